"""Prefix-index replication: delta batches for gossip, max-merge on receipt, bucket digests for repair.

The replicated state is the prefix index's map (block, worker) -> last access, a join semilattice under
max-merge (``policies.prefix_index``): no tombstones; entries leave by age and capacity, on each
replica by itself. ``ReplicatedPrefixIndex`` is a ``PrefixIndex`` (policies use it unchanged) that
also keeps:

- a delta buffer: the blocks inserted locally (routing decisions, KV events) since the last batch,
  as the inserts' own (worker, time, blocks) groups (O(1) per insert; no deduplication: the
  receivers' max-merge absorbs the rare repeat). A re-access of a held block is buffered again
  only when it moves the block into a new time slot of the digest (below), so at most once per
  ``digest_granularity_s``: a chat's
  prefix is re-accessed every turn, and sending it every time would be most of the traffic; peers'
  times lag by less than a slot, which only shifts their expiry and LRU order, and their digests
  still agree. Bounded (``max_pending`` entries; the oldest are dropped: digest repair covers them);
- a digest: per (worker, time slot) bucket, the entry count and the sum of the block hashes
  (mod 2**64), a slot being ``int(last_access // digest_granularity_s)`` (0: the exact time). It is
  maintained incrementally (C-speed ``sum`` over the blocks of an insert, all in one bucket), on
  insert, merge and every removal (eviction, expiry, KV removals, clears), so reading it costs
  nothing; it has at most workers x (max_age / granularity + 2) buckets. Two replicas compare
  digests and send each other their entries of the buckets that differ (``diff``, ``entries_in``);
  after a max-merge both sides hold the same entries, with times equal up to the granularity
  (exactly, with 0). Differences are localized in time: a lost batch spoils one recent bucket, and
  slots still open (``repair_settle_s``) are left to the deltas in flight.

Removals are not replicated (no tombstones, by design): a block evicted here comes back from a peer
that still has it until that peer ages it out. Under capacity pressure replicas may keep different
subsets, and repair then moves entries the receiver evicts again; both are bounded by capacity.

Wire (inside the ``MeshState`` envelope): ``[model, [group, ...]]``, a group being
``[worker, time, hashes]`` (one float time for all, the shape of a routing decision) or
``[worker, times, hashes]`` (``times``: float64 array bytes, one per hash, for repair and snapshots);
``hashes`` are int64 array bytes, little-endian. A block costs 8 (or 16) bytes on the wire.

Coupling: this subclass reads ``PrefixIndex._lru``, overrides ``_drop`` (every removal of the parent
goes through it) and ``clear_worker``, and sets blocks through the parent's ``insert_blocks``; a
parent change there needs the same change here (the unit tests compare the incremental digest with
a full recomputation after random operations).
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import floordiv
from typing import Any

from shepherd.mesh.hlc import StateDecodeError, expect_list, expect_str
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig

__all__ = [
    "Group",
    "IndexReplConfig",
    "ReplicatedPrefixIndex",
    "decode_index_body",
    "encode_index_bodies",
    "worker_key",
]

_M64 = (1 << 64) - 1
_BIG = sys.byteorder == "big"
MAX_WORKER_LEN = 256

Group = tuple[str, "float | array[float]", "array[int]"]
"""(worker, one time or one time per hash, block hashes)."""


@dataclass(frozen=True, slots=True)
class IndexReplConfig:
    digest_granularity_s: float = 60.0  # times in the digest are coarsened to this (0: exact)
    max_pending: int = 131_072  # delta buffer bound, in entries (the oldest are dropped beyond it)
    max_future_s: float = 60.0  # entries stamped further ahead of the local clock are dropped
    relay: bool = False  # re-gossip entries received from peers that changed this index
    repair_settle_s: float = 5.0  # digest repair leaves alone time slots that ended less than this ago


_WKEYS: dict[str, int] = {}
_EMPTY: dict[int, float] = {}


def worker_key(worker: str) -> int:
    """A stable 64-bit key for a worker name (``hash(str)`` is salted per process; this is not)."""
    k = _WKEYS.get(worker)
    if k is None:
        if len(_WKEYS) > 65_536:
            _WKEYS.clear()
        k = _WKEYS[worker] = int.from_bytes(
            hashlib.blake2b(worker.encode(), digest_size=8).digest(), "little", signed=True
        )
    return k


def _to_bytes(a: array[Any]) -> bytes:
    if _BIG:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_bytes(code: str, b: bytes) -> array[Any]:
    a = array(code)
    a.frombytes(b)
    if _BIG:
        a.byteswap()
    return a


Slot = int | float
"""A digest bucket's time slot: ``int(t // granularity)``, or the exact time if the granularity is 0."""

