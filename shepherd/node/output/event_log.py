"""The events of a streamed background Response, kept so that any client can read them again.

A background response created with ``stream: true`` runs in a task of its own, not in the request that
started it: the generation writes its SSE events into an ``EventLog`` (a stand-in for the HTTP response:
``prepare``, ``write``, ``write_eof``), and every reader (the request that created it, and each
``GET /v1/responses/{id}?stream=true&starting_after=N``) follows the log from the sequence number it
asks for, while the client that created it may go away without stopping it. Event ``i`` of the log is
the one whose ``sequence_number`` is ``i`` (the Responses encoder numbers its events from 0, one by one):
keep-alive comments written to it are not events and are dropped.

``stored()`` is the log as a response record keeps it (the events' text, up to ``max_bytes`` of it), so
that a reader on another node, or after the task ended, replays it from the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

__all__ = ["MAX_STORED_BYTES", "EventLog", "events_after", "split_events"]

# the events a record keeps (more: the stored log stops there, ``cut``): with the output, well within a
# mesh frame (16 MiB) when the record lives on another node
MAX_STORED_BYTES = 4 << 20


def split_events(data: bytes) -> list[bytes]:
    """The SSE events in ``data`` (each ``event: ...\\ndata: ...\\n\\n``), comments dropped."""
    return [block + b"\n\n" for block in data.split(b"\n\n") if block and not block.startswith(b":")]


class EventLog:
    """The events written so far, whether the writer is done, and readers waiting for more."""

    def __init__(self, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.events: list[bytes] = []
        self.visible = 0  # the events readers see (the last write's wait for ``close``)
        self.closed = False
        self._holding = False
        self.max_bytes = max_bytes
        self._stored_bytes = 0
        self._stored_n = 0  # the leading events within max_bytes (those ``stored`` gives)
        self._grew = asyncio.Event()
        self._partial = b""  # the start of an event a write cut in two (not expected: kept for the next)

    # ---- the writer's side (what Generation.stream calls on its response) ----

    prepared = True  # no headers to send: a reader's own response has them

    async def prepare(self, request: Any) -> None:
        return None

    async def write(self, data: bytes) -> None:
        self.add(data)

    async def write_eof(self, data: bytes = b"") -> None:
        """The last events: kept, but shown to readers only at ``close`` (the writer stores the end
        first, so that a reader that saw the terminal event finds it stored)."""
        self._holding = True
        self.add(data)

    def add(self, data: bytes) -> None:
        if self.closed or not data:
            return
        data = self._partial + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._partial = data
            return
        self._partial = data[end + 2 :]
        new = split_events(data[: end + 2])
        if not new:
            return
        for e in new:
            if self._stored_n == len(self.events) and self._stored_bytes + len(e) <= self.max_bytes:
                self._stored_n += 1
                self._stored_bytes += len(e)
            self.events.append(e)
        if not self._holding:
            self.visible = len(self.events)
            self._wake()

    def drop_held(self) -> int:
        """Forget the last write's events, not shown yet (the end they tell was not stored: a failure or
        a cancel tells another one); later writes are shown again. Returns how many events are left."""
        if self._holding and not self.closed:
            del self.events[self.visible :]
            self._stored_n = min(self._stored_n, self.visible)
            self._stored_bytes = sum(map(len, self.events[: self._stored_n]))
            self._holding = False
        return len(self.events)

    def close(self) -> None:
        """No more events: readers get every one and end."""
        if not self.closed:
            self.closed = True
            self.visible = len(self.events)
            self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    # ---- readers ----

    async def follow(self, after: int) -> AsyncIterator[list[bytes]]:
        """The events whose sequence number is above ``after``, in batches as they come, until the log
        is closed (bounded: each turn yields events or ends)."""
        i = max(0, after + 1)
        while True:
            if i < self.visible:
                batch = self.events[i : self.visible]
                i = self.visible
                yield batch
                continue
            if self.closed:
                return
            await self._grew.wait()

    def stored(self) -> list[str]:
        """The events a record keeps (their text, oldest first)."""
        return [e.decode() for e in self.events[: self._stored_n]]

    @property
    def stored_count(self) -> int:
        return self._stored_n

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    @property
    def cut(self) -> bool:
        """Whether the stored log stops before the last event (over ``max_bytes``)."""
        return self._stored_n < len(self.events)


def events_after(stored: Sequence[str], after: int) -> list[bytes]:
    """The stored events whose sequence number is above ``after``."""
    return [e.encode() for e in stored[max(0, after + 1) :]]
