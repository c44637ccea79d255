"""A lean HTTP/1.1 server for the node's aiohttp ``web.Application`` (``--http-server lean``).

aiohttp's server costs ~134 µs of CPU per small POST → JSON; an ``asyncio.Protocol`` over httptools'
C parser (llhttp) does the same in a fraction of that. ``LeanServer`` serves an aiohttp application as
it is (its routes, middlewares, ``app[...]`` storage; startup and cleanup stay with ``web.AppRunner``) with
only the work a gateway needs per request, done by each connection (connection.py: parsing, limits, slow
clients, request bodies, routing, responses, client disconnects).

- **Shutdown** (``shutdown``): stop accepting, close idle keep-alive connections, let in-flight requests
  finish (bounded), then close the rest. Idle keep-alive connections close after ``keepalive_secs``.
- **Connection cap** (``ConnectionCap``, also for aiohttp's server: ``CappedTCPSite``): past
  ``max_client_connections`` open connections a new one gets a 503 (OpenAI envelope, ``Connection:
  close``) and is closed at once, counted in ``refused``. Checked when the connection is made, one at a
  time, so the count is exact; over TLS that is after the handshake (handshakes in progress are bounded by
  ``Limits.tls_handshake_secs``, 10 s, not by the cap). The cap never exceeds what the process may open
  (``fd_budget``: ``RLIMIT_NOFILE`` less a reserve for engine connections, the mesh, files and the refusals
  themselves): past it, idle connections would take every descriptor, new clients would be reset without an
  answer and the node could open no engine connection.
- **Per client** (``max_connections_per_client``, lean server): past that many open connections from one
  address (an IPv6 /64), its new one gets a 429 and is closed, counted in ``refused_client``.
- **PROXY protocol** (``proxy_from``, lean server): a connection from one of those load balancers must
  open with a PROXY header (``proxy_protocol``, v1 or v2, within ``PROXY_HEADER_S``); the client it names
  is the connection's address (the per-client cap, ``request.remote``), else it is closed
  (``refused_proxy``). On plain TCP the gate reads it before the connection is handed to the server. With
  TLS the header comes before the client's TLS (a balancer passing TLS through, as HAProxy's
  ``send-proxy-v2`` or a cloud NLB): the listener accepts itself (``_TlsListener``), reads exactly the
  header's bytes off the socket (peeking, so that no byte of the handshake is taken) and hands the socket
  to the TLS stack (``connect_accepted_socket``); connections in that stage count against the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import resource
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner

from shepherd.node.http.connection import _Conn, _Resolved
from shepherd.node.http.limits import Limits, error_body
from shepherd.node.http.proxy_protocol import MAX_HEADER, ProxyError, ProxyHeader, header_end, parse
from shepherd.node.http.types import LeanRequest, Routes
from shepherd.proto.addresses import client_key

log = logging.getLogger("shepherd.http")

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
_REFUSED_CLIENT = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
)
PROXY_HEADER_S = 5.0  # a balancer's connection must bring its PROXY header within this


def fd_budget(limit: int) -> int:
    """``limit`` client connections, or fewer if the process may not open that many descriptors: the soft
    ``RLIMIT_NOFILE`` less a reserve (an eighth of it, at least 64) for everything else the node opens."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no such limit here
        return limit
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return limit
    return max(1, min(limit, soft - max(64, soft // 8)))


class ConnectionCap:
    """At most ``limit`` client connections at once (``count()``: how many are open), fewer if the process
    may not open that many descriptors (``fd_budget``); ``refused``: connections turned away.
    ``factory(inner)`` is the protocol factory to serve with."""

    def __init__(
        self,
        limit: int,
        count: Callable[[], int],
        *,
        per_client: int = 0,
        proxy_from: Sequence[str] = (),
    ) -> None:
        self.limit = fd_budget(limit)
        if self.limit < limit:
            log.warning(
                "serving at most %d client connections, not %d: the open-files limit (ulimit -n) is %d",
                self.limit,
                limit,
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
        self.count = count
        self.refused = 0
        body = error_body(503, "The server has too many connections; retry.", "too_many_connections")
        self.answer = _REFUSED % (len(body), body)
        self.per_client = per_client  # 0: no cap
        self.clients: dict[str, int] = {}  # open connections per client (kept while a cap is set)
        self.refused_client = 0
        body = error_body(429, "Too many connections from this client; retry.", "too_many_client_connections")
        self.answer_client = _REFUSED_CLIENT % (len(body), body)
        self.proxy_from = tuple(ipaddress.ip_network(n, strict=False) for n in proxy_from)
        self.refused_proxy = 0
        # balancers' connections still bringing their header: counted against ``limit`` too (each holds a
        # descriptor), closed by ``close_waiting`` (the server stopping); none handed on once closing
        self.waiting: set[_Gate | _TlsOpening] = set()
        self.closing = False

    def factory(self, inner: Callable[[], asyncio.BaseProtocol]) -> Callable[[], asyncio.BaseProtocol]:
        return lambda: _Gate(self, inner)

    def proxied(self, peer: str | None) -> bool:
        """Whether a connection from ``peer`` opens with a PROXY header (a listed balancer's)."""
        if not self.proxy_from or peer is None:
            return False
        try:
            ip = ipaddress.ip_address(peer)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in n for n in self.proxy_from)

    def close_waiting(self) -> None:
        """The server stops: no connection is handed on any more, those waiting for a header close."""
        self.closing = True
        for g in list(self.waiting):
            g.close()

    def full(self) -> bool:
        return self.count() + len(self.waiting) >= self.limit

    def refuse(self, transport: asyncio.BaseTransport, answer: bytes | None = None) -> None:
        """Past the cap (or ``answer``'s): answered, and the connection closed."""
        if answer is None:
            self.refused += 1
            answer = self.answer
        t: Any = transport
        with contextlib.suppress(Exception):
            t.write(answer)
        transport.close()

    def admit(self, transport: asyncio.BaseTransport, client: str | None) -> str | None:
        """Whether a connection from ``client`` is served: its per-client key (counted), "" (no cap), or
        None (refused: answered and closed)."""
        if self.closing:
            transport.close()
            return None
        if self.full():
            self.refuse(transport)
            return None
        if not self.per_client or client is None:
            return ""
        key = client_key(client)
        n = self.clients.get(key, 0)
        if n < self.per_client:
            self.clients[key] = n + 1
            return key
        self.refused_client += 1
        self.refuse(transport, self.answer_client)
        return None

    def release(self, key: str) -> None:
        """A connection ``admit`` counted under ``key`` closed."""
        n = self.clients.get(key, 0) - 1
        if n > 0:
            self.clients[key] = n
        else:
            self.clients.pop(key, None)


class _Gate(asyncio.Protocol):
    """Stands for a new connection until it is made: refused past the caps, else hands the transport to
    the real protocol (``set_protocol``: nothing stays between them afterwards); a balancer's connection
    first brings its PROXY header (buffered here, bounded in size and time)."""

    __slots__ = ("buf", "cap", "client", "inner", "opening", "peer", "timer", "transport")

    def __init__(
        self,
        cap: ConnectionCap,
        inner: Callable[[], asyncio.BaseProtocol],
        opening: _TlsOpening | None = None,
    ) -> None:
        self.cap = cap
        self.inner = inner
        self.buf: bytes | None = None  # a PROXY header's bytes so far (None: not waiting for one)
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.peer: str | None = None
        self.opening = opening  # the TLS listener's stage before this (its header already read)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cap = self.cap
        if self.opening is not None:  # (its handshake done: it no longer waits, it is admitted or not)
            cap.waiting.discard(self.opening)
            self._hand(transport, self.opening.client, b"")
            return
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if cap.proxied(self.peer):
            if cap.full() or cap.closing:
                cap.refuse(transport)
                return
            self.transport = transport
            self.buf = b""
            cap.waiting.add(self)
            self.timer = asyncio.get_running_loop().call_later(PROXY_HEADER_S, self._refuse_proxy)
            return
        self._hand(transport, self.peer, b"")

    def close(self) -> None:
        """Stop waiting for the header: the connection closes."""
        self.cap.waiting.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.buf = None
        if self.transport is not None:
            self.transport.close()

    def _hand(self, transport: asyncio.BaseTransport, client: str | None, rest: bytes) -> None:
        cap = self.cap
        key = cap.admit(transport, client)
        if key is None:
            return
        proto = self.inner()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if isinstance(proto, _Conn):  # (aiohttp's server has neither cap nor PROXY headers: config)
            if client is not None:
                proto.remote = client
            if key:
                proto.on_lost = lambda: cap.release(key)
            if rest:
                proto.data_received(rest)

    def _refuse_proxy(self) -> None:
        self.cap.refused_proxy += 1
        self.timer = None
        self.close()

    def data_received(self, data: bytes) -> None:
        if self.buf is None:  # a refused connection's request: ignored
            return
        buf = self.buf + data
        try:
            header = parse(buf)
        except ProxyError as e:
            log.info("a connection from %s refused: %s", self.peer, e)
            header = None
            buf = b"\x00" * (MAX_HEADER + 1)
        if header is None:
            if len(buf) > MAX_HEADER:
                self._refuse_proxy()
            else:
                self.buf = buf
            return
        transport = self.transport
        assert transport is not None
        self.transport = None  # (handed on: ``close`` no longer closes it)
        self.close()
        self._hand(transport, header.client or self.peer, buf[header.length :])

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:  # (before it was handed on)
        self.transport = None
        self.close()


def _peer_of(sock: socket.socket) -> str | None:
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(sock.fileno(), ready)
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


async def read_proxy_header(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> ProxyHeader:
    """The PROXY header a non-blocking ``sock`` opens with, read to its last byte and not one further
    (what follows is the client's TLS, which the TLS stack reads from the socket itself). ``ProxyError``
    when the bytes are not a header or the peer closes first; the caller bounds the time."""
    buf = b""
    while True:  # bounded: each turn takes at least one byte, and at most MAX_HEADER + 1 are taken
        await _readable(loop, sock)
        try:
            peek = sock.recv(MAX_HEADER + 1 - len(buf), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        if not peek:
            raise ProxyError("the connection closed before its PROXY header")
        end = header_end(buf + peek)
        buf += sock.recv(len(peek) if end is None else min(len(peek), end - len(buf)))
        header = parse(buf)
        if header is not None:
            return header
        if len(buf) > MAX_HEADER:
            raise ProxyError("a PROXY header longer than this server reads")


class _TlsOpening:
    """A connection the TLS listener accepted, before its handshake is done: its PROXY header (when it
    comes from a balancer) is read here, then the socket goes to the TLS stack; counted in the cap's
    ``waiting`` until then (``close``: the server stops, the connection closes)."""

    __slots__ = ("cap", "client", "sock", "task")

    def __init__(self, cap: ConnectionCap, sock: socket.socket) -> None:
        self.cap = cap
        self.sock = sock
        self.client: str | None = None
        self.task: asyncio.Task[None] | None = None

    def close(self) -> None:
        self.cap.waiting.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # (the socket closes once the task has ended: its reader removed first)
        else:
            self._drop()

    def ended(self, task: asyncio.Task[None]) -> None:
        """Its task is over: cancelled (even before it started), the socket closes."""
        if task.cancelled():
            self._drop()

    def _drop(self) -> None:
        self.cap.waiting.discard(self)
        with contextlib.suppress(OSError):
            self.sock.close()

    async def open(
        self, inner: Callable[[], asyncio.BaseProtocol], ctx: ssl.SSLContext, handshake_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        cap = self.cap
        sock = self.sock
        peer = self.client = _peer_of(sock)
        try:
            if cap.proxied(peer):
                try:
                    async with asyncio.timeout(PROXY_HEADER_S):
                        header = await read_proxy_header(loop, sock)
                except (ProxyError, TimeoutError, OSError) as e:
                    cap.refused_proxy += 1
                    log.info("a connection from %s refused: %s", peer, e or "no PROXY header in time")
                    self._drop()
                    return
                self.client = header.client or peer
            await loop.connect_accepted_socket(
                lambda: _Gate(cap, inner, self), sock, ssl=ctx, ssl_handshake_timeout=handshake_s
            )
        except (OSError, ssl.SSLError, TimeoutError) as e:  # (a failed handshake: as asyncio's server)
            log.debug("a TLS connection from %s failed before it was served: %s", peer, e)
            self._drop()
        except BaseException:
            self._drop()
            raise
        finally:
            cap.waiting.discard(self)


class _TlsListener:
    """The client port with TLS behind balancers that send the PROXY header first: accepts itself (one
    task a listening socket) and opens each connection through ``_TlsOpening``. Stands for the
    ``asyncio.Server`` the other modes get (``sockets``, ``close``, ``wait_closed``)."""

    def __init__(
        self,
        cap: ConnectionCap,
        inner: Callable[[], asyncio.BaseProtocol],
        ctx: ssl.SSLContext,
        handshake_s: float,
        sockets: list[socket.socket],
    ) -> None:
        self.cap = cap
        self.inner = inner
        self.ctx = ctx
        self.handshake_s = handshake_s
        self.sockets = sockets
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._accept(s)) for s in sockets]

    @classmethod
    async def bind(
        cls,
        cap: ConnectionCap,
        inner: Callable[[], asyncio.BaseProtocol],
        ctx: ssl.SSLContext,
        handshake_s: float,
        host: str,
        port: int,
        *,
        backlog: int,
        reuse_address: bool,
        reuse_port: bool,
    ) -> _TlsListener:
        """Listening sockets on ``host``'s addresses (every interface when empty), as ``create_server``
        binds them."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        socks: list[socket.socket] = []
        try:
            for family, kind, proto, _, addr in dict.fromkeys(infos):
                s = socket.socket(family, kind, proto)
                socks.append(s)
                if reuse_address:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
                s.listen(backlog)
                s.setblocking(False)
        except BaseException:
            for s in socks:
                s.close()
            raise
        return cls(cap, inner, ctx, handshake_s, socks)

    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        cap = self.cap
        while True:  # (the server's life: ends with close)
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as e:  # out of descriptors, a connection reset while queued: go on shortly
                log.warning("accepting a TLS connection failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cap.closing or cap.full():  # (no answer before the handshake: closed, as past the cap)
                cap.refused += 1
                sock.close()
                continue
            opening = _TlsOpening(cap, sock)
            cap.waiting.add(opening)
            opening.task = task = loop.create_task(opening.open(self.inner, self.ctx, self.handshake_s))
            task.add_done_callback(opening.ended)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for s in self.sockets:
            s.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)


class CappedTCPSite(web.TCPSite):
    """aiohttp's ``TCPSite`` with a ``ConnectionCap`` (made from the runner's server's connections)."""

    def __init__(self, runner: BaseRunner, host: str, port: int, *, limit: int, **kw: Any) -> None:
        super().__init__(runner, host, port, **kw)
        server = runner.server
        assert server is not None, "runner.setup() first"
        self.cap = ConnectionCap(limit, lambda: len(server.connections))

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does; then TCPSite's, through the cap
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.cap.factory(server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


class LeanServer:
    """Serves a started aiohttp application (``await web.AppRunner(app).setup()`` first: it runs
    on_startup; ``runner.cleanup()`` after ``shutdown`` runs on_cleanup)."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_body: int,
        limits: Limits | None = None,
        clock: Callable[[], float] | None = None,
        max_connections: int = 10_000,
        max_connections_per_client: int = 0,
        proxy_from: Sequence[str] = (),
    ) -> None:
        if app.on_response_prepare:
            raise TypeError("the lean HTTP server does not run on_response_prepare signals")
        self.app = app
        self.max_body = max_body
        self.limits = limits or Limits()
        self.routes = Routes(app)
        # whether a request (its head just read) will be refused whatever its body (a caller the app's
        # authentication refuses without waiting): then its body is dropped as it comes, not buffered
        self.body_gate: Callable[[LeanRequest], bool] | None = None
        self.targets: dict[tuple[bytes, bytes], _Resolved] = {}  # bounded by _TARGETS_MAX
        self.conns: set[_Conn] = set()
        self.cap = ConnectionCap(  # refused ones: ``cap.refused``, ``refused_client``, ``refused_proxy``
            max_connections,
            self.conns.__len__,
            per_client=max_connections_per_client,
            proxy_from=proxy_from,
        )
        self._server: asyncio.AbstractServer | _TlsListener | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.draining = False  # (``drain``) answers close their connections
        self.stopping = False  # (``stop_in_flight``) requests cancelled now are answered 503
        self.loop = asyncio.get_running_loop()
        self.clock = clock or self.loop.time  # the time limits' clock (tests inject one, with ``sweep``)

    async def start(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
        reuse_address: bool = True,
        reuse_port: bool = False,
    ) -> None:
        if ssl_context is not None and self.cap.proxy_from:  # PROXY headers before TLS: accepted here
            self._server = await _TlsListener.bind(
                self.cap,
                lambda: _Conn(self),
                ssl_context,
                self.limits.tls_handshake_secs,
                host,
                port,
                backlog=backlog,
                reuse_address=reuse_address,
                reuse_port=reuse_port,
            )
        else:
            self._server = await self.loop.create_server(
                self.cap.factory(lambda: _Conn(self)),
                host,
                port,
                ssl=ssl_context,
                ssl_handshake_timeout=self.limits.tls_handshake_secs if ssl_context is not None else None,
                backlog=backlog,
                reuse_address=reuse_address,
                reuse_port=reuse_port or None,
            )
        self.arm_sweep()

    @property
    def port(self) -> int:
        """The bound port (of the first socket)."""
        socks: Any = getattr(self._server, "sockets", None)  # uvloop's server is not an asyncio.Server
        assert socks, "not started"
        port: int = socks[0].getsockname()[1]
        return port

    def arm_sweep(self) -> None:
        """Sweep every few seconds while there are connections (a connection arms it when none was
        armed): a server without connections does not wake for it."""
        if self._sweeper is None and self.conns:
            tick = max(0.5, min(5.0, self.limits.keepalive_secs / 3))
            self._sweeper = self.loop.call_later(tick, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.sweep()
        self.arm_sweep()

    def sweep(self) -> None:
        """Close connections idle for ``keepalive_secs``; answer 408 to requests slower than
        ``head_secs`` / ``body_secs`` (done every few seconds on its own)."""
        now = self.clock()
        for c in list(self.conns):
            c.idle_close(now)

    def drain(self) -> None:
        """The node drains (its readiness is 503): answers from now on close their connections, so that
        clients' next requests go to another node behind the balancer."""
        self.draining = True

    async def stop_in_flight(self, timeout: float = 2.0) -> None:
        """The grace is over: cancel every request still being answered. One without an answer yet gets
        a 503 ``server_shutting_down``; a stream under way ends with its in-band error and its body's end
        (``Generation.stream``); their engine calls are aborted. Waits (bounded) for them to be written."""
        self.stopping = True
        tasks = [c.task for c in self.conns if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close idle connections, wait (bounded) for in-flight requests, close the rest."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        self.cap.close_waiting()
        for c in list(self.conns):
            c.closing = True
            c.idle_close(None)
        deadline = self.loop.time() + timeout
        while self.conns and self.loop.time() < deadline:  # polled, bounded
            for c in list(self.conns):
                c.idle_close(None)
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.task is not None:
                c.task.cancel()
            c._close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()
        # the transports closed above let go of their sockets on the next loop turn (connection_lost):
        # a caller that goes on once this returns finds them closed, not reset by the data it sends
        await asyncio.sleep(0)
