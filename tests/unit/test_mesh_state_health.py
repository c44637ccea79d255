"""Replicated health: one versioned record per observer, gossiped as changes (deltas chained by version,
beacons, full records on push-pull); the combined view; dead observers; bounds; the wire."""

from __future__ import annotations

import random
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.hlc import HLC, make_stamp
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_health import (
    GONE,
    HEALTHY,
    UNHEALTHY,
    HealthBeacon,
    HealthConfig,
    HealthDelta,
    HealthRecord,
    Observation,
    ReplicatedHealth,
    beacon_from_wire,
    beacon_to_wire,
    checked_hash,
    delta_from_wire,
    delta_to_wire,
    records_from_wire,
    records_to_wire,
)
from shepherd.mesh.state_registry import WorkerRecord
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.state_wire import envelope
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto.state_decode import StateDecodeError

T0 = 1_000_000.0
T0_MS = int(T0 * 1000)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def health(node: str, clock: Clock, cfg: HealthConfig | None = None) -> ReplicatedHealth:
    return ReplicatedHealth(node, HLC(clock), cfg)


def truth(h: ReplicatedHealth) -> tuple[frozenset[str], frozenset[str]]:
    r = h.record(h.node)
    assert r is not None
    return r.checked, r.unhealthy


def held(h: ReplicatedHealth, observer: str) -> tuple[frozenset[str], frozenset[str]] | None:
    r = h.record(observer)
    return None if r is None else (r.checked, r.unhealthy)


def deliver(dst: ReplicatedHealth, items: list[HealthDelta | HealthBeacon]) -> set[str]:
    changed: set[str] = set()
    for it in items:
        changed |= dst.merge_delta(it) if isinstance(it, HealthDelta) else dst.merge_beacon(it)
    return changed


# -- the combined view -----------------------------------------------------------------------------------


def test_combined_view_majority_then_local_then_healthy() -> None:
    clock = Clock()
    me = health("me", clock)
    others = [health(f"n{i}", clock) for i in range(3)]
    assert me.view("w").routable and me.view("w").healthy == 0  # nothing known: routable
    for h in others[:2]:
        h.observe("w", False)
        deliver(me, h.take_delta())
    v = me.view("w")
    assert (v.healthy, v.unhealthy, v.local, v.routable) == (0, 2, None, False)
    me.observe("w", True)
    others[2].observe("w", True)
    deliver(me, others[2].take_delta())
    v = me.view("w")
    assert (v.healthy, v.unhealthy, v.local, v.routable) == (2, 2, True, True)  # a tie: ours decides
    me.observe("w", False)
    assert not me.routable("w")
    assert me.view("other") == me.view("other2") and me.routable("other")  # unchecked: routable


def test_only_changes_are_published_and_a_beacon_every_beacon_s() -> None:
    clock = Clock()
    a = health("a", clock, HealthConfig(beacon_s=10.0))
    assert a.observe("w1", True) and a.observe("w2", True)
    first = a.take_delta()
    assert len(first) == 1 and isinstance(first[0], HealthDelta)  # both flips in one delta
    assert dict(first[0].flips) == {"w1": HEALTHY, "w2": HEALTHY} and first[0].prev == 0
    for _ in range(30):  # the checker keeps observing the same: nothing to send but beacons
        clock.t += 1.0
        assert not a.observe("w1", True) and not a.observe("w2", True)
        a.tick()
    out = a.take_delta()
    assert out and all(isinstance(x, HealthBeacon) for x in out) and len(out) == 3  # 30 s / 10 s
    assert a.observe("w2", False)
    (d,) = a.take_delta()
    assert isinstance(d, HealthDelta) and d.prev == first[0].version and d.flips == (("w2", UNHEALTHY),)


def test_deltas_in_order_keep_a_record_in_sync() -> None:
    clock = Clock()
    a, b = health("a", clock), health("b", clock)
    rng = random.Random(1)
    for _ in range(200):
        clock.t += 0.01
        w = f"w{rng.randrange(20)}"
        if rng.random() < 0.1:
            a.forget(w)
        else:
            a.observe(w, rng.random() < 0.6)
        if rng.random() < 0.3:
            deliver(b, a.take_delta())
    deliver(b, a.take_delta())
    assert held(b, "a") == truth(a) and b.in_sync("a") and b.out_of_sync == 0
    assert b.versions()["a"] == a.versions()["a"]


