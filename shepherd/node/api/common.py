"""What the routes share: the app keys (gateway, admission, SSE keep-alive), the error middleware, SSE
keep-alive comments, and the relay to OpenAI HTTP workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from shepherd.node.api.admission import Admission
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.engines.http import HttpRelayClient
from shepherd.node.http.types import stream_response
from shepherd.node.openai.sse import DONE, KEEPALIVE, error_event
from shepherd.proto.engine_types import EngineError
from shepherd.proto.openai_errors import ApiError, error_response
from shepherd.storage.ids import new_id
from shepherd.storage.types import HistoryStore
from shepherd.tokens.pool import TokenizerPoolUnavailable, TokenizerWorkerError

log = logging.getLogger("shepherd.api")

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
ADMISSION: web.AppKey[Admission | None] = web.AppKey("admission")  # None: no rate limit configured
KEEPALIVE_TICKER: web.AppKey[KeepAlive] = web.AppKey("keepalive")
HISTORY: web.AppKey[History] = web.AppKey("history")


class History:
    """The history store the stateful routes use (Responses, Conversations), and the ids they mint.

    ``store``: in a mesh with an embedded backend, a store that routes each call by the id's owner
    (``shepherd.node.cluster``); else the backend itself. ``tag``: this node's owner tag.
    """

    def __init__(self, store: HistoryStore, tag: str) -> None:
        self.store = store
        self.tag = tag

    def new_id(self, prefix: str, owner_tag: str | None = None) -> str:
        """A fresh id owned by this node, or by the node of ``owner_tag`` (a conversation's owner keeps
        the responses stored in that conversation, so the pair is written in one transaction)."""
        return new_id(prefix, owner_tag or self.tag)


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# a route's label in the metrics (its resource's canonical path), by route: the app's routes live as long
# as the process (aiohttp's system routes, made per refused request, have no resource and are not kept)
_ROUTE_LABELS: dict[Any, str] = {}


def _route_label(route: Any) -> str:
    resource = route.resource
    if not resource:
        return "unmatched"
    label: str = resource.canonical
    if len(_ROUTE_LABELS) < 1024:
        _ROUTE_LABELS[route] = label
    return label


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    route = request.match_info.route
    path = _ROUTE_LABELS.get(route)
    if path is None:
        path = _route_label(route)
    gw.in_flight += 1
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except ApiError as e:
        status = e.status
        gw.metrics.errors.labels(path, e.code or e.type).inc()
        return error_response(e)
    except EngineError as e:
        status = 504 if e.code == "engine_timeout" else 400 if e.code == "invalid_request" else 502
        gw.metrics.errors.labels(path, e.code).inc()
        kind = "invalid_request_error" if status == 400 else "server_error"
        return error_response(ApiError(status, str(e), type=kind, code=e.code))
    except (TokenizerWorkerError, TokenizerPoolUnavailable) as e:
        status = 503
        gw.metrics.errors.labels(path, "tokenizer").inc()
        log.warning("tokenizer pool failure on %s: %s", request.path, e)
        return error_response(
            ApiError(
                503,
                "The tokenizer pool failed this request; retry.",
                type="service_unavailable",
                code="tokenizer",
            )
        )
    except TimeoutError:
        status = 504
        gw.metrics.errors.labels(path, "timeout").inc()
        return error_response(ApiError(504, "The request timed out.", type="server_error", code="timeout"))
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        msg = e.text or e.reason
        headers: dict[str, str] = {}
        if e.status == 404:
            msg = f"No route for {request.method} {request.path}."
        elif e.status == 405:
            msg = f"Method {request.method} is not allowed on {request.path}."
            if allow := e.headers.get("Allow"):
                headers["Allow"] = allow
        gw.metrics.errors.labels(path, str(e.status)).inc()
        return error_response(
            ApiError(
                e.status, msg, type=_STATUS_TYPES.get(e.status, "invalid_request_error"), headers=headers
            )
        )
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        gw.metrics.errors.labels(path, "internal").inc()
        return error_response(
            ApiError(500, "Internal error in the gateway.", type="internal_error", code="internal")
        )
    finally:
        gw.in_flight -= 1
        gw.metrics.count_request(path, request.get("model", ""), status)


class _Entry:
    __slots__ = ("last", "resp")

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


class KeepAlive:
    """One ticker for all open SSE streams: a comment line on each stream idle for ``interval`` seconds,
    so proxies and clients don't time out during long prefills or queueing."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._streams: dict[int, _Entry] = {}  # id(resp): every register has its unregister in a finally
        self._task: asyncio.Task[None] | None = None

    def register(self, resp: web.StreamResponse) -> _Entry:
        e = _Entry(resp)
        self._streams[id(resp)] = e
        return e

    def unregister(self, resp: web.StreamResponse) -> None:
        self._streams.pop(id(resp), None)

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        tick = max(0.05, min(1.0, self.interval / 2))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for e in list(self._streams.values()):
                if now - e.last >= self.interval:
                    e.touch()
                    with contextlib.suppress(Exception):
                        await e.resp.write(KEEPALIVE)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def relay(
    request: web.Request, gw: Gateway, model: str, raw: bytes, body: dict[str, Any], path: str, stream: bool
) -> web.StreamResponse:
    """Pass a request to an OpenAI HTTP worker; SSE flows back as it arrives. Retries another worker when
    the connection fails before any answer."""
    tried: set[str] = set()
    last: EngineError | None = None
    for _ in range(gw.cfg.max_retries + 1):
        w = gw.pick(model, tried, [], request.headers.get("x-smg-routing-key"), http=True)
        if w is None:
            break
        client = w.client
        assert isinstance(client, HttpRelayClient)
        served = w.info.served_model_name if w.info else ""
        payload = (
            raw if not served or served == body.get("model") else orjson.dumps({**body, "model": served})
        )
        headers = {"Content-Type": "application/json"}
        if rid := request.headers.get("x-request-id"):
            headers["x-request-id"] = rid
        w.in_flight += 1
        try:
            try:
                upstream = await client.post(path, payload, headers)
            except EngineError as e:
                gw.registry.record_result(w, False)
                tried.add(w.id)
                last = e
                continue
            gw.registry.record_result(w, upstream.status < 500)
            try:
                ctype = upstream.headers.get("Content-Type", "application/json")
                if stream and upstream.status == 200:
                    resp = stream_response(
                        request, status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
                    )
                    await resp.prepare(request)
                    try:
                        async for chunk in upstream.content.iter_any():
                            await resp.write(chunk)
                    except (aiohttp.ClientError, TimeoutError) as e:
                        await resp.write(
                            error_event(f"worker stream failed: {e}", code="engine_error") + DONE
                        )
                    return resp
                data = await upstream.read()
                return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype})
            finally:
                upstream.release()
        finally:
            w.in_flight -= 1
    if last is not None:
        raise last
    raise ApiError(
        503,
        f"No healthy worker is available for model '{model}'.",
        type="service_unavailable",
        code="no_available_worker",
    )
