"""The closed-loop load generator against a small in-process HTTP/1.1 server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from shepherd.loadgen.client import LoadSpec, WindowHooks, run_load
from shepherd.loadgen.http1 import RequestTemplate


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


COMPLETION = orjson.dumps(
    {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    }
)
TOKEN = _sse({"choices": [{"index": 0, "delta": {"content": "tok"}}]})


async def _respond(mode: str, writer: asyncio.StreamWriter) -> bool:
    """Write one response; False when the connection is to be closed."""
    if mode == "ok":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION))
        return True
    if mode == "http500":
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops")
        return True
    if mode == "bad_json":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnope")
        return True
    if mode == "cut":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        return False
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(4):
        writer.write(_chunk(TOKEN))
        await writer.drain()
        await asyncio.sleep(0)
    if mode == "stream":
        writer.write(_chunk(_sse({"choices": [], "usage": {"completion_tokens": 4}}) + b"data: [DONE]\n\n"))
    writer.write(b"0\r\n\r\n")
    return True


async def _handle(mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        for _ in range(100_000):  # bounded: one request per iteration
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if not await _respond(mode, writer):
                break
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[int]:
    mode: str = request.param
    srv = await asyncio.start_server(lambda r, w: _handle(mode, r, w), "127.0.0.1", 0)
    port: int = srv.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        srv.close()


class Source:
    def __init__(self, port: int) -> None:
        self.request = RequestTemplate("127.0.0.1", port, "/v1/chat/completions").render(b'{"messages":[]}')
        self.count = 0

    def next_request(self) -> bytes:
        self.count += 1
        return self.request


def spec(port: int, *, stream: bool, **kw: object) -> LoadSpec:
    base: dict[str, object] = {"concurrency": 4, "duration_s": 0.4, "warmup_s": 0.05, "timeout_s": 10.0}
    base.update(kw)
    return LoadSpec("127.0.0.1", port, stream=stream, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("server", ["ok"], indirect=True)
async def test_non_stream_ok(server: int) -> None:
    calls: list[str] = []
    hooks = WindowHooks(on_start=lambda: calls.append("start"), on_end=lambda: calls.append("end"))
    source = Source(server)
    r = await run_load(spec(server, stream=False), source, hooks)
    assert r.ok > 0
    assert r.errors == {}
    assert calls == ["start", "end"]
    assert r.latency.count == r.ok
    assert r.ttft.count == 0
    assert r.requests_sent == source.count
    assert r.rps > 0
    assert r.loadgen_cpu_s >= 0


@pytest.mark.parametrize("server", ["stream"], indirect=True)
async def test_stream_ok_measures_ttft_and_itl(server: int) -> None:
    r = await run_load(spec(server, stream=True), Source(server))
    assert r.ok > 0
    assert r.errors == {}
    assert r.ttft.count == r.ok
    assert r.itl.count == 3 * r.ok  # 4 content events: 3 gaps each
    assert r.content_events == 4 * r.ok
    assert r.completion_tokens == 4 * r.ok


@pytest.mark.parametrize(
    ("server", "stream", "kind"),
    [
        ("http500", False, "http_500"),
        ("bad_json", False, "malformed"),
        ("cut", False, "reset"),
        ("stream_nodone", True, "no_done"),
    ],
    indirect=["server"],
)
async def test_errors_are_counted_by_kind(server: int, stream: bool, kind: str) -> None:
    r = await run_load(spec(server, stream=stream), Source(server))
    assert r.ok == 0
    assert set(r.errors) == {kind}
    assert r.errors[kind] > 0


@pytest.mark.parametrize("server", ["ok"], indirect=True)
async def test_request_count_bound(server: int) -> None:
    r = await run_load(spec(server, stream=False, duration_s=60.0, max_requests=25), Source(server))
    assert r.ok == 25


async def test_connect_errors_when_nothing_listens() -> None:
    from shepherd.loadgen.procs import free_port

    port = free_port()
    r = await run_load(spec(port, stream=False, duration_s=0.2, connect_retry_s=0.05), Source(port))
    assert r.ok == 0
    assert r.errors.get("connect", 0) > 0
