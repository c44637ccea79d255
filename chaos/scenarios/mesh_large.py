"""The large mesh: as many light nodes as this 2-core machine holds, under loss and a partition, with two
mesh-wide rate limits (requests per window and concurrent requests) measured on both sides.

``mesh_large`` ties the simulations (``smg-bench mesh``, ``smg-bench mesh-scale``, ``bench/ratelimit_bench``)
to real processes: ``LARGE_N`` = 15 ``smg-node`` processes, each in its own namespace on the suite's bridge,
sharing 2 mock engines, with the lightest node the CLI allows (``--tokenizer-workers 0``: tokenization
inline, no pool process; the small gpt2 tokenizer). Why 15: measured on this 2-core machine (2026-11-29,
a 14-node fleet of this shape, idle for 20 s): a node takes 2.3 s of CPU to start, ~1% of a core idle
(SWIM probes, push-pull every 5 s, engine health checks) and 141 MB of RSS; 15 nodes are 35 CPU-s to start,
~16% of a core idle and 2.1 GB, which leaves the two cores to the load, the engines and the harness (the
watch polls 15 nodes); 15 also splits into exactly 2/3 | 1/3 (10 | 5). The node addresses end below the
engines' (``chaos.spec``: 20 at most). The faults are one iptables rule per node (``iprange``: each side
is a run of consecutive addresses), so they are set within a second even on a busy machine.

Phases, each one whole rate-limit window (60 s, aligned on the limiter's windows, wall clock):
1. **steady**: every view all alive and every node lists the same workers (convergence); then a window of
   2x load of two tenants straight to the nodes, round-robin: ``default`` (rpm-bound: short requests at 2x
   ``RPM``) and ``LARGE_CONC_TENANT`` (concurrency-bound: 5 s requests offered at 2x ``CONC`` in flight).
2. **loss**: 10% packet loss on every node-to-node link (iptables, each direction) for the window: nobody
   declared dead, the suspicions counted, the limits still hold.
3. **partition**: 10 | 5 for the window: each side admits its share (limit x R / N) of both limits,
   together within the limit, every node keeps serving; same-side nodes are never declared dead.
4. **heal**: every view all alive, every limiter counting all 15 members, the same workers everywhere,
   and no dead member lingering in any view.

Bounds. The rate (rpm) bounds are README "Chaos suite"'s: admitted / limit (or a side's share) between
0.985 - 0.085 = 0.90 and 1.10 (``mesh.RL_MIN_RATIO``, ``mesh.RL_OVER_BAR``). The concurrency bound above is
the same 1.10 on the time-averaged in-flight count (the client's view of each admitted request: start to
end, a little longer than the node's admission to settle); below, the README states no figure: the bound
is the limiter simulation's mean in flight / limit at this N (``bench/ratelimit_bench.py --nodes 15``:
``CONC_SIM_MEAN``) less the same 0.085 margin as the rates'. The heal bound is README's (push-pull + 2 s,
``mesh.CONVERGE_BOUND_S``). Detection at N = 15 has no README figure: reported; the majority holding the
minority dead is checked within ``mesh.SPLIT_TIMEOUT_S``, the minority (backing off) only reported.

Run it on its own (about 5 min; not part of ``short``): ``python -m chaos.run mesh_large --install``;
``python -m chaos.run --prove-can-fail mesh_large`` runs it with ``IGNORE_PARTITION_RULE`` (a limiter's N
is the members it reaches: each side of the partition admits the whole limit) and passes only if it fails;
``--inject DISABLE_RATELIMIT_GOSSIP mesh_large`` (each node counts only its own shard) fails it in every
window.
"""

from __future__ import annotations

import ipaddress
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from chaos import faults
from chaos.fleet import Fleet, Member
from chaos.loadgen import LoadGenerator, LoadSpec, RequestRecord
from chaos.mesh_watch import MeshWatch, View, all_alive
from chaos.netns import Host
from chaos.report import Figure, ScenarioResult, Table
from chaos.scenarios.base import LAUNCHED_MIN_SHARE, Traffic, scenario
from chaos.scenarios.mesh import (
    CONVERGE_BOUND_S,
    MESH3,
    MESH_NODE_ARGS,
    RL_MIN_RATIO,
    RL_OVER_BAR,
    RL_UNDER_MARGIN,
    SPLIT_TIMEOUT_S,
    SideWindow,
    _within,
    side_windows,
    to_admissions,
)
from chaos.scenarios.wire_upgrade import mesh_state

