"""An aiohttp server on loopback in a thread with its own event loop: the stand-ins of HTTP workers the
e2e tests put behind a node (a subclass answers every path with ``_handle``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from aiohttp import web


class ThreadedApp:
    """``start()`` serves ``_handle`` for every method and path on a free loopback port (``url``);
    ``stop()`` ends the loop and joins the thread. ``handler_cancellation``: a handler is cancelled when
    its client closes the connection (aiohttp's default is to let it run)."""

    handler_cancellation = False

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)

        async def start() -> None:
            self._runner = web.AppRunner(app, access_log=None, handler_cancellation=self.handler_cancellation)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()

        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
        loop.close()

    def start(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, r: web.Request) -> web.StreamResponse:
        raise NotImplementedError
