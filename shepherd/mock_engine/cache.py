"""Simulated paged prefix KV cache: chained block hashes, reference counts, LRU eviction, KV events.

A pure state machine (no I/O, no clock). The pool has ``capacity_blocks`` blocks of ``block_size``
tokens. A block is either *hashed* (a full block of a token sequence, in the prefix tree, found by
its chained hash) or *private* (held by a running sequence for its partial tail and its output, not
findable). Hashed blocks that no sequence references are *evictable* and kept in LRU order; a block
is evicted only to make room, least recently used first.

Hashes are chained: ``hash_i = H(hash_{i-1}, block_i)`` with ``H`` Python's tuple hash of
``(parent_hash, token_tuple)`` (deterministic across processes for ints; measured 0.8 µs per
16-token block against 2.2 µs for ``blake2b(digest_size=8)``). The hash of a block therefore names
its whole prefix, and a lookup walks blocks from the start until the first miss.

Invariant kept by the order of LRU updates (chains are touched leaf-first, so ancestors land after
their descendants): a block reaches the front of the LRU only after all of its descendants have
left it, so eviction always removes leaves and the tree stays prefix-closed. Every change to the
set of hashed blocks is recorded as a KV event with an increasing ``event_id``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT_HASH = 0  # the parent hash of the first block (published as "no parent")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one chain were stored; ``parent_hash`` is None for a chain's first block."""

    event_id: int
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[tuple[int, ...], ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    event_id: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class CacheStats:
    capacity_blocks: int
    block_size: int
    hashed_blocks: int
    evictable_blocks: int
    private_blocks: int
    lookup_tokens: int
    hit_tokens: int
    stored_blocks_total: int
    evicted_blocks_total: int

    @property
    def used_blocks(self) -> int:
        """Blocks that cannot be reclaimed now: referenced hashed blocks plus private ones."""
        return self.hashed_blocks - self.evictable_blocks + self.private_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(slots=True)
class Allocation:
    """What one sequence holds in the pool: a locked chain of hashed blocks and some private blocks."""

    chain: list[int]  # hashes of the locked hashed blocks, root first
    cached_tokens: int  # prompt tokens found in the cache at allocation time
    private_blocks: int
    released: bool = False


@dataclass(slots=True)
class _Block:
    parent: int
    tokens: tuple[int, ...]
    refs: int = 0
    children: int = 0


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    out: list[int] = []
    ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[start : start + block_size]))
        out.append(parent)
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class PrefixCache:
    """The KV block pool of one engine. See the module docstring for the model."""

    def __init__(self, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks <= 0 or block_size <= 0:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashed blocks with refs == 0, LRU first
        self._private = 0
        self._events: list[KvEvent] = []
        self._next_event_id = 1
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._stored_total = 0
        self._evicted_total = 0

    # ---- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - len(self._blocks) - self._private

    @property
    def reclaimable_blocks(self) -> int:
        """Blocks an allocation may use: free ones plus evictable ones."""
        return self.free_blocks + len(self._lru)

    @property
    def used_blocks(self) -> int:
        return len(self._blocks) - len(self._lru) + self._private

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Hashes of the longest cached run of full blocks at the start of ``token_ids`` (no side effect)."""
        out: list[int] = []
        ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        parent = ROOT_HASH
        bs = self.block_size
        blocks = self._blocks
        for start in range(0, len(ids) - bs + 1, bs):
            parent = hash((parent, ids[start : start + bs]))
            if parent not in blocks:
                break
            out.append(parent)
        return out

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens at the start of ``token_ids`` that are cached (a multiple of the block size)."""
        return len(self.match_prefix(token_ids)) * self.block_size

    def stats(self) -> CacheStats:
        return CacheStats(
            capacity_blocks=self.capacity_blocks,
            block_size=self.block_size,
            hashed_blocks=len(self._blocks),
            evictable_blocks=len(self._lru),
            private_blocks=self._private,
            lookup_tokens=self._lookup_tokens,
            hit_tokens=self._hit_tokens,
            stored_blocks_total=self._stored_total,
            evicted_blocks_total=self._evicted_total,
        )

    def lru_order(self) -> list[int]:
        """Evictable block hashes, next victim first (for tests and debugging)."""
        return list(self._lru)

    def block_parent(self, block_hash: int) -> int | None:
        b = self._blocks.get(block_hash)
        return None if b is None else b.parent

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- primitive operations -------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Cached prefix tokens of ``token_ids``; counts toward the hit rate and refreshes the LRU."""
        chain = self.match_prefix(token_ids)
        self._lookup_tokens += len(token_ids)
        self._hit_tokens += len(chain) * self.block_size
        self._touch(chain)
        return len(chain) * self.block_size

    def insert(self, token_ids: Sequence[int]) -> list[int]:
        """Store every full block of ``token_ids`` (unreferenced), evicting LRU blocks to make room.

        Returns the chain of hashes now cached (shorter than the full blocks when the pool is full of
        referenced blocks). The chain becomes the most recently used.
        """
        chain, _ = self._extend(token_ids, [], private_budget=0)
        self._unlock(chain)
        return chain

    def clear(self) -> bool:
        """Drop every hashed block. Refused (False) while any block is referenced or private."""
        if self._private or len(self._lru) != len(self._blocks):
            return False
        self._blocks.clear()
        self._lru.clear()
        self._emit_cleared()
        return True

    # ---- allocation for running sequences --------------------------------------------------------

    def allocate(self, prompt_ids: Sequence[int], total_tokens: int) -> Allocation | None:
        """Reserve the blocks one sequence of ``total_tokens`` (prompt + output) will occupy.

        The cached prefix is locked, the prompt's remaining full blocks are stored (hashed, locked) and
        the rest is reserved as private blocks. Returns None, changing nothing, when the pool cannot
        hold it even after evicting every unreferenced block. Counts toward the hit rate.
        """
        allocs = self.allocate_group(prompt_ids, (total_tokens,))
        return None if allocs is None else allocs[0]

    def allocate_group(self, prompt_ids: Sequence[int], totals: Sequence[int]) -> list[Allocation] | None:
        """``allocate`` for several sequences sharing one prompt (n > 1): the prompt is stored once.

        All or nothing: None, changing nothing, when the pool cannot hold them all.
        """
        bs = self.block_size
        ids = prompt_ids if isinstance(prompt_ids, tuple) else tuple(prompt_ids)
        matched = self.match_prefix(ids)
        full_prompt_blocks = len(ids) // bs
        per_seq = [max(blocks_for(t, bs), full_prompt_blocks) for t in totals]
        need = (full_prompt_blocks - len(matched)) + sum(per_seq) - full_prompt_blocks * len(per_seq)
        if need > self.free_blocks:
            # the matched blocks that are evictable now stop being reclaimable once locked
            pool = self._blocks
            matched_evictable = sum(1 for h in matched if pool[h].refs == 0)
            if need > self.reclaimable_blocks - matched_evictable:
                return None
        self._lookup_tokens += len(ids)
        self._hit_tokens += len(matched) * bs
        self._lock(matched)
        self._make_room(need)
        chain = matched
        if full_prompt_blocks > len(matched):
            chain, _ = self._extend(ids, list(matched), private_budget=0)
        allocs = [
            Allocation(chain=chain, cached_tokens=len(matched) * bs, private_blocks=per_seq[0] - len(chain))
        ]
        for blocks in per_seq[1:]:
            self._lock(chain)
            allocs.append(
                Allocation(
                    chain=list(chain), cached_tokens=len(matched) * bs, private_blocks=blocks - len(chain)
                )
            )
        self._private += sum(a.private_blocks for a in allocs)
        return allocs

    def release(self, alloc: Allocation, final_ids: Sequence[int] | None = None) -> None:
        """Give back a sequence's blocks. With ``final_ids`` (prompt + output) its full blocks are cached.

        Blocks past the locked chain are converted from the sequence's private blocks; a block that is
        already cached elsewhere frees the private block instead. Idempotent.
        """
        if alloc.released:
            return
        alloc.released = True
        chain = alloc.chain
        if final_ids is not None and alloc.private_blocks:
            chain, used = self._extend(final_ids, list(chain), private_budget=alloc.private_blocks)
            alloc.private_blocks -= used
        self._private -= alloc.private_blocks
        alloc.private_blocks = 0
        self._unlock(chain)

    # ---- internals -------------------------------------------------------------------------------

    def _extend(
        self, token_ids: Sequence[int], chain: list[int], *, private_budget: int
    ) -> tuple[list[int], int]:
        """Store and lock the full blocks of ``token_ids`` past ``chain`` (a locked prefix of it).

        Each new block takes one of ``private_budget`` private blocks while they last, else a free one
        (evicting if needed); storing stops when no block is available. Existing blocks on the way are
        locked and, while the budget lasts, free a private block each (the sequence's own copy is not
        needed). Locking as it goes keeps the parent of the next block from being evicted. Returns the
        extended chain and the private blocks used.
        """
        bs = self.block_size
        ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        parent = chain[-1] if chain else ROOT_HASH
        budget = private_budget
        stored_hashes: list[int] = []
        stored_tokens: list[tuple[int, ...]] = []
        stored_parent = parent
        blocks = self._blocks
        for start in range(len(chain) * bs, len(ids) - bs + 1, bs):
            tokens = ids[start : start + bs]
            h = hash((parent, tokens))
            existing = blocks.get(h)
            if existing is not None:
                if budget:
                    budget -= 1
                    self._private -= 1
                self._lock_one(h, existing)
                self._flush_stored(stored_hashes, stored_tokens, stored_parent)
                stored_hashes, stored_tokens, stored_parent = [], [], h
            else:
                if budget:
                    budget -= 1
                    self._private -= 1
                elif not self._make_room(1):
                    break
                pb = blocks.get(parent)
                if pb is not None:
                    pb.children += 1
                blocks[h] = _Block(parent=parent, tokens=tokens, refs=1)
                stored_hashes.append(h)
                stored_tokens.append(tokens)
                self._stored_total += 1
            chain.append(h)
            parent = h
        self._flush_stored(stored_hashes, stored_tokens, stored_parent)
        return chain, private_budget - budget

    def _flush_stored(self, hashes: list[int], tokens: list[tuple[int, ...]], parent: int) -> None:
        if hashes:
            self._events.append(
                BlockStored(
                    event_id=self._next_event_id,
                    block_hashes=tuple(hashes),
                    parent_hash=None if parent == ROOT_HASH else parent,
                    token_ids=tuple(tokens),
                    block_size=self.block_size,
                )
            )
            self._next_event_id += 1

    def _make_room(self, n: int) -> bool:
        """Evict LRU blocks until ``n`` blocks are free; False (having evicted what it could) if not."""
        short = n - self.free_blocks
        if short <= 0:
            return True
        removed: list[int] = []
        lru = self._lru
        blocks = self._blocks
        while short > 0 and lru:
            h, _ = lru.popitem(last=False)
            b = blocks.pop(h)
            # a block with cached children is never at the LRU front (see module docstring)
            assert b.children == 0, "evicting a block with children"
            pb = blocks.get(b.parent)
            if pb is not None:
                pb.children -= 1
            removed.append(h)
            short -= 1
        if removed:
            self._evicted_total += len(removed)
            self._events.append(BlockRemoved(event_id=self._next_event_id, block_hashes=tuple(removed)))
            self._next_event_id += 1
        return short <= 0

    def _emit_cleared(self) -> None:
        self._events.append(AllBlocksCleared(event_id=self._next_event_id))
        self._next_event_id += 1

    def _touch(self, chain: Iterable[int]) -> None:
        """Mark a chain most recently used, leaf first so that ancestors end up after descendants."""
        lru = self._lru
        for h in reversed(list(chain)):
            if h in lru:
                lru.move_to_end(h)

    def _lock(self, chain: Sequence[int]) -> None:
        blocks = self._blocks
        lru = self._lru
        for h in chain:
            block = blocks[h]
            if block.refs == 0:
                del lru[h]
            block.refs += 1

    def _lock_one(self, h: int, block: _Block) -> None:
        if block.refs == 0:
            self._lru.pop(h, None)
        block.refs += 1

    def _unlock(self, chain: Sequence[int]) -> None:
        """Drop one reference on each block of a chain, leaf first (ancestors enter the LRU last)."""
        blocks = self._blocks
        lru = self._lru
        for h in reversed(chain):
            b = blocks[h]
            b.refs -= 1
            if b.refs == 0:
                lru[h] = None
