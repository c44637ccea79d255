"""round_robin and random: the policies that need no load or cache state."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from shepherd.policies.base import RouteRequest, WorkerView


class RoundRobin:
    """Cycles through workers in id order; the cursor is the only state, kept per model."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.id)
        i = self._cursor.get(req.model, 0)
        self._cursor[req.model] = i + 1
        return ordered[i % len(ordered)]


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        return workers[self._rng.randrange(len(workers))]


def make_policy(name: str) -> RoundRobin | RandomPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    raise ValueError(f"unknown policy {name!r}")
