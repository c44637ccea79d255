"""What the routes share: the app keys (gateway, admission, SSE keep-alive, history), the error middleware,
SSE keep-alive comments, the relay to OpenAI HTTP workers, and what the stateful routes (Responses,
Conversations) share: the history store of a request, its errors as API errors, records' ownership."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from shepherd.auth.principal import PRINCIPAL_KEY, Principal
from shepherd.node.api.admission import TICKET_KEY, Admission
from shepherd.node.cluster.history import OwnerGone, OwnerUnavailable
from shepherd.node.dispatch.gateway import Gateway, model_not_found
from shepherd.node.dispatch.workers import no_healthy_worker
from shepherd.node.engines.http import (
    RELAY_CONTENT_TYPES,
    RELAY_MAX_BYTES,
    RELAY_STREAM_MAX_BYTES,
    BodyTooLarge,
    HttpRelayClient,
    read_capped,
)
from shepherd.node.http.types import stream_response
from shepherd.node.openai.reasoning_seal import ReasoningSeal
from shepherd.node.openai.requests import Sampling
from shepherd.node.openai.sse import DONE, KEEPALIVE, error_event
from shepherd.policies.text_ids import body_ids
from shepherd.proto.anthropic_errors import anthropic_error_response, convert_body, is_messages_path
from shepherd.proto.engine_types import EngineError
from shepherd.proto.openai_errors import ApiError, bad, error_response
from shepherd.storage.ids import new_id
from shepherd.storage.types import HistoryStore, IntegrityError, NotFound, StorageUnavailable, StoredItem
from shepherd.tokens.pool import TokenizerPoolUnavailable, TokenizerWorkerError

log = logging.getLogger("shepherd.api")
audit_log = logging.getLogger("shepherd.audit")


# an engine's failure as the client's status: the request's fault, the deadline, an overloaded fleet
# (every worker tried said RESOURCE_EXHAUSTED: retry later), else the upstream's (502)
_ENGINE_STATUS = {"invalid_request": 400, "engine_timeout": 504, "engine_overloaded": 503}


def audit(request: web.Request, action: str, target: str) -> None:
    """One line per change to the control plane's state (workers, API keys): what, on what, by whom
    (the caller's subject and how it authenticated; ``anonymous`` on an unauthenticated loopback
    control plane) and from where."""
    who = request.get(PRINCIPAL_KEY)
    subject, method = (who.subject, who.method) if who is not None else ("anonymous", "none")
    audit_log.info("%s %s by %s (%s) from %s", action, target, subject, method, request.remote or "?")


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
ADMISSION: web.AppKey[Admission | None] = web.AppKey("admission")  # None: no rate limit configured
KEEPALIVE_TICKER: web.AppKey[KeepAlive] = web.AppKey("keepalive")
HISTORY: web.AppKey[History] = web.AppKey("history")
# seals reasoning items' ``encrypted_content`` and opens those sent back (the mesh's keys: any node opens)
REASONING_SEAL: web.AppKey[ReasoningSeal] = web.AppKey("reasoning_seal")


class History:
    """The history store the stateful routes use (Responses, Conversations), and the ids they mint.

    ``store``: in a mesh with an embedded backend, a store that routes each call by the id's owner
    (``shepherd.node.cluster``); else the backend itself. ``tag``: this node's owner tag.
    """

    def __init__(
        self,
        store: HistoryStore,
        tag: str,
        cancel_elsewhere: Callable[[str], Awaitable[bool]] | None = None,
        conversations_refused: str | None = None,
        node_gone: Callable[[str], bool] | None = None,
        runner_runs: Callable[[str, str], Awaitable[bool | None]] | None = None,
    ) -> None:
        self.store = store
        self.tag = tag
        # why new conversations are refused (the memory backend in a mesh, not allowed local): None: they
        # are not
        self.conversations_refused = conversations_refused
        # a mesh: ask the other nodes to cancel a background response one of them runs (True: one did)
        self.cancel_elsewhere = cancel_elsewhere
        # a mesh: whether the node of an owner tag is gone (dead, left, or no member has the tag)
        self.node_gone = node_gone
        # a mesh: whether the alive node of an owner tag runs a background response (None: cannot tell)
        self.runner_runs = runner_runs
        # a store call found the store unavailable: until then (its Retry-After) a turn that must be stored
        # is refused before any engine work, whose answer could not be kept; the first after it tries again
        self.down_until = 0.0

    def store_failed(self, e: StorageUnavailable) -> None:
        """This node's store failed a call: turns that must be stored are refused for its Retry-After.
        Not for another node's records (``OwnerUnavailable``: a turn continuing a chain held by a node
        suspected down must not refuse everyone else's turns here)."""
        if isinstance(e, OwnerUnavailable):
            return
        self.down_until = max(self.down_until, time.monotonic() + max(1.0, e.retry_after))

    def refuse_while_down(self) -> None:
        """The 503 of a store known to be unavailable (``store_failed``), if it still is."""
        left = self.down_until - time.monotonic()
        if left > 0:
            raise history_unavailable(StorageUnavailable("known unavailable", retry_after=left), "history")

    def new_id(self, prefix: str, owner_tag: str | None = None) -> str:
        """A fresh id owned by this node, or by the node of ``owner_tag`` (a conversation's owner keeps
        the responses stored in that conversation, so the pair is written in one transaction)."""
        return new_id(prefix, owner_tag or self.tag)


