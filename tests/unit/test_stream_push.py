"""A streamed chat answer over a paced engine (one gRPC message per token), through the node's own
pieces in one process (lean HTTP server, app, gateway, lean HTTP/2 engine client; only the sockets are
fakes): the engine client pushes each token into the generation loop from its connection's callback,
and a client whose transport fills up gets the same answer, with nothing written while it is paused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg

from shepherd.node.app import build_app
from shepherd.node.config import build_config
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import Worker
from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.h2 import GenerateCall
from shepherd.node.engines.h2_stream import grpc_message
from shepherd.node.http.connection import _Conn
from shepherd.node.http.server import LeanServer
from tests.fake_h2_engine import HEAD, FakeTransport, canned_worker, trailers

TOKENS = 24


class _Client(FakeTransport):
    """The client side of one HTTP connection. With ``pause_every`` k, every k-th write fills the
    transport: the connection is told to pause writing, and to resume three loop turns later (the
    engine's next tokens arrive meanwhile)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pause_every: int = 0) -> None:
        super().__init__()
        self.loop = loop
        self.pause_every = pause_every
        self.conn: _Conn | None = None
        self.data = bytearray()
        self.writes = 0
        self.pauses = 0
        self.paused = False
        self.written_while_paused = 0
        self.done: asyncio.Future[None] = loop.create_future()

    def write(self, data: bytes) -> None:
        self.writes += 1
        if self.paused:
            self.written_while_paused += 1
        self.data += data
        if data.endswith(b"0\r\n\r\n") and not self.done.done():
            self.done.set_result(None)
        elif self.pause_every and self.writes % self.pause_every == 0 and self.conn is not None:
            self.paused = True
            self.pauses += 1
            self.conn.pause_writing()
            self.loop.call_soon(self._later, 3)

    def _later(self, turns: int) -> None:
        if turns:
            self.loop.call_soon(self._later, turns - 1)
            return
        self.paused = False
        assert self.conn is not None
        self.conn.resume_writing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


def _paced_reply(ids: list[int]) -> Any:
    """The engine's answer, one read per token (the head with the first, the trailers with the last)."""
    msgs = [
        sg.GenerateResponse(
            request_id="r",
            chunk=sg.GenerateStreamChunk(token_ids=[t], prompt_tokens=10, completion_tokens=i + 1),
        ).SerializeToString()
        for i, t in enumerate(ids)
    ]
    msgs.append(
        sg.GenerateResponse(
            request_id="r",
            complete=sg.GenerateComplete(
                finish_reason="length", prompt_tokens=10, completion_tokens=len(ids)
            ),
        ).SerializeToString()
    )

    def reply(sid: int) -> list[bytes]:
        frames = [h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, sid, HEAD)]
        frames += [h2.frame(h2.DATA, 0, sid, grpc_message(m)) for m in msgs]
        frames.append(h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, sid, trailers()))
        return [frames[0] + frames[1], *frames[2:-2], frames[-2] + frames[-1]]

    return reply


@dataclass
class _Node:
    loop: asyncio.AbstractEventLoop
    srv: LeanServer
    worker: Worker
    streams: dict[int, Any]
    model: str

    async def ask(self, pause_every: int = 0) -> _Client:
        t = _Client(self.loop, pause_every)
        c = _Conn(self.srv)
        t.conn = c
        c.connection_made(t)  # type: ignore[arg-type]
        body = orjson.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "Tell me about Paris."}],
                "max_tokens": TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        c.data_received(head + body)
        await asyncio.wait_for(t.done, 30)
        return t


@pytest.fixture
async def node() -> AsyncIterator[_Node]:
    loop = asyncio.get_running_loop()
    gw = Gateway(build_config({}, {"policy": "round_robin", "tokenizer_workers": 0}))
    await gw.tokenizers.start()
    model = gw.model_names()[0]
    text = "The capital of France is Paris, a city of museums, cafés and long walks along the Seine."
    ids = list(gw.tokenizer(model).hf.encode(text, add_special_tokens=False).ids)
    ids = (ids * 4)[:TOKENS]
    w, client, proto = canned_worker(loop, model, _paced_reply(ids), max_streams=64)
    gw.registry.workers[w.id] = w
    srv = LeanServer(build_app(gw), max_body=gw.cfg.max_body_bytes)
    try:
        yield _Node(loop, srv, w, proto.conn.streams, model)
    finally:
        await client.close()
        await gw.tokenizers.close()


def _events(data: bytes | bytearray) -> list[Any]:
    """The SSE events of a chunked HTTP answer, without the per-answer id and creation time."""
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    payload = bytearray()
    rest = body
    for _ in range(10_000):  # bounded by the body
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload += rest[:size]
        rest = rest[size + 2 :]
    out: list[Any] = []
    for line in bytes(payload).split(b"\n\n"):
        if not line:
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            out.append("[DONE]")
            continue
        ev = orjson.loads(line[6:])
        ev.pop("id", None)
        ev.pop("created", None)
        out.append(ev)
    return out


def _answer(events: list[Any]) -> tuple[str, str, dict[str, Any]]:
    """An SSE answer's text, finish reason (there is one) and usage (in the last event before [DONE])."""
    choices = [e["choices"][0] for e in events if e != "[DONE]" and e.get("choices")]
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(finishes) == 1 and events[-1] == "[DONE]"
    return "".join(c["delta"].get("content") or "" for c in choices), finishes[0], events[-2]["usage"]


async def test_tokens_are_pushed_one_write_each_and_the_answer_is_whole(
    node: _Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    pushes = 0
    real = GenerateCall.push

    def counting(self: GenerateCall, take: Any) -> asyncio.Future[None]:
        nonlocal pushes
        pushes += 1
        return real(self, take)

    monkeypatch.setattr(GenerateCall, "push", counting)
    t = await node.ask()
    events = _events(t.data)
    assert pushes == 1  # one hand-over: every later token came through the engine connection's callback
    text, finish, usage = _answer(events)
    assert text.startswith("The capital of France is Paris") and finish == "length"
    assert usage["completion_tokens"] == TOKENS
    # the head, the role with the first token, one write per later token, the last with usage and [DONE]
    assert t.writes == 1 + TOKENS
    assert len([e for e in events if e != "[DONE]" and e.get("choices")]) == 1 + TOKENS + 1
    assert node.worker.in_flight == 0 and not node.streams


async def test_a_full_client_transport_pauses_the_stream_without_changing_it(node: _Node) -> None:
    plain = _events((await node.ask()).data)
    t = await node.ask(pause_every=3)
    assert t.pauses >= 3
    assert t.written_while_paused == 0  # nothing more is taken from the engine until the drain
    events = _events(t.data)
    assert _answer(events) == _answer(plain)  # the same text, finish and usage
    assert len(events) < len(plain)  # tokens that came during a pause went out together after it
    assert node.worker.in_flight == 0 and not node.streams
