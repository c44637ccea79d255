"""Replicated worker registry: LWW semilattice, leases, tombstones, dead-owner cleanup, bounds, wire."""

from __future__ import annotations

import random
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.hlc import HLC, make_stamp
from shepherd.mesh.state_registry import (
    LIVE,
    OWNER_GONE,
    REMOVED,
    RegEntry,
    RegistryConfig,
    ReplicatedRegistry,
    WorkerRecord,
    entry_from_wire,
    entry_to_wire,
    merge_entry,
)
from shepherd.proto.state_decode import StateDecodeError

T0 = 1_000_000.0
T0_MS = int(T0 * 1000)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rec(wid: str, owner: str = "", model: str = "m", url: str | None = None) -> WorkerRecord:
    return WorkerRecord(wid, url or f"grpc://h:{abs(hash(wid)) % 60000}", model, "sglang", (), owner)


def reg(node: str, clock: Clock, cfg: RegistryConfig | None = None) -> ReplicatedRegistry:
    return ReplicatedRegistry(node, HLC(clock), cfg)


def wire_state(r: ReplicatedRegistry) -> list[Any]:
    return sorted(entry_to_wire(e) for e in r.entries().values())


# -- strategies -----------------------------------------------------------------------------------------

IDS = ["w0", "w1", "w2", "w3"]
NODES = ["n1", "n2", "n3"]


@st.composite
def entries(draw: st.DrawFn, ids: tuple[str, ...] = tuple(IDS)) -> RegEntry:
    wid = draw(st.sampled_from(ids))
    stamp = make_stamp(T0_MS - draw(st.integers(0, 3)), draw(st.integers(0, 2)))
    writer = draw(st.sampled_from(NODES))
    kind = draw(st.sampled_from([LIVE, LIVE, REMOVED, OWNER_GONE]))
    record = None
    if kind == LIVE:
        record = WorkerRecord(
            wid,
            draw(st.sampled_from(["u1", "u2"])),
            draw(st.sampled_from(["m", "n"])),
            "",
            (),
            draw(st.sampled_from(NODES)),
        )
    renewed = stamp + draw(st.integers(0, 3))
    return RegEntry(wid, stamp, writer, kind, record, renewed)


entry_lists = st.lists(entries(), max_size=12)


# -- the semilattice --------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(entries(("w0",)), entries(("w0",)), entries(("w0",)))
def test_merge_entry_is_commutative_associative_idempotent(a: RegEntry, b: RegEntry, c: RegEntry) -> None:
    assert merge_entry(a, b) == merge_entry(b, a)
    assert merge_entry(merge_entry(a, b), c) == merge_entry(a, merge_entry(b, c))
    assert merge_entry(a, a) == a


@settings(max_examples=100, deadline=None)
@given(a=entry_lists, b=entry_lists, c=entry_lists, seed=st.integers(0, 1 << 30))
def test_replica_state_does_not_depend_on_order_grouping_or_duplicates(
    a: list[RegEntry], b: list[RegEntry], c: list[RegEntry], seed: int
) -> None:
    clock = Clock(T0 + 1)  # nothing expires: leases are 90 s
    x = reg("r1", clock)
    for part in (a, b, c):
        x.merge(part)
    y = reg("r2", clock)
    for part in (c, b, a, b):  # another order, a duplicate
        y.merge(part)
    z = reg("r3", clock)
    bc = reg("r4", clock)
    bc.merge(b)
    bc.merge(c)
    z.merge(a)
    z.merge(bc.entries().values())  # a + (b + c)
    shuffled = a + b + c + a
    random.Random(seed).shuffle(shuffled)
    w = reg("r5", clock)
    for e in shuffled:
        w.merge([e])
    assert wire_state(x) == wire_state(y) == wire_state(z) == wire_state(w)
    x.merge(x.entries().values())
    assert wire_state(x) == wire_state(y)


# -- local operations ---------------------------------------------------------------------------------------


def test_put_remove_and_the_live_view() -> None:
    clock = Clock()
    r = reg("a", clock)
    ch = r.put(rec("w1"))
    assert ch is not None and ch.before is None and ch.after is not None and ch.after.owner == "a"
    assert r.get("w1") == ch.after
    assert r.put(rec("w1", owner="a")) is None  # same content: the live view did not change
    ch2 = r.remove("w1")
    assert ch2 is not None and ch2.after is None
    assert r.get("w1") is None and r.tombstone_count == 1 and r.live_count == 0


def test_a_remove_beats_the_version_it_saw_and_a_later_put_beats_the_remove() -> None:
    clock = Clock()
    a, b = reg("a", clock), reg("b", clock)
    a.put(rec("w1"))
    b.merge(a.take_delta())
    b.remove("w1")
    a.merge(b.take_delta())
    assert a.get("w1") is None
    a.put(rec("w1"))
    b.merge(a.take_delta())
    assert b.get("w1") is not None


