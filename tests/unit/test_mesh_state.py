"""MeshState: snapshots merge as a semilattice, lossy gossip + digest repair converge, dead-node
cleanup with callbacks, pinned workers, extra components, the Delegate contract, malformed payloads."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.state import MeshState
from shepherd.mesh.state_config import TenantRecord
from shepherd.mesh.state_registry import RegistryConfig, WorkerRecord
from shepherd.mesh.state_types import MeshStateConfig, StateComponent
from shepherd.mesh.state_wire import envelope
from shepherd.mesh.swim_types import Delegate, MemberDead, MemberUp
from shepherd.policies.block_names import block_hashes
from shepherd.policies.prefix_index import PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto.mesh_messages import USER_MSG_OVERHEAD, Member, MemberState
from shepherd.proto.state_decode import StateDecodeError

T0 = 1_000_000.0
EXACT_INDEX = PrefixIndexConfig(capacity_blocks=1 << 20, max_age_s=1e6)
EXACT_REPL = IndexReplConfig(digest_granularity_s=0.0, repair_settle_s=0.0)


def exact_index() -> Replica:
    """Replicas with exact digests and no repair settling (what most tests here compare)."""
    return make_replica(EXACT_INDEX, EXACT_REPL)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def view(m: MeshState[Replica]) -> tuple[Any, ...]:
    return (
        sorted(m.registry.to_wire()),
        sorted((r.observer, r.version, sorted(r.checked), sorted(r.unhealthy)) for r in m.health.records()),
        {model: ix.export() for model, ix in sorted(m.indexes.items()) if ix.export()},
        m.config.to_py(),
    )


CHAINS = [block_hashes([i * 7 + j for j in range(16 * 6)]) for i in range(5)]


def random_ops(m: MeshState[Replica], clock: Clock, rng: random.Random, n: int) -> None:
    for _ in range(n):
        clock.t += rng.random() * 0.05
        r = rng.random()
        wid = f"w{rng.randrange(6)}"
        if r < 0.2:
            m.add_worker(WorkerRecord(wid, f"grpc://h{wid}:1", rng.choice(["m1", "m2"]), "sglang"))
        elif r < 0.3:
            m.remove_worker(wid)
        elif r < 0.45:
            m.observe_health(wid, rng.random() < 0.7)
        elif r < 0.9:
            chain = rng.choice(CHAINS)
            m.index(rng.choice(["m1", "m2"])).insert_blocks(chain[: rng.randrange(1, 7)], wid, clock())
        else:
            m.config.set_tenant(TenantRecord(f"t{rng.randrange(3)}", (), rng.randrange(10)))


def make_nodes(
    clock: Clock,
    names: list[str],
    cfg: MeshStateConfig | None = None,
    new_index: Callable[[], Replica] = exact_index,
) -> list[MeshState[Replica]]:
    nodes = [MeshState(n, clock, cfg, new_index=new_index) for n in names]
    for m in nodes:
        for n in names:
            m.on_member_up(n)
    return nodes


# -- snapshots ------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 1 << 30), perm=st.permutations([0, 1, 2]))
def test_snapshot_merge_is_commutative_associative_idempotent(seed: int, perm: list[int]) -> None:
    rng = random.Random(seed)
    clock = Clock()
    nodes = make_nodes(clock, ["a", "b", "c"])
    for m in nodes:
        random_ops(m, clock, rng, rng.randrange(0, 10))
    snaps = [m.snapshot() for m in nodes]
    x, y, z, bc = (MeshState(n, clock, new_index=exact_index) for n in ("x", "y", "z", "bc"))
    for s in snaps:
        x.merge_snapshot(s)
    for k in perm:
        y.merge_snapshot(snaps[k])
    y.merge_snapshot(snaps[perm[0]])  # a duplicate
    bc.merge_snapshot(snaps[1])
    bc.merge_snapshot(snaps[2])
    z.merge_snapshot(snaps[0])
    z.merge_snapshot(bc.snapshot())
    assert view(x) == view(y) == view(z)
    x.merge_snapshot(x.snapshot())
    assert view(x) == view(y)


# -- gossip ---------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 1 << 30), loss=st.floats(0.0, 0.5))
def test_lossy_gossip_then_digest_repair_converges(seed: int, loss: float) -> None:
    rng = random.Random(seed)
    clock = Clock()
    nodes = make_nodes(clock, ["a", "b", "c"])
    inflight: list[tuple[MeshState[Replica], bytes, str]] = []
    for _ in range(rng.randrange(1, 8)):
        for m in nodes:
            random_ops(m, clock, rng, rng.randrange(0, 6))
        for m in nodes:
            out = m.broadcasts(1300) + m.index_batches(1100)
            for p in out:
                for dst in nodes:
                    if dst is not m and rng.random() >= loss:
                        inflight += [(dst, p, m.node)] * rng.choice([1, 1, 2])
        rng.shuffle(inflight)
        while inflight and rng.random() < 0.8:
            dst, p, src = inflight.pop()
            dst.on_user(p, src)
    # a two-round repair over every pair, twice: a worker removal learnt in the first pass changes the
    # learner's own health record (it stops checking the worker), which the second pass carries
    for _ in range(2):
        for a in nodes:
            for b in nodes:
                if a is not b:
                    for p in a.repair(b.digest()):
                        b.apply(p, a.node)
    assert view(nodes[0]) == view(nodes[1]) == view(nodes[2])
    assert all(m.stats.decode_errors == 0 for m in nodes)


def test_push_pull_through_the_delegate_converges() -> None:
    rng = random.Random(5)
    clock = Clock()
    a, b = make_nodes(clock, ["a", "b"])
    random_ops(a, clock, rng, 40)
    random_ops(b, clock, rng, 40)
    a.index_batches()  # these deltas are lost
    b.index_batches()
    a.broadcasts(1 << 20)
    b.broadcasts(1 << 20)
    sa, sb = a.local_state(), b.local_state()
    b.merge_remote_state(sa)
    a.merge_remote_state(sb)
    assert a.stats.index_entries_repair_queued > 0
    for src, dst in ((a, b), (b, a)):  # the diffs go out as index batches
        for p in src.index_batches(1 << 16):
            dst.apply(p, src.node)
    assert view(a) == view(b)


def test_broadcasts_fit_the_budget_and_index_batches_fit_theirs() -> None:
    clock = Clock()
    (a,) = make_nodes(clock, ["a"])
    random_ops(a, clock, random.Random(1), 200)
    seen = 0
    for _ in range(200):
        out = a.broadcasts(700)
        assert sum(len(p) + USER_MSG_OVERHEAD for p in out) <= 700
        seen += len(out)
        if not out:
            break
    assert seen > 0
    assert all(len(p) <= 1100 for p in a.index_batches())
    d = a.describe()
    assert d["workers"]["live"] == len(a.workers()) and set(d["indexes"]) <= {"m1", "m2"}
    msgpack.packb(d)  # plain data


# -- affinity -------------------------------------------------------------------------------------------


def test_an_index_delta_gives_another_node_the_same_match() -> None:
    clock = Clock()
    a, b = make_nodes(clock, ["a", "b"], new_index=make_replica)
    ids = list(range(16 * 40))
    a.index("qwen").insert(ids, "w7", clock())
    for p in a.index_batches():
        b.on_user(p, "a")
    assert b.index("qwen").match(ids) == {"w7": 16 * 40}


# -- membership -----------------------------------------------------------------------------------------


def member(name: str, state: MemberState) -> Member:
    return Member(name, "127.0.0.1", 7946, 1, state)


def test_a_dead_nodes_workers_are_removed_everywhere_with_callbacks() -> None:
    clock = Clock()
    a, b, c = make_nodes(clock, ["a", "b", "c"])
    removed: dict[str, list[str]] = {"b": [], "c": []}
    b.on_worker_removed.append(lambda r: removed["b"].append(r.id))
    c.on_worker_removed.append(lambda r: removed["c"].append(r.id))
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"))
    a.add_worker(WorkerRecord("w2", "grpc://x:2", "m"))
    c.add_worker(WorkerRecord("w3", "grpc://x:3", "m"))
    for src in (a, c):
        for p in src.broadcasts(1 << 16):
            for dst in (a, b, c):
                if dst is not src:
                    dst.on_user(p, src.node)
    assert {w.id for w in b.workers()} == {"w1", "w2", "w3"}
    clock.t += 5
    b.on_member_event(MemberDead(member("a", MemberState.DEAD), MemberState.SUSPECT))
    assert sorted(removed["b"]) == ["w1", "w2"] and [w.id for w in b.workers()] == ["w3"]
    for p in b.broadcasts(1 << 16):  # c learns it from b's tombstones before its own detector fires
        c.on_user(p, "b")
    assert sorted(removed["c"]) == ["w1", "w2"]
    c.on_member_dead("a")  # then its own: nothing more to remove
    assert sorted(removed["c"]) == ["w1", "w2"] and view(b)[0] == view(c)[0]
    b.on_member_event(MemberUp(member("a", MemberState.ALIVE), MemberState.DEAD))
    assert "a" in b.members


def test_pinned_workers_come_back_when_their_owner_dies_but_not_after_a_removal() -> None:
    clock = Clock()
    a, b = make_nodes(clock, ["a", "b"])
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"), pin=True)
    clock.t += 0.01
    b.add_worker(WorkerRecord("w1", "grpc://x:1", "m"), pin=True)  # the same worker in both configs
    for p in b.broadcasts(1 << 16):
        a.on_user(p, "b")
    assert a.worker("w1") is not None and a.worker("w1") == b.worker("w1")
    winner, other = (a, b) if b.worker("w1").owner == "a" else (b, a)  # type: ignore[union-attr]
    clock.t += 5
    other.on_member_dead(winner.node)
    assert other.worker("w1") is None
    other.tick()  # re-asserted by the surviving node that has it in its config
    w = other.worker("w1")
    assert w is not None and w.owner == other.node
    other.remove_worker("w1")
    other.tick()
    assert other.worker("w1") is None


def test_index_entries_of_workers_gone_from_the_registry_are_cleared_after_a_grace() -> None:
    clock = Clock()
    cfg = MeshStateConfig(orphan_grace_s=10.0)
    (a,) = make_nodes(clock, ["a"], cfg, make_replica)
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"))
    ix = a.index("m")
    ix.insert_blocks([1, 2, 3], "w1", clock())
    ix.insert_blocks([1, 2], "ghost", clock())
    a.tick()
    clock.t += 11
    a.tick()
    assert ix.workers == ["w1"]


def test_leases_expire_through_tick_and_health_goes_with_its_observer() -> None:
    clock = Clock()
    cfg = MeshStateConfig(registry=RegistryConfig(lease_s=6.0, renew_s=2.0, tombstone_grace_s=2.0))
    a, b = make_nodes(clock, ["a", "b"], cfg, make_replica)
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"))
    a.observe_health("w1", True)
    for p in a.broadcasts(1 << 16):
        b.on_user(p, "a")
    assert b.health_view("w1").healthy == 1
    for _ in range(10):  # a keeps renewing; b keeps the worker
        clock.t += 1.5
        a.tick()
        for p in a.broadcasts(1 << 16):
            b.on_user(p, "a")
        b.tick()
    assert b.worker("w1") is not None
    clock.t += 40  # a silent past the lease: its worker goes; its health record is not refreshed by time
    b.tick()
    assert b.worker("w1") is None and b.health_view("w1").healthy == 1
    b.on_member_dead("a")  # a record lives as long as its observer does
    assert b.health_view("w1").healthy == 0


# -- extra components -----------------------------------------------------------------------------------


class GCounter:
    """A toy grow-only counter (per-node shards), as the rate limiter's counters would plug in."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.shards: dict[str, int] = {}
        self.dirty = False
        self.dead: list[str] = []

    def incr(self, n: int = 1) -> None:
        self.shards[self.node] = self.shards.get(self.node, 0) + n
        self.dirty = True

    def value(self) -> int:
        return sum(self.shards.values())

    def take_delta(self) -> Any | None:
        if not self.dirty:
            return None
        self.dirty = False
        return [[self.node, self.shards[self.node]]]

    def _merge(self, pairs: list[Any]) -> None:
        checked = []
        for p in pairs:
            if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int):
                raise ValueError("bad shard")
            checked.append(p)
        for name, v in checked:
            self.shards[name] = max(self.shards.get(name, 0), v)

    def apply_delta(self, delta: Any) -> None:
        if not isinstance(delta, list):
            raise ValueError("bad delta")
        self._merge(delta)

    def snapshot(self) -> Any:
        return [[k, v] for k, v in sorted(self.shards.items())]

    def merge_snapshot(self, snapshot: Any) -> None:
        if not isinstance(snapshot, list):
            raise ValueError("bad snapshot")
        self._merge(snapshot)

    def digest(self) -> Any:
        return self.snapshot()

    def on_member_dead(self, name: str) -> None:
        self.dead.append(name)