def test_a_missed_delta_is_healed_by_the_beacon_then_the_full_record() -> None:
    clock = Clock()
    a, b = health("a", clock), health("b", clock)
    for i in range(5):
        a.observe(f"w{i}", True)
    deliver(b, a.take_delta())
    a.observe("w1", False)
    a.observe("w9", True)  # a new worker checked
    a.take_delta()  # lost
    clock.t += 0.5
    a.observe("w2", False)
    deliver(b, a.take_delta())  # applied across the gap: out of sync
    assert b.out_of_sync == 1 and not b.in_sync("a")
    assert b.view("w2").unhealthy == 1 and b.view("w1").unhealthy == 0  # w1's flip was lost
    assert "a" not in b.versions()  # a peer's digest asks for the whole record
    clock.t += 20.0
    a.tick()
    deliver(b, a.take_delta())  # the beacon: the unhealthy set is exact again, the checked set is not
    assert b.view("w1").unhealthy == 1 and b.view("w2").unhealthy == 1
    assert not b.in_sync("a") and b.view("w9").healthy == 0
    assert b.merge_records(a.newer_than(b.versions())) >= {"w9"}  # push-pull from the owner
    assert b.in_sync("a") and held(b, "a") == truth(a) and b.view("w9").healthy == 1


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 30), loss=st.floats(0.0, 0.6))
def test_lossy_reordered_gossip_then_repair_converges_to_the_observers_records(
    seed: int, loss: float
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    nodes = [health(f"n{i}", clock) for i in range(3)]
    inflight: list[tuple[ReplicatedHealth, HealthDelta | HealthBeacon]] = []
    for _ in range(rng.randrange(1, 10)):
        for h in nodes:
            for _ in range(rng.randrange(0, 6)):
                clock.t += rng.random() * 0.05
                w = f"w{rng.randrange(6)}"
                if rng.random() < 0.1:
                    h.forget(w)
                else:
                    h.observe(w, rng.random() < 0.7)
            if rng.random() < 0.3:
                clock.t += 11.0
                h.tick()
            for it in h.take_delta():
                inflight += [(d, it) for d in nodes if d is not h and rng.random() >= loss]
        rng.shuffle(inflight)
        inflight += inflight[: rng.randrange(0, 3)]  # duplicates
        while inflight and rng.random() < 0.8:
            dst, it = inflight.pop()
            deliver(dst, [it])
    for a in nodes:  # push-pull: each pulls what it lacks from every other
        for b in nodes:
            if a is not b:
                a.merge_records(b.newer_than(a.versions()))
    for h in nodes:
        for o in nodes:
            if o is not h and truth(o)[0]:
                assert held(h, o.node) == truth(o) and h.in_sync(o.node)
    for w in (f"w{i}" for i in range(6)):
        views = {(v.healthy, v.unhealthy) for v in (h.view(w) for h in nodes)}
        assert len(views) == 1  # every node counts the same votes


def test_records_merge_in_any_order_to_the_newest() -> None:
    clock = Clock()
    a = health("a", clock)
    recs = []
    for i in range(4):
        clock.t += 1
        a.observe(f"w{i}", i % 2 == 0)
        recs.append(a.record("a"))
    for perm in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1, 3]):
        b = health("b", clock)
        for i in perm:
            r = recs[i]
            assert r is not None
            b.merge_records([r])
        assert held(b, "a") == truth(a)


# -- membership, bounds ----------------------------------------------------------------------------------


def test_a_dead_observer_is_dropped_and_its_late_messages_refused_until_it_is_back() -> None:
    clock = Clock()
    a, b = health("a", clock), health("b", clock)
    a.observe("w", False)
    early = a.take_delta()
    deliver(b, early)
    clock.t += 2.0
    assert b.on_member_dead("a") == {"w"}
    assert b.view("w").unhealthy == 0
    assert deliver(b, early) == set() and b.dropped == 1
    rec = a.record("a")
    assert rec is not None and b.merge_records([rec]) == set()
    clock.t += 3600.0  # however late: records do not expire by time, so they stay refused
    b.tick()
    assert b.merge_records([rec]) == set() and b.record("a") is None
    b.on_member_alive("a")
    clock.t += 1.5
    a.observe("w", True)
    assert deliver(b, a.take_delta()) == {"w"} and b.view("w").healthy == 1
    assert not b.in_sync("a")  # it came back mid-chain: a full record makes it whole
    b.merge_records(a.newer_than(b.versions()))
    assert b.in_sync("a")


