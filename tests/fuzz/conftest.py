"""The fuzz targets' time budget: ``FUZZ_SECONDS`` split evenly between the targets collected (profiles.py).
Hypothesis profiles are registered by profiles.py and applied per test, never loaded for the session."""

from __future__ import annotations

import pytest

from tests.fuzz.profiles import Budget, total_seconds

_TARGETS = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_TARGETS] = sum(1 for it in items if "fuzz_budget" in getattr(it, "fixturenames", ()))


@pytest.fixture
def fuzz_budget(request: pytest.FixtureRequest) -> Budget:
    targets = max(1, request.config.stash.get(_TARGETS, 1))
    return Budget(total_seconds() / targets)
