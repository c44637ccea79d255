"""Python-level work per idle SWIM event, deterministically: Python and C calls (``sys.setprofile``) per
event (a datagram in or a timer tick) of three mesh runtimes with ``MeshState`` delegates on loopback
(uvloop, default SWIM timings), over a window after they converged and their join news went out.

    .venv/bin/python bench/mesh_idle_calls_bench.py                  # 10 s window, the state's tick too
    .venv/bin/python bench/mesh_idle_calls_bench.py --no-tick --top 30

Prints the calls per event, then per entry point (what the event loop called: ``datagram_received``,
``_on_timer``, push-pull connections) the calls and the *distinct* functions each entry runs (what an
idle wake-up costs on these VMs follows the distinct code it touches after a sleep, from cold caches:
README "What an idle wake-up costs"), and, with ``--top``, the functions called most per event;
``--distinct N`` lists, per entry point, the N distinct functions seen in most of its entries. Run
another tree's code with ``PYTHONPATH=/that/tree`` (from outside this one) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from shepherd.auth.certs import client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.policies.prefix_replica_native import make_replica


def _events(rts: list[MeshRuntime]) -> int:
    return sum(r.transport_metrics.udp_packets_in + r.metrics.ticks for r in rts)


async def run(window: float, settle: float, tick: bool, top: int, show_distinct: int) -> None:
    names = ["n1", "n2", "n3"]
    rts: list[MeshRuntime] = []
    with tempfile.TemporaryDirectory(prefix="mesh-calls-") as tmp:
        pki = write_dev_pki(Path(tmp), names)
        try:
            for n in names:
                st = MeshState(n, time.time, MeshStateConfig(first_hand=True), new_index=make_replica)
                seeds = (rts[0].address,) if rts else ()
                rt = MeshRuntime(
                    MeshRuntimeConfig(name=n, bind_host="127.0.0.1", bind_port=0, seeds=seeds),
                    Keyring([bytes(range(32))]),
                    server_context(pki[n]),
                    client_context(pki[n]),
                    st,
                    rng=random.Random(n),
                )
                await rt.start()
                rts.append(rt)
                if tick:  # as MeshNode's tick, on the runtime's wake-ups
                    rt.call_every(1.0, st.tick, slack=0.25)
            for _ in range(300):  # bounded: 30 s
                if all(sum(m.state == "alive" for m in r.members()) == len(names) for r in rts):
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("the three runtimes did not converge")
            await asyncio.sleep(settle)
            calls = 0
            depth = 0
            entry = "?"
            per_entry: collections.Counter[str] = collections.Counter()
            entries: collections.Counter[str] = collections.Counter()
            funcs: collections.Counter[str] = collections.Counter()
            seen: set[str] = set()  # the functions the current entry ran so far
            distinct: collections.Counter[str] = collections.Counter()  # per entry point, summed
            in_entries: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

            def once(name: str) -> None:
                if name not in seen:
                    seen.add(name)
                    distinct[entry] += 1
                    in_entries[entry][name] += 1

            def prof(frame: types.FrameType, event: str, arg: Any) -> None:
                nonlocal calls, depth, entry
                if event == "call":
                    if depth == 0:
                        entry = frame.f_code.co_name
                        entries[entry] += 1
                        seen.clear()
                    depth += 1
                    calls += 1
                    per_entry[entry] += 1
                    code = frame.f_code
                    name = f"{Path(code.co_filename).name}:{code.co_name}"
                    once(name)
                    if top:
                        funcs[name] += 1
                elif event == "return":
                    depth = max(0, depth - 1)
                elif event == "c_call":
                    calls += 1
                    per_entry[entry if depth else "(C, from the loop)"] += 1
                    name = f"C:{getattr(arg, '__qualname__', arg)}"
                    if depth:
                        once(name)
                    if top:
                        funcs[name] += 1

            ev0 = _events(rts)
            sys.setprofile(prof)
            try:
                await asyncio.sleep(window)
            finally:
                sys.setprofile(None)
            ev = max(1, _events(rts) - ev0)
            print(
                f"{ev} events in {window:g} s, {calls} calls, {calls / ev:.1f} calls per event, "
                f"{sum(distinct.values()) / ev:.1f} distinct functions per event"
            )
            for name, count in per_entry.most_common(8):
                k = max(1, entries.get(name, 0))
                print(f"  {name}: {k} entries, {count / k:.1f} calls, {distinct[name] / k:.1f} distinct each")
                for fn, seen_in in in_entries[name].most_common(show_distinct):
                    print(f"      {seen_in / k:5.2f} {fn}")
            for fname, count in funcs.most_common(top):
                print(f"  {count / ev:7.2f} {fname}")
        finally:
            for rt in rts:
                await rt.abort()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=float, default=10.0, help="profiled seconds (default 10)")
    p.add_argument("--settle", type=float, default=20.0, help="seconds after convergence (default 20)")
    p.add_argument("--no-tick", action="store_true", help="without the state's 1 s tick")
    p.add_argument("--top", type=int, default=0, help="the N functions called most per event")
    p.add_argument(
        "--distinct", type=int, default=0, help="per entry point, the N distinct functions in most entries"
    )
    args = p.parse_args()
    uvloop.run(run(args.window, args.settle, not args.no_tick, args.top, args.distinct))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