def test_state_is_bounded_by_observers_and_checked_workers() -> None:
    clock = Clock()
    cfg = HealthConfig(max_observers=3, max_checked=4, max_outbox=8)
    b = health("b", clock, cfg)
    for i in range(6):
        o = health(f"o{i}", clock)
        o.observe("w", False)
        deliver(b, o.take_delta())
    assert len(b.records()) == 2 + 0 and b.dropped >= 4  # b itself holds one of the 3 slots
    for i in range(10):
        b.observe(f"w{i}", True)
    assert len(truth(b)[0]) == 4
    assert len(b.take_delta()) <= 8


def test_checked_hash_is_order_free_and_tells_sets_apart() -> None:
    assert checked_hash(frozenset(["a", "b"])) == checked_hash(frozenset(["b", "a"]))
    assert checked_hash(frozenset(["a", "b"])) != checked_hash(frozenset(["a", "b", "c"]))
    assert checked_hash(frozenset(["ab"])) != checked_hash(frozenset(["a", "b"]))


# -- earlier-format observations ---------------------------------------------------------------------------


def test_earlier_format_observations_count_while_fresh() -> None:
    clock = Clock()
    b = health("b", clock, HealthConfig(legacy_fresh_s=30.0))
    stamp = make_stamp(T0_MS)
    assert b.merge_legacy([Observation("w", "old", stamp, False)]) == {"w"}
    assert b.view("w").unhealthy == 1 and not b.routable("w")
    clock.t += 31.0
    assert b.view("w").unhealthy == 0 and b.routable("w")
    assert b.tick() == {"w"} and len(b) == 0


# -- MeshState: push-pull by digest, first hand ----------------------------------------------------------


def mesh(name: str, clock: Clock, first_hand: bool = False) -> MeshState[Replica]:
    return MeshState(name, clock, MeshStateConfig(first_hand=first_hand), new_index=make_replica)


def exchange(a: MeshState[Replica], b: MeshState[Replica]) -> tuple[int, int]:
    """One push-pull, a the requester (as the runtime and the simulator do it); the bytes each way."""
    req = a.local_state()
    b.merge_remote_state_from(req, a.node)
    rep = b.local_state()
    a.merge_remote_state_from(rep, b.node)
    return len(req), len(rep)


def test_push_pull_sends_only_the_records_the_requester_lacks() -> None:
    clock = Clock()
    nodes = [mesh(f"n{i}", clock) for i in range(12)]
    for m in nodes:
        for j in range(40):
            m.observe_health(f"worker-{j:04d}", j % 7 != 0)
    hub = nodes[0]
    for m in nodes[1:]:
        exchange(m, hub)
        exchange(hub, m)
    assert len(hub.health.records()) == 12
    fresh = mesh("fresh", clock)
    _, join = exchange(fresh, hub)
    assert len(fresh.health.records()) == 12  # the join carried every record
    assert fresh.health_view("worker-0000").unhealthy == 12
    _, steady = exchange(fresh, hub)
    assert steady < 200 < join  # converged: the reply carries no record
    hub.observe_health("worker-0001", False)
    _, one = exchange(fresh, hub)
    assert steady < one < join and fresh.health_view("worker-0001").unhealthy == 1


def test_first_hand_push_pull_reply_carries_only_the_responders_record() -> None:
    clock = Clock()
    a, b, c = (mesh(n, clock, first_hand=True) for n in ("a", "b", "c"))
    for m in (a, b, c):
        for n in ("a", "b", "c"):
            m.on_member_up(n)
        m.observe_health("w", m.node != "c")
    exchange(c, b)  # b has c's record first-hand
    exchange(a, b)
    assert {r.observer for r in a.health.records()} == {"a", "b"}  # not c's, relayed by b
    assert {r.observer for r in b.health.records()} == {"a", "b", "c"}


