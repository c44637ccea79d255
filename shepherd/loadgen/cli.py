"""``smg-bench``: benchmarks that print a report (one subcommand per benchmark, plus ``all``)."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from shepherd.loadgen.benchmarks import Benchmark, registry


def _parser(benchmarks: dict[str, Benchmark]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smg-bench", description="Shepherd benchmarks (they print reports)")
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for bench in benchmarks.values():
        sp = sub.add_parser(bench.name, help=bench.help, description=bench.help)
        bench.add_arguments(sp)
    sub.add_parser(
        "all",
        help="every benchmark with its defaults: "
        + ", ".join(b.name for b in benchmarks.values() if b.in_all),
    )
    return p


def _defaults(bench: Benchmark) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"smg-bench {bench.name}")
    bench.add_arguments(p)
    return p.parse_args([])


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the process groups, which stop what they started


def main(argv: list[str] | None = None) -> None:
    benchmarks = registry()
    args = _parser(benchmarks).parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.benchmark == "all":
            code = 0
            for bench in benchmarks.values():
                if bench.in_all:
                    print(f"\n##### smg-bench {bench.name}", flush=True)
                    code = max(code, bench.run(_defaults(bench)))
        else:
            code = benchmarks[args.benchmark].run(args)
    except KeyboardInterrupt:
        print("\nsmg-bench: interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    main()
