"""SWIM in the deterministic simulator: detection, no false DEAD under loss and pauses, partitions, restarts.

All bounds are in simulated seconds (the clock is fake), so they are deterministic, not timed assertions.
"""

from __future__ import annotations

import itertools
import random

import pytest

from shepherd.mesh.sim import GossipDelegate, Sim
from shepherd.mesh.swim_types import SwimConfig
from shepherd.proto.mesh_messages import MemberState

A, S, D, L = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
WARMUP = 5.0


def _random_pauses(
    sim: Sim, rng: random.Random, start: float, end: float, every: float, length: float
) -> int:
    return len(sim.random_pauses(rng, start, end, every, length))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def test_cluster_forms_through_one_seed() -> None:
    sim = Sim(10, seed=1, start_spread=1.0, loss=0.05)
    sim.run(1.0)
    assert sim.run_until(sim.converged, timeout=3.0) is not None
    assert sim.wire_errors == 0
    assert all(sim.swim(n).joined for n in sim.names)


@pytest.mark.parametrize(("n", "bound"), [(3, 6.0), (10, 6.0), (50, 10.0)])
def test_crash_detected_by_all_within_bound(n: int, bound: float) -> None:
    sim = Sim(n, seed=n)
    sim.run(WARMUP + 1)
    assert sim.converged()
    victim = sim.names[n // 2]
    crashed_at = sim.now
    sim.crash(victim)
    survivors = sim.up()
    t = sim.run_until(lambda: sim.sees(survivors, [victim], D), timeout=30.0)
    assert t is not None
    # at least the minimum suspicion timeout (after a failed probe)...
    assert t - crashed_at >= SwimConfig().suspicion_bounds(n)[0]
    # ...and no more than the bound (confirmations drive the timer to its minimum)
    assert t - crashed_at <= bound
    assert sim.false_dead() == []


def _crash_trial(n: int, trial: int) -> list[float]:
    """Each survivor's time to mark a node crashed at a random phase DEAD."""
    rng = random.Random(f"bar-{n}-{trial}")
    sim = Sim(n, seed=100 * n + trial)
    sim.run(WARMUP + rng.uniform(0, 1.0))
    victim = rng.choice(sim.names)
    crashed_at = sim.now
    sim.crash(victim)
    assert sim.run_until(lambda: sim.sees(sim.up(), [victim], D), timeout=20.0) is not None
    assert sim.false_dead() == []
    return [t - crashed_at for t in sim.detection(victim, crashed_at).values()]


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_crash_detection_meets_the_bar(n: int) -> None:
    """Issue 4's bar in simulated time: detection p50 <= 3 s and p99 <= 5 s at every n <= 20 (here:
    every observer's time in 24 crashes at random phases, each in its own seeded cluster; 24 rather than
    6: with probes on a shared grid the observers of one crash mostly agree to the ms, so a crash is
    nearly one sample, and six of them left the median to one seed)."""
    trials = 24
    took = [t for trial in range(trials) for t in _crash_trial(n, trial)]
    assert len(took) == trials * (n - 1)
    assert _pct(took, 50) <= 3.0
    assert max(took) <= 5.0


@pytest.mark.parametrize(("n", "length"), [(3, 1.5), (5, 1.5), (5, 0.5)])
def test_no_false_dead_from_pauses_shorter_than_the_timers(n: int, length: float) -> None:
    """Single SIGSTOPs of up to 1.5 s (a node rests 0.2 s before it is paused again) with 10% loss:
    the paused node clears itself every time (the floor is 2.0 s after a failed 0.4 s probe)."""
    sim = Sim(n, seed=40 + n, loss=0.1)
    sim.run(WARMUP)
    pauses = sim.random_pauses(random.Random(n), WARMUP, 65.0, every=2.0, length=length, rest=0.2)
    sim.run(65.0)
    assert len(pauses) > 20
    assert sum(1 for e in sim.events if e.kind == "suspect") > 20  # the pauses did bite
    assert sim.false_dead() == []


def test_no_false_dead_under_loss_and_pauses_soak() -> None:
    """10% loss and a random 1 s SIGSTOP every ~3 s for 120 simulated seconds: not one false DEAD."""
    sim = Sim(10, seed=11, loss=0.1)
    sim.run(WARMUP)
    pauses = _random_pauses(sim, random.Random(11), WARMUP, 125.0, every=3.0, length=1.0)
    sim.run(125.0)
    assert pauses > 25
    assert sum(1 for e in sim.events if e.kind == "suspect") > 50  # the faults did bite
    assert sim.false_dead() == []
    sim.loss = 0.0
    assert sim.run_until(sim.converged, timeout=10.0) is not None


def test_no_false_dead_small_clusters_heavy_pauses() -> None:
    for n, seed in ((3, 21), (5, 22)):
        sim = Sim(n, seed=seed, loss=0.1)
        sim.run(WARMUP)
        _random_pauses(sim, random.Random(seed), WARMUP, 100.0, every=2.0, length=1.0)
        sim.run(100.0)
        assert sim.false_dead() == [], n


def test_partition_heal_converges_within_push_pull_interval() -> None:
    """A 60 s split (long past detection and reaping) heals within push_pull_interval + a few s."""
    cfg = SwimConfig()
    sim = Sim(10, seed=3)
    sim.run(WARMUP)
    a, b = sim.names[:5], sim.names[5:]
    sim.partition(a, b)
    sim.run(WARMUP + 60.0)
    for o in a:  # each side has declared the other dead, and reaped it
        assert all(sim.swim(o).member(m) is None for m in b)
    assert sim.converged() is False
    sim.heal()
    healed = sim.now
    t = sim.run_until(sim.converged, timeout=cfg.push_pull_interval + 5.0)
    assert t is not None, "did not reconverge"
    assert t - healed <= cfg.push_pull_interval + 5.0


def test_short_partition_heal_converges() -> None:
    sim = Sim(8, seed=4, loss=0.05)
    sim.run(WARMUP)
    sim.partition(sim.names[:3], sim.names[3:])
    # the minority side is slow to decide, by design: its probes through relays on the other side
    # get no nacks, so Lifeguard blames itself and it backs off (LHM up)
    sim.run(WARMUP + 40.0)
    a, b = sim.names[:3], sim.names[3:]
    assert all(
        sim.view(o).get(m) in (D, None) for o, m in [*itertools.product(a, b), *itertools.product(b, a)]
    )
    sim.heal()
    assert sim.run_until(sim.converged, timeout=20.0) is not None


def test_one_way_link_failure_is_bridged_by_indirect_probes() -> None:
    sim = Sim(10, seed=5, loss=0.02)
    sim.run(WARMUP)
    sim.partition(["n0"], ["n1"], oneway=True)  # n0 -> n1 dropped; n1 -> n0 fine
    sim.run(WARMUP + 60.0)
    assert [e for e in sim.events if e.kind == "dead"] == []
    assert sim.converged()


def test_node_that_cannot_receive_is_declared_dead_and_not_believed() -> None:
    """n3 can send but not receive: the others declare it dead, and its accusations (it hears
    nobody, so it suspects everybody) kill no one in their views."""
    sim = Sim(10, seed=6)
    sim.run(WARMUP)
    others = [n for n in sim.names if n != "n3"]
    sim.partition(others, ["n3"], oneway=True)
    t = sim.run_until(lambda: sim.sees(others, ["n3"], D), timeout=10.0)
    assert t is not None
    sim.run(WARMUP + 60.0)
    assert [e for e in sim.false_dead() if "n3" not in (e.observer, e.member)] == []
    assert sim.swim("n3").health == SwimConfig().lhm_max  # Lifeguard: it knows it is the sick one
    assert all(sim.view(o).get(m) == A for o in others for m in others if m != o)


@pytest.mark.parametrize("incarnation", [None, 0])
def test_restart_rejoins(incarnation: int | None) -> None:
    """A crashed node restarts (new instance, same name): with a higher incarnation it is accepted at
    once; with a stale one it learns it was dead from the push-pull and refutes."""
    sim = Sim(10, seed=7)
    sim.run(WARMUP)
    sim.crash("n2")
    assert sim.run_until(lambda: sim.sees(sim.up(), ["n2"], D), timeout=10.0) is not None
    sim.restart("n2", incarnation=incarnation)
    restarted = sim.now
    t = sim.run_until(sim.converged, timeout=5.0)
    assert t is not None and t - restarted <= 3.0
    assert sim.swim("n2").incarnation >= 1
    assert [e for e in sim.false_dead()] == []


def test_restart_after_reap_rejoins() -> None:
    cfg = SwimConfig(gossip_to_the_dead_time=5.0)
    sim = Sim(6, seed=8, config=cfg)
    sim.run(WARMUP)
    sim.crash("n4")
    sim.run(WARMUP + 20.0)
    assert all(sim.swim(o).member("n4") is None for o in sim.up())
    sim.restart("n4", incarnation=0)
    assert sim.run_until(sim.converged, timeout=5.0) is not None


def test_dead_members_are_cleaned_up_and_memory_is_bounded_under_churn() -> None:
    """45 short-lived nodes (one joins every second and crashes 4 s later): what a stable node holds
    (members + tombstones) stays bounded by the churn rate, not the churn total; all is cleaned up."""
    cfg = SwimConfig(gossip_to_the_dead_time=5.0, tombstone_time=10.0, max_tombstones=8)
    stable = [f"s{i}" for i in range(5)]
    churn = [f"c{i}" for i in range(45)]
    sim = Sim(stable + churn, seed=9, config=cfg, start=False)
    for name in stable:
        sim.boot(name)
    sim.run(WARMUP)
    for i, name in enumerate(churn):
        sim.at(WARMUP + i, lambda name=name: sim.boot(name))  # type: ignore[misc]
        sim.at(WARMUP + i + 4.0, lambda name=name: sim.crash(name))  # type: ignore[misc]
    sizes: list[int] = []
    for k in range(0, 55, 2):
        sim.run(WARMUP + k)
        sw = sim.swim("s0")
        assert len(sw.tombstones()) <= cfg.max_tombstones
        sizes.append(len(sw.members()) + len(sw.tombstones()))
    assert max(sizes) <= 40  # of 50 names
    assert max(sizes[-10:]) <= max(sizes[:18]) + 4  # steady, not growing with the churn total
    # after the last crash: detection (slowed: churned relays send no nacks, so Lifeguard backs off),
    # then gossip_to_the_dead_time, then tombstone_time
    sim.run(WARMUP + 45 + 4 + 60)
    for o in stable:
        assert {m.name for m in sim.swim(o).members()} == set(stable)
        assert sim.swim(o).tombstones() == []
    assert sim.false_dead() == []


def test_graceful_leave_marks_left_not_dead() -> None:
    sim = Sim(10, seed=10)
    sim.run(WARMUP)
    sim.leave("n4")
    others = [n for n in sim.names if n != "n4"]
    t = sim.run_until(lambda: sim.sees(others, ["n4"], L), timeout=3.0)
    assert t is not None
    sim.run(WARMUP + 10.0)
    assert [e for e in sim.events if e.kind == "dead"] == []
    assert not any(e.kind == "suspect" and e.member == "n4" for e in sim.events)


def test_event_loop_lag_raises_health_without_false_dead() -> None:
    sim = Sim(10, seed=12)
    sim.run(WARMUP)
    sim.lag("n1", 0.3, 15.0)
    sim.run(WARMUP + 10.0)
    assert sim.swim("n1").health >= 4
    sim.run(WARMUP + 50.0)
    assert sim.swim("n1").health <= 2  # heals with successful probes
    assert sim.false_dead() == []
    assert sim.converged()


def test_user_broadcast_reaches_everyone_fast() -> None:
    sim = Sim(10, seed=13, delegates=lambda name: GossipDelegate(name, lambda: sim.now))
    sim.run(WARMUP)
    latencies: list[float] = []
    for i in range(10):
        sent = sim.now
        sim.originate(f"n{i}", f"m{i}".encode())
        sim.run_for(2.0)
        for name in sim.names:
            d = sim.nodes[name].delegate
            assert isinstance(d, GossipDelegate)
            latencies.append(d.received[f"m{i}".encode()] - sent)
    assert max(latencies) <= 1.0


def test_simulation_is_deterministic() -> None:
    def run() -> list[tuple[float, str, str, str, int]]:
        sim = Sim(8, seed=99, loss=0.1)
        sim.run(WARMUP)
        sim.pause("n3", 1.0)
        sim.crash("n5")
        sim.run(20.0)
        return [(e.time, e.observer, e.kind, e.member, e.incarnation) for e in sim.events]

    assert run() == run()


def test_wire_is_exercised_and_bytes_counted() -> None:
    cfg = SwimConfig()
    sim = Sim(5, seed=14)
    sim.run(20.0)
    assert sim.wire_errors == 0
    per_node_per_s = sim.gossip_bytes() / 5 / 20.0
    assert 50 < per_node_per_s < 5_000
    assert all(n.stats.bytes_sent <= n.stats.packets_sent * cfg.max_packet_bytes for n in sim.nodes.values())
    plain = Sim(5, seed=14, wire=False)
    plain.run(20.0)
    assert [(e.time, e.kind, e.member) for e in plain.events] == [
        (e.time, e.kind, e.member) for e in sim.events
    ]
