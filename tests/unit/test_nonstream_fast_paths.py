"""The short paths of a non-streamed chat request equal the general ones they stand in for: request
parsing without options, messages kept as sent, the reasoning side of a plain prompt, the final message
of a choice the parsers would pass through, per-model metric children, the lean server's resolved
targets and its serving task kept between requests, and the body read without a coroutine."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.api.common import GATEWAY, error_middleware
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import json_now, read_json
from shepherd.node.http.connection import _Conn
from shepherd.node.http.server import LeanServer
from shepherd.node.http.types import lean_request
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import CHAT_OPTION_KEYS, _parse_chat_options, parse_chat, parse_sampling
from shepherd.node.output.chat import ChatOutput, chat_message, reasoning_side
from shepherd.parsers import (
    REASONING_FAMILIES,
    prompt_closes_think,
    prompt_opens_think,
    thinking_enabled,
)
from shepherd.proto.openai_errors import ApiError

# ---- parse_chat ------------------------------------------------------------------------------------

_TEXT = st.text(alphabet="ab <>/\n", max_size=12)
_CONTENT = st.one_of(
    _TEXT,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2),
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": _CONTENT, "name": _TEXT},
)
_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 64),
        "temperature": st.floats(0, 2),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "stop": st.lists(_TEXT, max_size=2),
        "n": st.integers(1, 3),
    },
)


def _general(d: dict[str, Any]) -> Any:
    """parse_chat as it was, every option read: the model, the messages, the sampling, then the options."""
    from shepherd.node.openai.requests import _messages, _model

    keys = ("max_tokens", "max_completion_tokens")
    parts: dict[int, list[dict[str, str]]] = {}
    req = _parse_chat_options(d, _model(d), _messages(d, parts), parse_sampling(d, max_tokens_keys=keys))
    if parts:  # (several text parts: kept for a template that iterates over a message's content)
        req.text_parts = parts
    return req


@settings(max_examples=150, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=4), _SAMPLING)
def test_a_request_without_options_parses_as_the_general_path_does(
    messages: list[dict[str, Any]], sampling: dict[str, Any]
) -> None:
    d = {"model": "m", "messages": messages, **sampling}
    assert CHAT_OPTION_KEYS.isdisjoint(d)
    try:
        want = _general(d)
    except ApiError as e:
        with pytest.raises(ApiError) as got:
            parse_chat(d)
        assert got.value.body() == e.body()
        return
    assert parse_chat(d) == want


def test_messages_with_text_are_kept_as_sent_and_others_are_copies() -> None:
    sent: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief", "name": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": []},
        {"role": "assistant", "content": None},
    ]
    msgs: list[dict[str, Any]] = [dict(m) for m in sent]
    got = parse_chat({"model": "m", "messages": msgs}).messages
    assert got[0] is msgs[0] and got[0] == sent[0]
    assert got[1] == {"role": "user", "content": "a\nb"} and msgs[1] == sent[1]  # not written to
    assert got[2] == {"role": "assistant", "tool_calls": [], "content": None}
    assert list(got[2]) == ["role", "tool_calls", "content"]
    assert got[3] is msgs[3]
    copies = [{**m, "content": g["content"]} for m, g in zip(sent, got, strict=True)]
    assert orjson.dumps(got) == orjson.dumps(copies)  # what copying every message gave, key order included


@pytest.mark.parametrize(
    "options",
    [
        {"logprobs": True, "top_logprobs": 2},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"separate_reasoning": False},
        {"tool_choice": None},
        {"add_generation_prompt": False},
    ],
)
def test_a_request_with_options_takes_the_general_path(options: dict[str, Any]) -> None:
    d = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **options}
    assert parse_chat(d) == _general(d)


# ---- the reasoning side and the final message -------------------------------------------------------

_MARKED = st.lists(
    st.sampled_from(["<think>", "</think>", "<tool_call>", " ", "\n", "x", "answer", "<", "</", "<th"]),
    max_size=8,
).map("".join)


def _side_general(family: str | None, separate: bool, kwargs: dict[str, Any], prompt: str) -> Any:
    if family == "gpt_oss" and not separate:  # harmony is markup: parsed all the same (its reasoning dropped)
        return family, False
    if family and separate and thinking_enabled(family, kwargs) and not prompt_closes_think(family, prompt):
        return family, prompt_opens_think(family, prompt)
    return None, False


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([None, "", *REASONING_FAMILIES]),
    st.booleans(),
    st.sampled_from([{}, {"enable_thinking": False}, {"enable_thinking": True}, {"thinking": True}]),
    st.sampled_from(["", "x" * 5000]),
    _MARKED,
    st.sampled_from(["", "x" * 5000]),
    _MARKED,
)
def test_the_reasoning_side_is_the_registrys(
    family: str | None, separate: bool, kwargs: dict[str, Any], a: str, b: str, c: str, d: str
) -> None:
    prompt = a + b + c + d
    req = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "separate_reasoning": separate,
            "chat_template_kwargs": kwargs,
        }
    )
    assert reasoning_side(family, req, prompt) == _side_general(family, separate, kwargs, prompt)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(REASONING_FAMILIES)), st.booleans(), _MARKED)
def test_the_final_message_is_what_the_parsers_make_of_the_text(family: str, opened: bool, text: str) -> None:
    out = ChatOutput(family, opened, None, (), True)
    message, parsed = out.message(text)
    want = chat_message(out.choice().whole(text), True)
    assert message == want
    assert list(message) == list(want)
    if parsed is not None:
        assert chat_message(parsed, True) == want


def test_the_final_message_with_a_tool_parser_takes_the_parsers() -> None:
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    out = ChatOutput("qwen3", False, "hermes", tools, True)
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    message, parsed = out.message(text)
    assert parsed is not None and parsed.calls
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "f"


# ---- metrics ------------------------------------------------------------------------------------------


def test_per_model_children_and_request_counts_are_the_families() -> None:
    a, b = NodeMetrics(), NodeMetrics()
    for m in (a, b):
        m.overhead.observe(0.001)
    for model, status in (("q", 200), ("q", 200), ("r", 404), ("q", 500)):
        a.count_request("/v1/chat/completions", model, status)
        b.requests.labels("/v1/chat/completions", model, str(status)).inc()
        mm = a.for_model(model, "chat")
        mm.ttft.observe(0.01)
        mm.e2e.observe(0.2)
        mm.itl.observe(0.003)
        mm.prompt_tokens.value += 250
        mm.completion_tokens.value += 32
        b.ttft.labels(model, "chat").observe(0.01)
        b.e2e.labels(model, "chat").observe(0.2)
        b.itl.labels(model, "chat").observe(0.003)
        b.tokens.labels(model, "prompt", "chat").inc(250)
        b.tokens.labels(model, "completion", "chat").inc(32)
    assert a.for_model("q", "chat") is a.for_model("q", "chat")
    assert a.render() == b.render()
    assert a.for_model("q", "chat") is not a.for_model("q", "responses")


# ---- the lean server -----------------------------------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False
        self.wrote = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.out.append(data)
        self.wrote.set()

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def _hello(request: web.Request) -> web.Response:
    lean = lean_request(request)
    assert lean is not None
    body = {"path": request.path, "qs": request.query_string, "raw": lean.raw_path, "method": request.method}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _item(request: web.Request) -> web.Response:
    return web.json_response({"id": request.match_info["item_id"]})


async def _json(request: web.Request) -> web.Response:
    got = json_now(request, 64)
    want = await read_json(request, 64)
    assert got == want
    return web.json_response({"ok": True})


def _app() -> web.Application:
    from types import SimpleNamespace

    gw = SimpleNamespace(cfg=NodeConfig(), metrics=NodeMetrics(), in_flight=0)
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app.add_routes([web.get("/hello", _hello), web.get("/items/{item_id}", _item), web.post("/json", _json)])
    return app


async def _ask(conn: _Conn, t: _Transport, wire: bytes) -> bytes:
    t.wrote.clear()
    conn.data_received(wire)
    await asyncio.wait_for(t.wrote.wait(), 10.0)
    return t.out[-1]


def _fixed(answer: bytes) -> list[bytes]:
    """An answer's lines without the per-request ones (its id and the gateway's time)."""
    return [ln for ln in answer.split(b"\r\n") if not ln.startswith((b"x-request-id:", b"x-smg-gateway-ms:"))]


async def test_targets_are_resolved_once_and_only_static_routes_without_a_query_are_kept() -> None:
    app = _app()
    runner = web.AppRunner(app)
    await runner.setup()
    srv = LeanServer(app, max_body=1024)
    t = _Transport()
    conn = _Conn(srv)
    conn.connection_made(t)  # type: ignore[arg-type]
    try:
        answers = []
        for target in ("/hello", "/hello", "/h%65llo", "/hello?a=1", "/items/7", "/nope", "/nope"):
            wire = b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % target.encode()
            answers.append(await _ask(conn, t, wire))
        bodies = [a.partition(b"\r\n\r\n")[2] for a in answers]
        assert orjson.loads(bodies[0]) == orjson.loads(bodies[1])
        assert orjson.loads(bodies[0]) == {"path": "/hello", "qs": "", "raw": "/hello", "method": "GET"}
        assert orjson.loads(bodies[2]) == {"path": "/hello", "qs": "", "raw": "/h%65llo", "method": "GET"}
        assert orjson.loads(bodies[3])["qs"] == "a=1"
        assert orjson.loads(bodies[4]) == {"id": "7"}
        assert answers[5].startswith(b"HTTP/1.1 404") and _fixed(answers[6]) == _fixed(answers[5])
        assert b"x-request-id: " in answers[5] and b"x-smg-gateway-ms: " in answers[5]
        assert set(srv.targets) == {(b"GET", b"/hello"), (b"GET", b"/h%65llo")}
        head = b"HEAD /hello HTTP/1.1\r\nHost: t\r\n\r\n"
        assert (await _ask(conn, t, head)).startswith(b"HTTP/1.1 200")  # another method: its own entry
        assert (b"HEAD", b"/hello") in srv.targets
        body = b'{"model": "m"}'
        post = (
            b"POST /json HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert (await _ask(conn, t, post)).startswith(b"HTTP/1.1 200")
    finally:
        conn.connection_lost(None)
        await runner.cleanup()


async def test_one_task_serves_a_keep_alive_connection_and_ends_with_it() -> None:
    app = _app()
    runner = web.AppRunner(app)
    await runner.setup()
    srv = LeanServer(app, max_body=1024)
    wire = b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n"
    try:
        t = _Transport()
        conn = _Conn(srv)
        conn.connection_made(t)  # type: ignore[arg-type]
        await _ask(conn, t, wire)
        runner_task = conn._runner
        assert runner_task is not None and conn.task is None  # idle, its task waiting for more
        await _ask(conn, t, wire)
        assert conn._runner is runner_task and len(t.out) == 2
        conn.connection_lost(None)
        await asyncio.sleep(0)
        assert runner_task.done()

        t2 = _Transport()  # an idle connection closed by the server (shutdown, keep-alive sweep)
        conn2 = _Conn(srv)
        conn2.connection_made(t2)  # type: ignore[arg-type]
        await _ask(conn2, t2, wire)
        task2 = conn2._runner
        assert conn2.idle_close(None) and t2.closing
        await asyncio.sleep(0)
        assert task2 is not None and task2.done()

        t3 = _Transport()  # Connection: close ends the task with the answer
        conn3 = _Conn(srv)
        conn3.connection_made(t3)  # type: ignore[arg-type]
        await _ask(conn3, t3, b"GET /hello HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        await asyncio.sleep(0)
        assert conn3._runner is not None and conn3._runner.done() and t3.closing
    finally:
        await runner.cleanup()
