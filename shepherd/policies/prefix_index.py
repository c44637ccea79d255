"""Prefix index: which worker holds which 16-token blocks of which prompts, with last-access times.

Holds the index's API and the flat reference layout (``PrefixIndex``), its config
(``PrefixIndexConfig``) and the replicated state's vocabulary (``Entries``, ``merge_entries``,
``by_worker``); the run layout is ``run_index.RunPrefixIndex``.

Blocks are named by a chained hash: ``h_i = hash((h_{i-1}, block_i))`` over the 16-token blocks of a
prompt, from ``CHAIN_SEED``; a block's name stands for the whole prefix that ends with it. CPython's
``hash`` of a tuple of ints does not depend on PYTHONHASHSEED (only str/bytes hashes are salted), so
the names are the same on every node that runs 64-bit CPython >= 3.8 (golden values pinned in the
tests). Engines name their blocks with hashes of their own: the KV event feed names them again from
their tokens (``kv_events``), the index never needs an engine's hash function.

Naming (``block_names``): in C (``_prefixcore.c``) about the cost of a bare ``sum(ids)`` over the prompt,
the pure-Python reference about 2.5x that; numpy (conversion plus a dozen array calls of ~2 µs each on
tiny arrays) and per-block C calls over bytes (crc32, blake2b, int.from_bytes) measured slower than
either. ``hashes`` caches the names of the last ``ids`` object, so a ``match`` then ``insert`` of one
prompt names it once.

Two layouts of the same index in Python (same API, replicated state and invariants; the property
tests run both and compare them), and a third with its state in C (``native_index.NativePrefixIndex``:
what ``cache_aware`` uses where it is built):

- ``PrefixIndex`` (flat, here): ``_mask`` block -> bitmask of its holders (workers get a bit slot; masks
  of up to 8 workers are small cached ints: no memory beyond the dict entry); ``_lru[worker]`` block ->
  last access (one exact time per (block, worker)); ``_queue[worker]`` the blocks in the order they
  became the worker's, as (time, keys) batches, one per insert: eviction (capacity) and expiry (age)
  take batches from the front, CLOCK-style (a block accessed since its batch was queued is queued
  again instead of dropped). A request touching n held blocks costs n writes in a large dict, a
  cache miss each (~150 ns on the bench machine when quiet): that is its floor.
  Invariant: ``bit(w) in _mask[h]`` iff ``h in _lru[w]``; no mask is 0.
- ``run_index.RunPrefixIndex`` (runs): a subclass that keeps the blocks that became a worker's in one
  insert as a run with a list of times (see ``run_index``).

Both match with a shared binary search over the chain (a few dict lookups per distinct answer,
whatever the number of workers); Python-level loops run only on rare paths (a chain with a hole,
blocks touched out of order, merges). ``bench/prefix_index_bench.py`` prints the figures.

Replicated state is the map (block, worker) -> last access with max-merge (``merge_entries``): a join
semilattice, no tombstones; entries leave by age and capacity. A locally removed entry can come back
from a peer that still has it until that peer ages it out (no tombstones, by design).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import compress, repeat

from shepherd.policies.block_names import BLOCK, CHAIN_SEED, NATIVE_NAMES, BlockNamer, block_hashes

__all__ = ["BLOCK_TOKENS"]

BLOCK_TOKENS = BLOCK
_or = operator.or_
_and = operator.and_
_sink: deque[object] = deque(maxlen=0)
_consume: Callable[[Iterable[object]], None] = _sink.extend  # runs an iterator at C speed, keeps nothing

Entries = dict[tuple[int, str], float]


def by_worker(entries: Mapping[tuple[int, str], float]) -> dict[str, tuple[list[int], list[float]]]:
    """Replicated entries grouped per worker: its blocks and their times, in the entries' order."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for (h, w), t in entries.items():
        g = out.get(w)
        if g is None:
            g = out[w] = ([], [])
        g[0].append(h)
        g[1].append(t)
    return out


