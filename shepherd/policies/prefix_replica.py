"""Prefix-index replication: delta batches for gossip, max-merge on receipt, bucket digests for repair.

The replicated state is the prefix index's map (block, worker) -> last access, a join semilattice under
max-merge (``policies.prefix_index``): no tombstones; entries leave by age and capacity, on each
replica by itself. ``ReplicatedPrefixIndex`` is a ``RunPrefixIndex`` (the run layout: policies use it
unchanged, at close to its cost per request and memory per block) that also keeps:

- a delta buffer: the blocks routing decisions inserted since the last batch, as the inserts' own
  (worker, time, blocks) groups (O(1) per insert: a new run is buffered by reference, its blocks read
  when the batch is cut; no deduplication: the receivers' max-merge absorbs the rare repeat; one
  request's groups leave as one). Never buffered: inserts learned from an engine's KV events
  (``store_token_blocks``: every node subscribed to the engine gets the same event), and the inserts of
  a quiet worker (``set_quiet``: a node with ``--mesh-index-replication auto`` quiets the workers whose
  KV-event stream is live; their entries take their access times, and digest repair leaves them
  alone). A held block a routing decision re-accesses in another time slot of the digest (below) is
  moved there and buffered again only once ``refresh_s`` old (600 s; 0: at every slot change, as
  before); until then it stays in its slot, its time the slot's last instant at most (``_clamp``), so
  peers' digests still agree and a follow-up sends only its new blocks. A chat's prefix is re-accessed
  every turn: re-sending it when a turn crossed a slot was most of the traffic. Peers' times lag by
  less than ``refresh_s`` plus a slot (capped below ``max_age_s``), which only shifts their expiry and
  LRU order. Bounded (``max_pending`` entries; the oldest batches are dropped: digest repair covers
  them);
- a digest: per (worker, time slot) bucket, the entry count and the sum of the block hashes
  (mod 2**64), a slot being ``int(last_access // digest_granularity_s)`` (0: the exact time). It is
  maintained incrementally, per run rather than per block where it can: a run touched at time t
  whose old times (bounded by its first and last ones, or a C-speed min and max) are all in t's slot
  changes nothing; a new run adds one C-speed ``sum`` to one bucket; an evicted tail subtracts one.
  It follows insert, merge and every removal (eviction, expiry, KV removals, clears), so reading it
  costs nothing; it has at most workers x (max_age / granularity + 2) buckets. Two replicas compare
  digests and send each other their entries of the buckets that differ (``diff``, ``entries_in``);
  after a max-merge both sides hold the same entries, with times equal up to the granularity
  (exactly, with 0). Differences are localized in time: a lost batch spoils one recent bucket, and
  slots still open (``repair_settle_s``) are left to the deltas in flight.

Sparse replication (``set_turns``; a node's ``--mesh-index-replication ends``): a routing decision of such a
worker buffers one turn end instead (``take_turns``: the name of the prompt's last full block, the worker,
its blocks; the chained names make it stand for the prefix); received ones (``apply_turns``) are kept in
a bounded table (``turn_ends_max``, ``turn_ends_span_s``) that ``match`` consults beside the walk
(``policies.turn_ends``).

Merged blocks new to a worker become one loose run per group (newest first); held ones are set to
the newer time in place. Removals are not replicated (no tombstones, by design): a block evicted here
comes back from a peer that still has it until that peer ages it out. Under capacity pressure
replicas may keep different subsets, and repair then moves entries the receiver evicts again; both
are bounded by capacity.

The wire (batches of ``Group`` values, ``Digest`` values) is ``shepherd.proto.index_wire``. The mesh
state (``mesh.state.MeshState``) carries it and drives a replica per model through the ``IndexReplica``
protocol (``mesh.state_types``); a node gives it ``prefix_replica_native.make_replica`` as the factory
of those replicas.

Coupling: this subclass hooks the parent's ``_touch`` (``_on_touch``: the digest per run), overrides
``_touch_one``, ``_add_run`` (local inserts: one time per run), ``_unlink`` (every removal goes
through it), and reads runs (``_Run``: keys, times, ``ordered``) and holders; a
parent change there needs the same change here (the property tests compare this index with a
``RunPrefixIndex`` and its incremental digest with a full recomputation after random operations).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import floordiv, is_, not_

from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndexConfig, by_worker
from shepherd.policies.run_index import RunPrefixIndex, _Holder, _Run, _run_of, _Shared
from shepherd.policies.turn_ends import TurnEnds
from shepherd.proto.index_wire import MAX_TURN_BLOCKS, Digest, Group, Slot, TurnBatch

__all__ = [
    "IndexReplConfig",
    "ReplicaApi",
    "ReplicatedPrefixIndex",
    "effective_refresh",
    "worker_key",
]

_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class IndexReplConfig:
    digest_granularity_s: float = 60.0  # times in the digest are coarsened to this (0: exact)
    max_pending: int = 131_072  # delta buffer bound, in entries (the oldest are dropped beyond it)
    max_future_s: float = 60.0  # entries stamped further ahead of the local clock are dropped
    relay: bool = False  # re-gossip entries received from peers that changed this index
    repair_settle_s: float = 5.0  # digest repair leaves alone time slots that ended less than this ago
    # a local re-access moves a held entry into a newer time slot, and sends it again, only once it is
    # this old (0: at every slot change, as before); capped at max_age_s - 2 x the granularity
    refresh_s: float = 600.0
    # sparse replication (``set_turns``; ``--mesh-index-replication ends``): received turn ends kept, at
    # most this many (C: 8 bytes a cell at load <= 1/2, 128 MB when full) and this long; a record is kept
    # between half and all of either bound (``turn_ends``). Half of 8M is 150 s of 28 peers' decisions at
    # 1,000 req/s each (N = 200, 7 models): follow-ups within that find their turn end
    turn_ends_max: int = 1 << 23
    turn_ends_span_s: float = 600.0


def effective_refresh(config: PrefixIndexConfig, repl: IndexReplConfig) -> float:
    """``repl.refresh_s``, capped so that an entry kept in use is refreshed on every replica before it
    expires there (``max_age_s``)."""
    return max(0.0, min(repl.refresh_s, config.max_age_s - 2 * repl.digest_granularity_s))


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


class ReplicaApi:
    """What both replicas (``ReplicatedPrefixIndex`` here, ``NativeReplicatedPrefixIndex`` in C) share: time
    slots, digest comparison and the validation of received groups. A replica provides ``digest`` and
    ``_merge_group``."""

    config: PrefixIndexConfig
    repl: IndexReplConfig
    _g: float
    _refresh: float
    rejected: int
    _quiet: set[str]
    _turns_of: set[str]

    @property
    def quiet_workers(self) -> frozenset[str]:
        """Workers whose local inserts are not buffered for gossip (``set_quiet``)."""
        return frozenset(self._quiet)

    def set_quiet(self, worker: str, quiet: bool) -> None:
        """``quiet``: this worker's local inserts (routing decisions) are never buffered for gossip, its
        entries always take their access time, and digest repair leaves it alone: every node learns
        what it caches from the engine's own KV events (a node's ``--mesh-index-replication auto`` for a
        worker whose event stream is live, or ``none``)."""
        raise NotImplementedError

    def store_token_blocks(
        self, worker: str, token_ids: Sequence[int], now: float, parent: int | None = None
    ) -> list[int]:
        """KV event "stored" (``PrefixIndex.store_token_blocks``), never buffered for gossip: every node
        subscribed to the engine gets the same event (its entries take the event's time, as a quiet
        worker's do)."""
        raise NotImplementedError

    # -- sparse replication: turn ends (``shepherd.policies.turn_ends``) ----------------------------------

    @property
    def turn_workers(self) -> frozenset[str]:
        """Workers whose routing decisions are sent as turn ends (``set_turns``)."""
        return frozenset(self._turns_of)

    def set_turns(self, worker: str, on: bool) -> None:
        """``on``: each routing decision of this worker buffers one turn end (the name of the prompt's last
        full block, the worker, the blocks) for ``take_turns``. The blocks themselves are sent or not as
        ``set_quiet`` says (``--mesh-index-replication ends`` quiets the worker too)."""
        raise NotImplementedError

    def take_turns(self) -> TurnBatch | None:
        """The buffered turn ends (None: none), oldest first."""
        raise NotImplementedError

    @property
    def turn_ends(self) -> int:
        """Received turn ends kept (what ``match`` also consults)."""
        raise NotImplementedError

    def _put_turns(self, batch: TurnBatch) -> int:
        raise NotImplementedError

    def apply_turns(self, batch: TurnBatch, now: float) -> int:
        """Keep a peer's turn ends; a batch older than the turn ends are kept (``turn_ends_span_s``,
        ``max_age_s``) or more than ``max_future_s`` ahead is dropped. Returns the records kept."""
        lo = now - min(self.config.max_age_s, self.repl.turn_ends_span_s)
        if not lo <= batch.time <= now + self.repl.max_future_s:
            self.rejected += len(batch)
            return 0
        return self._put_turns(batch)

    def _clamp(self, so: Slot, old: float, now: float) -> float:
        """The time a held entry at ``old`` (slot ``so``) takes for an access at ``now`` that leaves it in
        its slot: the slot's last instant at most, never earlier than ``old``."""
        g = self._g
        if not now > old or g <= 0:
            return old
        end = min(now, math.nextafter((so + 1) * g, -math.inf))
        return end if end > old and self.slot(end) == so else old

    def digest(self) -> Digest:
        raise NotImplementedError

    def _merge_group(self, worker: str, t: float | array[float], hs: Sequence[int]) -> int:
        raise NotImplementedError

    def _replica_workers(self) -> Iterable[str]:
        raise NotImplementedError

    def _select(self, worker: str, slots: Collection[Slot] | None) -> tuple[Sequence[int], Sequence[float]]:
        """The worker's entries in time slots ``slots`` (None: all), as keys and times (none if unknown)."""
        raise NotImplementedError

    def _queue_held(self, worker: str, keys: Sequence[int]) -> None:
        """Buffer ``keys`` of ``worker`` for gossip at the times held when the batch is cut."""
        raise NotImplementedError

    def entries_in(self, sel: Mapping[str, Collection[Slot]] | None = None) -> list[Group]:
        """Our entries of the (worker, time slot) buckets ``sel`` (None: all), one group per worker
        with per-entry times (what a peer whose digest differs there needs)."""
        out: list[Group] = []
        for w in self._replica_workers():
            slots = None if sel is None else sel.get(w)
            if sel is not None and not slots:
                continue
            keys, times = self._select(w, slots)
            if keys:
                out.append((w, array("d", times), array("q", keys)))
        return out

    def queue_repair(self, sel: Mapping[str, Collection[Slot]], limit: int | None = None) -> int:
        """Put our entries of the buckets ``sel`` in the delta buffer (repair by gossip), at most
        ``limit``; returns how many."""
        n = 0
        for w, slots in sel.items():
            if not slots:
                continue
            keys, _ = self._select(w, slots)
            if limit is not None and n + len(keys) > limit:
                keys = keys[: max(0, limit - n)]
            if keys:
                self._queue_held(w, keys)
            n += len(keys)
            if limit is not None and n >= limit:
                break
        return n

    def slot(self, t: float) -> Slot:
        g = self._g
        return int(t // g) if g > 0 else t

    def diff(self, remote: Digest, now: float | None = None) -> dict[str, set[Slot]]:
        """Per worker, the time slots where a peer's digest differs from ours (either side's). With
        ``now``, only slots that ended ``repair_settle_s`` ago: younger differences are mostly deltas
        still in flight, which repair would send a second time."""
        mine = self.digest()
        settled = math.inf if now is None else now - self.repl.repair_settle_s
        g = self._g
        out: dict[str, set[Slot]] = {}
        for w in mine.keys() | remote.keys():
            if w in self._quiet:  # the engine's events feed every node: repair would double them
                continue
            a, b = mine.get(w, {}), remote.get(w, {})
            bad = {
                sl
                for sl in a.keys() | b.keys()
                if a.get(sl) != b.get(sl) and ((sl + 1) * g if g > 0 else sl) <= settled
            }
            if bad:
                out[w] = bad
        return out

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


class ReplicatedPrefixIndex(ReplicaApi, RunPrefixIndex):
    """A ``RunPrefixIndex`` with a gossip delta buffer and an incrementally maintained digest."""

    def __init__(self, config: PrefixIndexConfig | None = None, repl: IndexReplConfig | None = None) -> None:
        super().__init__(config)
        self.repl = repl or IndexReplConfig()
        self._g = self.repl.digest_granularity_s
        self._refresh = effective_refresh(self.config, self.repl)
        self._quiet = set()
        self._gossip = True  # False while a KV event's insert runs (store_token_blocks)
        # the digest: worker -> slot -> [count, sum of block hashes] (exact ints, reduced when read)
        self._acc: dict[str, dict[Slot, list[int]]] = {}
        # the delta buffer, oldest first: (worker, time or None: read it when cut, source, start, end),
        # the blocks being source[start:end] (a list this index owns) or, for a local insert's new run,
        # the run's keys[start:end] as they are when cut (no copy per insert; blocks gone since are
        # left out)
        self._pending: deque[tuple[str, float | None, list[int] | _Run, int, int]] = deque()
        self._pending_n = 0
        self.pending_dropped = 0  # delta keys dropped by the buffer bound
        self.rejected = 0  # received entries dropped (too old or too far in the future)
        self._turns_of = set()
        self._turn_buf: list[tuple[int, str, int, float]] = []  # (end name, worker, blocks, time)
        self._turn_table = TurnEnds(self.repl.turn_ends_max, self.repl.turn_ends_span_s)

    # -- digest accounting --------------------------------------------------------------------------

    def _slot_list(self, times: Iterable[float]) -> list[Slot]:
        g = self._g
        if g > 0:
            return list(map(int, map(floordiv, times, repeat(g))))
        return list(times)

    def _bucket_add(self, worker: str, slot: Slot, n: int, total: int) -> None:
        """Add ``n`` entries whose block hashes sum to ``total`` (both negative: remove) to a bucket."""
        if not n:
            return
        wacc = self._acc.get(worker)
        if wacc is None:
            wacc = self._acc[worker] = {}
        b = wacc.get(slot)
        if b is None:
            b = wacc[slot] = [0, 0]
        b[0] += n
        b[1] += total
        if b[0] == 0 and b[1] == 0:  # not while a merge is part-way: a block named twice in one group
            del wacc[slot]  # takes its term out of a bucket it has not reached yet (count 0, sum not)
            if not wacc:
                del self._acc[worker]

    def _bucket_times(
        self, worker: str, keys: Sequence[int], times: Sequence[float], sign: int, ordered: bool = False
    ) -> None:
        """Add (sign 1) or remove (-1) the terms of ``keys`` at per-key ``times`` (``ordered``: not
        increasing), grouped by slot."""
        if not keys:
            return
        lo, hi = (times[-1], times[0]) if ordered else (min(times), max(times))
        g = self._g
        if g > 0:
            if lo // g == hi // g:  # one slot: the common case (C-speed min and max)
                self._bucket_add(worker, int(lo // g), sign * len(keys), sign * sum(keys))
                return
        elif lo == hi:
            self._bucket_add(worker, lo, sign * len(keys), sign * sum(keys))
            return
        groups: dict[Slot, list[int]] = {}
        for h, sl in zip(keys, self._slot_list(times), strict=True):
            grp = groups.get(sl)
            if grp is None:
                groups[sl] = [h]
            else:
                grp.append(h)
        for sl, hs in groups.items():
            self._bucket_add(worker, sl, sign * len(hs), sign * sum(hs))

    def _moved(
        self,
        worker: str,
        keys: list[int],
        olds: list[float],
        lo: float,
        hi: float,
        now: float,
        send: bool = True,
    ) -> None:
        """Blocks ``keys`` of ``worker``, at times ``olds`` (between ``lo`` and ``hi``), were set to
        ``now`` by a local access, and some changed slot: their digest terms move, and those blocks are
        buffered for gossip. (A conversation's next turn usually comes a slot later: its whole held
        prefix moves, from one old slot, with C-speed sums.)"""
        ns = self.slot(now)
        so = self.slot(lo)
        if so == self.slot(hi) and so != ns:  # one old slot, not now's: all move
            n, total = len(keys), sum(keys)
            self._bucket_add(worker, so, -n, -total)
            self._bucket_add(worker, ns, n, total)
            if send:
                self._queue_keys(worker, keys, now)
            return
        slots = self._slot_list(olds)
        moved = [h for h, sl in zip(keys, slots, strict=True) if sl != ns]
        if moved:
            if len(moved) == len(keys):
                self._bucket_times(worker, keys, olds, -1)
            else:
                mts = [t for t, sl in zip(olds, slots, strict=True) if sl != ns]
                self._bucket_times(worker, moved, mts, -1)
            self._bucket_add(worker, ns, len(moved), sum(moved))
            if send:
                self._queue_keys(worker, moved, now)

    def digest(self) -> Digest:
        """worker -> time slot -> (count, sum of block hashes mod 2**64): equal entry sets (and times
        equal up to the granularity) give equal digests."""
        return {w: {sl: (b[0], b[1] & _M64) for sl, b in wacc.items()} for w, wacc in self._acc.items()}

    def recompute_digest(self) -> Digest:
        """The digest from scratch (a check of the incremental one; O(entries))."""
        out: Digest = {}
        for w, holder in self._holders.items():
            groups: dict[Slot, list[int]] = {}
            for run in holder.runs:
                for h, sl in zip(run.keys, self._slot_list(run.times), strict=True):
                    groups.setdefault(sl, []).append(h)
            if groups:
                out[w] = {sl: (len(hs), sum(hs) & _M64) for sl, hs in groups.items()}
        return out

    # -- local updates (recorded for gossip): the parent's hooks ------------------------------------

    _touch_hooked = True

    def _on_touch(self, holder: _Holder, run: _Run, o: int, b: int, now: float) -> bool:
        """``RunPrefixIndex._touch``'s hook: the digest accounting of a run's span about to be set to
        ``now``. The old times' slots are checked through the span's ends (an ordered run) or a
        C-speed min and max; only blocks whose slot changes cost Python-level work. An insert that is
        not sent (a KV event's, a quiet worker's) moves them to now's slot; a routing decision moves
        (and sends again) those ``refresh_s`` old, the others stay in their slots, their times the
        slot's last instant at most (set here: True)."""
        times = run.times
        if run.ordered:  # the old times lie between the first and the last one
            hi, lo = times[o], times[o + b - 1]
        else:
            olds = times[o : o + b]
            hi, lo = max(olds), min(olds)
        g = self._g
        if g > 0:  # (a touch sets one float object: the old times are often one object too)
            hf = hi // g
            moved = hf != now // g or (lo is not hi and lo // g != hf)
        else:
            moved = not lo == now == hi
        if not moved:
            return False
        name = holder.name
        quiet = name in self._quiet
        send = self._gossip and not quiet
        if not send or not now - hi < self._refresh:  # all move (not sent, or the newest is due)
            self._moved(name, run.keys[o : o + b], times[o : o + b], lo, hi, now, send)
            return False
        # some (or all) stay in their slots: block by block (bounded by the span)
        ns = self.slot(now)
        keys = run.keys
        mk: list[int] = []
        mt: list[float] = []
        for j in range(o, o + b):
            old = times[j]
            so = self.slot(old)
            if so == ns:
                times[j] = now
            elif now < old or not now - old < self._refresh:  # an older time moves it, as locally
                mk.append(keys[j])
                mt.append(old)
                times[j] = now
            else:
                times[j] = self._clamp(so, old, now)
        if mk:
            self._moved(name, mk, mt, min(mt), max(mt), now)
        return True

    def _touch_one(self, holder: _Holder, run: _Run, h: int, now: float) -> None:
        o = run.keys.index(h)
        old = run.times[o]
        if now > old:
            so = self.slot(old)
            if so == self.slot(now):
                self._set_time(holder, run, o, now)
                return
            send = self._gossip and holder.name not in self._quiet
            if not send or not now - old < self._refresh:
                self._set_time(holder, run, o, now)
                self._moved(holder.name, [h], [old], old, old, now, send)
                return
            t = self._clamp(so, old, now)
            if t > old:
                self._set_time(holder, run, o, t)

    def _add_run(self, holder: _Holder, keys: list[int], times: list[float], chain: bool) -> _Run | None:
        """Blocks new to the worker from a local insert, all at one time (the parent calls it so;
        merges add their runs with the parent's method and account for them themselves)."""
        run = RunPrefixIndex._add_run(self, holder, keys, times, chain)
        if run is not None:
            t = times[0]
            ks = run.keys
            self._bucket_add(holder.name, self.slot(t), len(ks), sum(ks))
            if self._gossip and holder.name not in self._quiet:
                self._pending.append((holder.name, t, run, 0, len(ks)))
                self._pending_n += len(ks)
                if self._pending_n > self.repl.max_pending:
                    self._drop_pending()
        return run

    def _queue_keys(self, worker: str, keys: list[int], t: float | None = None) -> None:
        """Buffer ``keys`` (a list this index owns) for gossip: at time ``t``, or (None) at the times
        the index holds when the batch is cut. O(1): deduplication is the receiver's max-merge."""
        if keys:
            self._pending.append((worker, t, keys, 0, len(keys)))
            self._pending_n += len(keys)
            if self._pending_n > self.repl.max_pending:
                self._drop_pending()

    def _drop_pending(self) -> None:
        """The buffer's bound: its oldest batches go, whole (up to one batch more than needed)."""
        q = self._pending
        while self._pending_n > self.repl.max_pending and q:  # bounded: each turn drops a batch
            _, _, _, s, e = q.popleft()
            self._pending_n -= e - s
            self.pending_dropped += e - s

    # -- removals (every removal of the parent goes through _unlink) --------------------------------

    def _unlink(self, holder: _Holder, run: _Run, keys: Sequence[int], times: Sequence[float]) -> None:
        self._bucket_times(holder.name, keys, times, -1, run.ordered)
        RunPrefixIndex._unlink(self, holder, run, keys, times)

    # -- merges -------------------------------------------------------------------------------------

    def merge(self, entries: Mapping[tuple[int, str], float]) -> None:
        """Max-merge a peer's entries (no validation: ``apply_groups`` is the wire entry point)."""
        for w, (hs, ts) in by_worker(entries).items():
            self._merge_group(w, array("d", ts), hs)

    def _merge_group(self, worker: str, t: float | array[float], hs: Sequence[int]) -> int:
        """Max-merge blocks ``hs`` of ``worker`` at ``t`` (one time, or one per block). Blocks new to
        the worker become one loose run (newest first); held ones older than their new time are set,
        one by one. Returns how many entries changed."""
        n = len(hs)
        if not n:
            return 0
        holder = self._holders.get(worker) or self._add_holder(worker)
        vs = list(map(self._blocks.get, hs))
        new: dict[int, float] = {}
        up_k: list[int] = []  # held blocks set to a newer time: their old and new times
        up_old: list[float] = []
        up_new: list[float] = []
        ts: Iterable[float] = repeat(t, n) if isinstance(t, float) else t
        group = hs
        nk = vs.count(None)  # blocks no worker holds: new, with C-speed passes (a delta, a snapshot)
        if nk == n:
            _merge_new(hs, ts, new)
        else:  # the known ones (held by this worker or others) go block by block
            if nk:
                isnew = list(map(is_, vs, repeat(None)))
                known = list(map(not_, isnew))
                tl = list(ts)
                _merge_new(list(compress(hs, isnew)), list(compress(tl, isnew)), new)
                hs, vs, ts = list(compress(hs, known)), list(compress(vs, known)), list(compress(tl, known))
            self._merge_held(holder, hs, vs, ts, new, up_k, up_old, up_new)
        if up_k:
            self._bucket_times(worker, up_k, up_old, -1)
            self._bucket_times(worker, up_k, up_new, 1)
        if new:
            if 0 < nk < n:  # in the group's order (a chain's: its deeper blocks are evicted first)
                keys = list(filter(new.__contains__, dict.fromkeys(group)))
                times = list(map(new.__getitem__, keys))
            else:
                keys = list(new)
                times = list(new.values())
            if times.count(times[0]) != len(times):  # newest first: a loose run's tail is its oldest
                order = sorted(range(len(keys)), key=times.__getitem__, reverse=True)
                keys = [keys[i] for i in order]
                times = [times[i] for i in order]
            RunPrefixIndex._add_run(self, holder, keys, times, False)  # no local gossip of it
            self._bucket_times(worker, keys, times, 1)
            self._epoch += 1
            up_k += keys
        if self.repl.relay and up_k:
            self._queue_keys(worker, up_k)  # at the times it holds
        cap = self.capacity(worker)
        if holder.count > cap:
            self._evict_runs(holder, holder.count - cap)
        return len(up_k)

    def _merge_held(
        self,
        holder: _Holder,
        hs: Sequence[int],
        vs: list[_Run | _Shared | None],
        ts: Iterable[float],
        new: dict[int, float],
        up_k: list[int],
        up_old: list[float],
        up_new: list[float],
    ) -> None:
        """The block-by-block part of a merge: new blocks into ``new``, newer times set in place."""
        bit = holder.bit
        for h, v, x in zip(hs, vs, ts, strict=True):
            run = _run_of(v, bit)
            if run is None:
                cur = new.get(h)
                if cur is None or x > cur:
                    new[h] = x
                continue
            o = run.keys.index(h)
            old = run.times[o]
            if x > old:
                self._set_time(holder, run, o, x)
                up_k.append(h)
                up_old.append(old)
                up_new.append(x)

    # -- gossip -------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._pending_n + len(self._turn_buf)

    # -- turn ends ----------------------------------------------------------------------------------

    def set_turns(self, worker: str, on: bool) -> None:
        if on:
            self._turns_of.add(worker)
        else:
            self._turns_of.discard(worker)

    def match(self, ids: Sequence[int]) -> dict[str, int]:
        """``RunPrefixIndex.match`` and, per worker, the longest received turn end of the prompt."""
        res = RunPrefixIndex.match(self, ids)
        if len(self._turn_table):
            self._turn_table.combine(res, self.hashes(ids), BLOCK_TOKENS)
        return res

    def insert(self, ids: Sequence[int], worker: str, now: float) -> None:
        RunPrefixIndex.insert(self, ids, worker, now)
        if worker in self._turns_of and len(ids) >= BLOCK_TOKENS:
            hs = self.hashes(ids)
            n = min(len(hs), self.capacity(worker), MAX_TURN_BLOCKS)
            if len(self._turn_buf) < self.repl.max_pending:
                self._turn_buf.append((hs[n - 1], worker, n, now))
            else:
                self.pending_dropped += 1

    def take_turns(self) -> TurnBatch | None:
        buf, self._turn_buf = self._turn_buf, []
        if not buf:
            return None
        workers = list(dict.fromkeys(w for _, w, _, _ in buf))
        at = {w: i for i, w in enumerate(workers)}
        return TurnBatch(
            max(t for *_, t in buf),
            workers,
            bytes(at[w] for _, w, _, _ in buf),
            array("q", [k for k, _, _, _ in buf]),
            array("H", [n for _, _, n, _ in buf]),
        )

    @property
    def turn_ends(self) -> int:
        return len(self._turn_table)

    def _put_turns(self, batch: TurnBatch) -> int:
        put, ws, t = self._turn_table.put, batch.workers, batch.time
        for i, k, n in zip(batch.widx, batch.keys, batch.blocks, strict=True):
            put(k, ws[i], n, t)
        return len(batch)

    def clear_worker(self, worker: str) -> None:
        RunPrefixIndex.clear_worker(self, worker)
        self._turn_table.clear(worker)
        self._turn_buf = [r for r in self._turn_buf if r[1] != worker]

    def expire(self, now: float, budget: int = 4096) -> int:
        self._turn_table.expire(now - min(self.config.max_age_s, self.repl.turn_ends_span_s))
        return RunPrefixIndex.expire(self, now, budget)

    def take_groups(self, limit: int | None = None) -> list[Group]:
        """The buffered deltas, oldest first (at most ``limit`` entries; the rest stay), as groups
        (worker, time, blocks). Blocks buffered without a time get the index's current ones, and are
        skipped if gone; a worker cleared since is skipped."""
        out: list[Group] = []
        budget = math.inf if limit is None else limit
        q = self._pending
        get = self._blocks.get
        while q and budget > 0:  # bounded: each turn consumes a batch or the budget
            w, t, src, s, e = q[0]
            if e - s <= budget:
                q.popleft()
            else:
                cut = s + int(budget)
                q[0] = (w, t, src, cut, e)
                e = cut
            self._pending_n -= e - s
            budget -= e - s
            holder = self._holders.get(w)
            if holder is None:
                continue
            if type(src) is _Run:
                if src not in holder.runs:  # evicted, or its worker cleared since
                    continue
                keys = src.keys[s:e]
            else:
                keys = src[s:e]  # type: ignore[index]
            if not keys:
                continue
            if t is not None:
                prev = out[-1] if out else None
                if prev is not None and isinstance(prev[1], float) and prev[1] == t and prev[0] == w:
                    prev[2].fromlist(keys)  # the same access (the runs of one request): one group
                else:
                    out.append((w, t, array("q", keys)))
                continue
            bit = holder.bit
            ks: list[int] = []
            ts: list[float] = []
            pos: dict[_Run, dict[int, int]] = {}  # a run's offsets, built once per run met
            for h in keys:
                run = _run_of(get(h), bit)
                if run is None:
                    continue
                p = pos.get(run)
                if p is None:
                    p = pos[run] = {k: i for i, k in enumerate(run.keys)}
                ks.append(h)
                ts.append(run.times[p[h]])
            if ks:
                out.append((w, array("d", ts), array("q", ks)))
        return out

    def _replica_workers(self) -> Iterable[str]:
        return list(self._holders)

    def set_quiet(self, worker: str, quiet: bool) -> None:
        if quiet:
            self._quiet.add(worker)
        else:
            self._quiet.discard(worker)

    def store_token_blocks(
        self, worker: str, token_ids: Sequence[int], now: float, parent: int | None = None
    ) -> list[int]:
        self._gossip = False
        try:
            return RunPrefixIndex.store_token_blocks(self, worker, token_ids, now, parent)
        finally:
            self._gossip = True

    def _queue_held(self, worker: str, keys: Sequence[int]) -> None:
        self._queue_keys(worker, list(keys))  # at the times held when cut

    def _select(self, worker: str, slots: Collection[Slot] | None) -> tuple[list[int], list[float]]:
        holder = self._holders.get(worker)
        ks: list[int] = []
        ts: list[float] = []
        if holder is None:
            return ks, ts
        g = self._g
        for run in holder.runs:
            keys, times = run.keys, run.times
            if slots is not None:
                lo, hi = self.slot(min(times)), self.slot(max(times))
                if lo == hi:  # the run is in one slot: all or nothing (C-speed)
                    if lo not in slots:
                        continue
                else:
                    sel = [
                        i
                        for i, x in enumerate(times)
                        if (int(x // g) if g > 0 else x) in slots  # bounded by the run
                    ]
                    ks += [keys[i] for i in sel]
                    ts += [times[i] for i in sel]
                    continue
            ks += keys
            ts += times
        return ks, ts


def _merge_new(hs: Sequence[int], ts: Iterable[float], new: dict[int, float]) -> None:
    """Blocks no worker holds, into ``new`` with their times (a repeated one: its newest)."""
    if len(set(hs)) == len(hs):
        new.update(zip(hs, ts, strict=True))
        return
    for h, x in zip(hs, ts, strict=True):
        cur = new.get(h)
        if cur is None or x > cur:
            new[h] = x
