"""Scenarios on the SWIM mesh (``FleetSpec(mesh=True)``): partitions, crashes, pauses and leaves under
load, the mesh-wide rate limit under a partition, and cache affinity across a node failover.

The nodes run with ``--mesh-push-pull-interval 5``; ``chaos.mesh_watch`` polls every node's
``GET /mesh/members`` and stamps each change of its view. Figures: detection time (fault -> a node marks
the victim suspect / every node marks it dead), convergence time (heal, restart or SIGCONT -> every node
sees every member alive), false-dead count (a node declared dead by a node nothing cut it off from),
requests lost through the LB (a client with one retry), admitted / limit per rate-limit window and per
side of a partition, and the share of follow-up turns that reach the engine holding their prefix.

- ``mesh_partition_2_1``, ``mesh_partition_3_2``: partition, then heal.
- ``mesh_one_way_partition``: indirect probes keep both ends alive.
- ``mesh_flapping_partition``: cuts shorter and longer than the suspicion timeout, alternating with heals.
- ``mesh_detection_convergence``: SIGKILL and restart, a 10 s SIGSTOP, a graceful leave (SIGTERM), a
  slow node (1 s pauses).
- ``mesh_ratelimit_over_admission``: a tenant's mesh-wide rpm at 2x load, one node partitioned away for
  a whole window (the figure issue #5 asks for).
- ``mesh_cache_affinity_failover``: multi-turn conversations round-robin over the nodes, before and
  after a node is killed, and after it rejoins.

The bounds are derived from the SWIM constants below, read from the node's defaults
(``shepherd.mesh.swim_types.SwimConfig``: the fleets override only the push-pull interval), so they follow
a change of the defaults; what each bound assumes is in its function's docstring.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from chaos import faults
from chaos.fleet import Fleet, Member
from chaos.loadgen import ConversationLoad, ConversationSpec, LoadSpec, RequestRecord, TurnRecord
from chaos.mesh_watch import DOWN_STATES, MeshWatch, View, ViewChange, all_alive
from chaos.report import Figure, ScenarioResult, Table
from chaos.scenarios.base import DEFAULT_SPEC, Traffic, scenario
from shepherd.mesh import faults as node_faults
from shepherd.mesh.swim_types import SwimConfig

# ---- SWIM timing the bounds assume (the node's defaults; README "The mesh"; docs/DESIGN.md §6) ------

SWIM = SwimConfig()  # what a node runs with unless --mesh-probe-interval & co. say otherwise
PROBE_INTERVAL_S = SWIM.probe_interval  # --mesh-probe-interval's default
SUSPICION_MULT = SWIM.suspicion_mult  # --mesh-suspicion-mult's default
PUSH_PULL_S = 5.0  # --mesh-push-pull-interval of the mesh fleets: the heal bound is this + 2 s
GOSSIP_SLACK_S = 2.0  # dissemination to every node + the watch's poll period + event-loop lag on 2 busy cores

# after a heal (README states no figure: a node dead in the others' views may need a push-pull round to come
# back) the bound is the configured push-pull interval + a margin of 2 s (dissemination + poll + loop lag)
CONVERGE_BOUND_S = PUSH_PULL_S + 2.0
BASELINE_S = 2.0
MESH_NODE_ARGS = (*DEFAULT_SPEC.node_args, "--mesh-push-pull-interval", str(PUSH_PULL_S))
MESH3 = replace(DEFAULT_SPEC, mesh=True, node_args=MESH_NODE_ARGS)
MESH5 = replace(MESH3, nodes=5)


def expected_confirmations(n: int) -> int:
    """Lifeguard's k: independent confirmations a suspicion waits for (none when n - 2 < mult - 2)."""
    return SWIM.expected_confirmations(n)


def suspicion_bounds_s(n: int) -> tuple[float, float]:
    """(min, max) suspicion timeout in an n-member mesh: min = mult x probe interval (x log10 n in
    memberlist's variant), max = 6 x mult x max(1, log10 n) x probe interval."""
    return SWIM.suspicion_bounds(n)


def suspicion_timeout_s(n: int, confirmations: int) -> float:
    """When a suspicion confirmed by ``confirmations`` other members ends: max, shrinking toward min with
    each confirmation (log(c + 1) / log(k + 1)); min when no confirmation is expected (k = 0)."""
    lo, hi = suspicion_bounds_s(n)
    k = expected_confirmations(n)
    if k < 1:
        return lo
    c = max(0, min(confirmations, k))
    return max(lo, hi - math.log(c + 1) / math.log(k + 1) * (hi - lo))


def first_probe_s(n: int) -> float:
    """Longest wait until a given member is probed: randomized round-robin over the n - 1 others, re-shuffled
    every round, so at worst first in one round and last in the next."""
    return max(1, 2 * (n - 1) - 1) * PROBE_INTERVAL_S


def suspect_bound_s(n: int) -> float:
    """Fault -> some node suspects the victim: the first probe, a failed probe round (direct probe timeout,
    then indirect probes until the end of the interval), dissemination slack."""
    return first_probe_s(n) + PROBE_INTERVAL_S + GOSSIP_SLACK_S


def detect_bound_s(n: int, confirmations: int = 0) -> float:
    """Fault -> every observer holds the victim dead: suspected, then the suspicion timeout for the
    confirmations its observers can give each other (a side of k nodes: k - 1)."""
    return suspect_bound_s(n) + suspicion_timeout_s(n, confirmations)


SUSPICION_MIN_S = suspicion_bounds_s(3)[0]  # no death comes sooner after its suspicion began
WATCH_SLACK_S = 2 * MeshWatch.interval_s  # a view change is seen up to a poll period (+ the poll) late
DETECT_BOUND_3_S = detect_bound_s(3)  # the SWIM worst case (a figure; the checks use the README's below)

# ---- the bounds the checks use: the figures README "Chaos suite" states, plus a margin written here -----
# Detection at N = 3 (a SIGKILLed, 10 s-paused or 2 | 1-partitioned node dead in every survivor's view):
# README "2.2-3.2 s"; margin 0.8 s = the watch's poll lag (2 x 0.1 s) + 0.6 s of event-loop lag on 2 busy
# cores (the slowest run seen here: 3.15 s).
README_DETECT_N3_S = 3.2
DETECT_MARGIN_S = 0.8
DETECT_CHECK_N3_S = README_DETECT_N3_S + DETECT_MARGIN_S
# Detection in a 3 | 2 partition of 5 (every majority node holds both minority nodes dead; a suspicion
# gets 2 of the k = 3 confirmations it waits for, so its timeout is ~3.3 s, not the 2.0 s minimum): README
# "p50 5.2 s, p99 7.1 s, 7.9 s at worst" (`bench/mesh_sim_bench.py --sizes '' --sweep-pauses '' --partitions
# 5:2 --partition-trials 1000`: when each victim is first probed is random, so one measured run is no bound;
# 4.7 s was one run, and one real run in four took longer than its 5.7 s check); margin 1.0 s = the poll lag +
# event-loop lag as above + 0.2 s for the second victim's probe. Under SWIM's worst case (9.3 s, reported).
README_DETECT_3_2_S = 7.9
DETECT_MARGIN_3_2_S = 1.0
DETECT_CHECK_3_2_S = README_DETECT_3_2_S + DETECT_MARGIN_3_2_S
# A graceful leave seen as left everywhere: README "0.06-0.17 s"; margin 0.8 s (poll lag + loop lag + the
# SIGTERM's delivery to a node busy with requests).
README_LEAVE_S = 0.17
LEAVE_MARGIN_S = 0.8
LEAVE_CHECK_S = README_LEAVE_S + LEAVE_MARGIN_S
# Everyone alive again after a restart (ready) or a SIGCONT: README "within 0.2 s of its restart being
# ready"; margin 0.8 s (as for the leave: the first gossip round from a process that just woke up).
README_BACK_S = 0.2
BACK_MARGIN_S = 0.8
BACK_CHECK_S = README_BACK_S + BACK_MARGIN_S