def test_an_extra_component_rides_deltas_repair_snapshots_and_membership() -> None:
    clock = Clock()
    a, b, c = make_nodes(clock, ["a", "b", "c"])
    counters = {m.node: GCounter(m.node) for m in (a, b, c)}
    for m in (a, b, c):
        comp: StateComponent = counters[m.node]
        m.register("ratelimit", comp)
        assert m.component("ratelimit") is comp
    with pytest.raises(ValueError):
        a.register("ratelimit", counters["a"])
    counters["a"].incr(3)
    counters["b"].incr(4)
    for src in (a, b):
        for p in src.broadcasts(1 << 16):
            c.on_user(p, src.node)
    assert counters["c"].value() == 7
    for p in c.repair(a.digest()):  # a lacks b's shard
        a.apply(p, "c")
    assert counters["a"].value() == 7
    fresh = MeshState("d", clock, new_index=exact_index)
    counters["d"] = GCounter("d")
    fresh.register("ratelimit", counters["d"])
    fresh.merge_snapshot(c.snapshot())
    assert counters["d"].value() == 7
    c.on_member_dead("b")
    assert counters["c"].dead == ["b"]
    with pytest.raises(StateDecodeError):  # a malformed delta for the component: one error type
        c.apply(msgpack.packb([1, "x", ["ratelimit", "nonsense"]]), "a")
    assert counters["c"].value() == 7


