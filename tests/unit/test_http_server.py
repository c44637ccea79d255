"""The lean HTTP/1.1 server (shepherd.node.http.server) through real loopback sockets: framing, keep-alive,
pipelining, 100-continue, chunked bodies, limits, request encodings, streaming, flow control, client
disconnects and shutdown. The app is a small aiohttp application with the node's own error middleware and
``read_json``, so the envelopes are the node's. No timed assertions: waits are bounded, never measured."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.api.common import GATEWAY, error_middleware
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import read_json
from shepherd.node.http.limits import Limits
from shepherd.node.http.server import LeanServer
from shepherd.node.http.types import lean_request, stream_response
from shepherd.node.metrics import NodeMetrics

MAX_BODY = 64 * 1024
LIMITS = Limits(max_field=4096, max_headers=32, max_head=16 * 1024, max_line=2048, linger_secs=5.0)
WAIT = 10.0  # bound on every wait (never asserted on)
TRAIL: web.RequestKey[list[str]] = web.RequestKey("trail", list)
EVENTS: web.AppKey[dict[str, asyncio.Event]] = web.AppKey("events", dict)


# ---- the app ---------------------------------------------------------------------------------------


async def echo(request: web.Request) -> web.Response:
    raw, d = await read_json(request, MAX_BODY)
    body = {
        "size": len(raw),
        "json": d,
        "trail": request[TRAIL],
        "query": dict(request.query),
        "path": request.path,
        "x": request.headers.get("X-Test"),
        "remote": request.remote,
        "has_transport": request.transport is not None,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def item(request: web.Request) -> web.Response:
    return web.json_response({"id": request.match_info["item_id"], "route": request.match_info.route.name})


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello", headers={"x-request-id": "r-1"})


async def slow(request: web.Request) -> web.Response:
    ev = request.app[EVENTS]
    ev["slow_started"].set()
    try:
        await ev["release"].wait()
    except asyncio.CancelledError:
        ev["slow_cancelled"].set()
        raise
    return web.Response(text="released")


async def stream(request: web.Request) -> web.StreamResponse:
    n = int(request.query.get("n", "3"))
    size = int(request.query.get("size", "10"))
    resp = stream_response(request, headers={"Content-Type": "text/event-stream", "Connection": "keep-alive"})
    await resp.prepare(request)
    for i in range(n):
        await resp.write(b"%d:" % i + b"x" * size + b"\n")
    await resp.write_eof(b"end\n")
    return resp


async def stream_no_eof(request: web.Request) -> web.StreamResponse:
    resp = stream_response(request, headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    await resp.write(b"a")
    await resp.write(b"")  # an empty write must not end a chunked body
    await resp.write(b"b")
    return resp  # the server ends it


async def stream_fail(request: web.Request) -> web.StreamResponse:
    resp = stream_response(request, headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    if request.query.get("at") == "start":
        raise RuntimeError("failed before the first write")
    await resp.write(b"partial")
    raise RuntimeError("failed midway")


async def stream_204(request: web.Request) -> web.StreamResponse:
    resp = stream_response(request, status=204)
    await resp.prepare(request)
    await resp.write_eof()
    return resp


async def bad_header(request: web.Request) -> web.Response:
    return web.Response(text="x", headers={"x-evil": "a\r\nSet-Cookie: owned=1"})


@web.middleware
async def trail_outer(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    request[TRAIL] = ["outer"]
    return await handler(request)


@web.middleware
async def trail_inner(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    request[TRAIL].append("inner")
    return await handler(request)


def make_app() -> web.Application:
    gw = SimpleNamespace(cfg=NodeConfig(max_body_bytes=MAX_BODY), metrics=NodeMetrics(), in_flight=0)
    app = web.Application(middlewares=[error_middleware, trail_outer, trail_inner], client_max_size=MAX_BODY)
    app[GATEWAY] = cast(Gateway, gw)
    app[EVENTS] = {k: asyncio.Event() for k in ("slow_started", "slow_cancelled", "release")}
    app.add_routes(
        [
            web.get("/multi", hello),  # one path, two resources (not registered one after the other)
            web.post("/echo", echo),
            web.get("/items/{item_id}", item, name="item"),
            web.get("/hello", hello),
            web.get("/slow", slow),
            web.get("/stream", stream),
            web.get("/stream-no-eof", stream_no_eof),
            web.get("/bad-header", bad_header),
            web.get("/stream-fail", stream_fail),
            web.get("/stream-204", stream_204),
            web.post("/multi", echo),
        ]
    )
    return app


@dataclass
class Running:
    app: web.Application
    server: LeanServer
    port: int

    @property
    def gw(self) -> Any:
        return self.app[GATEWAY]


@contextlib.asynccontextmanager
async def running(limits: Limits, clock: Callable[[], float] | None = None) -> AsyncIterator[Running]:
    """The test app on a lean server with ``limits`` (and ``clock``), on a free port."""
    app = make_app()
    runner = web.AppRunner(app)
    await runner.setup()
    server = (
        LeanServer(app, max_body=MAX_BODY, limits=limits)
        if clock is None
        else LeanServer(app, max_body=MAX_BODY, limits=limits, clock=clock)
    )
    await server.start("127.0.0.1", 0)
    try:
        yield Running(app, server, server.port)
    finally:
        await server.shutdown(timeout=1.0)
        await runner.cleanup()


@pytest.fixture
async def srv() -> AsyncIterator[Running]:
    async with running(LIMITS) as r:
        yield r


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def clocked() -> AsyncIterator[tuple[Running, FakeClock]]:
    """A server on a fake clock (its limits are checked by ``server.sweep()``)."""
    clock = FakeClock()
    async with running(Limits(keepalive_secs=60.0, head_secs=30.0, body_secs=100.0), clock) as r:
        yield r, clock


# ---- a small HTTP/1.x client --------------------------------------------------------------------------


@dataclass
class Resp:
    version: str
    status: int
    headers: dict[str, str]
    body: bytes
    chunked: bool = False
    chunks: list[bytes] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The OpenAI envelope's error (asserting its shape)."""
        assert self.headers["content-type"].startswith("application/json"), self.headers
        d = self.json()
        assert set(d) == {"error"} and set(d["error"]) == {"message", "type", "param", "code"}, d
        err: dict[str, Any] = d["error"]
        return err


