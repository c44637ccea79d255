"""What every scenario uses: the registry, traffic through the load balancer, and a monitor of the fleet.

A scenario is a function ``fn(fleet, result)`` that injects faults into a running fleet while ``Traffic``
drives requests through the load balancer, then records checks (what must hold) and figures in ``result``.
A ``Scenario`` with a non-empty ``todo`` is a placeholder, listed and skipped with that reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from chaos.fleet import Fleet, FleetSpec
from chaos.lb import PANIC_SUFFIX
from chaos.loadgen import LoadGenerator, LoadSpec, RequestRecord
from chaos.report import ScenarioResult, routed_around_s, slow_threshold_s, summarize

ScenarioFn = Callable[[Fleet, ScenarioResult], None]

DEFAULT_SPEC = FleetSpec()
# What a node's RSS may grow by over one scenario: README "Chaos suite" states "node memory growth under
# 0.1 MB per scenario" (the largest of `make chaos` on 2026-11-29: 0.48 MB, the 5-node partition); the
# margin is 1.9 MB: one glibc heap trim threshold / a few pymalloc arenas kept by a burst of requests.
RSS_GROWTH_README_MB = 0.1
RSS_GROWTH_MARGIN_MB = 1.9
RSS_GROWTH_BOUND_MB = RSS_GROWTH_README_MB + RSS_GROWTH_MARGIN_MB
# Traffic flowed: the open-loop generator launches ``rate`` requests a second; at least this share of the
# launches due over the scenario must have been made (margin: the event loop's start and a busy 2-core
# machine's lag; the README's runs launch every one), and none may have been skipped at the in-flight cap.
LAUNCHED_MIN_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    fn: ScenarioFn | None
    spec: FleetSpec = DEFAULT_SPEC
    short: bool = False  # part of ``chaos.run short`` (the test suite's subset)
    todo: str = ""  # non-empty: a placeholder, skipped with this reason
    must_hold: str = ""


REGISTRY: dict[str, Scenario] = {}


def scenario(
    name: str, title: str, *, spec: FleetSpec = DEFAULT_SPEC, short: bool = False, must_hold: str = ""
) -> Callable[[ScenarioFn], ScenarioFn]:
    def register(fn: ScenarioFn) -> ScenarioFn:
        if name in REGISTRY:
            raise ValueError(f"scenario {name!r} registered twice")
        REGISTRY[name] = Scenario(name, title, fn, spec, short, must_hold=must_hold)
        return fn

    return register


# ---- the monitor: LB server states and node memory, sampled in the background ------------------------------


@dataclass
class Monitor:
    fleet: Fleet
    interval_s: float = 0.1
    rss_every: int = 10  # RSS every rss_every samples
    max_s: float = 900.0
    transitions: list[tuple[float, str, str]] = field(default_factory=list)  # (time, server, new status)
    requests: dict[str, int] = field(default_factory=dict)  # last stot seen per server
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Monitor:
        self._thread = threading.Thread(target=self._run, name="smgc-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last: dict[str, str] = {}
        t0 = time.monotonic()
        i = 0
        while not self._stop.is_set() and time.monotonic() - t0 < self.max_s:
            now = time.monotonic()
            stats = self.fleet.lb_stats()
            for name, st in stats.items():
                if name.endswith(PANIC_SUFFIX):
                    continue
                self.requests[name] = st.sessions_total
                if last.get(name) != st.status:
                    self.transitions.append((now, name, st.status))
                    last[name] = st.status
            if i % self.rss_every == 0:
                for n in self.fleet.nodes:
                    pid = n.proc.pid
                    rss = n.proc.rss()
                    # started up (RSS settled): seen ready, and in the pool (after a restart the balancer
                    # shows the old process UP a moment while the new one starts)
                    ready = n.proc.ready_start == n.proc.starts
                    in_pool = ready and n.name in stats and stats[n.name].status == "UP"
                    if pid is not None and rss is not None and in_pool:
                        self.fleet.rss_log.setdefault((n.name, pid), []).append((now, rss))
            i += 1
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def first(self, server: str, up: bool, after: float) -> float | None:
        """Seconds after ``after`` when HAProxy first showed ``server`` fully UP (or DOWN)."""
        want = "UP" if up else "DOWN"
        for t, name, status in self.transitions:
            if t >= after and name == server and status == want:
                return round(t - after, 3)
        return None


# ---- traffic ------------------------------------------------------------------------------------------


class Traffic:
    """Load through the LB plus the monitor, for the duration of a ``with`` block; on exit the traffic
    summary, the memory check and the timeline go into the result."""

    def __init__(
        self,
        fleet: Fleet,
        result: ScenarioResult,
        load: LoadSpec | None = None,
        rss_bound_mb: float = RSS_GROWTH_BOUND_MB,
    ) -> None:
        self.fleet = fleet
        self.result = result
        self.rss_bound_mb = rss_bound_mb
        self.load = load or LoadSpec(url=fleet.lb_url, model=fleet.spec.model_name)
        self.gen = LoadGenerator(self.load, netns=fleet.client_ns)
        self.monitor = Monitor(fleet)
        self.t0 = 0.0
        self.records: list[RequestRecord] = []

    def __enter__(self) -> Traffic:
        self.fleet.events.clear()
        self.monitor.start()
        self.gen.start()
        self.t0 = time.monotonic()
        return self

    def mark(self, what: str) -> float:
        return self.fleet.mark(what)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def baseline_slow_s(self, until: float) -> float:
        return slow_threshold_s([r for r in self.gen.snapshot() if r.start < until])

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stopped_at = time.monotonic()
        try:
            self.records = self.gen.stop()
        finally:
            self.monitor.stop()
        self.result.traffic = summarize(self.records, self.gen.skipped, self.gen.abandoned)
        started = self.gen.started_at or stopped_at
        check_traffic_flowed(
            self.result,
            launched=self.gen.launched,
            skipped=self.gen.skipped,
            due=self.load.rate * max(0.0, stopped_at - started),
        )
        self.result.timeline = [(round(t - self.t0, 2), what) for t, what in self.fleet.events]
        self.result.timeline += [
            (round(t - self.t0, 2), f"LB sees {name} {status}")
            for t, name, status in self.monitor.transitions
            if t >= self.t0
        ]
        self.result.timeline.sort()
        if exc_type is None:
            check_memory(self.fleet.rss_log, self.result, since=self.t0, bound_mb=self.rss_bound_mb)

    def routed_around(self, fault_at: float, slow_s: float, until: float | None = None) -> float | None:
        return routed_around_s(self.records, fault_at, slow_s, until)

    def requests_to(self, server: str) -> int:
        return self.monitor.requests.get(server, 0)


def check_traffic_flowed(result: ScenarioResult, launched: int, skipped: int, due: float) -> None:
    """The checks are not vacuous: requests were sent (at least ``LAUNCHED_MIN_SHARE`` of the ``due``
    launches) and none was skipped because the client's in-flight cap was reached."""
    result.figures["launched"] = launched
    result.figures["launches_due"] = round(due)
    result.check(
        f"traffic flowed: requests sent > 0 and >= {LAUNCHED_MIN_SHARE:.0%} of the launches due",
        launched > 0 and launched >= LAUNCHED_MIN_SHARE * due,
        f"launched {launched} of {due:.0f} due",
    )
    result.check(
        "no launch skipped at the client's in-flight cap", skipped == 0, f"skipped {skipped} launches"
    )


