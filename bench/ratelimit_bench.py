"""Mesh-wide rate limits: what the mesh admits ÷ the limit, per window, mean and worst.

    .venv/bin/python bench/ratelimit_bench.py [--nodes 3] [--rpm 600] [--load 2.0] [--duration 60]
                                              [--warmup 120] [--gossip 0.2] [--seed 1]
    .venv/bin/python bench/ratelimit_bench.py --target loopback [--scenario steady|paused|both]
                                              [--duration 60] [--lb-warmup 60]   # real nodes: run_loopback

Default target: the deterministic simulation (``shepherd.mesh.ratelimit_sim``): ``--nodes`` limiter
replicas gossiping every ``--gossip`` seconds (5-25 ms delivery), Poisson load at ``--load`` x the limit
split over the nodes, measured for ``--duration`` seconds of simulated time after ``--warmup`` seconds
(two windows: the first one is a cold start, which admits the whole limit at once then waits).
Two views of "a window": the limiter's fixed windows, and every sliding window of the same length ending
each second of the measured period (exact counts: stricter than the limiter's own approximation).
Scenarios: steady state with even and uneven load, one node partitioned away (cut 5 s into the
measured period, healed 15 s before its end; failure detection 2 s, then 10 s), a burst on every node
at once with and without the lease, tokens per minute, and concurrency. Last, the CPU cost of one
admission (acquire + settle, two rules) on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import http.client
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from shepherd.loadgen.procs import ManagedProcess, ProcessGroup, ProcSpec, free_port
from shepherd.loadgen.targets import console_script
from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_sim import (
    Load,
    NetModel,
    Partition,
    Rule,
    Scenario,
    SimResult,
    even,
    simulate,
    summarize,
    uneven,
)

WINDOW = 60.0  # the limiter's window (``LimiterConfig.window``; the nodes use the default)
MODEL = "qwen3"


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Figures:
    name: str
    fixed: list[float]  # per fixed window in the measured period
    sliding: list[float]  # per sliding window ending each second of the measured period
    note: str = ""


def _measure(name: str, r: SimResult, limit: float, a: argparse.Namespace, note: str = "") -> Figures:
    first = int(a.warmup // WINDOW)
    last = int((a.warmup + a.duration) // WINDOW)
    fixed = r.ratios("a", "requests", limit, skip=first)[: max(1, last - first)]
    end = a.warmup + a.duration
    sliding = r.sliding_ratios("a", limit, max(WINDOW, a.warmup), end)
    return Figures(name, fixed, sliding, note)


def run_sim(a: argparse.Namespace) -> list[Figures]:
    n, rpm = a.nodes, a.rpm
    total = a.warmup + a.duration
    rate = a.load * rpm / WINDOW
    rules = (Rule("a", Limits(rpm=rpm)),)
    net = NetModel(gossip_interval=a.gossip)
    lim = LimiterConfig(window=WINDOW)
    cut = (Partition(a.warmup + 5, total - 15, (tuple(range(n - 1)), (n - 1,))),)
    out: list[Figures] = []

    def sc(loads: tuple[Load, ...], **kw: object) -> Scenario:
        return Scenario(n, total, rules, loads, **{"net": net, "limiter": lim, "seed": a.seed, **kw})

    weights = [7, 2, 1] + [1] * (n - 3) if n >= 3 else [3, 1][:n]
    out.append(_measure("steady, even load", simulate(sc((Load("a", even(rate, n)),))), rpm, a))
    out.append(_measure("steady, uneven load", simulate(sc((Load("a", uneven(rate, weights)),))), rpm, a))
    out.append(
        _measure(
            "all load on one node", simulate(sc((Load("a", uneven(rate, [1] + [0] * (n - 1))),))), rpm, a
        )
    )
    out.append(
        _measure(
            "one node partitioned away", simulate(sc((Load("a", even(rate, n)),), partitions=cut)), rpm, a
        )
    )
    slow = NetModel(gossip_interval=a.gossip, detect=10.0)
    out.append(
        _measure(
            "  ...detected after 10 s",
            simulate(sc((Load("a", even(rate, n)),), partitions=cut, net=slow)),
            rpm,
            a,
        )
    )
    out.append(
        _measure(
            "lossy network (30 % loss)",
            simulate(sc((Load("a", even(rate, n)),), net=NetModel(loss=0.3))),
            rpm,
            a,
        )
    )
    burst = (
        Load("a", even(5 * rpm, n), poisson=False, start=a.warmup, end=a.warmup + 0.5),
        Load("a", even(rate / 4, n)),
    )
    out.append(_measure("burst 2.5x in 0.5 s (+0.25x)", simulate(sc(burst)), rpm, a, "lease"))
    naive = LimiterConfig(window=WINDOW, lease=False)
    out.append(_measure("  ...without the lease", simulate(sc(burst, limiter=naive)), rpm, a, "naive"))
    return out


def run_tokens_and_concurrency(a: argparse.Namespace) -> list[str]:
    n, total = a.nodes, a.warmup + a.duration
    first = int(a.warmup // WINDOW)
    lines = []
    tpm = 300_000
    r = simulate(
        Scenario(
            n,
            total,
            (Rule("a", Limits(tpm=tpm)),),
            (Load("a", even(a.load * tpm / WINDOW / 670, n)),),
            seed=a.seed,
        )
    )
    m, hi, lo = summarize(r.ratios("a", "tokens", tpm, skip=first))
    lines.append(
        f"tokens per minute ({tpm}), real tokens ÷ limit: mean {m:.3f}  worst {hi:.3f}  min {lo:.3f}"
    )
    cap = 30
    r = simulate(
        Scenario(
            n,
            total,
            (Rule("a", Limits(max_concurrent=cap)),),
            (Load("a", even(a.load * cap / 1.75, n)),),
            seed=a.seed,
        )
    )
    one = simulate(
        Scenario(
            1,
            total,
            (Rule("a", Limits(max_concurrent=cap)),),
            (Load("a", (a.load * cap / 1.75,)),),
            seed=a.seed,
        )
    )
    mean_c = summarize(r.ratios("a", "mean_concurrent", cap, skip=first))[0]
    mean_1 = summarize(one.ratios("a", "mean_concurrent", cap, skip=first))[0]
    peak = summarize(r.ratios("a", "peak_concurrent", cap, skip=first))[1]
    excess = summarize(r.ratios("a", "excess_concurrent", cap, skip=first))[1]
    lines.append(
        f"max_concurrent ({cap}): mean in flight ÷ limit {mean_c:.3f} (one node alone: {mean_1:.3f}), "
        f"peak {peak:.3f}, time-averaged excess {excess:.4f}"
    )
    return lines


def admission_cpu_us(rounds: int = 5, n: int = 20_000) -> float:
    """CPU µs per acquire + settle with a tenant rule and a (tenant, model) rule, 3 live nodes."""
    best = float("inf")
    rules = [
        (("t", ""), Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6)),
        (("t", "m"), Limits(rpm=10**9)),
    ]
    for _ in range(rounds):
        lim = RateLimiter("n0", 1)
        lim.set_membership(["n0", "n1", "n2"], 3)
        t0 = time.process_time()
        now = 1000.0
        for _ in range(n):
            now += 0.0005
            g = lim.acquire(now, rules, 500)
            assert isinstance(g, Grant)
            lim.settle(now, g, 300)
        best = min(best, (time.process_time() - t0) / n * 1e6)
    return best


def run_loopback(a: argparse.Namespace) -> list[Figures]:
    """The same figures on real processes on loopback: one mock engine (``--zero-latency``) and
    ``--nodes`` ``smg-node serve`` processes meshed through a shared ``--mesh-dev-pki`` dir, every node
    with ``--rate-limit-rpm RPM --auth-trust-tenant-header``; ready when each node's ``/mesh/members``
    lists all of them alive.

    Load: ``load x RPM`` requests per minute (Poisson, non-streamed chat, ``max_tokens`` 1, tenant
    header set), round-robin over the nodes that are up, at most ``--concurrency`` in flight; the send
    time of every 200 is an admission, a 429 a refusal. Load starts at once; the measured period starts
    at the first limiter window boundary (windows of 60 s aligned on the wall clock, as the nodes'
    limiters count them) at least ``--lb-warmup`` s later, and lasts ``--duration`` s. Figures as in the
    simulation: per fixed window (a partial window is scaled to its length) and per sliding 60-s
    window ending each second of the measured period (those that start after the load started).

    ``--scenario paused`` (or ``both``, after the steady period, on the same tenant): SIGSTOP one node
    at the start of its measured period and send the load to the others. A PAUSE, not a partition
    (loopback has no netns: the paused node neither admits nor gossips, and the others see it suspect,
    then dead, then reap it). Every process is stopped by pid, also on failure."""
    with tempfile.TemporaryDirectory(prefix="ratelimit-bench-") as tmp:
        group = ProcessGroup(Path(a.log_dir) if a.log_dir else Path(tmp) / "logs")
        with group:
            return _loopback(a, group, Path(tmp))


@dataclass
class _Shot:
    t: float  # wall-clock send time
    node: int
    status: int


def _members(port: int) -> dict[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/mesh/members")
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"/mesh/members on port {port}: HTTP {resp.status}")
    return {m["name"]: m["state"] for m in json.loads(raw)["members"]}


def _wait_mesh(ports: list[int], names: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if all(_members(p) == dict.fromkeys(names, "alive") for p in ports):
                return
        except (OSError, RuntimeError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {len(names)} nodes to see each other alive")
        time.sleep(0.1)


def _loopback(a: argparse.Namespace, group: ProcessGroup, tmp: Path) -> list[Figures]:
    grpc, http_port = free_port(), free_port()
    engine = [*console_script("smg-mock-engine", "shepherd.mock_engine.cli"), "--zero-latency"]
    engine += ["--grpc-port", str(grpc), "--http-port", str(http_port)]
    group.start(ProcSpec("engine", tuple(engine), ready_port=http_port, ready_path="/health"))
    names = [f"n{i}" for i in range(a.nodes)]
    http_ports = [free_port() for _ in names]
    mesh_ports = [free_port() for _ in names]
    procs: list[ManagedProcess] = []
    for i, name in enumerate(names):
        argv = [
            *console_script("smg-node", "shepherd.node.cli"), "serve",
            "--host", "127.0.0.1", "--port", str(http_ports[i]),
            "--worker-urls", f"grpc://127.0.0.1:{grpc}", "--model-id", MODEL,
            "--tokenizer-workers", "0", "--log-level", "warning",
            "--rate-limit-rpm", str(a.rpm), "--auth-trust-tenant-header",
            "--mesh-port", str(mesh_ports[i]), "--mesh-name", name, "--mesh-dev-pki", str(tmp / "pki"),
        ]  # fmt: skip
        if i > 0:
            argv += ["--mesh-seeds", f"127.0.0.1:{mesh_ports[0]}"]
        spec = ProcSpec(
            name, tuple(argv), ready_port=http_ports[i], ready_path="/readiness", ready_timeout_s=240
        )
        procs.append(group.start(spec))  # one after the other: 2 shared cores
    _wait_mesh(http_ports, names)
    _progress(f"{a.nodes} nodes meshed (HTTP ports {http_ports})")
    steady = a.scenario in ("steady", "both")
    paused = a.scenario in ("paused", "both")
    victim = procs[-1]
    t_load = time.time()
    start = (math.floor((t_load + a.lb_warmup) / WINDOW) + 1) * WINDOW
    periods: list[tuple[str, float, float]] = []
    if steady:
        periods.append(("loopback: steady, even load", start, start + a.duration))
    if paused:
        p0 = periods[-1][2] if periods else start
        periods.append(("loopback: node paused (SIGSTOP)", p0, p0 + a.duration))
    pause_at = periods[-1][1] if paused else math.inf
    shots: list[_Shot] = []
    notes: list[str] = []
    try:
        asyncio.run(_drive(a, http_ports, t_load, periods[-1][2], pause_at, victim, shots, notes))
    finally:
        if paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)  # so that SIGTERM can end it
    other = [s for s in shots if s.status not in (200, 429)]
    out: list[Figures] = []
    for name, p0, p1 in periods:
        f = _loopback_figures(name, [s.t for s in shots if s.status == 200], a.rpm, t_load, p0, p1)
        n200 = sum(1 for s in shots if p0 <= s.t < p1 and s.status == 200)
        n429 = sum(1 for s in shots if p0 <= s.t < p1 and s.status == 429)
        _progress(f"{name}: {n200} admitted, {n429} refused in [{p0:.0f}, {p1:.0f})")
        per10 = [
            sum(1 for s in shots if p0 + b <= s.t < p0 + b + 10 and s.status == 200) / (a.rpm / 6)
            for b in range(0, int(p1 - p0), 10)
        ]
        _progress("  admitted per 10 s ÷ (limit / 6): " + " ".join(f"{x:.2f}" for x in per10))
        out.append(f)
    for line in notes:
        _progress(line)
    if other:
        codes = sorted({s.status for s in other})
        _progress(f"{len(other)} answers neither 200 nor 429 (statuses {codes}; 0: no answer)")
    return out


def _loopback_figures(
    name: str, admitted: list[float], rpm: int, t_load: float, p0: float, p1: float
) -> Figures:
    fixed: list[float] = []
    w = math.floor(p0 / WINDOW)
    while w * WINDOW < p1:
        lo, hi = max(p0, w * WINDOW), min(p1, (w + 1) * WINDOW)
        if hi - lo >= 1.0:
            n = sum(1 for t in admitted if lo <= t < hi)
            fixed.append(n / (rpm * (hi - lo) / WINDOW))
        w += 1
    sliding: list[float] = []
    ts = sorted(admitted)
    end = math.ceil(max(p0, t_load + WINDOW))
    while end <= p1:
        n = bisect.bisect_left(ts, end) - bisect.bisect_left(ts, end - WINDOW)
        sliding.append(n / rpm)
        end += 1
    return Figures(name, fixed, sliding)


async def _drive(
    a: argparse.Namespace,
    ports: list[int],
    t0: float,
    t_end: float,
    pause_at: float,
    victim: ManagedProcess,
    shots: list[_Shot],
    notes: list[str],
) -> None:
    rng = random.Random(a.seed)
    rate = a.load * a.rpm / WINDOW
    sem = asyncio.Semaphore(a.concurrency)
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}
    )
    headers = {"content-type": "application/json", "x-smg-tenant": "bench"}
    live = list(range(len(ports)))
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=30)
    conn = aiohttp.TCPConnector(limit=a.concurrency)

    async def one(node: int) -> None:
        async with sem:
            t = time.time()
            try:
                async with session.post(
                    f"http://127.0.0.1:{ports[node]}/v1/chat/completions", data=body, headers=headers
                ) as r:
                    await r.read()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError):
                status = 0
            shots.append(_Shot(t, node, status))

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        loop = asyncio.get_running_loop()
        t_next, k = t0, 0
        while t_next < t_end:
            if t_next >= pause_at and len(live) == len(ports):
                os.kill(victim.pid, signal.SIGSTOP)
                live.remove(len(ports) - 1)
                notes.append(f"paused node n{len(ports) - 1} (SIGSTOP) at {time.time():.1f}")
                tasks.add(asyncio.create_task(_watch(ports[:-1], f"n{len(ports) - 1}", t_end, notes)))
            await asyncio.sleep(max(0.0, t_next - time.time()))
            task = loop.create_task(one(live[k % len(live)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
            t_next += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=60)


async def _watch(ports: list[int], name: str, t_end: float, notes: list[str]) -> None:
    """Note when the other nodes first list the paused node as suspect, dead, or no longer."""
    seen: dict[tuple[int, str], float] = {}
    while time.time() < t_end:
        for p in ports:
            try:
                st = (await asyncio.to_thread(_members, p)).get(name, "gone")
            except (OSError, RuntimeError, ValueError, KeyError):
                continue
            if (p, st) not in seen:
                seen[(p, st)] = time.time()
                notes.append(f"  node on port {p} lists {name} {st} at {seen[(p, st)]:.1f}")
        await asyncio.sleep(0.5)


def _row(f: Figures) -> str:
    fm, fw, _ = summarize(f.fixed)
    sm, sw, sl = summarize(f.sliding)
    return f"{f.name:<32} {fm:6.3f} {fw:6.3f}   {sm:6.3f} {sw:6.3f} {sl:6.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["sim", "loopback"], default="sim")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--rpm", type=int, default=600)
    p.add_argument("--load", type=float, default=2.0, help="offered load ÷ the limit")
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="measured seconds (simulated; real, per scenario, on loopback)",
    )
    p.add_argument("--warmup", type=float, default=120.0, help="seconds before measuring (simulated)")
    p.add_argument("--gossip", type=float, default=0.2, help="gossip interval, seconds")
    p.add_argument("--seed", type=int, default=1)
    lb = p.add_argument_group("loopback (--target loopback)")
    lb.add_argument("--scenario", choices=["steady", "paused", "both"], default="both")
    lb.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    lb.add_argument(
        "--lb-warmup", type=float, default=60.0, help="seconds of load before the measured period"
    )
    lb.add_argument("--log-dir", help="keep the processes' logs here")
    a = p.parse_args(argv)
    if a.target == "loopback":
        figs = run_loopback(a)
    else:
        t0 = time.process_time()
        figs = run_sim(a)
        extra = run_tokens_and_concurrency(a)
        sim_cpu = time.process_time() - t0
    if a.target == "sim":
        print(
            f"mesh rate limits: {a.nodes} nodes, rpm {a.rpm} (window {WINDOW:.0f} s), load {a.load}x the "
            f"limit, gossip every {a.gossip} s, τ 1 s; measured {a.duration:.0f} s after {a.warmup:.0f} s"
        )
    else:
        print(
            f"mesh rate limits on loopback: {a.nodes} smg-node processes + 1 mock engine, rpm {a.rpm} "
            f"(window {WINDOW:.0f} s, wall-clock aligned), load {a.load}x the limit spread over the nodes; "
            f"measured {a.duration:.0f} s per scenario, from a window boundary"
        )
    print("admitted ÷ limit                  fixed windows   sliding 60-s windows, every second")
    print(f"{'scenario':<32} {'mean':>6} {'worst':>6}   {'mean':>6} {'worst':>6} {'min':>6}")
    for f in figs:
        print(_row(f))
    if a.target == "sim":
        for line in extra:
            print(line)
        print(f"admission CPU per request (acquire + settle, 2 rules): {admission_cpu_us():.1f} µs")
        print(f"(simulation CPU: {sim_cpu:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