class GCounterWithDiff(GCounter):
    def diff(self, remote_digest: Any) -> Any:
        have = {k: v for k, v in remote_digest} if isinstance(remote_digest, list) else {}
        return [[k, v] for k, v in sorted(self.shards.items()) if have.get(k) != v]


def test_repair_sends_an_extra_components_diff_when_it_has_one() -> None:
    clock = Clock()
    a, b = make_nodes(clock, ["a", "b"])
    ca, cb = GCounterWithDiff("a"), GCounterWithDiff("b")
    a.register("rl", ca)
    b.register("rl", cb)
    ca.incr(2)
    cb.incr(5)
    payloads = a.repair(b.digest())
    tags = [msgpack.unpackb(p)[1] for p in payloads]
    assert "x" in tags and "X" not in tags
    for p in payloads:
        b.apply(p, "a")
    assert cb.value() == 7


def test_mesh_state_is_a_swim_delegate() -> None:
    clock = Clock()
    d: Delegate = MeshState("a", clock, new_index=make_replica)
    assert d.broadcasts(1000) == [] and isinstance(d.local_state(), bytes)
    m = MeshState("b", clock, new_index=make_replica)
    m.on_member_alive("c")  # MeshRuntime's hook names
    m.on_member_dead("c")
    assert m.members == frozenset({"b"})


