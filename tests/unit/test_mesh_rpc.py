"""MeshRuntime RPC on loopback: real runtimes, real mTLS + sealed frames, bounded polling (no timings).

``rpc(name, payload)`` round-trips to the member's handler, which is told the caller's certificate
identity; callers without a certificate or without the mesh key never reach the handler; the reasons of
``RpcError`` (unknown, suspect, failed, refused) are each produced.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime, RpcError
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.swim_types import PushPull
from shepherd.mesh.transport import PushPullError, push_pull_request
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import Addr, MemberState, PushPullState, RpcRequest
from tests.unit.mesh_fixtures import FAST, KEY, OTHER_KEY, eventually

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2", "n3", "mallory"])


class Cluster:
    def __init__(self, stack: AsyncExitStack, pki: dict[str, TlsFiles]) -> None:
        self.stack = stack
        self.pki = pki

    async def node(self, name: str, seeds: tuple[Addr, ...] = (), **cfg: float) -> MeshRuntime:
        files = self.pki[name]
        # push-pulls one-shot (as before they could be kept) unless a test asks: the tests of the RPC
        # pool count the sessions idle on a server, and FAST's push-pulls every second would add theirs
        cfg.setdefault("keep_push_pull_connections", False)
        rt = MeshRuntime(
            MeshRuntimeConfig(name=name, bind_host="127.0.0.1", bind_port=0, seeds=seeds, swim=FAST, **cfg),  # type: ignore[arg-type]
            Keyring([KEY]),
            server_context(files),
            client_context(files),
            rng=random.Random(name),
        )
        await rt.start()
        self.stack.push_async_callback(rt.abort)
        return rt


@pytest.fixture
async def cluster(pki: dict[str, TlsFiles]) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        yield Cluster(stack, pki)


def alive(nodes: list[MeshRuntime], names: list[str]) -> bool:
    return all(rt.member_state(n) == MemberState.ALIVE for rt in nodes for n in names)


class Recorder:
    def __init__(self, me: str) -> None:
        self.me = me
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, identity: str, payload: bytes) -> bytes:
        self.calls.append((identity, payload))
        if payload == b"boom":
            raise RuntimeError("secret internal detail /etc/shadow")
        return f"{self.me} answers {identity}: ".encode() + payload


async def three(cluster: Cluster) -> tuple[MeshRuntime, MeshRuntime, MeshRuntime]:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,))
    n3 = await cluster.node("n3", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2, n3], ["n1", "n2", "n3"]), what="three alive")
    return n1, n2, n3


async def test_rpc_round_trip_with_certificate_identity(cluster: Cluster) -> None:
    n1, n2, n3 = await three(cluster)
    recs = {rt.me.name: Recorder(rt.me.name) for rt in (n1, n2, n3)}
    for rt in (n1, n2, n3):
        rt.set_rpc_handler(recs[rt.me.name])
    assert await n2.rpc("n1", b"get record 7") == b"n1 answers n2: get record 7"
    assert await n3.rpc("n1", b"x" * 200_000, timeout=10) == b"n1 answers n3: " + b"x" * 200_000
    assert await n1.rpc("n3", b"") == b"n3 answers n1: "
    assert recs["n1"].calls == [("n2", b"get record 7"), ("n3", b"x" * 200_000)]
    # several at once
    replies = await asyncio.gather(*(n2.rpc("n3", str(i).encode()) for i in range(20)))
    assert replies == [f"n3 answers n2: {i}".encode() for i in range(20)]
    # to itself: the local handler, its own name as the identity
    assert await n1.rpc("n1", b"me") == b"n1 answers n1: me"
    assert n2.metrics.rpcs_out >= 21 and n3.metrics.rpcs_in >= 21
    # push-pull keeps working beside RPC frames (a join on demand is a push-pull)
    assert await n3.join([n2.address]) == 1


async def test_rpc_identity_is_the_certificate_not_the_payload(
    cluster: Cluster, pki: dict[str, TlsFiles]
) -> None:
    n1 = await cluster.node("n1")
    rec = Recorder("n1")
    n1.set_rpc_handler(rec)
    # mallory holds the mesh key and a CA certificate, not a member: it still may call, and the
    # handler is told "mallory" whatever the payload claims
    frame = mesh_wire.encode_rpc_request(RpcRequest(b'{"from": "n2"}'))
    reply = await push_pull_request(
        n1.address, client_context(pki["mallory"]), frame, expected_identity="n1", keyring=Keyring([KEY])
    )
    answer = mesh_wire.decode_rpc_reply(reply.payload)
    assert answer.ok and answer.payload == b'n1 answers mallory: {"from": "n2"}'
    assert rec.calls == [("mallory", b'{"from": "n2"}')]


async def test_rpc_needs_a_certificate_and_the_mesh_key(cluster: Cluster, pki: dict[str, TlsFiles]) -> None:
    n1 = await cluster.node("n1")
    rec = Recorder("n1")
    n1.set_rpc_handler(rec)
    frame = mesh_wire.encode_rpc_request(RpcRequest(b"dump"))
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.check_hostname = False
    no_cert.load_verify_locations(cafile=str(pki["n1"].ca))
    with pytest.raises(PushPullError):
        await push_pull_request(n1.address, no_cert, frame, keyring=Keyring([KEY]))
    await eventually(lambda: n1.transport_metrics.tcp_rejected_tls >= 1, what="no-cert refused")
    # a certificate but another mesh key: the sealed frame does not open
    with pytest.raises(PushPullError):
        await push_pull_request(n1.address, client_context(pki["n2"]), frame, keyring=Keyring([OTHER_KEY]))
    await eventually(lambda: n1.transport_metrics.tcp_bad_seal >= 1, what="wrong key refused")
    # a certificate, unsealed frames
    with pytest.raises(PushPullError):
        await push_pull_request(n1.address, client_context(pki["n2"]), frame)
    assert rec.calls == []


async def test_rpc_error_reasons(cluster: Cluster) -> None:
    n1, n2, n3 = await three(cluster)
    n1.set_rpc_handler(Recorder("n1"))
    # unknown: never a member
    with pytest.raises(RpcError) as e:
        await n2.rpc("nobody", b"")
    assert e.value.reason == "unknown"
    # refused: no handler on n3
    with pytest.raises(RpcError) as e:
        await n2.rpc("n3", b"hello")
    assert e.value.reason == "refused" and "no rpc handler" in str(e.value)
    # refused: the handler raised; the caller gets the exception type, no detail, no traceback
    with pytest.raises(RpcError) as e:
        await n2.rpc("n1", b"boom")
    assert e.value.reason == "refused"
    assert "RuntimeError" in str(e.value) and "shadow" not in str(e.value) and "Traceback" not in str(e.value)
    assert n1.metrics.rpcs_in_refused == 1
    # suspect: n2 believes n3 suspected (fed through the machine as a gossip would)
    swim = n2.swim
    m3 = swim.member("n3")
    assert m3 is not None
    from shepherd.proto.mesh_messages import Packet, Suspect

    swim.on_packet(
        asyncio.get_running_loop().time(), n1.address, Packet("n1", (Suspect(m3.incarnation, "n3", "n1"),))
    )
    assert n2.member_state("n3") == MemberState.SUSPECT  # no await since: n3 cannot have refuted yet
    with pytest.raises(RpcError) as e:
        await n2.rpc("n3", b"")
    assert e.value.reason == "suspect"
    # left: n3 leaves gracefully -> unknown
    await n3.close()
    await eventually(lambda: n2.member_state("n3") == MemberState.LEFT, what="n3 LEFT")
    with pytest.raises(RpcError) as e:
        await n2.rpc("n3", b"")
    assert e.value.reason == "unknown"
    # failed: n1 crashes; until n2 notices, an rpc to it cannot connect
    n1_addr_state = n2.member_state("n1")
    await n1.abort()
    if n2.member_state("n1") == n1_addr_state == MemberState.ALIVE:
        with pytest.raises(RpcError) as e:
            await n2.rpc("n1", b"", timeout=2.0)
        assert e.value.reason in ("failed", "suspect", "unknown")


async def test_rpc_failed_when_the_member_answers_with_another_certificate(
    cluster: Cluster, pki: dict[str, TlsFiles]
) -> None:
    # a runtime named n2 but holding mallory's certificate listens at n2's address in n1's view:
    # the caller requires the certificate to name n2, so the rpc fails before the payload is sent
    n1 = await cluster.node("n1")
    rogue = MeshRuntime(
        MeshRuntimeConfig(name="n2", bind_port=0, swim=FAST),
        Keyring([KEY]),
        server_context(pki["mallory"]),
        client_context(pki["mallory"]),
    )
    await rogue.start()
    cluster.stack.push_async_callback(rogue.abort)
    rec = Recorder("rogue")
    rogue.set_rpc_handler(rec)
    from shepherd.proto.mesh_messages import Alive, Packet

    n1.swim.on_packet(
        asyncio.get_running_loop().time(),
        rogue.address,
        Packet("n2", (Alive("n2", rogue.address[0], rogue.address[1], 1),)),
    )
    assert n1.member_state("n2") == MemberState.ALIVE
    with pytest.raises(RpcError) as e:
        await n1.rpc("n2", b"secret question")
    assert e.value.reason == "failed"
    assert rec.calls == []


def test_tcp_frames_are_told_apart() -> None:
    from shepherd.proto.mesh_messages import Member, PushPullState, RpcReply, RpcStatus

    pp = PushPullState((Member("n1", "127.0.0.1", 1, 3, MemberState.ALIVE),), b"u", True)
    assert mesh_wire.decode_tcp_request(mesh_wire.encode_push_pull(pp)) == pp
    assert mesh_wire.decode_push_pull(mesh_wire.encode_push_pull(pp)) == pp
    rq = RpcRequest(b"\x00payload")
    assert mesh_wire.decode_tcp_request(mesh_wire.encode_rpc_request(rq)) == rq
    with pytest.raises(mesh_wire.WireError):
        mesh_wire.decode_push_pull(mesh_wire.encode_rpc_request(rq))  # an old node refuses, cleanly
    rp = RpcReply(RpcStatus.REFUSED, b"", "e" * 1000)
    got = mesh_wire.decode_rpc_reply(mesh_wire.encode_rpc_reply(rp))
    assert not got.ok and got.error == "e" * mesh_wire.MAX_RPC_ERROR_LEN
    with pytest.raises(mesh_wire.WireError):
        mesh_wire.decode_rpc_reply(mesh_wire.encode_push_pull(pp))
    with pytest.raises(mesh_wire.WireError):
        mesh_wire.decode_tcp_request(mesh_wire.encode_rpc_reply(rp))


# ---- kept-alive RPC connections (the pool) ---------------------------------------------------------


async def test_sequential_rpcs_reuse_one_connection(cluster: Cluster) -> None:
    n1, n2, _ = await three(cluster)
    rec = Recorder("n1")
    n1.set_rpc_handler(rec)
    connects, handshakes = n2.metrics.rpc_connects, n2.transport_metrics.tcp_handshakes_out
    push_pulls = n2.metrics.push_pulls_ok + n2.metrics.push_pulls_failed
    for i in range(30):
        assert await n2.rpc("n1", b"q%d" % i) == b"n1 answers n2: q%d" % i
    assert n2.metrics.rpc_connects == connects + 1
    assert n2.metrics.rpcs_reused >= 29 and n2.metrics.rpcs_retried == 0
    # every other TLS handshake of n2 meanwhile was a push-pull of its own
    pp = n2.metrics.push_pulls_ok + n2.metrics.push_pulls_failed - push_pulls
    assert n2.transport_metrics.tcp_handshakes_out - handshakes <= 1 + pp
    assert n2.pooled_connections("n1") == 1 and n2.pooled_connections() == 1
    tcp = n1._tcp
    assert tcp is not None
    await eventually(lambda: tcp.idle_sessions == 1, what="the session idle on n1")
    assert [who for who, _ in rec.calls] == ["n2"] * 30


async def test_server_idle_timeout_and_the_client_reconnects(cluster: Cluster) -> None:
    n1 = await cluster.node("n1", rpc_idle_timeout=0.3)
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    n1.set_rpc_handler(Recorder("n1"))
    assert await n2.rpc("n1", b"a") == b"n1 answers n2: a"
    assert n2.pooled_connections("n1") == 1
    # n1 closes the idle connection; n2's pool notices and forgets it
    await eventually(lambda: n1.transport_metrics.tcp_idle_closed >= 1, what="idle closed")
    await eventually(lambda: n2.pooled_connections("n1") == 0, what="pool emptied")
    connects = n2.metrics.rpc_connects
    assert await n2.rpc("n1", b"b") == b"n1 answers n2: b"
    assert n2.metrics.rpc_connects == connects + 1 and n2.metrics.rpcs_retried == 0


async def test_a_reused_connection_closed_unread_is_retried_once(cluster: Cluster) -> None:
    # the race the pool's watcher cannot close: the server ends the idle session just as the client
    # reuses it. Simulated by silencing the watcher of the pooled connection.
    n1 = await cluster.node("n1", rpc_idle_timeout=0.3)
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    rec = Recorder("n1")
    n1.set_rpc_handler(rec)
    assert await n2.rpc("n1", b"first") == b"n1 answers n2: first"
    (conn,) = n2._pool["n1"]
    conn._stop_watch()
    await eventually(lambda: n1.transport_metrics.tcp_idle_closed >= 1, what="idle closed")
    assert n2.pooled_connections("n1") == 1  # n2 does not know yet
    connects = n2.metrics.rpc_connects
    assert await n2.rpc("n1", b"second") == b"n1 answers n2: second"
    assert n2.metrics.rpcs_retried == 1 and n2.metrics.rpc_connects == connects + 1
    assert [p for _, p in rec.calls] == [b"first", b"second"]  # at most once


async def test_server_restart_on_the_same_address(cluster: Cluster, pki: dict[str, TlsFiles]) -> None:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    n1.set_rpc_handler(Recorder("n1"))
    assert await n2.rpc("n1", b"before") == b"n1 answers n2: before"
    assert n2.pooled_connections("n1") == 1
    port = n1.address[1]
    await n1.abort()  # a crash to the others: n1 stays a member in n2's view
    await eventually(lambda: n2.pooled_connections("n1") == 0, what="pooled connection closed")
    files = pki["n1"]
    again = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_host="127.0.0.1", bind_port=port, seeds=(n2.address,), swim=FAST),
        Keyring([KEY]),
        server_context(files),
        client_context(files),
    )
    for _ in range(100):  # the old sockets are closed by the loop shortly after abort()
        try:
            await again.start()
            break
        except OSError:
            await asyncio.sleep(0.05)
    cluster.stack.push_async_callback(again.abort)
    assert again.running
    rec = Recorder("n1 again")
    again.set_rpc_handler(rec)
    reply = b""
    for _ in range(100):  # n2 may meanwhile suspect n1: bounded retries until it is alive again
        try:
            reply = await n2.rpc("n1", b"after", timeout=2.0)
            break
        except RpcError:
            await asyncio.sleep(0.05)
    assert reply == b"n1 again answers n2: after"
    assert ("n2", b"after") in rec.calls


async def test_concurrent_rpcs_use_several_connections_within_the_bound(cluster: Cluster) -> None:
    n1, n2, _ = await three(cluster)
    in_flight = 0
    peak = 0
    full = asyncio.Event()

    async def slow(identity: str, payload: bytes) -> bytes:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight >= 8:
            full.set()
        try:
            await asyncio.wait_for(full.wait(), 20)
        finally:
            in_flight -= 1
        return payload

    n1.set_rpc_handler(slow)
    connects = n2.metrics.rpc_connects
    replies = await asyncio.gather(*(n2.rpc("n1", b"%d" % i, timeout=30) for i in range(12)))
    assert replies == [b"%d" % i for i in range(12)]
    assert peak == 8 == n2.config.max_rpcs_per_member
    assert n2.metrics.rpc_connects - connects <= 8  # one request in flight per connection
    assert n2.pooled_connections("n1") == n2.config.rpc_pool_per_member == 4
    # the next ones reuse the pool
    connects = n2.metrics.rpc_connects
    assert await asyncio.gather(*(n2.rpc("n1", b"x") for _ in range(4))) == [b"x"] * 4
    assert n2.metrics.rpc_connects == connects


async def test_push_pull_goes_through_while_the_pool_holds_connections(cluster: Cluster) -> None:
    n1 = await cluster.node("n1", max_tcp_sessions=2)
    n2 = await cluster.node("n2", seeds=(n1.address,))
    n3 = await cluster.node("n3", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2, n3], ["n1", "n2", "n3"]), what="three alive")
    gate = asyncio.Event()
    entered = 0

    async def handler(identity: str, payload: bytes) -> bytes:
        nonlocal entered
        entered += 1
        if entered >= 2:
            gate.set()
        await asyncio.wait_for(gate.wait(), 20)
        return b"ok"

    n1.set_rpc_handler(handler)
    # four at once: four connections (two served at a time on n1's two session slots), all pooled
    assert await asyncio.gather(*(n2.rpc("n1", b"q", timeout=20) for _ in range(4))) == [b"ok"] * 4
    assert n2.pooled_connections("n1") == 4
    tcp = n1._tcp
    assert tcp is not None
    await eventually(lambda: tcp.idle_sessions == 4, what="four idle sessions on n1")
    # idle sessions hold no session slot: joins (push-pulls) from both others go through
    assert await n3.join([n1.address]) == 1
    assert await n2.join([n1.address]) == 1
    assert n1.transport_metrics.tcp_rejected_busy == 0
    assert await n2.rpc("n1", b"q") == b"ok" and n2.pooled_connections("n1") == 4


async def test_a_member_that_dies_or_leaves_gets_its_pool_closed(cluster: Cluster) -> None:
    n1, n2, n3 = await three(cluster)
    for rt in (n1, n3):
        rt.set_rpc_handler(Recorder(rt.me.name))
    assert await n2.rpc("n3", b"q") == b"n3 answers n2: q"
    assert await n2.rpc("n1", b"q") == b"n1 answers n2: q"
    assert n2.pooled_connections("n3") == 1 and n2.pooled_connections() == 2
    tcp3 = n3._tcp
    assert tcp3 is not None
    await eventually(lambda: tcp3.idle_sessions == 1, what="idle on n3")
    # n2 is told n3 is dead (n3 itself is fine and refutes later): the pool to n3 goes at once
    from shepherd.proto.mesh_messages import Dead, Packet

    m3 = n2.swim.member("n3")
    assert m3 is not None
    now = asyncio.get_running_loop().time()
    n2._execute(n2.swim.on_packet(now, n1.address, Packet("n1", (Dead(m3.incarnation, "n3", "n1"),))))
    assert n2.member_state("n3") == MemberState.DEAD
    assert n2.pooled_connections("n3") == 0 and n2.pooled_connections() == 1
    await eventually(lambda: tcp3.idle_sessions == 0, what="n3 saw the pooled connection closed")
    # a graceful leave: the same
    await n1.close()
    await eventually(lambda: n2.member_state("n1") == MemberState.LEFT, what="n1 LEFT")
    assert n2.pooled_connections() == 0


async def test_runtime_close_closes_the_pool(cluster: Cluster) -> None:
    n1, n2, _ = await three(cluster)
    n1.set_rpc_handler(Recorder("n1"))
    assert await n2.rpc("n1", b"q") == b"n1 answers n2: q"
    tcp = n1._tcp
    assert tcp is not None
    await eventually(lambda: tcp.idle_sessions == 1, what="idle on n1")
    await n2.abort()
    assert n2.pooled_connections() == 0
    await eventually(lambda: tcp.idle_sessions == 0, what="n1 saw the pooled connection closed")
    assert n1.transport_metrics.tcp_idle_closed == 0  # closed by the client, not timed out


async def test_one_shot_server_keeps_working_with_pooling_clients(cluster: Cluster) -> None:
    # an older node (one request per connection): rpc_idle_timeout=0 behaves the same
    n1 = await cluster.node("n1", rpc_idle_timeout=0)
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    rec = Recorder("n1")
    n1.set_rpc_handler(rec)
    for i in range(5):
        assert await n2.rpc("n1", b"%d" % i) == b"n1 answers n2: %d" % i
    assert [p for _, p in rec.calls] == [b"%d" % i for i in range(5)]
    tcp = n1._tcp
    assert tcp is not None and tcp.idle_sessions == 0


# ---- push-pulls over a kept connection ---------------------------------------------------------------


async def test_push_pulls_reuse_the_kept_connection(cluster: Cluster) -> None:
    n1 = await cluster.node("n1", keep_push_pull_connections=True)
    n2 = await cluster.node("n2", seeds=(n1.address,), keep_push_pull_connections=True)
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    await eventually(lambda: n2.kept_push_pull_connections() == ["n1"], what="n2 keeps its connection")
    handshakes, ok = n2.transport_metrics.tcp_handshakes_out, n2.metrics.push_pulls_ok
    # FAST: a push-pull a second each way; the join was the only new connection n2 needed
    await eventually(lambda: n2.metrics.push_pulls_ok >= ok + 3, what="three more push-pulls by n2")
    assert n2.metrics.push_pulls_reused >= 3 and n2.metrics.push_pulls_failed == 0
    assert n2.transport_metrics.tcp_handshakes_out == handshakes
    assert n1.metrics.push_pulls_reused >= 1 and n1.kept_push_pull_connections() == ["n2"]
    assert n2.pooled_connections() == 0  # not the RPC pool's
    # a member that dies: its kept connection is closed at once
    from shepherd.proto.mesh_messages import Dead, Packet

    m1 = n2.swim.member("n1")
    assert m1 is not None
    now = asyncio.get_running_loop().time()
    n2._execute(n2.swim.on_packet(now, n1.address, Packet("n1", (Dead(m1.incarnation, "n1", "n2"),))))
    assert n2.member_state("n1") == MemberState.DEAD and n2.kept_push_pull_connections() == []


async def test_a_kept_push_pull_connection_the_server_closed(cluster: Cluster) -> None:
    # n1 ends idle sessions after 0.3 s, before n2's next push-pull (a second): n2 notices the close
    # and dials again; and when it does not notice (watcher silenced), the push-pull is sent again
    n1 = await cluster.node("n1", rpc_idle_timeout=0.3)
    n2 = await cluster.node("n2", seeds=(n1.address,), keep_push_pull_connections=True)
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    ok = n2.metrics.push_pulls_ok
    await eventually(lambda: n2.metrics.push_pulls_ok >= ok + 2, what="two push-pulls")
    assert n2.metrics.push_pulls_failed == 0 and n2.metrics.push_pulls_reused == 0
    await eventually(lambda: n2.kept_push_pull_connections() == ["n1"], what="a kept connection")
    conn = n2._pp_conns["n1"]
    conn._stop_watch()
    closed = n1.transport_metrics.tcp_idle_closed
    await eventually(lambda: n1.transport_metrics.tcp_idle_closed > closed, what="n1 closed it")
    assert await n2._spawn_push_pull(PushPull(n1.address, "n1", False)) is True
    assert n2.metrics.push_pulls_retried >= 1 and n2.metrics.push_pulls_failed == 0


async def test_a_push_pull_reply_refused_does_not_keep_its_connection(cluster: Cluster) -> None:
    # the connection is kept only once its reply was read and valid: n1 now replies with a state that
    # leaves itself out (refused by n2's check), so the connection that carried it is closed, not parked
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,), keep_push_pull_connections=True)
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="two alive")
    await eventually(lambda: n2.kept_push_pull_connections() == ["n1"], what="a kept connection")
    conn = n2._pp_conns["n1"]
    real = n1.swim.local_push_pull

    def without_n1(join: bool = False) -> PushPullState:
        return PushPullState(tuple(m for m in real(join).members if m.name != "n1"), b"", join)

    n1.swim.local_push_pull = without_n1  # type: ignore[method-assign]
    refused, reused = n2.metrics.push_pulls_refused, n2.metrics.push_pulls_reused
    assert await n2._spawn_push_pull(PushPull(n1.address, "n1", False)) is False
    assert n2.metrics.push_pulls_refused > refused
    assert n2.metrics.push_pulls_reused > reused  # it went over the kept connection
    assert conn.closed and n2.kept_push_pull_connections() == []
    # valid replies again: a new connection is kept
    n1.swim.local_push_pull = real  # type: ignore[method-assign]
    assert await n2._spawn_push_pull(PushPull(n1.address, "n1", False)) is True
    assert n2.kept_push_pull_connections() == ["n1"] and n2._pp_conns["n1"] is not conn