Digest = dict[str, dict[Slot, tuple[int, int]]]
"""worker -> time slot -> (entry count, sum of block hashes mod 2**64)."""


class ReplicatedPrefixIndex(PrefixIndex):
    """A ``PrefixIndex`` with a gossip delta buffer and an incrementally maintained digest."""

    def __init__(self, config: PrefixIndexConfig | None = None, repl: IndexReplConfig | None = None) -> None:
        super().__init__(config)
        self.repl = repl or IndexReplConfig()
        self._g = self.repl.digest_granularity_s
        # the digest: worker -> slot -> [count, sum of block hashes] (exact ints, reduced when read)
        self._acc: dict[str, dict[Slot, list[int]]] = {}
        # the delta buffer: (worker, time or None: read it when cut, blocks), oldest first
        self._pending: deque[tuple[str, float | None, list[int]]] = deque()
        self._pending_n = 0
        self.pending_dropped = 0  # delta keys dropped by the buffer bound
        self.rejected = 0  # received entries dropped (too old or too far in the future)

    # -- digest accounting --------------------------------------------------------------------------

    def slot(self, t: float) -> Slot:
        g = self._g
        return int(t // g) if g > 0 else t

    def _slot_list(self, times: Iterable[float]) -> list[Slot]:
        g = self._g
        if g > 0:
            return list(map(int, map(floordiv, times, repeat(g))))
        return list(times)

    def _bucket_add(self, worker: str, slot: Slot, keys: Sequence[int], sign: int) -> None:
        if not keys:
            return
        wacc = self._acc.get(worker)
        if wacc is None:
            wacc = self._acc[worker] = {}
        b = wacc.get(slot)
        if b is None:
            b = wacc[slot] = [0, 0]
        b[0] += sign * len(keys)
        b[1] += sign * sum(keys)
        if b[0] == 0:
            del wacc[slot]
            if not wacc:
                del self._acc[worker]

    def _bucket_times(self, worker: str, keys: Sequence[int], times: Sequence[float], sign: int) -> None:
        """Add (sign 1) or remove (-1) the terms of ``keys`` at per-key ``times``, grouped by slot."""
        if not keys:
            return
        slots = self._slot_list(times)
        first = slots[0]
        if slots.count(first) == len(slots):
            self._bucket_add(worker, first, keys, sign)
            return
        groups: dict[Slot, list[int]] = {}
        for h, sl in zip(keys, slots, strict=True):
            g = groups.get(sl)
            if g is None:
                groups[sl] = [h]
            else:
                g.append(h)
        for sl, hs in groups.items():
            self._bucket_add(worker, sl, hs, sign)

    def _set_times(self, worker: str, pairs: Mapping[int, float | None], t: float) -> None:
        """Digest terms of blocks set to time ``t`` from times ``pairs`` (None: new to the worker)."""
        held = [(h, o) for h, o in pairs.items() if o is not None]
        if held:
            self._bucket_times(worker, [p[0] for p in held], [p[1] for p in held], -1)
        self._bucket_add(worker, self.slot(t), list(pairs), 1)

    def digest(self) -> Digest:
        """worker -> time slot -> (count, sum of block hashes mod 2**64): equal entry sets (and times
        equal up to the granularity) give equal digests."""
        return {w: {sl: (b[0], b[1] & _M64) for sl, b in wacc.items()} for w, wacc in self._acc.items()}

    def recompute_digest(self) -> Digest:
        """The digest from scratch (a check of the incremental one; O(entries))."""
        out: Digest = {}
        for w, wd in self._lru.items():
            groups: dict[Slot, list[int]] = {}
            for h, sl in zip(wd, self._slot_list(wd.values()), strict=True):
                groups.setdefault(sl, []).append(h)
            if groups:
                out[w] = {sl: (len(hs), sum(hs) & _M64) for sl, hs in groups.items()}
        return out

    def diff(self, remote: Digest, now: float | None = None) -> dict[str, set[Slot]]:
        """Per worker, the time slots where a peer's digest differs from ours (either side's). With
        ``now``, only slots that ended ``repair_settle_s`` ago: younger differences are mostly deltas
        still in flight, which repair would send a second time."""
        mine = self.digest()
        settled = math.inf if now is None else now - self.repl.repair_settle_s
        g = self._g
        out: dict[str, set[Slot]] = {}
        for w in mine.keys() | remote.keys():
            a, b = mine.get(w, {}), remote.get(w, {})
            bad = {
                sl
                for sl in a.keys() | b.keys()
                if a.get(sl) != b.get(sl) and ((sl + 1) * g if g > 0 else sl) <= settled
            }
            if bad:
                out[w] = bad
        return out

    # -- local updates (recorded for gossip) --------------------------------------------------------

    def insert_blocks(self, hs: Sequence[int], worker: str, now: float) -> None:
        if not hs:
            return
        cap = self.capacity(worker)
        view = hs if len(hs) <= cap else hs[:cap]  # what the parent will set (it truncates the same way)
        n = len(view)
        wd = self._lru.get(worker)
        olds: list[float | None] | None = None
        k = 0  # the leading blocks the worker holds (a chain's held part is a prefix)
        if wd is not None:
            olds = list(map(wd.get, view))
            try:
                k = olds.index(None)
            except ValueError:
                k = n
        if k:  # a held prefix, re-accessed: C-speed checks, Python loops only when a slot changes
            assert olds is not None
            head: list[float] = olds if k == n else olds[:k]  # type: ignore[assignment]
            ns = self.slot(now)
            if self.slot(min(head)) != ns or self.slot(max(head)) != ns:
                pairs = dict(zip(view[:k], head, strict=True))
                keys = list(pairs)
                moved = [h for h, sl in zip(keys, self._slot_list(pairs.values()), strict=True) if sl != ns]
                self._bucket_times(worker, moved, [pairs[h] for h in moved], -1)
                self._bucket_add(worker, ns, moved, 1)
                self._queue_keys(worker, moved, now)
        if k < n:
            tail = view[k:] if k else view
            if olds is None or olds.count(None) == n - k:  # all new: the common case
                if len(set(tail)) != len(tail):
                    tail = list(dict.fromkeys(tail))
                self._bucket_add(worker, self.slot(now), tail, 1)
                self._queue_keys(worker, list(tail), now)
            else:  # a chain with holes (odd input): the general path
                skip = set(view[:k])
                tpairs = {h: o for h, o in zip(tail, olds[k:], strict=True) if h not in skip}
                ns = self.slot(now)
                moved = [h for h, o in tpairs.items() if o is None or self.slot(o) != ns]
                held = [h for h in moved if tpairs[h] is not None]
                self._bucket_times(worker, held, [tpairs[h] for h in held], -1)  # type: ignore[misc]
                self._bucket_add(worker, ns, moved, 1)
                self._queue_keys(worker, moved, now)
        super().insert_blocks(hs, worker, now)

    def _queue_keys(self, worker: str, keys: list[int], t: float | None = None) -> None:
        """Buffer ``keys`` (a list this index owns) for gossip: at time ``t``, or (None) at the times
        the index holds when the batch is cut. O(1): deduplication is the receiver's max-merge."""
        if not keys:
            return
        self._pending.append((worker, t, keys))
        self._pending_n += len(keys)
        over = self._pending_n - self.repl.max_pending
        while over > 0 and self._pending:  # bounded: each turn drops a batch or ends
            w, bt, bk = self._pending[0]
            if len(bk) <= over:
                self._pending.popleft()
                dropped = len(bk)
            else:
                self._pending[0] = (w, bt, bk[over:])
                dropped = over
            self._pending_n -= dropped
            self.pending_dropped += dropped
            over -= dropped

    # -- removals (every removal of the parent goes through _drop, or clear_worker) -----------------

    def _drop(self, worker: str, wd: dict[int, float], gone: list[int]) -> None:
        if gone:
            self._bucket_times(worker, gone, list(map(wd.__getitem__, gone)), -1)
        super()._drop(worker, wd, gone)

    def clear_worker(self, worker: str) -> None:
        self._acc.pop(worker, None)  # its buffered deltas are skipped when cut (no entries left)
        super().clear_worker(worker)

    # -- merges -------------------------------------------------------------------------------------

    def merge(self, entries: Mapping[tuple[int, str], float]) -> None:
        """Max-merge a peer's entries (no validation: ``apply_groups`` is the wire entry point)."""
        by_worker: dict[str, tuple[list[int], list[float]]] = {}
        for (h, w), t in entries.items():
            g = by_worker.get(w)
            if g is None:
                g = by_worker[w] = ([], [])
            g[0].append(h)
            g[1].append(t)
        for w, (hs, ts) in by_worker.items():
            self._merge_group(w, array("d", ts), hs)

    def apply_groups(self, groups: Iterable[Group], now: float) -> int:
        """Max-merge decoded groups; entries older than ``max_age_s`` or more than ``max_future_s``
        ahead of ``now`` are dropped. Returns how many entries changed this index."""
        lo, hi = now - self.config.max_age_s, now + self.repl.max_future_s
        changed = 0
        for w, t, hs in groups:
            if isinstance(t, float):
                if lo <= t <= hi:
                    changed += self._merge_group(w, t, hs)
                else:
                    self.rejected += len(hs)
                continue
            if not (t and lo <= min(t) and max(t) <= hi):
                keep = [i for i, x in enumerate(t) if lo <= x <= hi]
                self.rejected += len(t) - len(keep)
                changed += self._merge_group(w, array("d", [t[i] for i in keep]), [hs[i] for i in keep])
            else:
                changed += self._merge_group(w, t, hs)
        return changed

    def _merge_group(self, worker: str, t: float | array[float], hs: Sequence[int]) -> int:
        if not hs:
            return 0
        if isinstance(t, float):
            return self._merge_at(worker, t, hs)
        wd = self._lru.get(worker)
        get = _EMPTY.get if wd is None else wd.get
        upd: dict[int, float] = {}
        olds: dict[int, float] = {}
        for h, x in zip(hs, t, strict=True):
            o = get(h)
            if o is None or x > o:
                prev = upd.get(h)
                if prev is None or x > prev:
                    upd[h] = x
                    if o is not None:
                        olds[h] = o
        if not upd:
            return 0
        if olds:
            self._bucket_times(worker, list(olds), list(olds.values()), -1)
        keys = list(upd)
        self._bucket_times(worker, keys, list(upd.values()), 1)
        super().merge(dict(zip(zip(keys, repeat(worker)), upd.values(), strict=False)))
        if self.repl.relay:
            self._queue_keys(worker, keys)  # at the times it holds
        return len(keys)

    def _merge_at(self, worker: str, t: float, hs: Sequence[int]) -> int:
        """Max-merge blocks ``hs`` of ``worker`` at one time ``t`` (a routing decision's shape): the
        changed blocks are set with the parent's C-speed insert path."""
        wd = self._lru.get(worker)
        olds = None if wd is None else list(map(wd.get, hs))
        cap = self.capacity(worker)
        if olds is None or olds.count(None) == len(olds):  # all new: the common case
            keys = list(hs) if len(set(hs)) == len(hs) else list(dict.fromkeys(hs))
            if len(keys) > cap:
                keys = keys[:cap]
            self._bucket_add(worker, self.slot(t), keys, 1)
        else:
            pairs = {h: o for h, o in zip(hs, olds, strict=True) if o is None or t > o}
            if not pairs:
                return 0
            keys = list(pairs)
            if len(keys) > cap:
                keys = keys[:cap]
                pairs = {h: pairs[h] for h in keys}
            self._set_times(worker, pairs, t)
        PrefixIndex.insert_blocks(self, keys, worker, t)
        if self.repl.relay:
            self._queue_keys(worker, list(keys), t)
        return len(keys)

    # -- gossip -------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._pending_n

    def take_groups(self, limit: int | None = None) -> list[Group]:
        """The buffered deltas, oldest first (at most ``limit`` entries; the rest stay), as groups
        (worker, time, blocks). Blocks buffered without a time get the index's current ones, and are
        skipped if gone; a worker cleared since is skipped."""
        out: list[Group] = []
        budget = math.inf if limit is None else limit
        q = self._pending
        while q and budget > 0:  # bounded: each turn consumes a batch or the budget
            w, t, keys = q[0]
            if len(keys) <= budget:
                q.popleft()
            else:
                cut = int(budget)
                q[0] = (w, t, keys[cut:])
                keys = keys[:cut]
            self._pending_n -= len(keys)
            budget -= len(keys)
            wd = self._lru.get(w)
            if wd is None:
                continue
            if t is not None:
                out.append((w, t, array("q", keys)))
                continue
            pairs = [(h, x) for h, x in zip(keys, map(wd.get, keys), strict=True) if x is not None]
            if pairs:
                out.append((w, array("d", [p[1] for p in pairs]), array("q", [p[0] for p in pairs])))
        return out

    def _select(self, worker: str, wd: dict[int, float], slots: Collection[Slot] | None) -> list[int]:
        if slots is None:
            return list(wd)
        g = self._g
        if g > 0:
            return [h for h, t in wd.items() if int(t // g) in slots]
        return [h for h, t in wd.items() if t in slots]

    def entries_in(self, sel: Mapping[str, Collection[Slot]] | None = None) -> list[Group]:
        """Our entries of the (worker, time slot) buckets ``sel`` (None: all), one group per worker
        with per-entry times (what a peer whose digest differs there needs)."""
        out: list[Group] = []
        for w, wd in self._lru.items():
            slots = None if sel is None else sel.get(w)
            if sel is not None and not slots:
                continue
            keys = self._select(w, wd, slots)
            if keys:
                out.append((w, array("d", map(wd.__getitem__, keys)), array("q", keys)))
        return out

    def queue_repair(self, sel: Mapping[str, Collection[Slot]], limit: int | None = None) -> int:
        """Put our entries of the buckets ``sel`` in the delta buffer (repair by gossip), at most
        ``limit``; returns how many."""
        n = 0
        for w, slots in sel.items():
            wd = self._lru.get(w)
            if wd is None or not slots:
                continue
            keys = self._select(w, wd, slots)
            if limit is not None and n + len(keys) > limit:
                keys = keys[: max(0, limit - n)]
            self._queue_keys(w, keys)  # at the times held when cut
            n += len(keys)
            if limit is not None and n >= limit:
                break
        return n


# -- wire ---------------------------------------------------------------------------------------------


def _str_size(s: str) -> int:
    n = len(s.encode())
    return n + (1 if n <= 31 else 2 if n <= 255 else 3)


def _bin_size(n: int) -> int:
    return n + (2 if n <= 255 else 3 if n <= 65535 else 5)


def encode_index_bodies(model: str, groups: Iterable[Group], budget: int) -> Iterator[list[Any]]:
    """Bodies ``[model, [group, ...]]`` whose msgpack encoding takes at most ``budget`` bytes;
    a group that does not fit is split across bodies."""
    base = 1 + _str_size(model) + 5  # outer array, model, groups array header (conservative)
    if budget < base + 1 + _str_size("") + _bin_size(16) * 2 + 9:
        raise ValueError(f"budget {budget} is too small for an index batch")
    cur: list[Any] = []
    free = budget - base
    for w, t, hs in groups:
        scalar = isinstance(t, float)
        per = 8 if scalar else 16
        fixed = 1 + _str_size(w) + (9 if scalar else 0)
        i, n = 0, len(hs)
        while i < n:
            hdr = fixed + (5 if scalar else 10)  # bin headers, conservative
            k = min(n - i, (free - hdr) // per)
            if k <= 0:
                if not cur:
                    raise ValueError(f"budget {budget} is too small for worker name {w[:32]!r}")
                yield [model, cur]
                cur, free = [], budget - base
                continue
            part_h = hs[i : i + k]
            if scalar:
                cur.append([w, t, _to_bytes(part_h)])
            else:
                assert not isinstance(t, float)
                cur.append([w, _to_bytes(t[i : i + k]), _to_bytes(part_h)])
            free -= fixed + (_bin_size(8 * k) if scalar else 2 * _bin_size(8 * k))
            i += k
    if cur:
        yield [model, cur]


def decode_index_body(body: Any, max_entries: int = 1 << 20) -> tuple[str, list[Group]]:
    """Decode ``[model, groups]``; raises ``StateDecodeError`` on anything malformed."""
    f = expect_list(body, 2)
    model = expect_str(f[0], 512, allow_empty=True)
    out: list[Group] = []
    total = 0
    for g in expect_list(f[1], max_len=max_entries):
        w_raw, t_raw, h_raw = expect_list(g, 3)
        w = expect_str(w_raw, MAX_WORKER_LEN)
        if type(h_raw) is not bytes or len(h_raw) % 8:
            raise StateDecodeError("index hashes must be int64 array bytes")
        hs = _from_bytes("q", h_raw)
        total += len(hs)
        if total > max_entries:
            raise StateDecodeError("too many index entries in one payload")
        t: float | array[float]
        if type(t_raw) is float or type(t_raw) is int:
            t = float(t_raw)
            if not math.isfinite(t):
                raise StateDecodeError("index time must be finite")
        elif type(t_raw) is bytes and len(t_raw) == len(h_raw):
            t = _from_bytes("d", t_raw)
            if not all(map(math.isfinite, t)):
                raise StateDecodeError("index times must be finite")
        else:
            raise StateDecodeError("index time must be a float or a float64 array as long as the hashes")
        out.append((w, t, hs))
    return model, out
