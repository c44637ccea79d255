"""Every node's membership view, polled in the background (``GET /mesh/members``), with each change stamped.

``MeshWatch`` runs one thread per active node inside the client namespace, each polling its node, and records
``(time, observer, member, state)`` whenever a node's view of a member changes (``state`` as the node reports
it: alive, suspect, dead, left; ``unreachable`` when the node did not answer). Scenarios read the history:
when a view first changed after a fault, when all views agreed, how often a view flipped.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import TracebackType

from chaos.fleet import Fleet, Member, http_call
from chaos.netns import enter_netns

ALIVE = "alive"
DOWN_STATES = frozenset({"suspect", "dead"})


@dataclass(frozen=True, slots=True)
class ViewChange:
    at: float
    observer: str
    member: str
    state: str


View = dict[str, dict[str, str]]  # observer -> member -> state


@dataclass
class MeshWatch:
    fleet: Fleet
    interval_s: float = 0.2
    timeout_s: float = 1.0  # of one poll
    max_s: float = 600.0
    changes: list[ViewChange] = field(default_factory=list)
    _view: View = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MeshWatch:
        self._thread = threading.Thread(target=self._run, name="smgc-meshwatch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """One poller per node, so that a node that does not answer (paused: each poll waits its timeout)
        does not slow down the polls of the others."""
        pollers = [
            threading.Thread(target=self._poll_node, args=(n,), name=f"smgc-meshwatch-{n.name}", daemon=True)
            for n in self.fleet.active_nodes()
        ]
        for t in pollers:
            t.start()
        for t in pollers:
            t.join(timeout=self.max_s + 10.0)

    def _poll_node(self, n: Member) -> None:
        enter_netns(self.fleet.client_ns)  # this thread's sockets live in the client namespace
        self._loop(n)

    def _loop(self, n: Member) -> None:
        t0 = time.monotonic()
        url = self.fleet.node_url(n) + "/mesh/members"
        while not self._stop.is_set() and time.monotonic() - t0 < self.max_s:
            status, body = http_call("GET", url, timeout=self.timeout_s)
            self.record(n.name, parse_members(body) if status == 200 else None, time.monotonic())
            self._stop.wait(self.interval_s)

    def record(self, observer: str, seen: dict[str, str] | None, now: float) -> None:
        """One poll of ``observer``'s view (None: it did not answer): stamp what changed."""
        with self._lock:
            old = self._view.get(observer, {})
            new = {m: "unreachable" for m in old} if seen is None else seen
            for member in sorted(set(old) | set(new)):
                state = new.get(member, "absent")
                if old.get(member) != state:
                    self.changes.append(ViewChange(now, observer, member, state))
            self._view[observer] = new

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def __enter__(self) -> MeshWatch:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- reading the views --------------------------------------------------------------------------

    def view(self) -> View:
        with self._lock:
            return {k: dict(v) for k, v in self._view.items()}

    def wait(self, pred: Callable[[View], bool], timeout: float) -> float | None:
        """Seconds until ``pred(view)`` held (polled at the watch's pace), or None on timeout."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if pred(self.view()):
                return round(time.monotonic() - t0, 3)
            time.sleep(self.interval_s / 2)
        return None

    def when(self, pred: Callable[[View], bool], after: float, until: float | None = None) -> float | None:
        """Seconds after ``after`` when ``pred`` first held on the views as recorded (replayed from the
        history; 0.0 if it held at ``after``), or None if it never did by ``until``."""
        view: View = {}
        changes = self.history(-math.inf, until)
        for c in changes:
            if c.at >= after:
                break
            view.setdefault(c.observer, {})[c.member] = c.state
        if pred(view):
            return 0.0
        for c in changes:
            if c.at >= after:
                view.setdefault(c.observer, {})[c.member] = c.state
                if pred(view):
                    return round(c.at - after, 3)
        return None

    def history(self, after: float, until: float | None = None) -> list[ViewChange]:
        with self._lock:  # pollers run in parallel: a change may be appended just after a later one
            out = [c for c in self.changes if c.at >= after and (until is None or c.at <= until)]
        return sorted(out, key=lambda c: c.at)

    def first(
        self,
        after: float,
        observers: Collection[str],
        member: str,
        states: Collection[str],
        until: float | None = None,
    ) -> float | None:
        """Seconds after ``after`` when one of ``observers`` first saw ``member`` in one of ``states``."""
        for c in self.history(after, until):
            if c.observer in observers and c.member == member and c.state in states:
                return round(c.at - after, 3)
        return None

    def all_saw(
        self,
        after: float,
        observers: Collection[str],
        member: str,
        states: Collection[str],
        until: float | None = None,
    ) -> float | None:
        """Seconds after ``after`` when the last of ``observers`` first saw ``member`` in ``states``."""
        times = [self.first(after, [o], member, states, until) for o in observers]
        if not times or any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)

    def marked_dead(self, after: float, until: float | None = None) -> set[tuple[str, str]]:
        """(observer, member) pairs where the observer declared the member dead in that window."""
        return {(c.observer, c.member) for c in self.history(after, until) if c.state == "dead"}

    def flips(self, after: float, until: float | None = None) -> int:
        """View changes between alive and not alive in that window (every observer, every member)."""
        return sum(1 for c in self.history(after, until) if c.state in DOWN_STATES or c.state == ALIVE)


def parse_members(body: object) -> dict[str, str] | None:
    members = body.get("members") if isinstance(body, dict) else body
    if not isinstance(members, list):
        return None
    out: dict[str, str] = {}
    for m in members:
        if isinstance(m, dict) and isinstance(m.get("name"), str):
            out[m["name"]] = str(m.get("state", "?")).lower()
    return out


def all_alive(names: Collection[str]) -> Callable[[View], bool]:
    """Every node in ``names`` answers and sees every node in ``names`` alive."""

    def pred(view: View) -> bool:
        return all(all(view.get(o, {}).get(m) == ALIVE for m in names) for o in names)

    return pred
