"""The Messages and Responses answers, streamed and not, built from the same parser events: the same
blocks and items in generation order (text after a call stays after it), white space before a call
dropped in both (and in chat streams), the same item statuses, message items and logprobs. Engine
output is real qwen3 tokens through ``Generation`` (the stream by ``_drive``, the whole answer by the
API modules' own ``_respond``), read back with the anthropic and openai SDKs' stream accumulators.
Also: a Responses stream that fails opens with ``response.created`` (before the first token too, once
the keep-alive sent the headers), a failed or cut Response reports what OpenAI's would, and an engine
stream a failure ended is aborted with the failure's reason, not ``stop``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from shepherd.node.anthropic.messages import MessageEvents
from shepherd.node.anthropic.requests import parse_messages
from shepherd.node.api import messages as api_messages
from shepherd.node.api import responses as api_responses
from shepherd.node.api.common import KEEPALIVE_TICKER, History, KeepAlive
from shepherd.node.api.generation import Generation, Job
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import EngineFacts
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import parse_chat
from shepherd.node.openai.responses import parse_responses
from shepherd.node.openai.sse import ChatChunks
from shepherd.node.output.chat import ChatOutput, chat_message, shape_chat
from shepherd.node.output.choice import ChoiceState
from shepherd.node.output.responses import ResponseEvents
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineTimeout,
    TokenLogprob,
)
from shepherd.storage.memory import MemoryStore
from tests.unit.test_tokenizer_shared import qwen3

EOS = 151645  # <|im_end|>
PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
FAMILIES = ("qwen3", "hermes")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "tz": {"type": "string"}}}
NAMES = ("get_weather", "get_time")
BASE = api_responses._base(parse_responses({"model": "m", "input": "hi"}), "m", "resp_1", 1.0)
ANTHROPIC_EVENT = TypeAdapter[Any](RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter[Any](ResponseStreamEvent)


def tc(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


CALL = tc("get_weather", {"city": "Paris"})
CALL2 = tc("get_time", {"tz": "CET"})
WEATHER = ("tool_use", "get_weather", {"city": "Paris"})


def ids_of(text: str, eos: bool = True) -> list[int]:
    return qwen3().encode(text, add_special_tokens=False) + ([EOS] if eos else [])


def cut_ids(text: str, within: str) -> list[int]:
    """``text``'s tokens up to (not through) the end of its part ``within`` (a max_tokens cut in it)."""
    ids = ids_of(text, eos=False)
    end = text.index(within) + len(within) // 2
    for n in range(len(ids)):
        if len(qwen3().decode(ids[:n], skip_special_tokens=False)) >= end:
            return ids[:n]
    raise AssertionError("no cut")


# ---- a gateway and an engine, in-process ---------------------------------------------------------------


class _Engine:
    """An engine stream as the driver uses it (``EngineStream``'s batches / completed / close): its
    batches, then ``fail`` raised; the reasons it was aborted with."""

    def __init__(self, batches: list[list[EngineEvent]], fail: BaseException | None = None) -> None:
        self.events = batches
        self.fail = fail
        self.completed = False
        self.closed = False
        self.trace = None
        self.agen = None
        self.aborts: list[str] = []

    async def batches(self) -> AsyncIterator[list[EngineEvent]]:
        for b in self.events:
            await asyncio.sleep(0)
            yield b
        if self.fail is not None:
            raise self.fail

    async def close(self, reason: str = "cancelled") -> None:
        if self.closed:
            return
        self.closed = True
        if not self.completed:
            self.aborts.append(reason)


