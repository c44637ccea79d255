"""Naming a prompt's 16-token blocks: ``block_hashes`` (in C where built), and a memo over the pieces a
prompt was built from.

``block_hashes(ids)`` names every full 16-token block of a prompt by a chained hash,
``h_i = hash((h_{i-1}, tuple(block_i)))`` from ``CHAIN_SEED``. ``py_block_hashes`` is the reference: ~0.3 µs
a block in CPython (a 16-tuple, a pair and two tuple hashes per block), ~25 µs for a 1,300-token prompt.
``_prefixcore.c`` computes the same values (CPython's tuple and int hashes, folded without building the
tuples; property-tested equal on any ints and seeds) at about the cost of ``sum(ids)``: reading the ids
is then most of it. ``block_hashes`` is the C version where setup.py could build it (``NATIVE_NAMES``).

The tokenizer layer already splits a prompt into pieces it looks up by text (the L1 segments after each
special token, or the whole text on an L0 hit), and CPython caches a string's hash: so a follow-up turn
of a conversation, whose pieces repeat those of the turn before, can be named piece by piece without
reading its ids at all.

``PromptIds`` (``shepherd.proto.prompt_ids``, what the token caches hand over) is a list of ids that also
carries its *shape*: ``(key, n)`` pairs, the pieces it was built from in order (``key`` a string that
determines the piece's ids; ``n`` its number of ids). ``BlockNamer`` remembers, per chain of piece keys,
the block hashes that end inside each piece: a prompt whose first k pieces were seen before costs k dict
lookups for them, and only the ids after them are hashed. The result is always exactly
``block_hashes(ids)`` (property-tested): the memo is keyed by the exact chain of piece keys (equality,
not a digest), a key's ids never change for one tokenizer (one namer per model), and a shape that does
not add up to ``len(ids)`` is ignored.

Memory is bounded by entries and by hashes kept (oldest first out).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from shepherd.proto.prompt_ids import shape_of

BLOCK = 16
HashFn = Callable[[Sequence[int], int, int], list[int]]  # block_hashes(ids, seed, start)
CHAIN_SEED = 0x5EED_0F_B10C5
_LIST_ITER: type[object] = type(iter([]))


def py_block_hashes(ids: Sequence[int], seed: int = CHAIN_SEED, start: int = 0) -> list[int]:
    """Chained hashes of the full 16-token blocks of ``ids[start:]`` (a partial last block is not named):
    ``h_i = hash((h_{i-1}, tuple(block_i)))`` from ``seed``. The reference (and the fallback when the C
    module ``_prefixcore`` is not built): ``block_hashes`` is the C version where there is one.

    ``seed`` is the hash of the block before ``ids[start]``: pass a parent's hash to continue its chain.
    A list (or list subclass) is read from ``start`` without a copy.
    """
    h = seed
    it = iter(ids)
    if start:
        if type(it) is _LIST_ITER:
            it.__setstate__(start)  # type: ignore[attr-defined]  # a list iterator's position: O(1)
        else:
            it = iter(ids[start:])
    # 16 references to one iterator: zip yields consecutive 16-tuples (C speed, no slicing)
    return [
        h := hash((h, b))
        for b in zip(it, it, it, it, it, it, it, it, it, it, it, it, it, it, it, it, strict=False)
    ]


try:  # the same function in C (``_prefixcore.c``, built by setup.py where a compiler is): ~sum(ids)'s cost
    from shepherd.policies._prefixcore import block_hashes
except ImportError:  # pragma: no cover - an install without a C compiler
    block_hashes = py_block_hashes

NATIVE_NAMES = block_hashes is not py_block_hashes

__all__ = [
    "BLOCK",
    "CHAIN_SEED",
    "NATIVE_NAMES",
    "BlockNamer",
    "block_hashes",
    "py_block_hashes",
]


class BlockNamer:
    """``block_hashes`` with a memo over piece chains (see the module docstring)."""

    def __init__(
        self,
        hash_fn: HashFn,
        seed: int,
        *,
        max_entries: int = 16_384,
        max_hashes: int = 1 << 18,
    ) -> None:
        self._hash = hash_fn
        self._seed = seed
        self.max_entries = max_entries
        self.max_hashes = max_hashes
        # (parent node, piece key) -> (node, hashes of the blocks that end inside the piece, its id count);
        # the hashes as the int objects the index holds too (a dict lookup of the same object skips the
        # comparison; int64 arrays measured no faster: a hit then makes fresh ints)
        self._memo: dict[tuple[int, str], tuple[int, tuple[int, ...], int]] = {}
        self._kept = 0  # hashes held by the memo
        self._ids = itertools.count(1)
        self.hits = 0  # pieces named from the memo
        self.misses = 0

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def kept_hashes(self) -> int:
        return self._kept

    def names(self, ids: Sequence[int]) -> list[int]:
        """``block_hashes(ids)``; through the memo when ``ids`` carry a shape that adds up."""
        shape = shape_of(ids)
        if not shape:
            return self._hash(ids, self._seed, 0)
        get = self._memo.get
        out: list[int] = []
        parent = 0
        pos = 0
        k = 0
        for key, n in shape:
            e = get((parent, key))
            if e is None:
                break
            if e[2] != n:  # the same key for another number of ids: not a shape to trust
                return self._hash(ids, self._seed, 0)
            parent = e[0]
            out += e[1]
            pos += n
            k += 1
        self.hits += k
        if k == len(shape):
            if pos != len(ids):  # a shape that does not describe these ids: name them plainly
                return self._hash(ids, self._seed, 0)
            return out
        self.misses += len(shape) - k
        total = pos
        for _, n in shape[k:]:
            total += n
        if total != len(ids):
            return self._hash(ids, self._seed, 0)
        done = len(out)  # blocks named so far: those that end within the first pos ids
        out += self._hash(ids, out[-1] if out else self._seed, done * BLOCK)  # the rest (no slice)
        memo = self._memo
        # remember the new pieces: each gets the blocks that end inside it
        for key, n in shape[k:]:
            pos += n
            end = pos // BLOCK
            own = tuple(out[done:end])
            node = next(self._ids)
            memo[(parent, key)] = (node, own, n)
            self._kept += len(own)
            parent, done = node, end
        self._bound()
        return out

    def _bound(self) -> None:
        memo = self._memo
        if len(memo) <= self.max_entries and self._kept <= self.max_hashes:
            return
        # oldest first, down to a sixteenth below the bounds: in bulk, since taking the first key of a
        # dict whose front was deleted scans those dead slots (one at a time that cost grew with the
        # memo: most of a named follow-up's time once the memo was full). A piece still in use is
        # simply named again and re-entered; a dropped inner piece only makes its descendants
        # unreachable until they age out: correctness never depends on what is kept
        entries = self.max_entries - self.max_entries // 16
        hashes = self.max_hashes - self.max_hashes // 16
        n, kept = len(memo), self._kept
        drop: list[tuple[int, str]] = []
        for key, (_, own, _) in memo.items():  # bounded by the memo
            if n <= entries and kept <= hashes:
                break
            drop.append(key)
            n -= 1
            kept -= len(own)
        for key in drop:
            del memo[key]
        self._kept = kept
