"""``NativePrefixIndex``: the prefix index with its state in C (``_prefixcore.c``), what ``cache_aware``
routes with on a node where the extension is built (``NATIVE_INDEX``).

Same API, replicated state and invariants as ``PrefixIndex`` (the pure-Python reference: the property
tests run every layout through the same checks and hold this one to the flat layout's state, entry for
entry). What differs is the cost: a match is a binary search over the chain in C, an insert touches
each block of the prompt in C (one probe in an open-addressing table, an LRU move); a 1,300-token
follow-up costs a few µs instead of the Python layouts' 15-30 (``bench/prefix_index_bench.py``), and a
live block about 100 bytes.

Eviction is exact LRU per worker (one list per worker, most recent first; the blocks of one insert are
ordered so the deeper ones go first on equal times, so what a worker keeps of a chain stays a prefix).
Entries that arrive by ``merge`` keep their own times and are placed by them, exactly among the 64 most
recent entries, at the tail when older than all, approximately in between.

Limits: block names are 64-bit (every name ``block_hashes`` makes is); a name outside that range is never
held (``match_blocks``, ``remove_blocks``, ``holders`` and ``merge`` skip it, ``insert_blocks`` raises
``OverflowError``).
At most ``WORKER_LIMIT`` (64) workers per index (per model) at once: a mask of 64 bits per block is the
layout. The node enforces it where workers come in (``CacheAware.worker_limit`` -> ``WorkerRegistry``: a
start-up error for a configuration with more, HTTP 409 ``too_many_workers`` for a run-time add, a
refusal counted by the mesh bridge for a worker from the mesh), so no worker is silently left out of
routing. What still reaches a full index (a removed worker's slot is freed by ``clear_worker``, which
the mesh does after its orphan grace) is dropped and counted in ``dropped_inserts``, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from shepherd.policies.prefix_index import BLOCK_TOKENS, Entries, PrefixIndex, PrefixIndexConfig, by_worker

try:
    from shepherd.policies._prefixcore import MAX_SLOTS, Core
except ImportError:  # pragma: no cover - an install without a C compiler
    NATIVE_INDEX = False
else:
    NATIVE_INDEX = True

WORKER_LIMIT = 64  # workers one native index holds (the C core's MAX_SLOTS; checked at import below)
if NATIVE_INDEX and MAX_SLOTS != WORKER_LIMIT:  # pragma: no cover - a core built with another size
    WORKER_LIMIT = MAX_SLOTS

log = logging.getLogger(__name__)


class NativePrefixIndex(PrefixIndex):
    """``PrefixIndex`` with the state held by ``_prefixcore.Core`` (see the module docstring)."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        super().__init__(config)
        self._core = Core(self.config.capacity_blocks)
        self._slot: dict[str, int] = {}
        self._name_of: list[str | None] = [None] * MAX_SLOTS
        self._free = list(range(MAX_SLOTS - 1, -1, -1))  # popped lowest first
        self.dropped_inserts = 0
        # the ids the core named last (``match``): an ``insert`` of the same object reuses those names
        self._named: Sequence[int] | None = None
        self._named_len = -1

    # -- queries ------------------------------------------------------------------------------------

    def match(self, ids: Sequence[int]) -> dict[str, int]:
        """Per worker, the longest prefix of ``ids`` it holds, in tokens; the names stay in the core (as
        int64s, never Python ints) for an ``insert`` of the same ids (object and length) that follows."""
        self._named = None  # a match that fails leaves no names to reuse
        res = self._core.match_ids(ids)
        self._named, self._named_len = ids, len(ids)
        return {w: n * BLOCK_TOKENS for w, n in res.items()}

    def match_blocks(self, hs: Sequence[int]) -> dict[str, int]:
        return self._core.match(hs)

    def holders(self, block: int) -> list[str]:
        mask = self._core.holders(block)
        return [w for w, s in self._slot.items() if mask >> s & 1] if mask else []

    def last_access(self, block: int, worker: str) -> float | None:
        s = self._slot.get(worker)
        return None if s is None else self._core.last_access(block, s)

    def worker_blocks(self, worker: str) -> int:
        s = self._slot.get(worker)
        return 0 if s is None else self._core.count(s)

    @property
    def live_blocks(self) -> int:
        return self._core.live()

    @property
    def workers(self) -> list[str]:
        return sorted(self._slot, key=self._slot.__getitem__)

    # -- updates ------------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], worker: str, now: float) -> None:
        if len(ids) < BLOCK_TOKENS:  # no full block: nothing to hold (and no slot taken, as in PrefixIndex)
            return
        if ids is not self._named or len(ids) != self._named_len:
            self._named = None  # other ids named since: like PrefixIndex's one-slot cache, forget the match's
            self.insert_blocks(self.hashes(ids), worker, now)
            return
        s = self._slot_of(worker)
        if s is not None:
            self._core.insert_named(s, now)

    def insert_blocks(self, hs: Sequence[int], worker: str, now: float) -> None:
        s = self._slot_of(worker) if hs else None
        if s is not None:
            self._core.insert(hs, s, now)

    def remove_blocks(self, hs: Iterable[int], worker: str) -> None:
        s = self._slot.get(worker)
        if s is not None:
            self._core.remove(hs if isinstance(hs, list | tuple) else list(hs), s)

    def clear_worker(self, worker: str) -> None:
        s = self._slot.pop(worker, None)
        if s is None:
            return
        self._core.clear(s)
        self._core.set_name(s, None)
        self._name_of[s] = None
        self._free.append(s)
        self._free.sort(reverse=True)

    def set_capacity(self, worker: str, blocks: int) -> None:
        cap = self._capacity[worker] = max(1, blocks)
        s = self._slot.get(worker)
        if s is not None:
            self._core.set_capacity(s, cap)

    def expire(self, now: float, budget: int = 4096) -> int:
        cutoff = now - self.config.max_age_s
        return sum(self._core.expire(s, cutoff, budget) for s in list(self._slot.values()))

    # -- replication --------------------------------------------------------------------------------

    def export(self, since: float | None = None) -> Entries:
        return self._core.export(since)

    def merge(self, entries: Mapping[tuple[int, str], float]) -> None:
        for w, (hs, ts) in by_worker(entries).items():
            self._merge_worker(w, hs, ts)

    # -- internals ----------------------------------------------------------------------------------

    def _merge_worker(self, worker: str, hs: Sequence[int], ts: Sequence[float]) -> int:
        """Max-merge blocks ``hs`` of ``worker`` at times ``ts``; returns how many entries changed."""
        s = self._slot_of(worker)
        return 0 if s is None else self._core.merge(s, hs, ts)  # names outside 64 bits: skipped there

    def _slot_of(self, worker: str) -> int | None:
        """The worker's slot, given one on first use (None: all 64 are taken)."""
        s = self._slot.get(worker)
        return self._add_slot(worker) if s is None else s

    def _add_slot(self, worker: str) -> int | None:
        if not self._free:
            self.dropped_inserts += 1
            if self.dropped_inserts == 1:
                log.warning("prefix index: more than %d workers; %s is not indexed", MAX_SLOTS, worker)
            return None
        s = self._free.pop()
        self._slot[worker] = s
        self._name_of[s] = worker
        self._core.set_name(s, worker)
        self._core.set_capacity(s, self.capacity(worker))
        return s