# ---- the stateful routes: the store, its errors, ownership ----------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def history_of(request: web.Request, store: str) -> History:
    """The app's history store; without one a 503 naming ``store`` ("response", "conversation")."""
    h = request.app.get(HISTORY)
    if h is None:
        raise ApiError(
            503, f"The {store} store is not configured.", type="service_unavailable", code="no_store"
        )
    return h


def history_unavailable(
    e: StorageUnavailable, store: str, rounding: Callable[[float], int] = math.ceil
) -> ApiError:
    """The store's unavailability as a 503 with Retry-After (``e.retry_after`` seconds, by ``rounding``,
    at least 1). What failed (an address, a path, the driver's words) stays in the log: the client is told
    which store, not where it is."""
    log.warning("%s store unavailable: %s", store, e)
    return ApiError(
        503,
        f"The {store} store is unavailable; retry later.",
        type="service_unavailable",
        code="storage_unavailable",
        headers={"Retry-After": str(max(1, rounding(e.retry_after)))},
    )


def owner_unavailable(e: OwnerGone) -> ApiError:
    """A record whose owner node is gone from the mesh (an embedded backend): 404 ``owner_unavailable``."""
    return ApiError(404, str(e), code="owner_unavailable")


def history_errors(store: str, rounding: Callable[[float], int] = math.ceil) -> Callable[[Handler], Handler]:
    """A decorator: the store's errors a handler raises as API errors (an owner node gone or an unknown
    record 404, a conflict 400, unavailability ``history_unavailable``'s 503)."""

    def decorate(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except OwnerGone as e:
                raise owner_unavailable(e) from None
            except NotFound as e:
                raise ApiError(404, str(e), code="not_found") from None
            except IntegrityError as e:
                raise bad(str(e), code="conflict") from None
            except StorageUnavailable as e:
                raise history_unavailable(e, store, rounding) from None

        return wrapped

    return decorate


def item_list(items: Sequence[StoredItem], has_more: bool) -> dict[str, Any]:
    """A page of items as the API lists them (``{object: "list", data, first_id, last_id, has_more}``)."""
    return {
        "object": "list",
        "data": [it.data for it in items],
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
        "has_more": has_more,
    }


def owner_of(request: web.Request) -> str | None:
    """The owner recorded on what this caller creates: its principal's ``owner`` (the subject under its
    source, tenant and issuer; None: auth is off)."""
    p = request.get(PRINCIPAL_KEY)
    return p.owner if isinstance(p, Principal) and p.method != "none" else None


def model_for(request: web.Request, gw: Gateway, name: str) -> str:
    """``gw.resolve_model(name)`` under the caller's model allow-list (``model_allowed``; an unknown
    model's 404 names only the models the caller may use)."""
    try:
        model = gw.resolve_model(name)
    except ApiError as e:
        if e.code != "model_not_found":
            raise
        raise model_not_found(name, usable_models(request, gw)) from None
    model_allowed(request, model, name)
    return model


def usable_models(request: web.Request, gw: Gateway) -> list[str]:
    """The node's model names the caller may use (``may_use``)."""
    return [m for m in gw.model_names() if may_use(request, m)]


def model_allowed(request: web.Request, model: str, name: str = "") -> None:
    """A 403 ``model_not_allowed`` when the caller (an API key with ``models``) may not use ``model`` (or
    the name it was asked by): checked on the model a route resolved, however the request named it (its
    body, a query parameter, or not at all on a one-model node)."""
    if not may_use(request, model, name):
        raise ApiError(
            403,
            f"This API key may not use model {model[:100]!r}.",
            type="permission_error",
            param="model",
            code="model_not_allowed",
        )


def may_use(request: web.Request, model: str, name: str = "") -> bool:
    """Whether the caller's model list (an API key's ``models``; none: every model) holds ``model`` or the
    name it was asked by."""
    p = request.get(PRINCIPAL_KEY)
    allowed = p.models if isinstance(p, Principal) else None
    return allowed is None or model in allowed or name in allowed


def may_read(request: web.Request, owner: str | None) -> bool:
    """Whether the caller sees a record owned by ``owner`` (its owner, an admin, or auth off)."""
    p = request.get(PRINCIPAL_KEY)
    if owner is None or not isinstance(p, Principal) or p.role == "admin":
        return True
    return p.owner == owner


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


# what in an engine's error text names a machine: URLs, gRPC's "ipv4:1.2.3.4:5" targets, addresses and
# host:port pairs
_ADDRESS = re.compile(
    r"[a-z][a-z0-9+.-]*://[^\s'\"<>,;)]+"
    r"|\b(?:ipv4|ipv6|unix|dns):[^\s'\"<>,;)]+"
    r"|\[[0-9a-f:.]+\](?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
    r"|\b[a-z](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*:\d{1,5}\b",
    re.IGNORECASE,
)


def public_engine_message(message: str, worker_urls: Iterable[str] = ()) -> str:
    """An engine error's text as a client may see it: no worker URL, address or host:port (they say how
    the fleet is laid out, and which internal hosts the node reaches). Bounded in length, before any
    scrubbing (an engine's 60 KB message made the address pattern's scan take seconds)."""
    message = message[:4000]
    for url in worker_urls:
        if url and url in message:
            message = message.replace(url, "<worker>")
            host = url.partition("://")[2].rstrip("/")
            if host:
                message = message.replace(host, "<worker>")
    return _ADDRESS.sub("<worker>", message)[:1000]


def _error_answer(request: web.Request, err: ApiError) -> web.Response:
    """``err`` in the envelope of the request's API: Anthropic's on the Messages routes and for a caller
    that sends ``anthropic-version`` (the ``anthropic`` SDK, on a route this node does not serve: its
    Files API, say), OpenAI's else."""
    if is_messages_path(request.path) or "anthropic-version" in request.headers:
        return anthropic_error_response(err)
    return error_response(err)


def _to_anthropic(resp: web.Response) -> None:
    """An error answer in the OpenAI envelope, rewritten in place in Anthropic's (status and body)."""
    if resp.prepared or not isinstance(resp.body, bytes):
        return
    got = convert_body(resp.status, resp.body)
    if got is not None:
        resp.set_status(got[0])
        resp.body = got[1]


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    t0 = time.perf_counter()
    route = request.match_info.route
    path = _ROUTE_LABELS.get(route)
    if path is None:
        path = _route_label(route)
    counted = path in INFERENCE_ROUTES  # probes, metrics and admin calls are not "in flight"
    if counted:
        gw.in_flight += 1
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        if status >= 400 and isinstance(resp, web.Response) and is_messages_path(request.path):
            _to_anthropic(resp)  # an error answer made inside (auth, admission): Anthropic's envelope
        if not resp.prepared:
            _stamp(request, resp, t0)
        return resp
    except ApiError as e:
        status = e.status
        gw.metrics.errors.labels(path, e.code or e.type).inc()
        return _stamp(request, _error_answer(request, e), t0)
    except EngineError as e:
        status = _ENGINE_STATUS.get(e.code, 502)
        gw.metrics.errors.labels(path, e.code).inc()
        kind = "invalid_request_error" if status == 400 else "server_error"
        message = public_engine_message(str(e), (w.url for w in gw.registry.workers.values()))
        if status != 400:
            log.warning("engine failure on %s: %s", path, e)  # the whole detail stays in the log
        retry = {"Retry-After": "1"} if status == 503 else None
        err = ApiError(status, message, type=kind, code=e.code, headers=retry)
        return _stamp(request, _error_answer(request, err), t0)
    except (TokenizerWorkerError, TokenizerPoolUnavailable) as e:
        status = 503
        gw.metrics.errors.labels(path, "tokenizer").inc()
        log.warning("tokenizer pool failure on %s: %s", request.path, e)
        msg = "The tokenizer pool failed this request; retry."
        err = ApiError(503, msg, type="service_unavailable", code="tokenizer", headers={"Retry-After": "1"})
        return _stamp(request, _error_answer(request, err), t0)
    except TimeoutError:
        status = 504
        gw.metrics.errors.labels(path, "timeout").inc()
        err = ApiError(504, "The request timed out.", type="server_error", code="timeout")
        return _stamp(request, _error_answer(request, err), t0)
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
        typ = _STATUS_TYPES.get(e.status, "invalid_request_error")
        err = ApiError(e.status, msg, type=typ, headers=headers)
        return _stamp(request, _error_answer(request, err), t0)
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        gw.metrics.errors.labels(path, "internal").inc()
        err = ApiError(500, "Internal error in the gateway.", type="internal_error", code="internal")
        return _stamp(request, _error_answer(request, err), t0)
    finally:
        if counted:
            gw.in_flight -= 1
        gw.metrics.count_request(path, request.get(MODEL_KEY, ""), status, request.get(STREAM_KEY, False))
        gw.metrics.observe_http(request.method, path, time.perf_counter() - t0)


# the routes whose requests count as in flight (smg_in_flight_requests, /health's in_flight, the drain on
# shutdown): the ones that run engine work
INFERENCE_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/classify",
        "/v1/classify",
        "/generate",
    }
)


