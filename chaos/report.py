"""Figures of a scenario (traffic summary, fault timings, memory) and the markdown report (pure functions)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chaos.loadgen import RequestRecord

Figure = float | int | str | None


@dataclass(frozen=True, slots=True)
class TrafficSummary:
    sent: int
    succeeded: int
    failed: int
    retried_ok: int  # the first attempt failed, the retry succeeded
    skipped: int  # launches not made because the client's in-flight cap was reached
    errors: dict[str, int]  # final errors of failed requests
    first_errors: dict[
        str, int
    ]  # errors of first attempts (hidden from the user by the retry when it worked)
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @property
    def lost(self) -> int:
        return self.failed


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (q in [0, 100])."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_ms(records: Sequence[RequestRecord], q: float) -> float | None:
    """The q-th percentile latency (ms) of the successful requests among ``records``."""
    v = percentile(sorted(r.latency_s * 1000.0 for r in records if r.ok), q)
    return None if v is None else round(v, 1)


def summarize(records: Sequence[RequestRecord], skipped: int = 0, abandoned: int = 0) -> TrafficSummary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    lat = sorted(r.latency_s * 1000.0 for r in ok)
    errors = Counter(r.error or "?" for r in failed)
    if abandoned:
        errors["abandoned_at_stop"] += abandoned
    p50 = percentile(lat, 50)
    p99 = percentile(lat, 99)
    return TrafficSummary(
        sent=len(records) + abandoned,
        succeeded=len(ok),
        failed=len(failed) + abandoned,
        retried_ok=sum(1 for r in ok if r.first_error is not None),
        skipped=skipped,
        errors=dict(errors),
        first_errors=dict(Counter(r.first_error for r in records if r.first_error is not None)),
        p50_ms=None if p50 is None else round(p50, 1),
        p99_ms=None if p99 is None else round(p99, 1),
        max_ms=None if not lat else round(lat[-1], 1),
    )


def affected(record: RequestRecord, slow_s: float) -> bool:
    """A request the fault touched: its first attempt failed, or it took longer than ``slow_s``."""
    return record.first_error is not None or record.latency_s > slow_s


def routed_around_s(
    records: Sequence[RequestRecord], fault_at: float, slow_s: float, until: float | None = None
) -> float | None:
    """Seconds from the fault until the last request that the fault touched was *started* (after that,
    requests went around it); 0.0 when no request was touched. Only requests started in
    [fault_at, until) count."""
    end = math.inf if until is None else until
    starts = [r.start for r in records if fault_at <= r.start < end and affected(r, slow_s)]
    if not starts:
        return 0.0
    return round(max(starts) - fault_at, 3)


def slow_threshold_s(baseline: Sequence[RequestRecord], floor_s: float = 0.5) -> float:
    """What counts as slow: 3x the baseline p99 latency, at least ``floor_s``."""
    lat = sorted(r.latency_s for r in baseline if r.ok)
    p99 = percentile(lat, 99)
    return max(floor_s, 3.0 * p99) if p99 is not None else floor_s


@dataclass(frozen=True, slots=True)
class Check:
    """Something that must hold, and whether it did."""

    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    """Figures that read better as rows (e.g. admitted / limit per window and per side)."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[Figure, ...], ...]


@dataclass
class ScenarioResult:
    name: str
    title: str
    status: str  # passed | failed | skipped | error
    reason: str = ""
    duration_s: float = 0.0
    traffic: TrafficSummary | None = None
    figures: dict[str, Figure] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (seconds since load start, event)
    tables: list[Table] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped")

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def settle(self) -> None:
        """passed/failed from the checks (unless already skipped or errored)."""
        if self.status in ("skipped", "error"):
            return
        self.status = "passed" if all(c.ok for c in self.checks) else "failed"


def _fmt(value: Figure) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _errors(errs: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(errs.items(), key=lambda kv: -kv[1])) or "-"


def render_markdown(results: Sequence[ScenarioResult], header: Mapping[str, str]) -> str:
    lines = ["# Shepherd chaos report", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += [
        "",
        "## Summary",
        "",
        "| scenario | status | sent | ok | failed (why) | retried ok | p50 ms | p99 ms | routed around s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r.traffic
        if t is None:
            lines.append(f"| {r.name} | {r.status} | - | - | - | - | - | - | - |")
            continue
        routed = r.figures.get("routed_around_s")
        lines.append(
            f"| {r.name} | {r.status} | {t.sent} | {t.succeeded} | {t.failed} ({_errors(t.errors)}) | "
            f"{t.retried_ok} | {_fmt(t.p50_ms)} | {_fmt(t.p99_ms)} | {_fmt(routed)} |"
        )
    for r in results:
        lines += [
            "",
            f"## {r.name}: {r.title}",
            "",
            f"Status: **{r.status}**" + (f" ({r.reason})" if r.reason else ""),
        ]
        lines.append(f"Duration: {r.duration_s:.1f} s")
        if r.traffic is not None:
            t = r.traffic
            lines += [
                "",
                f"Traffic: sent {t.sent}, succeeded {t.succeeded}, failed {t.failed} ({_errors(t.errors)}), "
                f"first attempts failed {sum(t.first_errors.values())} ({_errors(t.first_errors)}), "
                f"skipped by the client cap {t.skipped}; latency p50 {_fmt(t.p50_ms)} ms, "
                f"p99 {_fmt(t.p99_ms)} ms, max {_fmt(t.max_ms)} ms.",
            ]
        if r.figures:
            lines += ["", "| figure | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in r.figures.items()]
        for tab in r.tables:
            lines += ["", f"{tab.title}:", "", "| " + " | ".join(tab.header) + " |"]
            lines.append("|" + "---|" * len(tab.header))
            lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in tab.rows]
        if r.checks:
            lines += ["", "Checks:"]
            lines += [
                f"- [{'x' if c.ok else ' '}] {c.name}" + (f": {c.detail}" if c.detail else "")
                for c in r.checks
            ]
        if r.timeline:
            lines += ["", "Timeline (s since the load started):"]
            lines += [f"- {t:7.2f} {what}" for t, what in r.timeline]
    lines.append("")
    return "\n".join(lines)