# -- malformed payloads ---------------------------------------------------------------------------------


def test_a_payload_of_empty_arrays_is_refused_not_decoded() -> None:
    """A payload holds at most an array or map per 2 bytes (``state_wire.LIMITS``): 300,000 empty arrays
    in 300 KB are refused (a decode error), the same as a push-pull state's, which is decoded a slice at
    a time (``merge_remote_state_steps`` yields between slices)."""
    clock = Clock()
    m = MeshState("a", clock, new_index=exact_index)
    bad = envelope("zz", [[]] * 300_000)  # (an unknown tag is otherwise skipped)
    with pytest.raises(StateDecodeError, match="arrays and maps"):
        m.apply(bad, "b")
    steps = list(m.merge_remote_state_steps(bad, "b"))
    assert m.stats.decode_errors == 2 and len(steps) > 1
    big = envelope("zz", [["k", 1] * 20] * 20_000)  # ~1.2 MB: decoded in slices, then skipped
    assert len(list(m.merge_remote_state_steps(big, "b"))) > 1 and m.stats.decode_errors == 2


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=24),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from("rhcixnd"), inner, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=100, deadline=None)
@given(
    tag=st.sampled_from(["r", "h", "i", "c", "x", "X", "S", "P", "D", "?"]),
    body=plain,
    raw=st.binary(max_size=40),
)
def test_malformed_payloads_raise_one_error_type_and_change_nothing(tag: str, body: Any, raw: bytes) -> None:
    clock = Clock()
    (m,) = make_nodes(clock, ["a"])
    random_ops(m, clock, random.Random(2), 30)
    m.register("ratelimit", GCounter("a"))
    before = view(m)
    for payload in (msgpack.packb([1, tag, body], use_bin_type=True), raw):
        try:
            m.apply(payload, "peer")
        except StateDecodeError:
            assert view(m) == before
        else:
            before = view(m)  # a well-formed payload: merged
        m.on_user(payload, "peer")  # the Delegate entry points never raise
        m.merge_remote_state(payload)
    try:
        m.repair(raw)
    except StateDecodeError:
        assert view(m) == before  # refused: nothing changed


def test_wrong_kinds_of_payload_are_refused() -> None:
    clock = Clock()
    (m,) = make_nodes(clock, ["a"])
    with pytest.raises(StateDecodeError):
        m.merge_snapshot(m.digest())
    with pytest.raises(StateDecodeError):
        m.apply(m.digest())
    with pytest.raises(StateDecodeError):
        m.repair(m.snapshot())
    with pytest.raises(StateDecodeError):
        m.apply(msgpack.packb([0x11, "r", []]))  # another major (wire_version)
    assert m.stats.decode_errors == 2
    m.apply(msgpack.packb([2, "zz", [], "a later field"]))  # next minor, unknown tag: skipped
    assert (m.stats.decode_errors, m.stats.unknown_skipped) == (2, 1)