def request_id_of(request: web.Request) -> str:
    """The request's id as answers carry it (``x-request-id``): the client's when it is sane, else one
    made here (kept on the request, so every answer of one request says the same)."""
    rid = request.get(_RID_KEY)
    if rid is None:
        rid = request.headers.get("x-request-id")
        if not rid or len(rid) > 128 or not rid.isprintable():
            rid = f"req-{uuid.uuid4().hex}"
        request[_RID_KEY] = rid
    return str(rid)


_RID_KEY: web.RequestKey[str] = web.RequestKey("shepherd.request_id", str)
# the request metrics' labels, set by the handlers: the model (whatever the outcome), and a streamed answer
# (SMG's ``streaming`` label of the request count)
MODEL_KEY: web.RequestKey[str] = web.RequestKey("shepherd.model", str)
STREAM_KEY: web.RequestKey[bool] = web.RequestKey("shepherd.stream", bool)


def stamp_headers(request: web.Request, resp: web.StreamResponse, t0: float) -> None:
    """``x-request-id`` (and on the Messages API's routes Anthropic's ``request-id``) and ``x-smg-gateway-ms``
    on an answer about to be sent, unless it has them (the generation routes set their own: the gateway's
    time without the engine's), and under rate limits the admission's ``x-ratelimit-*`` (the guard adds
    them to an answer not yet sent; a streamed one is sent before it returns)."""
    h = resp.headers
    if "x-request-id" not in h:
        h["x-request-id"] = request_id_of(request)
    messages = is_messages_path(request.path)
    if "request-id" not in h and messages:
        h["request-id"] = h["x-request-id"]  # Anthropic's (the SDK's ``request_id``), on every answer
    if "x-smg-gateway-ms" not in h:
        h["x-smg-gateway-ms"] = f"{(time.perf_counter() - t0) * 1000:.3f}"
    ticket = request.get(TICKET_KEY)
    if ticket is not None:
        h.update(ticket.headers)
        if messages:
            h.update(ticket.anthropic_headers)


