"""The Responses API's pure parts and one in-process route: request parsing (``parse_responses``), the
Response builder and the streamed event encoder (``ResponseEvents``), and a store that cannot be reached
before generation (503 with Retry-After, the engine never asked)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shepherd.auth.principal import PRINCIPAL_KEY, Principal
from shepherd.node.api import responses as api_responses
from shepherd.node.api.common import ADMISSION, GATEWAY, HISTORY, History, error_middleware
from shepherd.node.cluster.history import OwnerGone
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import parse_metadata
from shepherd.node.openai.responses import parse_responses
from shepherd.node.output.responses import ResponseEvents, response_object
from shepherd.proto.openai_errors import ApiError
from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import StorageUnavailable, StoredItem, StoredResponse

_ids = itertools.count(1)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):048x}"


# ---- parse_responses -------------------------------------------------------------------------------------


def test_defaults_and_echo() -> None:
    r = parse_responses({"model": "m", "input": "hi"})
    assert r.store is True and r.parallel_tool_calls is True and r.stream is False and r.background is False
    assert r.truncation == "disabled" and r.text == {"format": {"type": "text"}} and r.response_format is None
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.tools is None and r.tool_choice_echo == "auto"
    assert r.sampling.max_tokens is None


def test_tools_text_format_and_sampling() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_responses(
        {
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "name": "f", "parameters": schema}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
            "max_output_tokens": 32,
            "temperature": 0.5,
            "reasoning": {"effort": "none"},
            "conversation": {"id": "conv_1"},
        }
    )
    assert r.tools == [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    assert r.tool_choice.mode == "function" and r.tool_choice.name == "f"
    assert r.tool_choice_echo == {"type": "function", "name": "f"}
    assert r.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    assert r.text["format"]["type"] == "json_schema"
    assert r.sampling.max_tokens == 32 and r.sampling.temperature == 0.5
    assert r.template_kwargs == {"enable_thinking": False} and r.conversation_id == "conv_1"


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": "x"}, "model", 400),
        ({"model": "m"}, "input", 400),
        (
            {"model": "m", "input": "x", "previous_response_id": "resp_1", "conversation": "conv_1"},
            "conversation",
            400,
        ),
        ({"model": "m", "input": "x", "background": True, "store": False}, "background", 400),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", 400),
        ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice", 400),
        (
            {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            400,
        ),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature", 400),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", 400),
        ({"model": "m", "input": "x", "truncation": "sometimes"}, "truncation", 400),
        ({"model": "m", "input": 5}, "input", 400),
        ({"model": "m", "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", 400),
        ({"model": "m", "input": "x", "service_tier": "turbo"}, "service_tier", 400),
        ({"model": "m", "input": "x", "text": {"verbosity": "loud"}}, "text.verbosity", 400),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", 400),
        (
            {"model": "m", "input": "x", "tools": [{"type": "function", "name": "<|im_end|>"}]},
            "tools[0].name",
            400,
        ),
        (
            {"model": "m", "input": "x", "tools": [{"type": "function", "name": "x" * 129}]},
            "tools[0].name",
            400,
        ),
    ],
)
def test_refusals(body: dict[str, Any], param: str, status: int) -> None:
    with pytest.raises(ApiError) as ei:
        parse_responses(body)
    assert ei.value.status == status and ei.value.param == param


def test_metadata_bounds() -> None:
    assert parse_metadata({"a": "b"}) == {"a": "b"}
    for bad_md, code in (
        ({str(i): "v" for i in range(17)}, "object_above_max_properties"),
        ({"k" * 65: "v"}, "string_above_max_length"),
        ({"k": "v" * 513}, "string_above_max_length"),
        ({"k": 1}, "invalid_type"),
    ):
        with pytest.raises(ApiError) as ei:
            parse_metadata(bad_md)
        assert ei.value.code == code


# ---- the Response and its events -------------------------------------------------------------------------


def test_output_items_order_and_shapes() -> None:
    # a non-streamed answer's items: the stream's encoder, quiet (no bytes), keeps the items it made
    enc = ResponseEvents({"id": "resp_1"}, _new_id, quiet=True)
    made = [
        enc.role(0),
        enc.reasoning(0, "think"),
        enc.content(0, "hi"),
        enc.tool_call(0, 0, "call_1", "f"),
        enc.tool_args(0, 0, "{}"),
        enc.finish(0, "tool_calls"),
    ]
    assert made == [b""] * len(made)
    out = enc.items
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "think"}] and out[0]["summary"] == []
    assert out[1]["content"] == [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]
    assert out[2]["call_id"] == "call_1" and out[2]["id"].startswith("fc_") and out[2]["arguments"] == "{}"
    assert {o["status"] for o in out} == {"completed"}
    r = response_object({"id": "resp_1"}, status="incomplete", output=out, usage=None, finish_reason="length")
    assert r["incomplete_details"] == {"reason": "max_output_tokens"} and r["status"] == "incomplete"


def _parse_sse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        head, body = block.split("\n", 1)
        assert head.startswith("event: ") and body.startswith("data: ")
        payload = json.loads(body[6:])
        assert payload["type"] == head[7:]
        out.append((head[7:], payload))
    return out


def test_event_encoder_sequence_and_order() -> None:
    enc = ResponseEvents({"id": "resp_1", "object": "response"}, _new_id)
    chunks = [
        enc.role(0),
        enc.reasoning(0, "Hmm"),
        enc.reasoning(0, "."),
        enc.content(0, "Hel"),
        enc.content(0, "lo"),
        enc.content(0, ""),  # a logprobs-only step: nothing
        enc.tool_call(0, 0, "call_9", "f"),
        enc.tool_args(0, 0, '{"a":'),
        enc.tool_args(0, 0, "1}"),
        enc.finish(0, "tool_calls"),
    ]
    resp = enc.final({"input_tokens": 1})
    chunks.append(enc.terminal(resp))
    events = _parse_sse(b"".join(chunks))
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert [k for k, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    by_kind = {k: p for k, p in events}
    assert by_kind["response.output_text.done"]["text"] == "Hello"
    assert by_kind["response.output_text.done"]["output_index"] == 1
    assert by_kind["response.function_call_arguments.done"]["arguments"] == '{"a":1}'
    final = by_kind["response.completed"]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["status"] == "completed" and final["output"][2]["call_id"] == "call_9"
    assert final["status"] == "completed" and final["usage"] == {"input_tokens": 1}


def test_event_encoder_failure_and_incomplete() -> None:
    enc = ResponseEvents({"id": "resp_1"}, _new_id)
    data = enc.role(0) + enc.content(0, "x") + enc.failed("engine down", "engine_error")
    kinds = [k for k, _ in _parse_sse(data)]
    assert kinds[-4:] == [
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    enc2 = ResponseEvents({"id": "resp_2"}, _new_id)
    enc2.role(0)
    enc2.content(0, "x")
    enc2.finish(0, "length")
    [(kind, payload)] = _parse_sse(enc2.terminal(enc2.final(None)))
    assert (
        kind == "response.incomplete"
        and payload["response"]["incomplete_details"]["reason"] == "max_output_tokens"
    )


# ---- a store that cannot be reached: 503 before the engine ------------------------------------------------


class _DownStore(MemoryStore):
    async def get_chain(self, response_id: str, max_depth: int) -> list[Any]:
        raise StorageUnavailable("backend down", retry_after=2.5)


async def test_store_unavailable_before_generation_is_503() -> None:
    asked: list[str] = []

    def tokenizer(model: str) -> Any:
        return SimpleNamespace(vocab_size=100)

    async def render_and_encode(*a: Any, **kw: Any) -> Any:
        asked.append("render")
        raise AssertionError("rendered although the history could not be read")

    gw = SimpleNamespace(
        metrics=NodeMetrics(),
        in_flight=0,
        cfg=SimpleNamespace(max_body_bytes=1 << 20, history_chain_max_depth=10),
        resolve_model=lambda m: m,
        require_kind=lambda model, kind: None,
        relay_mode=lambda m: False,
        tokenizer=tokenizer,
        tokenizers=SimpleNamespace(render_and_encode=render_and_encode),
    )
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app[ADMISSION] = None
    app[HISTORY] = History(_DownStore(), "0" * 8)
    api_responses.install(app)
    async with TestClient(TestServer(app)) as client:
        r = await client.post(
            "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_" + "1" * 48}
        )
        body = await r.json()
        assert r.status == 503 and r.headers["Retry-After"] == "3"
        assert body["error"]["code"] == "storage_unavailable"
        # the store now known down: a turn to be stored is refused before any engine work (its answer
        # could not be kept), though it reads nothing from the store first
        r = await client.post("/v1/responses", json={"model": "m", "input": "y"})
        assert r.status == 503 and (await r.json())["error"]["code"] == "storage_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
        r = await client.get("/v1/responses/resp_nope")
        assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"
    assert asked == []


class _OwnerGoneStore(MemoryStore):
    """An embedded store in a mesh whose conversation's owner node is dead (``RoutedStore``'s answer)."""

    async def get_conversation(self, conversation_id: str) -> Any:
        raise OwnerGone("the node 'b' that owns this record is dead: its records are unreachable")


async def test_a_turn_on_a_conversation_whose_owner_is_gone_is_owner_unavailable() -> None:
    """README "Responses, Conversations and history storage": an owner gone is a 404 ``owner_unavailable``,
    as a read of the conversation answers, not ``conversation_not_found`` (the client would take the
    conversation for deleted while it is only on a node that is down)."""
    gw = SimpleNamespace(
        metrics=NodeMetrics(),
        in_flight=0,
        cfg=SimpleNamespace(max_body_bytes=1 << 20, history_chain_max_depth=10, request_timeout_secs=60.0),
        resolve_model=lambda m: m,
        require_kind=lambda model, kind: None,
        relay_mode=lambda m: False,
        tokenizer=lambda model: SimpleNamespace(vocab_size=100),
    )
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app[ADMISSION] = None
    app[HISTORY] = History(_OwnerGoneStore(), "0" * 8)
    api_responses.install(app)
    async with TestClient(TestServer(app)) as client:
        for stream in (False, True):
            r = await client.post(
                "/v1/responses",
                json={"model": "m", "input": "x", "conversation": "conv_" + "1" * 48, "stream": stream},
            )
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == "owner_unavailable", body


async def test_owner_sees_others_get_404() -> None:

    store = MemoryStore()
    item = StoredItem(
        "msg_1", "message", {"id": "msg_1", "type": "message", "role": "user", "content": []}, 1.0
    )
    body = {"id": "resp_a", "object": "response", "status": "completed", "output": [], "background": False}
    callers = {
        "alice": Principal("alice", "t", "user", method="api_key"),
        "bob": Principal("bob", "t", "user", method="api_key"),
        "root": Principal("root", "t", "admin", method="api_key"),
        "alice-token": Principal("alice", "t", "user", method="jwt"),  # the same name, another source
        "alice-elsewhere": Principal("alice", "u", "user", method="api_key"),  # another tenant
    }
    owner = callers["alice"].owner
    await store.put_response(
        StoredResponse("resp_a", 1.0, "m", body, input_item_ids=("msg_1",), owner=owner), [item]
    )

    @web.middleware
    async def as_caller(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        request[PRINCIPAL_KEY] = callers[request.headers["x-caller"]]
        return await handler(request)

    gw = SimpleNamespace(metrics=NodeMetrics(), in_flight=0)
    app = web.Application(middlewares=[error_middleware, as_caller])
    app[GATEWAY] = cast(Gateway, gw)
    app[HISTORY] = History(store, "0" * 8)
    api_responses.install(app)
    async with TestClient(TestServer(app)) as client:
        for who, status in (
            ("alice", 200),
            ("root", 200),
            ("bob", 404),
            ("alice-token", 404),
            ("alice-elsewhere", 404),
        ):
            h = {"x-caller": who}
            assert (await client.get("/v1/responses/resp_a", headers=h)).status == status
            assert (await client.get("/v1/responses/resp_a/input_items", headers=h)).status == status
        r = await client.post("/v1/responses/resp_a/cancel", headers={"x-caller": "alice"})
        assert r.status == 400  # not a background response
        assert (await client.delete("/v1/responses/resp_a", headers={"x-caller": "bob"})).status == 404
        r = await client.delete("/v1/responses/resp_a", headers={"x-caller": "alice"})
        assert await r.json() == {"id": "resp_a", "object": "response.deleted", "deleted": True}
        assert (await client.get("/v1/responses/resp_a", headers={"x-caller": "alice"})).status == 404


_TWO_TOOLS: Any = [
    {"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}} for n in ("a", "b")
]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "function": {"name": "a"}}]},
        {"type": "allowed_tools", "mode": "auto", "tools": ["a"]},
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "c"}]},
        {"type": "allowed_tools", "mode": "any", "tools": [{"type": "function", "name": "a"}]},
        {"type": "allowed_tools", "mode": "auto", "tools": []},
        {"type": "allowed_tools", "mode": "auto"},
    ],
)
def test_a_malformed_allowed_tools_choice_is_a_400_on_tool_choice(choice: Any) -> None:
    """The Responses API's flat shape only (the nested Chat Completions one is refused here), tools the
    request gave, a known mode, a non-empty list."""
    with pytest.raises(ApiError) as e:
        parse_responses({"model": "m", "input": "hi", "tools": _TWO_TOOLS, "tool_choice": choice})
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_allowed_tools_keeps_the_listed_tools_and_echoes_the_choice() -> None:
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}
    req = parse_responses({"model": "m", "input": "hi", "tools": _TWO_TOOLS, "tool_choice": choice})
    assert req.tool_choice.mode == "required" and req.tool_choice_echo == choice
    assert [t["function"]["name"] for t in req.tools or ()] == ["b"]
    assert [t["name"] for t in req.tools_echo] == ["a", "b"]
