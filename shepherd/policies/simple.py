"""round_robin and random: the policies that need no load or cache state."""

from __future__ import annotations

import operator
import random as _random
from collections.abc import Callable, Sequence

from shepherd.policies.base import Policy, RouteRequest, WorkerView
from shepherd.policies.bucket import Bucket
from shepherd.policies.cache_aware import CacheAware, CacheAwareConfig
from shepherd.policies.hashing import ConsistentHashing, PrefixHash
from shepherd.policies.load import LeastLoad, PowerOfTwo
from shepherd.policies.manual import Manual

_by_id = operator.attrgetter("id")


class RoundRobin:
    """Cycles through workers in id order; the cursor is the only state, kept per model."""

    name = "round_robin"
    uses_loads = False

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        i = self._cursor.get(req.model, 0)
        self._cursor[req.model] = i + 1
        if len(workers) == 1:
            return workers[0]
        return sorted(workers, key=_by_id)[i % len(workers)]


class RandomPolicy:
    name = "random"
    uses_loads = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        return workers[self._rng.randrange(len(workers))]


POLICY_NAMES = (
    "random",
    "round_robin",
    "power_of_two",
    "least_load",
    "cache_aware",
    "prefix_hash",
    "consistent_hashing",
    "manual",
    "bucket",
)


def make_policy(
    name: str,
    *,
    seed: int | None = None,
    clock: Callable[[], float] | None = None,
    cache_aware: CacheAwareConfig | None = None,
) -> Policy:
    """A policy by its SGLang/SMG name, with the defaults users know. ``seed`` fixes the random
    choices (random, power_of_two, manual); ``clock`` is cache_aware's time source (default time.time),
    ``cache_aware`` its parameters (default: ``CacheAwareConfig()``)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy(seed)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(cache_aware) if clock is None else CacheAware(cache_aware, clock=clock)
    if name == "prefix_hash":
        return PrefixHash()
    if name == "consistent_hashing":
        return ConsistentHashing()
    if name == "manual":
        return Manual(seed=seed)
    if name == "bucket":
        return Bucket()
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
