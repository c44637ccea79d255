"""A lean HTTP/1.1 server for the node's aiohttp ``web.Application`` (``--http-server lean``).

aiohttp's server costs ~134 µs of CPU per small POST → JSON; an ``asyncio.Protocol`` over httptools'
C parser (llhttp) does the same in a fraction of that. ``LeanServer`` serves an aiohttp application as
it is (its routes, middlewares, ``app[...]`` storage; startup and cleanup stay with ``web.AppRunner``) with
only the work a gateway needs per request, done by each connection (connection.py: parsing, limits, slow
clients, request bodies, routing, responses, client disconnects).

- **Shutdown** (``shutdown``): stop accepting, close idle keep-alive connections, let in-flight requests
  finish (bounded), then close the rest. Idle keep-alive connections close after ``keepalive_secs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web

from shepherd.node.http.connection import _Conn, _Resolved
from shepherd.node.http.limits import Limits
from shepherd.node.http.types import Routes


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
    ) -> None:
        if app.on_response_prepare:
            raise TypeError("the lean HTTP server does not run on_response_prepare signals")
        self.app = app
        self.max_body = max_body
        self.limits = limits or Limits()
        self.routes = Routes(app)
        self.targets: dict[tuple[bytes, bytes], _Resolved] = {}  # bounded by _TARGETS_MAX
        self.conns: set[_Conn] = set()
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
    ) -> None:
        self._server = await self.loop.create_server(
            lambda: _Conn(self),
            host,
            port,
            ssl=ssl_context,
            backlog=backlog,
            reuse_address=reuse_address,
        )
        self._schedule_sweep()

    @property
    def port(self) -> int:
        """The bound port (of the first socket)."""
        socks: Any = getattr(self._server, "sockets", None)  # uvloop's server is not an asyncio.Server
        assert socks, "not started"
        port: int = socks[0].getsockname()[1]
        return port

    def _schedule_sweep(self) -> None:
        tick = max(0.5, min(5.0, self.limits.keepalive_secs / 3))
        self._sweeper = self.loop.call_later(tick, self._sweep)

    def _sweep(self) -> None:
        self.sweep()
        self._schedule_sweep()

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
