"""Kept-alive mTLS sessions of the push-pull server (the RPC channel), on loopback, no timings.

A handler that calls ``keep_session_open`` keeps its connection for the same peer's next request; an
idle session holds no session slot; idle sessions are bounded per peer and in all (the oldest goes);
the server closes an idle session gracefully (close_notify) only before reading a request, which the
client reports as ``ClosedBeforeRequest`` (safe to send again), and anything else as ``PushPullError``.
Push-pull exchanges (no ``keep_session_open``) stay one request, one reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.transport import (
    ClosedBeforeRequest,
    KeptConnection,
    PushPullError,
    PushPullServer,
    SessionRefused,
    TransportMetrics,
    keep_session_open,
    push_pull_request,
)

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(32))


async def eventually(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout} s")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["alpha", "beta", "gamma"])


class Handler:
    """Keeps the session open for requests starting with b"rpc"; b"rpc-refuse" is refused after it was
    read (an abort: the client must not retry it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, identity: str, request: bytes) -> bytes:
        self.calls.append((identity, request))
        if request.startswith(b"rpc"):
            keep_session_open()
        if request == b"rpc-refuse":
            raise SessionRefused("no")
        return b"re:" + request


async def start(pki: dict[str, TlsFiles], handler: Handler, **kw: float) -> PushPullServer:
    return await PushPullServer.start(
        "127.0.0.1",
        0,
        server_context(pki["alpha"]),
        handler,
        keyring=Keyring([KEY]),
        timeout=5.0,
        **kw,  # type: ignore[arg-type]
    )


async def connect(srv: PushPullServer, pki: dict[str, TlsFiles], who: str = "beta") -> KeptConnection:
    return await KeptConnection.open(srv.address, client_context(pki[who]), expected_identity="alpha")


async def ask(conn: KeptConnection, payload: bytes) -> bytes:
    return await conn.exchange(payload, keyring=Keyring([KEY]))


async def test_one_connection_serves_many_requests_with_one_identity(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h)
    m = TransportMetrics()
    try:
        conn = await KeptConnection.open(
            srv.address, client_context(pki["beta"]), expected_identity="alpha", metrics=m
        )
        for i in range(20):
            assert await ask(conn, b"rpc %d" % i) == b"re:rpc %d" % i
        assert m.tcp_handshakes_out == 1 and srv.metrics.tcp_sessions_in == 1
        assert srv.metrics.tcp_requests_in == 20
        assert {who for who, _ in h.calls} == {"beta"}  # the certificate's, bound to the connection
        await eventually(lambda: srv.idle_sessions == 1, what="session idle")
        conn.close()  # the client ends it between requests: the server closes quietly
        await eventually(lambda: srv.idle_sessions == 0, what="session ended")
        assert srv.metrics.tcp_errors_in == 0 and srv.metrics.tcp_idle_closed == 0
        with pytest.raises(PushPullError):
            await ask(conn, b"rpc")
    finally:
        await srv.close()


async def test_push_pull_stays_one_shot_and_one_shot_rpc_clients_work(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h)
    try:
        # a push-pull (no keep_session_open): one reply, then the server closes
        reply = await push_pull_request(
            srv.address, client_context(pki["beta"]), b"state", keyring=Keyring([KEY])
        )
        assert reply.payload == b"re:state"
        # an RPC frame from a one-shot client (an older node): it closes after the reply, quietly
        reply = await push_pull_request(
            srv.address, client_context(pki["beta"]), b"rpc", keyring=Keyring([KEY])
        )
        assert reply.payload == b"re:rpc"
        await eventually(lambda: srv.metrics.tcp_sessions_in == 2 and srv.idle_sessions == 0, what="ended")
        assert srv.metrics.tcp_errors_in == 0
        # a kept connection to a push-pull handler: the server closed after the reply, and the next
        # request is reported as not read (close_notify before any reply byte)
        conn = await connect(srv, pki)
        assert await ask(conn, b"state 2") == b"re:state 2"
        with pytest.raises(ClosedBeforeRequest):
            await ask(conn, b"state 3")
        assert [c for _, c in h.calls] == [b"state", b"rpc", b"state 2"]
    finally:
        await srv.close()


