"""An engine's KV cache events for one worker, applied to the prefix index.

Engines name their blocks with hashes of their own (vLLM salts them per process; the mock engine uses
``hash((parent, tokens))`` from a root of its own), so the index never uses them as names: it names the
blocks itself, from the token ids each "stored" event carries, chained from the parent block's name;
this class remembers engine hash -> index names to find parents and to apply removals. Engine block
sizes that are multiples of 16 tokens are supported (an engine block of 16·m tokens is m index blocks).

The map is bounded: it never holds more than ``max_blocks`` engine blocks, so lost "removed" events
cannot make it grow without end. Past the bound the oldest entries go, a sixteenth of the bound at a
time: dropping them one by one from the front of a dict costs a scan of the dict's dead slots each
time (measured: 37 µs per stored block at 65,536 entries), in bulk it is amortized to a few ns.

``NativeKvApplier`` is the same applier with the map in C (``_prefixcore.KvMap``: the same entries in
the same order, the same bound), for a ``NativePrefixIndex``: ``apply_wire`` applies a batch's events
from the bytes of its message (``kv_codec.WireEvents``) in one call, names and inserts in the index's
core, no Python object per event, block or token (``bench/kv_events_bench.py``, a fleet-shaped stream:
217.7K instructions per event over protobuf's parse and this module's Python, 52.3K from the bytes).
Events it hands back (a "cleared", another block size, the worker's first slot) go through ``stored``,
``removed`` and ``cleared``, as here.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import TypeGuard

from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex

if NATIVE_INDEX:
    from shepherd.policies._prefixcore import KvMap


class _Blocks:
    """What both appliers check and keep: the worker, engine blocks of ``per_block`` index blocks, and
    at most ``max_blocks`` engine hashes mapped."""

    def __init__(self, worker: str, block_size: int, max_blocks: int) -> None:
        if block_size <= 0 or block_size % BLOCK_TOKENS:
            raise ValueError(f"engine block size {block_size} is not a multiple of {BLOCK_TOKENS}")
        self.worker = worker
        self.per_block = block_size // BLOCK_TOKENS
        self.max_blocks = max(1, max_blocks)


class KvEventApplier(_Blocks):
    def __init__(
        self, index: PrefixIndex, worker: str, block_size: int = 16, max_blocks: int = 1 << 18
    ) -> None:
        super().__init__(worker, block_size, max_blocks)
        self.index = index
        # engine hash -> the index's name of it (16-token engine blocks) or names (16·m tokens)
        self._names: dict[int, int | tuple[int, ...]] = {}

    def stored(
        self, engine_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], now: float
    ) -> bool:
        """Blocks ``engine_hashes`` (tokens ``token_ids``, in order) were cached after engine block
        ``parent`` (None: at the start of a sequence). False if the parent is unknown (not applied)."""
        if parent is None:
            seed = None
        else:
            names = self._names.get(parent)
            if names is None:
                return False
            seed = names if isinstance(names, int) else names[-1]
        mine = self.index.store_token_blocks(self.worker, token_ids, now, parent=seed)
        # an event carrying fewer tokens than its blocks need maps only its full blocks (zip stops)
        if self.per_block == 1:
            self._names.update(zip(engine_hashes, mine, strict=False))
        else:
            it = iter(mine)
            self._names.update(zip(engine_hashes, zip(*[it] * self.per_block, strict=False), strict=False))
        over = len(self._names) - self.max_blocks
        if over > 0:
            names_map = self._names
            for eh in list(islice(names_map, over + self.max_blocks // 16)):  # bounded by the map
                del names_map[eh]
        return True

    def removed(self, engine_hashes: Sequence[int]) -> None:
        pop = self._names.pop
        gone: list[int] = []
        for eh in engine_hashes:
            names = pop(eh, None)
            if names is None:
                continue
            if isinstance(names, int):
                gone.append(names)
            else:
                gone += names
        self.index.remove_blocks(gone, self.worker)

    def cleared(self) -> None:
        self._names.clear()
        self.index.clear_worker(self.worker)

    def __len__(self) -> int:
        return len(self._names)


def native_kv_ok(index: PrefixIndex) -> TypeGuard[NativePrefixIndex]:
    """Whether ``NativeKvApplier`` may apply events to ``index`` in its core: a ``NativePrefixIndex`` (or
    the mesh's native replica) whose KV-event updates are the ones the C path does (a subclass that hooks
    them takes the Python path)."""
    if not NATIVE_INDEX or not isinstance(index, NativePrefixIndex):
        return False
    cls = type(index)
    store = cls.store_token_blocks
    return (
        (
            store is NativeReplicatedPrefixIndex.store_token_blocks
            or (
                store is PrefixIndex.store_token_blocks
                and cls.insert_blocks is NativePrefixIndex.insert_blocks
            )
        )
        and cls.remove_blocks is NativePrefixIndex.remove_blocks
        and cls._slot_of is NativePrefixIndex._slot_of
    )


class NativeKvApplier(_Blocks):
    """``KvEventApplier`` with its map in C, for an index ``native_kv_ok`` accepts (see the module
    docstring). Engine hashes are 64-bit (what the wire carries)."""

    def __init__(
        self, index: NativePrefixIndex, worker: str, block_size: int = 16, max_blocks: int = 1 << 18
    ) -> None:
        super().__init__(worker, block_size, max_blocks)
        self.index = index
        self._map = KvMap(self.per_block, self.max_blocks)

    def stored(
        self, engine_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], now: float
    ) -> bool:
        if parent is None:
            seed = None
        else:
            seed = self._map.seed(parent)
            if seed is None:
                return False
        mine = self.index.store_token_blocks(self.worker, token_ids, now, parent=seed)
        self._map.put(engine_hashes, mine)
        return True

    def removed(self, engine_hashes: Sequence[int]) -> None:
        self.index.remove_blocks(self._map.pop(engine_hashes), self.worker)

    def cleared(self) -> None:
        self._map.clear()
        self.index.clear_worker(self.worker)

    def apply_wire(self, raw: bytes, start: int, now: float) -> tuple[int, int, int, int, int, int]:
        """The events of ``raw`` (a serialized ``KvEventBatch``) from byte ``start``, applied in C up to the
        first it hands back: (its start or -1 when none, its end, events, stored blocks, removed blocks,
        unknown parents), as ``KvMap.apply``."""
        ix = self.index
        return self._map.apply(ix._core, raw, start, ix._slot.get(self.worker, -1), now)

    def engine_hashes(self) -> list[int]:
        """The mapped engine hashes, oldest first (the order ``KvEventApplier``'s dict keeps)."""
        return self._map.keys()

    def __len__(self) -> int:
        return len(self._map)
