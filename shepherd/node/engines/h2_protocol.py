"""The asyncio shell of a lean HTTP/2 client connection: ``H2Protocol``.

The ``asyncio.Protocol`` around one ``H2Connection`` (h2_conn.py): readiness once the server's SETTINGS
arrive, waiting for a stream slot, keepalive pings, liveness probes on demand (``probe``: one PING when
the worker failed its health checks), closing a drained connection, and frames written
during one loop iteration coalesced into one ``transport.write``; ``LazyReads``: connections read on
their owner's wake-ups (a KV-event stream's own connection) instead of waking the loop for each message.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import socket
from collections.abc import Callable
from typing import Any, cast

from shepherd.node.engines.h2_conn import H2Connection
from shepherd.node.engines.h2_frames import LOCAL_WINDOW, NO_ERROR

PROBE_RECHECK_S = 0.01  # a probe's deadline passed with bytes unread in the socket: looked at again after
PROBE_RECHECKS = 50  # at most this many times (0.5 s), then the connection fails all the same


def _readable(transport: asyncio.BaseTransport) -> bool:
    """Whether the transport's socket has bytes the loop has not read yet (no socket: False)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        # poll, not select.select: a node's descriptors may exceed select's FD_SETSIZE (1024)
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError):  # closed meanwhile (fileno -1)
        return False


class LazyReads:
    """Connections read when their owner polls, not when their bytes arrive: each is a plain non-blocking
    socket the event loop does not watch (``PolledTransport``), read to the end of what it holds and its
    pending writes flushed on ``poll()``. For streams whose messages may wait (a KV-event stream on a
    connection of its own: its batches and load records); the poll rides a wake-up the owner has anyway
    (the mesh runtime's), so the messages of every such connection cost no wake-up of their own. (Pausing a
    loop transport does not do it: libuv leaves a paused socket in epoll until it next fires, so each
    message after a pause still woke the loop once.) Loop-bound: used from one event loop."""

    def __init__(self) -> None:
        self._transports: set[PolledTransport] = set()
        self.polls = 0  # poll() calls while a connection was open
        self.reads = 0  # reads that returned bytes

    def __len__(self) -> int:
        return len(self._transports)

    async def connect(
        self, factory: Callable[[], H2Protocol], host: str, port: int, unix: str | None
    ) -> H2Protocol:
        """A connection to ``host:port`` (or the unix socket ``unix``) read on ``poll()``; cleartext."""
        loop = asyncio.get_running_loop()
        if unix is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            addr: Any = unix
        else:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            if not infos:
                raise OSError(f"cannot resolve {host}")
            family, kind, proto_no, _, addr = infos[0]
            sock = socket.socket(family, kind, proto_no)
        try:
            sock.setblocking(False)
            if unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        proto = factory()
        t = PolledTransport(sock, proto, self)
        self._transports.add(t)
        proto.connection_made(t)
        t.flush()
        return proto

    def poll(self) -> None:
        """Read every connection's bytes received since the last poll; flush what waits to be sent."""
        if not self._transports:
            return
        self.polls += 1
        for t in list(self._transports):
            t.poll()

    def forget(self, t: PolledTransport) -> None:
        self._transports.discard(t)


_READ = 262_144  # bytes a lazy poll asks of a socket at once


