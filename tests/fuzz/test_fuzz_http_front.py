"""Fuzz target: the lean HTTP/1.1 server (shepherd/node/http/server.py, connection.py) on real loopback
sockets, in-process: a ``LeanServer`` on its own event loop thread serves a small aiohttp application
with the node's error middleware, ``read_json`` and ``parse_chat``, and records every request its
handlers see (by the client's port), so smuggling is observable.

Each example is a byte stream of one to three pipelined requests (http_strategies.py). What must hold:

- the server answers every request whose message arrived whole, in order, and nothing more: at most one
  final response per request head (+ one protocol error), only ``100 Continue`` as an interim answer;
- each response is well-formed HTTP/1.x (status line, header lines without CR/LF, one framing);
  final statuses in 200..599 and never 500 (client garbage is never the gateway's fault); an error
  answer with a body is the OpenAI envelope;
- the requests the app ran are exactly the first ones llhttp frames out of the stream: a request hidden
  in a body (``/canary/...``) never runs unless the stream really framed it as a request;
- a parse error is answered 400 and the connection closed (nothing follows an answer that says close);
- no hang: every wait is bounded (``WAIT``) and a wait that runs out is a failure;
- the server survives: ``/liveness`` answers on a new connection after every example, and nothing is
  logged at ERROR by the server (an escaped exception).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from hypothesis import example, given

from shepherd.node.api.common import GATEWAY, error_middleware
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import read_json
from shepherd.node.http.limits import Limits
from shepherd.node.http.server import LeanServer
from shepherd.node.http.types import stream_response
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import parse_chat
from tests.fuzz.http_strategies import CANARY, request_stream
from tests.fuzz.httpwire import WAIT, Outcome, Wire, converse, reference_parse
from tests.fuzz.profiles import Budget, fuzz_settings, run_bounded

MAX_BODY = 64 * 1024
# small limits, so that generated inputs reach them cheaply; a short linger keeps refused bodies quick
LIMITS = Limits(max_field=4096, max_headers=48, max_head=16 * 1024, max_line=2048, linger_secs=0.3)
PATHS = [
    b"/liveness",
    b"/echo",
    b"/v1/chat/completions",
    b"/items/abc",
    b"/items/",
    b"/stream",
    b"/",
    b"/nothing",
    b"/liveness/",
    CANARY.encode() + b"x",
]
RECORD: web.AppKey[Recorder] = web.AppKey("record")


# ---- the app ---------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """What the handlers saw, by client port (appended on the server's loop, read by the test thread)."""

    seen: list[tuple[int, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, port: int, method: str, target: str) -> None:
        with self.lock:
            self.seen.append((port, method, target))

    def of(self, port: int) -> list[tuple[str, str]]:
        with self.lock:
            return [(m, t) for p, m, t in self.seen if p == port]

    def clear(self) -> None:
        with self.lock:
            self.seen.clear()


class ErrorLog(logging.Handler):
    """ERROR records of the server and the API (an exception that escaped a handler or the server)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(self.format(r) for r in self.records)


@web.middleware
async def record(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    t = request.transport
    peer = t.get_extra_info("peername") if t is not None else None
    port = peer[1] if isinstance(peer, tuple) and len(peer) > 1 else -1
    request.app[RECORD].add(port, request.method, request.raw_path)
    return await handler(request)


async def liveness(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def echo(request: web.Request) -> web.Response:
    raw, d = await read_json(request, MAX_BODY)
    return web.Response(
        body=orjson.dumps({"size": len(raw), "keys": sorted(d)[:5]}), content_type="application/json"
    )


async def chat(request: web.Request) -> web.Response:
    _, d = await read_json(request, MAX_BODY)
    req = parse_chat(d)
    return web.json_response({"model": req.model, "messages": len(req.messages)})


async def item(request: web.Request) -> web.Response:
    return web.json_response({"id": request.match_info["item_id"]})


async def canary(request: web.Request) -> web.Response:
    return web.json_response({"canary": request.match_info["tag"]})


async def stream(request: web.Request) -> web.StreamResponse:
    resp = stream_response(request, headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(b"data: %d\n\n" % i)
    await resp.write_eof(b"data: [DONE]\n\n")
    return resp


def make_app() -> web.Application:
    gw = SimpleNamespace(cfg=NodeConfig(max_body_bytes=MAX_BODY), metrics=NodeMetrics(), in_flight=0)
    app = web.Application(middlewares=[record, error_middleware], client_max_size=MAX_BODY)
    app[GATEWAY] = cast(Gateway, gw)
    app[RECORD] = Recorder()
    app.add_routes(
        [
            web.get("/liveness", liveness),
            web.post("/echo", echo),
            web.put("/echo", echo),
            web.post("/v1/chat/completions", chat),
            web.get("/items/{item_id}", item),
            web.get(CANARY + "{tag}", canary),
            web.post(CANARY + "{tag}", canary),
            web.get("/stream", stream),
        ]
    )
    return app


class CountingSet(set[Any]):
    """``LeanServer.conns``, counting the connections the server took and let go (read by the test thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.added = 0
        self.removed = 0

    def add(self, item: Any) -> None:
        if item not in self:
            self.added += 1
        super().add(item)

    def discard(self, item: Any) -> None:
        if item in self:
            self.removed += 1
        super().discard(item)


class Front:
    """A ``LeanServer`` on an event loop of its own thread; ``stop`` ends it (bounded)."""

    def __init__(self) -> None:
        self.app = make_app()
        self.errors = ErrorLog()
        self.port = 0
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: LeanServer | None = None
        self.conns = CountingSet()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="fuzz-lean-server", daemon=True)

    @property
    def recorder(self) -> Recorder:
        return self.app[RECORD]

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self.failed = e
            self.ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.app)
        await runner.setup()
        server = LeanServer(self.app, max_body=MAX_BODY, limits=LIMITS)
        server.conns = self.conns
        await server.start("127.0.0.1", 0)
        self.server = server
        self.port = server.port
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.shutdown(timeout=1.0)
            await runner.cleanup()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30), "the lean server did not start"
        if self.failed is not None:
            raise self.failed

    def alive(self) -> bool:
        return self.thread.is_alive() and self.failed is None

    def open_connections(self) -> int:
        return self.conns.added - self.conns.removed

    def released(self, taken: int) -> bool:
        """The server has taken ``taken`` connections so far and let every one go (bounded polling: a
        client's close is noticed asynchronously; a refused body lingers ``LIMITS.linger_secs``)."""
        for _ in range(500):
            if self.conns.added >= taken and self.conns.removed == self.conns.added:
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(15)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    f = Front()
    loggers = [logging.getLogger("shepherd.http"), logging.getLogger("shepherd.api")]
    for lg in loggers:
        lg.addHandler(f.errors)
    try:
        f.start()
        yield f
    finally:
        f.stop()
        for lg in loggers:
            lg.removeHandler(f.errors)