async def read_response(r: asyncio.StreamReader, head_only: bool = False) -> Resp:
    line = await asyncio.wait_for(r.readline(), WAIT)
    assert line, "connection closed before a response"
    version, status, *_ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (h := await asyncio.wait_for(r.readline(), WAIT)) != b"\r\n":
        assert h, "connection closed inside a head"
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    resp = Resp(version, int(status), headers, b"")
    if head_only or resp.status < 200 or resp.status in (204, 304):
        return resp
    if headers.get("transfer-encoding") == "chunked":
        resp.chunked = True
        while True:
            size = int((await asyncio.wait_for(r.readline(), WAIT)).strip(), 16)
            data = await asyncio.wait_for(r.readexactly(size + 2), WAIT)
            assert data.endswith(b"\r\n")
            if size == 0:
                break
            resp.chunks.append(data[:-2])
        resp.body = b"".join(resp.chunks)
    elif "content-length" in headers:
        resp.body = await asyncio.wait_for(r.readexactly(int(headers["content-length"])), WAIT)
    else:
        resp.body = await asyncio.wait_for(r.read(), WAIT)  # close-delimited
    return resp


async def closed(r: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF, or a reset)."""
    try:
        return await asyncio.wait_for(r.read(1), WAIT) == b""
    except ConnectionResetError:
        return True


class Conn:
    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r = r
        self.w = w

    @classmethod
    async def open(cls, port: int) -> Conn:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def send(self, data: bytes) -> None:
        self.w.write(data)
        await self.w.drain()

    async def response(self, head_only: bool = False) -> Resp:
        return await read_response(self.r, head_only)

    async def request(self, data: bytes) -> Resp:
        await self.send(data)
        return await self.response()

    async def close(self) -> None:
        self.w.close()
        with contextlib.suppress(OSError):
            await self.w.wait_closed()


# the head of a raw POST to /echo (a JSON route: the Content-Type is required, 415 otherwise)
ECHO = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [
        f"POST {path} HTTP/{version}",
        "Host: t",
        "Content-Type: application/json",  # the node's JSON routes need it (415 otherwise)
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def get(path: str, *extra: str, method: str = "GET", version: str = "1.1") -> bytes:
    return ("\r\n".join([f"{method} {path} HTTP/{version}", "Host: t", *extra]) + "\r\n\r\n").encode()


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


# ---- keep-alive, pipelining, versions -------------------------------------------------------------------


async def test_keep_alive_serves_several_requests_on_one_connection(srv: Running) -> None:
    c = await Conn.open(srv.port)
    for i in range(3):
        r = await c.request(post(f"/echo?i={i}", BODY, "X-Test: yes"))
        assert r.status == 200 and r.version == "HTTP/1.1"
        d = r.json()
        assert d["json"]["model"] == "m" and d["query"] == {"i": str(i)} and d["x"] == "yes"
        assert d["trail"] == ["outer", "inner"]  # middlewares in app order
        assert d["remote"] == "127.0.0.1" and d["has_transport"]
        assert "connection" not in r.headers
        assert r.headers["content-length"] == str(len(r.body))
    await c.close()


async def test_pipelined_requests_are_answered_in_order(srv: Running) -> None:
    c = await Conn.open(srv.port)
    await c.send(post("/echo?i=0", BODY) + get("/hello") + get("/items/abc") + post("/echo?i=3", b"{}"))
    got = [await c.response() for _ in range(4)]
    assert [r.status for r in got] == [200, 200, 200, 200]
    assert got[0].json()["query"] == {"i": "0"}
    assert got[1].body == b"hello" and got[1].headers["x-request-id"] == "r-1"
    assert got[2].json() == {"id": "abc", "route": "item"}
    assert got[3].json()["query"] == {"i": "3"}
    await c.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), min_size=0, max_size=6))
def test_any_split_of_the_byte_stream_gives_the_same_answers(cuts: list[int]) -> None:
    """However the client's bytes are cut into reads, the answers are the same, in order."""
    chunked = ECHO + b"Transfer-Encoding: chunked\r\n\r\n"
    chunked += b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    wire = post("/echo?a=1", BODY) + get("/items/x%2Fy") + chunked

    async def run() -> list[tuple[int, bytes]]:
        app = make_app()
        runner = web.AppRunner(app)
        await runner.setup()
        server = LeanServer(app, max_body=MAX_BODY, limits=LIMITS)
        await server.start("127.0.0.1", 0)
        try:
            c = await Conn.open(server.port)
            pos = 0
            for cut in sorted(set(cuts)):
                if cut >= len(wire):
                    break
                await c.send(wire[pos:cut])
                await asyncio.sleep(0)
                pos = cut
            await c.send(wire[pos:])
            out = [await c.response() for _ in range(3)]
            await c.close()
            return [(r.status, r.body) for r in out]
        finally:
            await server.shutdown(timeout=1.0)
            await runner.cleanup()

    got = asyncio.run(run())
    assert [s for s, _ in got] == [200, 200, 200]
    assert orjson.loads(got[1][1]) == {"id": "x/y", "route": "item"}  # %2F inside a path variable
    assert orjson.loads(got[2][1])["json"]["model"] == "m"


