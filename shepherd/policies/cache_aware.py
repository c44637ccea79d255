"""cache_aware: route to the worker that holds the longest cached prefix, unless load says otherwise.

Semantics of SGLang's / SMG's cache_aware, with the same defaults (cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5):

1. Imbalanced system (max load - min load > abs threshold AND max > rel threshold * min): the least
   loaded worker, whatever the cache says.
2. Otherwise, the longest cached prefix among routable workers: if it covers more than
   ``cache_threshold`` of the prompt, the least loaded of the workers holding it; else the least
   loaded worker.
3. Spill (Shepherd's addition against the hot spots the original creates): when that holder is hot
   (its load exceeds the least loaded worker's by ``spill_abs_threshold`` and by the factor
   ``spill_rel_threshold``), the least loaded worker takes the request, and thereby the prefix.

Whatever is chosen is recorded in the prefix index: the chosen worker will hold the prompt's blocks.
``choose`` is the pure decision; ``CacheAware`` keeps one prefix index per model and a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded, load_key, worker_load
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    spill_abs_threshold: int = 16
    spill_rel_threshold: float = 1.5
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerView
    reason: str  # "imbalanced" | "hit" | "miss" | "spill"
    matched_tokens: int  # the longest cached prefix among the routable workers


def _exceeds(load: int, base: int, abs_t: float, rel_t: float) -> bool:
    return load - base > abs_t and load > rel_t * base


def choose(
    workers: Sequence[WorkerView], matched: Mapping[str, int], n_tokens: int, cfg: CacheAwareConfig
) -> Decision:
    """The cache-aware decision over a snapshot: ``matched`` is the prefix index's answer (worker id ->
    cached prefix tokens), ``workers`` the routable workers (not empty)."""
    least = least_loaded(workers)
    lo = worker_load(least)
    hi = max(map(worker_load, workers))
    best = max((matched.get(w.id, 0) for w in workers), default=0)
    if _exceeds(hi, lo, cfg.balance_abs_threshold, cfg.balance_rel_threshold):
        return Decision(least, "imbalanced", best)
    if n_tokens <= 0 or best / n_tokens <= cfg.cache_threshold:
        return Decision(least, "miss", best)
    holder = min((w for w in workers if matched.get(w.id, 0) == best), key=load_key)
    if _exceeds(worker_load(holder), lo, cfg.spill_abs_threshold, cfg.spill_rel_threshold):
        return Decision(least, "spill", best)
    return Decision(holder, "hit", best)


class CacheAware:
    name = "cache_aware"

    def __init__(
        self, config: CacheAwareConfig | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or CacheAwareConfig()
        self.clock = clock
        self.indexes: dict[str, PrefixIndex] = {}
        self.last: Decision | None = None

    def index(self, model: str) -> PrefixIndex:
        """The model's prefix index (created on first use): feed KV events and mesh merges here."""
        ix = self.indexes.get(model)
        if ix is None:
            ix = self.indexes[model] = PrefixIndex(self.config.index)
        return ix

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        ix = self.index(req.model)
        ids = req.input_ids
        hs = ix.hashes(ids)
        blocks = ix.match_blocks(hs)
        matched = {w: n * 16 for w, n in blocks.items()}
        d = self.last = choose(workers, matched, len(ids), self.config)
        ix.insert_blocks(hs, d.worker.id, self.clock())
        return d.worker
