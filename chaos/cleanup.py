"""Remove what a dead chaos run left behind: its network namespaces (``smgc-*``) and the processes inside.

    python -m chaos.cleanup                # every smgc-* namespace (no chaos run may be active)
    python -m chaos.cleanup --run-id 3f2   # only the namespaces of run 3f2 (smgc-3f2*)

Processes are found by namespace membership (``ip netns pids``), so only processes inside the suite's own
namespaces are signalled, each by pid: SIGCONT (a paused one), SIGTERM, then SIGKILL. Deleting a namespace
removes its veth ends, addresses and iptables rules.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence

from chaos.netns import PREFIX, delete_ns, list_namespaces, ns_pids


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str = PREFIX, grace_s: float = 3.0, verbose: bool = True) -> list[str]:
    """Stop the processes in every namespace named ``prefix*`` and delete those namespaces; returns them."""
    names = list_namespaces(prefix)
    pids = sorted({pid for ns in names for pid in ns_pids(ns) if pid != os.getpid()})
    if pids:
        if verbose:
            print(f"chaos.cleanup: stopping {len(pids)} processes: {pids}")
        _signal(pids, signal.SIGCONT)
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        _signal([p for p in pids if _alive(p)], signal.SIGKILL)
    for ns in names:
        delete_ns(ns)
    if verbose:
        print(f"chaos.cleanup: removed {len(names)} namespaces" + (f": {', '.join(names)}" if names else ""))
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.cleanup", description=__doc__.split("\n")[0])
    p.add_argument("--run-id", help="only this run's namespaces (smgc-<run-id>*)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos.cleanup: needs root", file=sys.stderr)
        return 1
    cleanup(f"{PREFIX}{args.run_id}" if args.run_id else PREFIX)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
