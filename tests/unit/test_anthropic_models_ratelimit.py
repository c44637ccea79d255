"""Anthropic's shapes beside OpenAI's: ``GET /v1/models`` with ``anthropic-version`` (Anthropic's page and
its pagination), and the ``anthropic-ratelimit-*`` headers of the Messages API's answers and 429s."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from shepherd.auth.principal import PRINCIPAL_KEY, Principal
from shepherd.mesh.ratelimit import Quota
from shepherd.node.api.admin import anthropic_models
from shepherd.node.api.admission import Admission, RateLimited, anthropic_quota_headers
from shepherd.node.config import RateLimitRule
from shepherd.node.openai.requests import parse_chat

NAMES = ["m1", "m2", "m3", "m4", "m5"]


class _Gateway:
    started_at = 1_700_000_000.4

    def context_length(self, name: str) -> int:
        return 8192


def _page(query: str = "", names: list[str] = NAMES) -> tuple[int, dict[str, Any]]:
    req = make_mocked_request("GET", "/v1/models" + query, headers={"anthropic-version": "2023-06-01"})
    resp = anthropic_models(req, _Gateway(), names)  # type: ignore[arg-type]
    assert resp.headers.get("request-id")
    assert isinstance(resp.body, bytes)
    return resp.status, orjson.loads(resp.body)


def _ids(body: dict[str, Any]) -> list[str]:
    return [m["id"] for m in body["data"]]


def test_model_info_shape() -> None:
    status, body = _page()
    assert status == 200 and _ids(body) == NAMES
    assert body["has_more"] is False and body["first_id"] == "m1" and body["last_id"] == "m5"
    info = body["data"][0]
    assert info["type"] == "model" and info["display_name"] == "m1"
    assert info["created_at"] == "2023-11-14T22:13:20Z"  # RFC 3339 of when the node started
    assert info["lifecycle"] == "active" and info["max_input_tokens"] == 8192


def test_pagination_as_anthropic_documents_it() -> None:
    _, p1 = _page("?limit=2")
    assert _ids(p1) == ["m1", "m2"] and p1["has_more"] is True and p1["last_id"] == "m2"
    _, p2 = _page("?limit=2&after_id=m2")
    assert _ids(p2) == ["m3", "m4"] and p2["has_more"] is True
    _, p3 = _page("?limit=2&after_id=m4")
    assert _ids(p3) == ["m5"] and p3["has_more"] is False
    _, b1 = _page("?limit=2&before_id=m5")
    assert _ids(b1) == ["m3", "m4"] and b1["has_more"] is True and b1["first_id"] == "m3"
    _, b2 = _page("?limit=2&before_id=m2")
    assert _ids(b2) == ["m1"] and b2["has_more"] is False
    _, empty = _page("?after_id=m5")
    assert empty == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    _, active = _page("?lifecycle[]=active&lifecycle[]=retired")
    assert _ids(active) == NAMES
    _, retired = _page("?lifecycle[]=retired")
    assert _ids(retired) == []


@pytest.mark.parametrize(
    "query",
    ["?limit=0", "?limit=1001", "?limit=x", "?after_id=nope", "?after_id=m1&before_id=m3", "?lifecycle[]=x"],
)
def test_bad_parameters_are_400s_in_anthropics_envelope(query: str) -> None:
    status, body = _page(query)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"


def test_a_keys_list_is_what_is_paged() -> None:
    """The caller's own list (``may_use``) is what the handler pages: a cursor outside it is unknown."""
    status, body = _page("?after_id=m4", names=["m1", "m2"])
    assert status == 400
    _, body = _page("", names=["m2"])
    assert _ids(body) == ["m2"]


def test_anthropic_quota_headers() -> None:
    q = Quota(10, 7, 12.5, 1000, 900, 0.2)
    h = anthropic_quota_headers(q, 1_700_000_000.0)
    assert h == {
        "anthropic-ratelimit-requests-limit": "10",
        "anthropic-ratelimit-requests-remaining": "7",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:33Z",  # (rounded up to the second)
        "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "900",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:21Z",
    }
    assert anthropic_quota_headers(Quota(), 0.0) == {}


class _Clock:
    t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def _request(path: str) -> web.Request:
    req = make_mocked_request("POST", path)
    req[PRINCIPAL_KEY] = Principal("s", "t", "user")
    return req


async def test_guard_adds_anthropic_headers_on_the_messages_routes_only() -> None:
    a = Admission([RateLimitRule("*", None, rpm=2, tpm=1000)], node="n0", gen=1, clock=_Clock())
    sampling = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    ).sampling

    async def run() -> web.StreamResponse:
        return web.Response(text="ok")

    ok = await a.guard(_request("/v1/messages"), "m", 5, sampling, run)
    assert ok.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert ok.headers["anthropic-ratelimit-tokens-remaining"] == "985"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"  # (kept)
    chat = await a.guard(_request("/v1/chat/completions"), "m", 5, sampling, run)
    assert "x-ratelimit-remaining-requests" in chat.headers
    assert not any(k.startswith("anthropic-") for k in chat.headers)
    refused = await a.guard(_request("/v1/messages"), "m", 5, sampling, run)
    assert refused.status == 429
    assert refused.headers["retry-after"] and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused.headers["anthropic-ratelimit-requests-limit"] == "2"
    with pytest.raises(RateLimited) as e:
        a.admit("t", "m", 5, 10)
    assert e.value.anthropic_headers["retry-after"] == e.value.headers["retry-after"]
