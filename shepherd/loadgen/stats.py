"""Summary statistics of latency samples: percentiles and distributions.

Percentiles use linear interpolation between closest ranks (numpy's default, "type 7"), so p50 of
``[1, 2]`` is 1.5 and every percentile of a single sample is that sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of already sorted values; NaN when there are none."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile out of range: {q}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    if n == 1:
        return float(sorted_values[0])
    rank = (n - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, n - 1)
    frac = rank - lo
    low = float(sorted_values[lo])
    return low + (float(sorted_values[hi]) - low) * frac


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean and the usual percentiles of one kind of sample (seconds, unless stated)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values: Iterable[float]) -> Distribution:
        data = sorted(values)
        if not data:
            return EMPTY
        return Distribution(
            count=len(data),
            mean=math.fsum(data) / len(data),
            p50=percentile(data, 50.0),
            p90=percentile(data, 90.0),
            p99=percentile(data, 99.0),
            max=float(data[-1]),
        )

    def scaled(self, factor: float) -> Distribution:
        """The same distribution in other units (e.g. ``1000.0`` for milliseconds)."""
        return Distribution(
            count=self.count,
            mean=self.mean * factor,
            p50=self.p50 * factor,
            p90=self.p90 * factor,
            p99=self.p99 * factor,
            max=self.max * factor,
        )


EMPTY = Distribution(count=0, mean=math.nan, p50=math.nan, p90=math.nan, p99=math.nan, max=math.nan)
