"""``smg-bench ratelimit``: mesh-wide rate limits, admitted ÷ limit per window.

Runs ``bench/ratelimit_bench.py`` twice: the deterministic simulation (3 nodes at 2x the limit: steady,
uneven, partitioned, lossy), then ``--target loopback`` (3 real meshed nodes on 127.0.0.1 and a mock
engine at 2x the limit: steady, then one node paused), unless ``--no-loopback``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from shepherd.loadgen.benchmarks import Benchmark

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "ratelimit_bench.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--loopback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run 3 real nodes on loopback (3-4 minutes)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per loopback scenario")


def run(a: argparse.Namespace) -> int:
    if not SCRIPT.is_file():
        print(f"smg-bench ratelimit: {SCRIPT} is missing (run from a source checkout)", file=sys.stderr)
        return 2
    rc = subprocess.run([sys.executable, str(SCRIPT)], check=False).returncode
    if a.loopback and rc == 0:
        cmd = [sys.executable, str(SCRIPT), "--target", "loopback", "--duration", str(a.duration)]
        rc = subprocess.run(cmd, check=False).returncode
    return rc


BENCHMARK = Benchmark(
    "ratelimit", "mesh-wide rate limits: admitted ÷ limit (simulation and 3 real nodes)", add_arguments, run
)
