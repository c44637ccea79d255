"""Mesh transports: a sealed UDP endpoint for gossip and an mTLS TCP push-pull server/client.

UDP: every outgoing datagram is sealed with the ``Keyring`` primary key, every incoming one is opened;
packets that do not open (no key, foreign key, tampered, plaintext) are dropped and counted. The
application callback only ever sees authenticated plaintext.

TCP push-pull: one request frame and one response frame per connection (an RPC session may be kept
for more: "Kept-alive sessions" below), over TLS 1.3 with client certificates required both ways (and,
given a keyring, frames sealed like datagrams, so that a peer needs both a mesh key and a certificate
from the mesh CA). Frames are a 4-byte big-endian length then the payload, bounded by ``max_frame``;
every read and write is bounded by ``timeout``.

Admission (so that unauthenticated connections cannot starve the mesh): a connection first takes a
*handshake* slot for at most ``handshake_timeout`` seconds (short: a peer of the mesh finishes a TLS
1.3 handshake in milliseconds). At most ``max_handshakes_per_ip`` handshakes run from one source
address (more are closed at once, counted); at most ``max_handshakes`` run in all, and when they are
full the *oldest* handshake in progress is closed to make room (counted): the oldest are the idle
connections of a flood, while a peer's handshake is over within milliseconds, so a flood from many
addresses must open connections faster than one per (handshake time / ``max_handshakes``) to keep a
real peer out. Only a peer whose certificate verified takes a *session* slot (``max_sessions``); when
they are all in use it waits for one, bounded by ``timeout`` (and at most ``max_handshakes`` such
waiters). So unauthenticated connections never hold session slots.

Kept-alive sessions (the history RPC): a handler may call ``keep_session_open()`` while it answers a
request; the server then, after the reply, waits up to ``idle_timeout`` for another request frame on the
same connection, from the same peer (the identity is bound to the TLS session: every request on it is
handed the identity its certificate gave at the handshake), at most ``max_session_requests`` requests
per connection. The runtime's push-pull handler calls it too (not for a join): a peer's next push-pull
may come over the same connection (``MeshRuntimeConfig.keep_push_pull_connections``).
A client that closes after one reply (an older one-shot RPC client) ends the idle wait at once, quietly.
Slots of kept-alive sessions: an *idle* session holds **no** session slot (it gives its slot back once
its reply is written and takes one again, under the same bound as a new session, when the next request
frame's header arrives), so idle RPC connections cannot starve push-pulls or joins. Idle sessions hold
no handshake slot either (they are past their handshake) but are bounded on their own: at most
``max_idle_per_peer`` per certificate identity and ``max_idle`` in all; when a session going idle finds
its peer's (or the global) quota full, the *oldest* idle session of that peer (or of all) is closed.
So authenticated connections open at once stay bounded (``max_sessions`` busy, ``max_handshakes``
waiting for a slot, ``max_idle`` idle), and everything SECURITY.md says of unauthenticated ones is as
before: they only ever hold a handshake slot, dropped after ``handshake_timeout``.

How an idle session ends (what makes a client's retry safe, ``KeptConnection``): the server closes a
kept-alive session *gracefully* (TLS close_notify, then FIN) only from the idle state, i.e. before it
dispatched any further request (idle timeout, request cap, eviction, server close; bytes of a request
that arrived meanwhile are never handed to the handler), or after the reply of the connection's last
request. Every other end of a session (a handler failure, a refused or unsealed frame, a server
cancelled mid-request) is an abort, without close_notify. A client that sees close_notify before any
byte of its reply therefore knows that its request was not processed.

The server hands the handler the peer's node identity taken from its verified certificate
(``peer_identity``), never a name from the payload. A peer without a certificate from the mesh CA never
reaches the handler.

Counters live in ``TransportMetrics``, a plain dataclass the node exports (``snapshot()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shepherd.auth.certs import CertError, peer_identity
from shepherd.mesh.keyring import Keyring, SealError

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_FRAME",
    "DEFAULT_MAX_HANDSHAKES",
    "DEFAULT_MAX_HANDSHAKES_PER_IP",
    "DEFAULT_MAX_IDLE",
    "DEFAULT_MAX_IDLE_PER_PEER",
    "DEFAULT_MAX_SESSION_REQUESTS",
    "DEFAULT_TIMEOUT",
    "MAX_DATAGRAM",
    "Addr",
    "ByteReader",
    "ByteWriter",
    "ClosedBeforeRequest",
    "FrameError",
    "KeptConnection",
    "PacketHandler",
    "PushPullError",
    "PushPullHandler",
    "PushPullReply",
    "PushPullServer",
    "SessionRefused",
    "TlsStream",
    "TransportMetrics",
    "UdpEndpoint",
    "current_peer_address",
    "keep_session_open",
    "push_pull_request",
    "read_frame",
    "write_frame",
]

log = logging.getLogger(__name__)

Addr = tuple[str, int]
PacketHandler = Callable[[bytes, Addr], None]
PushPullHandler = Callable[[str, bytes], Awaitable[bytes]]

MAX_DATAGRAM = 65507
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
DEFAULT_TIMEOUT = 5.0
DEFAULT_HANDSHAKE_TIMEOUT = 2.0
DEFAULT_MAX_HANDSHAKES = 64
DEFAULT_MAX_HANDSHAKES_PER_IP = 16
# kept-alive sessions wait this long for their next request: above what 15 s push-pulls to a random one of
# a few members leave between two with the same member (N = 3: 30 s on average; 1 in 256 over 120 s), so
# that the next push-pull reuses the connection rather than paying a new mTLS handshake (~14x the exchange)
DEFAULT_IDLE_TIMEOUT = 150.0
DEFAULT_MAX_SESSION_REQUESTS = 1000
DEFAULT_MAX_IDLE_PER_PEER = 8
DEFAULT_MAX_IDLE = 64
_FRAME = struct.Struct("!I")
_CLOSE_TIMEOUT = 1.0
_READ_LIMIT = 64 * 1024
_PEER: contextvars.ContextVar[Addr | None] = contextvars.ContextVar("mesh_tcp_peer", default=None)


class _Exchange:
    """The request being served by a session task (``keep_session_open`` marks it)."""

    __slots__ = ("keep",)

    def __init__(self) -> None:
        self.keep = False


_EXCHANGE: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar("mesh_tcp_rq", default=None)


def current_peer_address() -> Addr | None:
    """Inside a push-pull handler: the TCP peer's (ip, port), as the server's socket saw it."""
    return _PEER.get()


def keep_session_open() -> None:
    """Inside a push-pull handler: after this reply, keep the connection for another request from the
    same peer (a kept-alive RPC session, see the module doc). No effect outside a handler, or on a
    server whose ``idle_timeout`` is 0."""
    ex = _EXCHANGE.get()
    if ex is not None:
        ex.keep = True


@dataclass
class TransportMetrics:
    """Transport counters (monotonic). ``udp_bytes_*`` are gossip bytes on the wire (sealed)."""

    udp_packets_in: int = 0
    udp_packets_out: int = 0
    udp_bytes_in: int = 0
    udp_bytes_out: int = 0
    udp_dropped_bad_seal: int = 0
    udp_dropped_oversize: int = 0
    udp_dropped_backpressure: int = 0
    udp_send_errors: int = 0
    udp_handler_errors: int = 0
    tcp_sessions_in: int = 0
    tcp_sessions_out: int = 0
    tcp_rejected_tls: int = 0
    tcp_rejected_busy: int = 0
    """Authenticated sessions that found no session slot in time."""
    tcp_rejected_handshake_budget: int = 0
    """Connections closed at once: the handshake budget (global or per source address) was full."""
    tcp_handshake_timeouts: int = 0
    tcp_handshakes_evicted: int = 0
    """Handshakes in progress closed to make room (the global budget was full: the oldest goes)."""
    tcp_refused_by_handler: int = 0
    tcp_bad_seal: int = 0
    tcp_errors_in: int = 0
    tcp_errors_out: int = 0
    tcp_bytes_in: int = 0
    tcp_bytes_out: int = 0
    tcp_handshakes_out: int = 0
    """TLS handshakes completed as a client (push-pull and RPC connections)."""
    tcp_requests_in: int = 0
    """Request frames answered by the server (a kept-alive session answers several)."""
    tcp_idle_closed: int = 0
    """Kept-alive sessions the server closed while idle (timeout, request cap, eviction, close)."""
    tcp_idle_evicted: int = 0
    """... of which closed to respect ``max_idle_per_peer`` / ``max_idle`` (the oldest idle goes)."""

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# --- UDP --------------------------------------------------------------------------------------------


def _nothing_buffered() -> int:
    return 0


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, endpoint: UdpEndpoint) -> None:
        self._endpoint = endpoint

    def datagram_received(self, data: bytes, addr: Any) -> None:
        """Open the packet and hand it on (here, not in a method of the endpoint: an idle node's every
        wake-up runs this, and each distinct function it runs costs after a sleep)."""
        ep = self._endpoint
        try:
            payload = ep.keyring.open(data)
        except SealError:
            ep.metrics.udp_dropped_bad_seal += 1
            return
        m = ep.metrics
        m.udp_packets_in += 1
        m.udp_bytes_in += len(data)
        src = (str(addr[0]), int(addr[1]))
        try:
            ep.on_packet(payload, src)
        except Exception:
            m.udp_handler_errors += 1
            log.exception("mesh packet handler failed (packet from %s)", src)

    def error_received(self, exc: Exception) -> None:
        self._endpoint.metrics.udp_send_errors += 1
        log.debug("mesh udp error: %s", exc)


class UdpEndpoint:
    """A bound UDP socket sealing what it sends and opening what it receives."""

    def __init__(
        self,
        keyring: Keyring,
        on_packet: PacketHandler,
        metrics: TransportMetrics,
        max_buffer: int,
    ) -> None:
        self.keyring = keyring
        self.metrics = metrics
        self.on_packet = on_packet  # (read by the protocol)
        self._max_buffer = max_buffer
        self._transport: asyncio.DatagramTransport | None = None
        self._buffered: Callable[[], int] = _nothing_buffered  # the transport's bytes queued
        self._address: Addr = ("", 0)

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        keyring: Keyring,
        on_packet: PacketHandler,
        *,
        metrics: TransportMetrics | None = None,
        max_buffer: int = 1024 * 1024,
    ) -> UdpEndpoint:
        """Bind ``host:port`` (port 0: any free port). ``on_packet(plaintext, src)`` is called for every
        packet that opens; ``max_buffer`` bounds bytes queued in the kernel-full case (then dropped)."""
        ep = cls(keyring, on_packet, metrics if metrics is not None else TransportMetrics(), max_buffer)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(ep), local_addr=(host, port))
        ep._transport = transport
        # both asyncio's and uvloop's datagram transports buffer when the socket would block
        ep._buffered = getattr(transport, "get_write_buffer_size", _nothing_buffered)
        sock = transport.get_extra_info("sockname")
        ep._address = (str(sock[0]), int(sock[1]))
        return ep

    @property
    def address(self) -> Addr:
        """The bound address (kept after ``close``)."""
        return self._address

    @property
    def closed(self) -> bool:
        return self._transport is None

    def send(self, payload: bytes, dest: Addr) -> bool:
        """Seal and send one datagram; False if it was dropped (closed, too large, backpressure)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        packet = self.keyring.seal(payload)
        if len(packet) > MAX_DATAGRAM:
            self.metrics.udp_dropped_oversize += 1
            return False
        if self._buffered() > self._max_buffer:
            self.metrics.udp_dropped_backpressure += 1
            return False
        try:
            transport.sendto(packet, dest)
        except OSError as e:
            self.metrics.udp_send_errors += 1
            log.debug("mesh udp send to %s failed: %s", dest, e)
            return False
        self.metrics.udp_packets_out += 1
        self.metrics.udp_bytes_out += len(packet)
        return True

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


