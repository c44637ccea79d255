"""An engine's KV cache events for one worker, applied to the prefix index.

Engines name their blocks with hashes of their own (vLLM salts them per process), so the index names
the blocks itself, from the token ids each "stored" event carries, chained from the parent block's
name; this class remembers engine hash -> index names to find parents and to apply removals.
Engine block sizes that are multiples of 16 tokens are supported (an engine block of 16·m tokens is
m index blocks). The map is bounded: it never holds more than ``max_blocks`` engine blocks (oldest
dropped first), so lost "removed" events cannot make it grow without end.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        self.max_blocks = max_blocks
        self._names: dict[int, tuple[int, ...]] = {}

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
            seed = names[-1]
        mine = self.index.store_token_blocks(self.worker, token_ids, now, parent=seed)
        m = self.per_block
        for i, eh in enumerate(engine_hashes):
            chunk = tuple(mine[i * m : (i + 1) * m])
            if len(chunk) < m:  # the event carried fewer tokens than its blocks need
                break
            self._names[eh] = chunk
        while len(self._names) > self.max_blocks:  # bounded: one drop per turn
            del self._names[next(iter(self._names))]
        return True

    def removed(self, engine_hashes: Sequence[int]) -> None:
        gone = [n for eh in engine_hashes for n in self._names.pop(eh, ())]
        self.index.remove_blocks(gone, self.worker)

    def cleared(self) -> None:
        self._names.clear()
        self.index.clear_worker(self.worker)

    def __len__(self) -> int:
        return len(self._names)
