"""OpenTelemetry traces of the node, with the GenAI semantic conventions. Off by default.

On with ``--enable-trace`` / ``--otlp-traces-endpoint`` or the standard ``OTEL_*`` variables (``setup``):
spans go through a ``BatchSpanProcessor`` (a background thread, a bounded queue: a span that finds the
queue full is dropped and counted, a request never waits for the collector) to an OTLP exporter (gRPC
or HTTP/protobuf). Per request: a SERVER span for the route (``server_span``, continuing an incoming
``traceparent``), a CLIENT span per engine call named ``{gen_ai.operation.name} {gen_ai.request.model}``
(``EngineCall``); the gateway's stages on the hot path are events on the SERVER span with their
durations (``stage``: render and tokenize, admission, route, retries: an event costs a fraction of a
span), its storage calls and mesh RPCs child spans (``traced_store``, ``rpc_client``). The context goes
on to engines in gRPC metadata and HTTP headers (``grpc_header_block``, ``inject``) and to other nodes
inside the mesh RPC request (``rpc_client`` / ``rpc_server``).

With tracing off the request path pays a module attribute test (``tracing.ENABLED``) or a call that
returns the shared ``NOOP`` stage: no span, context or dict is made.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from aiohttp import web
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shepherd.node.observe import genai_metrics, otlp_wire
from shepherd.proto.engine_types import SamplingParams

__all__ = [
    "ENABLED",
    "NOOP",
    "STATS",
    "EngineCall",
    "TraceSettings",
    "TraceStats",
    "client_stage",
    "current_trace_id",
    "engine_call",
    "event",
    "grpc_header_block",
    "inject",
    "input_messages",
    "instrument",
    "record_error",
    "rpc_client",
    "rpc_server",
    "server_span",
    "settings_from",
    "setup",
    "shutdown",
    "stage",
    "traced_store",
]

log = logging.getLogger("shepherd.node.tracing")

T = TypeVar("T")

ENABLED = False  # read on the request path: everything below is skipped while it is False
CAPTURE_CONTENT = False  # OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true: prompts and answers
PROTOCOLS = ("grpc", "http/protobuf")

_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None  # the SDK's TracerProvider once set up
# set by ``setup`` (see ``_lean_paths``): the sampler reads no attributes (they are written after the span
# started); spans' attributes and events may be written without the SDK's per-value checks (no value
# length limit; the counts are still bounded); the propagator is W3C's (traceparent written directly)
_LEAN_START = False
_FAST = False
_MAX_ATTRS = 128
_MAX_EVENT_ATTRS = 128
_W3C = False
_SdkEvent: Any = None  # the SDK's Event class, once set up
_NO_EVENT_ATTRS: Mapping[str, Any] = MappingProxyType({})
# the GenAI operation of the request's route (chat, text_completion, embeddings), set by ``server_span``
_OPERATION: contextvars.ContextVar[str] = contextvars.ContextVar("smg_gen_ai_operation", default="chat")

# probes and scrapes: not traced (they would drown the requests in a trace backend)
UNTRACED_ROUTES = frozenset({"/liveness", "/readiness", "/health", "/health_generate", "/metrics"})

_ROUTE_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/embeddings": "embeddings",
}


@dataclass
class TraceStats:
    """Spans ended, exported, dropped (the queue was full) and lost in exports that failed (the collector
    down or slow): the node's ``smg_trace_spans_*`` metrics. Updated by the event loop (ended, dropped)
    and by the exporter thread (exported, export_failed): plain integer additions."""

    ended: int = 0
    dropped: int = 0
    exported: int = 0
    export_failed: int = 0
    queue_size: int = 0


STATS = TraceStats()


# ---- set-up -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSettings:
    endpoint: str | None  # None: the exporter's own (OTEL_EXPORTER_OTLP_*ENDPOINT, else localhost)
    protocol: str  # "grpc" or "http/protobuf"


def settings_from(
    enable: bool, endpoint: str | None, protocol: str | None, env: Mapping[str, str] = os.environ
) -> TraceSettings | None:
    """Whether tracing is on, and where spans go: the flags, else the standard environment
    (``OTEL_TRACES_EXPORTER=otlp`` or an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` turns it on,
    ``OTEL_SDK_DISABLED=true`` keeps it off). None: off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    env_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    explicit = enable or bool(endpoint)
    if not explicit and (exporter == "none" or not (env_endpoint or exporter == "otlp")):
        return None
    proto = (
        protocol
        or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if proto not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol {proto!r}: use one of {', '.join(PROTOCOLS)}")
    return TraceSettings(endpoint or None, proto)


def _exporter(s: TraceSettings) -> Any:
    endpoint = s.endpoint
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint  # "host:port" as SMG takes it: cleartext
    if s.protocol == "grpc":  # the stock gRPC exporter with the node's own encoder (otlp_wire)
        return otlp_wire.lean_grpc_exporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # optional: only when on
        OTLPSpanExporter as HttpExporter,
    )

    if endpoint is not None and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


def instrument() -> None:
    """Turn the request path's instrumentation on without a tracer (the GenAI metrics export alone):
    engine calls are measured, spans are the API's non-recording ones."""
    global ENABLED
    ENABLED = True


def setup(settings: TraceSettings | None, node_name: str | None = None) -> bool:
    """Install the tracer provider (sampler from ``OTEL_TRACES_SAMPLER`` / ``_ARG``, resource from
    ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, default service name ``smg-node``) and turn
    tracing on. False (and nothing installed) when ``settings`` is None."""
    global ENABLED, CAPTURE_CONTENT, _tracer, _provider
    if settings is None:
        return False
    # optional: the SDK is imported only when tracing is on
    from opentelemetry.sdk.resources import Resource  # optional: only when on
    from opentelemetry.sdk.trace import TracerProvider  # optional: only when on
    from opentelemetry.sdk.trace.export import (  # optional: only when on
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class CountingExporter(SpanExporter):
        """Counts what each export delivered or lost (the exporter already retried with back-off)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            try:
                got: SpanExportResult = self.inner.export(spans)
            except Exception:
                got = SpanExportResult.FAILURE
            if got == SpanExportResult.SUCCESS:
                STATS.exported += len(spans)
            else:
                STATS.export_failed += len(spans)
            return got

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    class CountingBatch(BatchSpanProcessor):
        """The SDK's batch processor (queue size, batch size and delay from ``OTEL_BSP_*``); a span that
        finds its queue full is counted as dropped (the SDK drops it)."""

        def on_end(self, span: Any) -> None:
            STATS.ended += 1
            bp = getattr(self, "_batch_processor", None)
            queue = getattr(bp, "_queue", None)
            if queue is not None and len(queue) >= getattr(bp, "_max_queue_size", 1 << 62):
                STATS.dropped += 1
            super().on_end(span)

    attrs: dict[str, Any] = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attrs["service.name"] = "smg-node"
    if node_name:
        attrs["service.instance.id"] = node_name
    provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
    processor = CountingBatch(CountingExporter(_exporter(settings)))
    provider.add_span_processor(processor)
    bp = getattr(processor, "_batch_processor", None)
    queue = getattr(bp, "_queue", None)
    if queue is not None:
        STATS.queue_size = int(getattr(bp, "_max_queue_size", 0))
    # the SDK warns once per dropped span; the drops are counted (smg_trace_spans_dropped_total) instead
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("shepherd.node")
    _lean_paths(provider, _tracer)
    CAPTURE_CONTENT = (
        os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() == "true"
    )
    ENABLED = True
    log.info(
        "tracing on: OTLP %s to %s (sampler %s)",
        settings.protocol,
        settings.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint (default localhost)",
        os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
    )
    return True


def _lean_paths(provider: Any, tracer: Any) -> None:
    """Which of the request path's short cuts hold for this provider (each falls back to the SDK's
    public calls otherwise):

    - ``_LEAN_START``: the sampler is one of the SDK's own (always on/off, trace id ratio, parent based
      on those), which read no span attributes: a span starts without them and gets them in one step.
    - ``_FAST``: no attribute value length limit (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` /
      ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`` unset) and the SDK's span keeps its attributes as
      this version does: the node's attributes (strings, numbers, booleans, lists of strings, by
      construction) go into the span's attribute map without the SDK's per-value type checks, and its
      events are made with their attribute map as it is; the count limits still apply (over them:
      the SDK's calls, which drop and count).
    - ``_W3C``: the global propagator writes W3C trace context (and baggage) only: the engine call's
      ``traceparent`` is formatted directly (``grpc_header_block``) unless the context has baggage."""
    global _LEAN_START, _FAST, _MAX_ATTRS, _MAX_EVENT_ATTRS, _W3C, _SdkEvent
    from opentelemetry.attributes import BoundedAttributes  # optional: only when on
    from opentelemetry.sdk.trace import Event, sampling  # optional: only when on
    from opentelemetry.sdk.trace import Span as SdkSpan  # optional: only when on

    _SdkEvent = Event

    def builtin(s: Any) -> bool:
        if isinstance(s, sampling.ParentBased):
            subs: tuple[str, ...] = ("_root", "_remote_parent_sampled", "_remote_parent_not_sampled")
            subs += ("_local_parent_sampled", "_local_parent_not_sampled")
            return all(builtin(getattr(s, k, None)) for k in subs)
        return type(s) in (sampling.StaticSampler, sampling.TraceIdRatioBased)

    _LEAN_START = builtin(getattr(provider, "sampler", None))
    limits = getattr(tracer, "_span_limits", None)
    probe = BoundedAttributes(1, None, immutable=False)
    _FAST = (
        limits is not None
        and limits.max_attribute_length is None
        and limits.max_span_attribute_length is None
        and isinstance(getattr(probe, "_dict", None), dict)
        and getattr(probe, "_immutable", None) is False
        and callable(getattr(SdkSpan, "_add_event", None))
    )
    if limits is not None:
        _MAX_ATTRS = limits.max_span_attributes if limits.max_span_attributes is not None else 1 << 30
        _MAX_EVENT_ATTRS = limits.max_event_attributes if limits.max_event_attributes is not None else 1 << 30
    fields = set(propagate.get_global_textmap().fields)
    _W3C = "traceparent" in fields and fields <= {"traceparent", "tracestate", "baggage"}


def _start(
    name: str, parent: otel_context.Context | None, kind: SpanKind, attrs: dict[str, Any] | None
) -> Span:
    """A span started by the SDK's tracer (its sampler, ids, processors' ``on_start``), ``attrs`` written
    in one step after it (``_LEAN_START``: the sampler reads none) or given to the sampler."""
    if not _LEAN_START:
        return _tracer.start_span(name, parent, kind, attrs)
    span = _tracer.start_span(name, parent, kind)
    if attrs:
        _put(span, attrs)
    return span


def _put(span: Span, attrs: dict[str, Any]) -> None:
    """``attrs`` (made here: the values are strings, numbers, booleans or lists of strings) on ``span`` in
    one step: straight into the SDK span's attribute map while ``_FAST`` and under the count limit,
    else ``set_attributes`` (a non-recording span ignores them)."""
    if _FAST:
        a: Any = getattr(span, "_attributes", None)
        if a is not None and a._immutable is False and len(a._dict) + len(attrs) <= _MAX_ATTRS:
            a._dict.update(attrs)
            return
    span.set_attributes(attrs)


def _event(span: Any, name: str, attrs: Mapping[str, Any], timestamp: int | None = None) -> None:
    """An event on ``span`` with ``attrs`` as they are (``_FAST``; the node does not change them after),
    else through ``add_event``."""
    if _FAST and len(attrs) <= _MAX_EVENT_ATTRS:
        add = getattr(span, "_add_event", None)
        if add is not None:
            add(_SdkEvent(name, attrs, timestamp))
            return
    span.add_event(name, attrs, timestamp)


async def shutdown(timeout: float = 5.0) -> None:
    """Flush what is queued and stop the exporter thread (bounded: a collector that is down does not
    hold the node's exit longer than ``timeout``)."""
    global ENABLED
    provider = _provider
    ENABLED = False
    await genai_metrics.shutdown_provider(provider, timeout, log, "tracing: spans not flushed")


# ---- the SERVER span -------------------------------------------------------------------------------------


def _route_of(request: web.Request) -> str:
    resource = getattr(request.match_info.route, "resource", None)
    return str(resource.canonical) if resource is not None else "unmatched"


@web.middleware
async def server_span(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The SERVER span of one HTTP request (installed only when tracing is on), continuing the client's
    ``traceparent`` / ``tracestate``; the route's GenAI operation is noted for the engine spans."""
    route = _route_of(request)
    if route in UNTRACED_ROUTES:
        return await handler(request)
    parent = propagate.extract(request.headers)
    op = _ROUTE_OPERATIONS.get(route)
    op_token = _OPERATION.set(op) if op is not None else None
    name = f"{request.method} {route}"
    if _LEAN_START:  # the sampler first: a request it leaves out makes no attributes
        span = _tracer.start_span(name, parent, SpanKind.SERVER)
        if span.is_recording():
            _put(span, _server_attrs(request, route))
    else:
        span = _tracer.start_span(name, parent, SpanKind.SERVER, _server_attrs(request, route))
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        resp = await handler(request)
    except BaseException as e:
        span.set_attribute("error.type", type(e).__qualname__)
        span.set_status(Status(StatusCode.ERROR))
        span.end()
        raise
    finally:
        otel_context.detach(token)
        if op_token is not None:
            _OPERATION.reset(op_token)
    if span.is_recording():
        status = resp.status
        end: dict[str, Any] = {"http.response.status_code": status}
        got_rid = resp.headers.get("x-request-id")
        if got_rid:
            end["shepherd.request.id"] = got_rid
        if status >= 500:
            end["error.type"] = str(status)
            span.set_status(Status(StatusCode.ERROR))
        _put(span, end)
        span.end()
    return resp


def _server_attrs(request: web.Request, route: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": request.path,
        "url.scheme": request.scheme,
    }
    if request.remote:
        attrs["client.address"] = request.remote
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128:
        attrs["shepherd.request.id"] = rid
    return attrs


def current_trace_id() -> str | None:
    """The trace id (32 hex) of the span in the current context, if one is recording (logs)."""
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


# ---- stages -------------------------------------------------------------------------------------------


class _Noop:
    """The stage of a request while tracing is off: every method does nothing."""

    __slots__ = ()

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        return None

    def routed(self, policy: object, worker: Any) -> None:
        return None


NOOP = _Noop()


class _Stage(_Noop):
    """A child span of the request's current span, current itself while the stage runs."""

    __slots__ = ("cache", "span", "stats", "token")

    def __init__(
        self,
        name: str,
        attrs: Mapping[str, Any] | None,
        kind: SpanKind,
        stats: Callable[[], Mapping[str, int]] | None,
        parent: otel_context.Context | None = None,
    ) -> None:
        self.span: Span = _start(name, parent, kind, dict(attrs) if attrs else None)
        self.token: object = None
        self.stats = stats
        self.cache: Mapping[str, int] | None = None

    def __enter__(self) -> _Stage:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        if self.stats is not None:
            self.cache = dict(self.stats())
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        otel_context.detach(self.token)  # type: ignore[arg-type]
        span = self.span
        if self.stats is not None and self.cache is not None:
            _put(span, _cache_attrs(self.cache, self.stats()))
        if e is not None:
            span.set_attribute("error.type", getattr(e, "code", None) or type(e).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(e)[:200]))
        span.end()

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self.span.set_attribute(key, value)


class _Event(_Noop):
    """A stage of the request on the hot path (render and tokenize, admission, route): an event on the
    current span (the SERVER span) at the stage's start, with its duration and outcome as attributes.
    An event costs a fraction of a span (no span processor, no export of its own)."""

    __slots__ = ("attrs", "cache", "name", "span", "start", "stats")

    def __init__(
        self, name: str, attrs: Mapping[str, Any] | None, stats: Callable[[], Mapping[str, int]] | None
    ) -> None:
        self.name = name
        self.span = trace.get_current_span()
        self.attrs: dict[str, Any] = dict(attrs) if attrs else {}
        self.stats = stats
        self.cache: Mapping[str, int] | None = dict(stats()) if stats is not None else None
        self.start = time.time_ns()

    def __enter__(self) -> _Event:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        attrs = self.attrs
        attrs["shepherd.duration_ms"] = (time.time_ns() - self.start) / 1e6
        if self.stats is not None and self.cache is not None:
            attrs.update(_cache_attrs(self.cache, self.stats()))
        if e is not None:
            attrs["error.type"] = getattr(e, "code", None) or type(e).__qualname__
        _event(self.span, self.name, attrs, self.start)

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self.attrs[key] = value

    def routed(self, policy: object, worker: Any) -> None:
        """The route stage's outcome: the policy, the worker it chose (None: none), and the cache-aware
        policy's decision (its reason, the longest cached prefix in tokens)."""
        attrs = self.attrs
        attrs["shepherd.route.policy"] = type(policy).__name__
        if worker is None:
            attrs["shepherd.route.worker"] = ""
            return
        attrs["shepherd.route.worker"] = str(worker.url)
        decision = getattr(policy, "last", None)
        if decision is not None and getattr(decision, "worker", None) is not None:
            attrs["shepherd.route.reason"] = str(decision.reason)
            attrs["shepherd.route.prefix_match_tokens"] = int(decision.matched_tokens)


def _cache_attrs(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, Any]:
    """Tokenizer cache lookups the stage made (the service's counters, before and after: other requests
    running meanwhile may add theirs) and whether it was served from cache."""
    out: dict[str, Any] = {}
    hits = misses = 0
    for key in ("render", "l0", "l1"):
        h = after.get(f"{key}_hits", 0) - before.get(f"{key}_hits", 0)
        m = after.get(f"{key}_misses", 0) - before.get(f"{key}_misses", 0)
        if h or m:
            out[f"shepherd.tokenizer.{key}_hits"] = h
            out[f"shepherd.tokenizer.{key}_misses"] = m
        hits += h
        misses += m
    out["shepherd.tokenizer.cache"] = "hit" if hits and not misses else "miss" if misses else "none"
    return out


def stage(
    name: str,
    attrs: Mapping[str, Any] | None = None,
    *,
    cache_stats: Callable[[], Mapping[str, int]] | None = None,
) -> _Noop:
    """A context manager timing one stage of the request as an event on its current span, with the
    stage's duration (``NOOP`` while tracing is off, and in a request the sampler left out).
    ``cache_stats``: the tokenizer service's counters, read before and after (cache hit or miss)."""
    if not ENABLED or not trace.get_current_span().is_recording():
        return NOOP
    return _Event(name, attrs, cache_stats)


def client_stage(name: str, url: str) -> _Noop:
    """A CLIENT span of a call to ``url`` (an HTTP worker), current while it runs (``NOOP`` when off, or
    in a request the sampler left out)."""
    if not ENABLED or not trace.get_current_span().is_recording():
        return NOOP
    host, port = _address(url)
    attrs: dict[str, Any] = {"server.address": host, "http.request.method": "POST"}
    if port is not None:
        attrs["server.port"] = port
    return _Stage(name, attrs, SpanKind.CLIENT, None)


def event(name: str, attrs: Mapping[str, Any] | None = None) -> None:
    """An event on the current span (a retry, a decision), when tracing is on."""
    if ENABLED:
        trace.get_current_span().add_event(name, attributes=attrs)


def record_error(e: BaseException) -> None:
    """An error reported in-band (a stream whose headers were already sent): on the current span."""
    if ENABLED:
        span = trace.get_current_span()
        span.set_attribute("error.type", getattr(e, "code", None) or type(e).__qualname__)
        span.set_status(Status(StatusCode.ERROR, str(e)[:200]))


# ---- the engine call (CLIENT span) ------------------------------------------------------------------------

_ADDRESSES: dict[str, tuple[str, int | None]] = {}


def _address(url: str) -> tuple[str, int | None]:
    got = _ADDRESSES.get(url)
    if got is None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        got = (parts.hostname or url, port)
        if len(_ADDRESSES) < 4096:
            _ADDRESSES[url] = got
    return got


def _sampling_attrs(s: SamplingParams, attrs: dict[str, Any]) -> None:
    attrs["gen_ai.request.temperature"] = s.temperature
    attrs["gen_ai.request.top_p"] = s.top_p
    if s.top_k > 0:
        attrs["gen_ai.request.top_k"] = s.top_k
    if s.max_new_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = s.max_new_tokens
    if s.seed is not None:
        attrs["gen_ai.request.seed"] = s.seed
    if s.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = s.presence_penalty
    if s.n != 1:
        attrs["gen_ai.request.choice.count"] = s.n


class _Choice(Protocol):
    """What the CLIENT span reads of one answered choice (``output.choice.ChoiceState``)."""

    finish_reason: str | None
    tokens: int

    def full_text(self) -> str: ...


class EngineCall:
    """The CLIENT span of one engine call (each retry is its own): opened before the request is sent,
    current while the first reply is awaited (so the engine client passes its context on), ended when
    the stream closes. GenAI attributes: operation, provider (the engine kind), request model and
    sampling, the worker's ``server.address`` / ``server.port``; then the response id, finish reasons,
    token usage, the time to the first chunk, or ``error.type``."""

    __slots__ = ("ended", "metric_attrs", "span", "t0", "ttfc", "usage")

    def __init__(
        self,
        model: str,
        request_id: str,
        sampling: SamplingParams | None,
        worker_url: str,
        provider: str,
        attempt: int = 0,
        input_tokens: int | None = None,
    ) -> None:
        op = _OPERATION.get()
        host, port = _address(worker_url)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "server.address": host,
            "shepherd.engine.request_id": request_id,
        }
        if port is not None:
            attrs["server.port"] = port
        # the GenAI metrics' attributes (only while they are exported)
        self.metric_attrs: dict[str, Any] = dict(attrs) if genai_metrics.ENABLED else {}
        if self.metric_attrs:
            del self.metric_attrs["shepherd.engine.request_id"]
        if attempt:
            attrs["shepherd.retry.attempt"] = attempt
        if input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = input_tokens
        if sampling is not None:
            _sampling_attrs(sampling, attrs)
        self.span: Span = _start(f"{op} {model}", None, SpanKind.CLIENT, attrs)
        self.t0 = time.perf_counter()
        self.ended = False
        self.ttfc: float | None = None
        self.usage: tuple[int, int] | None = None

    async def first(self, reply: Awaitable[T]) -> T:
        """Await the engine's first reply with this span current; a failure ends the span."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            got = await reply
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            otel_context.detach(token)
        ttfc = self.ttfc = time.perf_counter() - self.t0
        _put(self.span, {"gen_ai.response.time_to_first_chunk": ttfc})
        _event(self.span, "gen_ai.first_chunk", _NO_EVENT_ATTRS)
        return got

    def fail(self, e: BaseException) -> None:
        if self.ended:
            return
        code = getattr(e, "code", None)
        kind = code if isinstance(code, str) and code else type(e).__qualname__
        self.span.set_attribute("error.type", kind)
        self.metric_attrs["error.type"] = kind
        self.span.set_status(Status(StatusCode.ERROR, str(e)[:200]))
        self.end()

    def response(
        self, response_id: str, choices: Sequence[_Choice], input_tokens: int, cached_tokens: int
    ) -> None:
        """The answer's attributes, once the stream is consumed."""
        span = self.span
        output_tokens = sum(c.tokens for c in choices)
        self.usage = (input_tokens, output_tokens)
        _put(  # one step
            span,
            {
                "gen_ai.response.id": response_id,
                "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in choices],
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            },
        )
        if CAPTURE_CONTENT:
            out = [
                {"role": "assistant", "parts": [{"type": "text", "content": c.full_text()}],
                 "finish_reason": c.finish_reason or ""}
                for c in choices
            ]  # fmt: skip
            span.set_attribute("gen_ai.output.messages", json.dumps(out))

    def end(self, abort_reason: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if abort_reason is not None:
            _put(self.span, {"shepherd.engine.abort_reason": abort_reason})
        self.span.end()
        if genai_metrics.ENABLED:
            usage = self.usage
            genai_metrics.record(
                self.metric_attrs,
                time.perf_counter() - self.t0,
                self.ttfc,
                usage[0] if usage is not None else None,
                usage[1] if usage is not None else None,
            )


def engine_call(
    model: str,
    request_id: str,
    sampling: SamplingParams | None,
    worker_url: str,
    provider: str,
    attempt: int = 0,
) -> EngineCall | None:
    """The CLIENT span of an engine call, or None in a request the sampler left out (the engine still
    gets the request's context, sampled flag off) unless the GenAI metrics export measures it."""
    if not genai_metrics.ENABLED and not trace.get_current_span().is_recording():
        return None
    return EngineCall(model, request_id, sampling, worker_url, provider, attempt)


def input_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """The prompt's messages on the current span, only when the operator opted in
    (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``)."""
    if ENABLED and CAPTURE_CONTENT:
        trace.get_current_span().set_attribute(
            "gen_ai.input.messages", json.dumps(list(messages), default=str)
        )


# ---- propagation ------------------------------------------------------------------------------------------


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current context added to ``headers`` (HTTP, gRPC
    metadata); unchanged while tracing is off."""
    if ENABLED:
        propagate.inject(headers)
    return headers


def grpc_header_block(encode: Callable[[bytes, bytes], bytes]) -> bytes:
    """The current context's ``traceparent`` / ``tracestate`` as HPACK literals (``encode(name, value)``)
    for the lean gRPC client's request headers; b"" while tracing is off or without a context."""
    if not ENABLED:
        return b""
    if _W3C:  # what the W3C propagator writes, without its carrier and setter (no baggage to add)
        ctx = otel_context.get_current()
        if not baggage.get_all(ctx):
            sc = trace.get_current_span(ctx).get_span_context()
            if not sc.is_valid:
                return b""
            out = encode(
                b"traceparent", f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}".encode()
            )
            if sc.trace_state:
                out += encode(b"tracestate", sc.trace_state.to_header().encode("latin-1"))
            return out
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return b"".join(encode(k.encode(), v.encode("latin-1")) for k, v in carrier.items())


