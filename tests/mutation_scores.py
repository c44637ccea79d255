"""The mutation score per module from ``mutmut results --all true`` (``make mutate`` prints it).

    .venv/bin/mutmut results --all true | .venv/bin/python -m tests.mutation_scores [--only PATTERN...]

A line of mutmut's is ``    <module>.<function>__mutmut_<n>: <status>``; the score of a module is
killed / (every mutant but the ones no selected test reaches), with timeouts counted as killed (the mutant
made a test hang: it was detected). Exit status 1 when a module is under ``--goal`` (default 0.9).
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

KILLED = {"killed", "timeout"}
UNREACHED = {"no tests", "not checked", "skipped"}


def module_of(name: str) -> str:
    """``shepherd.mesh.swim_members.xǁMemberTableǁrefute__mutmut_3`` -> ``shepherd.mesh.swim_members``
    (the mangled function part has no dot)."""
    return name.split("__mutmut_", 1)[0].rsplit(".", 1)[0]


def scores(lines: Iterable[str], only: Sequence[str] = ()) -> dict[str, Counter[str]]:
    """Mutants per module, by status (only those whose name matches a pattern of ``only``, if given)."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name and (not only or any(fnmatch.fnmatch(name, p) for p in only)):
            out[module_of(name)][status] += 1
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--goal", type=float, default=0.9)
    p.add_argument("--only", nargs="*", default=[], help="mutant name patterns (fnmatch) to count")
    args = p.parse_args(argv)
    table = scores(sys.stdin, args.only)
    print("| module | mutants | killed | survived | not reached | score |")
    print("|---|---|---|---|---|---|")
    worst = 1.0
    for module, c in sorted(table.items()):
        killed = sum(v for k, v in c.items() if k in KILLED)
        unreached = sum(v for k, v in c.items() if k in UNREACHED)
        total = sum(c.values())
        judged = total - unreached
        score = killed / judged if judged else 0.0
        worst = min(worst, score)
        survived = judged - killed
        print(f"| {module} | {total} | {killed} | {survived} | {unreached} | {score:.1%} |")
    return 0 if table and worst >= args.goal else 1


if __name__ == "__main__":
    raise SystemExit(main())