class _Gateway:
    def __init__(
        self, engine: _Engine | None = None, open_error: BaseException | None = None, delay: float = 0.0
    ) -> None:
        self.metrics = NodeMetrics()
        self.cfg = NodeConfig()
        self.registry = SimpleNamespace(workers={})  # (no worker URL to keep out of error texts)
        self.engine = engine
        self.open_error = open_error
        self.delay = delay

    def check_context(
        self, model: str, prompt: int, max_tokens: int | None, param: str = "", max_param: str = ""
    ) -> int:
        return max_tokens or 4096

    def context_length(self, model: str) -> int:
        return 4096

    def engine_facts(self, model: str, target: str | None = None) -> EngineFacts:
        return EngineFacts(None, False, False)  # (no sampling defaults reported)

    async def open_stream(
        self, model: str, gen: Any, target: Any = None, routing_key: Any = None, retry: Any = None
    ) -> Any:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.open_error is not None:
            raise self.open_error
        return self.engine

    def retry_midway(self, es: Any, e: BaseException, state: Any) -> bool:
        return False  # (one engine here: nothing to ask again)


class _Request(dict[str, Any]):
    """What ``Generation`` reads of a request off the HTTP server (headers, path, its labels)."""

    headers: ClassVar[dict[str, str]] = {}
    path = "/v1/test"


def stream_batches(
    ids: Sequence[int], reason: str = "stop", step: int = 1, lp: bool = False
) -> list[list[EngineEvent]]:
    out: list[list[EngineEvent]] = []
    for a in range(0, len(ids), step):
        piece = ids[a : a + step]
        out.append([EngineChunk(0, piece, logprobs=[TokenLogprob(t, -0.5) for t in piece] if lp else ())])
    out.append([EngineComplete(0, reason)])
    return out


def whole_engine(ids: Sequence[int], reason: str = "stop", lp: bool = False) -> _Engine:
    lps = [TokenLogprob(t, -0.5) for t in ids] if lp else []
    return _Engine([[EngineComplete(0, reason, output_ids=ids, logprobs=lps)]])


async def drive(g: Generation, job: Job, engine: _Engine, out: list[bytes] | None = None) -> bytes:
    """The streamed answer's bytes (into ``out`` as they come: a failure leaves them there)."""
    sent: list[bytes] = [] if out is None else out

    async def emit(chunks: list[bytes], last: bool = False) -> None:
        sent.extend(chunks)

    await g._drive(engine, job, emit)  # type: ignore[arg-type]
    return b"".join(sent)