class PolledTransport(asyncio.Transport):
    """The transport of a ``LazyReads`` connection: ``write`` sends at once what the socket takes and
    keeps the rest for the next poll (the KV stream writes little: its request, window updates, pings);
    ``poll`` flushes, then reads until a read is short (the socket had no more; EOF or an error: the
    connection is lost)."""

    def __init__(self, sock: socket.socket, proto: H2Protocol, owner: LazyReads) -> None:
        super().__init__()
        self._sock = sock
        self._proto = proto
        self._owner = owner
        self._wbuf = bytearray()
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self._sock
        if name == "peername":
            try:
                return self._sock.getpeername()
            except OSError:
                return default
        return default

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return False  # never by the loop: on polls

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        self._wbuf += data
        self.flush()

    def flush(self) -> None:
        buf = self._wbuf
        while buf and not self._closing:  # bounded: each turn sends bytes or stops
            try:
                n = self._sock.send(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e)
                return
            del buf[:n]

    def poll(self) -> None:
        if self._closing:
            return
        self.flush()
        for _ in range(64):  # bounded: 64 reads of 256 KB a poll, the rest on the next
            try:
                data = self._sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e)
                return
            if not data:
                self._lost(None)
                return
            self._owner.reads += 1
            self._proto.data_received(data)
            if self.is_closing() or len(data) < _READ:
                # closed by the protocol (a GOAWAY, a fatal error); or a short read: the socket held no
                # more then, and what came since waits for the next poll (not a recv that finds nothing)
                return

    def _lost(self, exc: Exception | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._owner.forget(self)
        self._sock.close()
        self._proto.connection_lost(exc)

    def close(self) -> None:
        """Flush what the socket takes (the GOAWAY), close it; the protocol hears of it on the next loop
        iteration, as from an asyncio transport."""
        if self._closing:
            return
        self.flush()
        if self.is_closing():  # the flush found the connection lost
            return
        self._closing = True
        self._owner.forget(self)
        self._sock.close()
        self._proto.loop.call_soon(self._proto.connection_lost, None)

    def abort(self) -> None:
        self._lost(None)


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
        self._probe: asyncio.TimerHandle | None = None  # a liveness probe's deadline (``probe``)
        self._probe_dead: Callable[[int], None] | None = None  # told when the probe fails the connection
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
        self._end_probe()
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
        self._end_probe()  # alive: a probe waiting for this ACK is answered

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

    def probe(self, timeout_s: float, on_dead: Callable[[int], None] | None = None) -> bool:
        """Ask the server now whether it is alive (its worker failed its health checks): with streams open,
        one PING (none when one is outstanding already: the keepalive's, or an earlier probe's, whose ACK
        answers this probe too) and, when no PING ACK arrives within ``timeout_s``, the connection fails
        (``conn.fail``, as the keepalive does when its ping goes unanswered: every stream on it fails
        UNAVAILABLE), ``on_dead`` told first how many streams that fails. A probe already waiting is not
        restarted. Returns whether a probe runs (False: no stream open, or the connection closed or failed).

        An engine alive but busy answers PINGs from its gRPC core at once; one PING per failed health
        verdict stays far below gRPC servers' ping-strike limit (a GOAWAY ENHANCE_YOUR_CALM to pings more
        often than every 5 minutes without data). On a ``PolledTransport`` the ACK is read on the owner's
        next poll: the timeout must then exceed the poll period."""
        if self.transport is None or self.conn.failed is not None or not self.conn.streams:
            return False
        if self._probe is None:
            if self._ping_sent is None:
                self._ping_sent = self.loop.time()
                self.conn.ping()
            self._probe = self.loop.call_later(timeout_s, self._on_probe_timeout, timeout_s, 0)
            self._probe_dead = on_dead
        return True

    def _on_probe_timeout(self, timeout_s: float, rechecks: int) -> None:
        self._probe = None
        if self.transport is None or self._ping_sent is None or self.conn.failed is not None:
            self._probe_dead = None
            return  # closed or answered meanwhile
        if rechecks < PROBE_RECHECKS and _readable(self.transport):
            # uvloop runs a timer due during a long callback before reading what already waits in the
            # socket: when the node's own loop lagged (why every worker's checks fail at once), the ACK
            # may be there unread. The loop reads it first; looked at again shortly after
            self._probe = self.loop.call_later(
                PROBE_RECHECK_S, self._on_probe_timeout, timeout_s, rechecks + 1
            )
            return
        on_dead = self._probe_dead
        self._probe_dead = None
        if on_dead is not None:
            on_dead(len(self.conn.streams))
        self.conn.fail(f"the engine did not answer a ping within {timeout_s:g}s", NO_ERROR)

    def _end_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._probe_dead = None

    def close(self) -> None:
        """Graceful: GOAWAY then close the transport (streams still open fail as connection lost)."""
        if self.transport is not None:
            self.conn.close()
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
