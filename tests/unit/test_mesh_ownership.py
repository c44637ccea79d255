"""Finding 4: replicated entries that name a node are accepted only from that node.

Through the real runtime (sealed datagrams from a key holder without a certificate, claiming a member's
name) and the real ``MeshState`` (``first_hand``, as a node runs it): a forged or relayed worker record,
health observation or rate-limit shard of another node is dropped; the owner's own ones are applied.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.ratelimit import RateLimiter
from shepherd.mesh.ratelimit_shards import Entry
from shepherd.mesh.ratelimit_shards import entry_to_wire as shard_to_wire
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_health import Observation, observation_to_wire
from shepherd.mesh.state_registry import LIVE, OWNER_GONE, REMOVED, RegEntry, WorkerRecord, entry_to_wire
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.state_wire import envelope
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import Addr, MemberState, User
from tests.unit.mesh_fixtures import FAST, KEY, eventually

pytestmark = pytest.mark.timeout(90)


def state(name: str) -> MeshState[Replica]:
    return MeshState(name, time.time, MeshStateConfig(first_hand=True), new_index=make_replica)


def live_entry(wid: str, writer: str, owner: str, stamp: int) -> RegEntry:
    return RegEntry(wid, stamp, writer, LIVE, WorkerRecord(wid, f"http://{wid}", "m", owner=owner), stamp)


def stamp_now() -> int:
    from shepherd.mesh.hlc import make_stamp

    return make_stamp(int(time.time() * 1000))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2", "n3"])


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def node(
    stack: AsyncExitStack,
    pki: dict[str, TlsFiles],
    name: str,
    st: MeshState[Replica],
    seeds: tuple[Addr, ...] = (),
) -> MeshRuntime:
    rt = MeshRuntime(
        MeshRuntimeConfig(name=name, bind_port=0, seeds=seeds, swim=FAST),
        Keyring([KEY]),
        server_context(pki[name]),
        client_context(pki[name]),
        st,
        on_member_event=st.on_member_event,
        rng=random.Random(name),
    )
    await rt.start()
    stack.push_async_callback(rt.abort)
    return rt


def forge(dest: Addr, sender: str, payload: bytes) -> None:
    """A key holder without a certificate: a sealed, fresh, well-formed datagram naming ``sender``."""
    raw = mesh_wire.encode_packet(
        [User(payload)], budget=60_000, sender=sender, stamp=(int(time.time() * 1000), 2**62)
    )
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(Keyring([KEY]).seal(raw), dest)
    finally:
        s.close()


async def test_key_holder_cannot_speak_for_a_member_over_udp(
    stack: AsyncExitStack, pki: dict[str, TlsFiles]
) -> None:
    s1, s2 = state("n1"), state("n2")
    n1 = await node(stack, pki, "n1", s1)
    n2 = await node(stack, pki, "n2", s2, seeds=(n1.address,))
    await eventually(
        lambda: n1.member_state("n2") == MemberState.ALIVE and n2.member_state("n1") == MemberState.ALIVE,
        what="joined",
    )
    await eventually(lambda: n2.senders.is_bound("n1", n1.address), what="n2 verified n1")
    # a forged worker record "from n1" (right name, right writer and owner), sent from another address
    forged = envelope("r", [entry_to_wire(live_entry("evil", "n1", "n1", stamp_now()))])
    forge(n2.address, "n1", forged)
    await eventually(lambda: n2.senders.stats.dropped_unbound >= 1, what="forged datagram refused")
    assert s2.worker("evil") is None
    # n1's own record, sent by n1 itself (as a node's flush does): applied
    s1.add_worker(WorkerRecord("w1", "http://w1", "m"))
    assert n1.send_user(n2.address, s1.owned_batches()) >= 1
    await eventually(lambda: s2.worker("w1") is not None, what="n1's worker applied on n2")
    assert s2.worker("w1").owner == "n1"  # type: ignore[union-attr]
    assert s2.worker("evil") is None


def test_only_the_owner_entries_are_taken_from_a_sender() -> None:
    s2 = state("n2")
    now = stamp_now()
    # n3 relays (or forges) n1's worker record, a removal written by n1, n1's health view, n1's shard
    payloads = [
        envelope("r", [entry_to_wire(live_entry("w1", "n1", "n1", now))]),
        envelope("r", [entry_to_wire(live_entry("w2", "n3", "n1", now))]),  # n3 writes a record n1 "owns"
        envelope("r", [entry_to_wire(RegEntry("w9", now, "n1", REMOVED, None, now))]),
        envelope("r", [entry_to_wire(RegEntry("w8", now, "n1", OWNER_GONE, None, now))]),
        envelope("h", [observation_to_wire(Observation("w1", "n1", now, False))]),
    ]
    for p in payloads:
        s2.on_user(p, "n3")
    assert s2.registry.entries() == {}
    assert s2.health.observations() == []
    assert s2.stats.foreign_entries_dropped == len(payloads)
    # the same from their owner: applied
    s2.on_user(payloads[0], "n1")
    s2.on_user(payloads[4], "n1")
    s2.on_user(envelope("r", [entry_to_wire(live_entry("w3", "n3", "n3", now))]), "n3")
    assert {r.id for r in s2.workers()} == {"w1", "w3"}
    assert [o.observer for o in s2.health.observations()] == ["n1"]


def test_rate_limit_shards_only_from_their_node() -> None:
    s2 = state("n2")
    rl = RateLimiter("n2", 1)
    s2.register("ratelimit", rl)
    w = int(time.time() // 60)
    shard_n1 = shard_to_wire("t", "", "n1", 1, Entry(1, w, [1000, 0, 0, 1000, 0]))
    shard_n3 = shard_to_wire("t", "", "n3", 1, Entry(1, w, [1, 0, 0, 1, 0]))
    s2.on_user(envelope("x", ["ratelimit", [shard_n1, shard_n3]]), "n3")
    held = {sid for (_, sid) in rl.entries()}
    assert held == {("n3", 1)} and rl.foreign_dropped == 1
    # a push-pull from n3 (certificate identity n3) carrying n1's shard: the same
    other = state("n3")
    other_rl = RateLimiter("n3", 1)
    other.register("ratelimit", other_rl)
    other_rl.apply_delta([shard_n1])  # n3 learnt it (say, in the past): it may not hand it on
    s2.merge_remote_state_from(other.local_state(), "n3")
    assert ("n1", 1) not in {sid for (_, sid) in rl.entries()}


def test_push_pull_takes_only_the_peers_own_entries() -> None:
    s1, s3, s2 = state("n1"), state("n3"), state("n2")
    s1.add_worker(WorkerRecord("w1", "http://w1", "m"))
    s3.merge_remote_state_from(s1.local_state(), "n1")  # first-hand from n1: n3 holds w1
    assert s3.worker("w1") is not None
    s3.add_worker(WorkerRecord("w3", "http://w3", "m"))
    s2.merge_remote_state_from(s3.local_state(), "n3")  # n3 hands on n1's w1: refused, its own w3 taken
    assert {r.id for r in s2.workers()} == {"w3"}
    s2.merge_remote_state_from(s1.local_state(), "n1")
    assert {r.id for r in s2.workers()} == {"w1", "w3"}


def test_owner_gone_about_our_own_version_still_triggers_the_rewrite() -> None:
    s1, s2 = state("n1"), state("n2")
    s1.add_worker(WorkerRecord("w1", "http://w1", "m"))
    s2.merge_remote_state_from(s1.local_state(), "n1")
    s2.on_member_dead("n1")  # n2 saw n1 die: the owner-gone tombstone of w1
    e = s2.registry.entry("w1")
    assert e is not None and e.kind == OWNER_GONE
    before = s1.registry.entry("w1")
    s1.on_user(envelope("r", [entry_to_wire(e)]), "n2")  # n1 hears of it: refutes with a new version
    after = s1.registry.entry("w1")
    assert before is not None and after is not None and after.stamp > before.stamp and after.live


def test_owned_registry_and_health_changes_go_out_twice() -> None:
    """Nothing relays a first-hand datagram: a worker add or a health flip goes out again ``resend_s``
    after its first send (with the next flush), so one lost datagram does not wait for the lease renewal;
    a receiver that got both applies the second as nothing new; nothing goes out a third time."""
    now = [1000.0]
    a = MeshState("a", lambda: now[0], MeshStateConfig(first_hand=True), new_index=make_replica)
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"))
    a.observe_health("w1", False)
    first = a.owned_batches()
    assert first and a.owned_batches() == []  # not again before resend_s
    now[0] += 0.5
    assert a.owned_batches() == []
    now[0] += 0.6
    assert a.owned_batches() == first  # the second send
    now[0] += 5
    assert a.owned_batches() == []  # once only
    b = MeshState("b", lambda: now[0], MeshStateConfig(first_hand=True), new_index=make_replica)
    b.on_member_up("a")  # one copy lost: the second one alone brings the worker and its health
    for p in first:
        b.apply(p, "a")
    assert [r.id for r in b.workers()] == ["w1"] and not b.routable("w1")
    once = MeshState(
        "a2", lambda: now[0], MeshStateConfig(first_hand=True, resend_s=0), new_index=make_replica
    )
    once.add_worker(WorkerRecord("w2", "grpc://x:2", "m"))
    assert once.owned_batches()
    now[0] += 2
    assert once.owned_batches() == []