LARGE_N = 15
LARGE_ENGINES = 2
RPM = 600  # --rate-limit-rpm: every tenant, each on its own count (the "*" rule)
CONC = 30  # --rate-limit-max-concurrent: likewise (the simulation's cap in bench/ratelimit_bench.py)
WINDOW_S = 60.0  # --rate-limit-window-secs: the README's figures are for 60 s windows
LOAD_X = 2.0  # offered / limit for both tenants
LOSS = 0.10  # the loss phase's drop probability on every node-to-node link
LARGE_CONC_TENANT = "chaos-conc"
DECODE_MS = 20.0  # the engines' inter-token latency here (the other fleets: 2 ms)
CONC_MAX_TOKENS = 250  # -> ~5 s per request at 20 ms a token (+ the engines' batch slowdown)
CONC_EXPECTED_S = CONC_MAX_TOKENS * DECODE_MS / 1000  # the launch rate's basis (offered in flight ~2x CONC)
RPM_MAX_TOKENS = 8
# The concurrency lease under-admits more the more nodes share a slot or two of headroom: the limiter
# simulation (`bench/ratelimit_bench.py --nodes N`, 2026-11-29; max_concurrent 30 at 2x load) gives mean in
# flight / limit 0.915 at N = 5, 0.727 at N = 12, 0.592 at N = 15. The lower bound is the N = 15 figure (the
# lowest: it also covers the partition's 10 and 5 live nodes) less the rates' margin RL_UNDER_MARGIN.
CONC_SIM_MEAN = 0.592
CONC_MIN_RATIO = CONC_SIM_MEAN - RL_UNDER_MARGIN
CONC_OVER_BAR = RL_OVER_BAR
WARMUP_S = 15.0  # load before the first measured window (at least)
EDGE_S = 0.5  # a fault is complete this long before its window begins
SETUP_S = 2.0  # time given to set a fault's rules (15 or 30 iptables calls; ~0.1 s each on a busy machine)
AFTER_HEAL_S = 20.0
SAMPLE_S = 5.0  # the limiters' views sampled this often
WATCH_INTERVAL_S = 0.5  # 15 pollers: 30 polls a second rather than 75 (the harness shares 2 cores)

MESH_LARGE = replace(
    MESH3,
    nodes=LARGE_N,
    engines=LARGE_ENGINES,
    # --output-len: the mock ends a request at max_tokens, not at its default 32-token EOS
    engine_args=(
        "--decode-ms-per-token",
        str(DECODE_MS),
        "--prefill-us-per-token",
        "10",
        "--output-len",
        "1000",
    ),
    node_args=(
        *MESH_NODE_ARGS,
        *("--rate-limit-rpm", str(RPM), "--rate-limit-max-concurrent", str(CONC)),
        *("--rate-limit-window-secs", str(WINDOW_S)),
        "--auth-trust-tenant-header",  # x-smg-tenant names the second tenant (auth is off in the fleet)
    ),
)


# ---- what the processes cost ------------------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (``/proc/PID/stat``), None when it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(members: Sequence[Member]) -> dict[str, float]:
    out = {}
    for m in members:
        c = cpu_seconds(m.proc.pid)
        if c is not None:
            out[m.name] = c
    return out


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# ---- concurrency: time-averaged in flight, from the client's records ---------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    start: float  # wall clock
    end: float
    node: str


def held(records: Sequence[RequestRecord], wall_offset: float, node_of: Mapping[str, str]) -> list[Held]:
    """The admitted (200) requests as intervals, wall clock, by the node that answered."""
    return [
        Held(r.start + wall_offset, r.end + wall_offset, node_of.get(r.target, r.target))
        for r in records
        if r.status == 200
    ]


def mean_in_flight(hs: Sequence[Held], start: float, end: float, nodes: Collection[str]) -> float:
    """Time-averaged number of requests in flight at ``nodes`` over [start, end)."""
    if end <= start:
        return 0.0
    busy = sum(max(0.0, min(h.end, end) - max(h.start, start)) for h in hs if h.node in nodes)
    return busy / (end - start)


