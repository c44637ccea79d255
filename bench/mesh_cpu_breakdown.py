"""Where a mesh's CPU per request goes: the routing bench's trace (``smg-bench routing --shape fleet``)
through one node, N meshed nodes behind HAProxy (round robin), or N meshed nodes with every request to
node 1, and per node and per process (the node's main process, its tokenizer workers) user and system
CPU per cluster request, the main thread's wake-ups a second (voluntary context switches), and the
nodes' ``/metrics`` counters that moved (token cache levels, engine hit rates); plus what one extra
subscriber of every engine's KV-event stream receives (batches, load-only records: what each node
consumes).

    .venv/bin/python bench/mesh_cpu_breakdown.py --mode rr       # 3 nodes behind HAProxy
    .venv/bin/python bench/mesh_cpu_breakdown.py --mode one      # 3 nodes, all to node 1
    .venv/bin/python bench/mesh_cpu_breakdown.py --mode single   # one node
    .venv/bin/python bench/mesh_cpu_breakdown.py --mode single --lb   # one node behind the same HAProxy
    .venv/bin/python bench/mesh_cpu_breakdown.py --mode one --idle 60   # no requests: 60 s idle
    .venv/bin/python bench/mesh_cpu_breakdown.py --mode rr --arrival-s 40   # the trace at a higher rate
    .venv/bin/python bench/mesh_cpu_breakdown.py --gateway smg --mode rr   # smg's own fleet (its mesh)

Idle (``--idle S``), an empty event loop (uvloop, as the node's) woken at every multiple of SWIM's probe
period of the same clock (the grid the nodes' probes fall on) runs beside the nodes over the same window:
the floor of what a process waking that often costs on this host at that moment, printed with the nodes'
figures (a host whose vCPUs sleep long charges each wake-up far more: only figures of one window compare).

Two code trees side by side (both runs at the same time, the same load): ``--tree DIR`` runs the nodes
and engines from DIR (``PYTHONPATH``; DIR holds a ``shepherd`` package with its built extensions).

``--profile DIR`` puts ``bench/idle_profile/sitecustomize.py`` on the nodes' path: each node process
writes ``DIR/prof-PID.txt``, what its event loop's callbacks ran (entries a second, calls and distinct
functions per entry) over the idle window (or the trace's first 120 s); the hook slows them, so their CPU
figures then mean nothing, the counts do:

    .venv/bin/python bench/mesh_cpu_breakdown.py --mode one --idle 90 --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
_VOL = re.compile(r"^voluntary_ctxt_switches:\s+(\d+)", re.M)
_SHOWN = re.compile(r"cache|pool|kv|render|hit_rate")
# the floor: an empty loop woken on the probe grid (``swim.grid_tick``: multiples of the period), 1 ms late
_FLOOR = """
import asyncio, math, sys
period = float(sys.argv[1])
try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
async def main():
    loop = asyncio.get_running_loop()
    while True:
        now = loop.time()
        await asyncio.sleep((math.floor(now / period + 1e-9) + 1) * period - now + 0.001)
asyncio.run(main())
"""


def _run_s(pid: int) -> float:
    """CPU time (s) of every thread of ``pid`` as the scheduler counts it (``schedstat``: nanoseconds,
    exact; ``stat``'s user and system are sampled at the clock tick, 10 ms steps that a process waking
    a few times a second hits or misses)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def _profile_env(out: Path, tree: str, idle: float) -> dict[str, str]:
    """The environment that loads ``bench/idle_profile`` into a node process: counting from 10 s after
    its start (ready, joined) over the idle window less that, or the trace's first 120 s."""
    out.mkdir(parents=True, exist_ok=True)
    hook = Path(__file__).resolve().parent / "idle_profile"
    window = max(5.0, idle - 5.0) if idle > 0 else 120.0
    return {"PYTHONPATH": f"{hook}{os.pathsep}{tree}", "SHEPHERD_IDLE_PROF": f"10:{window:g}:{out.resolve()}"}


