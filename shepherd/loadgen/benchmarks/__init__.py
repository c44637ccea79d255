"""The benchmarks ``smg-bench`` knows, one module each.

A benchmark module defines ``BENCHMARK = Benchmark(...)``: a name (the subcommand), a help line,
``add_arguments(parser)`` and ``run(args) -> exit code``. To add one, write the module and list it
in ``MODULES``; ``smg-bench all`` runs, with their defaults, those whose ``in_all`` is true. A
benchmark's helpers live next to it, outside ``MODULES`` (``mesh_cluster``: the processes of ``mesh``).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass

MODULES = (
    "shepherd.loadgen.benchmarks.gateway",
    "shepherd.loadgen.benchmarks.routing",
    "shepherd.loadgen.benchmarks.routing_sim",
    "shepherd.loadgen.benchmarks.mesh",
    "shepherd.loadgen.benchmarks.mesh_scale",
    "shepherd.loadgen.benchmarks.ratelimit",
)


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    in_all: bool = True


def registry() -> dict[str, Benchmark]:
    """Every benchmark by name, in ``MODULES`` order."""
    out: dict[str, Benchmark] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        bench = module.BENCHMARK
        if not isinstance(bench, Benchmark):
            raise TypeError(f"{module_name}.BENCHMARK is not a Benchmark")
        if bench.name in out or bench.name == "all":
            raise ValueError(f"duplicate benchmark name {bench.name!r}")
        out[bench.name] = bench
    return out
