"""One measured run as a row, and rows as the plain-text table a benchmark prints."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shepherd.loadgen.client import LoadResult


@dataclass(frozen=True, slots=True)
class RunRow:
    """One (workload, target, concurrency) measurement. Times in ms, CPU in ms per OK request."""

    workload: str
    target: str
    concurrency: int
    ok: int
    window_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    gateway_cpu_ms: float  # NaN for the direct reference
    gateway_rss_mb: float
    gateway_processes: int
    engine_cpu_ms: float
    loadgen_cpu_ms: float
    errors: Mapping[str, int] = field(default_factory=dict)
    errors_outside_window: Mapping[str, int] = field(default_factory=dict)
    chunks_per_request: float = math.nan
    note: str = ""
    gateway_pss_mb: float = math.nan  # the tree's PSS: a forked worker's shared pages counted once
    output_tokens: float = 0.0  # tokens out per OK request (the answers' usage, else as asked); 0: unknown

    @property
    def gateway_cpu_us_per_token(self) -> float:
        return 1000.0 * self.gateway_cpu_ms / self.output_tokens if self.output_tokens else math.nan

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gateway_cpu_us_per_token"] = self.gateway_cpu_us_per_token
        for key, value in list(out.items()):
            if isinstance(value, float) and math.isnan(value):
                out[key] = None
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RunRow:
        """The row ``to_json`` wrote: its derived keys ignored, its Nones (NaN figures) read back as NaN;
        a field an older file lacks keeps its default."""
        kept: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in doc:
                kept[f.name] = math.nan if doc[f.name] is None else doc[f.name]
        return cls(**kept)


def row_from_result(
    workload: str,
    target: str,
    result: LoadResult,
    *,
    gateway_cpu_s: float | None,
    gateway_rss_kb: int | None,
    gateway_processes: int,
    engine_cpu_s: float | None,
    note: str = "",
    gateway_pss_kb: int | None = None,
    output_tokens: float = 0.0,
) -> RunRow:
    ok = result.ok
    if ok and result.completion_tokens:
        output_tokens = result.completion_tokens / ok

    def per_request(cpu_s: float | None) -> float:
        return 1000.0 * cpu_s / ok if cpu_s is not None and ok else math.nan

    return RunRow(
        workload=workload,
        target=target,
        concurrency=result.spec.concurrency,
        ok=ok,
        window_s=result.window_s,
        rps=result.rps,
        p50_ms=result.latency.p50 * 1000.0,
        p99_ms=result.latency.p99 * 1000.0,
        ttft_p50_ms=result.ttft.p50 * 1000.0,
        ttft_p99_ms=result.ttft.p99 * 1000.0,
        itl_p50_ms=result.itl.p50 * 1000.0,
        itl_p99_ms=result.itl.p99 * 1000.0,
        gateway_cpu_ms=per_request(gateway_cpu_s),
        gateway_rss_mb=gateway_rss_kb / 1024.0 if gateway_rss_kb is not None else math.nan,
        gateway_processes=gateway_processes,
        engine_cpu_ms=per_request(engine_cpu_s),
        loadgen_cpu_ms=per_request(result.loadgen_cpu_s),
        errors=dict(result.errors),
        errors_outside_window=dict(result.errors_outside_window),
        chunks_per_request=result.content_events / ok if ok and result.spec.stream else math.nan,
        note=note,
        gateway_pss_mb=gateway_pss_kb / 1024.0 if gateway_pss_kb is not None else math.nan,
        output_tokens=output_tokens,
    )


def fmt(value: float, digits: int = 2) -> str:
    if math.isnan(value):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits}f}"


def format_errors(errors: Mapping[str, int]) -> str:
    if not errors:
        return "0"
    return " ".join(f"{kind}:{n}" for kind, n in sorted(errors.items()))


COLUMNS = (
    "target",
    "conc",
    "req/s",
    "p50 ms",
    "p99 ms",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "gw CPU ms/req",
    "gw CPU us/tok",
    "gw RSS MB",
    "gw PSS MB",
    "eng CPU ms/req",
    "lg CPU ms/req",
    "errors",
)


def cells(row: RunRow) -> list[str]:
    target = row.target if row.gateway_processes <= 1 else f"{row.target} ({row.gateway_processes} procs)"
    return [
        target,
        str(row.concurrency),
        fmt(row.rps),
        fmt(row.p50_ms),
        fmt(row.p99_ms),
        fmt(row.ttft_p50_ms),
        fmt(row.ttft_p99_ms),
        fmt(row.itl_p50_ms, 3),
        fmt(row.itl_p99_ms, 3),
        fmt(row.gateway_cpu_ms, 3),
        fmt(row.gateway_cpu_us_per_token, 1),
        fmt(row.gateway_rss_mb, 1),
        fmt(row.gateway_pss_mb, 1),
        fmt(row.engine_cpu_ms, 3),
        fmt(row.loadgen_cpu_ms, 3),
        format_errors(row.errors) + (f" ({row.note})" if row.note else ""),
    ]


def format_table(rows: Sequence[RunRow]) -> str:
    """A fixed-width table; numeric columns right-aligned."""
    body = [cells(r) for r in rows]
    widths = [len(c) for c in COLUMNS]
    for line in body:
        widths = [max(w, len(c)) for w, c in zip(widths, line, strict=True)]

    def render(line: Sequence[str]) -> str:
        parts = []
        for i, (w, c) in enumerate(zip(widths, line, strict=True)):
            parts.append(c.ljust(w) if i in (0, len(widths) - 1) else c.rjust(w))
        return "  ".join(parts).rstrip()

    out = [render(COLUMNS), render(["-" * w for w in widths])]
    out.extend(render(line) for line in body)
    return "\n".join(out)
