"""Percentiles and distributions of the load generator."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.loadgen.stats import Distribution, percentile


def test_percentile_interpolates_between_ranks() -> None:
    data = [1.0, 2.0, 3.0, 4.0]
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 4.0
    assert percentile(data, 50) == pytest.approx(2.5)
    assert percentile(data, 25) == pytest.approx(1.75)


def test_percentile_of_one_and_none() -> None:
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_of_values() -> None:
    d = Distribution.of([0.003, 0.001, 0.002])
    assert d.count == 3
    assert d.p50 == pytest.approx(0.002)
    assert d.max == pytest.approx(0.003)
    assert d.mean == pytest.approx(0.002)
    ms = d.scaled(1000.0)
    assert ms.p50 == pytest.approx(2.0)
    assert ms.count == 3


def test_empty_distribution_is_nan() -> None:
    d = Distribution.of([])
    assert d.count == 0
    assert math.isnan(d.p99)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(min_value=0, max_value=100),
    st.floats(min_value=0, max_value=100),
)
def test_percentile_is_monotone_and_bounded(values: list[float], q1: float, q2: float) -> None:
    data = sorted(values)
    lo, hi = min(q1, q2), max(q1, q2)
    p_lo, p_hi = percentile(data, lo), percentile(data, hi)
    assert data[0] - 1e-6 <= p_lo <= p_hi + 1e-6
    assert p_hi <= data[-1] + 1e-6