async def test_idle_timeout_closes_gracefully_and_the_request_is_not_read(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h, idle_timeout=0.2)
    try:
        conn = await connect(srv, pki)
        assert await ask(conn, b"rpc 1") == b"re:rpc 1"
        await eventually(lambda: srv.metrics.tcp_idle_closed == 1, what="idle timeout")
        with pytest.raises(ClosedBeforeRequest):
            await ask(conn, b"rpc 2")
        assert conn.closed and [c for _, c in h.calls] == [b"rpc 1"]
        # parked, the watcher sees the close at once
        conn = await connect(srv, pki)
        assert await ask(conn, b"rpc 3") == b"re:rpc 3"
        lost: list[KeptConnection] = []
        conn.park(lost.append)
        await eventually(lambda: lost == [conn], what="watcher saw the close")
        assert not await conn.unpark()
    finally:
        await srv.close()


async def test_a_request_read_then_refused_is_not_reported_as_unread(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h)
    try:
        conn = await connect(srv, pki)
        assert await ask(conn, b"rpc") == b"re:rpc"
        with pytest.raises(PushPullError) as e:
            await ask(conn, b"rpc-refuse")
        assert not isinstance(e.value, ClosedBeforeRequest)  # it was read: never sent again
        assert [c for _, c in h.calls] == [b"rpc", b"rpc-refuse"]
    finally:
        await srv.close()


async def test_request_cap_per_connection(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h, max_session_requests=2)
    try:
        conn = await connect(srv, pki)
        assert await ask(conn, b"rpc 1") == b"re:rpc 1"
        assert await ask(conn, b"rpc 2") == b"re:rpc 2"
        with pytest.raises(ClosedBeforeRequest):
            await ask(conn, b"rpc 3")
        assert len(h.calls) == 2
    finally:
        await srv.close()


async def test_idle_sessions_hold_no_slot_and_are_bounded(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h, max_sessions=1, max_idle_per_peer=2, max_idle=3)
    conns: list[KeptConnection] = []
    try:
        for _ in range(2):
            conns.append(await connect(srv, pki, "beta"))
            assert await ask(conns[-1], b"rpc") == b"re:rpc"
        await eventually(lambda: srv.idle_sessions == 2, what="two idle")
        # one session slot, two idle sessions: a push-pull still gets through at once
        reply = await push_pull_request(
            srv.address, client_context(pki["gamma"]), b"pp", keyring=Keyring([KEY])
        )
        assert reply.payload == b"re:pp" and srv.metrics.tcp_rejected_busy == 0
        # a third idle session of beta: its oldest is closed (gracefully: not read, safe to resend)
        conns.append(await connect(srv, pki, "beta"))
        assert await ask(conns[-1], b"rpc") == b"re:rpc"
        await eventually(lambda: srv.metrics.tcp_idle_evicted == 1, what="per-peer cap")
        with pytest.raises(ClosedBeforeRequest):
            await ask(conns[0], b"rpc again")
        # the global cap (3): gamma's two idle sessions push beta's oldest out
        for _ in range(2):
            conns.append(await connect(srv, pki, "gamma"))
            assert await ask(conns[-1], b"rpc") == b"re:rpc"
        await eventually(lambda: srv.metrics.tcp_idle_evicted == 2, what="global cap")
        assert srv.idle_sessions == 3
        with pytest.raises(ClosedBeforeRequest):
            await ask(conns[1], b"rpc again")
        assert await ask(conns[2], b"rpc 2") == b"re:rpc 2"  # the newest of beta is kept
        assert b"rpc again" not in [c for _, c in h.calls]
    finally:
        for c in conns:
            c.close()
        await srv.close()


async def test_server_close_ends_idle_sessions_gracefully(pki: dict[str, TlsFiles]) -> None:
    h = Handler()
    srv = await start(pki, h)
    conn = await connect(srv, pki)
    try:
        assert await ask(conn, b"rpc") == b"re:rpc"
        await eventually(lambda: srv.idle_sessions == 1, what="idle")
        lost: list[KeptConnection] = []
        conn.park(lost.append)
    finally:
        await srv.close()
    await eventually(lambda: lost == [conn], what="client saw the close")
    assert srv.metrics.tcp_idle_closed == 1
