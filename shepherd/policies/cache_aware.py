"""cache_aware: route to the worker that holds the longest cached prefix, unless load says otherwise.

Semantics of SGLang's / SMG's cache_aware, with the same defaults (cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5):

1. Imbalanced system (max load - min load > abs threshold AND max > rel threshold * min): the least
   loaded worker, whatever the cache says.
2. Otherwise, the longest cached prefix among routable workers: if it covers no more than
   ``cache_threshold`` of the prompt, the least loaded worker ("miss").
3. Otherwise each worker costs its load (requests: running + waiting) plus, if it holds less of the
   prompt than the best holder, a *move* cost: ``move_base + missing_tokens / move_tokens_per_load``
   requests. The cheapest worker wins ("hit" if it holds the longest prefix, else "move").

Rule 3 is Shepherd's answer to the original's hot spots (docs/DESIGN.md §5): there, a hit always goes to the
holder, so every conversation under a shared system prompt lands on the engine that first cached
that prompt. Here a holder keeps a request only while it is not busier than another worker by more
than what re-prefilling the missing tokens costs: a new conversation (everyone may hold the system
prompt: nothing missing) goes to the least loaded of the holders, a second holder of a hot shared
prompt is seeded once its first holder is a few requests busier, and a long conversation (thousands
of tokens that only its holder has) stays put unless its holder is much busier.

Whatever is chosen is recorded in the prefix index: the chosen worker will hold the prompt's blocks.
``choose`` is the pure decision; ``CacheAware`` keeps one prefix index per model and a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded, load_key, worker_load
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig
from shepherd.policies.run_index import RunPrefixIndex


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # rule 3 (see the module docstring); tuned on ``smg-bench routing`` (4 engines, 1,169 requests): hit
    # rate 0.92-0.93 (always-to-the-holder: 0.933), busiest engine 1.06-1.27x the mean (that: 1.90x)
    move_base: float = 3.0  # requests of load a move must save at least
    move_tokens_per_load: float = 256.0  # and one more per this many tokens to prefill again
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerView
    reason: str  # "imbalanced" | "hit" | "miss" | "move"
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
    base, per = cfg.move_base, cfg.move_tokens_per_load

    def cost(w: WorkerView) -> tuple[float, int, tuple[int, float, str]]:
        have = matched.get(w.id, 0)
        move = 0.0 if have >= best else base + (best - have) / per
        return (worker_load(w) + move, -have, load_key(w))

    chosen = min(workers, key=cost)
    return Decision(chosen, "hit" if matched.get(chosen.id, 0) >= best else "move", best)


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
        """The model's prefix index (created on first use): feed KV events and mesh merges here. Its state
        in C where the extension is built (``NativePrefixIndex``), else the run layout (same answers)."""
        ix = self.indexes.get(model)
        if ix is None:
            layout = NativePrefixIndex if NATIVE_INDEX else RunPrefixIndex
            ix = self.indexes[model] = layout(self.config.index)
        return ix

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        ix = self.index(req.model)
        ids = req.input_ids
        matched = ix.match(ids)  # names the prompt once: the insert of the same ids reuses the names
        d = self.last = choose(workers, matched, len(ids), self.config)
        ix.insert(ids, d.worker.id, self.clock())
        return d.worker
