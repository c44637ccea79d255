"""The run layout of the prefix index: ``RunPrefixIndex`` and its runs, shared blocks and holders.

``RunPrefixIndex`` is a ``prefix_index.PrefixIndex`` (same API, replicated state and invariants) whose
blocks that became a worker's in one insert form a run with a list of times; a request touches one run
per earlier insert it meets (see its docstring). Faster per request, smaller per block, exact expiry,
and its eviction (run tails first) keeps what a worker holds of a chain a prefix even when KV events
touched the deeper blocks later (the flat CLOCK then takes the older ancestors first).

The mesh's ``prefix_replica.ReplicatedPrefixIndex`` subclasses it and reads its private pieces
(``_Run``, ``_Shared``, ``_Holder``, ``_run_of``): it overrides ``RunPrefixIndex._touch`` (a copy of its
loop), ``_touch_one``, ``_add_run``, ``_unlink`` (every removal goes through it, with the removed
blocks' times), ``merge`` and ``clear_worker``: keep them in step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat

from shepherd.policies.prefix_index import Entries, PrefixIndex, PrefixIndexConfig


class _Run:
    """Blocks that became one worker's in one insert, in chain order, with their last-access times.

    A chain run (``chain``) is a contiguous piece of one chain: requests touch prefixes of it (a
    request's chain enters a run at its first block), so its times do not increase along it and its
    tail is its least recently used part. A loose run (merged entries, or an insert that met blocks the
    worker held already) is any set of blocks, kept newest first.

    ``ordered``: its times do not increase along it (so its first and last ones bound them all). Runs
    are made so (one time, or newest first); a touch or merge that breaks it clears it."""

    __slots__ = ("chain", "keys", "mask", "ordered", "seq", "times")

    def __init__(
        self, keys: list[int], times: list[float], mask: int, seq: int, chain: bool, ordered: bool = True
    ) -> None:
        self.keys = keys
        self.times = times
        self.mask = mask  # the worker's bit (blocks map to the run: the run stands for the mask)
        self.seq = seq
        self.chain = chain
        self.ordered = ordered


class _Shared:
    """A block several workers hold: its mask, and each holder's run by bit."""

    __slots__ = ("mask", "runs")

    def __init__(self, mask: int, runs: dict[int, _Run]) -> None:
        self.mask = mask
        self.runs = runs


class _Holder:
    """One worker of a ``RunPrefixIndex``: its bit, its live runs, a lazy heap of their tails."""

    __slots__ = ("bit", "count", "heap", "name", "runs")

    def __init__(self, name: str, bit: int) -> None:
        self.name = name
        self.bit = bit
        self.count = 0  # blocks held
        self.runs: dict[_Run, None] = {}
        # (tail time, -seq, run): the least recently used tail first, the newer run first on ties;
        # an entry is stale once the run's tail time changed (a newer entry was pushed) or it is gone
        self.heap: list[tuple[float, int, _Run]] = []


def _run_of(v: _Run | _Shared | None, bit: int) -> _Run | None:
    if v is None:
        return None
    if type(v) is _Run:
        return v if v.mask == bit else None
    return v.runs.get(bit)  # type: ignore[union-attr]


class RunPrefixIndex(PrefixIndex):
    """The same index as ``PrefixIndex`` (API, replicated state, invariants), laid out for speed.

    ``PrefixIndex`` keeps one time per (block, worker) in a dict per worker, so a request that touches
    n held blocks costs n writes in a large dict (a cache miss each: ~150 ns here), whatever else is
    done. Here the blocks that became a worker's in one insert form a *run* (a contiguous piece of the
    chain, with a list of times); a request's chain covers a prefix of each run it meets, so touching
    a held prefix costs one lookup per run met (a conversation: its system prompt's run, then one run
    per earlier turn) and a slice assignment of the times. Per block there is one dict entry
    (block -> its run; a ``_Shared`` when several workers hold it), and a slot in its run's key and
    time lists.

    Eviction takes the least recently used run tail first (a lazy heap per worker); since a run's
    times do not increase along it, that is LRU down to the order inside a run, where the deeper
    block goes first; what a worker keeps of a chain stays a prefix. Expiry starts from the same oldest
    tails (no scan past recent entries). Runs that merges or out-of-order touches left unsorted are
    evicted and expired from their tail all the same (approximately LRU). An insert that takes a worker
    over its capacity evicts 1/64 of the capacity more than needed, so that most inserts evict nothing
    (the per-call work is paid once per batch; the worker then holds up to 1.6% less)."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        super().__init__(config)
        self._blocks: dict[int, _Run | _Shared] = {}
        self._holders: dict[str, _Holder] = {}
        self._seq = 0
        self._hints: list[int] = []  # recent match answers (probe positions to try first)

    # -- queries ------------------------------------------------------------------------------------

    def match_blocks(self, hs: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of the chain ``hs`` it holds (``PrefixIndex.match_blocks``)."""
        out: dict[str, int] = {}
        self._m_hs, self._m_res, self._m_epoch = hs, out, self._epoch
        n = len(hs)
        get = self._blocks.get
        v = get(hs[0]) if n else None
        if v is None:
            return {}
        first = v.mask
        names = self._names
        if n > 1:
            v = get(hs[n - 1])
            full = 0 if v is None else v.mask & first
        else:
            full = first
        if full:
            for w in names(full):
                out[w] = n
        rest = first & ~full
        if rest:
            # as in PrefixIndex.match_blocks, but the first probes of a range go where recent answers
            # were (a shared system prompt's end recurs): two probes settle a set that ends there
            hints = self._hints
            stack = [(1, n - 1, rest)]
            while stack:  # bounded: each turn settles a set, each inner step narrows a range
                lo, hi, ws = stack.pop()
                while lo < hi:
                    for a in hints:  # bounded: a few hints
                        if lo <= a < hi:
                            mid = a
                            break
                        if lo <= a - 1 < hi:
                            mid = a - 1
                            break
                    else:
                        mid = (lo + hi) >> 1
                    v = get(hs[mid])
                    right = 0 if v is None else ws & v.mask
                    if right:
                        if right != ws:
                            stack.append((lo, mid, ws ^ right))
                        lo, ws = mid + 1, right
                    else:
                        hi = mid
                for w in names(ws):
                    out[w] = lo
                if lo not in hints:
                    hints.insert(0, lo)
                    del hints[2:]
        return dict(out)

    def holders(self, block: int) -> list[str]:
        v = self._blocks.get(block)
        return [] if v is None else list(self._names(v.mask))

    def last_access(self, block: int, worker: str) -> float | None:
        h = self._holders.get(worker)
        run = None if h is None else _run_of(self._blocks.get(block), h.bit)
        return None if run is None else run.times[run.keys.index(block)]

    def worker_blocks(self, worker: str) -> int:
        h = self._holders.get(worker)
        return 0 if h is None else h.count

    @property
    def live_blocks(self) -> int:
        return len(self._blocks)

    # -- updates ------------------------------------------------------------------------------------

    def insert_blocks(self, hs: Sequence[int], worker: str, now: float) -> None:
        n = len(hs)
        if not n:
            return
        holder = self._holders.get(worker) or self._add_holder(worker)
        cap = self._capacity.get(worker, self.config.capacity_blocks)
        if n > cap:  # a prompt longer than the worker's cache: it keeps the leading blocks
            hs = hs[:cap]
            n = cap
        res = self._m_res if hs is self._m_hs and self._m_epoch == self._epoch else self.match_blocks(hs)
        k = res.get(worker, 0)
        i = self._touch(holder, hs, k, now) if k else 0
        if i < k:  # a hole in what the worker holds of this chain (KV "removed" events, merges)
            self._insert_slow(holder, hs, i, n, now)
        elif k < n:
            self._add_run(holder, hs[k:] if type(hs) is list else list(hs[k:]), [now] * (n - k), True)
        else:
            return  # all held already: only times changed
        self._epoch += 1  # masks changed: a cached match of these blocks is stale
        if holder.count > cap:
            # a little more than needed (1/64 of the capacity, never so much that the blocks just set
            # would go when all the others are older): most inserts then evict nothing
            self._evict_runs(holder, holder.count - cap + min(cap >> 6, cap - n))
        if len(holder.heap) > 2 * len(holder.runs) + 64:
            self._rebuild_heap(holder)

    def remove_blocks(self, hs: Iterable[int], worker: str) -> None:
        """KV event "removed" (or local eviction): ``worker`` no longer holds these blocks."""
        holder = self._holders.get(worker)
        if holder is None:
            return
        self._epoch += 1
        get = self._blocks.get
        for h in dict.fromkeys(hs):
            run = _run_of(get(h), holder.bit)
            if run is not None:
                self._cut(holder, run, run.keys.index(h))

    def clear_worker(self, worker: str) -> None:
        """KV event "all cleared", or the worker left: forget it and free its slot."""
        holder = self._holders.pop(worker, None)
        if holder is None:
            return
        self._epoch += 1
        for run in holder.runs:
            self._unlink(holder, run, run.keys, run.times)
        self._slots[holder.bit.bit_length() - 1] = None
        self._names_of.clear()

    def set_capacity(self, worker: str, blocks: int) -> None:
        """Capacity in blocks, as the engine reports it (e.g. max KV tokens // 16)."""
        cap = self._capacity[worker] = max(1, blocks)
        holder = self._holders.get(worker)
        if holder is not None and holder.count > cap:
            self._evict_runs(holder, holder.count - cap)

    def expire(self, now: float, budget: int = 4096) -> int:
        """Drop entries not accessed within ``max_age_s``, oldest first (run tails in the order
        eviction takes them), about ``budget`` per worker per call (call periodically). Returns how
        many were dropped."""
        cutoff = now - self.config.max_age_s
        dropped = 0
        for holder in self._holders.values():
            heap = holder.heap
            seen = 0
            while heap and heap[0][0] < cutoff and seen < budget:  # bounded by budget
                t, ns, run = heap[0]
                keys, times = run.keys, run.times
                if not keys or times[-1] != t:  # stale entry
                    heapq.heappop(heap)
                    seen += 1
                    continue
                # the run's tail as old as its heap entry (all of it with that time: a chain run's
                # times do not increase along it), no more: another run's equal or older tail may be
                # deeper in a chain, and a budget that stops midway must leave what is held a prefix
                j = len(keys) - 1
                while j and times[j - 1] <= t:  # bounded by the run
                    j -= 1
                victims = keys[j:]
                vtimes = times[j:]
                del keys[j:], times[j:]
                self._unlink(holder, run, victims, vtimes)
                holder.count -= len(victims)
                dropped += len(victims)
                seen += len(victims)
                if keys:
                    heapq.heapreplace(heap, (times[-1], ns, run))
                else:
                    heapq.heappop(heap)
                    del holder.runs[run]
        if dropped:
            self._epoch += 1
        return dropped

    # -- replication --------------------------------------------------------------------------------

    def export(self, since: float | None = None) -> Entries:
        """The replicated state, (block, worker) -> last access; only entries newer than ``since``."""
        out: Entries = {}
        for w, holder in self._holders.items():
            for run in holder.runs:
                if since is None:
                    out.update(zip(zip(run.keys, repeat(w)), run.times, strict=True))
                else:
                    out.update(((h, w), t) for h, t in zip(run.keys, run.times, strict=True) if t > since)
        return out

    def merge(self, entries: Mapping[tuple[int, str], float]) -> None:
        """Max-merge a peer's entries (a delta or a full state) into this index."""
        by_worker: dict[str, list[tuple[int, float]]] = {}
        for (h, w), t in entries.items():
            by_worker.setdefault(w, []).append((h, t))
        get = self._blocks.get
        for w, pairs in by_worker.items():
            holder = self._holders.get(w) or self._add_holder(w)
            new: list[tuple[int, float]] = []
            for h, t in pairs:
                run = _run_of(get(h), holder.bit)
                if run is None:
                    new.append((h, t))
                    continue
                self._set_time(holder, run, run.keys.index(h), t)
            if new:
                new.sort(key=lambda p: -p[1])  # newest first: a loose run's tail is its oldest (stable)
                self._add_run(holder, [p[0] for p in new], [p[1] for p in new], False)
                self._epoch += 1
            cap = self.capacity(w)
            if holder.count > cap:
                self._evict_runs(holder, holder.count - cap)

    # -- internals ----------------------------------------------------------------------------------

    def _add_holder(self, worker: str) -> _Holder:
        try:
            slot = self._slots.index(None)
            self._slots[slot] = worker
        except ValueError:
            slot = len(self._slots)
            self._slots.append(worker)
        self._epoch += 1
        self._names_of.clear()
        holder = self._holders[worker] = _Holder(worker, 1 << slot)
        return holder

    _touch_hooked = False  # a subclass that overrides _on_touch sets it (the base loop skips the call)

    def _on_touch(self, holder: _Holder, run: _Run, o: int, b: int, now: float) -> bool:
        """Called by ``_touch`` for each run's span ``run.keys[o:o+b]`` before its times become ``now``,
        when ``_touch_hooked``. True: the hook set the span's times itself (some below ``now``)."""
        return False

    def _touch(self, holder: _Holder, hs: Sequence[int], k: int, now: float) -> int:
        """Set the time of the held blocks ``hs[:k]`` to ``now``, run by run; returns how far it got
        (less than ``k``: a block the worker does not hold, a hole). ``_on_touch``, when a subclass
        sets it, sees each run's span before its times change (the mesh's digest accounting)."""
        get = self._blocks.get
        bit = holder.bit
        hooked = self._touch_hooked
        i = 0
        while i < k:  # bounded: i grows by at least 1 per turn
            h = hs[i]
            v = get(h)
            if v is None:
                return i
            if type(v) is _Run:
                run: _Run | None = v if v.mask == bit else None
            else:
                run = v.runs.get(bit)  # type: ignore[union-attr]
            if run is None:
                return i
            keys = run.keys
            o = 0 if keys[0] == h else keys.index(h)
            b = len(keys) - o  # how far run and chain may go on together
            if b > k - i:
                b = k - i
            if b > 1 and (not run.chain or keys[o + b - 1] != hs[i + b - 1]):  # it leaves the chain
                b = self._span(run, o, hs, i, b)
            if hooked and self._on_touch(holder, run, o, b, now):
                run.ordered = False  # times the hook chose: their order along the run is not known
                if o + b == len(keys):
                    heapq.heappush(holder.heap, (run.times[-1], -run.seq, run))
                i += b
                continue
            times = run.times
            if run.ordered and ((o and times[o - 1] < now) or (o + b < len(times) and times[o + b] > now)):
                run.ordered = False
            times[o : o + b] = [now] * b
            if o + b == len(keys):  # its tail moved: a fresh heap entry (the old one goes stale)
                heapq.heappush(holder.heap, (now, -run.seq, run))
            i += b
        return i

    def _span(self, run: _Run, o: int, hs: Sequence[int], i: int, b: int) -> int:
        """How many blocks ``run`` (from its offset ``o``) and the chain ``hs`` (from ``i``) have in
        common, at most ``b`` (the first one is)."""
        keys = run.keys
        if not run.chain:  # any set of blocks: compared one by one (a C-speed compare first)
            if type(hs) is list and keys[o : o + b] == hs[i : i + b]:
                return b
            m = 1
            while m < b and keys[o + m] == hs[i + m]:  # bounded by b
                m += 1
            return m
        # a piece of a chain: equal names at one depth mean equal prefixes. Where a recent match
        # answer ended first (a shared system prompt's end recurs), else a binary search
        for a in self._hints:  # bounded: a few hints
            m = a - i
            if 0 < m < b and keys[o + m - 1] == hs[a - 1] and keys[o + m] != hs[a]:
                return m
        lo, hi = 1, b - 1
        while lo < hi:  # bounded: the range halves
            mid = (lo + hi + 1) >> 1
            if keys[o + mid - 1] == hs[i + mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _touch_one(self, holder: _Holder, run: _Run, h: int, now: float) -> None:
        self._set_time(holder, run, run.keys.index(h), now)

    def _set_time(self, holder: _Holder, run: _Run, o: int, now: float) -> None:
        """Block ``o`` of ``run`` accessed at ``now`` (a time never goes back)."""
        if now > run.times[o]:
            run.times[o] = now
            if o and run.times[o - 1] < now:
                run.ordered = False
            if o == len(run.keys) - 1:
                heapq.heappush(holder.heap, (now, -run.seq, run))

    def _insert_slow(self, holder: _Holder, hs: Sequence[int], i: int, n: int, now: float) -> None:
        """``hs[i:n]`` block by block: held ones are touched, the others become runs (one per piece)."""
        get = self._blocks.get
        piece: list[int] = []
        for h in hs[i:n]:
            run = _run_of(get(h), holder.bit)
            if run is None:
                piece.append(h)
                continue
            if piece:
                self._add_run(holder, piece, [now] * len(piece), True)
                piece = []
            self._touch_one(holder, run, h, now)
        if piece:
            self._add_run(holder, piece, [now] * len(piece), True)

    def _add_run(self, holder: _Holder, keys: list[int], times: list[float], chain: bool) -> _Run | None:
        """Blocks ``keys`` (lists the run owns) become the worker's, as a new run (returned, with the
        blocks that were new to the worker; None if there were none)."""
        self._seq += 1
        run = _Run(keys, times, holder.bit, self._seq, chain)
        blocks = self._blocks
        before = len(blocks)
        olds = list(map(blocks.setdefault, keys, repeat(run)))
        if len(blocks) - before != len(keys):  # some were known: other holders, or repeated names
            self._share(holder, run, olds)
            if not run.keys:
                return None
        holder.runs[run] = None
        holder.count += len(run.keys)
        heapq.heappush(holder.heap, (run.times[-1], -run.seq, run))
        return run

    def _share(self, holder: _Holder, run: _Run, olds: list[_Run | _Shared]) -> None:
        """The blocks of a new ``run`` that were in the index already: shared with their holders,
        or (held by this worker already) touched where they are and left out of the run."""
        bit = holder.bit
        blocks = self._blocks
        keep: list[int] = []
        times: list[float] = []
        seen: set[int] = set()
        for h, t, o in zip(run.keys, run.times, olds, strict=True):
            if h in seen:
                continue
            seen.add(h)
            if o is run:
                pass
            elif type(o) is _Run:
                if o.mask == bit:
                    self._touch_one(holder, o, h, t)
                    continue
                blocks[h] = _Shared(o.mask | bit, {o.mask: o, bit: run})
            else:
                assert isinstance(o, _Shared)
                if o.mask & bit:
                    self._touch_one(holder, o.runs[bit], h, t)
                    continue
                o.mask |= bit
                o.runs[bit] = run
            keep.append(h)
            times.append(t)
        if len(keep) != len(run.keys):
            run.chain = False  # not a contiguous piece of a chain any more
            run.keys, run.times = keep, times

    def _unlink(self, holder: _Holder, run: _Run, keys: Sequence[int], times: Sequence[float]) -> None:
        """Take the worker's entries of ``keys`` (blocks of ``run``, last accessed at ``times``) out of
        the block map. Every removal goes through here (the mesh's digest follows it)."""
        bit = holder.bit
        blocks = self._blocks
        olds = list(map(blocks.pop, keys, repeat(None)))
        if olds.count(run) == len(olds):  # the worker was the only holder: the common case
            return
        for h, o in zip(keys, olds, strict=True):
            if o is run or o is None:
                continue
            if type(o) is _Shared:
                o.runs.pop(bit, None)
                o.mask &= ~bit
                if len(o.runs) > 1:
                    blocks[h] = o
                elif o.runs:
                    blocks[h] = next(iter(o.runs.values()))
            else:
                blocks[h] = o  # another worker's run (not expected): left as it was

    def _cut(self, holder: _Holder, run: _Run, o: int) -> None:
        """Remove the block at offset ``o`` of ``run``; what follows it becomes a run of its own."""
        keys, times = run.keys, run.times
        h, t = keys[o], times[o]
        rest_k, rest_t = keys[o + 1 :], times[o + 1 :]
        del keys[o:], times[o:]
        self._unlink(holder, run, [h], [t])
        holder.count -= 1
        if rest_k:
            self._seq += 1
            tail = _Run(rest_k, rest_t, holder.bit, self._seq, run.chain, run.ordered)
            blocks = self._blocks
            for k in rest_k:  # bounded by the run
                v = blocks[k]
                if v is run:
                    blocks[k] = tail
                elif type(v) is _Shared:
                    v.runs[holder.bit] = tail
            holder.runs[tail] = None
            heapq.heappush(holder.heap, (rest_t[-1], -tail.seq, tail))
        if keys:
            heapq.heappush(holder.heap, (times[-1], -run.seq, run))
        else:
            del holder.runs[run]

    def _evict_runs(self, holder: _Holder, k: int) -> None:
        """Evict ``k`` blocks: the least recently used run tails first."""
        heap = holder.heap
        self._epoch += 1
        while k > 0 and heap:  # bounded: each turn drops a heap entry or evicts blocks
            t, ns, run = heap[0]
            keys, times = run.keys, run.times
            if not keys or times[-1] != t:  # stale entry
                heapq.heappop(heap)
                continue
            n = len(keys)
            j = max(times.index(t), n - k)  # times do not increase along a chain run: [j:] are all t
            if j < n - 1 and max(times[j:]) > t:  # an unsorted run: its tail up to a newer block
                j = n - 1
                while j > n - k and times[j - 1] <= t:  # bounded by k
                    j -= 1
            victims = keys[j:]
            vtimes = times[j:]
            del keys[j:], times[j:]
            self._unlink(holder, run, victims, vtimes)
            holder.count -= n - j
            k -= n - j
            if keys:
                heapq.heapreplace(heap, (times[-1], ns, run))
            else:
                heapq.heappop(heap)
                del holder.runs[run]

    def _rebuild_heap(self, holder: _Holder) -> None:
        holder.heap = [(r.times[-1], -r.seq, r) for r in holder.runs]
        heapq.heapify(holder.heap)
