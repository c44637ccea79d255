"""``NativeReplicatedPrefixIndex``: a mesh's replica of the prefix index with its state in C, what
``make_replica`` (the mesh state's index factory on a node) makes where the extension is built
(``NATIVE_INDEX``).

The same replica as ``prefix_replica.ReplicatedPrefixIndex`` (the wire, the delta and digest rules, the
validation of received groups: ``ReplicaApi``), on ``NativePrefixIndex``'s core with the replication
turned on (``Core.replicate``): the digest (per worker and time slot, the entry count and the sum of the
block names mod 2**64) follows every change of an entry inside the core; the delta buffer holds, per routing
decision, the blocks it made, and those it moved into another time slot once ``refresh_s`` old (in chain
order; younger ones stay in their slot), bounded by ``max_pending`` (the oldest batches go, whole). KV-event
inserts (``store_token_blocks``) and a quiet worker's (``set_quiet``) are never buffered. A batch is cut
by ``take_groups``: blocks no longer held by their worker, and batches of a worker cleared since, are
left out. Merges (``apply_groups``) set newer times and add new entries in the core; with ``relay`` what
they changed is buffered too, at the times held when cut.

Sparse replication (``set_turns``, ``--mesh-index-replication ends``): a routing decision of such a
worker buffers one turn end in ``_prefixcore.Turns`` (the name of the prompt's last full block, read from
the names the match made), received ones are kept there, and ``match`` raises each worker's walk to its
longest turn end of the prompt, in C over the same names (``policies.turn_ends``).

Differences from the Python replica, both by design of the layout: eviction is exact LRU (the run layout
evicts run tails), and a block buffered by a local insert and evicted before the batch is cut is not sent
(the Python replica sends the blocks it moved regardless). The property tests run both replicas through
the same checks (convergence under loss and reordering to the max-merge of flat references; the digest
equal to a recomputation after any update).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Collection, Iterable, Sequence

from shepherd.policies.block_names import CHAIN_SEED, block_hashes
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndexConfig
from shepherd.policies.prefix_replica import (
    IndexReplConfig,
    ReplicaApi,
    ReplicatedPrefixIndex,
    effective_refresh,
)
from shepherd.proto.index_wire import MAX_TURN_BLOCKS, Digest, Group, Slot, TurnBatch

with contextlib.suppress(ImportError):  # an install without a C compiler uses the Python replica
    from shepherd.policies._prefixcore import Turns

_DEAD = 0xFF  # a turn end's worker this index has no slot for (``Turns.put`` skips it)

__all__ = ["NativeReplicatedPrefixIndex", "Replica", "make_replica"]


def _q(b: bytes) -> array[int]:
    a = array("q")
    a.frombytes(b)
    return a


def _d(b: bytes) -> array[float]:
    a = array("d")
    a.frombytes(b)
    return a


def _h(b: bytes) -> array[int]:
    a = array("H")
    a.frombytes(b)
    return a


class NativeReplicatedPrefixIndex(ReplicaApi, NativePrefixIndex):
    """A ``NativePrefixIndex`` whose core keeps a digest and a delta buffer (see the module docstring)."""

    def __init__(self, config: PrefixIndexConfig | None = None, repl: IndexReplConfig | None = None) -> None:
        super().__init__(config)
        self.repl = repl or IndexReplConfig()
        self._g = self.repl.digest_granularity_s
        self._refresh = effective_refresh(self.config, self.repl)
        self._quiet = set()
        self._core.replicate(self._g, self.repl.max_pending, self.repl.relay, self._refresh)
        self.rejected = 0  # received entries dropped (too old or too far in the future)
        self._turns_of = set()
        self._turns = Turns(self.repl.turn_ends_max, self.repl.turn_ends_span_s, self.repl.max_pending)
        self._turns_kept = False  # any received turn end (else ``match`` skips the lookup)

    # -- digest -------------------------------------------------------------------------------------

    def _by_name(self, raw: dict[int, dict[Slot, tuple[int, int]]]) -> Digest:
        names = self._name_of
        return {n: d for s, d in raw.items() if (n := names[s]) is not None}

    def digest(self) -> Digest:
        """worker -> time slot -> (count, sum of block hashes mod 2**64), kept by the core as entries
        change."""
        return self._by_name(self._core.digest(False))

    def recompute_digest(self) -> Digest:
        """The digest from scratch (a check of the incremental one; O(entries))."""
        return self._by_name(self._core.digest(True))

    # -- gossip -------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return self._core.pending()[0] + (self._turns.stats()[1] if self._turns_of else 0)

    @property
    def pending_dropped(self) -> int:
        return self._core.pending()[1] + self._turns.stats()[2]

    # -- turn ends (sparse replication: ``policies.turn_ends``; the table is ``_prefixcore.Turns``) -----

    def set_turns(self, worker: str, on: bool) -> None:
        if on:
            self._turns_of.add(worker)
        else:
            self._turns_of.discard(worker)
        s = self._slot.get(worker)
        if s is not None:
            self._turns.set_send(s, on)

    def match(self, ids: Sequence[int]) -> dict[str, int]:
        """``NativePrefixIndex.match`` and, per worker, the longest received turn end of the prompt (looked
        up in C over the names the match made)."""
        self._named = None
        res = self._core.match_ids(ids)
        self._named, self._named_len = ids, len(ids)
        if self._turns_kept:
            self._turns.combine(self._core, res)
        return {w: n * BLOCK_TOKENS for w, n in res.items()}

    def insert(self, ids: Sequence[int], worker: str, now: float) -> None:
        named = ids is self._named and len(ids) == self._named_len
        NativePrefixIndex.insert(self, ids, worker, now)
        if worker not in self._turns_of or len(ids) < BLOCK_TOKENS:
            return
        s = self._slot.get(worker)
        if s is None:
            return
        if named:  # the names the match made, the worker's capacity applied (as the insert did)
            self._turns.note_named(self._core, s, now)
        else:
            hs = self.hashes(ids)
            n = min(len(hs), self.capacity(worker), MAX_TURN_BLOCKS)
            self._turns.note(s, hs[n - 1], n, now)

    def take_turns(self) -> TurnBatch | None:
        kb, nb, sb, tb = self._turns.take()
        if not sb:
            return None
        names = self._name_of
        used = sorted(set(sb))
        table = bytearray(256)
        for i, s in enumerate(used):
            table[s] = i
        return TurnBatch(max(_d(tb)), [names[s] or "" for s in used], sb.translate(table), _q(kb), _h(nb))

    @property
    def turn_ends(self) -> int:
        return int(self._turns.stats()[0])

    def _put_turns(self, batch: TurnBatch) -> int:
        table = bytearray([_DEAD]) * 256
        ws = batch.workers
        for i in set(batch.widx):  # a slot only for a worker some record names (a listed name alone
            s = self._slot_of(ws[i])  # would take one of the 64 for nothing)
            if s is not None:
                table[i] = s
        kept = int(self._turns.put(batch.keys, batch.blocks, batch.widx.translate(table), batch.time))
        self._turns_kept = self._turns_kept or kept > 0
        return kept

    def clear_worker(self, worker: str) -> None:
        s = self._slot.get(worker)
        if s is not None:
            self._turns.clear(s)  # its records and buffered turn ends (the slot may serve another next)
        NativePrefixIndex.clear_worker(self, worker)

    def expire(self, now: float, budget: int = 4096) -> int:
        self._turns.expire(now - min(self.config.max_age_s, self.repl.turn_ends_span_s))
        return NativePrefixIndex.expire(self, now, budget)

    def take_groups(self, limit: int | None = None) -> list[Group]:
        """The buffered deltas, oldest first (at most ``limit`` entries; the rest stay), as groups
        (worker, time, blocks); one request's blocks leave as one group."""
        out: list[Group] = []
        names = self._name_of
        for s, t, kb, tb in self._core.take(-1 if limit is None else max(0, limit)):  # -1: all
            w = names[s]
            if w is None:  # pragma: no cover - the core skips the batches of a cleared slot
                continue
            keys = _q(kb)
            if t is None:
                assert tb is not None
                out.append((w, _d(tb), keys))
                continue
            prev = out[-1] if out else None
            if prev is not None and isinstance(prev[1], float) and prev[1] == t and prev[0] == w:
                prev[2].extend(keys)
            else:
                out.append((w, t, keys))
        return out

    def _replica_workers(self) -> Iterable[str]:
        return self.workers

    def set_quiet(self, worker: str, quiet: bool) -> None:
        if quiet:
            self._quiet.add(worker)
        else:
            self._quiet.discard(worker)
        s = self._slot.get(worker)
        if s is not None:
            self._core.set_quiet(s, quiet)

    def _add_slot(self, worker: str) -> int | None:
        s = NativePrefixIndex._add_slot(self, worker)
        if s is not None and worker in self._quiet:
            self._core.set_quiet(s, True)
        if s is not None and worker in self._turns_of:
            self._turns.set_send(s, True)
        return s

    def store_token_blocks(
        self, worker: str, token_ids: Sequence[int], now: float, parent: int | None = None
    ) -> list[int]:
        hs = block_hashes(token_ids, CHAIN_SEED if parent is None else parent)
        s = self._slot_of(worker) if hs else None
        if s is not None:
            self._core.insert(hs, s, now, False)  # an engine's event: never buffered for gossip
        return hs

    def _queue_held(self, worker: str, keys: Sequence[int]) -> None:
        self._core.queue(self._slot[worker], keys)

    def _select(self, worker: str, slots: Collection[Slot] | None) -> tuple[array[int], array[float]]:
        s = self._slot.get(worker)
        if s is None:
            return array("q"), array("d")
        kb, tb = self._core.entries(s)
        keys, times = _q(kb), _d(tb)
        if slots is None:
            return keys, times
        slot = self.slot
        sel = [i for i, x in enumerate(times) if slot(x) in slots]  # bounded by the worker's entries
        return array("q", [keys[i] for i in sel]), array("d", [times[i] for i in sel])

    # -- merges (``merge`` is NativePrefixIndex's: the core keeps the digest) ------------------------

    def _merge_group(self, worker: str, t: float | array[float], hs: Sequence[int]) -> int:
        """Max-merge blocks ``hs`` of ``worker`` at ``t`` (one time, or one per block); returns how many
        entries changed. Names outside 64 bits are never held (skipped)."""
        return self._merge_worker(worker, hs, [t] * len(hs) if isinstance(t, float) else t) if len(hs) else 0


Replica = ReplicatedPrefixIndex | NativeReplicatedPrefixIndex
"""Either replica (``make_replica`` makes the native one where the extension is built)."""


def make_replica(config: PrefixIndexConfig | None = None, repl: IndexReplConfig | None = None) -> Replica:
    """A new replica of a model's prefix index: the native layout where the extension is built, the run
    layout otherwise. What a node gives ``MeshState`` as its index factory (one call per model), e.g.
    ``MeshState(name, clock, new_index=lambda: make_replica(config, repl))``."""
    layout = NativeReplicatedPrefixIndex if NATIVE_INDEX else ReplicatedPrefixIndex
    return layout(config, repl)
