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
  asyncio's ``ssl_handshake_timeout``, not by the cap). The cap never exceeds what the process may open
  (``fd_budget``: ``RLIMIT_NOFILE`` less a reserve for engine connections, the mesh, files and the refusals
  themselves): past it, idle connections would take every descriptor, new clients would be reset without an
  answer and the node could open no engine connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner

from shepherd.node.http.connection import _Conn, _Resolved
from shepherd.node.http.limits import Limits, error_body
from shepherd.node.http.types import LeanRequest, Routes

log = logging.getLogger("shepherd.http")

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


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

    def __init__(self, limit: int, count: Callable[[], int]) -> None:
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

    def factory(self, inner: Callable[[], asyncio.BaseProtocol]) -> Callable[[], asyncio.BaseProtocol]:
        return lambda: _Gate(self, inner)


class _Gate(asyncio.Protocol):
    """Stands for a new connection until it is made: refused past the cap, else hands the transport to
    the real protocol (``set_protocol``: nothing stays between them afterwards)."""

    __slots__ = ("cap", "inner")

    def __init__(self, cap: ConnectionCap, inner: Callable[[], asyncio.BaseProtocol]) -> None:
        self.cap = cap
        self.inner = inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cap = self.cap
        if cap.count() >= cap.limit:
            cap.refused += 1
            t: Any = transport
            with contextlib.suppress(Exception):
                t.write(cap.answer)
            transport.close()
            return
        proto = self.inner()
        transport.set_protocol(proto)
        proto.connection_made(transport)

    def data_received(self, data: bytes) -> None:  # a refused connection's request: ignored
        pass

    def eof_received(self) -> bool | None:
        return None


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
        self.cap = ConnectionCap(max_connections, self.conns.__len__)  # refused ones: ``cap.refused``
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None
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
        self._server = await self.loop.create_server(
            self.cap.factory(lambda: _Conn(self)),
            host,
            port,
            ssl=ssl_context,
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

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close idle connections, wait (bounded) for in-flight requests, close the rest."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
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
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