@contextmanager
def rpc_client(peer: str, method: str) -> Iterator[dict[str, str]]:
    """A CLIENT span around one mesh RPC to ``peer`` (the history store's fetches and writes); yields the
    carrier (``traceparent``...) for the request, empty while tracing is off."""
    if not ENABLED:
        yield {}
        return
    with _Stage(
        f"mesh.rpc {method}",
        {"rpc.system": "shepherd.mesh", "rpc.method": method, "server.address": peer},
        SpanKind.CLIENT,
        None,
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield carrier


def rpc_server(peer: str, method: str, carrier: object) -> _Noop:
    """The SERVER span of one mesh RPC a peer sent, continuing the trace its request carries."""
    if not ENABLED:
        return NOOP
    ctx = (
        propagate.extract({k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)})
        if isinstance(carrier, dict)
        else None
    )
    attrs = {"rpc.system": "shepherd.mesh", "rpc.method": method, "client.address": peer[:64]}
    return _Stage(f"mesh.rpc {method}", attrs, SpanKind.SERVER, None, ctx)


# ---- storage ----------------------------------------------------------------------------------------------


class _TracedStore:
    """A history store whose calls made for a traced request are child spans (``storage {method}``):
    every attribute of the store is passed through, its coroutine methods wrapped."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._system = str(getattr(inner, "name", "history"))

    def __getattr__(self, name: str) -> Any:
        got = getattr(self._inner, name)
        if name.startswith("_") or not asyncio.iscoroutinefunction(got):
            return got
        system = self._system

        async def call(*args: Any, **kwargs: Any) -> Any:
            if not trace.get_current_span().is_recording():  # background work (retention): no trace
                return await got(*args, **kwargs)
            with _Stage(
                f"storage {name}",
                {"db.system.name": system, "db.operation.name": name},
                SpanKind.CLIENT,
                None,
            ):
                return await got(*args, **kwargs)

        return call


def traced_store(store: T) -> T:
    """``store`` with a span per call while tracing is on (else ``store`` itself)."""
    if not ENABLED:
        return store
    return _TracedStore(store)  # type: ignore[return-value]
