"""cache_aware: route to the worker that holds the longest cached prefix, unless load says otherwise.

Semantics of SGLang's / SMG's cache_aware, with the same defaults (cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5), and Shepherd's answer to its hot spots:

1. Imbalanced system (max load - min load > abs threshold AND max > rel threshold * min): the least
   loaded worker, whatever the cache says.
2. **A new conversation** is placed by *expected load*: the engine's requests now (running + queued)
   plus ``conversation_weight`` times the conversations it is expected to keep serving (the
   conversations recently started on it, decayed with ``conversation_lifetime_s``), plus the shared
   prefix it lacks, paid once per engine (``missing tokens / shared_tokens_per_load``). A request is
   new when its longest cached prefix covers no more than ``cache_threshold`` of the prompt (a miss)
   or when that prefix is *shared*: its last block has already ended the match of
   ``shared_after`` other requests that went on differently (a system prompt many conversations
   share). A conversation's own history ends where only it goes on, so a follow-up is never new.
3. **A follow-up** (the match goes into the conversation's own history) costs each worker its load
   plus, where it holds less of the prompt than the best holder, a *move*:
   ``move_base + missing_tokens / move_tokens_per_load`` requests. The cheapest wins ("hit" if it
   holds the longest prefix, else "move"): a conversation stays unless its holder is busier than
   another worker by more than re-prefilling its history costs.

Why rule 2: the original sends every hit to the holder, so every conversation under a shared system
prompt lands on the engine that first cached that prompt, and engines that never received a system
prompt never become attractive while the others are below the balance thresholds (measured on a
multi-turn trace with three shared prompts: two of four engines got no request at all). Counting the
conversations an engine already carries spreads new ones over the whole fleet, each engine paying a
shared prompt once, while follow-ups keep their hits.

The classification is local to the policy (a bounded map of block name -> how many requests ended
their match there, ``max_tracked`` entries) and needs no new replicated state: in a mesh a node that
never saw a prefix end treats the match as history (sticky), the safe side; each node learns a shared
prompt after ``shared_after`` new conversations of its own.

Whatever is chosen is recorded in the prefix index: the chosen worker will hold the prompt's blocks.
``choose`` is the pure decision; ``CacheAware`` keeps one prefix index and one ``Placements`` per
model, and a clock.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded, load_key, worker_load
from shepherd.policies.native_index import NATIVE_INDEX, WORKER_LIMIT, NativePrefixIndex
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex, PrefixIndexConfig
from shepherd.policies.run_index import RunPrefixIndex


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # rule 3 (see the module docstring); tuned on ``smg-bench routing`` (4 engines, 1,169 requests): hit
    # rate 0.92-0.93 (always-to-the-holder: 0.933), busiest engine 1.06-1.27x the mean (that: 1.90x)
    move_base: float = 10.0  # requests of load a move must save at least
    move_tokens_per_load: float = 256.0  # and one more per this many tokens to prefill again
    # rule 2 (new conversations by expected load): see the module docstring
    conversation_weight: float = 1.0  # requests of load one carried conversation is worth
    conversation_lifetime_s: float = 60.0  # a placement's weight decays as exp(-age / this)
    shared_tokens_per_load: float = 512.0  # a missing shared prefix: one request of load per this many
    shared_after: int = 1  # a prefix end that ended this many other matches is shared
    max_tracked: int = 16384  # prefix ends remembered per model (oldest first out)
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.move_tokens_per_load <= 0 or self.shared_tokens_per_load <= 0:
            raise ValueError("tokens per load must be positive")
        if self.conversation_weight < 0 or self.conversation_lifetime_s <= 0:
            raise ValueError("conversation_weight must be >= 0 and conversation_lifetime_s > 0")
        if self.shared_after < 1 or self.max_tracked < 16:
            raise ValueError("shared_after must be >= 1 and max_tracked >= 16")


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerView
    reason: str  # "imbalanced" | "hit" | "miss" | "move" | "spread" (a new conversation on a shared prefix)
    matched_tokens: int  # the longest cached prefix among the routable workers


def _exceeds(load: int, base: int, abs_t: float, rel_t: float) -> bool:
    return load - base > abs_t and load > rel_t * base


def choose(
    workers: Sequence[WorkerView],
    matched: Mapping[str, int],
    n_tokens: int,
    cfg: CacheAwareConfig,
    *,
    shared: bool = False,
    carried: Mapping[str, float] | None = None,
) -> Decision:
    """The cache-aware decision over a snapshot: ``matched`` is the prefix index's answer (worker id ->
    cached prefix tokens), ``workers`` the routable workers (not empty), ``shared`` whether the longest
    match ends on a shared prefix, ``carried`` the conversations each worker is expected to keep
    serving (rule 2; absent: none)."""
    least = least_loaded(workers)
    lo = worker_load(least)
    hi = max(map(worker_load, workers))
    best = max((matched.get(w.id, 0) for w in workers), default=0)
    if _exceeds(hi, lo, cfg.balance_abs_threshold, cfg.balance_rel_threshold):
        return Decision(least, "imbalanced", best)
    if shared or n_tokens <= 0 or best / n_tokens <= cfg.cache_threshold:
        conv = carried or {}
        weight, per_shared = cfg.conversation_weight, cfg.shared_tokens_per_load

        def expected(w: WorkerView) -> tuple[float, int, tuple[int, float, str]]:
            have = matched.get(w.id, 0)
            cost = worker_load(w) + weight * conv.get(w.id, 0.0) + (best - have) / per_shared
            return (cost, -have, load_key(w))

        picked = min(workers, key=expected)
        return Decision(picked, "spread" if shared and best > 0 else "miss", best)
    base, per = cfg.move_base, cfg.move_tokens_per_load

    def cost(w: WorkerView) -> tuple[float, int, tuple[int, float, str]]:
        have = matched.get(w.id, 0)
        move = 0.0 if have >= best else base + (best - have) / per
        return (worker_load(w) + move, -have, load_key(w))

    chosen = min(workers, key=cost)
    return Decision(chosen, "hit" if matched.get(chosen.id, 0) >= best else "move", best)


class Placements:
    """Per model: which prefix ends are shared, and the conversations each worker carries (pure state,
    the caller's clock). Bounded: ``max_tracked`` prefix ends, one decayed figure per worker."""

    __slots__ = ("_carried", "_ends", "cfg")

    def __init__(self, cfg: CacheAwareConfig) -> None:
        self.cfg = cfg
        self._ends: dict[int, int] = {}  # block name -> matches that ended there (oldest first)
        self._carried: dict[str, tuple[float, float]] = {}  # worker -> (decayed count, as of)

    def is_shared(self, end: int) -> bool:
        return self._ends.get(end, 0) >= self.cfg.shared_after

    def ended(self, end: int) -> None:
        """A request's match ended at block ``end`` and the request went on past it."""
        ends = self._ends
        n = ends.pop(end, 0) + 1
        ends[end] = n  # re-inserted: the most recently seen ends are the last to go
        if len(ends) > self.cfg.max_tracked:
            drop = len(ends) - self.cfg.max_tracked * 3 // 4
            for k in list(itertools.islice(ends, drop)):
                del ends[k]

    def carried(self, now: float) -> dict[str, float]:
        tau = self.cfg.conversation_lifetime_s
        return {w: v * math.exp(-max(0.0, now - t) / tau) for w, (v, t) in self._carried.items()}

    def started(self, worker: str, now: float) -> None:
        """A new conversation was placed on ``worker``."""
        v, t = self._carried.get(worker, (0.0, now))
        self._carried[worker] = (
            v * math.exp(-max(0.0, now - t) / self.cfg.conversation_lifetime_s) + 1.0,
            now,
        )

    def forget(self, worker: str) -> None:
        self._carried.pop(worker, None)


class CacheAware:
    name = "cache_aware"
    text_affinity = True  # requests relayed to HTTP workers route by their text (``text_ids``)

    def __init__(
        self, config: CacheAwareConfig | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or CacheAwareConfig()
        self.clock = clock
        self.indexes: dict[str, PrefixIndex] = {}
        self.placements: dict[str, Placements] = {}
        self.last: Decision | None = None
        # called after each routing decision's index insert (the mesh flushes the delta it leaves)
        self.on_insert: Callable[[], None] | None = None

    @property
    def worker_limit(self) -> int | None:
        """Workers of one model this policy can index at most (the native layout's 64; None: no limit).
        The node refuses more (``WorkerRegistry.worker_limit``) rather than route some blind."""
        return WORKER_LIMIT if NATIVE_INDEX else None

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
        pl = self.placements.get(req.model)
        if pl is None:
            pl = self.placements[req.model] = Placements(self.config)
        ids = req.input_ids
        now = self.clock()
        matched = ix.match(ids)  # names the prompt once: the insert of the same ids reuses the names
        best = max((matched.get(w.id, 0) for w in workers), default=0)
        end = None
        if best and len(ids) >= best + BLOCK_TOKENS:  # the prompt goes on past its cached prefix
            end = ix.hashes(ids)[best // BLOCK_TOKENS - 1]
        shared = end is not None and pl.is_shared(end)
        d = self.last = choose(
            workers, matched, len(ids), self.config, shared=shared, carried=pl.carried(now)
        )
        if d.reason in ("spread", "miss"):
            pl.started(d.worker.id, now)
        if end is not None:
            pl.ended(end)
        ix.insert(ids, d.worker.id, now)
        if self.on_insert is not None:
            self.on_insert()
        return d.worker
