"""Assemble and run one node: the aiohttp app, its gateway, signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from aiohttp import web

from shepherd.node import api_admin, api_openai
from shepherd.node.api_common import GATEWAY, error_middleware
from shepherd.node.config import NodeConfig
from shepherd.node.gateway import Gateway

log = logging.getLogger("shepherd.node")


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.cfg.max_body_bytes, middlewares=[error_middleware])
    app[GATEWAY] = gw
    app.add_routes(api_openai.routes())
    app.add_routes(api_admin.routes())
    return app


async def drain(gw: Gateway, grace: float) -> None:
    """Readiness goes 503 at once; wait (bounded) for in-flight requests to finish."""
    gw.draining = True
    deadline = time.monotonic() + grace
    while gw.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polled, bounded by the grace
        await asyncio.sleep(0.05)
    if gw.in_flight:
        log.warning("shutdown grace over with %d requests still in flight", gw.in_flight)


async def serve(cfg: NodeConfig, ready_message: bool = True) -> None:
    gw = Gateway(cfg)
    await gw.start()
    app = build_app(gw)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_message:
        models = ", ".join(gw.model_names())
        n = len(gw.registry.workers)
        print(f"smg-node listening on http://{cfg.host}:{cfg.port} models=[{models}] workers={n}", flush=True)
    try:
        await stop.wait()
        log.info("shutting down: draining")
        await drain(gw, cfg.shutdown_grace_secs)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await gw.close()
