"""What each event-loop callback of a node process runs, counted by distinct function: a site hook that
``bench/idle_bench.py --profile DIR`` puts on the node's ``PYTHONPATH`` (Python imports ``sitecustomize``
at start-up in every process that sees it: the node, its ``--procs`` children, the mock engine).

With ``SHEPHERD_IDLE_PROF=START:WINDOW:DIR`` set, a ``sys.setprofile`` hook counts, from START seconds
after the process started and for WINDOW seconds, every *entry* (a Python call made by the event loop
itself, from C: a callback, a protocol method, a task's step) by its function, the Python and C calls
each entry runs and the *distinct* functions among them, then writes ``DIR/prof-PID.txt`` and removes
itself. On these VMs an idle wake-up costs what its code touches after a sleep, from cold caches, so the
distinct functions per entry, times the entries a second, are what to cut (README "What an idle wake-up
costs"). The hook slows the process while it is installed (start-up included): read counts, not times.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from types import FrameType
from typing import Any

_SPEC = os.environ.get("SHEPHERD_IDLE_PROF", "")
_RUNNERS = "runners.py"  # asyncio.Runner.run: the Python frame under every callback the loop makes


class _Profile:
    def __init__(self, start: float, window: float, out_dir: str) -> None:
        self.t0 = time.monotonic() + start
        self.t1 = self.t0 + window
        self.out_dir = out_dir
        self.entry: str | None = None
        self.seen: set[str] = set()
        self.entries: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.distinct: collections.Counter[str] = collections.Counter()
        self.within: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def _count(self, name: str) -> None:
        entry = self.entry
        if entry is None:
            return
        self.calls[entry] += 1
        if name not in self.seen:
            self.seen.add(name)
            self.distinct[entry] += 1
            self.within[entry][name] += 1

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            back = frame.f_back
            if back is not None and back.f_code.co_filename.endswith(_RUNNERS):  # a new entry
                now = time.monotonic()
                if now > self.t1:
                    sys.setprofile(None)
                    self.entry = None
                    self.write()
                    return
                code = frame.f_code
                self.entry = (
                    f"{os.path.basename(code.co_filename)}:{code.co_name}" if now >= self.t0 else None
                )
                if self.entry is not None:
                    self.entries[self.entry] += 1
                    self.seen.clear()
            code = frame.f_code
            self._count(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        elif event == "c_call":
            self._count(f"C:{getattr(arg, '__qualname__', arg)}")

    def write(self) -> None:
        total = sum(self.entries.values()) or 1
        window = self.t1 - self.t0
        calls, distinct = sum(self.calls.values()), sum(self.distinct.values())
        lines = [
            f"argv {' '.join(sys.argv[:3])}",
            f"{total} entries in {window:g} s ({total / window:.1f}/s), {calls / total:.1f} calls and "
            f"{distinct / total:.1f} distinct functions per entry, {distinct / window:.0f} distinct-function "
            "runs a second",
        ]
        for name, k in self.entries.most_common(30):
            each = f"{self.calls[name] / k:.1f} calls, {self.distinct[name] / k:.1f} distinct each"
            lines.append(f"  {name}: {k / window:.2f}/s, {each}")
            lines.extend(f"      {n / k:5.2f} {fn}" for fn, n in self.within[name].most_common(150))
        path = os.path.join(self.out_dir, f"prof-{os.getpid()}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if _SPEC:
    _start, _window, _dir = _SPEC.split(":", 2)
    sys.setprofile(_Profile(float(_start), float(_window), _dir))
