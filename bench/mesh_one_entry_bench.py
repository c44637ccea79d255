"""Where a mesh's CPU goes: the routing trace sent to node 1 of an N-node mesh (no load balancer), each
node's process tree measured, so that the nodes serving nothing show what every node pays per request of
the cluster (SWIM, KV-event streams of every engine, load polls, health checks) and node 1 what serving
costs in a mesh (compare ``smg-bench routing --mesh 1`` on the same trace).

    .venv/bin/python bench/mesh_one_entry_bench.py                 # fleet shape, 600 requests, 3 nodes
    .venv/bin/python bench/mesh_one_entry_bench.py --mesh 2 --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shepherd.loadgen.benchmarks import routing
from shepherd.loadgen.procs import ProcessGroup, free_port
from shepherd.loadgen.procstat import TreeCpuTracker
from shepherd.loadgen.targets import extract_tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    routing.add_arguments(p)
    args = p.parse_args(["--shape", "fleet", "--requests", "600", "--mesh", "3", *sys.argv[1:]])
    trace = routing._trace_of(args)
    load = os.getloadavg()
    print(f"mesh_one_entry_bench — {time.strftime('%Y-%m-%d %H:%M')}, load average {load[0]:.2f}")
    print(f"trace: {trace.summary()}")
    with tempfile.TemporaryDirectory(prefix="smg-one-entry-") as tmp:
        tmp_path = Path(tmp)
        model_dir = extract_tokenizer(tmp_path / routing.MODEL)
        with ProcessGroup(tmp_path / "logs") as group:
            engines = [routing.EnginePorts(free_port(), free_port()) for _ in range(args.engines)]
            specs = [routing.engine_spec(i, e, args, model_dir) for i, e in enumerate(engines)]
            routing.start_engines(group, specs)
            nodes = routing.gateways("node", "cache_aware", engines, model_dir, [], args.mesh, tmp_path)
            procs = [group.start(s) for s in nodes]
            time.sleep(3.0)  # the mesh joins
            trackers = [TreeCpuTracker(proc.pid) for proc in procs]
            before = [t.sample(with_rss=False).cpu_seconds for t in trackers]
            samples, wall = asyncio.run(routing.replay(procs[0].spec.ready_port or 0, trace, args.timeout))
            after = [t.sample(with_rss=False).cpu_seconds for t in trackers]
            ok = sum(1 for s in samples if not s.error)
            print(f"{ok} requests ok in {wall:.0f} s (all to node 1)")
            print(f"{'node':<8} {'ms/req':>8} {'ms/s':>8}")
            for i, (a, b) in enumerate(zip(before, after, strict=True)):
                print(f"node-{i + 1:<3} {(b - a) * 1000 / max(1, ok):>8.2f} {(b - a) * 1000 / wall:>8.1f}")
            total = sum(b - a for a, b in zip(before, after, strict=True))
            print(f"{'all':<8} {total * 1000 / max(1, ok):>8.2f} {total * 1000 / wall:>8.1f}")
            for proc in procs:
                proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