def detect_check_s(n: int, minority: int) -> float:
    """The README-derived detection bound the partition scenarios check (2 | 1 at N = 3, 3 | 2 at N = 5)."""
    return DETECT_CHECK_N3_S if (n, minority) == (3, 1) else DETECT_CHECK_3_2_S


def _names(ms: Sequence[Member]) -> list[str]:
    return [m.name for m in ms]


def _baseline(fleet: Fleet, watch: MeshWatch, result: ScenarioResult, key: str = "baseline") -> list[str]:
    """Wait until every node sees every node alive (the previous scenario may have left the mesh healing)."""
    names = _names(fleet.active_nodes())
    took = watch.wait(all_alive(names), timeout=40.0)
    result.figures[f"{key}_converged_s"] = took
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


def _all_see(observers: Collection[str], member: str, states: Collection[str]) -> Callable[[View], bool]:
    def pred(view: View) -> bool:
        return all(view.get(o, {}).get(member) in states for o in observers)

    return pred


def _within(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def _lost(result: ScenarioResult) -> None:
    t = result.traffic
    assert t is not None
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")


# ---- partitions -----------------------------------------------------------------------------------------


# how long a partition is held at most for both sides to declare the other dead: the minority side has no
# detection bound (a node whose probes all fail backs off: Lifeguard's local health multiplier scales its
# probe interval up to (lhm_max + 1)x), so only the majority's detection is checked against detect_bound_s
SPLIT_TIMEOUT_S = 30.0


def _partition_heal(fleet: Fleet, result: ScenarioResult, minority: int) -> None:
    nodes = fleet.active_nodes()
    side_b, side_a = nodes[:minority], nodes[minority:]  # side a is the majority
    a_names, b_names = _names(side_a), _names(side_b)
    n = len(nodes)
    swim_bound_a = detect_bound_s(n, len(side_a) - 1)  # the SWIM worst case, a figure
    bound_a = detect_check_s(n, minority)
    cut = {(x, y) for x in a_names for y in b_names} | {(y, x) for x in a_names for y in b_names}
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        fault = faults.partition(fleet.firewall, [n.host for n in side_a], [n.host for n in side_b])
        cut_at = tr.mark(fault.description)
        try:

            def split(view: dict[str, dict[str, str]]) -> bool:
                return all(view.get(o, {}).get(m) == "dead" for o, m in cut)

            split_s = watch.wait(split, timeout=SPLIT_TIMEOUT_S)
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
        detection_bound_majority_s=round(bound_a, 2),
        detection_swim_worst_case_s=round(swim_bound_a, 2),
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
        f"the majority marks the minority dead within {bound_a:.1f} s",
        _within(dead_s, bound_a),
        f"suspect after {detect_s} s, dead (every majority node) after {dead_s} s",
    )
    result.check(
        f"each side converges on its own view (the other side dead) within {SPLIT_TIMEOUT_S} s",
        split_s is not None,
        f"after {split_s} s (the minority, backing off, after {minority_dead_s} s)",
    )
    result.check(
        f"after the heal every node sees all {len(names)} members alive within push-pull + 2 s",
        _within(converged_s, CONVERGE_BOUND_S),
        f"{converged_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    result.check("no node on the same side is declared dead", not false_dead, f"false dead: {false_dead}")
    _lost(result)


@scenario(
    "mesh_partition_2_1",
    "3-node mesh partitioned 2 | 1, then healed",
    spec=MESH3,
    short=True,  # the test suite's subset runs one scenario with the mesh on
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


ONE_WAY_HOLD_S = 15.0  # longer than the slowest suspicion timeout at N = 3 (and than the detection bound)


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
    _lost(result)


# ---- flapping partition ---------------------------------------------------------------------------------

FLAP_S = 30.0
FLAP_SEED = (
    25  # its schedule: 3 cuts under the suspicion timeout, 3 longer than FLAP_LONG_CUT_S (unit-tested)
)
FLAP_CUT_S = (0.5, 5.0)  # each cut: from well below the suspicion timeout to well above it
FLAP_HEAL_S = (0.5, 2.0)
# a cut this long gets the lone node declared dead even if it is probed last: first probe, failed probe, min
# suspicion timeout
FLAP_LONG_CUT_S = first_probe_s(3) + PROBE_INTERVAL_S + SUSPICION_MIN_S


def flap_schedule(
    seed: int,
    total_s: float,
    cut_s: tuple[float, float] = FLAP_CUT_S,
    heal_s: tuple[float, float] = FLAP_HEAL_S,
) -> list[tuple[float, float]]:
    """(cut, heal) durations, alternating, drawn from ``seed`` until ``total_s`` is used up (at least one
    pair; the last heal is where the flapping ends)."""
    rng = random.Random(seed)
    out: list[tuple[float, float]] = []
    used = 0.0
    while not out or used < total_s:
        pair = (round(rng.uniform(*cut_s), 2), round(rng.uniform(*heal_s), 2))
        out.append(pair)
        used += sum(pair)
    return out


def _state_before(changes: Sequence[ViewChange], observer: str, member: str, t: float) -> str | None:
    """``observer``'s view of ``member`` just before ``t`` (``changes`` sorted by time)."""
    state = None
    for c in changes:
        if c.at >= t:
            break
        if c.observer == observer and c.member == member:
            state = c.state
    return state


def suspicion_to_death_s(changes: Sequence[ViewChange]) -> list[tuple[ViewChange, float | None]]:
    """Each death declaration with the time since its member was first suspected (by any node) after the
    declaring node last saw it alive; None when nobody was seen suspecting it. SWIM runs a suspicion timer
    of at least the minimum timeout before anyone may declare a death."""
    cs = sorted(changes, key=lambda c: c.at)
    out: list[tuple[ViewChange, float | None]] = []
    for d in cs:
        if d.state != "dead":
            continue
        alive = [c.at for c in cs if (c.observer, c.member) == (d.observer, d.member) and c.state == "alive"]
        since = max((a for a in alive if a < d.at), default=-math.inf)
        sus = [c.at for c in cs if c.member == d.member and c.state == "suspect" and since < c.at <= d.at]
        out.append((d, round(d.at - min(sus), 3) if sus else None))
    return out


def deaths_after_short_cuts(
    changes: Sequence[ViewChange], cuts: Sequence[tuple[float, float]], min_s: float
) -> list[ViewChange]:
    """Deaths declared after a cut (start, duration) shorter than ``min_s`` that began while the declaring
    node still saw the member alive (a suspicion carried over from an earlier, longer cut is not its)."""
    cs = sorted(changes, key=lambda c: c.at)
    bad = []
    for d in cs:
        before = [c for c in cuts if c[0] <= d.at]
        if d.state != "dead" or not before:
            continue
        start, duration = max(before)
        if duration < min_s and _state_before(cs, d.observer, d.member, start) == "alive":
            bad.append(d)
    return bad


def count_rejoins(changes: Sequence[ViewChange]) -> int:
    """How often a view took a member back: dead -> alive for the same (observer, member)."""
    dead: set[tuple[str, str]] = set()  # pairs dead since their last alive
    n = 0
    for c in sorted(changes, key=lambda c: c.at):
        key = (c.observer, c.member)
        if c.state == "dead":
            dead.add(key)
        elif c.state == "alive" and key in dead:
            dead.discard(key)
            n += 1
    return n


@scenario(
    "mesh_flapping_partition",
    "a partition (1 | 2) that flaps for 30 s: cuts of 0.5-5 s, heals of 0.5-2 s",
    spec=MESH3,
    must_hold="the long cuts get the lone node declared dead (and it rejoins), the cuts shorter than the "
    "suspicion timeout never do; every death follows a suspicion of at least the minimum timeout, no member "
    "is declared dead twice within it; no false dead; one view again within push-pull + 2 s after the "
    "flapping stops; no request lost",
)
def mesh_flapping_partition(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    lone, rest = nodes[0], nodes[1:]
    schedule = flap_schedule(FLAP_SEED, FLAP_S)
    cuts: list[tuple[float, float]] = []  # (start, duration)
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        start = tr.mark(f"flapping {lone.name} | {', '.join(_names(rest))} begins")
        fault: faults.Fault | None = None
        healed_at = start
        try:
            for cut_s, heal_s in schedule:
                fault = faults.partition(fleet.firewall, [lone.host], [n.host for n in rest])
                cuts.append((tr.mark(f"cut for {cut_s} s"), cut_s))
                time.sleep(cut_s)
                fault.heal()
                fault = None
                healed_at = tr.mark(f"healed for {heal_s} s")
                time.sleep(heal_s)
        finally:
            if fault is not None:
                fault.heal()
        stop_at = tr.mark("flapping ends, healed")
        watch.wait(all_alive(names), timeout=30.0)
        end = time.monotonic()
        converged_s = watch.when(all_alive(names), healed_at, end)  # from the last cut's end
        tr.sleep(1.0)
    _timeline(result, tr, watch, start)
    t = result.traffic
    assert t is not None
    history = watch.history(start, end)
    deaths: dict[tuple[str, str], list[float]] = {}
    for c in history:
        if c.state == "dead":
            deaths.setdefault((c.observer, c.member), []).append(c.at)
    gaps = [b - a for ts in deaths.values() for a, b in itertools.pairwise(ts)]
    min_gap = round(min(gaps), 2) if gaps else None
    cut = {(lone.name, n.name) for n in rest} | {(n.name, lone.name) for n in rest}
    death_list = sorted((at, o, m) for (o, m), ts in deaths.items() for at in ts)
    full = watch.history(0.0, end)  # with the views before the flapping: what each node saw at a cut's start
    timers = [(d, g) for d, g in suspicion_to_death_s(full) if d.at >= start]
    too_soon = [(d, g) for d, g in timers if g is None or g < SUSPICION_MIN_S - WATCH_SLACK_S]
    after_short = [d for d in deaths_after_short_cuts(full, cuts, SUSPICION_MIN_S) if d.at >= start]
    gaps_s = [g for _, g in timers if g is not None]
    lone_dead = [d for d in death_list if d[2] == lone.name]
    rejoins = count_rejoins(history)
    long_cuts = sum(1 for c, _ in schedule if c >= FLAP_LONG_CUT_S)
    result.figures.update(
        partition_cuts=len(schedule),
        cuts_shorter_than_suspicion=sum(1 for c, _ in schedule if c < SUSPICION_MIN_S),
        cuts_long_enough_to_kill=long_cuts,
        longest_cut_s=max(c for c, _ in schedule),
        flapping_s=round(stop_at - start, 2),
        dead_declarations=len(death_list),
        lone_node_declared_dead=len(lone_dead),
        rejoins_dead_to_alive=rejoins,
        suspicions=sum(1 for c in history if c.state == "suspect"),
        false_dead=len(_false_dead(watch, start, end, cut)),
        min_gap_between_deaths_s=min_gap,
        min_suspicion_to_death_s=min(gaps_s) if gaps_s else None,
        deaths_after_short_cuts=len(after_short),
        convergence_after_last_cut_s=converged_s,
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check(
        "the long cuts get the lone node declared dead (the checks below are not vacuous)",
        bool(lone_dead),
        f"{len(lone_dead)} declarations of {lone.name} dead; {long_cuts} cuts >= {FLAP_LONG_CUT_S} s",
    )
    result.check(
        f"cuts shorter than the suspicion timeout ({SUSPICION_MIN_S} s) get nobody declared dead",
        not after_short,
        f"{[(round(d.at - start, 2), d.observer, d.member) for d in after_short]}",
    )
    result.check(
        f"every death follows a suspicion of at least the minimum timeout ({SUSPICION_MIN_S} s, less the "
        f"watch's {WATCH_SLACK_S} s of poll lag)",
        not too_soon,
        f"shortest {min(gaps_s) if gaps_s else None} s; too soon: "
        f"{[(round(d.at - start, 2), d.observer, d.member, g) for d, g in too_soon]}",
    )
    result.check(
        f"no view declares a member dead twice within the suspicion timeout ({SUSPICION_MIN_S} s)",
        min_gap is None or min_gap >= SUSPICION_MIN_S,
        f"shortest gap {min_gap} s",
    )
    result.check(
        "no node on the same side is declared dead",
        not _false_dead(watch, start, end, cut),
        f"false dead: {_false_dead(watch, start, end, cut)}",
    )
    result.check(
        "one view again within push-pull + 2 s after the last cut",
        _within(converged_s, CONVERGE_BOUND_S),
        f"{converged_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    _lost(result)


# ---- detection and convergence: a crash, a long pause, a graceful leave, a slow node ---------------------

PAUSE_LONG_S = 10.0
SLOW_PAUSE_S = 1.0  # below the suspicion timeout (unit-tested): Lifeguard must not declare it dead
SLOW_PAUSES = 3
SLOW_GAP_S = 3.0


@dataclass(frozen=True, slots=True)
class Phase:
    """One fault of ``mesh_detection_convergence`` as the views saw it (seconds; None: never happened)."""

    name: str
    victim: str
    fault_at: float
    end: float
    suspect_s: float | None = None  # fault -> a survivor suspects the victim (or holds it dead)
    down_s: float | None = None  # fault -> every survivor holds it dead (left, for a leave)
    recover_s: float | None = None  # fault -> the victim is back: restarted and ready, or SIGCONT
    converged_s: float | None = None  # back -> every node answers and sees every member alive
    restart_s: float | None = None  # a restart: the process started -> ready (the node's own boot)
    start_to_converged_s: float | None = None  # a restart: the process started -> every view all alive


def _survivors(names: Sequence[str], victim: Member) -> list[str]:
    return [n for n in names if n != victim.name]


def _converge(fleet: Fleet, watch: MeshWatch, names: Sequence[str]) -> float | None:
    """Seconds until every view is all alive again (None: not within 30 s), marked on the timeline."""
    converged = watch.wait(all_alive(names), timeout=30.0)
    fleet.mark("mesh converged" if converged is not None else "mesh did not converge")
    return converged


def _restart_phase(
    kind: str, fleet: Fleet, watch: MeshWatch, v: Member, names: Sequence[str], at: float, down: set[str]
) -> Phase:
    """After a fault at ``at`` that took ``v`` down (the survivors hold it in a state of ``down``): start
    it again (waits until it is ready) and time the mesh's convergence."""
    others = _survivors(names, v)
    down_s = watch.all_saw(at, others, v.name, down)
    begin = time.monotonic()
    fleet.start_node(v)  # waits until it is ready
    back = time.monotonic()
    converged = _converge(fleet, watch, names)
    return Phase(
        kind,
        v.name,
        at,
        time.monotonic(),
        suspect_s=watch.first(at, others, v.name, DOWN_STATES),
        down_s=down_s,
        recover_s=round(back - at, 3),
        converged_s=converged,
        restart_s=round(back - begin, 3),
        start_to_converged_s=watch.when(all_alive(names), begin),
    )


def _crash_phase(fleet: Fleet, watch: MeshWatch, v: Member, names: Sequence[str]) -> Phase:
    at = fleet.crash_node(v)
    watch.wait(_all_see(_survivors(names, v), v.name, {"dead"}), timeout=DETECT_BOUND_3_S + 10.0)
    return _restart_phase("crash", fleet, watch, v, names, at, {"dead"})


def _pause_phase(fleet: Fleet, watch: MeshWatch, v: Member, names: Sequence[str]) -> Phase:
    others = _survivors(names, v)
    at = fleet.pause(v)
    try:
        watch.wait(_all_see(others, v.name, {"dead"}), timeout=PAUSE_LONG_S)
        time.sleep(max(0.0, at + PAUSE_LONG_S - time.monotonic()))
    finally:
        fleet.resume(v)
    back = time.monotonic()
    converged = _converge(fleet, watch, names)
    return Phase(
        "pause",
        v.name,
        at,
        time.monotonic(),
        suspect_s=watch.first(at, others, v.name, DOWN_STATES),
        down_s=watch.all_saw(at, others, v.name, {"dead"}),
        recover_s=round(back - at, 3),
        converged_s=converged,
    )


def _leave_phase(fleet: Fleet, watch: MeshWatch, v: Member, names: Sequence[str]) -> Phase:
    at = time.monotonic()
    fleet.terminate_node(v)  # SIGTERM: it leaves the mesh at once, drains, exits
    watch.wait(_all_see(_survivors(names, v), v.name, {"left"}), timeout=LEAVE_CHECK_S + 5.0)
    return _restart_phase("leave", fleet, watch, v, names, at, {"left"})


def _slow_phase(fleet: Fleet, watch: MeshWatch, v: Member, names: Sequence[str]) -> Phase:
    at = time.monotonic()
    resumed = []
    for _ in range(SLOW_PAUSES):
        watch.wait(all_alive(names), timeout=15.0)
        fleet.pause(v)
        try:
            time.sleep(SLOW_PAUSE_S)
        finally:
            fleet.resume(v)
        resumed.append(time.monotonic())
        time.sleep(SLOW_GAP_S)
    watch.wait(all_alive(names), timeout=30.0)
    after_each = [watch.when(all_alive(names), r) for r in resumed]  # the slowest refutation
    converged = None if None in after_each else max(x for x in after_each if x is not None)
    return Phase(
        "slow",
        v.name,
        at,
        time.monotonic(),
        suspect_s=watch.first(at, _survivors(names, v), v.name, DOWN_STATES),
        down_s=watch.all_saw(at, _survivors(names, v), v.name, {"dead"}),
        converged_s=converged,
    )


@scenario(
    "mesh_detection_convergence",
    "detection and convergence after a SIGKILL + restart, a 10 s pause, a graceful leave; a slow node",
    spec=MESH3,
    must_hold="every survivor holds a crashed or 10 s-paused node dead within the bound derived from the "
    "SWIM parameters; after the restart / SIGCONT every view is all alive within push-pull + 2 s; a leave "
    "is seen as left everywhere within the gossip bound and never as dead; 1 s pauses (below the suspicion "
    "timeout) get nobody declared dead; no false dead; a client with one retry loses nothing",
)
def mesh_detection_convergence(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    n = len(nodes)
    bound = DETECT_CHECK_N3_S if n == 3 else detect_bound_s(n)
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        tr.sleep(BASELINE_S)
        start = time.monotonic()
        crash = _crash_phase(fleet, watch, nodes[-1], names)
        pause = _pause_phase(fleet, watch, nodes[1], names)
        leave = _leave_phase(fleet, watch, nodes[-1], names)
        slow = _slow_phase(fleet, watch, nodes[1], names)
        end = time.monotonic()
        tr.sleep(1.0)
    _timeline(result, tr, watch, start)
    t = result.traffic
    assert t is not None
    phases = (crash, pause, leave, slow)
    allowed = {
        (c.observer, p.victim)
        for p in (crash, pause)
        for c in watch.history(p.fault_at, p.end)
        if c.state == "dead" and c.member == p.victim
    }
    deaths = watch.marked_dead(start, end)
    false_dead = sorted(f"{o}:{m}" for o, m in deaths - allowed if o != m)
    leave_dead = sorted(o for o, m in watch.marked_dead(leave.fault_at, leave.end) if m == leave.victim)
    slow_dead = sorted(f"{o}:{m}" for o, m in watch.marked_dead(slow.fault_at, slow.end))
    slow_suspicions = sum(1 for c in watch.history(slow.fault_at, slow.end) if c.state == "suspect")
    result.figures.update(
        swim=f"probe {PROBE_INTERVAL_S} s, suspicion mult {SUSPICION_MULT} (min "
        f"{suspicion_bounds_s(n)[0]:.1f} s, k = {expected_confirmations(n)}), push-pull {PUSH_PULL_S} s",
        suspect_bound_s=round(suspect_bound_s(n), 2),
        detection_bound_s=round(bound, 2),
        detection_swim_worst_case_s=round(detect_bound_s(n), 2),
        back_bound_s=BACK_CHECK_S,
        leave_bound_s=LEAVE_CHECK_S,
    )
    for p in phases:
        result.figures.update(
            {
                f"{p.name}_victim": p.victim,
                f"{p.name}_suspect_s": p.suspect_s,
                f"{p.name}_{'left' if p.name == 'leave' else 'dead'}_everywhere_s": p.down_s,
            }
        )
        if p.restart_s is not None:
            result.figures[f"{p.name}_restart_until_ready_s"] = p.restart_s
            result.figures[f"{p.name}_restart_until_all_alive_s"] = p.start_to_converged_s
        elif p.recover_s is not None:
            result.figures[f"{p.name}_back_after_s"] = p.recover_s
        result.figures[f"{p.name}_converged_after_back_s"] = p.converged_s
    result.figures.update(
        leave_declared_dead=len(leave_dead),
        slow_pauses=f"{SLOW_PAUSES} x {SLOW_PAUSE_S} s",
        slow_suspicions=slow_suspicions,
        slow_dead=len(slow_dead),
        false_dead=len(false_dead),
        view_changes=len(watch.history(start, end)),
        first_attempt_failures=sum(t.first_errors.values()),
    )
    for p in (crash, pause):
        result.check(
            f"{p.name}: every survivor holds {p.victim} dead within {bound:.1f} s",
            _within(p.down_s, bound),
            f"suspect after {p.suspect_s} s, dead everywhere after {p.down_s} s",
        )
    for p, back in (
        (crash, "the restarted node is ready"),
        (pause, "SIGCONT"),
        (leave, "it is back"),
        (slow, "each SIGCONT"),
    ):
        result.check(
            f"{p.name}: every view all alive within {BACK_CHECK_S:.1f} s after {back}",
            _within(p.converged_s, BACK_CHECK_S),
            f"{p.converged_s} s (bound {BACK_CHECK_S:.1f} s)",
        )
    result.check(
        f"leave: every survivor sees {leave.victim} left within {LEAVE_CHECK_S:.2f} s, nobody holds it dead",
        _within(leave.down_s, LEAVE_CHECK_S) and not leave_dead,
        f"left everywhere after {leave.down_s} s; dead in the views of {leave_dead}",
    )
    result.check(
        f"slow node ({SLOW_PAUSES} pauses of {SLOW_PAUSE_S} s): nobody is declared dead (Lifeguard)",
        not slow_dead,
        f"{slow_suspicions} suspicions, dead: {slow_dead}",
    )
    result.check("no false dead (only the crashed and the paused node)", not false_dead, f"{false_dead}")
    _lost(result)


# ---- the mesh-wide rate limit under a partition ---------------------------------------------------------

RL_RPM = 600  # the tenant's mesh-wide limit (--rate-limit-rpm: every tenant; the load is tenant "default")
RL_WINDOW_S = 60.0  # --rate-limit-window-secs: a cut of one whole window outlasts SWIM's reap (~30 s)
RL_LOAD = 2.0  # offered load / limit, spread evenly over the nodes
RL_OVER_BAR = 0.10  # issue #5: over-admission <= 10% while one node is partitioned away
# bounded below too (a limiter that refuses everything must fail): README "Chaos suite" states 0.987 of the
# limit in a steady window, 0.995 (lone node) and 0.985 (pair) of their shares partitioned: the worst, 0.985,
# less a margin of 0.085 (the open-loop arrivals' jitter at the window edges and 2 busy cores) -> >= 0.90
README_RL_WORST_RATIO = 0.985
RL_UNDER_MARGIN = 0.085
RL_MIN_RATIO = README_RL_WORST_RATIO - RL_UNDER_MARGIN
RL_WARMUP_S = 10.0  # at least this much load before the first measured window
RL_CUT_EARLY_S = 0.5  # the cut comes this long before a window begins, so the partition covers all of it
RL_HEAL_LATE_S = 1.0  # and the heal this long after it ended
RL_AFTER_HEAL_S = 20.0
RL_SAMPLE_S = 5.0  # the nodes' limiter views (reachable / known members) sampled this often
MESH3_RL = replace(
    MESH3,
    node_args=(
        *MESH_NODE_ARGS,
        *("--rate-limit-rpm", str(RL_RPM), "--rate-limit-window-secs", str(RL_WINDOW_S)),
    ),
)


@dataclass(frozen=True, slots=True)
class Admission:
    at: float  # wall-clock seconds: the limiter's windows are floor(time.time() / window)
    node: str
    admitted: bool  # a 200; False: a 429


def to_admissions(
    records: Sequence[RequestRecord], wall_offset: float, node_of: Mapping[str, str]
) -> list[Admission]:
    """The 200 and 429 answers (other outcomes left out) as admissions at wall-clock time ``start +
    wall_offset`` by the node their URL names."""
    return [
        Admission(r.start + wall_offset, node_of.get(r.target, r.target), r.status == 200)
        for r in records
        if r.status in (200, 429)
    ]


@dataclass(frozen=True, slots=True)
class SideWindow:
    """What one side of the fleet admitted in [start, end) against its allowance (limit x its nodes / N)."""

    label: str
    side: str
    nodes: tuple[str, ...]
    start: float
    end: float
    offered: int  # 200s and 429s
    admitted: int
    allowance: float

    @property
    def ratio(self) -> float:
        return self.admitted / self.allowance if self.allowance > 0 else 0.0

    @property
    def over(self) -> float:
        return max(0.0, self.ratio - 1.0)

    @property
    def under(self) -> float:
        """The allowance left unused although more was asked (0 when the demand was below it)."""
        if self.offered <= self.allowance:
            return 0.0
        return max(0.0, 1.0 - self.ratio)


def side_windows(
    adm: Sequence[Admission],
    label: str,
    start: float,
    end: float,
    sides: Mapping[str, Collection[str]],
    limit: float,
    n_nodes: int,
    window_s: float,
) -> list[SideWindow]:
    """Per side, admitted in [start, end) against ``limit x len(side) / n_nodes``, scaled by the span's
    share of a window (a whole window: the plain allowance)."""
    scale = (end - start) / window_s
    out = []
    for side, members in sides.items():
        inside = [a for a in adm if start <= a.at < end and a.node in members]
        out.append(
            SideWindow(
                label,
                side,
                tuple(sorted(members)),
                start,
                end,
                len(inside),
                sum(1 for a in inside if a.admitted),
                limit * len(members) / n_nodes * scale,
            )
        )
    return out


def max_sliding_ratio(
    adm: Sequence[Admission], ends: Sequence[float], limit: float, window_s: float
) -> float | None:
    """The largest admitted-in-(t - window, t] / limit over the window ends ``ends``."""
    times = sorted(a.at for a in adm if a.admitted)
    if not ends or limit <= 0:
        return None
    return max(sum(1 for x in times if t - window_s < x <= t) / limit for t in ends)


def _limiter_views(fleet: Fleet, nodes: Sequence[Member]) -> dict[str, str]:
    """Each node's rate limiter's membership: "reachable/known" (``GET /mesh/state``), "?" if no answer."""
    out = {}
    for n in nodes:
        status, body = fleet.call("GET", fleet.node_url(n) + "/mesh/state", timeout=2.0)
        rl = body.get("rate_limits") if status == 200 and isinstance(body, dict) else None
        out[n.name] = f"{rl.get('reachable')}/{rl.get('known')}" if isinstance(rl, dict) else "?"
    return out


def _sleep_until_wall(
    t: float, fleet: Fleet, nodes: Sequence[Member], seen: dict[str, str], log: list[tuple[float, str, str]]
) -> None:
    """Sleep until wall-clock ``t``, sampling the limiters' views every RL_SAMPLE_S: each change is marked
    and logged as (monotonic time, node, "reachable/known")."""
    while time.time() < t:
        views = _limiter_views(fleet, nodes)
        for name, v in views.items():
            if seen.get(name) != v:
                log.append((fleet.mark(f"{name} rate limiter counts {v} (reachable/known) members"), name, v))
                seen[name] = v
        time.sleep(max(0.0, min(RL_SAMPLE_S, t - time.time())))


def first_shrunk(log: Sequence[tuple[float, str, str]], n: int, after: float) -> float | None:
    """When a limiter first counted fewer than ``n`` known members (its N shrank: unreachable members
    reaped from the member list) after ``after``; None if none did."""
    for at, _, view in log:
        known = view.rpartition("/")[2]
        if at >= after and known.isdigit() and int(known) < n:
            return at
    return None


@scenario(
    "mesh_ratelimit_over_admission",
    f"a mesh-wide rate limit ({RL_RPM} rpm, 2x load over 3 nodes), one node partitioned away for a window",
    spec=MESH3_RL,
    must_hold="steady state: the mesh admits <= limit x 1.1 per window; partitioned 1 | 2 for a whole "
    "window: the lone node admits <= limit/3 x 1.1 and the pair <= limit x 2/3 x 1.1 (under-admission "
    "reported); after the heal every node's limiter counts all members again within push-pull + 2 s; no "
    "request fails other than by 429",
)
def mesh_ratelimit_over_admission(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    lone, pair = nodes[-1], nodes[:-1]
    n = len(nodes)
    node_of = {fleet.node_url(m): m.name for m in nodes}
    sides: dict[str, Collection[str]] = {
        "minority": [lone.name],
        "majority": _names(pair),
        "all": _names(nodes),
    }
    load = LoadSpec(
        url=fleet.lb_url,
        model=fleet.spec.model_name,
        rate=RL_RPM / RL_WINDOW_S * RL_LOAD,
        stream_fraction=0.0,
        max_tokens=8,
        retries=0,
        targets=tuple(node_of),
    )
    wall_offset = time.time() - time.monotonic()
    seen: dict[str, str] = {}
    log: list[tuple[float, str, str]] = []
    with Traffic(fleet, result, load) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        w1 = math.ceil((time.time() + RL_WARMUP_S) / RL_WINDOW_S) * RL_WINDOW_S  # the steady window
        w2 = w1 + RL_WINDOW_S  # the partitioned window
        tr.mark(f"load at {load.rate:.0f}/s straight to the nodes; steady window in {w1 - time.time():.1f} s")
        _sleep_until_wall(w2 - RL_CUT_EARLY_S, fleet, nodes, seen, log)
        fault = faults.partition(fleet.firewall, [lone.host], [m.host for m in pair])
        cut_at = tr.mark(fault.description)
        try:
            _sleep_until_wall(w2 + RL_WINDOW_S + RL_HEAL_LATE_S, fleet, nodes, seen, log)
        finally:
            fault.heal()
        heal_at = tr.mark("healed")
        heal_wall = heal_at + wall_offset

        def limiters_whole() -> bool:
            return all(v == f"{n}/{n}" for v in _limiter_views(fleet, nodes).values())

        converged_s = watch.wait(all_alive(names), timeout=30.0)
        t0 = time.monotonic()
        limiter_s = None
        while time.monotonic() - t0 < 30.0:
            if limiters_whole():
                limiter_s = round(time.monotonic() - heal_at, 3)
                break
            time.sleep(0.25)
        tr.mark("every limiter counts every member" if limiter_s is not None else "limiters still split")
        _sleep_until_wall(heal_wall + RL_AFTER_HEAL_S, fleet, nodes, seen, log)
    _timeline(result, tr, watch, cut_at)
    t = result.traffic
    assert t is not None
    adm = to_admissions(tr.records, wall_offset, node_of)
    limit = float(RL_RPM)
    steady = side_windows(adm, "steady", w1, w2, sides, limit, n, RL_WINDOW_S)
    cut = side_windows(adm, "partitioned", w2, w2 + RL_WINDOW_S, sides, limit, n, RL_WINDOW_S)
    whole = side_windows(
        adm, "whole partition", cut_at + wall_offset, heal_wall, sides, limit, n, RL_WINDOW_S
    )
    after = side_windows(
        adm, "after heal", heal_wall, heal_wall + RL_AFTER_HEAL_S, sides, limit, n, RL_WINDOW_S
    )
    shrunk = first_shrunk(log, n, cut_at)  # a side's N shrank: from then on it may admit more than its share
    early = (
        side_windows(
            adm,
            "partition until N shrank",
            cut_at + wall_offset,
            shrunk + wall_offset,
            sides,
            limit,
            n,
            RL_WINDOW_S,
        )
        if shrunk is not None
        else []
    )
    ends = [heal_wall + CONVERGE_BOUND_S + i for i in range(int(RL_AFTER_HEAL_S - CONVERGE_BOUND_S) + 1)]
    sliding_after = max_sliding_ratio(adm, ends, limit, RL_WINDOW_S)
    rows: list[tuple[Figure, ...]] = [
        (
            sw.label,
            f"{round(sw.start - wall_offset - tr.t0, 1)}-{round(sw.end - wall_offset - tr.t0, 1)}",
            f"{sw.side} ({', '.join(sw.nodes)})",
            sw.offered,
            sw.admitted,
            round(sw.allowance, 1),
            round(sw.ratio, 3),
            f"{sw.over * 100:.1f}%",
            f"{sw.under * 100:.1f}%",
        )
        for sw in (*steady, *cut, *whole, *early, *after)
    ]
    table = Table(
        f"Admitted / allowance (limit {RL_RPM} per {RL_WINDOW_S:.0f} s window; a side's allowance: limit x "
        f"its nodes / {n}, scaled to the span; in steady state only the mesh-wide row is a limit)",
        ("span", "s since load start", "side", "offered", "admitted", "allowance", "ratio", "over", "under"),
        tuple(rows),
    )
    result.tables.append(table)
    print("\n".join(f"chaos:   {' | '.join(str(c) for c in row)}" for row in rows), flush=True)
    by = {(sw.label, sw.side): sw for sw in (*steady, *cut, *whole, *early, *after)}
    other_errors = {k: v for k, v in t.errors.items() if k != "http_429"}
    result.figures.update(
        limit_per_window=RL_RPM,
        window_s=RL_WINDOW_S,
        offered_per_window=round(load.rate * RL_WINDOW_S),
        steady_admitted_over_limit=round(by["steady", "all"].ratio, 3),
        partitioned_minority_over_share=round(by["partitioned", "minority"].ratio, 3),
        partitioned_majority_over_share=round(by["partitioned", "majority"].ratio, 3),
        partitioned_total_over_limit=round(by["partitioned", "all"].ratio, 3),
        partitioned_over_admission_pct=round(
            100 * max(by["partitioned", s].over for s in ("minority", "majority", "all")), 1
        ),
        partitioned_under_admission_pct=round(
            100 * max(by["partitioned", s].under for s in ("minority", "majority")), 1
        ),
        whole_partition_minority_over_share=round(by["whole partition", "minority"].ratio, 3),
        whole_partition_majority_over_share=round(by["whole partition", "majority"].ratio, 3),
        partitioned_s=round(heal_at - cut_at, 1),
        limiter_n_shrank_after_cut_s=None if shrunk is None else round(shrunk - cut_at, 1),
        until_n_shrank_minority_over_share=round(by["partition until N shrank", "minority"].ratio, 3)
        if early
        else None,
        until_n_shrank_majority_over_share=round(by["partition until N shrank", "majority"].ratio, 3)
        if early
        else None,
        after_heal_max_sliding_over_limit=None if sliding_after is None else round(sliding_after, 3),
        mesh_converged_after_heal_s=converged_s,
        limiters_whole_after_heal_s=limiter_s,
        refused_429=t.errors.get("http_429", 0),
        other_failures=sum(other_errors.values()),
    )
    st = by["steady", "all"]
    result.check(
        f"steady state: the mesh admits between limit x {RL_MIN_RATIO:.3f} and limit x {1 + RL_OVER_BAR} "
        "per window",
        RL_MIN_RATIO <= st.ratio <= 1 + RL_OVER_BAR,
        f"{st.admitted} / {RL_RPM} = {st.ratio:.3f} (under-admission {st.under * 100:.1f}%)",
    )
    for side in ("minority", "majority"):
        sw = by["partitioned", side]
        result.check(
            f"partitioned: the {side} ({', '.join(sw.nodes)}) admits between its share "
            f"{sw.allowance:.0f} x {RL_MIN_RATIO:.3f} and x {1 + RL_OVER_BAR} in the window",
            RL_MIN_RATIO <= sw.ratio <= 1 + RL_OVER_BAR,
            f"{sw.admitted} / {sw.allowance:.0f} = {sw.ratio:.3f} (under-admission {sw.under * 100:.1f}%)",
        )
    # 429s accounted: the load is 2x the limit, so in the steady window the refusals are what was offered
    # beyond the admissions (every answer is a 200 or a 429, checked below), and the share refused is about
    # 1 - 1/RL_LOAD; a limiter refusing nothing or everything is outside [RL_MIN_RATIO, 1 + RL_OVER_BAR]
    refused = st.offered - st.admitted
    want_refused = st.offered - RL_RPM
    result.check(
        "steady state: the 429s are the requests offered over the limit (within the admission bounds)",
        refused > 0 and abs(refused - want_refused) <= RL_RPM * max(RL_OVER_BAR, 1 - RL_MIN_RATIO),
        f"offered {st.offered}, admitted {st.admitted}, refused {refused} (offered - limit = {want_refused})",
    )
    result.check(
        "after the heal every node's limiter counts all members (and every view is all alive) within "
        "push-pull + 2 s",
        _within(limiter_s, CONVERGE_BOUND_S) and _within(converged_s, CONVERGE_BOUND_S),
        f"limiters after {limiter_s} s, views after {converged_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    result.check("no request fails other than by 429", not other_errors, f"{other_errors}")


# ---- cache affinity across a node failover ----------------------------------------------------------------

AFF_PHASE_S = 15.0
AFF_BAR = 0.9
AFF_LB_RATE = 10.0  # single-turn traffic through the LB beside the conversations
AFF_CONVERSATIONS = 12
# the prefix index and the token caches (both bounded) grow with the conversations here: README "Chaos
# suite" states 9.7-11.4 MB of node memory growth in this scenario (6.3-7.9 in earlier sessions' runs; the
# node now encodes more prompts inline and keeps their segments in its own caches, not the pool workers');
# margin 2.1 MB (the index's dicts grow in doubling steps) -> 13.5 MB
README_AFF_RSS_GROWTH_MB = 11.4
AFF_RSS_MARGIN_MB = 2.1
MOCK_BLOCK_TOKENS = 16  # the mock engine's KV block size (smg-mock-engine default)
# cache_aware routes on the prefix index; without the engines' KV events only the mesh (the index gossiped
# between the nodes) can tell a node where a conversation's earlier turns went
MESH3_CA = replace(MESH3, policy="cache_aware", node_args=(*MESH_NODE_ARGS, "--no-kv-events"))


@dataclass(frozen=True, slots=True)
class FollowUp:
    prev: TurnRecord
    turn: TurnRecord
    hit: bool  # it reached the engine holding its prefix


def follow_ups(turns: Sequence[TurnRecord], block: int = MOCK_BLOCK_TOKENS) -> list[FollowUp]:
    """Every turn k >= 1 whose turn k - 1 and itself succeeded. A hit when the engine's cached tokens cover
    the previous turn's prompt (its whole blocks, less one where the two renderings may differ): only the
    engine that served turn k - 1 holds that (the other holds at most turn k - 2's, 3+ blocks shorter)."""
    by_conv: dict[int, dict[int, TurnRecord]] = {}
    for t in turns:
        by_conv.setdefault(t.conversation, {})[t.turn] = t
    out = []
    for conv in by_conv.values():
        for k, t in sorted(conv.items()):
            prev = conv.get(k - 1)
            if k == 0 or prev is None or not (prev.ok and t.ok):
                continue
            need = max(0, (prev.prompt_tokens // block - 1) * block)
            out.append(FollowUp(prev, t, t.cached_tokens >= need and need > 0))
    return out


def affinity(fs: Sequence[FollowUp]) -> float | None:
    return round(sum(f.hit for f in fs) / len(fs), 3) if fs else None


def _index_blocks(fleet: Fleet, nodes: Sequence[Member]) -> str:
    """Prefix-index blocks each node holds (``GET /mesh/state``)."""
    parts = []
    for m in nodes:
        status, body = fleet.call("GET", fleet.node_url(m) + "/mesh/state", timeout=2.0)
        index = body.get("index") if status == 200 and isinstance(body, dict) else None
        blocks = sum(v.get("blocks", 0) for v in index.values()) if isinstance(index, dict) else "?"
        parts.append(f"{m.name} {blocks}")
    return ", ".join(parts)


@scenario(
    "mesh_cache_affinity_failover",
    "cache affinity of multi-turn conversations sent round-robin over the nodes, across a node SIGKILL",
    spec=MESH3_CA,
    must_hold=f"follow-up turns reach the engine holding their prefix (share >= {AFF_BAR}) before the kill, "
    "after it (the survivors route the conversations the dead node served: the prefix index is gossiped) "
    "and after the node rejoins; no turn and no request through the LB is lost (one retry)",
)
def mesh_cache_affinity_failover(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    victim, survivors = nodes[-1], nodes[:-1]
    urls = [fleet.node_url(m) for m in nodes]
    conv = ConversationLoad(
        ConversationSpec(targets=tuple(urls), model=fleet.spec.model_name, conversations=AFF_CONVERSATIONS),
        netns=fleet.client_ns,
    )
    served_before = {e.name: int(fleet.engine_stats(e).get("requests_received", 0)) for e in fleet.engines}
    load = LoadSpec(url=fleet.lb_url, model=fleet.spec.model_name, rate=AFF_LB_RATE)
    turns: list[TurnRecord] = []
    rss_bound = README_AFF_RSS_GROWTH_MB + AFF_RSS_MARGIN_MB
    with Traffic(fleet, result, load, rss_bound_mb=rss_bound) as tr, MeshWatch(fleet) as watch:
        names = _baseline(fleet, watch, result)
        conv.start()
        try:
            begin = tr.mark(f"{AFF_CONVERSATIONS} conversations, each turn on the next node")
            tr.sleep(AFF_PHASE_S)
            index_before = _index_blocks(fleet, nodes)
            kill_at = fleet.crash_node(victim)
            conv.set_targets([fleet.node_url(m) for m in survivors])
            tr.sleep(AFF_PHASE_S)
            fleet.start_node(victim)
            rejoin_s = watch.wait(all_alive(names), timeout=30.0)
            index_rejoined = _index_blocks(fleet, nodes)
            rejoin_at = tr.mark(f"{victim.name} back in the mesh: turns over every node again")
            conv.set_targets(urls)
            tr.sleep(AFF_PHASE_S)
            index_after = _index_blocks(fleet, nodes)
        finally:
            turns = conv.stop()
        end = tr.mark("conversations end")
    _timeline(result, tr, watch, begin)
    served = {
        e.name: int(fleet.engine_stats(e).get("requests_received", 0)) - served_before[e.name]
        for e in fleet.engines
    }
    fs = follow_ups(turns)
    victim_url = fleet.node_url(victim)
    phases = {
        "before the kill": [f for f in fs if begin <= f.turn.start < kill_at],
        "after the kill": [f for f in fs if kill_at <= f.turn.start < rejoin_at],
        "after the rejoin": [f for f in fs if rejoin_at <= f.turn.start < end],
    }
    orphans = [
        f for f in phases["after the kill"] if f.prev.target == victim_url
    ]  # the victim routed turn k-1
    rejoined = [f for f in phases["after the rejoin"] if f.turn.target == victim_url]  # it routes turn k
    rows: list[tuple[Figure, ...]] = []
    for label, group in (
        *phases.items(),
        (f"after the kill, turn k-1 routed by {victim.name}", orphans),
        (f"after the rejoin, turn k routed by {victim.name}", rejoined),
    ):
        cached = sum(f.turn.cached_tokens for f in group)
        prev_prompt = sum(f.prev.prompt_tokens for f in group)
        rows.append(
            (
                label,
                len(group),
                sum(f.hit for f in group),
                affinity(group),
                round(cached / prev_prompt, 3) if prev_prompt else None,
            )
        )
    result.tables.append(
        Table(
            "Follow-up turns that reached the engine holding their prefix",
            ("turns", "follow-ups", "hits", "affinity", "cached tokens / previous prompt tokens"),
            tuple(rows),
        )
    )
    print("\n".join(f"chaos:   {' | '.join(str(c) for c in row)}" for row in rows), flush=True)
    failed_turns = [t for t in turns if not t.ok]
    t = result.traffic
    assert t is not None
    aff = {k: affinity(v) for k, v in phases.items()}
    result.figures.update(
        policy=fleet.spec.policy,
        turns=len(turns),
        turns_failed=len(failed_turns),
        turns_retried_ok=sum(1 for x in turns if x.ok and x.attempts > 1),
        affinity_before=aff["before the kill"],
        affinity_after_failover=aff["after the kill"],
        affinity_after_rejoin=aff["after the rejoin"],
        affinity_of_the_victims_conversations=affinity(orphans),
        affinity_routed_by_the_rejoined_node=affinity(rejoined),
        rejoin_converged_s=rejoin_s,
        index_blocks_before_kill=index_before,
        index_blocks_at_rejoin=index_rejoined,
        index_blocks_at_end=index_after,
        engine_requests=", ".join(f"{k} {v}" for k, v in sorted(served.items())),
    )
    for label, key in (("before the kill", "before"), ("after the kill", "after failover")):
        a = aff[label]
        result.check(
            f"affinity {key} >= {AFF_BAR}",
            a is not None and a >= AFF_BAR,
            f"{a} over {len(phases[label])} follow-ups",
        )
    a = aff["after the rejoin"]
    result.check(
        f"affinity after the node rejoined >= {AFF_BAR} (its index came back by the mesh)",
        a is not None and a >= AFF_BAR,
        f"{a} over {len(phases['after the rejoin'])} follow-ups, {affinity(rejoined)} of those it routed",
    )
    result.check(
        "no conversation turn is lost (one retry on the next node)",
        not failed_turns,
        f"failed: {[(x.conversation, x.turn, x.error) for x in failed_turns][:10]}",
    )
    _lost(result)


# ---- which break each scenario catches ---------------------------------------------------------------------

# ``python -m chaos.run --prove-can-fail`` runs each of these scenarios with its fault injected into every
# node (a test-only switch of shepherd.mesh.faults, read at start-up) and passes only when each one FAILS:
# the suite can see the break it guards against. README "Chaos suite" lists the same table.
CATCHES: dict[str, str] = {
    "mesh_partition_2_1": node_faults.DISABLE_MESH,  # no views to converge: the baseline never forms
    "mesh_partition_3_2": node_faults.DISABLE_MESH,
    "mesh_one_way_partition": node_faults.DISABLE_MESH,
    "mesh_flapping_partition": node_faults.DISABLE_REFUTATION,  # a suspected node cannot clear itself
    "mesh_detection_convergence": node_faults.DISABLE_REFUTATION,  # the slow node's 1 s pauses kill it
    "mesh_ratelimit_over_admission": node_faults.DISABLE_RATELIMIT_GOSSIP,  # each node admits alone
    "mesh_cache_affinity_failover": node_faults.DISABLE_INDEX_GOSSIP,  # survivors cannot tell the engine
    "mesh_wire_upgrade": node_faults.STRICT_WIRE,  # (wire_upgrade.py) 0.1 refuses 0.2's packets as before
    "mesh_large": node_faults.IGNORE_PARTITION_RULE,  # (mesh_large.py) each side admits the whole limit
}
