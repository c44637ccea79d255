"""Two (or more) gateways measured at the same time, each with its own mock engine and load generator:
CPU per request side by side under the same host noise.

``smg-bench gateway`` measures its targets one after the other; on a shared 2-CPU machine the host's
speed drifts by 20-50 % over tens of seconds (every process's CPU per request moves together: gateway,
engine, load generator), so the ratio of two windows 15 s apart is only good to about +-15 % even with
``--rounds``. Here every side is a whole ``smg-bench gateway`` run (same arguments, started together, so
their windows line up), and the ratio of two sides is taken window by window: the drift cancels. Two
node variants of equal cost measured so agree within ~2 % a window (2026-12-03: 2.65/2.67, 2.90/2.86,
3.25/3.19 ms a request).

The price: the sides share the machine. With the default pinning every gateway runs on CPU 1 and every
engine and load generator on CPU 0, so each gateway's absolute CPU per request is higher than alone
(the other's wake-ups and caches): read the ratios, not the absolute figures. On a bigger host give each
side CPUs of its own (``--gateway-cpus`` / ``--engine-cpus`` in a side's ``args=``).

    .venv/bin/python bench/paired_bench.py -- --decode-ms-per-token 5 --prompt-tokens 2000 --turns 4 \\
        --max-tokens 64 --concurrency 32,128 --workloads stream --engine-steps batch --rounds 3
        # the node against smg (the default sides: node=node smg=smg)
    .venv/bin/python bench/paired_bench.py --side new=node --side old=node,tree=/tmp/old -- ...
        # this tree's node against another tree's (its C extensions built in place:
        # ``.venv/bin/python setup.py build_ext --inplace`` there)
    .venv/bin/python bench/paired_bench.py --side on=node,SHEPHERD_X=1 --side off=node -- ...
        # one tree, an environment variable apart

A side is ``NAME=TARGET[,KEY=VALUE...]``: ``TARGET`` is ``node``, ``smg`` or ``litellm``; ``tree=DIR`` runs
``smg-bench`` (and so the node) from that code tree (``PYTHONPATH``); ``python=PATH`` runs it under another
venv's interpreter (and so the node, engine and load generator it starts from that venv); ``args=...``
adds ``smg-bench gateway`` flags for that side alone (shell-split); any other ``KEY=VALUE`` is an
environment variable of the side's processes. The first side is compared with each other one. Everything
after ``--`` goes to every ``smg-bench gateway``; ``--targets``, ``--peers`` and ``--json`` are set here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shepherd.loadgen.benchmarks.gateway import ratio_lines
from shepherd.loadgen.report import RunRow, format_table

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("node", "smg", "litellm")


@dataclass(frozen=True)
class Side:
    name: str
    target: str
    env: Mapping[str, str]
    tree: Path | None = None
    args: tuple[str, ...] = ()
    python: str | None = None

    def command(self, common: Sequence[str], json_path: Path) -> list[str]:
        where = ["--targets", "node"] if self.target == "node" else ["--targets", "", "--peers", self.target]
        bench = [self.python or sys.executable, "-m", "shepherd.loadgen.cli", "gateway"]
        return [*bench, *common, *self.args, *where, "--json", str(json_path)]

    @property
    def root(self) -> Path:
        """The code tree: ``python -m`` puts the working directory first on the path, so run from it."""
        return self.tree or ROOT

    def environ(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = str(self.root)
        return env


def parse_side(spec: str) -> Side:
    """``NAME=TARGET[,KEY=VALUE...]`` (see the module's text)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"a side is NAME=TARGET[,KEY=VALUE...], not {spec!r}")
    target, *pairs = rest.split(",")
    if target not in TARGETS:
        raise ValueError(f"side {name!r}: the target is one of {', '.join(TARGETS)}, not {target!r}")
    env: dict[str, str] = {}
    tree: Path | None = None
    args: tuple[str, ...] = ()
    python: str | None = None
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"side {name!r}: {pair!r} is not KEY=VALUE")
        if key == "tree":
            tree = Path(value).resolve()
        elif key == "args":
            args = tuple(shlex.split(value))
        elif key == "python":
            python = value
        else:
            env[key] = value
    return Side(name, target, env, tree, args, python)