def proc_info(pid: int) -> dict[str, Any] | None:
    """utime, stime and scheduler run time (s) and the main thread's voluntary context switches of one
    process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    except OSError:
        return None
    f = stat[stat.rindex(")") + 2 :].split()
    m = _VOL.search(status)
    return {
        "user": int(f[11]) / TICK,
        "sys": int(f[12]) / TICK,
        "run": _run_s(pid),
        "wakeups": int(m.group(1)) if m else 0,
    }


def snapshot(root: int, tree_pids: Any) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for pid in tree_pids(root):
        info = proc_info(pid)
        if info is not None:
            out[pid] = info
    return out


def metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, _, v = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[k] = float(v)
    return out


async def count_kv(engines: list[Any], counts: dict[str, int]) -> None:
    """One more subscriber of every engine's KV-event stream: what each node receives."""
    from shepherd.node.engines.h2 import H2EngineClient  # not at the top: after --tree is on sys.path

    async def one(e: Any) -> None:
        c = H2EngineClient(e.url, f"127.0.0.1:{e.grpc}")
        try:
            async for b in c.subscribe_kv_events(0):
                counts["records"] += 1
                if b.load_only:
                    counts["load_only"] += 1
                else:
                    counts["batches"] += 1
                    counts["events"] += len(b.events)
        finally:
            await c.close()

    await asyncio.gather(*(one(e) for e in engines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("rr", "one", "single"), default="rr")
    ap.add_argument("--mesh", type=int, default=3, help="nodes in the mesh (rr, one)")
    ap.add_argument(
        "--lb",
        action="store_true",
        help="single: the node behind rr's HAProxy (the same front path: only the mesh differs)",
    )
    ap.add_argument(
        "--gateway",
        choices=("node", "smg"),
        default="node",
        help="whose gateways: ours, or smg's (its own mesh; installed by bench/peers/setup.sh smg)",
    )
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument(
        "--arrival-s", type=float, default=None, help="users arrive over this window (shorter: a higher rate)"
    )
    ap.add_argument("--idle", type=float, default=0.0, help="no requests: measure this many seconds idle")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the code tree the nodes and engines run")
    ap.add_argument(
        "--node-args", default="", help="extra smg-node serve flags (one string, split on spaces)"
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--profile", type=Path, help="write each node process's callback profile here")
    a = ap.parse_args()
    tree = str(a.tree.resolve())
    os.environ["PYTHONPATH"] = tree
    sys.path.insert(0, tree)
    # not at the top: from the tree asked for (start-up)
    from shepherd.loadgen.benchmarks import routing
    from shepherd.loadgen.procs import ProcessGroup, ProcSpec, free_port
    from shepherd.loadgen.procstat import host_line, tree_pids
    from shepherd.loadgen.targets import extract_tokenizer
    from shepherd.mesh.swim_types import SwimConfig

    rp = argparse.ArgumentParser()
    routing.add_arguments(rp)
    argv = ["--shape", "fleet", "--requests", str(a.requests)]
    if a.arrival_s is not None:
        argv += ["--arrival-s", str(a.arrival_s)]
    args = rp.parse_args(argv)
    trace = routing._trace_of(args)
    n = 1 if a.mode == "single" else a.mesh
    load0 = os.getloadavg()
    behind_lb = a.mode == "rr" or (a.mode == "single" and a.lb)
    behind = " behind haproxy" if behind_lb and a.mode == "single" else ""
    print(
        f"mesh_cpu_breakdown {a.gateway} {a.mode}{behind} x{n}, tree {tree}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {host_line()}"
    )
    print(f"trace: {trace.summary()}")
    report: dict[str, Any] = {
        "gateway": a.gateway,
        "mode": a.mode,
        "lb": behind_lb,
        "nodes": n,
        "tree": tree,
        "per_node": [],
    }
    with tempfile.TemporaryDirectory(prefix="smg-mesh-cpu-") as tmp:
        tp = Path(tmp)
        model_dir = extract_tokenizer(tp / routing.MODEL)
        with ProcessGroup(tp / "logs") as group:
            engines = [routing.EnginePorts(free_port(), free_port()) for _ in range(args.engines)]
            routing.start_engines(
                group, [routing.engine_spec(i, e, args, model_dir) for i, e in enumerate(engines)]
            )
            extra = a.node_args.split()
            specs = routing.gateways(a.gateway, "cache_aware", engines, model_dir, extra, n, tp)
            if a.profile is not None:
                env = _profile_env(a.profile, tree, a.idle)
                specs = [dataclasses.replace(s, env={**s.env, **env}) for s in specs]
            procs = [group.start(s) for s in specs]
            port = procs[0].spec.ready_port or 0
            if behind_lb:
                lb = group.start(routing.lb_spec(free_port(), [s.ready_port or 0 for s in specs], tp))
                port = lb.spec.ready_port or 0
            floor = None
            if a.idle > 0:
                period = str(SwimConfig().probe_interval)
                floor = group.start(ProcSpec("floor", (sys.executable, "-c", _FLOOR, period)))
            time.sleep(3.0)  # the mesh joins
            ports = [p.spec.ready_port or 0 for p in procs]
            f0 = None if floor is None else proc_info(floor.pid)
            s0 = [snapshot(p.pid, tree_pids) for p in procs]
            m0 = [metrics(pt) for pt in ports]
            counts = {"records": 0, "load_only": 0, "batches": 0, "events": 0}

            async def run() -> tuple[int, float]:
                kv = asyncio.create_task(count_kv(engines, counts))
                try:
                    if a.idle > 0:
                        t0 = time.monotonic()
                        await asyncio.sleep(a.idle)
                        return 0, time.monotonic() - t0
                    samples, wall = await routing.replay(port, trace, args.timeout)
                    return sum(1 for s in samples if not s.error), wall
                finally:
                    kv.cancel()
                    with contextlib.suppress(BaseException):
                        await kv

            ok, wall = asyncio.run(run())
            s1 = [snapshot(p.pid, tree_pids) for p in procs]
            f1 = None if floor is None else proc_info(floor.pid)
            m1 = [metrics(pt) for pt in ports]
            load1 = os.getloadavg()
            per = max(1, ok)
            unit = "ms/req" if ok else "ms (idle)"
            print(f"{ok} requests ok in {wall:.0f} s; load average {load0[0]:.2f} -> {load1[0]:.2f}")
            print(
                f"KV-event stream, all engines, one subscriber: {counts} ({counts['records'] / wall:.1f}/s)"
            )
            total = total_run = 0.0
            for i, p in enumerate(procs):
                node_cpu = node_run = 0.0
                rows = []
                for pid, b in s1[i].items():
                    z = s0[i].get(pid, {"user": 0.0, "sys": 0.0, "run": 0.0, "wakeups": 0})
                    du, ds, dw = b["user"] - z["user"], b["sys"] - z["sys"], b["wakeups"] - z["wakeups"]
                    node_cpu += du + ds
                    node_run += b["run"] - z["run"]
                    kind = "main" if pid == p.pid else "worker"
                    rows.append({"process": kind, "user_s": du, "sys_s": ds, "wakeups_per_s": dw / wall})
                    print(
                        f"  node-{i + 1} {kind:<6} user {du * 1000 / per:6.2f} "
                        f"sys {ds * 1000 / per:6.2f} {unit}, main-thread wake-ups {dw / wall:6.1f}/s"
                    )
                total += node_cpu
                moved = {
                    k: v - m0[i].get(k, 0.0)
                    for k, v in m1[i].items()
                    if _SHOWN.search(k) and "bucket" not in k and v != m0[i].get(k, 0.0)
                }
                for k in sorted(moved):
                    print(f"    {k} {moved[k]:g}")
                print(
                    f"  node-{i + 1} total {node_cpu * 1000 / per:.2f} {unit}, "
                    f"{node_cpu * 1000 / wall:.1f} ms/s (schedstat {node_run * 1000 / wall:.2f} ms/s)"
                )
                total_run += node_run
                report["per_node"].append(
                    {"processes": rows, "cpu_s": node_cpu, "run_s": node_run, "metrics": moved}
                )
            print(f"all nodes {total * 1000 / per:.2f} {unit}")
            if f0 is not None and f1 is not None:
                f_run = f1["run"] - f0["run"]
                f_wake = (f1["wakeups"] - f0["wakeups"]) / wall
                node_avg = total_run / len(procs)
                print(
                    f"floor (schedstat): an empty loop woken on the grid {f_run * 1000 / wall:.2f} ms/s "
                    f"at {f_wake:.1f} wake-ups/s ({f_run * 1e6 / max(1.0, f_wake * wall):.0f} us each); "
                    f"a node {node_avg * 1000 / wall:.2f} ms/s ({node_avg / max(f_run, 1e-9):.1f}x the floor)"
                )
                report["floor"] = {"run_s": f_run, "wakeups_per_s": f_wake}
            report.update(ok=ok, wall_s=wall, load=[load0[0], load1[0]], kv_stream=counts, cpu_s=total)
            for proc in reversed(procs):
                proc.stop()
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