# --- TCP frames -------------------------------------------------------------------------------------


class FrameError(Exception):
    """A frame over the size bound, or a stream that ended inside a frame."""


class ByteReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class ByteWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


async def read_frame(
    reader: ByteReader, *, max_size: int = DEFAULT_MAX_FRAME, timeout: float = DEFAULT_TIMEOUT
) -> bytes:
    """Read one length-prefixed frame; raises ``FrameError``, ``TimeoutError``, ``OSError`` or
    ``ssl.SSLError``. The size is checked before the body is read."""
    async with asyncio.timeout(timeout):
        try:
            header = await reader.readexactly(_FRAME.size)
            (size,) = _FRAME.unpack(header)
            if size > max_size:
                raise FrameError(f"frame of {size} bytes over the bound of {max_size}")
            return await reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            raise FrameError(f"stream ended inside a frame ({len(e.partial)} bytes read)") from None


async def write_frame(
    writer: ByteWriter,
    data: bytes,
    *,
    max_size: int = DEFAULT_MAX_FRAME,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Write one length-prefixed frame and drain, bounded by ``timeout``."""
    if len(data) > max_size:
        raise FrameError(f"frame of {len(data)} bytes over the bound of {max_size}")
    writer.write(_FRAME.pack(len(data)))
    writer.write(data)
    async with asyncio.timeout(timeout):
        await writer.drain()


# --- TLS over a plain stream ------------------------------------------------------------------------


class TlsStream:
    """TLS driven through ``ssl.MemoryBIO`` over a plain asyncio stream.

    Doing TLS here rather than in the event loop's transport behaves the same on asyncio and uvloop,
    lets the server count refused handshakes and bound them, and avoids the race of upgrading an
    accepted plain stream with ``start_tls`` after the client's hello was already buffered.
    """

    _CHUNK = 64 * 1024

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        *,
        server_side: bool,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._in, self._out, server_side=server_side)
        self.bytes_read = 0
        """Plaintext bytes read so far."""
        self.peer_closed = False
        """The peer closed its side gracefully (a TLS close_notify was read)."""

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self._writer.write(data)

    async def _fill(self) -> bool:
        """Feed the next bytes from the socket to TLS; False at end of stream."""
        self._flush()
        await self._writer.drain()
        data = await self._reader.read(self._CHUNK)
        if not data:
            return False
        self._in.write(data)
        return True

    async def handshake(self) -> None:
        """Run the TLS handshake (the peer certificate is verified per the context)."""
        while True:
            try:
                self.ssl_object.do_handshake()
                break
            except ssl.SSLWantReadError:
                if not await self._fill():
                    raise ConnectionResetError(
                        "peer closed the connection during the TLS handshake"
                    ) from None
            except ssl.SSLError:
                self._flush()  # let the peer see our alert
                raise
        self._flush()
        await self._writer.drain()

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.ssl_object.read(n - len(buf))
            except ssl.SSLWantReadError:
                if not await self._fill():
                    raise asyncio.IncompleteReadError(bytes(buf), n) from None
                continue
            except ssl.SSLZeroReturnError:
                self.peer_closed = True
                raise asyncio.IncompleteReadError(bytes(buf), n) from None
            if not chunk:  # SSLObject.read's answer to a close_notify
                self.peer_closed = True
                raise asyncio.IncompleteReadError(bytes(buf), n)
            buf += chunk
            self.bytes_read += len(chunk)
        return bytes(buf)

    async def wait_peer_close(self) -> None:
        """Return once the peer closes (close_notify, end of stream, reset) or sends anything: for a
        connection kept idle, to which the peer never sends unprompted (TLS post-handshake messages are
        consumed). Cancelling it loses nothing but such messages."""
        try:
            while True:
                try:
                    if not self.ssl_object.read(1):
                        self.peer_closed = True  # a close_notify
                    return  # or unprompted data: the connection is not usable any more
                except ssl.SSLWantReadError:
                    pass
                if not await self._fill():
                    return
        except ssl.SSLZeroReturnError:
            self.peer_closed = True
        except (ssl.SSLError, OSError):
            pass

    def write(self, data: bytes) -> None:
        self.ssl_object.write(data)
        self._flush()

    async def drain(self) -> None:
        await self._writer.drain()

    def abort(self) -> None:
        self._writer.transport.abort()

    @property
    def usable(self) -> bool:
        """The socket is open both ways as far as we know (no end of stream, reset or close seen)."""
        reader = self._reader
        return (
            not self.peer_closed
            and not self._writer.transport.is_closing()
            and not reader.at_eof()
            and reader.exception() is None
        )

    def close_nowait(self) -> None:
        """Close gracefully without waiting: close_notify (best effort), then FIN once written."""
        with contextlib.suppress(ssl.SSLError, OSError, ValueError):
            self.ssl_object.unwrap()
        with contextlib.suppress(OSError):
            self._flush()
        self._writer.close()

    async def close(self) -> None:
        """Send close_notify (best effort) and close the socket, bounded."""
        with contextlib.suppress(ssl.SSLError, OSError):
            self.ssl_object.unwrap()
        with contextlib.suppress(OSError):
            self._flush()
        self._writer.close()
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await self._writer.wait_closed()
        except (TimeoutError, OSError):
            self._writer.transport.abort()


# --- TCP push-pull server ---------------------------------------------------------------------------


@dataclass
class _IdleSession:
    identity: str
    tls: TlsStream
    closed: bool = False


async def _read_body(reader: ByteReader, header: bytes, *, max_size: int, timeout: float) -> bytes:
    """The rest of a frame whose header was read (``read_frame`` in two steps)."""
    (size,) = _FRAME.unpack(header)
    if size > max_size:
        raise FrameError(f"frame of {size} bytes over the bound of {max_size}")
    async with asyncio.timeout(timeout):
        try:
            return await reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            raise FrameError(f"stream ended inside a frame ({len(e.partial)} bytes read)") from None


class SessionRefused(Exception):
    """Raised by a push-pull handler to drop a session without answering (counted, logged briefly)."""


class PushPullServer:
    """mTLS TCP server: for each connection, handshake, learn the peer identity from its certificate,
    read one request frame, answer ``await handler(identity, request)`` with one frame, close (or, if
    the handler called ``keep_session_open``, wait idle for the next request: see the module doc)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        handler: PushPullHandler,
        metrics: TransportMetrics,
        max_frame: int,
        timeout: float,
        max_sessions: int,
        keyring: Keyring | None,
        *,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        max_handshakes_per_ip: int = DEFAULT_MAX_HANDSHAKES_PER_IP,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_session_requests: int = DEFAULT_MAX_SESSION_REQUESTS,
        max_idle_per_peer: int = DEFAULT_MAX_IDLE_PER_PEER,
        max_idle: int = DEFAULT_MAX_IDLE,
    ) -> None:
        self.metrics = metrics
        self._idle_timeout = idle_timeout
        self._max_session_requests = max(1, max_session_requests)
        self._max_idle_per_peer = max(1, max_idle_per_peer)
        self._max_idle = max(1, max_idle)
        self._idle: dict[asyncio.Task[Any], _IdleSession] = {}  # idle kept-alive sessions, oldest first
        self._idle_per_peer: dict[str, int] = {}
        self._keyring = keyring
        self._ssl = ssl_context
        self._handler = handler
        self._max_frame = max_frame
        self._timeout = timeout
        self._handshake_timeout = handshake_timeout
        self._max_handshakes = max_handshakes
        self._max_handshakes_per_ip = max_handshakes_per_ip
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # every connection task (for close)
        self._accepting: set[asyncio.Task[None]] = set()  # (held until done: the loop keeps weak refs)
        self._handshaking: dict[str, int] = {}  # source address -> handshakes in progress
        self._pending: dict[asyncio.Task[Any], tuple[str, TlsStream]] = {}  # handshakes, oldest first
        self._slots = asyncio.Semaphore(max_sessions)
        self._waiting = 0

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext,
        handler: PushPullHandler,
        *,
        metrics: TransportMetrics | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        timeout: float = DEFAULT_TIMEOUT,
        max_sessions: int = 16,
        keyring: Keyring | None = None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        max_handshakes_per_ip: int = DEFAULT_MAX_HANDSHAKES_PER_IP,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_session_requests: int = DEFAULT_MAX_SESSION_REQUESTS,
        max_idle_per_peer: int = DEFAULT_MAX_IDLE_PER_PEER,
        max_idle: int = DEFAULT_MAX_IDLE,
    ) -> PushPullServer:
        """Listen on ``host:port`` (port 0: any free port). Admission is in the module doc (handshake
        budget, then ``max_sessions`` session slots); each step after the handshake is bounded by
        ``timeout``. With a ``keyring``, both frames are also sealed (the peer must hold a mesh key
        *and* a certificate). Kept-alive sessions (``keep_session_open``) wait ``idle_timeout`` for
        their next request (0: never kept), serve at most ``max_session_requests``, and at most
        ``max_idle_per_peer`` per identity and ``max_idle`` in all are idle at once."""
        srv = cls(
            ssl_context,
            handler,
            metrics if metrics is not None else TransportMetrics(),
            max_frame,
            timeout,
            max_sessions,
            keyring,
            handshake_timeout=handshake_timeout,
            max_handshakes=max_handshakes,
            max_handshakes_per_ip=max_handshakes_per_ip,
            idle_timeout=idle_timeout,
            max_session_requests=max_session_requests,
            max_idle_per_peer=max_idle_per_peer,
            max_idle=max_idle,
        )
        srv._server = await asyncio.start_server(srv._accept, host, port, limit=_READ_LIMIT)
        return srv

    @property
    def address(self) -> Addr:
        if self._server is None:
            raise RuntimeError("server closed")
        sock = self._server.sockets[0].getsockname()
        return (str(sock[0]), int(sock[1]))

    @property
    def handshakes_in_progress(self) -> int:
        return len(self._pending)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection's task, made here rather than by asyncio's stream protocol: that one asks a task
        cancelled before its first step (a node stopping as a peer connects: the loop's teardown cancels
        it) for its exception, which raises, and logs that as an error with a traceback."""
        task = asyncio.get_running_loop().create_task(self._on_connection(reader, writer))
        self._accepting.add(task)
        task.add_done_callback(functools.partial(self._accepted, writer))

    def _accepted(self, writer: asyncio.StreamWriter, task: asyncio.Task[None]) -> None:
        self._accepting.discard(task)
        if task.cancelled():  # before its first step: the loop is going away
            writer.transport.abort()
            return
        exc = task.exception()
        if exc is not None:
            log.error("mesh: a connection's handler failed", exc_info=exc)
            writer.transport.abort()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._server is None or task is None:
            writer.transport.abort()
            return
        if self._handshaking.get(ip, 0) >= self._max_handshakes_per_ip:
            self.metrics.tcp_rejected_handshake_budget += 1
            writer.transport.abort()
            return
        if len(self._pending) >= self._max_handshakes:
            self._evict_oldest_handshake()
        self._tasks.add(task)
        tls = TlsStream(reader, writer, self._ssl, server_side=True)
        try:
            identity = await self._handshake(task, tls, ip, peer)
            if identity is not None:
                await self._admit(tls, identity, peer)
        except asyncio.CancelledError:
            # only ``close()`` cancels sessions; end the task quietly (asyncio's stream callback
            # would log a cancelled connection task as an error)
            tls.abort()
        finally:
            self._tasks.discard(task)

    def _evict_oldest_handshake(self) -> None:
        """The handshake budget is full: close the oldest handshake in progress (a peer of the mesh
        completes its own within milliseconds, so the oldest are the idle ones of a flood)."""
        task, (ip, tls) = next(iter(self._pending.items()))
        self._forget_handshake(task, ip)
        self.metrics.tcp_handshakes_evicted += 1
        tls.abort()

    def _forget_handshake(self, task: asyncio.Task[Any], ip: str) -> None:
        if self._pending.pop(task, None) is not None:
            _count_down(self._handshaking, ip)

    async def _handshake(self, task: asyncio.Task[Any], tls: TlsStream, ip: str, peer: Any) -> str | None:
        """The TLS handshake under the handshake budget; the peer's identity, or None (closed)."""
        self._pending[task] = (ip, tls)
        self._handshaking[ip] = self._handshaking.get(ip, 0) + 1
        try:
            async with asyncio.timeout(self._handshake_timeout):
                await tls.handshake()
            return peer_identity(tls.ssl_object)
        except (ssl.SSLError, OSError, TimeoutError, CertError) as e:
            self.metrics.tcp_rejected_tls += 1
            if isinstance(e, TimeoutError):
                self.metrics.tcp_handshake_timeouts += 1
            log.debug("mesh tcp: handshake refused from %s: %s", peer, e)
            tls.abort()
            return None
        finally:
            self._forget_handshake(task, ip)

    @property
    def idle_sessions(self) -> int:
        """Kept-alive sessions waiting for their next request (holding no session slot)."""
        return len(self._idle)

    async def _take_slot(self, tls: TlsStream, identity: str, peer: Any) -> bool:
        """A session slot for an authenticated peer (waiting for one, bounded); False: aborted."""
        if self._slots.locked() and self._waiting >= self._max_handshakes:
            self.metrics.tcp_rejected_busy += 1
            tls.abort()
            return False
        self._waiting += 1
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except TimeoutError:
            self.metrics.tcp_rejected_busy += 1
            log.info("mesh tcp: no session slot for %s (%s) in %s s", identity, peer, self._timeout)
            tls.abort()
            return False
        finally:
            self._waiting -= 1
        return True

    async def _admit(self, tls: TlsStream, identity: str, peer: Any) -> None:
        """An authenticated peer: take a session slot (waiting for one, bounded), then serve it; a
        kept-alive session gives its slot back while idle and takes one again for its next request."""
        if not await self._take_slot(tls, identity, peer):
            return
        self.metrics.tcp_sessions_in += 1
        if isinstance(peer, tuple) and len(peer) >= 2:
            _PEER.set((str(peer[0]), int(peer[1])))
        exchange = _Exchange()
        _EXCHANGE.set(exchange)
        header: bytes | None = None
        served = 0
        while True:
            exchange.keep = False
            try:
                ok = await self._serve_one(tls, identity, peer, header)
            finally:
                self._slots.release()
            if not ok:
                return
            served += 1
            if (
                not exchange.keep
                or self._idle_timeout <= 0
                or served >= self._max_session_requests
                or self._server is None
            ):
                if exchange.keep:
                    self.metrics.tcp_idle_closed += 1  # the request cap (or closing): no more
                await tls.close()
                return
            header = await self._wait_idle(tls, identity)
            if header is None or not await self._take_slot(tls, identity, peer):
                return

    async def _wait_idle(self, tls: TlsStream, identity: str) -> bytes | None:
        """Idle, without a session slot: the next request frame's header, or None (the session ended:
        closed gracefully by us before reading a request, or by the peer, or failed)."""
        task = asyncio.current_task()
        assert task is not None
        if self._idle_per_peer.get(identity, 0) >= self._max_idle_per_peer:
            self._evict_idle(next(t for t, e in self._idle.items() if e.identity == identity))
        if len(self._idle) >= self._max_idle:
            self._evict_idle(next(iter(self._idle)))
        entry = _IdleSession(identity, tls)
        self._idle[task] = entry
        self._idle_per_peer[identity] = self._idle_per_peer.get(identity, 0) + 1
        try:
            async with asyncio.timeout(self._idle_timeout):
                header = await tls.readexactly(_FRAME.size)
        except TimeoutError:
            if not entry.closed:
                self.metrics.tcp_idle_closed += 1
                entry.closed = True
                tls.close_nowait()  # close_notify: the client knows nothing was read
            return None
        except asyncio.IncompleteReadError as e:
            if not entry.closed and e.partial:
                self.metrics.tcp_errors_in += 1  # the peer went away inside a header
                tls.abort()
            elif not entry.closed:
                await tls.close()  # the peer closed between requests (a one-shot client): fine
            return None
        except (OSError, ssl.SSLError) as e:
            if not entry.closed:
                self.metrics.tcp_errors_in += 1
                log.debug("mesh tcp: idle session with %s failed: %s", identity, e)
                tls.abort()
            return None
        finally:
            self._forget_idle(task, identity)
        if entry.closed:
            return None  # evicted (or the server closing) as the request arrived: not read, not served
        return header

    def _forget_idle(self, task: asyncio.Task[Any], identity: str) -> None:
        if self._idle.pop(task, None) is not None:
            _count_down(self._idle_per_peer, identity)

    def _evict_idle(self, task: asyncio.Task[Any], *, count: bool = True) -> None:
        """Close an idle kept-alive session gracefully (close_notify: its next request was not read)."""
        entry = self._idle.get(task)
        if entry is None or entry.closed:
            return
        entry.closed = True
        self._forget_idle(task, entry.identity)
        self.metrics.tcp_idle_closed += 1
        if count:
            self.metrics.tcp_idle_evicted += 1
        entry.tls.close_nowait()

    async def _serve_one(self, tls: TlsStream, identity: str, peer: Any, header: bytes | None) -> bool:
        """Read one request frame (its header already read if ``header``), answer it; False: aborted."""
        try:
            if header is None:
                request = await read_frame(tls, max_size=self._max_frame, timeout=self._timeout)
            else:
                request = await _read_body(tls, header, max_size=self._max_frame, timeout=self._timeout)
            self.metrics.tcp_bytes_in += len(request) + _FRAME.size
            if self._keyring is not None:
                request = self._keyring.open(request)
            async with asyncio.timeout(self._timeout):
                response = await self._handler(identity, request)
            if self._keyring is not None:
                response = self._keyring.seal(response)
            await write_frame(tls, response, max_size=self._max_frame, timeout=self._timeout)
            self.metrics.tcp_bytes_out += len(response) + _FRAME.size
            self.metrics.tcp_requests_in += 1
        except SealError as e:
            self.metrics.tcp_bad_seal += 1
            log.info("mesh tcp: push-pull from %s (%s) not sealed with a mesh key: %s", identity, peer, e)
            tls.abort()
            return False
        except SessionRefused as e:
            self.metrics.tcp_refused_by_handler += 1
            log.info("mesh tcp: push-pull from %s (%s) refused: %s", identity, peer, e)
            tls.abort()
            return False
        except (FrameError, TimeoutError, OSError, ssl.SSLError) as e:
            self.metrics.tcp_errors_in += 1
            log.debug("mesh tcp: session with %s (%s) failed: %s", identity, peer, e)
            tls.abort()
            return False
        except Exception:
            self.metrics.tcp_errors_in += 1
            log.exception("mesh tcp: push-pull handler failed (peer %s)", identity)
            tls.abort()
            return False
        return True

    async def close(self) -> None:
        """Stop accepting, cancel sessions in flight, wait for them (bounded)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # idle kept-alive sessions end gracefully (close_notify: their clients may retry elsewhere),
        # and then by themselves; the others are cancelled (an abort)
        idle = list(self._idle)
        for t in idle:
            self._evict_idle(t, count=False)
        sessions = list(self._tasks)
        for t in sessions:
            if t not in idle:
                t.cancel()
        if sessions:
            _, stuck = await asyncio.wait(sessions, timeout=_CLOSE_TIMEOUT)
            for t in stuck:
                t.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await server.wait_closed()


# --- TCP push-pull client ---------------------------------------------------------------------------


class PushPullError(Exception):
    """A push-pull exchange failed: connection, TLS (refused or untrusted peer), identity, frame, timeout."""


def _count_down(counts: dict[str, int], key: str) -> None:
    """One fewer of ``key`` in a per-peer count; a count that reaches zero leaves the dict."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