def _stamp(request: web.Request, resp: web.StreamResponse, t0: float) -> web.StreamResponse:
    stamp_headers(request, resp, t0)
    return resp


class _Entry:
    __slots__ = ("last", "opening", "payload", "request", "resp")

    def __init__(self, resp: web.StreamResponse, payload: bytes, request: web.Request | None) -> None:
        self.resp = resp
        self.payload = payload
        self.request = request  # set: the ticker sends the headers if they are not out when it first ticks
        # what the ticker writes right after the headers it sent, instead of ``payload`` (the Messages
        # API's message_start: Anthropic's streams open with it, before any ping)
        self.opening: Callable[[], bytes] | None = None
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


class KeepAlive:
    """One ticker for all open SSE streams: a comment line (or the stream's own ``payload``: Anthropic's
    ``ping`` event) on each stream idle for ``interval`` seconds, so proxies and clients don't time out
    during long prefills or queueing."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._streams: dict[int, _Entry] = {}  # id(resp): every register has its unregister in a finally
        self._task: asyncio.Task[None] | None = None
        self._some = asyncio.Event()  # set while a stream is registered: without one, the ticker sleeps

    def register(
        self, resp: web.StreamResponse, payload: bytes = KEEPALIVE, request: web.Request | None = None
    ) -> _Entry:
        """Keep ``resp`` alive while it is idle. With ``request``, ``resp`` may be registered before its
        headers are sent (its engine request still queued or prefilling): an idle interval later the
        ticker sends them, then the keep-alive (errors after that are in-band: the caller checks
        ``resp.prepared``)."""
        e = _Entry(resp, payload, request)
        self._streams[id(resp)] = e
        self._some.set()
        return e

    def unregister(self, resp: web.StreamResponse) -> None:
        self._streams.pop(id(resp), None)

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        tick = max(0.05, min(1.0, self.interval / 2))
        while True:
            if not self._streams:  # an idle node does not tick: the next register wakes it
                self._some.clear()
                await self._some.wait()
            await asyncio.sleep(tick)
            now = time.monotonic()
            for e in list(self._streams.values()):
                if now - e.last >= self.interval:
                    e.touch()
                    with contextlib.suppress(Exception):
                        data = e.payload
                        if e.request is not None:
                            if not e.resp.prepared:
                                await e.resp.prepare(e.request)
                                if e.opening is not None:
                                    data = e.opening()
                            e.request = None
                        await e.resp.write(data)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def admitted(
    request: web.Request,
    model: str,
    prompt_tokens: int,
    sampling: Sampling,
    run: Callable[[], Awaitable[web.StreamResponse]],
    jobs: Sequence[Any] | None = None,
) -> web.StreamResponse:
    """``run()`` under the app's admission (the rate limits), when there is one; ``jobs``: what the
    engine requests used, to settle the reservation with (``Admission.guard``; relayed requests: none,
    the reservation stands)."""
    adm = request.app[ADMISSION]
    if adm is None:
        return await run()
    return await adm.guard(request, model, prompt_tokens, sampling, run, jobs)


def _bad_answer(w_id: str, why: str) -> ApiError:
    """What a client gets for a worker's answer the relay will not pass on (``why`` is logged only)."""
    log.warning("HTTP worker %s: answer not relayed: %s", w_id, why)
    return ApiError(
        502, "The worker's answer could not be relayed.", type="server_error", code="bad_worker_response"
    )