def test_first_hand_drops_deltas_beacons_and_records_naming_another_observer() -> None:
    clock = Clock()
    s2 = mesh("n2", clock, first_hand=True)
    n1 = health("n1", clock)
    n1.observe("w1", False)
    clock.t += 11
    n1.tick()
    items = n1.take_delta()
    rec = n1.record("n1")
    assert rec is not None
    payloads = [
        envelope("f", [delta_to_wire(i) for i in items if isinstance(i, HealthDelta)]),
        envelope("b", [beacon_to_wire(i) for i in items if isinstance(i, HealthBeacon)]),
        envelope("H", records_to_wire([rec])),
    ]
    for p in payloads:
        s2.on_user(p, "n3")
    assert s2.health.records() == [] and s2.stats.foreign_entries_dropped == 3
    s2.on_user(payloads[0], "n1")
    assert s2.health_view("w1").unhealthy == 1 and s2.health.in_sync("n1")
    assert s2.broadcasts(1400) == []  # first hand: nothing relayed


def test_gossip_relays_a_delta_once_and_a_stale_one_not_at_all() -> None:
    clock = Clock()
    a, b, c = (mesh(n, clock) for n in ("a", "b", "c"))
    a.observe_health("w", False)
    (p,) = a.broadcasts(1400)
    b.on_user(p, "a")
    b.on_user(p, "a")  # a duplicate changes nothing: not queued again
    assert len(b.health.take_delta()) == 1
    c.on_user(p, "a")
    relayed = c.broadcasts(1400)
    assert relayed == [p]  # c passes it on, as it came
    assert c.health_view("w").unhealthy == 1


# -- wire ----------------------------------------------------------------------------------------------

names = st.sampled_from(["w0", "w1", "worker-abcdef", "x"])


@settings(max_examples=100, deadline=None)
@given(
    obs=st.sampled_from(["n1", "node-b"]),
    prev=st.integers(0, 1 << 40),
    ver=st.integers(1, 1 << 62),
    flips=st.lists(st.tuples(names, st.sampled_from([HEALTHY, UNHEALTHY, GONE])), max_size=5),
    sick=st.lists(names, max_size=4),
)
def test_wire_round_trips(
    obs: str, prev: int, ver: int, flips: list[tuple[str, int]], sick: list[str]
) -> None:
    d = HealthDelta(obs, prev, ver, tuple(flips))
    assert delta_from_wire(msgpack.unpackb(msgpack.packb(delta_to_wire(d)))) == d
    b = HealthBeacon(obs, ver, tuple(sick), checked_hash(frozenset(sick)))
    assert beacon_from_wire(msgpack.unpackb(msgpack.packb(beacon_to_wire(b)))) == b
    recs = [
        HealthRecord(obs, ver, frozenset(sick) | {"w0"}, frozenset(sick)),
        HealthRecord("other", ver, frozenset(sick) | {"w0"}, frozenset()),
    ]
    wire = records_to_wire(recs)
    assert len(wire[0]) == 1  # the shared checked set travels once
    assert records_from_wire(msgpack.unpackb(msgpack.packb(wire))) == recs


def test_later_minor_trailing_fields_are_ignored() -> None:
    d = HealthDelta("n1", 0, 5, (("w", HEALTHY),))
    assert delta_from_wire([*delta_to_wire(d), "later"]) == d
    b = HealthBeacon("n1", 5, (), b"12345678")
    assert beacon_from_wire([*beacon_to_wire(b), 1]) == b
    sets, recs = records_to_wire([HealthRecord("n1", 5, frozenset({"w"}), frozenset())])
    assert records_from_wire([sets, [[*r, 0] for r in recs], "x"])[0].observer == "n1"


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        ["n1", 0, 5],
        ["n1", 0, 0, []],  # version 0
        ["n1", -1, 5, []],
        ["n1", 0, 5, [["w", 2]]],  # no such state
        ["n1", 0, 5, [["w"]]],
        ["", 0, 5, []],
        [1, 0, 5, []],
    ],
)
def test_malformed_deltas_are_refused(bad: Any) -> None:
    with pytest.raises(StateDecodeError):
        delta_from_wire(bad)


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [[], []],
        [[["w"]], [["n1", 5, 1, []]]],  # no such set
        [[["w"]], [["n1", 5, 0, ["v"]]]],  # unhealthy but not checked
        [[["w"]], [["n1", 0, 0, []]]],  # version 0
        [[[1]], [["n1", 5, 0, []]]],
        [[["w"]], [["n1", 5, 0]]],
    ],
)
def test_malformed_records_are_refused(bad: Any) -> None:
    if bad == [[], []]:
        assert records_from_wire(bad) == []  # empty is fine
        return
    with pytest.raises(StateDecodeError):
        records_from_wire(bad)