async def _dial(
    dest: Addr, ssl_context: ssl.SSLContext, expected_identity: str | None, m: TransportMetrics
) -> tuple[TlsStream, str]:
    """Connect to ``dest`` and run the client's TLS handshake: the stream and the server's certificate
    identity. A server whose certificate does not name ``expected_identity`` (if given) is refused
    (``CertError``). On any failure the connection is aborted before the exception leaves."""
    reader, writer = await asyncio.open_connection(dest[0], dest[1], limit=_READ_LIMIT)
    tls = TlsStream(reader, writer, ssl_context, server_side=False)
    try:
        await tls.handshake()
        m.tcp_handshakes_out += 1
        identity = peer_identity(tls.ssl_object)
        if expected_identity is not None and identity != expected_identity:
            raise CertError(f"peer at {dest} is {identity!r}, expected {expected_identity!r}")
    except BaseException:
        tls.abort()
        raise
    return tls, identity


@dataclass(frozen=True)
class PushPullReply:
    identity: str
    payload: bytes


async def push_pull_request(
    dest: Addr,
    ssl_context: ssl.SSLContext,
    payload: bytes,
    *,
    expected_identity: str | None = None,
    keyring: Keyring | None = None,
    metrics: TransportMetrics | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    timeout: float = DEFAULT_TIMEOUT,
) -> PushPullReply:
    """Send ``payload`` to the push-pull server at ``dest`` over mTLS and return its answer with the
    server's certificate identity. If ``expected_identity`` is given, a server whose certificate names
    another node is refused before the payload is sent. With a ``keyring`` both frames are sealed
    (as the server must be configured). The whole exchange is bounded by ``timeout``."""
    m = metrics if metrics is not None else TransportMetrics()
    tls: TlsStream | None = None
    try:
        async with asyncio.timeout(timeout):
            tls, identity = await _dial(dest, ssl_context, expected_identity, m)
            frame = keyring.seal(payload) if keyring is not None else payload
            await write_frame(tls, frame, max_size=max_frame, timeout=timeout)
            m.tcp_bytes_out += len(frame) + _FRAME.size
            answer = await read_frame(tls, max_size=max_frame, timeout=timeout)
            m.tcp_bytes_in += len(answer) + _FRAME.size
            if keyring is not None:
                answer = keyring.open(answer)
    except (OSError, ssl.SSLError, TimeoutError, FrameError, CertError, SealError) as e:
        m.tcp_errors_out += 1
        if tls is not None:
            tls.abort()
        raise PushPullError(f"push-pull with {dest[0]}:{dest[1]} failed: {type(e).__name__}: {e}") from e
    except BaseException:
        if tls is not None:
            tls.abort()
        raise
    m.tcp_sessions_out += 1
    await tls.close()
    return PushPullReply(identity, answer)