def test_leases_are_renewed_by_the_owner_and_run_out_without_it() -> None:
    cfg = RegistryConfig(lease_s=10.0, renew_s=3.0, tombstone_grace_s=5.0)
    clock = Clock()
    a, b = reg("a", clock, cfg), reg("b", clock, cfg)
    a.put(rec("w1"))
    b.merge(a.take_delta())
    for _ in range(10):  # 40 s with renewals gossiped
        clock.t += 4.0
        a.tick()
        b.merge(a.take_delta())
        assert b.tick() == []
        assert b.get("w1") is not None
    clock.t += 11.0  # the owner is silent
    changes = b.tick()
    assert [c.id for c in changes] == ["w1"] and b.get("w1") is None and b.live_count == 0


def test_a_renewal_never_resurrects_a_concurrent_removal() -> None:
    cfg = RegistryConfig(lease_s=10.0, renew_s=3.0)
    clock = Clock()
    a, b = reg("a", clock, cfg), reg("b", clock, cfg)
    a.put(rec("w1"))
    b.merge(a.take_delta())
    b.remove("w1")
    clock.t += 5.0
    a.tick()  # a renews before it hears of the removal: a later stamp, but the same version
    renewal = a.take_delta()
    a.merge(b.take_delta())
    b.merge(renewal)
    assert a.get("w1") is None and b.get("w1") is None
    assert wire_state(a) == wire_state(b)


def test_tombstones_are_collected_and_a_stale_copy_does_not_resurrect() -> None:
    cfg = RegistryConfig(lease_s=10.0, renew_s=3.0, tombstone_grace_s=5.0)
    clock = Clock()
    a, b, stale = reg("a", clock, cfg), reg("b", clock, cfg), reg("s", clock, cfg)
    a.put(rec("w1"))
    d = a.take_delta()
    b.merge(d)
    stale.merge(d)  # stale never hears of the removal
    b.remove("w1")
    a.merge(b.take_delta())
    for _ in range(4):  # 12 s: tombstones are kept lease + grace = 15 s
        clock.t += 3.0
        a.tick()
        b.tick()
    assert a.tombstone_count == 1
    clock.t += 4.0
    a.tick()
    b.tick()
    assert a.tombstone_count == 0 and b.tombstone_count == 0 and not a.entries()
    a.merge(stale.entries().values())  # the stale live version comes back: its lease has run out
    assert a.get("w1") is None
    a.tick()
    assert not a.entries()


# -- dead owners --------------------------------------------------------------------------------------------


def test_a_dead_owners_workers_go_everywhere_and_a_later_readd_survives() -> None:
    clock = Clock()
    owner, r1, r2, r3 = reg("n1", clock), reg("r1", clock), reg("r2", clock), reg("r3", clock)
    owner.put(rec("w1"))
    owner.put(rec("w2"))
    d = owner.take_delta()
    r1.merge(d)
    r2.merge(d)
    r1_changes = r1.on_member_dead("n1")
    assert sorted(c.id for c in r1_changes) == ["w1", "w2"] and not r1.records()
    r2.on_member_dead("n1")
    r2.put(rec("w2"))  # r2 re-adds w2 after the death (it has seen n1's version)
    r3.on_member_dead("n1")  # r3 learns of the death before n1's entries reach it
    r3.merge(d)
    assert not r3.records()
    for x in (r1, r2, r3):
        for y in (r1, r2, r3):
            y.merge(x.entries().values())
    assert wire_state(r1) == wire_state(r2) == wire_state(r3)
    assert [w.id for w in r1.records()] == ["w2"] and r1.get("w2") == WorkerRecord(
        "w2", rec("w2").url, "m", "sglang", (), "r2"
    )


@settings(max_examples=100, deadline=None)
@given(order=st.permutations(list(range(6))), seed=st.integers(0, 1000))
def test_dead_owner_cleanup_is_deterministic_in_any_order(order: list[int], seed: int) -> None:
    clock = Clock()
    owner = reg("n1", clock)
    other = reg("n2", clock)
    for i in range(3):
        owner.put(rec(f"w{i}"))
    other.put(rec("w9"))
    d_owner, d_other = owner.take_delta(), other.take_delta()
    replicas = [reg(f"r{i}", clock) for i in range(3)]
    rng = random.Random(seed)
    events: list[tuple[int, str]] = [(i, kind) for i in range(3) for kind in ("dead", "data")]
    events = [events[k] for k in order]
    for i, kind in events:
        if kind == "dead":
            replicas[i].on_member_dead("n1")
        else:
            part = list(d_owner)
            rng.shuffle(part)
            replicas[i].merge(part + d_other)
    for x in replicas:
        for y in replicas:
            y.merge(x.entries().values())
    states = [wire_state(r) for r in replicas]
    assert states[0] == states[1] == states[2]
    assert [w.id for w in replicas[0].records()] == ["w9"]