def error_log(front: Front) -> ErrorLog:
    return front.errors


# ---- one exchange ------------------------------------------------------------------------------------------


def exchange(front: Front, data: bytes) -> Outcome:
    out = converse(front.port, data)
    out.ran = front.recorder.of(out.port)
    return out


def check_outcome(data: bytes, out: Outcome) -> None:
    ref = reference_parse(data)
    for i, r in enumerate(out.responses):
        assert 200 <= r.status <= 599, f"answer {i}: status {r.status}"
        assert r.status != 500, f"answer {i}: 500 for client input: {r.body[:500]!r}"
        is_head = i < len(ref.heads) and ref.heads[i].method == "HEAD"
        if r.status >= 400 and not is_head and r.body:
            r.error()
    if ref.error is not None and out.responses:
        last = out.responses[-1]
        assert last.closes, "the connection stays open after a parse error"
    framed = [(m.method, m.target) for m in ref.heads]
    assert out.ran == framed[: len(out.ran)], f"the app ran {out.ran}, the stream framed {framed}"
    smuggled = [t for _, t in out.ran if t.startswith(CANARY)]
    assert len(smuggled) <= sum(1 for _, t in framed if t.startswith(CANARY)), smuggled


def check_liveness(front: Front) -> None:
    assert front.alive(), "the server thread died"
    with socket.create_connection(("127.0.0.1", front.port), timeout=WAIT) as s:
        s.sendall(b"GET /liveness HTTP/1.1\r\nHost: t\r\n\r\n")
        r = Wire(s).response(head_request=False)
    assert r is not None and r.status == 200 and orjson.loads(r.body) == {"status": "alive"}, r


def run_example(front: Front, data: bytes) -> Outcome:
    log = error_log(front)
    log.records.clear()
    front.recorder.clear()
    taken = front.conns.added
    out = exchange(front, data)
    check_outcome(data, out)
    assert front.released(taken + 1), (
        f"{front.open_connections()} connections still open after the client left"
    )
    check_liveness(front)
    assert front.released(taken + 2), "the liveness connection was not released"
    assert not log.records, f"the server logged errors:\n{log.text()}"
    return out


# ---- the targets --------------------------------------------------------------------------------------