# --- kept-alive client connection (RPC) -------------------------------------------------------------


class ClosedBeforeRequest(PushPullError):
    """The server closed a kept-alive connection gracefully (TLS close_notify) before any byte of the
    reply: it closes so only from the idle state, before reading a request (module doc), so the
    request was not processed and may be sent again over another connection."""


class KeptConnection:
    """The client end of a kept-alive mTLS session (the RPC channel): one request at a time through
    ``exchange``; between requests it is ``park``-ed, a watcher noticing the server closing it.

    The server must have been asked to keep the session (its handler calls ``keep_session_open``);
    a server that does not (an older node) closes after the first reply, which the watcher sees."""

    def __init__(self, dest: Addr, tls: TlsStream, identity: str) -> None:
        self.dest = dest
        self.identity = identity
        self.requests = 0
        """Requests answered over this connection."""
        self.idle_since = 0.0
        """Event-loop time of the last ``park``."""
        self._tls = tls
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        dest: Addr,
        ssl_context: ssl.SSLContext,
        *,
        expected_identity: str | None = None,
        metrics: TransportMetrics | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> KeptConnection:
        """Connect and run the TLS handshake; a server whose certificate does not name
        ``expected_identity`` (if given) is refused. ``PushPullError`` on any failure."""
        m = metrics if metrics is not None else TransportMetrics()
        try:
            async with asyncio.timeout(timeout):
                tls, identity = await _dial(dest, ssl_context, expected_identity, m)
        except (OSError, ssl.SSLError, TimeoutError, CertError) as e:
            m.tcp_errors_out += 1
            raise PushPullError(f"connection to {dest[0]}:{dest[1]} failed: {type(e).__name__}: {e}") from e
        m.tcp_sessions_out += 1
        return cls(dest, tls, identity)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usable(self) -> bool:
        """Not closed by either side as far as we know (the server may still close it any time)."""
        return not self._closed and self._tls.usable

    async def exchange(
        self,
        payload: bytes,
        *,
        keyring: Keyring | None = None,
        metrics: TransportMetrics | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> bytes:
        """Send one request frame, return the reply frame (sealed and opened with ``keyring``), bounded
        by ``timeout``. On failure the connection is closed and ``ClosedBeforeRequest`` (the server had
        closed it gracefully before any reply byte: the request was not processed) or ``PushPullError``
        (anything else: the request may have been processed) is raised."""
        if self._closed or self._watch is not None:
            raise PushPullError("connection closed or parked")
        m = metrics if metrics is not None else TransportMetrics()
        tls = self._tls
        before = tls.bytes_read
        try:
            async with asyncio.timeout(timeout):
                frame = keyring.seal(payload) if keyring is not None else payload
                if len(frame) > max_frame:
                    raise FrameError(f"frame of {len(frame)} bytes over the bound of {max_frame}")
                # one write, so one send: a server that closed the connection answers it with a reset,
                # which must not come before we read the close_notify it sent first (a second send
                # would fail on that reset and hide the close_notify already buffered)
                tls.write(_FRAME.pack(len(frame)) + frame)
                await tls.drain()
                m.tcp_bytes_out += len(frame) + _FRAME.size
                answer = await read_frame(tls, max_size=max_frame, timeout=timeout)
                m.tcp_bytes_in += len(answer) + _FRAME.size
                if keyring is not None:
                    answer = keyring.open(answer)
        except (OSError, ssl.SSLError, TimeoutError, FrameError, SealError) as e:
            unread = tls.peer_closed and tls.bytes_read == before
            self.abort()
            where = f"{self.dest[0]}:{self.dest[1]}"
            if unread:
                raise ClosedBeforeRequest(f"{where} closed the connection before reading the request") from e
            m.tcp_errors_out += 1
            raise PushPullError(f"request to {where} failed: {type(e).__name__}: {e}") from e
        except BaseException:
            self.abort()
            raise
        self.requests += 1
        return answer

    def park(self, on_lost: Callable[[KeptConnection], None]) -> None:
        """Keep the connection idle; ``on_lost(self)`` is called if the server closes it meanwhile."""
        if self._closed or self._watch is not None:
            return
        loop = asyncio.get_running_loop()
        self.idle_since = loop.time()
        watch = loop.create_task(self._tls.wait_peer_close(), name=f"mesh-idle-{self.identity}")

        def lost(task: asyncio.Task[None]) -> None:
            if task.cancelled() or self._watch is not task:
                return
            self._watch = None
            on_lost(self)

        watch.add_done_callback(lost)
        self._watch = watch

    async def unpark(self) -> bool:
        """Take the connection out of idle for a request; False: it is not usable any more (closed)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            if watch.done():
                self.abort()
                return False
            watch.cancel()
            try:
                await asyncio.wait({watch})
            except BaseException:
                self.abort()
                raise
            if not watch.cancelled():
                self.abort()  # it ended on its own meanwhile: the server closed the connection
                return False
        if not self.usable:
            self.abort()
            return False
        return True

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    def close(self) -> None:
        """Close gracefully, without waiting (the server sees the end between two requests)."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch()
        self._tls.close_nowait()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_watch()
        self._tls.abort()
