"""End to end: rate limits on a real node (mock engine on loopback), seen through the openai SDK.

Tenants come from the ``x-smg-tenant`` header, which the node trusts only with
``--auth-trust-tenant-header`` (the auth layer's switch for tests and trusted fronts)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from shepherd.node.config import EMBEDDED_MODEL_DIR
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

CONFIG = """
models:
  - {{name: qwen3, model_path: "{path}", worker_urls: ["grpc://127.0.0.1:{grpc}"]}}
  - {{name: relayed, model_path: "{path}", worker_urls: ["http://127.0.0.1:{http}"]}}
rate_limits:
  - {{tenant: "*", rpm: 3}}
  - {{tenant: tok, tpm: 2000}}
  - {{tenant: slow, max_concurrent: 1}}
  - {{tenant: gen, tpm: 2000}}
"""
MSGS: list[Any] = [{"role": "user", "content": "Say something."}]
HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
)
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "20", "--output-len", "8") as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc) -> Iterator[NodeProc]:
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "node.yaml"
        cfg.write_text(CONFIG.format(path=EMBEDDED_MODEL_DIR, grpc=engine.grpc_port, http=engine.http_port))
        with running_node("--config", str(cfg), "--auth-trust-tenant-header") as n:
            yield n


def client(node: NodeProc, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=node.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=30,
        default_headers={"x-smg-tenant": tenant},
    )


def test_requests_per_minute_answer_429_in_openai_style(node: NodeProc) -> None:
    alpha = client(node, "alpha")
    for left in (2, 1, 0):
        raw = alpha.chat.completions.with_raw_response.create(model="qwen3", messages=MSGS, max_tokens=4)
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError) as ei:
        alpha.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
    e = ei.value
    assert e.status_code == 429
    assert e.code == "rate_limit_exceeded" and e.type == "requests"  # (OpenAI's: "tokens" for TPM)
    h = e.response.headers
    assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "0"
    assert "alpha" in e.message
    # the completions endpoint shares the tenant's count
    with pytest.raises(openai.RateLimitError):
        alpha.completions.create(model="qwen3", prompt="Hello", max_tokens=4)
    # another tenant is untouched by alpha's flood
    raw = client(node, "beta").chat.completions.with_raw_response.create(
        model="qwen3", messages=MSGS, max_tokens=4
    )
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"


def test_streamed_responses_carry_the_headers(node: NodeProc) -> None:
    raw = client(node, "gamma").chat.completions.with_raw_response.create(
        model="qwen3", messages=MSGS, max_tokens=4, stream=True
    )
    assert all(k in raw.headers for k in HEADERS)
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)


def test_tokens_are_reserved_then_settled(node: NodeProc) -> None:
    tok = client(node, "tok")
    raw = tok.chat.completions.with_raw_response.create(model="qwen3", messages=MSGS, max_tokens=1500)
    r1 = raw.parse()
    assert r1.usage is not None
    prompt, used1 = r1.usage.prompt_tokens, r1.usage.total_tokens
    assert all(k in raw.headers for k in TOKEN_HEADERS)
    assert "x-ratelimit-limit-requests" not in raw.headers  # tok has no requests limit
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(2000 - (prompt + 1500))
    # the first request settled at its real usage, so a second 1500-token reservation fits
    raw = tok.chat.completions.with_raw_response.create(model="qwen3", messages=MSGS, max_tokens=1500)
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(2000 - used1 - (prompt + 1500))
    used2 = raw.parse().usage.total_tokens  # type: ignore[union-attr]
    too_many = 2000 - used1 - used2 - prompt + 1  # one token more than the headroom left
    with pytest.raises(openai.RateLimitError) as ei:
        tok.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=too_many)
    assert "tokens per min" in ei.value.message and "retry-after" in ei.value.response.headers
    assert ei.value.type == "tokens"  # OpenAI's type of a TPM refusal
    with pytest.raises(openai.RateLimitError) as ei:
        tok.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=2500)
    assert "too large" in ei.value.message and "retry-after" not in ei.value.response.headers


@contextlib.contextmanager
def holding_the_slot(node: NodeProc, tenant: str) -> Iterator[None]:
    """Inside: a stream of about 20 s for ``tenant`` runs on ``node`` (its first chunk is in), holding a
    concurrency slot of the tenant's; on exit the client hangs up."""
    body = {
        "model": "qwen3",
        "messages": MSGS,
        "max_tokens": 1000,  # 1000 tokens at 20 ms: a stream of about 20 s
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST", node.url + "/v1/chat/completions", json=body, headers={"x-smg-tenant": tenant}
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep it: a dropped generator closes the stream (a disconnect)
        assert next(lines).startswith("data:")  # the stream runs: the slot is taken
        yield


def wait_admitted(c: openai.OpenAI, what: str) -> None:
    """Send a small request until it is not refused (bounded: 10 s, long before a held 20 s stream ends)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, what
            time.sleep(0.1)


def test_concurrency_is_released_when_the_client_goes_away(node: NodeProc) -> None:
    slow = client(node, "slow")
    with holding_the_slot(node, "slow"):  # the tenant's only slot is taken
        with pytest.raises(openai.RateLimitError) as ei:
            slow.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        assert "concurrent" in ei.value.message
    # the client hung up: the node aborts the request and gives the slot back
    wait_admitted(slow, "the concurrency slot was not released")


def test_relayed_requests_are_limited_too(node: NodeProc) -> None:
    relay = client(node, "relay")
    raw = relay.chat.completions.with_raw_response.create(model="relayed", messages=MSGS, max_tokens=4)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    streamed = relay.chat.completions.with_raw_response.create(
        model="relayed", messages=MSGS, max_tokens=4, stream=True
    )
    assert streamed.headers["x-ratelimit-remaining-requests"] == "1"  # a relayed stream carries them too
    assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    legacy = relay.completions.with_raw_response.create(model="relayed", prompt="Hello", max_tokens=4)
    assert legacy.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        relay.chat.completions.create(model="relayed", messages=MSGS, max_tokens=4)


def test_background_responses_carry_the_headers(node: NodeProc) -> None:
    """A background response is admitted as any answer: its queued object (and the SSE answer of a
    streamed one) carries the x-ratelimit-* headers too."""
    bg = client(node, "bg")
    raw = bg.responses.with_raw_response.create(
        model="qwen3", input="Hi", max_output_tokens=4, background=True
    )
    assert raw.parse().status in ("queued", "in_progress")
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    with httpx.stream(
        "POST",
        node.url + "/v1/responses",
        json={"model": "qwen3", "input": "Hi", "max_output_tokens": 4, "background": True, "stream": True},
        headers={"x-smg-tenant": "bg"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-remaining-requests"] == "1"
        assert "response.incomplete" in r.read().decode()  # (max_output_tokens reached)


def test_native_generate_is_settled_with_its_usage_and_streams_the_headers(node: NodeProc) -> None:
    """SGLang's /generate reserves prompt + max_new_tokens as the OpenAI routes do and is settled with
    what it used (it kept the whole reservation: a second call of 1,500 tokens was refused with 2,000 a
    minute), and its streamed answer carries the x-ratelimit-* headers."""
    h = {"x-smg-tenant": "gen"}
    body: dict[str, Any] = {"model": "qwen3", "text": "Hi", "sampling_params": {"max_new_tokens": 1500}}
    r = httpx.post(node.url + "/generate", json=body, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    prompt, used = meta["prompt_tokens"], meta["prompt_tokens"] + meta["completion_tokens"]
    assert r.headers["x-ratelimit-remaining-tokens"] == str(2000 - (prompt + 1500))
    with httpx.stream(
        "POST", node.url + "/generate", json={**body, "stream": True}, headers=h, timeout=30
    ) as s:
        assert s.status_code == 200
        assert s.headers["x-ratelimit-limit-tokens"] == "2000"
        assert s.headers["x-ratelimit-remaining-tokens"] == str(2000 - used - (prompt + 1500))
        assert "[DONE]" in s.read().decode()


# a schema the model lookup and admission come before (meta-validated under admission): a 400 after it
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": 12}}}
OPENAI_AFTER_ADMISSION: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
    ),
    "chat-stream": (
        "chat",
        {
            "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}},
        },
    ),
    "responses": (
        "responses",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
    ),
    "responses-background": (
        "responses",
        {"background": True, "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
    ),
    "responses-background-stream": (
        "responses",
        {
            "background": True,
            "stream": True,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
        },
    ),
}


@pytest.mark.parametrize("case", sorted(OPENAI_AFTER_ADMISSION))
def test_an_error_after_admission_carries_the_headers_and_counts_once(node: NodeProc, case: str) -> None:
    """A request refused after it was admitted (here its schema, meta-validated under admission) was
    counted: its error carries the x-ratelimit-* headers as OpenAI's do, and it counts once (a
    background response's error had none)."""
    c = client(node, f"after-{case}")
    route, extra = OPENAI_AFTER_ADMISSION[case]
    with pytest.raises(openai.BadRequestError) as ei:
        if route == "chat":
            c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4, **extra)
        else:
            c.responses.create(model="qwen3", input="Hi", max_output_tokens=16, **extra)
    h = ei.value.response.headers
    assert "schema" in ei.value.message
    assert h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    raw = c.chat.completions.with_raw_response.create(model="qwen3", messages=MSGS, max_tokens=4)
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"  # the refused request counted once


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_error_after_admission_carries_both_headers(node: NodeProc, stream: bool) -> None:
    """The Messages API's error after admission: Anthropic's envelope with its anthropic-ratelimit-*
    beside the x-ratelimit-*, streamed or not, counted once."""
    tenant = f"after-messages-{stream}"
    with anthropic.Anthropic(
        base_url=node.url,
        api_key="unused",
        max_retries=0,
        timeout=30,
        default_headers={"x-smg-tenant": tenant},
    ) as c:
        fmt = {"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}
        with pytest.raises(anthropic.BadRequestError) as ei:
            c.messages.create(model="qwen3", max_tokens=4, messages=MSGS, stream=stream, extra_body=fmt)
        assert ei.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        h = ei.value.response.headers
        assert h["anthropic-ratelimit-requests-limit"] == "3"
        assert h["anthropic-ratelimit-requests-remaining"] == "2"
        assert h["anthropic-ratelimit-requests-reset"].endswith("Z")
        assert h["x-ratelimit-remaining-requests"] == "2"
        raw = c.messages.with_raw_response.create(model="qwen3", max_tokens=4, messages=MSGS)
        assert raw.headers["anthropic-ratelimit-requests-remaining"] == "1"
