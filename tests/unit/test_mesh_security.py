"""Attacks on the mesh through the real codec, transport and runtime (loopback), one per finding:

1. a forged ``Suspect`` at the top incarnation cannot silence a node;
2. idle TCP connects (no certificate) do not starve push-pull / RPC;
3. a captured datagram replayed later (after a leave) or at once is refused;

and the precedence rules behind them on the pure state machine. Bounded polling, no timed assertions.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.replay import ReplayGuard
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.swim import Swim
from shepherd.mesh.swim_types import NullDelegate, SwimConfig
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import Addr, Alive, Dead, MemberState, NodeAddr, Packet, Suspect
from shepherd.proto.mesh_wire import MAX_INCARNATION
from tests.unit.mesh_fixtures import FAST, KEY, eventually

pytestmark = pytest.mark.timeout(120)

ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2", "n3"])


class Cluster:
    def __init__(self, stack: AsyncExitStack, pki: dict[str, TlsFiles]) -> None:
        self.stack = stack
        self.pki = pki

    async def node(self, name: str, seeds: tuple[Addr, ...] = (), **cfg: Any) -> MeshRuntime:
        files = self.pki[name]
        cfg.setdefault("swim", FAST)
        rt = MeshRuntime(
            MeshRuntimeConfig(name=name, bind_host="127.0.0.1", bind_port=0, seeds=seeds, **cfg),
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
    return all(rt.member_state(n) == ALIVE for rt in nodes for n in names)


class Forger:
    """A holder of the mesh key (no certificate): seals datagrams of its own making."""

    def __init__(self, stamp_ms: Callable[[], int] | None = None) -> None:
        self.keyring = Keyring([KEY])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.seq = 10**18

    def send(self, dest: Addr, sender: str, *msgs: Any, stamp: tuple[int, int] | None = None) -> None:
        import time

        self.seq += 1
        st = stamp if stamp is not None else (int(time.time() * 1000), self.seq)
        raw = mesh_wire.encode_packet(list(msgs), budget=60_000, sender=sender, stamp=st)
        self.sock.sendto(self.keyring.seal(raw), dest)

    def send_raw_fields(self, dest: Addr, fields: list[Any]) -> None:
        import msgpack  # type: ignore[import-untyped]

        self.sock.sendto(self.keyring.seal(msgpack.packb(fields, use_bin_type=True)), dest)

    def close(self) -> None:
        self.sock.close()


# ---- 1. incarnations ------------------------------------------------------------------------------


async def test_suspect_at_2_64_minus_1_cannot_silence_a_node(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="joined")
    forger = Forger()
    try:
        # the reported datagram: Suspect(2^64 - 1, n2), sealed with the mesh key, sent to n2
        import time

        stamp = [int(time.time() * 1000), 10**18]
        forger.send_raw_fields(n2.address, [1, "n1", [[6, 2**64 - 1, "n2", "n1"]], *stamp])
        await eventually(lambda: n2.metrics.wire_errors >= 1, what="the out-of-range incarnation refused")
        assert n2.swim.incarnation < 2**32
        # the largest accepted accusation: n2 refutes at the bound, and keeps refuting there
        forger.send(n2.address, "n1", Suspect(MAX_INCARNATION, "n2", "n1"))
        await eventually(lambda: n2.swim.incarnation == MAX_INCARNATION, what="n2 refuted at the bound")
        await eventually(
            lambda: (
                (m := n1.swim.member("n2")) is not None
                and m.incarnation == MAX_INCARNATION
                and m.state == ALIVE
            ),
            what="n1 holds n2 alive at the bound",
        )
        for _ in range(3):  # accused again and again at the bound: it is never declared dead
            forger.send(n1.address, "n3", Suspect(MAX_INCARNATION, "n2", "n3"))
            await eventually(lambda: n1.member_state("n2") != ALIVE, timeout=5, what="n1 suspects n2")
            await eventually(lambda: n1.member_state("n2") == ALIVE, what="n2's refutation at the bound wins")
        assert n2.metrics.encode_errors == 0
        assert n1.member_state("n2") == ALIVE and n2.running
    finally:
        forger.close()


def _swim(name: str = "me") -> Swim:
    sw = Swim(SwimConfig(), NodeAddr(name, "10.0.0.1", 7946), random.Random(1), NullDelegate())
    sw.start(0.0, [])
    return sw


def test_refutation_saturates_and_the_bound_breaks_ties_for_alive_not_left() -> None:
    me = _swim()
    me.on_packet(1.0, ("10.0.0.2", 1), Packet("x", (Suspect(MAX_INCARNATION, "me", "x"),)))
    assert me.incarnation == MAX_INCARNATION
    me.on_packet(1.1, ("10.0.0.2", 1), Packet("x", (Dead(MAX_INCARNATION, "me", "x"),)))
    assert me.incarnation == MAX_INCARNATION  # still refutes (an Alive at the bound), never overflows
    me.set_meta(1.2, b"m")
    assert me.incarnation == MAX_INCARNATION
    # every message a node at the bound sends still encodes
    mesh_wire.encode_msg(Alive("me", "10.0.0.1", 7946, me.incarnation))

    other = _swim("o")
    src = ("10.0.0.2", 1)
    other.on_packet(1.0, src, Packet("b", (Alive("b", "10.0.0.3", 1, MAX_INCARNATION),)))
    other.on_packet(1.1, src, Packet("c", (Suspect(MAX_INCARNATION, "b", "c"),)))
    assert other.member("b").state == SUSPECT  # type: ignore[union-attr]
    other.on_packet(1.2, src, Packet("b", (Alive("b", "10.0.0.3", 1, MAX_INCARNATION),)))
    assert other.member("b").state == ALIVE  # type: ignore[union-attr]
    # a leave at the bound is final: the same Alive does not bring it back
    other.on_packet(1.3, src, Packet("b", (Dead(MAX_INCARNATION, "b", "b"),)))
    assert other.member("b").state == LEFT  # type: ignore[union-attr]
    other.on_packet(1.4, src, Packet("b", (Alive("b", "10.0.0.3", 1, MAX_INCARNATION),)))
    assert other.member("b").state == LEFT  # type: ignore[union-attr]
    # below the bound, a left member's old incarnation stays left too
    other.on_packet(1.5, src, Packet("c", (Alive("c", "10.0.0.4", 1, 7),)))
    other.on_packet(1.6, src, Packet("c", (Dead(7, "c", "c"),)))
    other.on_packet(1.7, src, Packet("c", (Alive("c", "10.0.0.4", 1, 7),)))
    assert other.member("c").state == LEFT  # type: ignore[union-attr]


def test_out_of_range_incarnations_neither_encode_nor_decode() -> None:
    import msgpack

    for fields in ([5, "n", "h", 1, 2**63, b""], [6, 2**63, "n", "s"], [7, 2**64 - 1, "n", "s"]):
        with pytest.raises(mesh_wire.WireError):
            mesh_wire.decode_packet(msgpack.packb([1, "s", [fields]], use_bin_type=True))
    with pytest.raises(mesh_wire.WireError):
        mesh_wire.encode_msg(Suspect(2**63, "n", "s"))


# ---- 2. connect flood -----------------------------------------------------------------------------


async def _idle_connects(addr: Addr, n: int, source: str) -> list[socket.socket]:
    """``n`` TCP connections that never send a byte (no TLS, no certificate, no key)."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((source, 0))
        try:
            await asyncio.get_running_loop().sock_connect(s, addr)
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


