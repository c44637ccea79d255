"""Hypothesis settings of the fuzz targets and their time budget.

Two profiles, chosen by ``SHEPHERD_FUZZ_PROFILE`` (default ``ci``):

- ``ci`` (``make test``): few examples per target, derandomized (the same examples on every run, so a
  failure in CI reproduces locally), no example database;
- ``fuzz`` (``make fuzz``): random examples in batches, repeated until the target's share of
  ``FUZZ_SECONDS`` (default 300, split evenly between the targets collected) is spent; failures are
  kept in Hypothesis' example database (``.hypothesis/``) and replayed first on the next run.

The profiles are applied per test (``settings(...)`` on each target), never loaded globally: the rest
of the suite keeps its own Hypothesis settings in the same pytest session.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, settings

PROFILE_ENV = "SHEPHERD_FUZZ_PROFILE"
SECONDS_ENV = "FUZZ_SECONDS"
DEFAULT_SECONDS = 300.0
FUZZ_BATCH = 500  # examples per Hypothesis run in the fuzz profile (runs repeat until the budget is spent)

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "shepherd-fuzz-ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "shepherd-fuzz-fuzz",
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=_QUIET,
)


def profile_name() -> str:
    name = os.environ.get(PROFILE_ENV, "ci").strip() or "ci"
    if name not in ("ci", "fuzz"):
        raise ValueError(f"{PROFILE_ENV} must be 'ci' or 'fuzz', not {name!r}")
    return name


def fuzzing() -> bool:
    return profile_name() == "fuzz"


def fuzz_settings(ci_examples: int) -> settings:
    """The settings of one target: ``ci_examples`` derandomized examples under ``ci``, a batch of
    ``FUZZ_BATCH`` random ones under ``fuzz`` (``run_bounded`` repeats batches)."""
    if fuzzing():
        return settings(settings.get_profile("shepherd-fuzz-fuzz"), max_examples=FUZZ_BATCH)
    return settings(settings.get_profile("shepherd-fuzz-ci"), max_examples=ci_examples)


def total_seconds() -> float:
    raw = os.environ.get(SECONDS_ENV, "")
    try:
        return max(1.0, float(raw)) if raw else DEFAULT_SECONDS
    except ValueError:
        raise ValueError(f"{SECONDS_ENV} must be a number of seconds, not {raw!r}") from None


@dataclass(frozen=True)
class Budget:
    """The wall-clock share of one fuzz target (only used by the ``fuzz`` profile)."""

    seconds: float


def run_bounded(check: Callable[[], None], budget: Budget) -> int:
    """Run a ``@given`` target: once under ``ci``; under ``fuzz``, batch after batch until its share of
    the time is spent (a bounded loop: at least one batch, then as many as fit). The number of runs."""
    if not fuzzing():
        check()
        return 1
    end = time.monotonic() + budget.seconds
    runs = 0
    while True:  # bounded by the deadline: each batch is a finite Hypothesis run
        check()
        runs += 1
        if time.monotonic() >= end:
            return runs
