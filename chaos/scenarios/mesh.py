"""Scenarios on the SWIM mesh (``FleetSpec(mesh=True)``): partitions between node namespaces under load.

Implemented: ``mesh_partition_2_1``, ``mesh_partition_3_2`` (partition, then heal), ``mesh_one_way_partition``
and ``mesh_flapping_partition``. The nodes run with ``--mesh-push-pull-interval 5``; ``chaos.mesh_watch``
polls every node's ``GET /mesh/members`` and stamps each change of its view. Figures: detection time (fault
-> a node marks the victim suspect / every node marks it dead), convergence time (heal -> every node sees
every member alive), false-dead count (a node declared dead by a node nothing cut it off from), requests lost
through the LB (a client with one retry).

Still placeholders (TODO-mesh): detection and convergence after a crash / pause / leave, rate-limit
over-admission under a partition (admitted / limit while partitioned), cache affinity kept after failover
(share of follow-up turns that land on the engine holding their prefix, before vs after).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import replace

from chaos import faults
from chaos.fleet import Fleet, Member
from chaos.mesh_watch import DOWN_STATES, MeshWatch, all_alive
from chaos.report import ScenarioResult
from chaos.scenarios.base import DEFAULT_SPEC, Traffic, scenario, todo_mesh

PUSH_PULL_S = 5.0  # --mesh-push-pull-interval of the mesh fleets: the heal bound is this + 2 s
SUSPICION_MIN_S = 2.0  # suspicion_mult 4 x probe interval 0.5 s (x max(1, log10 n)): the fastest dead
DETECT_BOUND_S = 15.0  # the slowest dead: 6 x the minimum (Lifeguard, no confirmations), plus slack
CONVERGE_BOUND_S = PUSH_PULL_S + 2.0
BASELINE_S = 2.0
MESH_NODE_ARGS = (*DEFAULT_SPEC.node_args, "--mesh-push-pull-interval", str(PUSH_PULL_S))
MESH3 = replace(DEFAULT_SPEC, mesh=True, node_args=MESH_NODE_ARGS)
MESH5 = replace(MESH3, nodes=5)


def _names(ms: Sequence[Member]) -> list[str]:
    return [m.name for m in ms]


def _baseline(fleet: Fleet, watch: MeshWatch, result: ScenarioResult) -> list[str]:
    """Wait until every node sees every node alive (the previous scenario may have left the mesh healing)."""
    names = _names(fleet.active_nodes())
    took = watch.wait(all_alive(names), timeout=40.0)
    result.figures["baseline_converged_s"] = took
    if took is None:
        raise RuntimeError(f"the mesh never converged before the fault: {watch.view()}")
    return names


def _timeline(result: ScenarioResult, tr: Traffic, watch: MeshWatch, after: float) -> None:
    """The views' changes since ``after`` go into the scenario's timeline."""
    result.timeline += [
        (round(c.at - tr.t0, 2), f"{c.observer} sees {c.member} {c.state}") for c in watch.history(after)
    ]
    result.timeline.sort()


def _false_dead(watch: MeshWatch, after: float, until: float, cut: set[tuple[str, str]]) -> list[str]:
    """Members some node declared dead although nothing cut them off from that node."""
    return sorted({m for o, m in watch.marked_dead(after, until) if (o, m) not in cut and o != m})


def _partition_heal(fleet: Fleet, result: ScenarioResult, minority: int) -> None:
    nodes = fleet.active_nodes()
    side_b, side_a = nodes[:minority], nodes[minority:]  # side a is the majority
    a_names, b_names = _names(side_a), _names(side_b)
    cut = {(x, y) for x in a_names for y in b_names} | {(y, x) for x in a_names for y in b_names}
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        fault = faults.partition(fleet.firewall, [n.host for n in side_a], [n.host for n in side_b])
        cut_at = tr.mark(fault.description)
        try:

            def split(view: dict[str, dict[str, str]]) -> bool:
                return all(view.get(o, {}).get(m) == "dead" for o, m in cut)

            split_s = watch.wait(split, timeout=DETECT_BOUND_S + 5.0)
            tr.sleep(2.0)
        finally:
            fault.heal()
        heal_at = tr.mark("healed")
        converged_s = watch.wait(all_alive(names), timeout=30.0)
        tr.mark("mesh converged" if converged_s is not None else "mesh did not converge")
        end = time.monotonic()
        tr.sleep(1.0)
    _timeline(result, tr, watch, cut_at)
    t = result.traffic
    assert t is not None
    suspect_a = [watch.first(cut_at, a_names, m, DOWN_STATES) for m in b_names]
    dead_a = [watch.all_saw(cut_at, a_names, m, {"dead"}) for m in b_names]
    dead_b = [watch.all_saw(cut_at, b_names, m, {"dead"}) for m in a_names]
    false_dead = _false_dead(watch, cut_at, end, cut)
    detect_s = None if any(x is None for x in suspect_a) else max(x for x in suspect_a if x is not None)
    dead_s = None if any(x is None for x in dead_a) else max(x for x in dead_a if x is not None)
    minority_dead_s = None if any(x is None for x in dead_b) else max(x for x in dead_b if x is not None)
    result.figures.update(
        partition=f"{len(a_names)} | {len(b_names)}",
        detection_suspect_s=detect_s,
        detection_dead_majority_s=dead_s,
        detection_dead_minority_s=minority_dead_s,
        both_sides_split_s=split_s,
        partitioned_s=round(heal_at - cut_at, 2),
        convergence_after_heal_s=converged_s,
        convergence_bound_s=CONVERGE_BOUND_S,
        false_dead=len(false_dead),
        false_suspect=len(
            {(c.observer, c.member) for c in watch.history(cut_at, end) if c.state == "suspect"} - cut
        ),
        view_changes=len(watch.history(cut_at, end)),
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check(
        f"the majority marks the minority dead within {DETECT_BOUND_S} s",
        dead_s is not None and dead_s <= DETECT_BOUND_S,
        f"suspect after {detect_s} s, dead (every majority node) after {dead_s} s",
    )
    result.check(
        "each side converges on its own view (the other side dead)", split_s is not None, f"after {split_s} s"
    )
    result.check(
        f"after the heal every node sees all {len(names)} members alive within push-pull + 2 s",
        converged_s is not None and converged_s <= CONVERGE_BOUND_S,
        f"{converged_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    result.check("no node on the same side is declared dead", not false_dead, f"false dead: {false_dead}")
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")


@scenario(
    "mesh_partition_2_1",
    "3-node mesh partitioned 2 | 1, then healed",
    spec=MESH3,
    must_hold="the majority declares the lone node dead within the suspicion bound; after the heal every "
    "node sees 3 alive members within push-pull + 2 s (convergence time); no request lost through the LB",
)
def mesh_partition_2_1(fleet: Fleet, result: ScenarioResult) -> None:
    _partition_heal(fleet, result, minority=1)


@scenario(
    "mesh_partition_3_2",
    "5-node mesh partitioned 3 | 2, then healed",
    spec=MESH5,
    must_hold="each side converges on its own view; after the heal one view again within push-pull + 2 s; "
    "no false dead; no request lost through the LB",
)
def mesh_partition_3_2(fleet: Fleet, result: ScenarioResult) -> None:
    _partition_heal(fleet, result, minority=2)


ONE_WAY_HOLD_S = 15.0  # longer than the slowest suspicion timeout


@scenario(
    "mesh_one_way_partition",
    "a one-way partition (A's packets to B dropped) for 15 s",
    spec=MESH3,
    must_hold="indirect probes keep A and B alive in everyone's view: no false dead; no request lost",
)
def mesh_one_way_partition(fleet: Fleet, result: ScenarioResult) -> None:
    a, b = fleet.active_nodes()[:2]
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        fault = faults.one_way(fleet.firewall, [a.host], [b.host])
        cut_at = tr.mark(fault.description)
        try:
            tr.sleep(ONE_WAY_HOLD_S)
        finally:
            fault.heal()
        heal_at = tr.mark("healed")
        converged_s = watch.wait(all_alive(names), timeout=30.0)
        end = time.monotonic()
        tr.sleep(1.0)
    _timeline(result, tr, watch, cut_at)
    t = result.traffic
    assert t is not None
    false_dead = _false_dead(watch, cut_at, end, set())
    suspected = sorted(
        {f"{c.observer}:{c.member}" for c in watch.history(cut_at, heal_at) if c.state == "suspect"}
    )
    result.figures.update(
        one_way=f"{a.name} -> {b.name}",
        held_s=round(heal_at - cut_at, 2),
        false_dead=len(false_dead),
        suspicions=len(suspected),
        view_changes=len(watch.history(cut_at, end)),
        all_alive_after_heal_s=converged_s,
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check("no node is declared dead (indirect probes)", not false_dead, f"false dead: {false_dead}")
    result.check(
        "every node sees all alive after the heal", converged_s is not None, f"after {converged_s} s"
    )
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")


FLAP_S = 20.0
FLAP_SEED = 7


@scenario(
    "mesh_flapping_partition",
    "a partition (1 | 2) that flaps every 0.5-2 s for 20 s",
    spec=MESH3,
    must_hold="no view flips a member to dead faster than the suspicion timeout; false-dead count reported; "
    "one view again within push-pull + 2 s after the flapping stops; no request lost",
)
def mesh_flapping_partition(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    lone, rest = nodes[0], nodes[1:]
    rng = random.Random(FLAP_SEED)
    flips = 0
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        start = tr.mark(f"flapping {lone.name} | {', '.join(_names(rest))} begins")
        fault: faults.Fault | None = None
        try:
            while time.monotonic() - start < FLAP_S:
                if fault is None:
                    fault = faults.partition(fleet.firewall, [lone.host], [n.host for n in rest])
                else:
                    fault.heal()
                    fault = None
                flips += 1
                time.sleep(rng.uniform(0.5, 2.0))
        finally:
            if fault is not None:
                fault.heal()
        stop_at = tr.mark("flapping ends, healed")
        converged_s = watch.wait(all_alive(names), timeout=30.0)
        end = time.monotonic()
        tr.sleep(1.0)
    _timeline(result, tr, watch, start)
    t = result.traffic
    assert t is not None
    deaths: dict[tuple[str, str], list[float]] = {}
    for c in watch.history(start, end):
        if c.state == "dead":
            deaths.setdefault((c.observer, c.member), []).append(c.at)
    gaps = [b - a for ts in deaths.values() for a, b in itertools.pairwise(ts)]
    min_gap = round(min(gaps), 2) if gaps else None
    cut = {(lone.name, n.name) for n in rest} | {(n.name, lone.name) for n in rest}
    result.figures.update(
        partition_flips=flips,
        flapping_s=round(stop_at - start, 2),
        dead_declarations=sum(len(ts) for ts in deaths.values()),
        suspicions=sum(1 for c in watch.history(start, end) if c.state == "suspect"),
        false_dead=len(_false_dead(watch, start, end, cut)),
        dead_of_partitioned=len(watch.marked_dead(start, end) & cut),
        view_changes=len(watch.history(start, end)),
        min_gap_between_deaths_s=min_gap,
        convergence_after_stop_s=converged_s,
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check(
        f"no view declares a member dead twice within the suspicion timeout ({SUSPICION_MIN_S} s)",
        min_gap is None or min_gap >= SUSPICION_MIN_S,
        f"shortest gap {min_gap} s",
    )
    result.check(
        "one view again within push-pull + 2 s after the flapping",
        converged_s is not None and converged_s <= CONVERGE_BOUND_S,
        f"{converged_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")


todo_mesh(
    "mesh_detection_convergence",
    "detection and convergence after a crash, a 10 s pause and a graceful leave",
    "figures: detection time, convergence time, false-dead count "
    "(Lifeguard: a slow node is not declared dead)",
)
todo_mesh(
    "mesh_ratelimit_over_admission",
    "a mesh-wide rate limit under a partition",
    "admitted requests stay within the partition's allowance (each side admits limit x reachable / N)",
)
todo_mesh(
    "mesh_cache_affinity_failover",
    "cache affinity after a node failover",
    "follow-up turns keep landing on the engine that holds their prefix after the node that routed them dies "
    "(the prefix index is gossiped)",
)
