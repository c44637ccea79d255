"""Retransmit-limited broadcast queues (memberlist's TransmitLimitedQueue).

Every queued item is piggybacked on outgoing packets until it has been sent
``retransmit_mult * ceil(log10(n + 1))`` times (n = current cluster size, read at each ``get``).
Items sent the fewest times go first, and among those the newest first. Queuing an item under a
``key`` that is already queued replaces the older item (a newer update about the same member or
the same state entry obsoletes the older one). The queue is bounded: beyond ``max_items`` the
oldest, most-transmitted items are dropped.

``BroadcastQueue`` is the byte-payload flavour for a ``Delegate`` (the replicated state layer)::

    q = BroadcastQueue(retransmit_mult=4, num_nodes=lambda: swim.num_members())
    q.queue(payload, key="worker/w1")   # key=None: never replaced
    def broadcasts(self, budget: int) -> list[bytes]:   # Delegate method
        return q.get(budget)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from shepherd.mesh.swim_types import retransmit_limit
from shepherd.proto.mesh_messages import USER_MSG_OVERHEAD

T = TypeVar("T")


@dataclass(slots=True)
class _Item(Generic[T]):
    id: int
    key: str | None
    value: T
    size: int
    transmits: int = 0


class TransmitLimitedQueue(Generic[T]):
    """Items of type ``T`` with a wire ``size``, sent at most ``retransmit_limit`` times each."""

    def __init__(
        self, retransmit_mult: int = 4, num_nodes: Callable[[], int] | None = None, max_items: int = 4096
    ) -> None:
        self.retransmit_mult = retransmit_mult
        self.num_nodes: Callable[[], int] = num_nodes if num_nodes is not None else (lambda: 1)
        self.max_items = max_items
        # transmits -> {id: item}; dicts keep insertion (= id) order, newest last
        self._buckets: dict[int, dict[int, _Item[T]]] = {}
        self._by_key: dict[str, _Item[T]] = {}
        self._next_id = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:  # (asked before every datagram: one call, not len's two)
        return self._len > 0

    def limit(self) -> int:
        return retransmit_limit(self.retransmit_mult, self.num_nodes())

    def queue(self, value: T, size: int, key: str | None = None) -> None:
        """Queue ``value`` (``size`` wire bytes); replaces any queued item with the same ``key``."""
        if key is not None:
            self.invalidate(key)
        self._next_id += 1
        item = _Item(self._next_id, key, value, size)
        self._buckets.setdefault(0, {})[item.id] = item
        if key is not None:
            self._by_key[key] = item
        self._len += 1
        if self._len > self.max_items:
            self._prune(self.max_items)

    def invalidate(self, key: str) -> bool:
        """Drop the item queued under ``key``; True if there was one."""
        old = self._by_key.pop(key, None)
        if old is None:
            return False
        self._remove(old)
        return True

    def clear(self) -> None:
        self._buckets.clear()
        self._by_key.clear()
        self._len = 0

    def get(self, budget: int, overhead: int = 0) -> list[T]:
        """Items whose ``size + overhead`` fit in ``budget`` bytes, fewest-transmits then newest first."""
        if self._len == 0 or budget <= overhead:
            return []
        limit = self.limit()
        out: list[T] = []
        sent: list[_Item[T]] = []
        free = budget
        for transmits in sorted(self._buckets):
            for item in reversed(self._buckets[transmits].values()):
                need = item.size + overhead
                if need <= free:
                    free -= need
                    out.append(item.value)
                    sent.append(item)
            if free <= overhead:
                break
        for item in sent:
            self._remove(item)
            item.transmits += 1
            if item.transmits < limit:
                self._buckets.setdefault(item.transmits, {})[item.id] = item
                self._len += 1
                if item.key is not None:
                    self._by_key[item.key] = item
        return out

    def transmits(self, key: str) -> int | None:
        """How many times the item under ``key`` was sent (None if not queued)."""
        item = self._by_key.get(key)
        return None if item is None else item.transmits

    def _remove(self, item: _Item[T]) -> None:
        bucket = self._buckets.get(item.transmits)
        if bucket is None or bucket.pop(item.id, None) is None:
            return
        if not bucket:
            del self._buckets[item.transmits]
        if item.key is not None and self._by_key.get(item.key) is item:
            del self._by_key[item.key]
        self._len -= 1

    def _prune(self, keep: int) -> None:
        # drop the most transmitted first, and among those the oldest
        for transmits in sorted(self._buckets, reverse=True):
            for item in list(self._buckets[transmits].values()):
                if self._len <= keep:
                    return
                self._remove(item)


class BroadcastQueue:
    """User payloads for a ``Delegate``: ``get(budget)`` honours ``USER_MSG_OVERHEAD`` per payload."""

    def __init__(
        self, retransmit_mult: int = 4, num_nodes: Callable[[], int] | None = None, max_items: int = 4096
    ) -> None:
        self._q: TransmitLimitedQueue[bytes] = TransmitLimitedQueue(retransmit_mult, num_nodes, max_items)

    @property
    def num_nodes(self) -> Callable[[], int]:
        return self._q.num_nodes

    @num_nodes.setter
    def num_nodes(self, fn: Callable[[], int]) -> None:
        self._q.num_nodes = fn

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return self._q._len > 0

    def queue(self, payload: bytes, key: str | None = None) -> None:
        """Queue ``payload``; replaces a payload queued under the same ``key``."""
        self._q.queue(payload, len(payload), key)

    def invalidate(self, key: str) -> bool:
        return self._q.invalidate(key)

    def clear(self) -> None:
        self._q.clear()

    def get(self, budget: int) -> list[bytes]:
        """Payloads with ``sum(len(p) + USER_MSG_OVERHEAD) <= budget`` (the ``Delegate.broadcasts`` shape)."""
        return self._q.get(budget, USER_MSG_OVERHEAD)

    broadcasts = get