# a worker's answers worth another worker's try, as SMG's HTTP router retries them (``is_retryable_status``)
RELAY_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# the relayed routes whose text is the prompt a worker caches (the others are routed without ids)
PROMPT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# the blank lines that end an SSE event ("\r\n\r\n" ends in "\n\r\n"; "\r\n\n" holds "\n\n")
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r\n")


def event_end(recent: bytes, chunk: bytes) -> int:
    """How much of ``chunk`` ends complete SSE events (0: none ends in it); ``recent``: the last bytes
    (two are enough) of the stream before ``chunk``, where a blank line may have begun. The chunk is
    searched in place (a relayed stream's every chunk passes here): only its first two bytes are joined
    to ``recent``, for a blank line across the two."""
    end = 0
    for sep in _EVENT_ENDS:
        i = chunk.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep))
    if end:
        return end
    tail = recent[-2:]
    head = tail + chunk[:2]
    for sep in _EVENT_ENDS:
        i = head.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep) - len(tail))
    return max(0, end)


async def _relay_stream(resp: web.StreamResponse, upstream: aiohttp.ClientResponse, w_id: str) -> None:
    """A worker's SSE stream to the client, as it arrives, event by event: an event's bytes go out once
    its blank line came, so an error event (the worker's stream failed, or is over
    ``RELAY_STREAM_MAX_BYTES``) is never glued to half an event, which a client could not parse (the
    openai SDK raises a ``JSONDecodeError``, not an ``APIError``). An event held over ``RELAY_MAX_BYTES``
    goes out as it is; a stream's unfinished last bytes go out at its end."""
    left = RELAY_STREAM_MAX_BYTES
    held: list[bytes] = []  # the event under way
    held_n = 0
    recent = b""
    try:
        async for chunk in upstream.content.iter_any():
            left -= len(chunk)
            if left < 0:
                log.warning("HTTP worker %s: stream over %d bytes: cut", w_id, RELAY_STREAM_MAX_BYTES)
                await resp.write(error_event("The worker's stream is too long.", code="engine_error") + DONE)
                return
            end = event_end(recent, chunk)
            recent = chunk[-2:] if len(chunk) >= 2 else (recent + chunk)[-2:]
            if end:
                await resp.write(b"".join((*held, chunk[:end])) if held else chunk[:end])
                held = [chunk[end:]] if end < len(chunk) else []
                held_n = len(chunk) - end
                continue
            held.append(chunk)
            held_n += len(chunk)
            if held_n > RELAY_MAX_BYTES:
                await resp.write(b"".join(held))
                held, held_n = [], 0
    except (aiohttp.ClientError, TimeoutError) as e:
        log.info("HTTP worker %s: stream failed: %s", w_id, e)
        await resp.write(error_event("The worker's stream failed.", code="engine_error") + DONE)
        return
    if held:
        await resp.write(b"".join(held))


