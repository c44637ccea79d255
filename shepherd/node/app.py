"""Assemble and run one node: the aiohttp app, its gateway, signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

from aiohttp import web

from shepherd.auth.keys import KeyStore
from shepherd.auth.middleware import AUTH, make_body_gate
from shepherd.auth.tls import server_tls
from shepherd.mesh import faults
from shepherd.mesh.keyring import Keyring
from shepherd.node import gc_tuning
from shepherd.node.api import admin as api_admin
from shepherd.node.api import conversations as api_conversations
from shepherd.node.api import embeddings as api_embeddings
from shepherd.node.api import keys as api_keys
from shepherd.node.api import mesh as api_mesh
from shepherd.node.api import messages as api_messages
from shepherd.node.api import native as api_native
from shepherd.node.api import openai as api_openai
from shepherd.node.api import pooling as api_pooling
from shepherd.node.api import reload as api_reload
from shepherd.node.api import responses as api_responses
from shepherd.node.api import smg_metrics
from shepherd.node.api.admission import Admission
from shepherd.node.api.common import (
    ADMISSION,
    GATEWAY,
    HISTORY,
    KEEPALIVE_TICKER,
    History,
    KeepAlive,
    error_middleware,
)
from shepherd.node.api.cors import apply_head_extra, make_cors_middleware
from shepherd.node.cluster.history import build_history
from shepherd.node.cluster.key_journal import KeyJournal
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.cluster.worker_journal import WorkerJournal
from shepherd.node.config import ConfigError, NodeConfig, control_listener, insecure_admin_in_effect
from shepherd.node.discovery.kube import PodDiscovery, start_discovery
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.model_source import resolve_models
from shepherd.node.dispatch.workers import Worker
from shepherd.node.http.body import json_response
from shepherd.node.http.server import CappedTCPSite, ConnectionCap, LeanServer
from shepherd.node.http.types import LeanRequest
from shepherd.node.metrics import counter
from shepherd.node.observe import genai_metrics, logs, tracing
from shepherd.node.openai.reasoning_seal import ReasoningSeal
from shepherd.node.procs import PROC_INDEX_ENV
from shepherd.proto.anthropic_errors import anthropic_error_response, is_messages_path
from shepherd.proto.openai_errors import ApiError, error_response

log = logging.getLogger("shepherd.node")
PROCS_METRICS_TIMEOUT_S = 2.0  # a sibling process's exposition, asked for by a scrape of /metrics
_PROC_NAME = re.compile(r"-p(\d+)$")  # a --procs child's mesh name: <name>-p<index>


def build_app(
    gw: Gateway,
    mesh: MeshNode | None = None,
    *,
    admission: Admission | None = None,
    history: History | None = None,
    key_store: KeyStore | None = None,
) -> web.Application:
    """The node's aiohttp application: its routes and middlewares over the gateway. ``admission``: the
    rate limits (None: none configured). The SSE keep-alive ticker lives and dies with the app.
    ``history``: the Responses / Conversations store (None: those routes answer 503); ``key_store``: the
    API keys (None: a fresh one in memory)."""
    # traces and request-bound logs, outside the error middleware (they see the answer it makes); only
    # when on: a request pays no middleware of theirs otherwise
    cors = gw.cfg.cors_allowed_origins
    middlewares = [
        # a preflight is answered before anything else (it carries no credential)
        *([make_cors_middleware(cors, gw.cfg.auth.metrics)] if cors else []),
        *([tracing.server_span] if tracing.ENABLED else []),
        *([logs.request_context] if logs.ACTIVE else []),
        error_middleware,
    ]
    app = web.Application(client_max_size=gw.cfg.max_body_bytes, middlewares=middlewares)
    app[GATEWAY] = gw
    app[ADMISSION] = admission
    app[KEEPALIVE_TICKER] = KeepAlive(gw.cfg.sse_keepalive_secs)
    app.cleanup_ctx.append(_keepalive_ticking)
    if history is not None:
        app[HISTORY] = history
    app.add_routes(api_openai.routes())
    app.add_routes(api_messages.routes())  # /v1/messages, /v1/messages/count_tokens (Anthropic)
    app.add_routes(api_embeddings.routes())  # /v1/embeddings (gRPC Embed, or relayed)
    app.add_routes(api_pooling.routes())  # rerank, score, classify (relayed to HTTP workers)
    # /v1/responses (+ the background registry); reasoning blobs under the keys of reasoning_keyring_file,
    # else the mesh's, so that any node opens what another sealed (else a key of this process)
    rt = mesh.runtime if mesh is not None else None
    seal = None
    if gw.cfg.reasoning_keyring_file is not None:
        keys = Keyring.from_file(gw.cfg.reasoning_keyring_file).keys
        seal = ReasoningSeal(keys, cluster=gw.cfg.mesh_cluster)
    elif rt is not None:
        seal = ReasoningSeal(rt.keyring.keys, cluster=gw.cfg.mesh_cluster)
    api_responses.install(app, seal)
    app.add_routes(api_conversations.routes())
    app.add_routes(api_admin.routes())
    app.add_routes(api_native.routes())  # /generate, /version, /get_model_info... (vLLM, SGLang, SMG shapes)
    api_mesh.install(app, mesh)  # /mesh/members, /mesh/state (404 when the mesh is off), smg_mesh_*
    api_keys.install(app, key_store)  # auth middleware (inside the error middleware) and /admin/keys
    return app


async def _keepalive_ticking(app: web.Application) -> AsyncIterator[None]:
    ticker = app[KEEPALIVE_TICKER]
    ticker.start()
    yield
    await ticker.close()


@web.middleware
async def _starting(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every request while the start waits for its engines to say what they serve (no route runs):
    /liveness 200 (the process is up: an orchestrator must not restart it for engines that load their
    weights), /readiness and /health 503, anything else 503 with Retry-After in the API's envelope."""
    if request.path == "/liveness":
        return json_response({"status": "alive"})
    if request.path in ("/readiness", "/health"):
        return json_response({"status": "starting"}, 503)
    msg = "The node is starting: its engines have not yet said which model they serve; retry."
    err = ApiError(503, msg, type="service_unavailable", code="starting", headers={"Retry-After": "5"})
    return anthropic_error_response(err) if is_messages_path(request.path) else error_response(err)