def merge_entries(a: Mapping[tuple[int, str], float], b: Mapping[tuple[int, str], float]) -> Entries:
    """Max-merge of two replicated states: commutative, associative, idempotent."""
    out = dict(a)
    for k, t in b.items():
        cur = out.get(k)
        if cur is None or t > cur:
            out[k] = t
    return out


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    capacity_blocks: int = 1 << 16  # per worker, unless the engine reported one (set_capacity)
    max_age_s: float = 1800.0


class PrefixIndex:
    """Block-hash -> {worker: last_access}; per-worker capacity, eviction by age and capacity."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._mask: dict[int, int] = {}
        self._lru: dict[str, dict[int, float]] = {}
        # per worker, blocks in the order they became its own, as (time, keys) batches: eviction order
        self._queue: dict[str, deque[tuple[float, list[int]]]] = {}
        self._queued: dict[str, int] = {}
        self._bit: dict[str, int] = {}
        self._slots: list[str | None] = []
        self._names_of: dict[int, tuple[str, ...]] = {}  # mask -> its workers (cache)
        self._capacity: dict[str, int] = {}
        # the piece memo pays only over the Python names: in C, naming every id costs less than its lookups
        # (bench/prefix_index_bench.py, "all" against "pieces")
        self.namer = None if NATIVE_NAMES else BlockNamer(block_hashes, CHAIN_SEED)
        # one-slot cache: match(ids) then insert(ids, ...) hash the prompt once
        self._last_ids: Sequence[int] | None = None
        self._last_len = -1
        self._last_hashes: list[int] = []
        # the last match_blocks result, valid while no entry was removed (epoch unchanged)
        self._epoch = 0
        self._m_hs: Sequence[int] | None = None
        self._m_res: dict[str, int] = {}
        self._m_epoch = -1

    # -- naming -------------------------------------------------------------------------------------

    def hashes(self, ids: Sequence[int]) -> list[int]:
        """``block_hashes(ids)``, cached for the last ``ids`` object seen (same object, same length:
        ids are taken as immutable, as the tokenizer layer hands them over); ids that carry the pieces
        they were built from (``prompt_ids.PromptIds``) are named through the piece memo when the names
        are computed in Python."""
        if ids is self._last_ids and len(ids) == self._last_len:
            return self._last_hashes
        hs = block_hashes(ids) if self.namer is None else self.namer.names(ids)
        self._last_ids, self._last_len, self._last_hashes = ids, len(ids), hs
        return hs

    # -- queries ------------------------------------------------------------------------------------

    def match(self, ids: Sequence[int]) -> dict[str, int]:
        """Per worker, the longest prefix of ``ids`` it holds, in tokens (workers with none are absent)."""
        return {w: n * BLOCK_TOKENS for w, n in self.match_blocks(self.hashes(ids)).items()}

    def match_blocks(self, hs: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of the chain ``hs`` it holds.

        A shared binary search: about log2(len(hs)) lookups per distinct answer, not one per block
        (the last block is looked at first: its holders hold the whole chain). It relies on each
        worker's blocks of a chain being prefix-closed (an engine's radix cache evicts leaves first;
        this index's eviction prefers later blocks on equal access times); were there a hole, the
        answer is the end of some held run, not necessarily the first one.
        """
        out: dict[str, int] = {}
        self._m_hs, self._m_res, self._m_epoch = hs, out, self._epoch
        n = len(hs)
        get = self._mask.get
        first = get(hs[0], 0) if n else 0
        if not first:
            return {}
        names = self._names
        full = get(hs[n - 1], 0) & first if n > 1 else first
        if full:
            for w in names(full):
                out[w] = n
        rest = first & ~full
        if rest:
            # (lo, hi, S): each worker in S holds block lo-1, and exactly b leading blocks, lo <= b <= hi
            stack = [(1, n - 1, rest)]
            while stack:  # bounded: each turn settles a set, each inner step halves a range
                lo, hi, ws = stack.pop()
                while lo < hi:
                    mid = (lo + hi) >> 1
                    right = ws & get(hs[mid], 0)
                    if right:
                        if right != ws:
                            stack.append((lo, mid, ws ^ right))
                        lo, ws = mid + 1, right
                    else:
                        hi = mid
                for w in names(ws):
                    out[w] = lo
        return dict(out)  # a copy: insert_blocks relies on what this match saw

    def holders(self, block: int) -> list[str]:
        return list(self._names(self._mask.get(block, 0)))

    def last_access(self, block: int, worker: str) -> float | None:
        d = self._lru.get(worker)
        return None if d is None else d.get(block)

    def worker_blocks(self, worker: str) -> int:
        d = self._lru.get(worker)
        return 0 if d is None else len(d)

    @property
    def live_blocks(self) -> int:
        return len(self._mask)

    @property
    def workers(self) -> list[str]:
        return [w for w in self._slots if w is not None]

    def capacity(self, worker: str) -> int:
        return self._capacity.get(worker, self.config.capacity_blocks)

    # -- updates ------------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], worker: str, now: float) -> None:
        """Record that ``worker`` now holds every full block of ``ids`` (a routing decision)."""
        self.insert_blocks(self.hashes(ids), worker, now)

    def insert_blocks(self, hs: Sequence[int], worker: str, now: float) -> None:
        n = len(hs)
        if not n:
            return
        bit = self._bit.get(worker) or self._add_worker(worker)
        wd = self._lru[worker]
        cap = self._capacity.get(worker, self.config.capacity_blocks)
        if n > cap:  # a prompt longer than the worker's cache: it keeps the leading blocks
            hs = hs[:cap]
            n = cap
        before = len(wd)
        wd.update(zip(hs, repeat(now)))
        added = len(wd) - before
        if not added:  # all held already (a repeat): only the times changed
            return
        # the leading blocks it held (as the last match_blocks(hs) saw, or a new one: masks are not
        # updated yet) have the bit; the rest are new to it, unless it had a hole in this chain
        res = self._m_res if hs is self._m_hs and self._m_epoch == self._epoch else self.match_blocks(hs)
        held = res.get(worker, 0)
        md = self._mask
        tail: list[int] | None = None
        if n - held == added:
            tail = list(hs[held:])
            masks = list(map(md.get, tail, repeat(0)))
            if reduce(_or, masks, 0) & bit:  # one of them was held: the counts agreed by chance (a hole)
                tail = None
        if tail is None:  # a hole (or repeated names): the blocks the worker did not hold, by their masks
            tail = [h for h in dict.fromkeys(hs) if not md.get(h, 0) & bit]
            masks = list(map(md.get, tail, repeat(0)))
        md.update(zip(tail, map(_or, masks, repeat(bit)), strict=True))
        self._enqueue(worker, now, tail)
        if len(wd) > cap:
            self._evict(worker, len(wd) - cap, protect=now)

    def store_token_blocks(
        self, worker: str, token_ids: Sequence[int], now: float, parent: int | None = None
    ) -> list[int]:
        """KV event "stored": ``worker`` cached these token blocks after the block named ``parent``.

        Engines' own block hashes are opaque, so the index names the blocks from their tokens.
        Returns the names, so a caller can map the engine's hashes to them.
        """
        hs = block_hashes(token_ids, CHAIN_SEED if parent is None else parent)
        self.insert_blocks(hs, worker, now)
        return hs

    def remove_blocks(self, hs: Iterable[int], worker: str) -> None:
        """KV event "removed" (or local eviction): ``worker`` no longer holds these blocks."""
        wd = self._lru.get(worker)
        if wd is None:
            return
        self._epoch += 1
        gone = [h for h in dict.fromkeys(hs) if h in wd]
        if gone:
            self._drop(worker, wd, gone)

    def clear_worker(self, worker: str) -> None:
        """KV event "all cleared", or the worker left: forget it and free its slot."""
        wd = self._lru.pop(worker, None)
        bit = self._bit.pop(worker, 0)
        self._queue.pop(worker, None)
        self._queued.pop(worker, None)
        if wd is None:
            return
        self._epoch += 1
        md = self._mask
        for h in wd:
            m = md[h] & ~bit
            if m:
                md[h] = m
            else:
                del md[h]
        self._slots[bit.bit_length() - 1] = None
        self._names_of.clear()

    def set_capacity(self, worker: str, blocks: int) -> None:
        """Capacity in blocks, as the engine reports it (e.g. max KV tokens // 16)."""
        self._capacity[worker] = max(1, blocks)
        d = self._lru.get(worker)
        if d is not None and len(d) > self._capacity[worker]:
            self._evict(worker, len(d) - self._capacity[worker])

    def expire(self, now: float, budget: int = 4096) -> int:
        """Drop entries not accessed within ``max_age_s``, oldest first; looks at about ``budget``
        queued entries per worker per call (call periodically). Returns how many were dropped."""
        cutoff = now - self.config.max_age_s
        dropped = 0
        for worker in list(self._lru):
            wd, q = self._lru[worker], self._queue[worker]
            victims: list[int] = []
            keep: list[int] = []
            newest = -math.inf
            seen = 0
            while q and seen < budget and q[0][0] < cutoff:  # bounded by budget (plus one batch)
                _, keys = q.popleft()
                seen += len(keys)
                for h in keys:
                    t = wd.get(h)
                    if t is None:
                        continue
                    if t < cutoff:
                        victims.append(h)
                    else:
                        keep.append(h)
                        newest = max(newest, t)
            self._queued[worker] -= seen
            if keep:
                self._enqueue(worker, newest, keep)
            if victims:
                gone = list(dict.fromkeys(victims))
                self._epoch += 1
                self._drop(worker, wd, gone)
                dropped += len(gone)
        return dropped

    # -- replication --------------------------------------------------------------------------------

    def export(self, since: float | None = None) -> Entries:
        """The replicated state, (block, worker) -> last access; only entries newer than ``since``."""
        out: Entries = {}
        for w, wd in self._lru.items():
            if since is None:
                out.update(zip(zip(wd, repeat(w)), wd.values(), strict=False))
            else:
                out.update(((h, w), t) for h, t in wd.items() if t > since)
        return out

    def merge(self, entries: Mapping[tuple[int, str], float]) -> None:
        """Max-merge a peer's entries (a delta or a full state) into this index."""
        new: dict[str, list[int]] = {}
        newest: dict[str, float] = {}
        for (h, w), t in entries.items():
            bit = self._bit.get(w) or self._add_worker(w)
            wd = self._lru[w]
            cur = wd.get(h)
            if cur is None:
                wd[h] = t
                self._mask[h] = self._mask.get(h, 0) | bit
                new.setdefault(w, []).append(h)
                newest[w] = max(newest.get(w, t), t)
            elif t > cur:
                wd[h] = t
        for w, keys in new.items():
            self._enqueue(w, newest[w], keys)
            wd = self._lru[w]
            if len(wd) > self.capacity(w):
                self._evict(w, len(wd) - self.capacity(w))

    # -- internals ----------------------------------------------------------------------------------

    def _add_worker(self, worker: str) -> int:
        try:
            slot = self._slots.index(None)
            self._slots[slot] = worker
        except ValueError:
            slot = len(self._slots)
            self._slots.append(worker)
        bit = 1 << slot
        self._epoch += 1
        self._names_of.clear()
        self._bit[worker] = bit
        self._lru[worker] = {}
        self._queue[worker] = deque()
        self._queued[worker] = 0
        return bit

    def _names(self, mask: int) -> tuple[str, ...]:
        """The workers of a mask (cached: a handful of distinct masks recur)."""
        names = self._names_of.get(mask)
        if names is None:
            slots = self._slots
            out = []
            m = mask
            while m:  # bounded: one bit cleared per turn
                low = m & -m
                w = slots[low.bit_length() - 1]
                if w is not None:
                    out.append(w)
                m ^= low
            names = tuple(out)
            if len(self._names_of) >= 4096:
                self._names_of.clear()
            self._names_of[mask] = names
        return names

    def _drop(self, worker: str, wd: dict[int, float], gone: list[int]) -> None:
        """Remove blocks ``worker`` holds (``gone``: unique, all in ``wd``) from its map and their
        masks (C-speed passes)."""
        md = self._mask
        bit = self._bit[worker]
        _consume(map(wd.__delitem__, gone))
        masks = list(map(md.__getitem__, gone))
        if masks.count(bit) == len(masks):  # the worker was the only holder: the common case
            _consume(map(md.__delitem__, gone))
            return
        masks = list(map(_and, masks, repeat(~bit)))
        md.update(zip(gone, masks, strict=True))
        _consume(map(md.__delitem__, compress(gone, map(operator.not_, masks))))

    def _enqueue(self, worker: str, t: float, keys: list[int]) -> None:
        """Queue blocks that just became ``worker``'s, as one batch (keys in chain order) at time ``t``."""
        q = self._queue[worker]
        q.append((t, keys))
        n = self._queued[worker] = self._queued[worker] + len(keys)
        if n > 2 * len(self._lru[worker]) + 1024:  # mostly stale keys (removed by events): rebuild
            wd = self._lru[worker]
            q.clear()
            q.append((max(wd.values(), default=t), list(wd)))
            self._queued[worker] = len(wd)

    def _evict(self, worker: str, k: int, protect: float = math.inf) -> None:
        """Evict ``k`` entries, least recently used first (CLOCK over insert batches).

        Batches leave the queue oldest first; a block accessed after its batch was queued is set
        aside instead of evicted. Batches queued at ``protect`` or later (the current insert) are
        reached last: before them, the set-aside blocks go, oldest first. Deeper blocks go before
        their ancestors on equal times, so what a worker keeps of a chain stays a prefix."""
        wd, q = self._lru[worker], self._queue[worker]
        get = wd.get
        victims: list[int] = []
        # the victims, from the second batch on: a block may be queued twice (re-queued, or removed and
        # added again), and each counts once toward ``k``
        picked: set[int] | None = None
        aside: list[int] = []  # popped deepest first
        seen = 0
        for limit in (protect, math.inf):
            while q and len(victims) < k and q[0][0] < limit:  # bounded: each turn consumes keys
                tb, keys = q[0]
                need = k - len(victims)
                if len(keys) <= need:
                    q.popleft()
                    chunk = keys
                else:  # the deepest blocks of the batch first
                    chunk = keys[-need:]
                    del keys[-need:]
                seen += len(chunk)
                if victims:
                    if picked is None:
                        picked = set(victims)
                    chunk = [h for h in chunk if h not in picked]
                    if not chunk:
                        continue
                ts = list(map(get, chunk))
                # none touched or removed since queued: all go
                if None not in ts and max(ts) <= tb:  # type: ignore[type-var, operator]
                    taken = chunk
                else:
                    taken = [h for h, t in zip(chunk, ts, strict=True) if t is not None and t <= tb]
                    aside += [
                        h
                        for h, t in zip(reversed(chunk), reversed(ts), strict=True)
                        if t is not None and t > tb
                    ]
                victims += taken
                if picked is not None:
                    picked.update(taken)
            if len(victims) < k and aside:
                aside.reverse()  # chain order; then oldest first, the later (deeper) first on ties
                vs = set(victims)
                aside = [h for h in dict.fromkeys(aside) if h not in vs]
                order = sorted(range(len(aside)), key=lambda i: (wd[aside[i]], -i))
                cut = k - len(victims)
                taken = [aside[i] for i in order[:cut]]
                victims += taken
                if picked is not None:
                    picked.update(taken)
                aside = [aside[i] for i in sorted(order[cut:])][::-1]
        self._queued[worker] -= seen
        if aside:
            if victims:
                vs = set(victims)
                aside = [h for h in reversed(aside) if h not in vs]
            else:
                aside.reverse()
            if aside:
                self._enqueue(worker, max(map(wd.__getitem__, aside)), aside)
        self._epoch += 1
        if victims:
            self._drop(worker, wd, victims)
