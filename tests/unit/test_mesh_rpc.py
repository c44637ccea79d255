"""MeshRuntime RPC on loopback: real runtimes, real mTLS + sealed frames, bounded polling (no timings).

``rpc(name, payload)`` round-trips to the member's handler, which is told the caller's certificate
identity; callers without a certificate or without the mesh key never reach the handler; the reasons of
``RpcError`` (unknown, suspect, failed, refused) are each produced.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime, RpcError
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.swim_types import SwimConfig
from shepherd.mesh.transport import PushPullError, push_pull_request
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import Addr, MemberState, RpcRequest

pytestmark = pytest.mark.timeout(90)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

FAST = SwimConfig(
    probe_interval=0.2,
    probe_timeout=0.1,
    nack_timeout=0.08,
    suspicion_mult=3,
    suspicion_max_timeout_mult=3,
    gossip_interval=0.05,
    push_pull_interval=1.0,
    reconnect_interval=0.5,
    join_retry_interval=0.1,
    join_retry_max_interval=0.5,
    gossip_to_the_dead_time=60.0,
)


async def eventually(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2", "n3", "mallory"])


class Cluster:
    def __init__(self, stack: AsyncExitStack, pki: dict[str, TlsFiles]) -> None:
        self.stack = stack
        self.pki = pki

    async def node(self, name: str, seeds: tuple[Addr, ...] = (), **cfg: float) -> MeshRuntime:
        files = self.pki[name]
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