def check_names(sides: Sequence[Side]) -> None:
    """Each side's name labels its rows and its files: no two alike."""
    names = [s.name for s in sides]
    if len(set(names)) != len(names):
        raise ValueError(f"two sides of one name: {', '.join(names)}")


def load_rows(path: Path, name: str) -> list[RunRow]:
    """The rows of one ``smg-bench gateway --json`` file, their target renamed to the side's name."""
    data = json.loads(path.read_text())
    return [replace(RunRow.from_json(raw), target=name) for raw in data["rows"]]


def paired_report(ours: str, rows_by_side: Mapping[str, Sequence[RunRow]]) -> list[str]:
    """Per workload: every side's rows, then ``ours`` against each other side, window by window."""
    out: list[str] = []
    workloads = sorted({r.workload for rows in rows_by_side.values() for r in rows})
    for workload in workloads:
        merged = [r for rows in rows_by_side.values() for r in rows if r.workload == workload]
        out.append(f"== {workload}")
        out.append(format_table(merged))
        out.extend(ratio_lines(merged, ours=ours))
    return out


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # smg-bench stops what it started, by pid
    deadline = time.monotonic() + 60.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", action="append", default=[], help="NAME=TARGET[,KEY=VALUE...] (2 or more)")
    ap.add_argument("--log-dir", type=Path, help="keep each side's output here (default: a removed temp dir)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="stop every side after this many seconds")
    a = ap.parse_args(argv)
    try:
        sides = [parse_side(s) for s in (a.side or ["node=node", "smg=smg"])]
        if len(sides) < 2:
            raise ValueError("give two sides or more")
        check_names(sides)
    except ValueError as e:
        ap.error(str(e))
    for flag in ("--targets", "--peers", "--json"):
        if flag in common:
            ap.error(f"{flag} is set per side here")
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the sides too, as Ctrl-C does
    with tempfile.TemporaryDirectory(prefix="smg-paired-") as tmp:
        out_dir = (a.log_dir or Path(tmp)).resolve()  # (the sides run in their trees)
        out_dir.mkdir(parents=True, exist_ok=True)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for side in sides:
                log = (out_dir / f"{side.name}.txt").open("wb")
                procs.append(
                    subprocess.Popen(
                        side.command(common, out_dir / f"{side.name}.json"),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=side.environ(),
                        cwd=side.root,
                    )
                )
                log.close()
            deadline = time.monotonic() + a.timeout
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            print("stopped before the end", file=sys.stderr)
            return 1
        finally:
            _stop(procs)
        rows: dict[str, list[RunRow]] = {}
        failed = False
        for side, p in zip(sides, procs, strict=True):
            text = (out_dir / f"{side.name}.txt").read_text(errors="replace")
            if p.returncode != 0 or not (out_dir / f"{side.name}.json").exists():
                print(f"side {side.name} failed (exit {p.returncode}):\n{text[-2000:]}", file=sys.stderr)
                failed = True
                continue
            if not rows:
                print(text.splitlines()[0] if text else "")
            rows[side.name] = load_rows(out_dir / f"{side.name}.json", side.name)
        described = "; ".join(_describe(s) for s in sides)
        print(f"paired sides, at the same time: {described}")
        print("\n".join(paired_report(sides[0].name, rows)))
        return 1 if failed else 0


def _describe(side: Side) -> str:
    extra: list[str] = [f"{k}={v}" for k, v in side.env.items()]
    if side.tree is not None:
        extra.append(f"tree {side.tree}")
    if side.args:
        extra.append(shlex.join(side.args))
    if side.python is not None:
        extra.append(f"python {side.python}")
    return f"{side.name} = {side.target}" + (f" ({', '.join(extra)})" if extra else "")


if __name__ == "__main__":
    sys.exit(main())