async def test_a_long_pipeline_pauses_reading_and_resumes(srv: Running) -> None:
    """More pipelined requests than the server queues (16) behind a slow one: all answered, in order."""
    ev = srv.app[EVENTS]
    c = await Conn.open(srv.port)
    await c.send(get("/slow") + b"".join(get(f"/items/{i}") for i in range(40)))
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    ev["release"].set()
    assert (await c.response()).body == b"released"
    ids = [(await c.response()).json()["id"] for _ in range(40)]
    assert ids == [str(i) for i in range(40)]
    await c.close()


async def test_idle_keep_alive_connections_are_closed() -> None:
    """By the sweep, which runs only while there are connections (an idle node does not wake for it):
    armed by a connection, not again once none is left."""
    async with running(Limits(keepalive_secs=0.3)) as r:
        server = r.server

        def armed() -> bool:
            return server._sweeper is not None

        assert not armed()  # no connection: nothing armed
        c = await Conn.open(server.port)
        assert (await c.request(get("/hello"))).status == 200
        assert armed()
        assert await closed(c.r)  # by the sweep, within its tick (the wait is bounded, not measured)
        for _ in range(100):  # bounded: the sweep after the close finds no connection
            if not armed() and not server.conns:
                break
            await asyncio.sleep(0.05)
        assert not armed() and not server.conns
        c = await Conn.open(server.port)  # a new connection arms it again
        assert (await c.request(get("/hello"))).status == 200
        assert armed()
        await c.close()


