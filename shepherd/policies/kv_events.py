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
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex


class KvEventApplier:
    def __init__(
        self, index: PrefixIndex, worker: str, block_size: int = 16, max_blocks: int = 1 << 18
    ) -> None:
        if block_size <= 0 or block_size % BLOCK_TOKENS:
            raise ValueError(f"engine block size {block_size} is not a multiple of {BLOCK_TOKENS}")
        self.index = index
        self.worker = worker
        self.per_block = block_size // BLOCK_TOKENS
        self.max_blocks = max(1, max_blocks)
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
