"""The KV event log: cache events grouped in numbered batches, a bounded history, live subscribers.

Sequence numbers start at 1 and increase by one per batch. A subscriber asking for
``start_sequence_number`` 0 gets live batches only (the proto's "start from current state"); a
positive number replays the batches still in the history from that number on, then live ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shepherd.mock_engine.cache import BlockStored, KvEvent


@dataclass(frozen=True, slots=True)
class KvBatch:
    sequence_number: int
    timestamp: float
    events: tuple[KvEvent, ...]


class KvSubscription:
    """One subscriber's queue. ``overflowed`` when it fell more than ``max_pending`` batches behind."""

    def __init__(self, log: KvEventLog, max_pending: int) -> None:
        self._log = log
        self._pending: deque[KvBatch] = deque()
        self._wake = asyncio.Event()
        self._max_pending = max_pending
        self.load_dirty = False
        self.overflowed = False
        self.closed = False

    def push(self, batch: KvBatch) -> None:
        if len(self._pending) >= self._max_pending:
            self.overflowed = True
        else:
            self._pending.append(batch)
        self._wake.set()

    def poke(self) -> None:
        self.load_dirty = True
        self._wake.set()

    async def wait(self, timeout: float | None) -> None:
        """Until a batch or a load change arrives, or ``timeout`` seconds pass."""
        if self._pending or self.overflowed or self.load_dirty:
            return
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    def take(self) -> list[KvBatch]:
        batches = list(self._pending)
        self._pending.clear()
        return batches

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._log.unsubscribe(self)


def _blocks_in(batch: KvBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))


class KvEventLog:
    """History bounded by batches and by stored blocks held (token ids are what costs memory)."""

    def __init__(self, history: int = 4096, history_blocks: int = 65_536, max_pending: int = 100_000) -> None:
        self._history: deque[KvBatch] = deque()
        self._history_limit = history
        self._history_blocks_limit = history_blocks
        self._history_blocks = 0
        self._next_seq = 1
        self._subscribers: set[KvSubscription] = set()
        self._max_pending = max_pending

    @property
    def last_sequence_number(self) -> int:
        return self._next_seq - 1

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, events: Sequence[KvEvent], timestamp: float) -> KvBatch | None:
        if not events:
            return None
        batch = KvBatch(self._next_seq, timestamp, tuple(events))
        self._next_seq += 1
        history = self._history
        history.append(batch)
        self._history_blocks += _blocks_in(batch)
        while len(history) > 1 and (
            len(history) > self._history_limit or self._history_blocks > self._history_blocks_limit
        ):
            self._history_blocks -= _blocks_in(history.popleft())
        for sub in self._subscribers:
            sub.push(batch)
        return batch

    def replay_from(self, start: int) -> list[KvBatch]:
        """Batches still held with ``sequence_number >= start`` (oldest first)."""
        if start <= 0 or not self._history:
            return []
        first = self._history[0].sequence_number
        if start <= first:
            return list(self._history)
        return [b for b in self._history if b.sequence_number >= start]

    def subscribe(self, start_sequence_number: int = 0) -> KvSubscription:
        sub = KvSubscription(self, self._max_pending)
        for batch in self.replay_from(start_sequence_number):
            sub.push(batch)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self._subscribers.discard(sub)

    def load_changed(self) -> None:
        for sub in self._subscribers:
            sub.poke()