class _StartingPort:
    """The client port while the start waits for engines (``resolve_models``' ``waiting``): a lean
    server of ``_starting`` alone, on the node's host, port and TLS, until just before the node's own
    binds (the gateway, tokenizers, history and mesh built meanwhile). Opened once, and only when the
    start does wait (engines that answer at once never see it). With ``--procs`` each child's joins the
    port's SO_REUSEPORT group while it waits: a sibling already serving shares the port with it then."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.server: LeanServer | None = None
        self.runner: web.AppRunner | None = None
        self._opened = False

    async def open(self) -> None:
        if self._opened:
            return
        self._opened = True
        cfg = self.cfg
        app = web.Application(middlewares=[_starting])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        tls = server_tls(cfg)
        server = LeanServer(
            app,
            max_body=64 * 1024,
            max_connections=cfg.max_client_connections,
            max_connections_per_client=cfg.max_connections_per_client,
            proxy_from=cfg.proxy_protocol_from,
        )
        start = server.start(
            cfg.host,
            cfg.port,
            ssl_context=tls.context if tls else None,
            backlog=128,
            reuse_port=cfg.reuse_port,
        )
        await _listen("--host/--port", cfg.host, cfg.port, start)
        self.server = server
        log.warning("waiting for the engines: %s:%d answers /liveness meanwhile", cfg.host, cfg.port)

    async def close(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await server.shutdown(timeout=1.0)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()


async def _listen(what: str, host: str, port: int, start: Awaitable[None]) -> None:
    """``start`` (a listener's bind), a failure to bind said in one line as a configuration error (the
    CLI's exit 2: a port in use or not ours to take is the operator's to fix, not a traceback)."""
    try:
        await start
    except OSError as e:
        # a host that does not resolve, a port in use or not ours; not a file the start reads (the mesh's
        # keyring, its TLS files: an unreadable one has its name on the error and is said as it is)
        in_use = e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)
        bind = in_use or isinstance(e, socket.gaierror)
        if e.filename is not None or not bind:
            raise
        raise ConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror or e}") from None


async def drain(gw: Gateway, grace: float) -> None:
    """Readiness goes 503 at once; wait (bounded) for in-flight requests to finish."""
    gw.draining = True
    deadline = time.monotonic() + grace
    while gw.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polled, bounded by the grace
        await asyncio.sleep(0.05)
    if gw.in_flight:
        log.warning("shutdown grace over with %d requests still in flight", gw.in_flight)


async def serve(cfg: NodeConfig, ready_message: bool = True) -> None:
    # While the start waits for engines still loading, the client port answers /liveness (and 503
    # elsewhere) until the node's own server binds it (or the start fails)
    starting = _StartingPort(cfg)
    try:
        await _serve(cfg, ready_message, starting)
    finally:
        await starting.close()


def _body_gate(app: web.Application) -> Callable[[LeanRequest], bool] | None:
    """With authentication on: a caller refused at its head has its body dropped as it comes, not
    buffered (``LeanServer.body_gate``)."""
    authn = app[AUTH].authenticator
    if not authn.cfg.enabled:
        return None
    return cast(Callable[[LeanRequest], bool], make_body_gate(authn))


async def _serve(cfg: NodeConfig, ready_message: bool, starting: _StartingPort) -> None:
    injected = faults.active()  # test-only fault switches (shepherd.mesh.faults; chaos.run --inject)
    if injected:
        log.warning("TEST-ONLY FAULTS INJECTED: %s", ", ".join(injected))
    if faults.DISABLE_MESH in injected:
        cfg = dataclasses.replace(cfg, mesh_port=None)
    given = cfg  # as configured: what a reload (SIGHUP, POST /admin/reload) compares the file with
    # no --model-path: the served name, tokenizer and chat template from the gRPC engines; aliases
    cfg = await resolve_models(cfg, waiting=starting.open)
    try:  # traces (OTLP) and the GenAI metrics export, before anything that is traced is built
        tracing.setup(
            tracing.settings_from(cfg.enable_trace, cfg.otlp_traces_endpoint, cfg.otlp_traces_protocol),
            cfg.mesh_name,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.otlp_metrics_endpoint:
        genai_metrics.setup(cfg.otlp_metrics_endpoint, cfg.otlp_traces_protocol or "grpc", cfg.mesh_name)
        tracing.instrument()
    gw = Gateway(cfg)
    gw.metrics.add_callback(smg_metrics.trace_families)
    # mesh-wide rate limits (None: none configured, and the handlers skip admission)
    admission = Admission.from_config(cfg, node=cfg.mesh_name, metrics=gw.metrics)
    if faults.DISABLE_RATELIMIT in injected:
        admission = None
    limiter = admission.limiter if admission is not None else None
    # built before the gateway starts: the policies must route with the replicated indexes from the start
    mesh = MeshNode(cfg, gw, limiter=limiter) if cfg.mesh_port is not None else None
    # the history store (routed to the owner nodes in a mesh with an embedded backend; its RPC handler
    # installed before the mesh starts) and the API keys journaled to the node's records
    history = build_history(cfg, mesh)
    await gw.start()
    if admission is not None:
        await admission.start()  # the Redis backend's first ping (bounded; unreachable: the fallback rule)
    try:
        await history.start()
        journal = await KeyJournal.open(cfg.data_dir, history.backend)
    except BaseException:
        await history.close()
        await gw.close()
        raise
    if mesh is not None:
        try:
            await _listen("--mesh-bind/--mesh-port", cfg.mesh_bind, cfg.mesh_port or 0, mesh.start())
        except BaseException:
            await mesh.close()
            await journal.close()
            await history.close()
            await gw.close()
            raise
    gw.metrics.add_callback(history.metrics)
    gw.metrics.add_callback(smg_metrics.SmgNames(gw, mesh, admission).collect)  # SMG's names, when scraped
    app = build_app(
        gw,
        mesh,
        admission=admission,
        history=History(
            history.store,
            history.tag,
            history.cancel_elsewhere if mesh is not None else None,
            history.conversations_refused,
            history.node_gone if mesh is not None else None,
            history.runner_runs if mesh is not None else None,
        ),
        key_store=journal.store,
    )
    journal.attach(journal.store, app[AUTH].bootstrap_ids)
    # the workers added through the API before a restart, added again (and published to the mesh)
    workers_journal = app[api_admin.WORKER_JOURNAL] = WorkerJournal(journal.records)
    removed_hook = gw.registry.on_removed

    def worker_removed(w: Worker) -> None:
        if removed_hook is not None:
            removed_hook(w)  # (the mesh's first: a removal made here is then the mesh's too)
        if mesh is None or mesh.removed_on_purpose(w.id):  # (not gone with its node: it comes back)
            workers_journal.removed(w.id)

    gw.registry.on_removed = worker_removed
    if await workers_journal.replay(functools.partial(api_admin.add_spec, gw)):
        log.info("%d workers added through the API before a restart added again", workers_journal.replayed)
    reloader = api_reload.Reloader(
        given,
        gw,
        admission=admission,
        auth=app[AUTH],
        journal=journal,
        key_sync=app[api_keys.KEY_SYNC],
        mesh=mesh,
    )
    api_reload.install(app, reloader)  # POST /admin/reload (SIGHUP: below, with the TLS reload)
    background = app[api_responses.BACKGROUND]

    async def cancel_background(response_id: str) -> bool:  # a peer's "cancel" RPC for one running here
        return background.cancel(response_id)

    history.set_cancel_handler(cancel_background)
    history.set_running_handler(background.__contains__)  # a peer's "running" RPC (a restarted runner's)
    proc_index = os.environ.get(PROC_INDEX_ENV)
    if mesh is not None and proc_index is not None:  # one of --procs N: /metrics shows every process's

        async def exposition() -> bytes:  # as its own /metrics renders it (the engine loads read first)
            await gw.registry.loads_for_reading()
            return gw.metrics.render()

        history.set_metrics_handler(exposition)

        async def siblings() -> dict[str, bytes]:
            got = await history.peer_metrics(PROCS_METRICS_TIMEOUT_S)
            return {m.group(1): body for name, body in got.items() if (m := _PROC_NAME.search(name))}

        app[api_admin.PROCS_METRICS] = (proc_index, siblings)
    if cfg.http_server != "lean" and cfg.cors_allowed_origins:
        app.on_response_prepare.append(apply_head_extra)  # (the lean server adds them itself)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        handler_args={"max_field_size": 65536, "max_line_size": 65536},  # large JWTs
    )
    await runner.setup()
    tls = server_tls(cfg)
    ssl_ctx = tls.context if tls else None
    await starting.close()  # (the port's starting answers end here: the node's own server binds it)
    front: LeanServer | None = None
    if cfg.http_server == "lean":  # the app's routes, middlewares and hooks as they are; httptools underneath
        front = LeanServer(
            app,
            max_body=cfg.max_body_bytes,
            max_connections=cfg.max_client_connections,
            max_connections_per_client=cfg.max_connections_per_client,
            proxy_from=cfg.proxy_protocol_from,
        )
        front.body_gate = _body_gate(app)
        start = front.start(cfg.host, cfg.port, ssl_context=ssl_ctx, backlog=1024, reuse_port=cfg.reuse_port)
        await _listen("--host/--port", cfg.host, cfg.port, start)
        cap: ConnectionCap = front.cap
    else:  # the same cap on aiohttp's server (shepherd.node.http.server.CappedTCPSite)
        site = CappedTCPSite(
            runner,
            cfg.host,
            cfg.port,
            limit=cfg.max_client_connections,
            backlog=1024,
            reuse_address=True,
            reuse_port=cfg.reuse_port or None,
            ssl_context=ssl_ctx,
        )
        await _listen("--host/--port", cfg.host, cfg.port, site.start())
        cap = site.cap
    gw.metrics.add_callback(
        lambda: [
            counter(
                "smg_http_connections_refused",
                "Client connections refused past max_client_connections",
                [],
                [([], float(cap.refused))],
            ),
            counter(
                "smg_http_connections_refused_client",
                "Client connections refused: past max_connections_per_client (client), or a load "
                "balancer's without a valid PROXY protocol header in time (proxy_header)",
                ["reason"],
                [(["client"], float(cap.refused_client)), (["proxy_header"], float(cap.refused_proxy))],
            ),
        ]
    )
    # the admin listener: the control routes are served there and not on the client port
    # (shepherd.auth.control); same app, same TLS
    admin_front: LeanServer | None = None
    admin_host, admin_port = control_listener(cfg)
    if cfg.admin_port is not None:
        if cfg.http_server == "lean":
            admin_front = LeanServer(app, max_body=cfg.max_body_bytes)
            admin_front.body_gate = _body_gate(app)
            start = admin_front.start(
                admin_host, admin_port, ssl_context=ssl_ctx, backlog=128, reuse_port=cfg.reuse_port
            )
            await _listen("--admin-host/--admin-port", admin_host, admin_port, start)
        else:
            admin_site = web.TCPSite(
                runner,
                admin_host,
                admin_port,
                reuse_address=True,
                reuse_port=cfg.reuse_port or None,
                ssl_context=ssl_ctx,
            )
            await _listen("--admin-host/--admin-port", admin_host, admin_port, admin_site.start())
    if insecure_admin_in_effect(cfg):
        log.warning(
            "INSECURE ADMIN: the control plane (/admin/*, /workers*, /mesh/*, /metrics) is served WITHOUT "
            "authentication on %s:%d, an address other machines reach (--insecure-admin): anyone there "
            "can add and delete workers mesh-wide and mint API keys",
            admin_host,
            admin_port,
        )
    if tls:
        tls.start(sighup=False)  # reload changed cert files; SIGHUP: the reloader's handler does both
    reloader.tls = tls
    reloader.start()  # SIGHUP: TLS certificates and the configuration file
    # Kubernetes worker discovery: workers registered as POST /workers does (the mesh replicates them)
    discovery: PodDiscovery | None = start_discovery(cfg, gw) if cfg.service_discovery else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gc_tuning.settle(cfg.gc_gen0_threshold)  # start-up is over: freeze what it built
    if ready_message:
        models = ", ".join(gw.model_names())
        n = len(gw.registry.workers)
        scheme = "https" if tls else "http"
        admin = f" admin={scheme}://{admin_host}:{admin_port}" if cfg.admin_port is not None else ""
        print(
            f"smg-node listening on {scheme}://{cfg.host}:{cfg.port} models=[{models}] workers={n}{admin}",
            flush=True,
        )
    try:
        await stop.wait()
        log.info("shutting down: draining")
        if front is not None:
            front.drain()
        # the node stays in the mesh while it drains (its leave is in the finally below): the turns it is
        # finishing write their records to other nodes' stores and release conversation leases there, and
        # the records it owns stay readable for the others until it goes
        await drain(gw, cfg.shutdown_grace_secs)
        if gw.in_flight and front is not None:  # the grace is over: end what is left, each with its error
            gw.stopping = True
            await front.stop_in_flight()
    finally:
        # stop accepting, close idle connections, let in-flight ones end (bounded, both listeners at once:
        # the mesh's leave below comes within the orchestrator's kill deadline)
        fronts = [f.shutdown(timeout=5.0) for f in (front, admin_front) if f is not None]
        await asyncio.gather(*fronts, return_exceptions=True)
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await reloader.close()
        if tls:
            await tls.close()
        if discovery is not None:
            await discovery.close()
        if mesh is not None:
            await mesh.close()
        await workers_journal.close()
        await journal.close()
        await history.close()
        if admission is not None:
            await admission.close()
        await gw.close()
        await tracing.shutdown()
        await genai_metrics.shutdown()