async def relay(
    request: web.Request, gw: Gateway, model: str, raw: bytes, body: dict[str, Any], path: str, stream: bool
) -> web.StreamResponse:
    """Pass a request to an OpenAI HTTP worker; SSE flows back as it arrives (``_relay_stream``). Retries
    another worker when the connection fails before any answer, or the answer is one SMG's HTTP router
    retries (``RELAY_RETRY_STATUSES``: 408, 429, 500, 502, 503, 504), while tries are left (else that
    answer is relayed); a worker that does not answer within the request timeout: 504, not retried. With
    ``x-smg-target-worker``: that HTTP worker of the model only (else a 400), no retry elsewhere.

    Only what an OpenAI worker answers goes back: a status other than 2xx/4xx/5xx (redirects are not
    followed), a content type other than JSON or SSE, a ``Content-Encoding`` (the worker is asked for
    ``identity``: the answer is re-framed here) or a body over ``RELAY_MAX_BYTES`` (whole) /
    ``RELAY_STREAM_MAX_BYTES`` (streamed) -> 502 in the OpenAI envelope, without the worker's body. Of
    the worker's headers only its ``Content-Type`` and ``Retry-After`` are passed on. Messages name
    workers by id, never by URL.

    A policy with ``text_affinity`` (cache_aware) routes a chat or completion by its text, as pseudo
    token ids (``policies.text_ids``: no tokenizer here), so a conversation's turns meet its prefix."""
    t0 = time.perf_counter()
    tried: set[str] = set()
    last: EngineError | web.Response | None = None
    target = request.headers.get("x-smg-target-worker")
    text_affinity = path in PROMPT_PATHS and getattr(gw.policy_for(model), "text_affinity", False)
    ids: Sequence[int] = body_ids(body) if text_affinity and target is None else ()
    tries = 1 if target is not None else gw.cfg.max_retries + 1  # a targeted request: that worker only
    for attempt in range(tries):
        if target is not None:
            w = gw.registry.find(target)
            if w is None or w.model != model or not w.is_http:
                raise ApiError(
                    400, f"x-smg-target-worker {target!r} is not an HTTP worker of model {model!r}."
                )
        else:
            w = gw.pick(model, tried, ids, request.headers.get("x-smg-routing-key"), http=True)
        if w is None:
            break
        client = w.client
        assert isinstance(client, HttpRelayClient)
        served = w.info.served_model_name if w.info else ""
        payload = (
            raw if not served or served == body.get("model") else orjson.dumps({**body, "model": served})
        )
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if rid := request.headers.get("x-request-id"):
            headers["x-request-id"] = rid
        w.in_flight += 1
        try:
            t_post = time.perf_counter()
            try:
                upstream = await client.post(path, payload, headers)
            except EngineError as e:
                gw.registry.record_result(w, False)
                if not e.retryable:
                    raise
                tried.add(w.id)
                if not isinstance(last, web.Response):  # (an earlier worker's answer is the better one)
                    last = e
                continue
            except BaseException:  # the client went away: nothing learnt of the worker (a half-open
                if target is None:  # circuit's trial, taken by the pick, must not stay taken)
                    w.breaker.release()
                raise
            try:
                status = upstream.status
                uh = upstream.headers
                ctype = uh.get("Content-Type", "")
                mime = ctype.partition(";")[0].strip().lower()
                if (
                    mime not in RELAY_CONTENT_TYPES
                    or uh.get("Content-Encoding", "identity").lower() != "identity"
                    or not 200 <= status < 600
                    or 300 <= status < 400
                ):
                    gw.registry.record_result(w, False)
                    enc = uh.get("Content-Encoding")
                    raise _bad_answer(w.id, f"status {status}, content type {ctype[:64]!r}, encoding {enc!r}")
                gw.registry.record_result(w, status < 500)
                if stream and status == 200 and mime == "text/event-stream":  # else read whole, capped
                    resp = stream_response(
                        request, status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
                    )
                    stamp_headers(request, resp, t0)  # the time until the worker's answer began
                    await resp.prepare(request)
                    await _relay_stream(resp, upstream, w.id)
                    return resp
                try:
                    data = await read_capped(upstream, RELAY_MAX_BYTES)
                except BodyTooLarge as e:
                    raise _bad_answer(w.id, f"body {e}") from None
                own = t_post - t0  # the gateway's own time: not the worker's
                out = web.Response(status=status, body=data, headers={"Content-Type": ctype})
                out.headers["x-smg-gateway-ms"] = f"{own * 1000:.3f}"
                if retry_after := uh.get("Retry-After"):
                    out.headers["Retry-After"] = retry_after[:64]
                if status in RELAY_RETRY_STATUSES and attempt + 1 < tries:
                    log.info("HTTP worker %s answered %d: trying another worker", w.id, status)
                    tried.add(w.id)
                    last = out
                    continue
                return out
            finally:
                upstream.release()
        finally:
            w.in_flight -= 1
    if isinstance(last, web.Response):  # no other worker: the last worker's answer
        return last
    if last is not None:
        raise last
    raise no_healthy_worker(f"No healthy worker is available for model '{model}'.")