def test_malformed_health_payloads_merge_nothing() -> None:
    clock = Clock()
    m = mesh("m", clock)
    for tag, body in (("f", [["n1", 0, 5, [["w", 7]]]]), ("b", [["n1", 5, [1], b""]]), ("H", [[["w"]], [1]])):
        with pytest.raises(StateDecodeError):
            m.apply(envelope(tag, body), "n1")
    assert m.health.records() == [] and m.stats.decode_errors == 3


def test_a_worker_removed_from_the_registry_leaves_this_nodes_record() -> None:
    clock = Clock()
    a, b = mesh("a", clock), mesh("b", clock)
    a.add_worker(WorkerRecord("w1", "grpc://x:1", "m"))
    a.observe_health("w1", False)
    for p in a.broadcasts(1 << 16):
        b.on_user(p, "a")
    assert b.health_view("w1").unhealthy == 1
    a.remove_worker("w1")  # a stops checking it: a GONE flip, not a stale vote until a dies
    rec = a.health.record("a")
    assert rec is not None and "w1" not in rec.checked
    for p in a.broadcasts(1 << 16):
        b.on_user(p, "a")
    assert b.health_view("w1").unhealthy == 0 and b.health.in_sync("a")


def test_a_restarted_observer_starts_a_new_record() -> None:
    clock = Clock()
    a, b = health("a", clock), health("b", clock)
    for w in ("w1", "w2", "w3"):
        a.observe(w, w != "w1")
    deliver(b, a.take_delta())
    clock.t += 5.0
    a2 = health("a", clock)  # the same name, started again: it checks only w3 now
    a2.observe("w3", False)
    assert deliver(b, a2.take_delta()) == {"w1", "w2", "w3"}
    assert held(b, "a") == (frozenset({"w3"}), frozenset({"w3"})) and b.in_sync("a")
    assert b.view("w1").unhealthy == 0 and b.view("w2").healthy == 0


def test_a_flip_is_relayed_a_records_bulk_and_a_beacon_that_changes_nothing_are_not() -> None:
    clock = Clock()
    a, b = (
        health("a", clock, HealthConfig(relay_max_flips=2)),
        health("b", clock, HealthConfig(relay_max_flips=2)),
    )
    for i in range(5):
        a.observe(f"w{i}", True)
    deliver(b, a.take_delta())  # the first fill: 5 flips
    assert b.take_delta() == [] and b.in_sync("a")
    a.observe("w1", False)
    (flip,) = a.take_delta()
    deliver(b, [flip])
    assert b.take_delta() == [flip]  # passed on
    clock.t += 11.0
    a.tick()
    (beacon,) = a.take_delta()
    deliver(b, [beacon])
    assert b.take_delta() == []  # b agreed with it already
    c = health("c", clock)
    deliver(c, [beacon])  # c had nothing of a: the beacon corrected it, so it is passed on
    assert c.take_delta() == [beacon] and c.view("w1").unhealthy == 1


def test_a_bulk_publication_is_cut_evenly_and_no_piece_passes_for_a_flip() -> None:
    clock = Clock()
    a = health("a", clock, HealthConfig(max_flips=48, relay_max_flips=8))
    for i in range(49):
        a.observe(f"w{i}", True)
    out = a.take_delta()
    assert [len(d.flips) for d in out if isinstance(d, HealthDelta)] == [25, 24]
    b = health("b", clock)
    deliver(b, out)
    assert held(b, "a") == truth(a) and b.in_sync("a")
