"""In-process fakes for the lean HTTP/2 engine client's socket: an asyncio transport as far as the node's
protocols use it, and a canned gRPC engine that answers every call with pre-built frames. Shared by the
h2 client's tests and the in-process benchmarks (bench/engine_transport_bench.py, bench/node_path_bench.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.workers import Worker
from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_protocol import H2Protocol

HEAD = b"\x88" + h2.hpack_literal(31, b"application/grpc")  # :status 200, content-type


def trailers(status: int = 0, message: bytes = b"") -> bytes:
    block = h2.hpack_literal(b"grpc-status", str(status).encode())
    return block + (h2.hpack_literal(b"grpc-message", message) if message else b"")


class FakeTransport:
    """asyncio.Transport, as far as the node's protocols use it; ``write`` is the subclass's."""

    def __init__(self) -> None:
        self.closing = False

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def connect(transport: FakeTransport, loop: asyncio.AbstractEventLoop, max_streams: int = 0) -> H2Protocol:
    """A client H2Protocol over ``transport``, the server's SETTINGS received (``max_streams`` 0: none)."""
    proto = H2Protocol(loop, keepalive_s=0)
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(
        h2.settings_frame({h2.SETTINGS_MAX_CONCURRENT_STREAMS: max_streams} if max_streams else {})
    )
    return proto


def client_on(proto: H2Protocol, kind: str = "sglang") -> H2EngineClient:
    """An engine client whose connection is ``proto`` (the fake one, ready)."""
    c = H2EngineClient(f"{kind}://127.0.0.1:1", "127.0.0.1:1", kind)
    c._proto = proto
    return c


class CannedEngine(FakeTransport):
    """The client's transport whose peer is a canned gRPC server: each request's HEADERS frame is
    answered, on the next loop turn, by ``reply(stream id)`` (a list of reads, delivered one loop turn
    apart); the DATA the client sends is credited back to the connection window, as a server does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reply: Callable[[int], list[bytes]]) -> None:
        super().__init__()
        self.loop = loop
        self.reply = reply
        self.proto: H2Protocol | None = None  # the protocol fed the reads (``canned_engine`` sets it)

    def write(self, data: bytes) -> None:
        off = len(h2.PREFACE) if data.startswith(h2.PREFACE) else 0
        n = len(data)
        received = 0
        replies = []
        while n - off >= 9:
            length = int.from_bytes(data[off : off + 3], "big")
            ftype = data[off + 3]
            if ftype == h2.HEADERS:
                replies.append(self.reply(int.from_bytes(data[off + 5 : off + 9], "big") & 0x7FFFFFFF))
            elif ftype == h2.DATA:
                received += length
            off += 9 + length
        if received:
            replies.insert(0, [h2.window_update_frame(0, received)])
        for reads in replies:
            if reads:
                self.loop.call_soon(self._deliver, reads, 0)

    def _deliver(self, reads: list[bytes], i: int) -> None:
        if self.closing or self.proto is None:
            return
        self.proto.data_received(reads[i])
        if i + 1 < len(reads):
            self.loop.call_soon(self._deliver, reads, i + 1)


def canned_engine(
    loop: asyncio.AbstractEventLoop,
    reply: Callable[[int], list[bytes]],
    max_streams: int,
    kind: str = "sglang",
) -> tuple[H2EngineClient, H2Protocol]:
    """An engine client connected to a ``CannedEngine`` answering with ``reply``: (client, its protocol)."""
    engine = CannedEngine(loop, reply)
    proto = connect(engine, loop, max_streams)
    engine.proto = proto
    return client_on(proto, kind), proto


def canned_worker(
    loop: asyncio.AbstractEventLoop,
    model: str,
    reply: Callable[[int], list[bytes]],
    max_streams: int,
) -> tuple[Worker, H2EngineClient, H2Protocol]:
    """A healthy worker ``w0`` serving ``model`` through a ``canned_engine``, for a gateway's registry:
    (the worker, its engine client, that client's protocol)."""
    client, proto = canned_engine(loop, reply, max_streams)
    w = Worker(
        id="w0",
        url=client.url,
        model=model,
        client=client,
        health=HealthTracker(healthy=True, checked=True),
        breaker=CircuitBreaker(),
    )
    return w, client, proto
