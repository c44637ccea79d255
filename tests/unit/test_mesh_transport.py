"""Mesh transports on loopback: sealed UDP, length-prefixed frames, mTLS push-pull with cert identity."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.transport import (
    Addr,
    FrameError,
    PushPullError,
    PushPullServer,
    TransportMetrics,
    UdpEndpoint,
    push_pull_request,
    read_frame,
    write_frame,
)

pytestmark = pytest.mark.timeout(60)

K1 = bytes(range(32))
K2 = bytes(range(1, 33))


async def _eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    out = tmp_path_factory.mktemp("pki")
    files = write_dev_pki(out, ["alpha", "beta", "mallory"])
    foreign = write_dev_pki(out / "foreign", ["beta"])
    files["foreign-beta"] = foreign["beta"]
    return files


# --- UDP --------------------------------------------------------------------------------------------


async def test_udp_sealed_round_trip() -> None:
    got_a: list[tuple[bytes, Addr]] = []
    got_b: list[tuple[bytes, Addr]] = []
    a = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: got_a.append((d, s)))
    b = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: got_b.append((d, s)))
    try:
        assert a.send(b"ping", b.address)
        await _eventually(lambda: len(got_b) == 1)
        assert got_b[0] == (b"ping", a.address)
        assert b.send(b"ack" * 400, a.address)
        await _eventually(lambda: len(got_a) == 1)
        assert got_a[0][0] == b"ack" * 400
        assert a.metrics.udp_packets_out == 1 and b.metrics.udp_packets_in == 1
        assert a.metrics.udp_bytes_out == len(b"ping") + 29 == b.metrics.udp_bytes_in
    finally:
        a.close()
        b.close()
    assert a.closed and not a.send(b"x", b.address)


async def test_udp_send_dropped_while_the_transport_holds_more_than_max_buffer() -> None:
    got: list[bytes] = []
    b = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: got.append(d))
    full = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: None, max_buffer=-1)
    ok = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: None, max_buffer=0)
    try:
        # an empty buffer (0 bytes queued) is over a bound of -1 and within a bound of 0
        assert not full.send(b"dropped", b.address)
        assert full.metrics.udp_dropped_backpressure == 1 and full.metrics.udp_packets_out == 0
        assert ok.send(b"sent", b.address)
        await _eventually(lambda: got == [b"sent"])
        assert ok.metrics.udp_dropped_backpressure == 0
    finally:
        b.close()
        full.close()
        ok.close()


async def test_udp_wrong_key_and_plaintext_dropped_and_counted() -> None:
    got: list[bytes] = []
    good = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: got.append(d))
    intruder = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K2]), lambda d, s: None)
    raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        intruder.send(b"join me", good.address)
        raw.sendto(b"plain text gossip", good.address)
        raw.sendto(Keyring([K1], cluster="other").seal(b"other cluster"), good.address)
        await _eventually(lambda: good.metrics.udp_dropped_bad_seal == 3)
        assert got == []
        assert good.metrics.udp_packets_in == 0
        # a node holding the key as a secondary (rotation) still gets through
        rotated = Keyring([K2, K1])
        assert rotated.primary == K2
        good.keyring.add_key(K2)
        intruder.keyring.add_key(K1)
        intruder.send(b"now trusted", good.address)
        await _eventually(lambda: got == [b"now trusted"])
    finally:
        raw.close()
        good.close()
        intruder.close()


async def test_udp_handler_errors_are_counted_not_raised() -> None:
    def boom(data: bytes, src: Addr) -> None:
        raise ValueError("bad message")

    a = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), boom)
    b = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), boom)
    try:
        b.send(b"x", a.address)
        await _eventually(lambda: a.metrics.udp_handler_errors == 1)
        assert a.send(b"still alive", b.address)
    finally:
        a.close()
        b.close()


async def test_udp_oversize_dropped() -> None:
    a = await UdpEndpoint.open("127.0.0.1", 0, Keyring([K1]), lambda d, s: None)
    try:
        assert not a.send(b"x" * 65500, ("127.0.0.1", 9))
        assert a.metrics.udp_dropped_oversize == 1
    finally:
        a.close()


# --- frames -----------------------------------------------------------------------------------------


async def _pipe() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Callable[[], Awaitable[None]]]:
    """A loopback TCP pair: (reader of the server side, writer of the client side, closer)."""
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accepted.put((r, w))

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    _, cw = await asyncio.open_connection("127.0.0.1", port)
    sr, sw = await asyncio.wait_for(accepted.get(), 5)

    async def close() -> None:
        cw.close()
        sw.close()
        srv.close()

    return sr, cw, close


async def test_frames_round_trip_and_bounds() -> None:
    reader, writer, close = await _pipe()
    try:
        for payload in (b"", b"a", b"x" * 100_000):
            await write_frame(writer, payload)
            assert await read_frame(reader) == payload
        with pytest.raises(FrameError):
            await write_frame(writer, b"y" * 1001, max_size=1000)
        # a peer announcing a frame over the bound is refused before reading the body
        writer.write((1 << 30).to_bytes(4, "big"))
        await writer.drain()
        with pytest.raises(FrameError):
            await read_frame(reader, max_size=16 * 1024 * 1024)
    finally:
        await close()


async def test_frame_read_timeout_and_truncation() -> None:
    reader, writer, close = await _pipe()
    try:
        writer.write(b"\x00\x00")  # half a header, then silence
        await writer.drain()
        with pytest.raises(TimeoutError):
            await read_frame(reader, timeout=0.1)
        writer.write(b"\x00\x10abc")
        await writer.drain()
        writer.close()
        with pytest.raises(FrameError):
            await read_frame(reader, timeout=5)
    finally:
        await close()


# --- push-pull over mTLS ----------------------------------------------------------------------------


@pytest.fixture
async def server(pki: dict[str, TlsFiles]) -> AsyncIterator[tuple[PushPullServer, list[tuple[str, bytes]]]]:
    calls: list[tuple[str, bytes]] = []

    async def handler(identity: str, request: bytes) -> bytes:
        calls.append((identity, request))
        return b"state-of-alpha:" + request

    srv = await PushPullServer.start("127.0.0.1", 0, server_context(pki["alpha"]), handler, timeout=3.0)
    try:
        yield srv, calls
    finally:
        await srv.close()


async def test_push_pull_exchange_uses_cert_identity(
    pki: dict[str, TlsFiles], server: tuple[PushPullServer, list[tuple[str, bytes]]]
) -> None:
    srv, calls = server
    m = TransportMetrics()
    reply = await push_pull_request(
        srv.address, client_context(pki["beta"]), b"state-of-beta", metrics=m, expected_identity="alpha"
    )
    assert reply.identity == "alpha"
    assert reply.payload == b"state-of-alpha:state-of-beta"
    assert calls == [("beta", b"state-of-beta")]
    assert m.tcp_sessions_out == 1 and srv.metrics.tcp_sessions_in == 1
    assert srv.metrics.tcp_bytes_in == len(b"state-of-beta") + 4


async def test_push_pull_identity_is_the_cert_not_the_claim(
    pki: dict[str, TlsFiles], server: tuple[PushPullServer, list[tuple[str, bytes]]]
) -> None:
    srv, calls = server
    # mallory's certificate, payload claiming to be beta: the handler is told "mallory"
    await push_pull_request(srv.address, client_context(pki["mallory"]), b'{"node": "beta"}')
    assert calls == [("mallory", b'{"node": "beta"}')]


async def test_push_pull_client_refuses_unexpected_server(
    pki: dict[str, TlsFiles], server: tuple[PushPullServer, list[tuple[str, bytes]]]
) -> None:
    srv, calls = server
    with pytest.raises(PushPullError):
        await push_pull_request(
            srv.address, client_context(pki["beta"]), b"secret", expected_identity="gamma"
        )
    await _eventually(lambda: srv.metrics.tcp_errors_in == 1)
    assert calls == []


async def test_push_pull_foreign_ca_client_refused(
    pki: dict[str, TlsFiles], server: tuple[PushPullServer, list[tuple[str, bytes]]]
) -> None:
    srv, calls = server
    foreign = pki["foreign-beta"]
    ctx = client_context(TlsFiles(cert=foreign.cert, key=foreign.key, ca=pki["alpha"].ca))
    with pytest.raises(PushPullError):
        await push_pull_request(srv.address, ctx, b"inject")
    await _eventually(lambda: srv.metrics.tcp_rejected_tls == 1)
    assert calls == []


async def test_push_pull_client_without_cert_refused(
    pki: dict[str, TlsFiles], server: tuple[PushPullServer, list[tuple[str, bytes]]]
) -> None:
    srv, calls = server
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(pki["alpha"].ca))
    with pytest.raises(PushPullError):
        await push_pull_request(srv.address, ctx, b"read your state")
    await _eventually(lambda: srv.metrics.tcp_rejected_tls == 1)
    assert calls == []


async def test_push_pull_plain_tcp_refused(server: tuple[PushPullServer, list[tuple[str, bytes]]]) -> None:
    srv, calls = server
    reader, writer = await asyncio.open_connection(*srv.address)
    try:
        await write_frame(writer, b"plaintext state")
        with pytest.raises((FrameError, ConnectionError)):
            await read_frame(reader, timeout=5)
    finally:
        writer.close()
    await _eventually(lambda: srv.metrics.tcp_rejected_tls == 1)
    assert calls == []


async def test_push_pull_client_refuses_foreign_server(pki: dict[str, TlsFiles]) -> None:
    foreign = pki["foreign-beta"]

    async def handler(identity: str, request: bytes) -> bytes:
        return b"poison"

    ctx = server_context(TlsFiles(cert=foreign.cert, key=foreign.key, ca=pki["alpha"].ca))
    srv = await PushPullServer.start("127.0.0.1", 0, ctx, handler, timeout=3.0)
    try:
        with pytest.raises(PushPullError):
            await push_pull_request(srv.address, client_context(pki["alpha"]), b"x")
    finally:
        await srv.close()


async def test_push_pull_frame_bound_enforced(pki: dict[str, TlsFiles]) -> None:
    calls: list[str] = []

    async def handler(identity: str, request: bytes) -> bytes:
        calls.append(identity)
        return b"ok"

    srv = await PushPullServer.start(
        "127.0.0.1", 0, server_context(pki["alpha"]), handler, max_frame=1024, timeout=3.0
    )
    try:
        client = client_context(pki["beta"])
        with pytest.raises(PushPullError):
            await push_pull_request(srv.address, client, b"z" * 4096, max_frame=1 << 20)
        await _eventually(lambda: srv.metrics.tcp_errors_in == 1)
        assert calls == []
        assert (await push_pull_request(srv.address, client, b"small")).payload == b"ok"
    finally:
        await srv.close()


async def test_push_pull_server_close_cancels_stuck_sessions(pki: dict[str, TlsFiles]) -> None:
    entered = asyncio.Event()

    async def handler(identity: str, request: bytes) -> bytes:
        entered.set()
        await asyncio.sleep(3600)
        return b""

    srv = await PushPullServer.start("127.0.0.1", 0, server_context(pki["alpha"]), handler, timeout=30.0)
    client = asyncio.create_task(
        push_pull_request(srv.address, client_context(pki["beta"]), b"x", timeout=30.0)
    )
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(srv.close(), 5)
    with pytest.raises(PushPullError):
        await asyncio.wait_for(client, 5)


async def test_push_pull_unreachable(pki: dict[str, TlsFiles], tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    m = TransportMetrics()
    with pytest.raises(PushPullError):
        await push_pull_request(("127.0.0.1", port), client_context(pki["beta"]), b"x", metrics=m, timeout=2)
    assert m.tcp_errors_out == 1


async def test_push_pull_sealed_frames_need_the_mesh_key(pki: dict[str, TlsFiles]) -> None:
    calls: list[bytes] = []

    async def handler(identity: str, request: bytes) -> bytes:
        calls.append(request)
        return b"answer"

    srv = await PushPullServer.start(
        "127.0.0.1", 0, server_context(pki["alpha"]), handler, keyring=Keyring([K1]), timeout=3.0
    )
    try:
        client = client_context(pki["beta"])
        reply = await push_pull_request(srv.address, client, b"hello", keyring=Keyring([K1, K2]))
        assert reply.payload == b"answer" and calls == [b"hello"]
        # valid certificate, wrong mesh key: refused before the handler
        with pytest.raises(PushPullError):
            await push_pull_request(srv.address, client, b"inject", keyring=Keyring([K2]))
        await _eventually(lambda: srv.metrics.tcp_bad_seal == 1)
        # valid certificate, no sealing at all: refused too
        with pytest.raises(PushPullError):
            await push_pull_request(srv.address, client, b"inject")
        await _eventually(lambda: srv.metrics.tcp_bad_seal == 2)
        assert calls == [b"hello"]
    finally:
        await srv.close()


async def test_a_connection_cancelled_before_its_first_step_is_closed_quietly(
    server: tuple[PushPullServer, list[tuple[str, bytes]]],
) -> None:
    """A node stopping as a peer connects: the loop's teardown cancels the connection's task before it
    ran. asyncio's own stream callback asked that task for its exception, which raises, and logged it as
    an error with a traceback (a --procs child failing its start beside a forming mesh); the server's
    own task bookkeeping closes the transport and says nothing."""
    srv, _ = server
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return ("127.0.0.1", 1) if name == "peername" else default

    class Writer:
        transport = Transport()

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return self.transport.get_extra_info(name, default)

    try:
        writer = Writer()
        srv._accept(asyncio.StreamReader(), writer)  # type: ignore[arg-type]
        (task,) = srv._accepting
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.cancelled() and not srv._accepting
        assert writer.transport.aborted and errors == []
    finally:
        loop.set_exception_handler(None)
