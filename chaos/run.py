"""Run chaos scenarios and write a markdown report.

    python -m chaos.run list                              # the scenarios and what each must hold
    python -m chaos.run all --report chaos-report.md      # every scenario (~9 min on 2 cores)
    python -m chaos.run short                             # node crash, rolling restart, partition primitives
    python -m chaos.run node_crash engine_slow            # by name
    python -m chaos.run --inject DISABLE_MESH mesh_partition_2_1   # with a test-only fault in every node
    python -m chaos.run --prove-can-fail [NAME...]        # each mesh scenario with the fault it catches

Needs root, network namespaces and the packages of chaos/install.sh (``--install`` runs it first). Exit
status: 0 when every check held, 1 when one failed, 3 when the suite cannot run here (the reason is printed).
Scenarios that share a fleet shape run on one fleet, reset between them; every namespace and process is
removed on exit, also on failure or SIGTERM (leftovers of a killed run: ``python -m chaos.cleanup``).
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from chaos import scenarios
from chaos.fleet import Fleet, FleetSpec
from chaos.netns import unavailable_reason
from chaos.procs import faketime_lib
from chaos.report import ScenarioResult, render_markdown
from chaos.scenarios.base import Scenario
from chaos.scenarios.mesh import CATCHES
from shepherd.mesh import faults as node_faults

EXIT_UNAVAILABLE = 3
INSTALL_SCRIPT = Path(__file__).resolve().parent / "install.sh"


def missing_packages() -> list[str]:
    missing = [
        pkg
        for tool, pkg in (("ip", "iproute2"), ("iptables", "iptables"), ("haproxy", "haproxy"))
        if shutil.which(tool) is None
    ]
    if faketime_lib() is None:
        missing.append("libfaketime")
    return missing


def preflight() -> str | None:
    """Why the suite cannot run here, or None."""
    reason = unavailable_reason()
    if reason:
        return reason
    missing = missing_packages()
    if missing:
        return f"missing packages: {', '.join(missing)} (run chaos/install.sh as root)"
    return None


def install() -> None:
    subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True, timeout=600)


def select(names: Sequence[str]) -> list[Scenario]:
    if list(names) == ["all"]:
        return scenarios.ordered()
    if list(names) == ["short"]:
        return scenarios.short()
    unknown = [n for n in names if n not in scenarios.REGISTRY]
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(unknown)} (see: python -m chaos.run list)")
    return [scenarios.REGISTRY[n] for n in names]


def groups(selected: Sequence[Scenario]) -> list[tuple[FleetSpec, list[Scenario]]]:
    """Scenarios grouped by fleet shape, in order of first appearance (placeholders apart)."""
    out: list[tuple[FleetSpec, list[Scenario]]] = []
    for s in selected:
        for spec, members in out:
            if spec == s.spec:
                members.append(s)
                break
        else:
            out.append((s.spec, [s]))
    return out


def fleets_text(selected: Sequence[Scenario]) -> str:
    """The report header's fleet line: each fleet shape the selected scenarios ran on."""
    shapes = groups([s for s in selected if not s.todo])
    return "; ".join(
        f"{spec.nodes} nodes (smg-node, {spec.policy}) + {spec.engines} mock engines, HAProxy in front, "
        "one netns each" + (f" ({', '.join(s.name for s in members)})" if len(shapes) > 1 else "")
        for spec, members in shapes
    )


def run_one(fleet: Fleet, s: Scenario) -> ScenarioResult:
    result = ScenarioResult(s.name, s.title, "running")
    t0 = time.monotonic()
    print(f"chaos: {s.name}: {s.title}", flush=True)
    assert s.fn is not None
    try:
        s.fn(fleet, result)
    except Exception as e:
        result.status = "error"
        result.reason = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    result.duration_s = time.monotonic() - t0
    result.settle()
    failed = [c.name for c in result.checks if not c.ok]
    print(
        f"chaos: {s.name}: {result.status} in {result.duration_s:.1f} s"
        + (f"; failed: {failed}" if failed else ""),
        flush=True,
    )
    return result


def run_scenarios(
    selected: Sequence[Scenario],
    run_dir: Path,
    run_id: str,
    model_dir: str | None = "",
    policy: str = "",
    inject: str = "",
) -> list[ScenarioResult]:
    results: list[ScenarioResult] = []
    for group_index, (spec, members) in enumerate(groups(selected)):
        if model_dir != "":
            spec = replace(
                spec, model_dir=model_dir, chat_template=None if model_dir is None else spec.chat_template
            )
        if policy:
            spec = replace(spec, policy=policy)
        if inject:  # a test-only fault switch in every node (shepherd.mesh.faults)
            spec = replace(spec, node_env=(*spec.node_env, (node_faults.env_name(inject), "1")))
        runnable = [s for s in members if not s.todo]
        results.extend(ScenarioResult(s.name, s.title, "skipped", reason=s.todo) for s in members if s.todo)
        if not runnable:
            continue
        group_dir = run_dir / f"fleet-{group_index}"
        fleet: Fleet | None = None
        try:
            t0 = time.monotonic()
            fleet = Fleet(spec, group_dir, run_id=f"{run_id}{group_index % 10}").start()
            print(
                f"chaos: fleet of {spec.nodes} nodes, {spec.engines} engines up in "
                f"{time.monotonic() - t0:.1f} s (logs: {group_dir})",
                flush=True,
            )
            for i, s in enumerate(runnable):
                if i > 0:
                    fleet.reset()
                results.append(run_one(fleet, s))
        except Exception as e:  # the fleet could not be built or healed: the rest of the group cannot run
            traceback.print_exc()
            done = {r.name for r in results}
            results.extend(
                ScenarioResult(s.name, s.title, "error", reason=f"fleet: {type(e).__name__}: {e}")
                for s in runnable
                if s.name not in done
            )
        finally:
            if fleet is not None:
                fleet.close()
    order = {s.name: i for i, s in enumerate(selected)}
    return sorted(results, key=lambda r: order.get(r.name, 0))