def check_memory(
    rss_log: dict[tuple[str, int], list[tuple[float, int]]],
    result: ScenarioResult,
    since: float = 0.0,
    bound_mb: float = RSS_GROWTH_BOUND_MB,
) -> None:
    """No node's RSS grows over the scenario (samples from ``since`` on, each node process from its first
    sample in the pool) by more than ``bound_mb``."""
    worst_growth = 0
    worst = ""
    peak = 0
    ok = True
    spans = []
    bound = int(bound_mb * 2**20)
    for (name, pid), all_samples in rss_log.items():
        samples = [s for s in all_samples if s[0] >= since]
        if len(samples) < 2:
            continue
        spans.append(samples[-1][0] - samples[0][0])
        first = samples[0][1]
        last = samples[-1][1]
        peak = max(peak, max(s[1] for s in samples))
        growth = last - first
        if growth > worst_growth:
            worst_growth, worst = growth, f"{name} (pid {pid})"
        if growth > bound:
            ok = False
    result.figures["node_rss_peak_mb"] = round(peak / 2**20, 1)
    result.figures["node_rss_growth_mb_max"] = round(worst_growth / 2**20, 2)
    result.figures["node_rss_watched_s"] = round(max(spans, default=0.0), 1)
    result.check(
        f"no node's memory grows by more than {bound_mb:g} MB over the scenario",
        ok and bool(spans),
        f"largest growth {worst_growth / 2**20:.2f} MB ({worst or '-'}), peak {peak / 2**20:.0f} MB"
        + ("" if spans else "; no node was sampled twice"),
    )