def test_a_node_declared_dead_by_mistake_writes_its_workers_again() -> None:
    clock = Clock()
    a, b = reg("a", clock), reg("b", clock)
    a.put(rec("w1"))
    b.merge(a.take_delta())
    b.on_member_dead("a")  # a false positive
    assert b.get("w1") is None
    a.merge(b.take_delta())  # a sees its entry's owner-gone tombstone: it refutes
    assert a.get("w1") is not None
    b.on_member_alive("a")
    b.merge(a.take_delta())
    assert b.get("w1") is not None and b.get("w1") == a.get("w1")


# -- bounds ------------------------------------------------------------------------------------------------


def test_memory_stays_bounded_under_50k_add_remove_ops() -> None:
    cfg = RegistryConfig(lease_s=5.0, renew_s=1.0, tombstone_grace_s=2.0)
    clock = Clock()
    nodes = [reg(f"n{i}", clock, cfg) for i in range(3)]
    rng = random.Random(7)
    live: list[tuple[int, str]] = []
    peak_entries = peak_tombs = 0
    for op in range(50_000):
        clock.t += 0.01  # 100 ops/s: 500 s in all, 100 lease windows
        i = rng.randrange(3)
        if len(live) < 100 or rng.random() < 0.5:
            wid = f"w{op}"
            nodes[i].put(rec(wid))
            live.append((i, wid))
        else:
            _, wid = live.pop(rng.randrange(len(live)))
            nodes[rng.randrange(3)].remove(wid)
        if op % 100 == 99:  # gossip with 5% losses
            for src in nodes:
                delta = src.take_delta()
                for dst in nodes:
                    if dst is not src:
                        dst.merge([e for e in delta if rng.random() > 0.05])
        if op % 200 == 199:  # upkeep every 2 s
            for n in nodes:
                n.tick()
                peak_entries = max(peak_entries, len(n.entries()))
                peak_tombs = max(peak_tombs, n.tombstone_count)
    # tombstones: the removals of one lease + grace window (7 s at 50/s = 350, plus a tick's lag);
    # live: the ~100 workers (plus lapsed ones awaiting the next tick)
    assert peak_tombs < 600
    assert peak_entries < 1000
    assert all(n.dead_marks == 0 for n in nodes)


# -- wire ---------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(entries())
def test_wire_round_trip(e: RegEntry) -> None:
    w = msgpack.unpackb(msgpack.packb(entry_to_wire(e)))
    assert entry_from_wire(w) == e


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
        lambda inner: st.lists(inner, max_size=7),
        max_leaves=20,
    )
)
def test_malformed_entries_are_refused_or_round_trip(v: Any) -> None:
    try:
        e = entry_from_wire(v)
    except StateDecodeError:
        return
    # accepted: a well-formed entry, the one its own encoding gives back
    assert entry_from_wire(msgpack.unpackb(msgpack.packb(entry_to_wire(e)))) == e


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_an_entry_with_one_field_changed_is_refused_or_round_trips(data: st.DataObject) -> None:
    good_entry = RegEntry("w", 5, "a", LIVE, rec("w", "a"), 5)
    good = entry_to_wire(good_entry)
    assert entry_from_wire(good) == good_entry
    i = data.draw(st.integers(0, len(good) - 1))
    junk = data.draw(st.none() | st.booleans() | st.integers() | st.text(max_size=4) | st.binary(max_size=8))
    try:
        e = entry_from_wire([*good[:i], junk, *good[i + 1 :]])
    except StateDecodeError:
        return
    assert entry_from_wire(msgpack.unpackb(msgpack.packb(entry_to_wire(e)))) == e
    with pytest.raises(StateDecodeError):
        entry_from_wire(good[:i])  # cut short: refused


def test_a_tombstone_with_a_record_or_a_live_entry_without_one_is_rejected() -> None:
    good = entry_to_wire(RegEntry("w", 5, "a", LIVE, rec("w", "a"), 5))
    bad_live = [*good[:5], None]
    bad_tomb = [good[0], 5, "a", REMOVED, 5, good[5]]
    bad_renewed = [good[0], 5, "a", LIVE, 4, good[5]]
    for v in (bad_live, bad_tomb, bad_renewed):
        with pytest.raises(StateDecodeError):
            entry_from_wire(v)