async def test_idle_connect_flood_does_not_stop_push_pull_or_rpc(cluster: Cluster) -> None:
    n1 = await cluster.node("n1", handshake_timeout=1.0, max_handshakes=48, max_handshakes_per_ip=16)
    n2 = await cluster.node("n2")

    async def handler(identity: str, payload: bytes) -> bytes:
        return b"ok:" + identity.encode()

    n1.set_rpc_handler(handler)
    socks: list[socket.socket] = []
    try:
        # 40 idle connects from one address: 16 take handshake slots, the rest are closed at once
        socks += await _idle_connects(n1.address, 40, "127.0.0.2")
        await eventually(
            lambda: n1.transport_metrics.tcp_rejected_handshake_budget >= 1,
            what="per-address budget enforced",
        )
        tcp = n1._tcp
        assert tcp is not None and tcp.handshakes_in_progress <= 16
        # 48 more from three other addresses: the global budget (48) is full, the oldest are closed
        for src in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
            socks += await _idle_connects(n1.address, 16, src)
        await eventually(lambda: n1.transport_metrics.tcp_handshakes_evicted >= 1, what="oldest evicted")
        assert tcp.handshakes_in_progress <= 48
        # a legitimate mTLS push-pull (a join) and RPCs still go through
        assert await n2.join([n1.address]) == 1
        await eventually(lambda: alive([n1, n2], ["n1", "n2"]), what="joined under the flood")
        assert await n2.rpc("n1", b"q") == b"ok:n2"
        results = await asyncio.gather(*(n2.rpc("n1", b"q") for _ in range(10)))
        assert results == [b"ok:n2"] * 10
        # the idle connections are dropped after the short handshake timeout
        await eventually(
            lambda: n1.transport_metrics.tcp_handshake_timeouts >= 16, what="idle connects timed out"
        )
    finally:
        for s in socks:
            s.close()


# ---- 3. replays ----------------------------------------------------------------------------------


class Tap:
    """Records the sealed datagrams a runtime sends to one address (what an eavesdropper captures)."""

    def __init__(self, rt: MeshRuntime, dest: Addr) -> None:
        self.captured: list[bytes] = []
        udp = rt._udp
        assert udp is not None and udp._transport is not None
        transport = udp._transport
        orig = transport.sendto

        def sendto(data: bytes, addr: Any = None) -> None:
            if addr == dest:
                self.captured.append(bytes(data))
            orig(data, addr)

        transport.sendto = sendto  # type: ignore[method-assign,assignment]