def sse(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("event: "):
            head, data = block.split("\n", 1)
            ev = json.loads(data.removeprefix("data: "))
            assert head == f"event: {ev['type']}"
            out.append(ev)
    return out


# ---- the Messages API ------------------------------------------------------------------------------------


def _messages(stream: bool, engine: _Engine, thinking: bool = False, max_tokens: int = 2000) -> Any:
    d: dict[str, Any] = {
        "model": "m",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": n, "input_schema": SCHEMA} for n in NAMES],
        "stream": stream,
    }
    if thinking:
        d["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    req = parse_messages(d)
    tok = qwen3()
    shaping = shape_chat(FAMILIES, req.chat, PROMPT)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    events = MessageEvents("msg_1", "m", len(ids), req.stop_sequences) if stream else None
    g = Generation(
        _Request(),  # type: ignore[arg-type]
        _Gateway(engine),  # type: ignore[arg-type]
        "m",
        tok,
        shaping.sampling,
        chat=True,
        rid="msg_1",
        t0=0.0,
        logprobs=None,
        shaping=shaping,
        events=events,
    )
    return g, Job(ids, PROMPT, [ChoiceState(0, tok, shaping.sampling, ids)], 0), req, events


def _blocks(content: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for b in content:
        if b["type"] == "text":
            out.append(("text", b["text"]))
        elif b["type"] == "thinking":
            out.append(("thinking", b["thinking"]))
        else:
            out.append(("tool_use", b["name"], b["input"]))
    return out


async def messages_both(
    ids: Sequence[int], reason: str = "stop", thinking: bool = False
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(the non-streamed Message's blocks, the streamed one's as the anthropic SDK assembles them)."""
    g, job, req, _ = _messages(False, whole_engine(ids, reason), thinking)
    resp = await api_messages._respond(g, [job], "msg_1", req)
    assert isinstance(resp.body, bytes)
    whole = orjson.loads(resp.body)
    engine = _Engine(stream_batches(ids, reason))
    g, job, _, events = _messages(True, engine, thinking)
    raw = events.role(0) + await drive(g, job, engine) + await events.end(1, 1, 0)
    snap = None
    bufs: dict[int, bytes] = {}
    for ev in sse(raw):
        if ev["type"] not in ("ping", "error"):
            snap = accumulate_event(
                event=ANTHROPIC_EVENT.validate_python(ev), current_snapshot=snap, json_bufs=bufs
            )
    assert snap is not None
    streamed = snap.model_dump(mode="json")
    assert streamed["stop_reason"] == whole["stop_reason"]
    return _blocks(whole["content"]), _blocks(streamed["content"])


async def test_messages_text_after_a_call_stays_after_it() -> None:
    whole, streamed = await messages_both(ids_of(CALL + "\nDone here."))
    assert whole == streamed == [("tool_use", "get_weather", {"city": "Paris"}), ("text", "Done here.")]


async def test_messages_cut_in_a_second_call_keeps_generation_order() -> None:
    text = "Sure.\n" + CALL + "\n" + CALL2
    whole, streamed = await messages_both(cut_ids(text, CALL2), "length")
    assert whole == streamed
    assert [b[0] for b in whole] == ["text", "tool_use", "text"]
    assert whole[0] == ("text", "Sure.\n") and whole[2][1].startswith("<tool_call>")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("\n\n" + CALL, [WEATHER]),
        (CALL + "\n\n" + CALL2 + "\n", [WEATHER, ("tool_use", "get_time", {"tz": "CET"})]),
        ("Sure.\n\n" + CALL, [("text", "Sure.\n\n"), WEATHER]),
        ("\n\nHello", [("text", "\n\nHello")]),
        ("  \n", [("text", "  \n")]),
    ],
)
async def test_messages_white_space_before_a_call_is_dropped_in_both(
    text: str, want: list[tuple[Any, ...]]
) -> None:
    whole, streamed = await messages_both(ids_of(text))
    assert whole == streamed == want


async def test_messages_thinking_then_white_space_then_a_call() -> None:
    text = "<think>\nx\n</think>\n\n \n" + CALL
    whole, streamed = await messages_both(ids_of(text), thinking=True)
    assert whole == streamed == [("thinking", "x\n"), WEATHER]


def test_chat_streams_drop_white_space_before_a_call_as_the_whole_answer_does() -> None:
    tools = tuple({"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in NAMES)
    output = ChatOutput(None, False, "hermes", tools, True)
    cases = [("\n\n" + CALL, None), ("Sure.\n\n" + CALL, "Sure.\n\n"), ("\n \n" + CALL + "\nok", "ok")]
    for text, content in cases:
        assert chat_message(output.choice().whole(text), False)["content"] == content
        for step in (1, 3, len(text)):
            enc = ChatChunks("id", 0, "m")
            post = output.choice(enc, 0)
            out: list[bytes] = []
            for i in range(0, len(text), step):
                post.stream(text[i : i + step], None, out)
            post.stream_end(out)
            got = "".join(
                c["delta"].get("content") or ""
                for b in b"".join(out).decode().split("\n\n")
                if b.startswith("data: {")
                for c in json.loads(b[6:])["choices"]
            )
            assert got == (content or ""), (text, step)


# ---- the Responses API -----------------------------------------------------------------------------------


def _responses(
    stream: bool, engine: _Engine, *, max_output_tokens: int | None = None, logprobs: bool = False
) -> tuple[Generation, Job, api_responses.Turn, dict[str, Any], Any]:
    d: dict[str, Any] = {"model": "m", "input": "hi", "stream": stream, "store": False}
    d["tools"] = [{"type": "function", "name": n, "parameters": SCHEMA} for n in NAMES]
    if max_output_tokens:
        d["max_output_tokens"] = max_output_tokens
    if logprobs:
        d["include"] = ["message.output_text.logprobs"]
    req = parse_responses(d)
    chat = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": req.tools,
            "max_tokens": max_output_tokens,
            "logprobs": logprobs,
        }
    )
    tok = qwen3()
    shaping = shape_chat(FAMILIES, chat, PROMPT)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    hist = History(MemoryStore(), "0" * 8)
    turn = api_responses.Turn(hist, "resp_1", 1.0, "m", None, None, None, [], (), None)
    base = api_responses._base(req, "m", "resp_1", 1.0)
    job = Job(ids, PROMPT, [ChoiceState(0, tok, shaping.sampling, ids)], 0)
    events = api_responses._StoringEvents(base, turn, False, tok, job) if stream else None
    g = Generation(
        _Request(),  # type: ignore[arg-type]
        _Gateway(engine),  # type: ignore[arg-type]
        "m",
        tok,
        shaping.sampling,
        chat=True,
        rid="resp_1",
        t0=0.0,
        logprobs=0 if logprobs else None,
        shaping=shaping,
        events=events,
    )
    return g, job, turn, base, events


def sdk_final(raw: bytes) -> dict[str, Any]:
    """The openai SDK's ``responses.stream`` over these events: the final Response (it raises on a
    stream not opened by ``response.created``)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final: dict[str, Any] | None = None
    for ev in sse(raw):
        state.handle_event(RESPONSES_EVENT.validate_python(ev))
        if ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
            final = ev["response"]
    assert final is not None
    Response.model_validate(final)
    return final


def _items(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for o in output:
        if o["type"] == "message":
            [part] = o["content"]
            out.append(("message", o["status"], part["text"], len(part["logprobs"])))
        elif o["type"] == "reasoning":
            out.append(("reasoning", o["status"], o["content"][0]["text"]))
        else:
            out.append(("function_call", o["status"], o["name"], json.loads(o["arguments"])))
    return out


async def responses_both(
    ids: Sequence[int], reason: str = "stop", **kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the non-streamed Response, the streamed one as the SDK ends it)."""
    lp = bool(kw.get("logprobs"))
    g, job, turn, base, _ = _responses(False, whole_engine(ids, reason, lp), **kw)
    resp = await api_responses._respond(g, [job], turn, base, False)
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    whole = orjson.loads(resp.body)
    Response.model_validate(whole)
    engine = _Engine(stream_batches(ids, reason, lp=lp))
    g, job, _, _, events = _responses(True, engine, **kw)
    raw = events.role(0) + await drive(g, job, engine) + await events.end(1, 1, 0)
    streamed = sdk_final(raw)
    assert streamed["status"] == whole["status"]
    assert streamed["incomplete_details"] == whole["incomplete_details"]
    return whole, streamed


async def test_responses_text_after_a_call_stays_after_it() -> None:
    whole, streamed = await responses_both(ids_of(CALL + "\nDone here."))
    want = [
        ("function_call", "completed", "get_weather", {"city": "Paris"}),
        ("message", "completed", "Done here.", 0),
    ]
    assert _items(whole["output"]) == _items(streamed["output"]) == want


async def test_responses_cut_in_a_second_call_keeps_order_and_marks_the_cut_item() -> None:
    text = "Sure.\n" + CALL + "\n" + CALL2
    whole, streamed = await responses_both(cut_ids(text, CALL2), "length", max_output_tokens=30)
    assert _items(whole["output"]) == _items(streamed["output"])
    assert [(o[0], o[1]) for o in _items(whole["output"])] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "incomplete"),  # the item max_output_tokens cut
    ]
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_responses_white_space_before_a_call_is_no_message_item() -> None:
    whole, streamed = await responses_both(ids_of("\n\n" + CALL))
    assert _items(whole["output"]) == _items(streamed["output"])
    assert [o["type"] for o in whole["output"]] == ["function_call"]


async def test_responses_reasoning_cut_by_max_output_tokens_is_incomplete_in_both() -> None:
    text = "<think>\nLet me think about this for a while.\n</think>\n\nThe answer is four, of course."
    whole, streamed = await responses_both(cut_ids(text, "four, of course"), "length", max_output_tokens=30)
    assert _items(whole["output"]) == _items(streamed["output"])
    assert [(o[0], o[1]) for o in _items(whole["output"])] == [
        ("reasoning", "completed"),
        ("message", "incomplete"),
    ]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", []),  # an empty answer: no message item, in both
        ("<think>\nonly this\n</think>\n\n", [("reasoning", "completed", "only this\n")]),
    ],
)
async def test_responses_without_output_text_have_no_message_item(text: str, want: list[Any]) -> None:
    whole, streamed = await responses_both(ids_of(text))
    assert _items(whole["output"]) == _items(streamed["output"]) == want


async def test_responses_logprobs_agree_eos_included() -> None:
    text = "Hello there, world!"
    ids = ids_of(text)
    whole, streamed = await responses_both(ids, logprobs=True)
    assert _items(whole["output"]) == _items(streamed["output"]) == [("message", "completed", text, len(ids))]
    [part] = streamed["output"][0]["content"]
    assert part["logprobs"][-1]["token"] == "<|im_end|>"  # as the chat completions API keeps it


# ---- failures: the Responses stream's events, the stored Response ----------------------------------------


def test_a_failure_before_the_opening_events_sends_them_first() -> None:
    ev = ResponseEvents(BASE, lambda p: p + "_1")
    raw = ev.failed("worker is unavailable", "engine_error")
    events = sse(raw)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    assert sdk_final(raw)["status"] == "failed"


async def test_a_failed_stream_closes_the_cut_item_incomplete_and_reports_usage() -> None:
    ids = ids_of("Hello there, world! And more.", eos=False)
    fail = EngineError("engine connection closed", retryable=False)
    engine = _Engine(stream_batches(ids[:4])[:-1], fail=fail)
    g, job, _, _, events = _responses(True, engine)
    out = [events.role(0)]
    with pytest.raises(EngineError):
        await drive(g, job, engine, out)
    raw = b"".join(out) + g._failure(fail)
    final = sdk_final(raw)
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert [(o["type"], o["status"]) for o in final["output"]] == [("message", "incomplete")]
    assert final["usage"] is not None and final["usage"]["output_tokens"] == 4
    assert events.partial() == final["output"]  # what _stream stores


async def test_a_client_gone_stores_incomplete_with_an_openai_reason() -> None:
    store = MemoryStore()
    hist = History(store, "0" * 8)
    _, job, _, _, events = _responses(True, _Engine([]))
    turn = api_responses.Turn(hist, "resp_1", 1.0, "m", None, None, None, [], (), None)
    events.turn = turn
    events.role(0)
    events.content(0, "Hel")

    async def gone(jobs: list[Job]) -> web.StreamResponse:
        raise asyncio.CancelledError

    stub = SimpleNamespace(stream=gone)
    with pytest.raises(asyncio.CancelledError):
        await api_responses._stream(stub, [job], turn, events, True)  # type: ignore[arg-type]
    stored = await store.get_response("resp_1")
    assert stored is not None and stored.status == "incomplete"
    assert stored.body["incomplete_details"] == {"reason": None}
    Response.model_validate(stored.body)  # the SDK's enum: max_output_tokens / content_filter / None
    assert [o["status"] for o in stored.body["output"]] == ["incomplete"]


# ---- Generation.stream over HTTP: failures before and after the first token ------------------------------


async def _serve(
    gw: _Gateway, text_events: bool, interval: float = 15.0
) -> tuple[TestClient[web.Request, web.Application], KeepAlive]:
    tok = qwen3()
    ids = tok.encode(PROMPT, add_special_tokens=False)

    async def handler(request: web.Request) -> web.StreamResponse:
        chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        shaping = shape_chat(FAMILIES, chat, PROMPT)
        job = Job(ids, PROMPT, [ChoiceState(0, tok, shaping.sampling, ids)], 0)
        events = ResponseEvents(BASE, lambda p: p + "_1")
        g = Generation(
            request,
            gw,  # type: ignore[arg-type]
            "m",
            tok,
            shaping.sampling,
            chat=True,
            rid="resp_1",
            t0=0.0,
            logprobs=None,
            shaping=shaping,
            events=events if text_events else None,  # type: ignore[arg-type]
        )
        return await g.stream([job])

    app = web.Application()
    ka = KeepAlive(interval)
    app[KEEPALIVE_TICKER] = ka
    app.router.add_post("/v1/test", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    ka.start()
    return client, ka


async def _post(gw: _Gateway, text_events: bool = True, interval: float = 15.0) -> bytes:
    client, ka = await _serve(gw, text_events, interval)
    try:
        r = await client.post("/v1/test")
        assert r.status == 200
        return await r.read()
    finally:
        await ka.close()
        await client.close()


async def test_a_responses_stream_failing_before_its_first_token_opens_with_response_created() -> None:
    # the keep-alive ticker sent the headers with the opening events while the engine queued (as OpenAI
    # and vLLM send them before any token), then the worker went away
    gw = _Gateway(open_error=EngineError("worker abc is unavailable."), delay=0.4)
    raw = await _post(gw, interval=0.1)
    assert raw.startswith(b"event: response.created\n")
    kinds = [e["type"] for e in sse(raw)]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]
    sdk_final(raw)  # the SDK's stream takes it (it raised: 'Expected to have received response.created')


@pytest.mark.parametrize(
    ("fail", "reason"),
    [
        (EngineError("engine connection closed", retryable=False), "cancelled"),
        (EngineTimeout("engine timed out: 600 s"), "timeout"),
        (TimeoutError(), "timeout"),
    ],
)
@pytest.mark.parametrize("text_events", [True, False])
async def test_an_engine_failing_mid_stream_is_aborted_with_its_reason(
    fail: BaseException, reason: str, text_events: bool
) -> None:
    engine = _Engine(stream_batches(ids_of("Hello there", eos=False))[:-1], fail=fail)  # no Complete
    raw = await _post(_Gateway(engine), text_events)
    assert engine.aborts == [reason]  # smg_engine_aborts_total{reason}, the span's abort reason
    if text_events:
        assert [e["type"] for e in sse(raw)][-2:] == ["error", "response.failed"]
    else:
        assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n")


async def test_a_gateway_side_stop_is_still_stop_and_a_non_streamed_failure_not() -> None:
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["there"]})
    shaping = shape_chat((None, None), chat, PROMPT)
    tok = qwen3()

    async def collect(engine: _Engine) -> None:
        g = Generation(
            _Request(),  # type: ignore[arg-type]
            _Gateway(engine),  # type: ignore[arg-type]
            "m",
            tok,
            shaping.sampling,
            chat=True,
            rid="chatcmpl-1",
            t0=0.0,
            logprobs=None,
            shaping=shaping,
        )
        await g.collect([Job([1, 2], "", [ChoiceState(0, tok, shaping.sampling, [1, 2])], 0)])

    stopped = _Engine(stream_batches(ids_of("Hello there world and more", eos=False)))
    await collect(stopped)
    assert stopped.aborts == ["stop"]
    failed = _Engine(
        stream_batches(ids_of("Hello", eos=False))[:-1], fail=EngineError("closed", retryable=False)
    )
    with pytest.raises(EngineError):
        await collect(failed)
    assert failed.aborts == ["cancelled"]