def peak_in_flight(hs: Sequence[Held], start: float, end: float, nodes: Collection[str]) -> int:
    """The most requests in flight at once at ``nodes`` within [start, end)."""
    events = []
    for h in hs:
        if h.node in nodes and h.end > start and h.start < end:
            events += [(max(h.start, start), 1), (min(h.end, end), -1)]
    level = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        level += d
        peak = max(peak, level)
    return peak


@dataclass(frozen=True, slots=True)
class ConcWindow:
    label: str
    side: str
    nodes: tuple[str, ...]
    mean: float
    peak: int
    allowance: float  # CONC x side / N

    @property
    def ratio(self) -> float:
        return self.mean / self.allowance if self.allowance > 0 else 0.0


def conc_windows(
    hs: Sequence[Held], label: str, start: float, end: float, sides: Mapping[str, Collection[str]], n: int
) -> list[ConcWindow]:
    return [
        ConcWindow(
            label,
            side,
            tuple(sorted(members)),
            mean_in_flight(hs, start, end, members),
            peak_in_flight(hs, start, end, members),
            CONC * len(members) / n,
        )
        for side, members in sides.items()
    ]


# ---- the nodes' state: workers, limiter membership --------------------------------------------------------


def _workers(state: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    if state is None:
        return []
    return sorted(
        (str(w.get("id")), str(w.get("url")), str(w.get("owner"))) for w in state.get("workers", [])
    )


def _limiter(state: Mapping[str, Any] | None) -> str:
    rl = state.get("rate_limits") if state is not None else None
    return f"{rl.get('reachable')}/{rl.get('known')}" if isinstance(rl, dict) else "?"


def _states(fleet: Fleet, nodes: Sequence[Member]) -> dict[str, dict[str, Any] | None]:
    return {n.name: mesh_state(fleet, n) for n in nodes}


def workers_equal(states: Mapping[str, Mapping[str, Any] | None]) -> bool:
    """Every node answered and lists the same non-empty workers, with the same owners."""
    lists = [_workers(s) for s in states.values()]
    return (
        all(s is not None for s in states.values()) and bool(lists[0]) and all(w == lists[0] for w in lists)
    )


def _wait_state(
    fleet: Fleet, nodes: Sequence[Member], pred: str, timeout: float, since: float | None = None
) -> float | None:
    """Seconds since ``since`` (default: now) until every node lists the same workers ("workers") or every
    limiter counts all members ("limiters"), polled every 0.25 s; None when not within ``timeout``."""
    n = len(nodes)
    t0 = time.monotonic()
    since = t0 if since is None else since
    while time.monotonic() - t0 < timeout:
        states = _states(fleet, nodes)
        ok = (
            workers_equal(states)
            if pred == "workers"
            else all(_limiter(s) == f"{n}/{n}" for s in states.values())
        )
        if ok:
            return round(time.monotonic() - since, 3)
        time.sleep(0.25)
    return None


def _sleep_until_wall(t: float, fleet: Fleet, nodes: Sequence[Member], seen: dict[str, str]) -> None:
    """Sleep until wall-clock ``t``, sampling the limiters' membership every SAMPLE_S (changes marked)."""
    while time.time() < t:
        for name, st in _states(fleet, nodes).items():
            v = _limiter(st)
            if seen.get(name) != v:
                fleet.mark(f"{name} rate limiter counts {v} (reachable/known) members")
                seen[name] = v
        time.sleep(max(0.0, min(SAMPLE_S, t - time.time())))


def exact_view(names: Collection[str]) -> Callable[[View], bool]:
    """Every node answers and its view is exactly ``names``, all alive: no other member, dead or not."""
    want = dict.fromkeys(names, "alive")

    def pred(view: View) -> bool:
        return all(view.get(o) == want for o in names)

    return pred


def _src_range(hosts: Sequence[Host]) -> str:
    """``hosts``' addresses as one iptables ``--src-range`` (they must be consecutive addresses)."""
    ips = sorted(ipaddress.ip_address(h.ip) for h in hosts)
    if [int(ip) - int(ips[0]) for ip in ips] != list(range(len(ips))):
        raise ValueError(f"not consecutive addresses: {[str(ip) for ip in ips]}")
    return f"{ips[0]}-{ips[-1]}"


def range_drop(
    fw: faults.Firewall, dst: Sequence[Host], src: Sequence[Host], what: str, *match: str
) -> faults.Fault:
    """One DROP rule per host of ``dst`` (INPUT, on ``eth0``: a host's packets to itself stay on ``lo``) for
    the packets from any host of ``src`` (consecutive addresses, one ``iprange`` match), plus ``match``
    (e.g. ``-m statistic``): ``faults.one_way`` / ``faults.loss`` with len(dst) rules instead of
    len(dst) x len(src), so that 15 nodes are cut or made lossy within a second on a busy machine."""
    fault = faults.Fault(fw, what)
    rng = _src_range(src)
    for d in dst:
        fault.rules.append(fw.add(d.ns, "INPUT", "-i", "eth0", "-m", "iprange", "--src-range", rng, *match))
    return fault


def loss_between(fw: faults.Firewall, hosts: Sequence[Host], p: float) -> faults.Fault:
    """Loss ``p`` on every link between ``hosts``, each direction (not the client's or engines' traffic)."""
    stat = ("-m", "statistic", "--mode", "random", "--probability", f"{p:.4f}")
    return range_drop(fw, hosts, hosts, f"loss {p:.0%} between {len(hosts)} nodes", *stat)


def partition_ranges(fw: faults.Firewall, side_a: Sequence[Host], side_b: Sequence[Host]) -> faults.Fault:
    """No packet crosses between ``side_a`` and ``side_b`` (each of consecutive addresses), either way."""
    fault = range_drop(fw, side_b, side_a, "")
    fault.rules += range_drop(fw, side_a, side_b, "").rules
    fault.description = f"partition {','.join(h.name for h in side_a)} | {','.join(h.name for h in side_b)}"
    return fault


# ---- the scenario ------------------------------------------------------------------------------------------


@scenario(
    "mesh_large",
    f"{LARGE_N}-node mesh (one namespace each, {LARGE_ENGINES} shared engines): convergence, two mesh-wide "
    f"limits ({RPM} rpm, {CONC} in flight) at 2x load, {LOSS:.0%} loss for a window, a 2/3 | 1/3 partition "
    "for a window, heal",
    spec=MESH_LARGE,
    must_hold=f"every view all alive and the same workers everywhere; each window (steady, {LOSS:.0%} loss, "
    "partitioned) admits the limit (rpm: x 0.90-1.10; in flight: time-averaged <= x 1.10) and under the "
    "partition each side its share limit x R/N; loss declares nobody dead; same-side nodes never dead; every "
    "node keeps serving; after the heal all alive and every limiter whole within push-pull + 2 s, nothing "
    "dead left in any view; no request fails other than by 429",
)
def mesh_large(fleet: Fleet, result: ScenarioResult) -> None:
    nodes = fleet.active_nodes()
    n = len(nodes)
    hosts = [m.host for m in nodes]
    minority = nodes[: n // 3]
    majority = nodes[n // 3 :]
    names = [m.name for m in nodes]
    maj_names, min_names = [m.name for m in majority], [m.name for m in minority]
    sides_all: dict[str, Collection[str]] = {"all": names}
    sides: dict[str, Collection[str]] = {"majority": maj_names, "minority": min_names, "all": names}
    node_of = {fleet.node_url(m): m.name for m in nodes}
    targets = tuple(node_of)
    rpm_load = LoadSpec(
        url=fleet.lb_url,
        model=fleet.spec.model_name,
        rate=RPM / WINDOW_S * LOAD_X,
        stream_fraction=0.0,
        max_tokens=RPM_MAX_TOKENS,
        retries=0,
        targets=targets,
    )
    conc_load = LoadSpec(
        url=fleet.lb_url,
        model=fleet.spec.model_name,
        rate=CONC * LOAD_X / CONC_EXPECTED_S,
        max_in_flight=256,
        stream_fraction=0.0,
        max_tokens=CONC_MAX_TOKENS,
        attempt_timeout_s=30.0,
        retries=0,
        targets=targets[1:] + targets[:1],  # the two loads' round-robins do not move in step
        headers=(("x-smg-tenant", LARGE_CONC_TENANT),),
    )
    conc_gen = LoadGenerator(conc_load, netns=fleet.client_ns)
    wall_offset = time.time() - time.monotonic()
    seen: dict[str, str] = {}
    load_start = _loadavg()
    cpu0 = _cpu([*nodes, *fleet.engines])
    harness0 = os.times()
    split = {(a, b) for a in maj_names for b in min_names} | {(b, a) for a in maj_names for b in min_names}
    t_begin = time.monotonic()
    conc_records: list[RequestRecord] = []
    loss_fault: faults.Fault | None = None
    with Traffic(fleet, result, rpm_load) as tr, MeshWatch(fleet, interval_s=WATCH_INTERVAL_S) as watch:
        conc_gen.start()
        try:
            converged_s = watch.wait(all_alive(names), timeout=60.0)
            workers_s = _wait_state(fleet, nodes, "workers", timeout=30.0)
            tr.mark(f"baseline: views all alive after {converged_s} s, same workers after {workers_s} s")
            if converged_s is None:
                raise RuntimeError(f"the mesh never converged before the faults: {watch.view()}")
            w1 = math.ceil((time.time() + WARMUP_S) / WINDOW_S) * WINDOW_S
            w2, w3, w4 = w1 + WINDOW_S, w1 + 2 * WINDOW_S, w1 + 3 * WINDOW_S
            tr.mark(f"steady window in {w1 - time.time():.1f} s")
            # each fault is in place EDGE_S before its window: the rules go in from SETUP_S before that
            _sleep_until_wall(w2 - EDGE_S - SETUP_S, fleet, nodes, seen)
            loss_start = time.monotonic()
            loss_fault = loss_between(fleet.firewall, hosts, LOSS)
            loss_at = tr.mark(f"{loss_fault.description} on every link, both ways")
            loss_setup_s = round(loss_at - loss_start, 2)
            loss_early_s = round(w2 - (loss_at + wall_offset), 2)
            _sleep_until_wall(w3 - EDGE_S - SETUP_S, fleet, nodes, seen)
            loss_fault.heal()
            loss_fault = None
            loss_end = tr.mark("loss healed")
            part = partition_ranges(fleet.firewall, [m.host for m in majority], [m.host for m in minority])
            cut_at = tr.mark(part.description)
            cut_early_s = round(w3 - (cut_at + wall_offset), 2)
            try:

                def split_seen(view: View) -> bool:
                    return all(view.get(o, {}).get(m) == "dead" for o, m in split)

                split_s = watch.wait(split_seen, timeout=SPLIT_TIMEOUT_S)
                _sleep_until_wall(w4 + 1.0, fleet, nodes, seen)
            finally:
                heal_at = tr.mark("healing the partition")
                part.heal()
            tr.mark("partition healed")
            watch.wait(all_alive(names), timeout=30.0)
            heal_converged_s = watch.when(all_alive(names), heal_at)
            limiters_s = _wait_state(fleet, nodes, "limiters", timeout=30.0, since=heal_at)
            heal_workers_s = _wait_state(fleet, nodes, "workers", timeout=30.0, since=heal_at)
            tr.mark(
                f"after the heal: views all alive after {heal_converged_s} s, limiters whole after "
                f"{limiters_s} s, same workers after {heal_workers_s} s"
            )
            _sleep_until_wall(heal_at + wall_offset + AFTER_HEAL_S, fleet, nodes, seen)
            final_view = watch.view()
            final_exact = exact_view(names)(final_view)
            end = time.monotonic()
        finally:
            if loss_fault is not None:
                loss_fault.heal()
            conc_records = conc_gen.stop()
    harness1 = os.times()
    cpu1 = _cpu([*nodes, *fleet.engines])
    wall = time.monotonic() - t_begin
    cut = split
    t_res = result.traffic
    assert t_res is not None

    # ---- rates (tenant "default") and concurrency (LARGE_CONC_TENANT) per window and side ----------------
    adm = to_admissions(tr.records, wall_offset, node_of)
    hs = held(conc_records, wall_offset, node_of)
    limit = float(RPM)
    rate_rows: list[SideWindow] = [
        *side_windows(adm, "steady", w1, w2, sides_all, limit, n, WINDOW_S),
        *side_windows(adm, f"{LOSS:.0%} loss", w2, w3, sides_all, limit, n, WINDOW_S),
        *side_windows(adm, "partitioned", w3, w4, sides, limit, n, WINDOW_S),
    ]
    conc_rows: list[ConcWindow] = [
        *conc_windows(hs, "steady", w1, w2, sides_all, n),
        *conc_windows(hs, f"{LOSS:.0%} loss", w2, w3, sides_all, n),
        *conc_windows(hs, "partitioned", w3, w4, sides, n),
    ]
    rows: list[tuple[Figure, ...]] = [
        (
            sw.label,
            f"rpm ({sw.side}, {len(sw.nodes)})",
            sw.offered,
            sw.admitted,
            round(sw.allowance, 1),
            round(sw.ratio, 3),
        )
        for sw in rate_rows
    ]
    rows += [
        (
            cw.label,
            f"in flight ({cw.side}, {len(cw.nodes)}), peak {cw.peak}",
            "-",
            round(cw.mean, 2),
            round(cw.allowance, 1),
            round(cw.ratio, 3),
        )
        for cw in conc_rows
    ]
    result.tables.append(
        Table(
            f"Admitted / allowance per {WINDOW_S:.0f} s window ({RPM} rpm for tenant 'default'; {CONC} in "
            f"flight for '{LARGE_CONC_TENANT}', time-averaged; a side's allowance: limit x its nodes / {n})",
            ("window", "limit (side)", "offered", "admitted / mean in flight", "allowance", "ratio"),
            tuple(rows),
        )
    )
    print("\n".join(f"chaos:   {' | '.join(str(c) for c in row)}" for row in rows), flush=True)

    # ---- membership ----------------------------------------------------------------------------------------
    loss_hist = watch.history(loss_at, loss_end)  # the partition follows at once
    loss_dead = sorted({f"{c.observer}:{c.member}" for c in loss_hist if c.state == "dead"})
    loss_suspicions = sum(1 for c in loss_hist if c.state == "suspect")
    part_hist = watch.history(cut_at, heal_at)
    false_dead = sorted(
        {
            f"{c.observer}:{c.member}"
            for c in part_hist
            if c.state == "dead" and (c.observer, c.member) not in cut
        }
    )
    dead_maj = [watch.all_saw(cut_at, maj_names, m, {"dead"}, heal_at) for m in min_names]
    dead_min = [watch.all_saw(cut_at, min_names, m, {"dead"}, heal_at) for m in maj_names]
    part_suspicions = sum(1 for c in part_hist if c.state == "suspect" and (c.observer, c.member) not in cut)

    def worst(xs: Sequence[float | None]) -> float | None:
        return None if any(x is None for x in xs) else max(x for x in xs if x is not None)

    serving = {
        name: sum(1 for a in adm if a.admitted and a.node == name and w3 <= a.at < w4) for name in names
    }
    serving_conc = {name: sum(1 for h in hs if h.node == name and w3 <= h.start < w4) for name in names}
    idle = sorted(name for name in names if not serving[name] or not serving_conc[name])
    other_errors: dict[str, int] = dict(t_res.errors)
    other_errors.pop("http_429", None)
    conc_errors: dict[str, int] = {}
    for r in conc_records:
        if r.status not in (200, 429):
            key = r.error or f"http_{r.status}"
            conc_errors[key] = conc_errors.get(key, 0) + 1
    conc_refused = sum(1 for r in conc_records if r.status == 429)
    node_cpu = {k: cpu1[k] - cpu0[k] for k in cpu0 if k in cpu1 and k in names}
    engine_cpu = {k: cpu1[k] - cpu0[k] for k in cpu0 if k in cpu1 and k not in names}
    harness_cpu = (harness1.user - harness0.user) + (harness1.system - harness0.system)
    rss = fleet.node_rss()
    by = {(sw.label, sw.side): sw for sw in rate_rows}
    cby = {(cw.label, cw.side): cw for cw in conc_rows}
    loss_label = f"{LOSS:.0%} loss"
    result.figures.update(
        nodes=n,
        engines=len(fleet.engines),
        partition=f"{len(majority)} | {len(minority)}",
        baseline_all_alive_s=converged_s,
        baseline_same_workers_s=workers_s,
        workers_listed=len(_workers(mesh_state(fleet, nodes[0]))),
        steady_rpm_admitted_over_limit=round(by["steady", "all"].ratio, 3),
        steady_in_flight_over_limit=round(cby["steady", "all"].ratio, 3),
        loss_rpm_admitted_over_limit=round(by[loss_label, "all"].ratio, 3),
        loss_in_flight_over_limit=round(cby[loss_label, "all"].ratio, 3),
        loss_rules_set_s=loss_setup_s,
        loss_in_place_before_window_s=loss_early_s,
        partition_in_place_before_window_s=cut_early_s,
        loss_suspicions=loss_suspicions,
        loss_dead=len(loss_dead),
        partitioned_rpm_majority_over_share=round(by["partitioned", "majority"].ratio, 3),
        partitioned_rpm_minority_over_share=round(by["partitioned", "minority"].ratio, 3),
        partitioned_rpm_total_over_limit=round(by["partitioned", "all"].ratio, 3),
        partitioned_in_flight_majority_over_share=round(cby["partitioned", "majority"].ratio, 3),
        partitioned_in_flight_minority_over_share=round(cby["partitioned", "minority"].ratio, 3),
        partitioned_in_flight_total_over_limit=round(cby["partitioned", "all"].ratio, 3),
        split_seen_by_both_sides_s=split_s,
        majority_holds_minority_dead_s=worst(dead_maj),
        minority_holds_majority_dead_s=worst(dead_min),
        partition_same_side_suspicions=part_suspicions,
        false_dead=len(false_dead),
        heal_all_alive_s=heal_converged_s,
        heal_limiters_whole_s=limiters_s,
        heal_same_workers_s=heal_workers_s,
        heal_bound_s=CONVERGE_BOUND_S,
        rpm_refused_429=t_res.errors.get("http_429", 0),
        conc_requests=len(conc_records),
        conc_refused_429=conc_refused,
        scenario_wall_s=round(wall, 1),
        node_cpu_s_total=round(sum(node_cpu.values()), 1),
        node_cpu_pct_of_a_core_mean=round(100 * sum(node_cpu.values()) / max(1, len(node_cpu)) / wall, 1),
        engine_cpu_s_total=round(sum(engine_cpu.values()), 1),
        harness_cpu_s=round(harness_cpu, 1),
        node_rss_mb_mean=round(sum(rss.values()) / max(1, len(rss)) / 2**20, 1),
        loadavg_start=load_start,
        loadavg_end=_loadavg(),
    )
    _timeline(result, tr, watch, t_begin)

    # ---- checks -----------------------------------------------------------------------------------------
    result.check(
        "convergence: every node sees all members alive and lists the same workers",
        converged_s is not None and workers_s is not None,
        f"views after {converged_s} s, workers after {workers_s} s",
    )
    result.check(
        "the loss and the partition are in place before their windows begin (the windows measure them whole)",
        loss_early_s >= 0 and cut_early_s >= 0,
        f"loss {loss_early_s} s before its window, partition {cut_early_s} s before its window",
    )
    for label in ("steady", loss_label):
        sw = by[label, "all"]
        result.check(
            f"{label}: the mesh admits between limit x {RL_MIN_RATIO:.3f} and x {1 + RL_OVER_BAR} requests "
            "in the window",
            RL_MIN_RATIO <= sw.ratio <= 1 + RL_OVER_BAR,
            f"{sw.admitted} / {RPM} = {sw.ratio:.3f} (offered {sw.offered})",
        )
        cw = cby[label, "all"]
        result.check(
            f"{label}: in flight, time-averaged, between limit x {CONC_MIN_RATIO:.3f} and "
            f"x {1 + CONC_OVER_BAR}",
            CONC_MIN_RATIO <= cw.ratio <= 1 + CONC_OVER_BAR,
            f"{cw.mean:.2f} / {CONC} = {cw.ratio:.3f} (peak {cw.peak})",
        )
    for side in ("majority", "minority"):
        sw = by["partitioned", side]
        result.check(
            f"partitioned: the {side} ({len(sw.nodes)} nodes) admits between its share {sw.allowance:.0f} "
            f"x {RL_MIN_RATIO:.3f} and x {1 + RL_OVER_BAR}",
            RL_MIN_RATIO <= sw.ratio <= 1 + RL_OVER_BAR,
            f"{sw.admitted} / {sw.allowance:.0f} = {sw.ratio:.3f} (offered {sw.offered})",
        )
        cw = cby["partitioned", side]
        result.check(
            f"partitioned: the {side}'s requests in flight, time-averaged, between its share "
            f"{cw.allowance:.0f} x {CONC_MIN_RATIO:.3f} and x {1 + CONC_OVER_BAR}",
            CONC_MIN_RATIO <= cw.ratio <= 1 + CONC_OVER_BAR,
            f"{cw.mean:.2f} / {cw.allowance:.0f} = {cw.ratio:.3f} (peak {cw.peak})",
        )
    tot, ctot = by["partitioned", "all"], cby["partitioned", "all"]
    result.check(
        f"partitioned: both sides together within the limit x {1 + RL_OVER_BAR} (requests and in flight)",
        tot.ratio <= 1 + RL_OVER_BAR and ctot.ratio <= 1 + CONC_OVER_BAR,
        f"requests {tot.admitted} / {RPM} = {tot.ratio:.3f}, "
        f"in flight {ctot.mean:.2f} / {CONC} = {ctot.ratio:.3f}",
    )
    result.check(
        "partitioned: every node on both sides keeps serving (admits requests of both tenants)",
        not idle,
        f"nodes that admitted nothing of a tenant: {idle}",
    )
    result.check(
        f"the limits bind: 429s for both tenants (offered {LOAD_X}x)",
        t_res.errors.get("http_429", 0) > 0 and conc_refused > 0,
        f"rpm tenant {t_res.errors.get('http_429', 0)}, concurrency tenant {conc_refused}",
    )
    result.check(
        f"{LOSS:.0%} loss for a window: nobody declared dead (suspicions reported)",
        not loss_dead,
        f"{loss_suspicions} suspicions; dead: {loss_dead}",
    )
    # only the majority's detection is checked (as in mesh._partition_heal): the minority has no bound, its
    # nodes' probes all fail and Lifeguard backs them off (16-30 s here for 10 members); reported
    maj_dead_s = worst(dead_maj)
    result.check(
        f"partitioned: every majority node holds every minority node dead within {SPLIT_TIMEOUT_S:.0f} s",
        _within(maj_dead_s, SPLIT_TIMEOUT_S),
        f"after {maj_dead_s} s (the minority, backing off, held the majority dead after {worst(dead_min)} s)",
    )
    result.check(
        "partitioned: no node on the same side is declared dead", not false_dead, f"false dead: {false_dead}"
    )
    result.check(
        f"after the heal every view is all alive and every limiter counts all {n} members within "
        "push-pull + 2 s",
        heal_converged_s is not None
        and heal_converged_s <= CONVERGE_BOUND_S
        and limiters_s is not None
        and limiters_s <= CONVERGE_BOUND_S,
        f"views after {heal_converged_s} s, limiters whole after {limiters_s} s (bound {CONVERGE_BOUND_S} s)",
    )
    result.check(
        "after the heal every node lists the same workers, and no dead member lingers in any view",
        heal_workers_s is not None and final_exact,
        f"workers after {heal_workers_s} s; views at the end: "
        + ("exactly the members, all alive" if final_exact else f"{_not_alive(final_view)}"),
    )
    conc_due = conc_load.rate * (end - t_begin)
    result.check(
        f"the concurrency tenant's traffic flowed (>= {LAUNCHED_MIN_SHARE:.0%} of the launches due, "
        "none skipped)",
        conc_gen.launched >= LAUNCHED_MIN_SHARE * conc_due and conc_gen.skipped == 0,
        f"launched {conc_gen.launched} of {conc_due:.0f} due, skipped {conc_gen.skipped}",
    )
    result.check(
        "no request of either tenant fails other than by 429",
        not other_errors and not conc_errors,
        f"rpm tenant: {other_errors}; concurrency tenant: {conc_errors}",
    )


def _not_alive(view: View) -> list[str]:
    return sorted(f"{o}:{m}={s}" for o, ms in view.items() for m, s in ms.items() if s != "alive")


def _timeline(result: ScenarioResult, tr: Traffic, watch: MeshWatch, after: float) -> None:
    """The views' changes since ``after`` (not the alive ones: 15 x 15 views make a long list)."""
    result.timeline += [
        (round(c.at - tr.t0, 2), f"{c.observer} sees {c.member} {c.state}")
        for c in watch.history(after)
        if c.state != "alive"
    ]
    result.timeline.sort()