async def test_http_10_closes_after_the_response(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/hello", version="1.0"))
    assert r.version == "HTTP/1.0" and r.status == 200 and r.body == b"hello"
    assert await closed(c.r)


async def test_http_10_needs_no_host(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(b"GET /hello HTTP/1.0\r\n\r\n")
    assert r.status == 200 and r.body == b"hello"


async def test_http_10_keep_alive_is_honoured(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/hello", "Connection: keep-alive", version="1.0"))
    assert r.headers["connection"].lower() == "keep-alive"
    r2 = await c.request(get("/hello", "Connection: keep-alive", version="1.0"))
    assert r2.status == 200
    await c.close()


async def test_connection_close_is_honoured(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/hello", "Connection: close"))
    assert r.headers["connection"] == "close" and r.body == b"hello"
    assert await closed(c.r)


async def test_head_has_no_body_but_its_length(srv: Running) -> None:
    c = await Conn.open(srv.port)
    await c.send(get("/hello", method="HEAD") + get("/hello"))
    head = await c.response(head_only=True)
    assert head.status == 200 and head.headers["content-length"] == "5"
    r = await c.response()  # the next response starts right after the head: no body was sent
    assert r.body == b"hello"
    await c.close()


# ---- routing ---------------------------------------------------------------------------------------


async def test_unknown_path_is_a_404_envelope(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/nope"))
    assert r.status == 404 and r.error()["type"] == "not_found_error"
    r = await c.request(get("/%00"))
    assert r.status == 404
    await c.close()


async def test_wrong_method_is_a_405_envelope_with_allow(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(post("/hello", b"{}"))
    assert r.status == 405 and r.headers["allow"] == "GET,HEAD"
    assert "not allowed" in r.error()["message"]
    r = await c.request(get("/echo", method="DELETE"))
    assert r.status == 405 and r.headers["allow"] == "POST"
    await c.close()


async def test_routes_of_one_path_registered_apart_are_merged(srv: Running) -> None:
    c = await Conn.open(srv.port)
    assert (await c.request(get("/multi"))).body == b"hello"
    assert (await c.request(post("/multi", BODY))).json()["size"] == len(BODY)
    r = await c.request(get("/multi", method="PUT"))
    assert r.status == 405 and r.headers["allow"] == "GET,HEAD,POST"
    await c.close()


# ---- request bodies ----------------------------------------------------------------------------------


async def test_expect_100_continue(srv: Running) -> None:
    c = await Conn.open(srv.port)
    head = post("/echo", BODY, "Expect: 100-continue")[: -len(BODY)]
    await c.send(head)
    interim = await c.response(head_only=True)
    assert interim.status == 100
    r = await c.request(BODY)
    assert r.status == 200 and r.json()["json"]["model"] == "m"
    await c.close()


async def test_expect_100_continue_over_the_limit_is_refused_without_continue(srv: Running) -> None:
    c = await Conn.open(srv.port)
    await c.send(ECHO + f"Content-Length: {MAX_BODY + 1}\r\n".encode())
    await c.send(b"Expect: 100-continue\r\n\r\n")
    r = await c.response()
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    assert r.headers["connection"] == "close"
    await c.close()


async def test_chunked_request_body(srv: Running) -> None:
    c = await Conn.open(srv.port)
    parts = [BODY[:7], BODY[7:20], BODY[20:]]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nTrailer: x\r\n\r\n"
    head = ECHO + b"Transfer-Encoding: chunked\r\n\r\n"
    r = await c.request(head + chunked)
    assert r.status == 200 and r.json()["size"] == len(BODY)
    r = await c.request(get("/hello"))  # and the connection goes on
    assert r.status == 200
    await c.close()


async def test_chunked_body_over_the_limit_is_a_413_envelope(srv: Running) -> None:
    c = await Conn.open(srv.port)
    chunk = b"a" * 16384
    head = ECHO + b"Transfer-Encoding: chunked\r\n\r\n"
    n = MAX_BODY // len(chunk) + 1
    await c.send(head + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * n + b"0\r\n\r\n")
    r = await c.response()
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    await c.close()


async def test_declared_body_over_the_limit_is_read_before_closing(srv: Running) -> None:
    """The client sends its whole (refused) body: it must read a 413, not a reset."""
    c = await Conn.open(srv.port)
    body = b" " * (MAX_BODY * 4)
    c.w.write(post("/echo", body))
    r = await c.response()
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    await c.w.drain()
    assert await closed(c.r)


async def test_gzip_body_is_decoded(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(post("/echo", gzip.compress(BODY), "Content-Encoding: gzip"))
    assert r.status == 200 and r.json()["json"]["model"] == "m"
    r = await c.request(post("/echo", zlib.compress(BODY), "Content-Encoding: deflate"))
    assert r.status == 200 and r.json()["size"] == len(BODY)
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    r = await c.request(post("/echo", raw.compress(BODY) + raw.flush(), "Content-Encoding: deflate"))
    assert r.status == 200 and r.json()["size"] == len(BODY)
    await c.close()


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(BODY) - 1), max_size=4))
@settings(max_examples=10, deadline=None)
def test_a_gzip_body_of_several_members_is_decoded_whole(cuts: list[int]) -> None:
    """Members one after another (RFC 1952 §2.2, what ``gzip`` and Python's readers take), in any split
    of the bytes; a member cut short is still an error."""
    from shepherd.node.http.limits import _Decoder

    bounds = [0, *sorted(set(cuts)), len(BODY)]
    members = b"".join(gzip.compress(BODY[a:b]) for a, b in itertools.pairwise(bounds))
    for step in (1, 7, len(members)):
        d = _Decoder(True, MAX_BODY)
        out = b"".join(d.feed(members[i : i + step]) for i in range(0, len(members), step)) + d.end()
        assert out == BODY
    d = _Decoder(True, MAX_BODY)
    d.feed(members[:-3])
    with pytest.raises(zlib.error):
        d.end()


def test_a_body_of_many_gzip_members_is_refused_after_the_bound() -> None:
    """Empty members (20 bytes, nothing out, so no size bound stops them): each member's end copies the
    rest of the read, so their number is bounded (a 16 MiB body of them took seconds of the loop)."""
    from shepherd.node.http.limits import _Decoder

    empty = gzip.compress(b"")
    d = _Decoder(True, MAX_BODY)
    assert d.feed(empty * _Decoder.MAX_MEMBERS) == b""
    d = _Decoder(True, MAX_BODY)
    with pytest.raises(zlib.error, match="members"):
        d.feed(empty * (_Decoder.MAX_MEMBERS + 1) * 100)


async def test_gzip_bomb_stops_at_the_limit(srv: Running) -> None:
    bomb = gzip.compress(b" " * (MAX_BODY * 50))
    assert len(bomb) < MAX_BODY
    c = await Conn.open(srv.port)
    r = await c.request(post("/echo", bomb, "Content-Encoding: gzip"))
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    await c.close()


@pytest.mark.parametrize(
    ("coding", "body", "status", "code"),
    [
        ("gzip", BODY, 400, "bad_body"),  # not gzip at all
        ("gzip", gzip.compress(BODY)[:-6], 400, "bad_body"),  # cut short
        ("br", BODY, 415, "unsupported_content_encoding"),
        ("gzip, br", BODY, 415, "unsupported_content_encoding"),
    ],
    ids=["corrupt", "truncated", "br", "stacked"],
)
async def test_undecodable_bodies_are_envelopes(
    srv: Running, coding: str, body: bytes, status: int, code: str
) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(post("/echo", body, f"Content-Encoding: {coding}"))
    assert r.status == status and r.error()["code"] == code
    r = await c.request(get("/hello"))  # a refused body was read whole: the connection goes on
    assert r.status == 200
    await c.close()


# ---- protocol errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"HELLO\r\n\r\n", 400),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
        (b"GET /hello HTTP/1.1\r\nHost: t\r\nX-Bad: a\x00b\r\n\r\n", 400),
        (
            ECHO + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (
            ECHO + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
        ),
        (
            ECHO + b"Content-Length: -1\r\n\r\n",
            400,
        ),
        (
            ECHO + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (b"GET /hello HTTP/1.1\r\nHost: t\r\nX: " + b"k" * 5000 + b"\r\n\r\n", 431),  # one field
        (b"GET /hello HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(40)) + b"\r\n", 431),
        (b"GET /hello HTTP/1.1\r\n" + b"".join(b"H%d: %s\r\n" % (i, b"v" * 4000) for i in range(5)), 431),
        (b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /hello HTTP/1.1\r\nX: y\r\n\r\n", 400),  # RFC 9112 section 3.2
        (b"GET /hello HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /hello HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n", 400),
    ],
    ids=[
        "garbage",
        "h2-preface",
        "nul",
        "cl-and-te",
        "bad-chunk",
        "cl-negative",
        "te-gzip",
        "field",
        "count",
        "head-unfinished",
        "url",
        "no-host",
        "two-hosts",
        "two-hosts-1.0",
    ],
)
async def test_protocol_errors_are_envelopes_then_close(srv: Running, data: bytes, status: int) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(data)
    assert r.status == status
    err = r.error()
    assert err["message"] and err["type"] == "invalid_request_error"
    assert r.headers["connection"] == "close"
    assert await closed(c.r)


async def test_a_bad_request_after_a_good_one_is_answered_in_turn(srv: Running) -> None:
    c = await Conn.open(srv.port)
    await c.send(get("/hello") + b"HELLO\r\n\r\n")
    first = await c.response()
    second = await c.response()
    assert (first.status, first.body, second.status) == (200, b"hello", 400)
    assert await closed(c.r)


async def test_a_large_header_within_the_limits_passes(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(post("/echo", BODY, "X-Test: " + "j" * 4000))
    assert r.status == 200 and r.json()["x"] == "j" * 4000
    await c.close()


async def test_a_response_header_with_a_newline_is_refused(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/bad-header"))
    assert r.status == 500 and "set-cookie" not in r.headers
    await c.close()


# ---- streaming ----------------------------------------------------------------------------------------


async def test_stream_is_chunked_and_kept_alive(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/stream?n=3&size=4"))
    assert r.status == 200 and r.chunked and r.headers["content-type"] == "text/event-stream"
    assert "connection" not in r.headers  # the handler's own Connection header is the server's business
    assert r.body == b"0:xxxx\n1:xxxx\n2:xxxx\nend\n"
    r = await c.request(get("/stream-no-eof"))
    assert r.body == b"ab"
    assert (await c.request(get("/hello"))).body == b"hello"
    await c.close()


async def test_stream_on_http_10_ends_with_the_connection(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/stream?n=2&size=1", version="1.0"))
    assert r.version == "HTTP/1.0" and not r.chunked and "content-length" not in r.headers
    assert r.body == b"0:x\n1:x\nend\n"


async def test_a_large_stream_to_a_slow_reader_is_complete(srv: Running) -> None:
    """More than the transport buffers: the handler waits for the client (flow control), nothing is lost."""
    c = await Conn.open(srv.port)
    n, size = 400, 20000
    await c.send(get(f"/stream?n={n}&size={size}"))
    await asyncio.sleep(0.05)  # let the server fill its buffers before the client reads
    r = await c.response()
    lines = r.body.split(b"\n")
    assert len(r.body) == sum(len(b"%d:" % i) + size + 1 for i in range(n)) + 4
    assert lines[-2] == b"end" and lines[n - 1].startswith(b"%d:" % (n - 1))
    await c.close()


async def test_a_client_that_reads_nothing_is_dropped_after_the_write_stall() -> None:
    """A response whose client reads nothing (its buffers full) ends after ``write_stall_secs``: the
    connection is aborted and the handler's write raises, so what it holds (an engine request) goes."""
    async with running(Limits(write_stall_secs=0.3)) as r:
        c = await Conn.open(r.port)
        await c.send(get("/stream?n=4000&size=20000"))  # 80 MB: more than every buffer on the way
        for _ in range(200):  # bounded: the buffers fill, the stall passes, the connection goes
            if not r.server.conns:
                break
            await asyncio.sleep(0.05)
        assert not r.server.conns
        c.w.close()


async def test_stream_response_works_under_aiohttp_too() -> None:
    async with TestClient(TestServer(make_app())) as client:
        r = await client.get("/stream?n=2&size=2")
        assert r.status == 200 and await r.read() == b"0:xx\n1:xx\nend\n"
        r = await client.get("/stream-no-eof")
        assert await r.read() == b"ab"


# ---- disconnects and shutdown ---------------------------------------------------------------------------


async def test_client_disconnect_cancels_the_handler(srv: Running) -> None:
    ev = srv.app[EVENTS]
    c = await Conn.open(srv.port)
    await c.send(get("/slow"))
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    # (gw.in_flight counts inference routes only: the middleware's own record here is the 499 it counts)
    gone = srv.gw.metrics.requests.labels("/slow", "", "499")
    assert gone.value == 0
    c.w.close()
    await asyncio.wait_for(ev["slow_cancelled"].wait(), WAIT)
    for _ in range(100):  # bounded: the middleware's finally runs as the task unwinds
        if gone.value == 1:
            break
        await asyncio.sleep(0.01)
    assert gone.value == 1 and srv.gw.in_flight == 0


async def test_shutdown_closes_idle_connections_and_lets_requests_finish(srv: Running) -> None:
    ev = srv.app[EVENTS]
    idle = await Conn.open(srv.port)
    assert (await idle.request(get("/hello"))).status == 200
    busy = await Conn.open(srv.port)
    await busy.send(get("/slow"))
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    stopping = asyncio.create_task(srv.server.shutdown(timeout=WAIT))
    assert await closed(idle.r)
    ev["release"].set()
    r = await busy.response()
    assert r.status == 200 and r.body == b"released" and r.headers["connection"] == "close"
    await asyncio.wait_for(stopping, WAIT)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", srv.port)


async def test_lean_request_is_found_behind_the_cast(srv: Running) -> None:
    seen: list[bool] = []

    async def probe(request: web.Request) -> web.Response:
        seen.append(lean_request(request) is not None)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/p", probe)
    runner = web.AppRunner(app)
    await runner.setup()
    server = LeanServer(app, max_body=1024)
    await server.start("127.0.0.1", 0)
    try:
        c = await Conn.open(server.port)
        assert (await c.request(get("/p"))).status == 200
        await c.close()
    finally:
        await server.shutdown(timeout=1.0)
        await runner.cleanup()
    assert seen == [True]


# ---- slow clients, framing floods, failed streams (review fixes) ------------------------------------------


async def test_a_request_head_that_never_ends_is_answered_408(
    clocked: tuple[Running, FakeClock],
) -> None:
    """Slowloris: a client trickling a head (each byte resetting the idle timer) is cut off at head_secs."""
    srv, clock = clocked
    c = await Conn.open(srv.port)
    await c.send(get("/hello") + b"GET /hello HTTP/1.1\r\nHost: t\r\n")  # the second head never ends
    assert (await c.response()).status == 200  # so the partial head has arrived too (one write)
    clock.now += 20.0
    await c.send(b"X-Slow: 1\r\n")  # keeps the connection from being idle
    clock.now += 11.0  # 31 s since the head's first byte, 11 s since its last
    srv.server.sweep()
    r = await c.response()
    assert r.status == 408 and r.error()["code"] == "request_timeout"
    assert await closed(c.r)


async def test_a_request_that_stops_arriving_is_answered_408(
    clocked: tuple[Running, FakeClock],
) -> None:
    """A body that stops partway: silent for keepalive_secs (60), before body_secs (100) is up, the
    client gets its 408 rather than a connection closed without a word."""
    srv, clock = clocked
    c = await Conn.open(srv.port)
    await c.send(ECHO + b"Content-Length: 100\r\n\r\n{")
    await asyncio.sleep(0.05)
    clock.now += 61.0
    srv.server.sweep()
    r = await c.response()
    assert r.status == 408 and r.error()["code"] == "request_timeout"
    assert await closed(c.r)


async def test_a_connection_that_sends_nothing_is_closed_at_head_secs(
    clocked: tuple[Running, FakeClock],
) -> None:
    """A silent connection holds a slot for head_secs (30), not keepalive_secs (60): one between two
    requests keeps the keep-alive's time."""
    srv, clock = clocked
    silent = await Conn.open(srv.port)
    between = await Conn.open(srv.port)
    await between.send(get("/hello"))
    assert (await between.response()).status == 200
    clock.now += 29.0
    srv.server.sweep()
    await asyncio.sleep(0.1)
    assert not silent.r.at_eof()
    clock.now += 2.0  # 31 s
    srv.server.sweep()
    assert await closed(silent.r)  # closed, no answer (no request came)
    await between.send(get("/hello"))  # 31 s idle after a request: still open
    assert (await between.response()).status == 200


async def test_a_request_body_that_never_ends_is_answered_408(
    clocked: tuple[Running, FakeClock],
) -> None:
    srv, clock = clocked
    c = await Conn.open(srv.port)
    await c.send(get("/hello") + ECHO + b"Content-Length: 100\r\n\r\n{")
    assert (await c.response()).status == 200
    for _ in range(3):  # a byte every 40 s: never idle for keepalive_secs (60)
        clock.now += 40.0
        await c.send(b" ")
    srv.server.sweep()  # 120 s since the request began (body_secs 100)
    r = await c.response()
    assert r.status == 408 and r.error()["code"] == "request_timeout"
    assert await closed(c.r)


async def test_keep_alive_idles_from_the_last_answer_not_the_request(
    clocked: tuple[Running, FakeClock],
) -> None:
    """A response that took longer than keepalive_secs (a long stream) must not leave its connection to
    be closed under the client's next request."""
    srv, clock = clocked
    ev = srv.app[EVENTS]
    c = await Conn.open(srv.port)
    await c.send(get("/slow"))
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    clock.now += 600.0
    srv.server.sweep()
    ev["release"].set()
    assert (await c.response()).body == b"released"
    srv.server.sweep()
    assert (await c.request(get("/hello"))).status == 200
    clock.now += 61.0
    srv.server.sweep()
    assert await closed(c.r)  # and idle connections are still closed


@pytest.mark.parametrize(
    "flood",
    [
        b"1\r\na\r\n0\r\n" + b"X-Trailer: vvvvvvvvvvvvvvvvvvvvvvvv\r\n" * 20000,
        b"1;" + b"e" * 600000,
        b"1;e\r\na\r\n" * 80000,
    ],
    ids=["trailers", "chunk-extension", "extensions"],
)
async def test_a_chunk_framing_flood_is_refused(srv: Running, flood: bytes) -> None:
    """Trailers and chunk extensions carry no body: without a bound they are an endless (or, kept, a
    memory-eating) request. (Larger than a socket read or two: the bound is checked per read.)"""
    c = await Conn.open(srv.port)
    c.w.write(ECHO + b"Transfer-Encoding: chunked\r\n\r\n" + flood)
    r = await c.response()
    assert r.status == 400 and r.error()["code"] == "bad_http_request"
    assert await closed(c.r)


async def test_transfer_encoding_in_http_1_0_is_faulty_framing(srv: Running) -> None:
    """RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding is treated as faulty framing."""
    c = await Conn.open(srv.port)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    c.w.write(ECHO.replace(b"HTTP/1.1", b"HTTP/1.0") + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    r = await c.response()
    assert r.status == 400 and r.error()["code"] == "bad_http_request"
    assert await closed(c.r)


async def test_an_absolute_form_target_must_name_the_host(srv: Running) -> None:
    """The absolute form's authority is the request's host (RFC 9112 §3.3): a Host naming another is a
    400 (the Host checks would pass a target they never saw); the same one is served."""
    c = await Conn.open(srv.port)
    await c.send(get("http://t/hello"))
    assert (await c.response()).status == 200
    c = await Conn.open(srv.port)
    await c.send(get("http://evil.example/hello"))
    r = await c.response()
    assert r.status == 400 and r.error()["code"] == "bad_http_request"


async def test_trailers_within_bounds_pass_and_are_not_headers(srv: Running) -> None:
    c = await Conn.open(srv.port)
    chunked = b"%x\r\n%s\r\n0\r\nX-Test: trailer\r\n\r\n" % (len(BODY), BODY)
    r = await c.request(ECHO + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert r.status == 200 and r.json()["x"] is None and r.json()["size"] == len(BODY)
    assert (await c.request(get("/hello"))).status == 200
    await c.close()


async def test_a_stream_failing_midway_is_cut_not_ended(srv: Running) -> None:
    """The client must see an incomplete body (no last chunk) and a closed connection, not a clean end."""
    c = await Conn.open(srv.port)
    await c.send(get("/stream-fail"))
    r = await c.response(head_only=True)
    assert r.status == 200 and r.headers["transfer-encoding"] == "chunked"
    rest = await asyncio.wait_for(c.r.read(), WAIT)  # up to the server's close
    assert rest == b"7\r\npartial\r\n"


async def test_a_stream_failing_before_its_first_write_is_an_error_envelope(srv: Running) -> None:
    c = await Conn.open(srv.port)
    r = await c.request(get("/stream-fail?at=start"))
    assert r.status == 500 and r.error()["code"] == "internal"
    assert (await c.request(get("/hello"))).status == 200  # the connection goes on
    await c.close()


async def test_a_streamed_204_has_no_content_length(srv: Running) -> None:
    c = await Conn.open(srv.port)
    await c.send(get("/stream-204") + get("/hello"))
    r = await c.response()
    assert r.status == 204 and "content-length" not in r.headers and "transfer-encoding" not in r.headers
    assert (await c.response()).body == b"hello"
    await c.close()


async def test_a_body_in_many_small_chunks_is_not_kept_as_many_objects(srv: Running) -> None:
    """A body of many tiny chunks must cost about what the same body in one chunk costs, not an object per
    chunk (~8x its size). (Allocated bytes, not time: the server runs in this process.)"""
    n = 10000
    body = b'{"x": "' + b"a" * (6 * n - 9) + b'"}'
    head = ECHO + b"Transfer-Encoding: chunked\r\n\r\n"
    small = b"".join(b"6\r\n%s\r\n" % body[i : i + 6] for i in range(0, len(body), 6)) + b"0\r\n\r\n"
    whole = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    c = await Conn.open(srv.port)
    assert (await c.request(get("/hello"))).status == 200
    peaks = []
    for wire in (head + whole, head + small):
        tracemalloc.start()
        try:
            r = await c.request(wire)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert r.status == 200 and r.json()["size"] == len(body)
    assert peaks[1] - peaks[0] < 3 * len(body), peaks  # one object per chunk: ~8x
    await c.close()


async def test_pipelined_bodies_behind_a_slow_request_pause_reading(srv: Running) -> None:
    """Queued requests hold their bodies: reading pauses once they hold more than max_body, not only after
    max_pipeline requests (16 queued bodies of max_body each would be 16x the limit per connection)."""
    ev = srv.app[EVENTS]
    body = b'{"x": "' + b"a" * (MAX_BODY - 20) + b'"}'
    c = await Conn.open(srv.port)
    c.w.write(get("/slow") + post("/echo", body) * 4)
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    (conn,) = srv.server.conns
    for _ in range(500):  # bounded: until the server has read what it will read
        if conn.read_paused:
            break
        await asyncio.sleep(0.01)
    assert conn.read_paused and len(conn.queue) < 4
    ev["release"].set()
    assert (await c.response()).body == b"released"
    sizes = [(await c.response()).json()["size"] for _ in range(4)]
    assert sizes == [len(body)] * 4
    await c.close()


async def test_a_request_waiting_behind_a_long_one_is_not_timed_out(
    clocked: tuple[Running, FakeClock],
) -> None:
    """A body held back for a 100 Continue (sent once the request ahead is answered) is timed from then."""
    srv, clock = clocked
    ev = srv.app[EVENTS]
    c = await Conn.open(srv.port)
    await c.send(get("/slow") + post("/echo", BODY, "Expect: 100-continue")[: -len(BODY)])
    await asyncio.wait_for(ev["slow_started"].wait(), WAIT)
    clock.now += 600.0  # the request ahead takes long (a long stream, say)
    ev["release"].set()
    assert (await c.response()).body == b"released"
    assert (await c.response(head_only=True)).status == 100
    srv.server.sweep()
    r = await c.request(BODY)
    assert r.status == 200 and r.json()["size"] == len(BODY)
    await c.close()