def prove_can_fail(args: argparse.Namespace) -> int:
    """Each scenario with the fault it catches (``CATCHES``) injected into every node: 0 when every one
    failed (the suite sees each break), 1 when one passed anyway."""
    names = [n for n in args.scenarios if n != "all"] or list(CATCHES)
    unknown = [n for n in names if n not in CATCHES]
    if unknown:
        raise SystemExit(f"no fault is listed for: {', '.join(unknown)} (chaos.scenarios.mesh.CATCHES)")
    reason = preflight()
    if reason:
        print(f"chaos: cannot run here: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    signal.signal(signal.SIGTERM, _on_term)
    run_id = args.run_id or secrets.token_hex(2)[:3]
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"smgc-{run_id}-"))
    rows = []
    for i, name in enumerate(names):
        fault = CATCHES[name]
        print(f"chaos: {name} with {node_faults.env_name(fault)}=1: it must fail", flush=True)
        res = run_scenarios([scenarios.REGISTRY[name]], run_dir / f"inject-{i}", run_id, inject=fault)
        failed = [c.name for r in res for c in r.checks if not c.ok]
        why = "; ".join(failed) or "; ".join(f"{r.status}: {r.reason}" for r in res if not r.ok)
        caught = any(not r.ok for r in res)
        rows.append((name, fault, caught, why))
        print(f"chaos: {name} + {fault}: {'caught' if caught else 'NOT CAUGHT'} ({why})", flush=True)
    lines = ["| scenario | fault injected | caught | failed checks |", "|---|---|---|---|"]
    lines += [f"| {n} | {f} | {'yes' if c else 'NO'} | {w} |" for n, f, c, w in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        args.report.write_text("# Chaos suite: injected faults\n\n" + text)
    print(f"chaos: logs in {run_dir}")
    return 0 if all(c for _, _, c, _ in rows) else 1


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every fleet's close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n")[0])
    p.add_argument("scenarios", nargs="+", help="all | short | list | scenario names")
    p.add_argument("--report", type=Path, help="write the markdown report here")
    p.add_argument("--run-dir", type=Path, help="logs and configs (default: a new dir under /tmp)")
    p.add_argument(
        "--run-id", default=None, help="3 hex chars naming the namespaces smgc-<id>N-* (default: random)"
    )
    p.add_argument("--install", action="store_true", help="run chaos/install.sh first")
    p.add_argument(
        "--qwen3", action="store_true", help="the embedded qwen3 tokenizer instead of the small gpt2"
    )
    p.add_argument("--policy", default="", help="the nodes' routing policy (default: least_load)")
    p.add_argument("--keep-logs", action="store_true", help="keep the run dir even when everything passed")
    p.add_argument(
        "--inject",
        default="",
        choices=node_faults.KNOWN,
        metavar="FAULT",
        help=f"TEST-ONLY: start every node with this fault switched on ({', '.join(node_faults.KNOWN)})",
    )
    p.add_argument(
        "--prove-can-fail",
        action="store_true",
        help="run each named scenario (default: every one in chaos.scenarios.mesh.CATCHES) with the fault it "
        "catches injected; exit 0 only when every one of them failed",
    )
    args = p.parse_args(argv)
    if args.prove_can_fail:
        return prove_can_fail(args)

    if args.scenarios == ["list"]:
        for s in scenarios.ordered():
            tag = " [short]" if s.short else ""
            print(
                f"{s.name}{tag}: {s.title}\n    must hold: {s.must_hold}"
                + (f"\n    skipped: {s.todo}" if s.todo else "")
            )
        return 0
    selected = select(args.scenarios)
    if args.install:
        install()
    reason = preflight()
    if reason:
        print(f"chaos: cannot run here: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    signal.signal(signal.SIGTERM, _on_term)
    run_id = args.run_id or secrets.token_hex(2)[:3]
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"smgc-{run_id}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_scenarios(
        selected,
        run_dir,
        run_id,
        model_dir=None if args.qwen3 else "",
        policy=args.policy,
        inject=args.inject,
    )
    wall = time.monotonic() - t0
    header = {
        "command": "python -m chaos.run "
        + (f"--inject {args.inject} " if args.inject else "")
        + " ".join(args.scenarios),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
        "fleet": fleets_text(selected),
        "wall time": f"{wall:.0f} s",
        "logs": str(run_dir),
    }
    text = render_markdown(results, header)
    if args.report:
        args.report.write_text(text)
        print(f"chaos: report written to {args.report}")
    bad = [r for r in results if not r.ok]
    counts = {st: sum(r.status == st for r in results) for st in ("passed", "failed", "error", "skipped")}
    print(
        f"chaos: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
        f"{counts['skipped']} skipped in {wall:.0f} s"
    )
    if not bad and not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif bad:
        print(f"chaos: logs kept in {run_dir}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
