"""The asyncio shell of a lean HTTP/2 client connection: ``H2Protocol``.

The ``asyncio.Protocol`` around one ``H2Connection`` (h2_conn.py): readiness once the server's SETTINGS
arrive, waiting for a stream slot, keepalive pings, closing a drained connection, and frames written
during one loop iteration coalesced into one ``transport.write``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import cast

from shepherd.node.engines.h2_conn import H2Connection
from shepherd.node.engines.h2_frames import LOCAL_WINDOW, NO_ERROR


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection on an asyncio transport; all protocol logic lives in ``H2Connection``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        local_window: int = LOCAL_WINDOW,
        keepalive_s: float = 60.0,
        keepalive_timeout_s: float = 20.0,
        coalesce_writes: bool = True,
    ) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.conn = H2Connection(self._write, self, local_window=local_window)
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._keepalive: asyncio.TimerHandle | None = None
        self._rx = False
        self._ping_sent: float | None = None
        self._coalesce = coalesce_writes
        self._wbuf: list[bytes] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports don't subclass it
        self.conn.start()
        if self._keepalive_s > 0:
            self._keepalive = self.loop.call_later(self._keepalive_s, self._on_keepalive)

    def data_received(self, data: bytes) -> None:
        self._rx = True
        self.conn.receive(data)

    def eof_received(self) -> bool | None:
        return False  # close the transport: HTTP/2 has no half-closed connections

    def connection_lost(self, exc: Exception | None) -> None:
        msg = f"connection lost: {exc}" if exc else "connection closed by the server"
        self.transport = None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        self.conn.lost(self.conn.failed or msg)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(msg))
            self.ready.exception()  # mark retrieved: the opener may have given up already
        if not self.closed.done():
            self.closed.set_result(None)
        self._wake_all()

    # ConnectionListener

    def on_settings(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
        self._wake_one()

    def on_stream_closed(self) -> None:
        if self._slot_waiters:
            self._wake_one()
        if not self.conn.streams and not self.conn.usable:
            self.close()

    def on_goaway(self) -> None:
        self._wake_all()
        if not self.conn.streams:
            self.close()

    def on_ping_ack(self, payload: bytes) -> None:
        self._ping_sent = None

    def on_fatal(self, message: str) -> None:
        self._wake_all()
        self._flush()  # the GOAWAY saying why
        self.abort()

    # used by the client

    def _write(self, data: bytes) -> None:
        """Frames written during one loop iteration leave in one ``transport.write`` (one syscall)."""
        if self.transport is None:
            return
        if not self._coalesce:
            self.transport.write(data)
        elif self._wbuf is None:
            self._wbuf = [data]
            self.loop.call_soon(self._flush)
        else:
            self._wbuf.append(data)

    def _flush(self) -> None:
        buf = self._wbuf
        self._wbuf = None
        if buf and self.transport is not None:
            self.transport.write(buf[0] if len(buf) == 1 else b"".join(buf))

    async def wait_slot(self) -> None:
        """Wait (FIFO) until a stream slot frees, the connection becomes unusable or settings change."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self._slot_waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._wake_one()  # we were handed a turn we won't use: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(fut)
            raise

    @property
    def has_waiters(self) -> bool:
        return bool(self._slot_waiters)

    @property
    def can_open(self) -> bool:
        """A stream can be opened now, ahead of no waiting caller (``conn.usable``, ``conn.has_slot``
        and not ``has_waiters``, in one call)."""
        c = self.conn
        return not self._slot_waiters and c.usable and c.has_slot

    def _wake_one(self) -> None:
        while self._slot_waiters:
            f = self._slot_waiters.popleft()
            if not f.done():
                f.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._slot_waiters:
            f = self._slot_waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _on_keepalive(self) -> None:
        self._keepalive = None
        if self.transport is None:
            return
        now = self.loop.time()
        if self._ping_sent is not None:
            if now - self._ping_sent > self._keepalive_timeout_s:
                self.conn.fail("keepalive ping not answered", NO_ERROR)
                return
        elif self.conn.streams and not self._rx:
            # streams are waiting and the server has been silent for a whole period: is it alive?
            self._ping_sent = now
            self.conn.ping()
        self._rx = False
        delay = self._keepalive_timeout_s if self._ping_sent is not None else self._keepalive_s
        self._keepalive = self.loop.call_later(delay, self._on_keepalive)

    def close(self) -> None:
        """Graceful: GOAWAY then close the transport (streams still open fail as connection lost)."""
        if self.transport is not None:
            self.conn.close()
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
