"""``smg-bench mesh``: the mesh on real node processes on loopback, and SWIM in simulation.

Real processes (started and watched by ``mesh_cluster``): ``smg-node`` with ``--mesh-port`` (a
development PKI shared through a temp dir), every node configured with the same 4 mock engines and
``cache_aware``. One cluster is grown through the sizes asked (node n0 is the seed, the others
``smg-node join``); at each size, measured here:

* crash detection (``--sizes``): SIGKILL a random node other than the seed; each survivor's time to
  mark it DEAD, read from its ``/mesh/members`` (the member's last change, so not limited by polling),
  pooled over trials (p50, p99), and the time until every survivor has; then the node is restarted
  and the next trial waits until every node sees it alive again. Any other member seen DEAD meanwhile
  counts as a false death.
* state propagation (``--sizes``): ``POST /workers`` (an address nobody listens on) to a random node,
  then ``DELETE`` it there. Per other node: the delta lag the mesh itself measured (the registry write
  on the origin -> its arrival there; ``/mesh/state`` ``recent_deltas``), and the time until the node
  lists it (or no longer does) as a client polling every 20 ms sees it, from the request's start.
* cache affinity (``--affinity-sizes``): a seeded multi-turn chat trace (shared system prompts, think
  time, answers appended) with every turn sent to a random node of N. A follow-up turn *reaches its
  prefix* when the engine that served it held the previous turn's whole prompt: its cached tokens (the
  usage the engine reports) cover the previous prompt's full 16-token blocks, one block of slack. The
  nodes do not subscribe to the engines' KV events unless ``--kv-events``: the prefix index is then
  what the routing decisions tell, replicated by the mesh (SMG's per-gateway trees are that, without
  the replication). With ``--baseline``, the same with N independent nodes (no mesh: each node knows
  its own decisions only; with ``--kv-events`` also what the engines report, to every node alike).

Simulation: ``bench/mesh_sim_bench.py`` (deterministic, simulated time: detection, propagation with
and without loss, false deaths under loss and pauses, gossip bytes per node) runs as a child process
and prints its own table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from shepherd.loadgen.benchmarks import Benchmark
from shepherd.loadgen.benchmarks.mesh_cluster import (
    MODEL,
    Cluster,
    Procs,
    Setup,
    Slot,
    get_json,
    http_request,
    wait_until,
)
from shepherd.loadgen.procs import ProcessFailed, free_port
from shepherd.loadgen.procstat import host_line
from shepherd.loadgen.stats import Distribution
from shepherd.loadgen.targets import REPO_ROOT, extract_tokenizer
from shepherd.loadgen.trace import Trace, TraceConfig, generate_trace
from shepherd.mesh.swim_types import SwimConfig
from shepherd.proto.engine_types import worker_id

SIM_SCRIPT = REPO_ROOT / "bench" / "mesh_sim_bench.py"


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="3,5,10", help="node counts for detection and propagation")
    p.add_argument("--affinity-sizes", default="1,3,8", help="node counts for cache affinity ('' for none)")
    p.add_argument("--crash-trials", type=int, default=3, help="crashes per size")
    p.add_argument("--prop-trials", type=int, default=5, help="worker adds (and removals) per size")
    p.add_argument("--engines", type=int, default=4, help="mock engines (every node routes to all)")
    p.add_argument("--users", type=int, default=24, help="affinity trace: users (one conversation each)")
    p.add_argument("--think-s", type=float, default=0.5, help="affinity trace: mean think time between turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="no-mesh rows")
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="nodes subscribe to the engines' KV events (default off: the index is the routing decisions')",
    )
    p.add_argument(
        "--probe-interval",
        type=float,
        default=None,
        help=f"mesh probe interval (default {SwimConfig().probe_interval:g} s; the probe timeout is half)",
    )
    p.add_argument(
        "--suspicion-mult",
        type=int,
        default=None,
        help=f"mesh suspicion multiplier (default {SwimConfig().suspicion_mult})",
    )
    p.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True, help="run the simulation")
    p.add_argument("--sim-args", default="--sizes 3,5,10,20", help="arguments of bench/mesh_sim_bench.py")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    p.add_argument("--log-dir", type=Path, help="keep process logs here (default: a removed temp dir)")


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


# ---- detection ---------------------------------------------------------------------------------------


@dataclass
class Detection:
    per_observer: list[float] = field(default_factory=list)
    all_seen: list[float] = field(default_factory=list)
    false_dead: int = 0


def _all_see_dead(
    cluster: Cluster, victim: Slot, others: list[Slot], t_kill: float, seen: dict[str, float], out: Detection
) -> bool:
    for s in others:
        if s.name in seen:
            continue
        ms = cluster.members(s)
        out.false_dead += sum(1 for k, m in ms.items() if k != victim.name and m["state"] == "dead")
        m = ms.get(victim.name)
        if m is not None and m["state"] == "dead":
            seen[s.name] = m["last_change"] - t_kill
    return len(seen) == len(others)


def measure_detection(cluster: Cluster, trials: int, rng: random.Random) -> Detection:
    out = Detection()
    for _ in range(trials):
        victim = rng.choice(cluster.slots[1:])
        others = [s for s in cluster.slots if s is not victim]
        t_kill = cluster.kill(victim)
        seen: dict[str, float] = {}
        wait_until(
            lambda: _all_see_dead(cluster, victim, others, t_kill, seen, out),  # noqa: B023 - called here
            f"every node to see {victim.name} dead",
            timeout=60,
            step=0.1,
        )
        out.per_observer += seen.values()
        out.all_seen.append(max(seen.values()))
        cluster.restart(victim)
    return out


# ---- propagation -------------------------------------------------------------------------------------


@dataclass
class Propagation:
    mesh_add: list[float] = field(default_factory=list)  # write on the origin -> arrival (the mesh's clock)
    client_add: list[float] = field(default_factory=list)  # POST start -> listed, per other node
    client_add_all: list[float] = field(default_factory=list)  # POST start -> listed everywhere
    mesh_remove: list[float] = field(default_factory=list)
    client_remove: list[float] = field(default_factory=list)
    client_remove_all: list[float] = field(default_factory=list)


async def _poll_until(
    session: aiohttp.ClientSession, port: int, url: str, present: bool, t0: float, timeout: float = 30.0
) -> float:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        async with session.get(f"http://127.0.0.1:{port}/workers") as r:
            ws = (await r.json())["workers"]
        if any(w["url"] == url for w in ws) == present:
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise RuntimeError(f"worker {url} never {'appeared' if present else 'left'} on port {port}")


async def _propagate(cluster: Cluster, origin: Slot, url: str, add: bool) -> list[float]:
    others = [s for s in cluster.slots if s is not origin]
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        if add:
            body = orjson.dumps({"url": url, "model_id": MODEL})
            async with session.post(f"http://127.0.0.1:{origin.http}/workers", data=body) as r:
                if r.status not in (200, 201, 202):
                    raise RuntimeError(f"POST /workers: HTTP {r.status}: {await r.text()}")
        else:
            async with session.delete(f"http://127.0.0.1:{origin.http}/workers", params={"url": url}) as r:
                if r.status not in (200, 202):
                    raise RuntimeError(f"DELETE /workers: HTTP {r.status}: {await r.text()}")
        return list(await asyncio.gather(*(_poll_until(session, s.http, url, add, t0) for s in others)))


def _mesh_lags(cluster: Cluster, origin: Slot, wid: str, op: str) -> list[float]:
    out = []
    for s in cluster.slots:
        if s is origin:
            continue
        rows = get_json(s.http, "/mesh/state")["recent_deltas"]
        lags = [
            r["lag_s"] for r in rows if r["worker"] == wid and r["op"] == op and r["writer"] == origin.name
        ]
        if lags:
            out.append(lags[-1])
    return out


def measure_propagation(cluster: Cluster, trials: int, rng: random.Random) -> Propagation:
    out = Propagation()
    for i in range(trials):
        origin = rng.choice(cluster.slots)
        url = f"grpc://127.0.0.1:{9 + i}"  # nobody listens there: registered, never healthy
        wid = worker_id(url)
        got = asyncio.run(_propagate(cluster, origin, url, True))
        out.client_add += got
        out.client_add_all.append(max(got))
        out.mesh_add += _mesh_lags(cluster, origin, wid, "add")
        got = asyncio.run(_propagate(cluster, origin, url, False))
        out.client_remove += got
        out.client_remove_all.append(max(got))
        out.mesh_remove += _mesh_lags(cluster, origin, wid, "remove")
    return out


# ---- cache affinity ----------------------------------------------------------------------------------


@dataclass
class Affinity:
    label: str
    nodes: int
    follow_ups: int = 0
    reached: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0

    @property
    def share(self) -> float:
        return self.reached / self.follow_ups if self.follow_ups else math.nan

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def affinity_trace(users: int, seed: int, think_s: float) -> Trace:
    cfg = TraceConfig(
        users=users,
        turns_min=3,
        turns_max=6,
        arrival_s=users * 0.25,
        think_s=think_s,
        think_max_s=4 * think_s,
        seed=seed,
    )
    return generate_trace(cfg)


async def replay_affinity(ports: Sequence[int], trace: Trace, seed: int, row: Affinity) -> None:
    rng = random.Random(seed)
    plan = {(c.user, i): rng.choice(ports) for c, i, _ in trace.turns()}
    t_start = time.monotonic()

    async def conversation(session: aiohttp.ClientSession, conv: Any) -> None:
        await asyncio.sleep(conv.start_s)
        messages = [{"role": "system", "content": trace.system_prompts[conv.system]}]
        prev_prompt = 0
        for i, turn in enumerate(conv.turns):
            if turn.think_s > 0:
                await asyncio.sleep(turn.think_s)
            messages.append({"role": "user", "content": turn.user_text})
            body = {"model": MODEL, "messages": messages, "max_tokens": turn.max_tokens, "ignore_eos": True}
            port = plan[(conv.user, i)]
            try:
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", data=orjson.dumps(body)
                ) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(str(data))
            except (aiohttp.ClientError, RuntimeError, TimeoutError):
                row.errors += 1
                return
            usage = data["usage"]
            prompt = int(usage["prompt_tokens"])
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if i > 0:
                row.follow_ups += 1
                row.prompt_tokens += prompt
                row.cached_tokens += cached
                if cached >= (prev_prompt // 16 - 1) * 16:
                    row.reached += 1
            prev_prompt = prompt
            messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        timeout=timeout, headers={"Content-Type": "application/json"}
    ) as session:
        await asyncio.gather(*(conversation(session, c) for c in trace.conversations))
    row.wall_s = time.monotonic() - t_start


def flush_engines(setup: Setup) -> None:
    for _, http_port in setup.engines:
        for _ in range(100):  # bounded: stragglers leave within seconds
            if http_request(http_port, "POST", "/mock/flush_cache")[0] == 200:
                break
            time.sleep(0.1)


def measure_affinity(
    setup: Setup, ports: Sequence[int], label: str, args: argparse.Namespace, n: int
) -> Affinity:
    flush_engines(setup)
    row = Affinity(label, len(ports))
    seed = args.seed + n
    asyncio.run(replay_affinity(ports, affinity_trace(args.users, seed, args.think_s), seed, row))
    return row


# ---- report ------------------------------------------------------------------------------------------


def _ms(d: Distribution) -> str:
    return f"{d.p50 * 1000:7.0f} {d.p99 * 1000:7.0f}" if d.count else f"{'-':>7} {'-':>7}"


def _s(d: Distribution) -> str:
    return f"{d.p50:6.2f} {d.p99:6.2f}" if d.count else f"{'-':>6} {'-':>6}"


def format_report(
    det: dict[int, Detection],
    prop: dict[int, Propagation],
    aff: Sequence[Affinity],
    probe: float,
    mult: int | None = None,
) -> str:
    lines = []
    if det:
        how = f"probe interval {probe:g} s" + (f", suspicion mult {mult}" if mult is not None else "")
        lines += [
            f"crash detection (SIGKILL; {how}): seconds from the kill to DEAD (bar: p50 <= 3, p99 <= 5)",
            f"{'N':>3} | {'per observer':>13} | {'all observers':>13} | {'samples':>7} | false DEAD",
            f"{'':>3} | {'p50':>6} {'p99':>6} | {'p50':>6} {'p99':>6} |",
        ]
        for n, d in det.items():
            per, al = Distribution.of(d.per_observer), Distribution.of(d.all_seen)
            lines.append(f"{n:>3} | {_s(per)} | {_s(al)} | {per.count:>7} | {d.false_dead}")
    if prop:
        lines += [
            "",
            "state propagation: a worker added / removed on one node; ms until the others have it",
            "  mesh = write on the origin -> arrival (the nodes' own delta lag); client = request start ->",
            "  listed (or gone) in GET /workers, polled every 20 ms; all = until every node",
            f"{'N':>3} | {'add mesh':>15} | {'add client':>15} | {'add all':>15} | "
            f"{'remove mesh':>15} | {'remove client':>15} | {'remove all':>15}",
            f"{'':>3} | " + " | ".join([f"{'p50':>7} {'p99':>7}"] * 6),
        ]
        for n, p in prop.items():
            cols = [
                p.mesh_add,
                p.client_add,
                p.client_add_all,
                p.mesh_remove,
                p.client_remove,
                p.client_remove_all,
            ]
            lines.append(f"{n:>3} | " + " | ".join(_ms(Distribution.of(c)) for c in cols))
    if aff:
        lines += [
            "",
            "cache affinity: every turn to a random node of N; share of follow-up turns served by the engine",
            "  that held the previous turn's prompt (cached tokens >= its full blocks - 1); hit = cached /",
            "  prompt tokens of the follow-ups (bar: >= 0.9 at N = 8; SMG: 0.66 with per-gateway trees)",
            f"{'target':<22} {'N':>3} | {'share':>6} | {'hit':>6} | {'follow-ups':>10} | {'errors':>6} | "
            "wall s",
        ]
        for a in aff:
            lines.append(
                f"{a.label:<22} {a.nodes:>3} | {a.share:6.3f} | {a.hit_rate:6.3f} | {a.follow_ups:>10} | "
                f"{a.errors:>6} | {a.wall_s:6.1f}"
            )
    return "\n".join(lines)


def run_sim(extra: str) -> int:
    if not SIM_SCRIPT.exists():
        print(f"(simulation skipped: {SIM_SCRIPT} not found: it lives in the repository)", flush=True)
        return 0
    print("", flush=True)
    return subprocess.run([sys.executable, str(SIM_SCRIPT), *extra.split()], check=False).returncode


def measure_real(
    args: argparse.Namespace,
    det: dict[int, Detection],
    prop: dict[int, Propagation],
    aff: list[Affinity],
) -> None:
    """Every real-process figure asked, into ``det``, ``prop`` and ``aff`` as they come."""
    sizes = _ints(args.sizes)
    aff_sizes = _ints(args.affinity_sizes)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="smg-bench-mesh-") as tmp:
        tmp_path = Path(tmp)
        log_dir = args.log_dir if args.log_dir is not None else tmp_path / "logs"
        with Procs(log_dir) as group:
            setup = Setup(
                group,
                extract_tokenizer(tmp_path / MODEL),
                tmp_path / "pki",
                [(free_port(), free_port()) for _ in range(args.engines)],
                args.probe_interval,
                args.kv_events,
                args.suspicion_mult,
            )
            _progress(f"starting {args.engines} mock engines ...")
            setup.start([setup.engine_spec(i) for i in range(args.engines)])
            cluster = Cluster(setup)
            for n in sorted(set(sizes) | set(aff_sizes)):
                _progress(f"N = {n}: starting nodes {len(cluster.slots)}..{n - 1} ...")
                cluster.grow(n)
                if n in aff_sizes:
                    _progress(f"N = {n}: cache affinity ...")
                    ports = [s.http for s in cluster.slots]
                    row = measure_affinity(setup, ports, "mesh", args, n)
                    aff.append(row)
                    _progress(f"N = {n}: share {row.share:.3f}, hit {row.hit_rate:.3f}")
                if n in sizes and n > 1:
                    _progress(f"N = {n}: propagation ({args.prop_trials} adds and removals) ...")
                    prop[n] = measure_propagation(cluster, args.prop_trials, rng)
                    _progress(f"N = {n}: crash detection ({args.crash_trials} crashes) ...")
                    det[n] = measure_detection(cluster, args.crash_trials, rng)
            if args.baseline:
                for s in cluster.slots:
                    if s.proc is not None:
                        s.proc.stop()
                for n in [k for k in aff_sizes if k > 1]:
                    _progress(f"no mesh: starting {n} independent nodes ...")
                    slots = [Slot(f"solo{i}", free_port(), 0) for i in range(n)]
                    procs = setup.start([setup.node_spec(s, [], meshed=False) for s in slots])
                    ports = [s.http for s in slots]
                    row = measure_affinity(setup, ports, "no mesh", args, n)
                    aff.append(row)
                    _progress(f"no mesh N = {n}: share {row.share:.3f}, hit {row.hit_rate:.3f}")
                    for p in procs:
                        p.stop()


def run(args: argparse.Namespace) -> int:
    sizes = _ints(args.sizes)
    aff_sizes = _ints(args.affinity_sizes)
    probe = args.probe_interval if args.probe_interval is not None else SwimConfig().probe_interval
    mult = args.suspicion_mult if args.suspicion_mult is not None else SwimConfig().suspicion_mult
    print(
        f"smg-bench mesh — {time.strftime('%Y-%m-%d %H:%M')}, {host_line()}\n"
        f"real smg-node processes on loopback (mesh sealed + mTLS, dev PKI), {args.engines} mock engines, "
        f"cache_aware, KV events {'on' if args.kv_events else 'off'}; one cluster grown through "
        f"N = {sorted(set(sizes) | set(aff_sizes))}",
        flush=True,
    )
    det: dict[int, Detection] = {}
    prop: dict[int, Propagation] = {}
    aff: list[Affinity] = []
    wall0 = time.monotonic()
    failed = ""
    try:
        measure_real(args, det, prop, aff)
    except (ProcessFailed, RuntimeError, OSError) as e:  # report what was measured before
        failed = str(e).strip()
    print("\n" + format_report(det, prop, aff, probe, mult), flush=True)
    print(f"(real processes: {time.monotonic() - wall0:.0f} s wall)", flush=True)
    if failed:
        print(f"stopped early: {failed}", flush=True)
    if args.json is not None:
        doc = {
            "benchmark": "mesh",
            "detection": {n: vars(d) for n, d in det.items()},
            "propagation": {n: vars(p) for n, p in prop.items()},
            "affinity": [{**vars(a), "share": a.share, "hit_rate": a.hit_rate} for a in aff],
        }
        args.json.write_text(json.dumps(doc, indent=2))
    code = 1 if failed else 0
    if args.sim:
        code = max(code, run_sim(args.sim_args))
    return code


BENCHMARK = Benchmark(
    name="mesh",
    help="the mesh on real nodes (crash detection, state propagation, cache affinity) and in simulation",
    add_arguments=add_arguments,
    run=run,
    in_all=False,
)
