"""The liveness probe of the lean HTTP/2 client (``H2Protocol.probe``, ``H2EngineClient.confirm_alive``)
and its trigger (``WorkerRegistry.check``, on a worker's turn to unhealthy): a connection with calls in
flight is sent one PING; no ACK within the timeout fails the connection and its calls (as the keepalive
does, ~80 s later, without it); an ACK leaves everything running; a connection without streams is not
pinged. Against the in-process fake server of test_engine_h2_call (no sockets), and one lazily read
connection over a socket pair."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.workers import Worker, WorkerRegistry
from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.errors import UNAVAILABLE
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_protocol import H2Protocol, LazyReads, PolledTransport
from shepherd.node.engines.h2_stream import GrpcStream
from tests.unit.test_engine_h2_call import FakeServer, flush
from tests.unit.test_engine_h2_frames import parse_frames

PATH = "/sglang.grpc.scheduler.SglangScheduler/Generate"
ACK = h2.ping_frame(bytes(8), ack=True)


def pings(server: FakeServer) -> int:
    return sum(1 for t, f, _sid, _p in server.frames if t == h2.PING and not f & h2.FLAG_ACK)


def goaways(server: FakeServer) -> list[int]:
    """The error codes of the GOAWAY frames the client sent."""
    return [int.from_bytes(p[4:8], "big") for t, _f, _sid, p in server.frames if t == h2.GOAWAY]


def client(server: FakeServer) -> H2EngineClient:
    c = H2EngineClient("grpc://127.0.0.1:1", "127.0.0.1:1", "sglang")
    c._proto = server.proto
    c._protos.add(server.proto)
    return c


def ended(stream: GrpcStream) -> bool:
    """Whether the call ended (a function: mypy narrows no attribute across the awaits between asks)."""
    return stream.done


def failure(server: FakeServer) -> str | None:
    """Why the connection failed (None: it did not); a function, as ``ended``."""
    return server.proto.conn.failed


def open_call(c: H2EngineClient) -> GrpcStream:
    stream = c._start_now(PATH, b"", None)
    assert stream is not None
    return stream


async def test_no_ack_fails_the_connection_and_its_calls_after_the_timeout() -> None:
    server = FakeServer(asyncio.get_running_loop())
    stream = open_call(client(server))
    told: list[int] = []
    assert server.proto.probe(0.5, told.append)  # (0.5 s: a slow machine still checks before it)
    await flush()
    assert pings(server) == 1
    await asyncio.sleep(0.02)
    assert not ended(stream) and failure(server) is None  # still within the timeout
    await asyncio.wait_for(stream.wait(), 10.0)
    assert ended(stream) and stream.code == UNAVAILABLE
    assert "did not answer a ping within 0.5s" in stream.details
    assert told == [1]  # told how many calls it fails, before failing them
    assert failure(server) is not None and not server.proto.conn.usable
    await flush()
    assert goaways(server) == [h2.NO_ERROR]
    assert server.closing  # aborted, as a fatal connection error does


async def test_an_ack_leaves_the_connection_and_its_calls_alone() -> None:
    server = FakeServer(asyncio.get_running_loop())
    stream = open_call(client(server))
    told: list[int] = []
    assert server.proto.probe(0.05, told.append)
    await flush()
    server.proto.data_received(ACK)
    await asyncio.sleep(0.1)  # past the timeout
    assert not stream.done and server.proto.conn.failed is None and told == []
    assert goaways(server) == [] and not server.closing
    assert server.proto.probe(0.05)  # a later verdict pings again
    await flush()
    assert pings(server) == 2


async def test_no_stream_no_ping() -> None:
    server = FakeServer(asyncio.get_running_loop())
    assert not server.proto.probe(0.01)
    await asyncio.sleep(0.05)
    assert pings(server) == 0 and server.proto.conn.failed is None and not server.closing


async def test_one_ping_at_a_time_and_an_outstanding_one_counts() -> None:
    server = FakeServer(asyncio.get_running_loop())
    stream = open_call(client(server))
    server.proto._ping_sent = server.proto.loop.time()  # the keepalive's ping, unanswered so far
    assert server.proto.probe(0.05) and server.proto.probe(0.05)  # the second one: already running
    await flush()
    assert pings(server) == 0  # its ACK answers the probe too
    server.proto.data_received(ACK)
    await asyncio.sleep(0.1)
    assert not stream.done and server.proto.conn.failed is None


async def test_the_probe_timer_ends_with_the_connection() -> None:
    server = FakeServer(asyncio.get_running_loop())
    stream = open_call(client(server))
    told: list[int] = []
    assert server.proto.probe(0.05, told.append)
    server.proto.connection_lost(None)
    assert stream.done and server.proto._probe is None
    await asyncio.sleep(0.1)
    assert told == [] and goaways(server) == []
    assert not server.proto.probe(0.05)  # nothing to ask on a closed connection


async def test_confirm_alive_pings_each_connection_with_calls_and_logs_the_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    busy, idle = FakeServer(loop), FakeServer(loop)
    c = client(busy)
    c._protos.add(idle.proto)
    stream = open_call(c)
    c.confirm_alive(0.05)
    await flush()
    assert (pings(busy), pings(idle)) == (1, 0)
    with caplog.at_level(logging.WARNING, logger="shepherd.engines.h2"):
        await asyncio.wait_for(stream.wait(), 1.0)
    assert stream.code == UNAVAILABLE and idle.proto.conn.failed is None
    assert any(
        "worker grpc://127.0.0.1:1 did not answer a ping within 0.05s after failing its health checks: "
        "failing its 1 in-flight calls" in r.getMessage()
        for r in caplog.records
    )


async def test_a_lazily_read_connection_is_probed_on_its_polls() -> None:
    """Over a ``PolledTransport`` (the KV-event side's connections) the PING leaves at once and its ACK
    is read on the next poll."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.settimeout(2.0)
    ours.setblocking(False)
    lazy = LazyReads()
    proto = H2Protocol(loop, keepalive_s=0)
    t = PolledTransport(ours, proto, lazy)
    lazy._transports.add(t)
    try:
        proto.connection_made(t)
        theirs.sendall(h2.settings_frame({}))
        lazy.poll()
        assert proto.ready.done()
        c = H2EngineClient("grpc://127.0.0.1:1", "127.0.0.1:1", "sglang")
        c._proto = proto
        stream = open_call(c)
        assert proto.probe(0.5)
        await flush()
        got = b""
        for _ in range(50):  # bounded: until the PING is in (the preface, SETTINGS, the call came first)
            got += theirs.recv(65536)
            if any(f[0] == h2.PING for f in parse_frames(got)):
                break
        theirs.sendall(ACK)
        lazy.poll()
        assert proto._probe is None and proto._ping_sent is None  # answered
        await asyncio.sleep(0.6)
        assert not stream.done and proto.conn.failed is None
    finally:
        t.abort()
        theirs.close()


class _Hung:
    """An engine client whose health checks fail; counts the liveness probes it is asked for."""

    def __init__(self) -> None:
        self.confirms: list[float] = []

    async def health_check(self, timeout: float) -> bool:
        return False

    def confirm_alive(self, timeout: float) -> None:
        self.confirms.append(timeout)


async def test_the_registry_asks_once_on_the_turn_to_unhealthy() -> None:
    cfg = build_config({}, {"health_failure_threshold": 2, "health_check_timeout_secs": 0.7})
    reg = WorkerRegistry(cfg)
    eng = _Hung()
    w = Worker(
        "w0",
        "grpc://127.0.0.1:1",
        "m",
        eng,  # type: ignore[arg-type]
        HealthTracker(2, 2, healthy=True, checked=True),
        CircuitBreaker(),
    )
    w.initialized = True
    await reg.check(w)
    assert eng.confirms == []  # one failed check: not yet unhealthy
    await reg.check(w)
    assert not w.health.healthy and eng.confirms == [0.7]
    await reg.check(w)
    await reg.check(w)
    assert eng.confirms == [0.7]  # not on every failed check


def _unread_bytes_in(server: FakeServer, data: bytes) -> tuple[socket.socket, socket.socket]:
    """A socket pair whose first end is the connection's socket, ``data`` waiting in it unread (as when
    the loop lagged: uvloop runs a due timer before reading what waits)."""
    ours, theirs = socket.socketpair()
    if data:
        theirs.sendall(data)
    server.get_extra_info = lambda name, default=None: ours if name == "socket" else default  # type: ignore[method-assign]
    return ours, theirs


async def test_bytes_waiting_in_the_socket_are_read_before_the_probe_fails() -> None:
    server = FakeServer(asyncio.get_running_loop())
    stream = open_call(client(server))
    ours, theirs = _unread_bytes_in(server, ACK)
    try:
        told: list[int] = []
        assert server.proto.probe(0.05, told.append)
        await asyncio.sleep(0.07)  # past the deadline: the ACK is in the socket, not read yet
        assert failure(server) is None and told == []
        server.proto.data_received(ACK)  # the loop reads it
        await asyncio.sleep(0.1)
        assert not ended(stream) and failure(server) is None and told == []
        assert server.proto._probe is None
    finally:
        ours.close()
        theirs.close()


async def test_bytes_waiting_that_never_answer_still_fail_it_and_so_does_an_empty_socket() -> None:
    loop = asyncio.get_running_loop()
    server = FakeServer(loop)
    stream = open_call(client(server))
    ours, theirs = _unread_bytes_in(server, b"\0")  # never read, never an ACK
    try:
        assert server.proto.probe(0.05)
        start = loop.time()
        await asyncio.wait_for(stream.wait(), 3.0)
        assert stream.code == UNAVAILABLE
        assert loop.time() - start >= 0.05 + 0.4  # looked at again, a bounded number of times
    finally:
        ours.close()
        theirs.close()
    server = FakeServer(loop)
    stream = open_call(client(server))
    ours, theirs = _unread_bytes_in(server, b"")
    try:
        assert server.proto.probe(0.05)
        start = loop.time()
        await asyncio.wait_for(stream.wait(), 3.0)
        assert stream.code == UNAVAILABLE and loop.time() - start < 0.3  # nothing waiting: at the deadline
    finally:
        ours.close()
        theirs.close()