def test_fuzz_http_front(front: Front, fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=200)
    @given(request_stream(PATHS, "smuggled"))
    @example(b"GET /liveness HTTP/1.1\r\nHost: t\r\n\r\n" * 3)
    @example(POST + b"Content-Length: 2\r\n\r\n{}GET /liveness HTTP/1.0\r\n\r\n")
    @example(POST + CT + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n{}")
    @example(b"GET /stream HTTP/1.0\r\n\r\n")
    @example(b"HEAD /liveness HTTP/1.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
    def check(data: bytes) -> None:
        run_example(front, data)

    run_bounded(check, fuzz_budget)


# the classic desyncs: the canary request must never run, and at most one answer comes back
POST = b"POST /echo HTTP/1.1\r\nHost: t\r\n"
CT = b"Content-Type: application/json\r\n"


def hidden(tag: bytes) -> bytes:
    return b"GET /canary/" + tag + b" HTTP/1.1\r\nHost: t\r\n\r\n"


SMUGGLING = [
    # CL.TE / TE.CL: both framings on one request
    POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + hidden(b"a"),
    POST + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
    # TE obfuscations
    POST + b"Transfer-Encoding: xchunked\r\nContent-Length: 4\r\n\r\n5c\r\n" + hidden(b"b") + b"0\r\n\r\n",
    POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n" + hidden(b"c"),
    POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n" + hidden(b"d"),
    POST + b"Transfer-Encoding:\tchunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + hidden(b"e"),
    POST + b"X: y\r\n Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + hidden(b"f"),
    # duplicate / conflicting Content-Length
    POST + CT + b"Content-Length: 0\r\nContent-Length: 38\r\n\r\n" + hidden(b"g"),
    POST + CT + b"Content-Length: 38, 0\r\n\r\n" + hidden(b"h"),
    # a bare LF or CR where CRLF belongs
    b"POST /echo HTTP/1.1\r\nHost: t\nContent-Length: 0\r\n\r\n" + hidden(b"i"),
    POST + b"Content-Length: 0\r\r" + hidden(b"j"),
    # chunk size overflow and a chunk extension hiding a request
    POST + b"Transfer-Encoding: chunked\r\n\r\n10000000000000000001\r\nA\r\n0\r\n\r\n" + hidden(b"k"),
    POST + b"Transfer-Encoding: chunked\r\n\r\n2;\n" + hidden(b"l") + b"\r\nab\r\n0\r\n\r\n",
    # a body too large: refused early, the rest dropped, never parsed as requests
    POST + CT + b"Content-Length: 70000\r\n\r\n" + hidden(b"m") * 1000,
    # an upgrade: what follows is another protocol
    b"GET /liveness HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n" + hidden(b"n"),
    b"CONNECT t:80 HTTP/1.1\r\nHost: t\r\n\r\n" + hidden(b"o"),
]


@pytest.mark.parametrize("data", SMUGGLING, ids=[f"desync-{i}" for i in range(len(SMUGGLING))])
def test_no_request_smuggling(front: Front, data: bytes) -> None:
    out = run_example(front, data)
    assert not [t for _, t in out.ran if t.startswith(CANARY)], f"smuggled: {out.ran}"
    assert len(out.responses) <= 1, [(r.status, r.body[:100]) for r in out.responses]


def test_head_fault_has_no_body(front: Front) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=WAIT) as s:
        s.sendall(b"HEAD /liveness HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        wire = Wire(s)
        r = wire.response(head_request=True)
        assert r is not None and r.status == 431 and r.closes
        assert wire.rest() == b""


@pytest.mark.parametrize(
    "target", [b"/nothing%ff", b"/liveness%ff%fe", b"/items/%C3%28", b"http://t/x%80?q=%ff"], ids=str
)
def test_undecodable_escape_in_path_is_not_500(front: Front, target: bytes) -> None:
    """Found by this fuzz target: a path whose escapes are not UTF-8 (``%ff``) reached the 404/405 envelope
    as a lone surrogate and orjson refused it (500). Fixed in types.py ``decode_path``."""
    for method in (b"GET", b"DELETE"):
        out = run_example(front, method + b" " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        assert [r.status for r in out.responses] in ([404], [405], [200]), out.responses
        r = out.responses[0]
        assert r.status == 200 or "%" in str(r.error()["message"]), r


class GoneTransport:
    """A transport whose peer has gone after the server's answer was written: ``write_eof`` fails as
    asyncio's selector transport fails on loopback (``shutdown`` on a socket the client reset)."""

    def __init__(self) -> None:
        self.closed = False
        self.written = b""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_fault_after_client_close() -> None:
    """What the fuzz target meets on loopback (a client that sends a malformed request and closes at once,
    e.g. ``HELLO\\r\\n\\r\\n``), made deterministic: the protocol error's answer must not log an error
    when the peer is gone, and the connection must close."""
    from shepherd.node.http.connection import _Conn

    errors = ErrorLog()
    lg = logging.getLogger("shepherd.http")
    lg.addHandler(errors)

    async def main() -> GoneTransport:
        loop = asyncio.get_running_loop()
        srv = SimpleNamespace(
            app=None, loop=loop, clock=loop.time, limits=LIMITS, max_body=MAX_BODY, routes=None, targets={}
        )
        srv.conns = set()
        srv.arm_sweep = lambda: None
        conn = _Conn(cast(Any, srv))
        t = GoneTransport()
        conn.connection_made(cast(Any, t))
        conn.data_received(b"HELLO\r\n\r\n")
        for _ in range(10):  # bounded: the answer is written within a few loop turns
            await asyncio.sleep(0)
        return t

    try:
        t = asyncio.run(main())
    finally:
        lg.removeHandler(errors)
    assert t.written.startswith(b"HTTP/1.1 400 ")
    assert t.closed
    assert not errors.records, errors.text()
