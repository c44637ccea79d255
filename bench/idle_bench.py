"""Idle CPU of a node: ms of CPU per second of wall time while no request comes, per configuration.

Starts one mock engine, then each configuration in turn (a plain node; a node with ``--procs 2``, whose
two processes mesh on loopback), lets it settle, and reads its process tree's CPU (/proc) over the
window. What an idle node still does: worker health checks and load polls, the tokenizer pool's
watchdog, metrics tickers; with a mesh also SWIM probes, gossip rounds and push-pull syncs.

    .venv/bin/python bench/idle_bench.py                       # 30 s windows
    .venv/bin/python bench/idle_bench.py --window 60 --configs "" "--procs 2" "--procs 4"
    .venv/bin/python bench/idle_bench.py --per-process --configs "--procs 3"   # and each process's

``--per-process`` adds a row per process of the tree: its CPU (the scheduler's run time of its threads,
``/proc/PID/task/*/schedstat``, in ns; ``/proc/PID/stat``'s 10 ms ticks where the kernel keeps no
schedstat) and its main thread's voluntary context switches per second (the event loop's wake-ups).
The tree's total stays on ``/proc/PID/stat`` (10 ms ticks: a 60 s window resolves 1/6 ms/s).

``--profile DIR`` runs the node's processes with ``bench/idle_profile/sitecustomize.py`` on their path:
each writes ``DIR/prof-PID.txt``, what its event loop's callbacks ran over the window (entries a second,
calls and distinct functions per entry, the functions). The hook slows them: their CPU figures then
mean nothing, the counts do.

    .venv/bin/python bench/idle_bench.py --settle 40 --window 60 --configs "--procs 3" --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shepherd.loadgen.procs import ProcessGroup, free_port
from shepherd.loadgen.procstat import TreeCpuTracker, host_line, read_run_ns, read_stat
from shepherd.loadgen.targets import extract_tokenizer, mock_engine_spec, node_spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=float, default=30.0, help="measured seconds (default 30)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds after ready before (default 15)")
    p.add_argument("--configs", nargs="+", default=["", "--procs 2"], help="smg-node serve flag strings")
    p.add_argument("--per-process", action="store_true", help="a row per process: ms/s and wake-ups/s")
    p.add_argument("--profile", type=Path, help="write each node process's callback profile here")
    args = p.parse_args()
    print(
        f"idle_bench — {time.strftime('%Y-%m-%d %H:%M')}, {host_line()}; "
        f"{args.window:g} s window after {args.settle:g} s"
    )
    print(f"{'node flags':<24} {'processes':>9} {'CPU ms/s':>9}")
    with tempfile.TemporaryDirectory(prefix="smg-idle-") as tmp, ProcessGroup(Path(tmp) / "logs") as group:
        model_dir = extract_tokenizer(Path(tmp) / "qwen3")
        grpc_port, http_port = free_port(), free_port()
        group.start(mock_engine_spec(grpc_port, http_port, cpus=None, model="qwen3", tokenizer_dir=model_dir))
        for flags in args.configs:
            spec = node_spec(free_port(), grpc_port, model_dir, cpus=None, extra=tuple(shlex.split(flags)))
            if args.profile is not None:
                spec = dataclasses.replace(spec, env={**spec.env, **_profile_env(args)})
            node = group.start(spec)
            time.sleep(args.settle)
            tracker = TreeCpuTracker(node.pid)
            start = tracker.sample(with_rss=False)
            before = {pid: _own(pid) for pid in start.live_pids}
            t0 = time.monotonic()
            time.sleep(args.window)
            end = tracker.sample(with_rss=False)
            wall = time.monotonic() - t0
            ms_per_s = 1000.0 * (end.cpu_seconds - start.cpu_seconds) / wall
            print(f"{flags or '(defaults)':<24} {len(end.live_pids):>9} {ms_per_s:>9.2f}", flush=True)
            if args.per_process:
                for pid, b in sorted(before.items()):
                    e = _own(pid)
                    if b is None or e is None:
                        continue
                    cpu, wakeups = 1000.0 * (e[0] - b[0]) / wall, (e[1] - b[1]) / wall
                    row = f"  pid {pid:<8} {e[2]:<16} {cpu:>7.2f} ms/s {wakeups:>7.1f} wake-ups/s"
                    print(row, flush=True)
            node.stop()
    return 0


def _profile_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment that loads the profile hook (``bench/idle_profile``) into the node's processes,
    counting over the window that follows the settling time (from each process's start)."""
    args.profile.mkdir(parents=True, exist_ok=True)
    hook = Path(__file__).resolve().parent / "idle_profile"
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "SHEPHERD_IDLE_PROF": f"{args.settle:g}:{args.window:g}:{args.profile.resolve()}",
    }


def _own(pid: int) -> tuple[float, int, str] | None:
    """A process's own CPU seconds (schedstat's ns where there, else stat's ticks), its main thread's
    voluntary context switches, its name."""
    st = read_stat(pid)
    if st is None:
        return None
    run_ns = read_run_ns(pid)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    switches = 0
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            switches = int(line.split()[1])
    return (st.cpu_seconds if run_ns is None else run_ns / 1e9), switches, st.comm


if __name__ == "__main__":
    raise SystemExit(main())
