"""power_of_two and least_load: choices by load alone (engine-reported load plus own in-flight)."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded, load_key


class LeastLoad:
    """The least loaded worker; ties by KV token usage, then id."""

    name = "least_load"

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        return least_loaded(workers) if workers else None


class PowerOfTwo:
    """Two distinct workers sampled at random; the less loaded of the two."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if len(workers) <= 1:
            return workers[0] if workers else None
        a, b = self._rng.sample(range(len(workers)), 2)
        return min(workers[a], workers[b], key=load_key)