async def test_captured_alive_replayed_after_a_leave_is_refused(cluster: Cluster) -> None:
    # short memory of departed members (reaped after 0.3 s, tombstones kept 0.6 s): the window must
    # be shorter still, and a replay comes after the tombstone is gone, as in the report (100 s)
    swim = replace(FAST, gossip_to_the_dead_time=0.3, tombstone_time=0.6)
    n1 = await cluster.node("n1", swim=swim, replay_window=0.5)
    n3 = await cluster.node("n3", seeds=(n1.address,), swim=swim, replay_window=0.5)
    tap = Tap(n3, n1.address)
    await eventually(lambda: alive([n1, n3], ["n1", "n3"]), what="joined")
    await eventually(
        lambda: any(_has_alive_of(n1, p, "n3") for p in tap.captured), what="an Alive of n3 captured"
    )
    captured = list(tap.captured)
    # replayed at once: duplicates, refused (n3 is still alive: nothing would change anyway)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        before = n1.replay.stats.duplicates
        for p in captured[-5:]:
            sock.sendto(p, n1.address)
        await eventually(lambda: n1.replay.stats.duplicates >= before + 1, what="duplicates refused")
        await n3.close()
        await eventually(lambda: n1.member_state("n3") == LEFT, what="n3 LEFT")
        await eventually(
            lambda: n1.member_state("n3") is None and "n3" not in n1.swim._table.tombstones,
            what="n3 forgotten",
        )
        # replayed after the leave was forgotten: outside the window, refused; n3 stays gone
        dropped = n1.metrics.replays_dropped
        for p in captured:
            sock.sendto(p, n1.address)
        await eventually(
            lambda: n1.metrics.replays_dropped >= dropped + len(captured), what="replays refused"
        )
        assert n1.member_state("n3") is None
        assert n1.replay.stats.outside_window >= len(captured)
    finally:
        sock.close()


def _has_alive_of(rt: MeshRuntime, sealed: bytes, name: str) -> bool:
    try:
        pkt = mesh_wire.decode_packet(rt.keyring.open(sealed))
    except Exception:
        return False
    return any(isinstance(m, Alive) and m.name == name for m in pkt.msgs)


async def test_forged_unstamped_or_stale_packets_are_refused(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    forger = Forger()
    try:
        import time

        # the older format (no stamp) and a stamp 60 s old: neither reaches the machine
        forger.send_raw_fields(n1.address, [1, "ghost", [[5, "ghost", "127.0.0.1", 9, 1, b""]]])
        forger.send(
            n1.address,
            "ghost",
            Alive("ghost", "127.0.0.1", 9, 1),
            stamp=(int(time.time() * 1000) - 60_000, 5),
        )
        await eventually(lambda: n1.metrics.replays_dropped >= 2, what="both refused")
        assert n1.member_state("ghost") is None
        assert n1.replay.stats.unstamped == 1 and n1.replay.stats.outside_window == 1
    finally:
        forger.close()


def test_replay_guard_window_and_bitmap() -> None:
    now = [1000.0]
    g = ReplayGuard(30.0, seq_window=64, max_senders=2, clock=lambda: now[0])
    ms = 1_000_000
    assert g.accept("a", (ms, 100))
    assert not g.accept("a", (ms, 100))  # exact duplicate
    assert g.accept("a", (ms, 90))  # reordered, within the bitmap
    assert not g.accept("a", (ms, 90))
    assert g.accept("a", (ms, 200))
    assert not g.accept("a", (ms, 200 - 64))  # too far behind the newest
    assert g.accept("a", (ms + 29_000, 201)) and g.accept("a", (ms - 29_000, 199))  # skew tolerated
    assert not g.accept("a", (ms + 31_000, 300)) and not g.accept("a", (ms - 31_000, 301))
    assert not g.accept("a", None)
    g.accept("b", (ms, 1))
    g.accept("c", (ms, 1))
    assert len(g) == 2  # bounded: the least recently heard sender went first
    assert g.stats.duplicates == 2 and g.stats.too_old == 1 and g.stats.outside_window == 2


def test_replay_window_must_be_shorter_than_the_memory_of_a_leave(pki: dict[str, TlsFiles]) -> None:
    cfg = MeshRuntimeConfig(
        name="n1", bind_port=0, swim=replace(FAST, gossip_to_the_dead_time=10, tombstone_time=10)
    )
    with pytest.raises(ValueError, match="replay_window"):
        MeshRuntime(
            replace(cfg, replay_window=25.0),
            Keyring([KEY]),
            server_context(pki["n1"]),
            client_context(pki["n1"]),
        )
