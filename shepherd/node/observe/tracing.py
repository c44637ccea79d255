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

With the SDK's own samplers and id generator and no attribute length limit (the defaults) the spans are
recorded lean (``_Span``: plain values, the node's own context variable; the same sampling decisions and
ids, the same batch processor and exporters), else they are the SDK's.

With tracing off the request path pays a module attribute test (``tracing.ENABLED``) or a call that
returns the shared ``NOOP`` stage: no span, context or dict is made.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, cast
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
    "/generate": "text_completion",  # SGLang's: a raw prompt (text or ids), no messages
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
        """Counts what each export delivered or lost (the exporter already retried with back-off). The
        lean spans (``_Span``) go as they are to an exporter that takes them (``takes_lean``: the node's
        own gRPC encoder), else as the SDK's ``ReadableSpan``s, made here (the exporter thread)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.takes_lean = bool(getattr(inner, "takes_lean", False))

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            if not self.takes_lean:
                spans = [sp.readable() if type(sp) is _Span else sp for sp in spans]
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
    _lean_setup(provider, _tracer, processor)
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


# ---- the request path's spans, recorded lean ----------------------------------------------------------
#
# While ``_LEAN`` (set by ``_lean_setup``: the SDK's own samplers and id generator, no attribute value
# length limit, the node's one batch processor) the request path's spans are ``_Span`` records: the SDK's
# sampler decision made from its configuration (``_decider``), the ids drawn as its RandomIdGenerator draws
# them, the attributes a plain dict, the events tuples; an ended span goes onto the SDK batch processor's
# bounded queue (``BatchProcessor.emit``) as it is. The exporter thread encodes it (``otlp_wire``, gRPC)
# or makes the SDK's ``ReadableSpan`` of it (``readable``: the HTTP/protobuf exporter, or any other).

_LEAN = False
_DECIDE: Callable[[Any, int], bool] = lambda parent, trace_id: False  # noqa: E731
_EMIT: Callable[[Any], None] = lambda span: None  # noqa: E731
_QUEUE: Any = ()  # the batch processor's queue (its length: a span that finds it full is dropped)
_QUEUE_MAX = 0
# an ended span appended to ``_QUEUE`` directly (the worker woken at a batch's size, as ``emit`` does) while
# the processor is running in this process: off at ``shutdown`` and in a forked child (``emit`` re-inits)
_DIRECT = False
_BATCH = 512
_AWAKE: Any = None
_MAX_EVENTS = 128
_getrandbits = random.getrandbits
_time_ns = time.time_ns
_new = object.__new__
# the root sampler's decision as a bound on the trace id's low 64 bits (sampled: below it; the SDK's own
# samplers, ``_root_bound``), so a request without trace headers is decided before any id or span is made;
# -1: no such bound (the request's span is started by ``_lean_start``)
_ROOT_BOUND = -1
# the sampler samples every child of a recording lean span (``_child_sampled``): no decision to make
_CHILD_SAMPLED = False
_CLIENT = SpanKind.CLIENT.value
_SERVER = SpanKind.SERVER.value


class _Span(Span):
    """One span of the node, recorded as plain values (see above). Implements the API's ``Span`` (the
    propagators read it from the context ``_context`` makes); a span the sampler left out is one with
    ``recording`` False (its context still goes to engines, sampled flag off)."""

    __slots__ = (
        "_ctx",
        "attrs",
        "desc",
        "dropped_events",
        "end_time",
        "events",
        "flags",
        "kind",
        "name",
        "parent",
        "recording",
        "remote",
        "span_id",
        "start_time",
        "state",
        "status",
        "trace_id",
    )

    lean = True  # otlp_wire: encoded from these fields
    resource: Any = None  # the provider's resource and the tracer's scope (``_lean_setup``)
    instrumentation_scope: Any = None

    def __init__(
        self,
        name: str,
        kind: int,
        trace_id: int,
        parent: int,
        remote: bool,
        state: Any,
        recording: bool,
        attrs: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = _getrandbits(64) or 1
        self.parent = parent  # the parent's span id (0: a root span)
        self.remote = remote  # the parent came from another process
        self.state = state  # the trace state (the parent's; None: none)
        self.flags = 1 if recording else 0
        self.recording = recording
        self.attrs: dict[str, Any] = attrs if attrs is not None else {}  # ``attrs``: made for it, its own
        self.events: list[tuple[str, int, Mapping[str, Any]]] = []
        self.dropped_events = 0
        self.status = 0  # StatusCode value: 0 unset, 1 ok, 2 error
        self.desc = ""
        self.start_time = _time_ns()
        self.end_time = 0
        self._ctx: Any = None

    # the API's Span
    def get_span_context(self) -> Any:
        ctx = self._ctx
        if ctx is None:
            from opentelemetry.trace import SpanContext, TraceFlags  # not at the top: rarely needed

            ctx = self._ctx = SpanContext(
                self.trace_id, self.span_id, False, TraceFlags(self.flags), self.state
            )
        return ctx

    def is_recording(self) -> bool:
        return self.recording and not self.end_time

    def set_attribute(self, key: str, value: Any) -> None:
        if self.recording:
            self.attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            self.attrs.update(attributes)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        if not self.recording:
            return
        if len(self.events) >= _MAX_EVENTS:
            self.dropped_events += 1
            return
        self.events.append((name, timestamp or time.time_ns(), attributes or _NO_EVENT_ATTRS))

    def update_name(self, name: str) -> None:
        self.name = name

    def set_status(self, status: Any, description: str | None = None) -> None:
        if isinstance(status, Status):
            code, desc = status.status_code, status.description
        else:
            code, desc = status, description
        if self.recording and (self.status != 1 or code.value == 1):  # OK is final (the SDK's rule)
            self.status = code.value
            self.desc = (desc or "") if code.value == 2 else ""

    def record_exception(
        self,
        exception: BaseException,
        attributes: Any = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        attrs = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.escaped": str(escaped),
        }
        self.add_event("exception", {**attrs, **dict(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time:
            return
        self.end_time = end_time or _time_ns()
        if not self.recording:
            return
        STATS.ended += 1
        q = _QUEUE
        if len(q) >= _QUEUE_MAX:
            STATS.dropped += 1  # the batch processor drops its oldest: one span lost either way
            _EMIT(self)
        elif _DIRECT:  # ``BatchProcessor.emit``'s own steps, minus its shutdown / fork checks (``_DIRECT``)
            q.appendleft(self)
            if len(q) >= _BATCH and not _AWAKE.is_set():
                _AWAKE.set()
        else:
            _EMIT(self)

    # the exporter thread's
    def readable(self) -> Any:
        """The SDK's ``ReadableSpan`` of this span (for exporters that take only those)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan  # not at the top: off the request path
        from opentelemetry.trace import SpanContext, TraceFlags  # not at the top: off the request path

        parent = (
            SpanContext(self.trace_id, self.parent, self.remote, TraceFlags(1), self.state)
            if self.parent
            else None
        )
        return ReadableSpan(
            self.name,
            self.get_span_context(),
            parent,
            self.resource,
            dict(self.attrs),
            tuple(Event(n, a, t) for n, t, a in self.events),
            (),
            SpanKind(self.kind),
            status=Status(StatusCode(self.status), self.desc or None),
            start_time=self.start_time,
            end_time=self.end_time,
            instrumentation_scope=self.instrumentation_scope,
        )


def _lean_start(name: str, parent: otel_context.Context | None, kind: int) -> _Span:
    """A span as the SDK's tracer would start it (the sampler's decision, the ids), recorded lean.
    ``kind``: the ``SpanKind``'s value (an enum's ``.value`` is a Python descriptor call)."""
    if parent is None:
        cur = _CURRENT.get()
        if cur is None:  # no current span (a request without trace headers): a root span
            tid = _getrandbits(128) or 1
            return _Span(name, kind, tid, 0, False, None, _DECIDE(None, tid))
        p: Span = cur[0]
    else:
        p = trace.get_current_span(parent)
    if type(p) is _Span:
        if p.recording or p.parent or p.remote:  # a local parent
            return _Span(name, kind, p.trace_id, p.span_id, False, p.state, _DECIDE(p, p.trace_id))
        sc = p.get_span_context()
    else:
        sc = p.get_span_context()
    if sc.is_valid:
        return _Span(
            name, kind, sc.trace_id, sc.span_id, sc.is_remote, sc.trace_state, _DECIDE(sc, sc.trace_id)
        )
    tid = _getrandbits(128) or 1
    return _Span(name, kind, tid, 0, False, None, _DECIDE(None, tid))


def _decider(s: Any) -> Callable[[Any, int], bool] | None:
    """The decision of the SDK sampler ``s`` (one of its own: static, trace id ratio, parent based on
    those) as a function of the parent (None, a ``SpanContext`` or a ``_Span``) and the trace id, made as
    its ``should_sample`` makes it; None for any other sampler."""
    from opentelemetry.sdk.trace import sampling  # optional: only when on

    if isinstance(s, sampling.ParentBased):
        root = _decider(getattr(s, "_root", None))
        subs = [
            _decider(getattr(s, k, None))
            for k in (
                "_remote_parent_sampled",
                "_remote_parent_not_sampled",
                "_local_parent_sampled",
                "_local_parent_not_sampled",
            )
        ]
        if root is None or None in subs:
            return None
        rs, rn, ls, ln = cast(list[Callable[[Any, int], bool]], subs)

        def parent_based(parent: Any, trace_id: int) -> bool:
            if parent is None:
                return root(None, trace_id)
            if type(parent) is _Span:
                return (ls if parent.recording else ln)(parent, trace_id)
            sampled = parent.trace_flags.sampled
            if parent.is_remote:
                return (rs if sampled else rn)(parent, trace_id)
            return (ls if sampled else ln)(parent, trace_id)

        return parent_based
    if type(s) is sampling.StaticSampler:
        on = getattr(s, "_decision", None) is sampling.Decision.RECORD_AND_SAMPLE
        return (lambda parent, trace_id: True) if on else (lambda parent, trace_id: False)
    if type(s) is sampling.TraceIdRatioBased:
        bound = int(s.bound)
        limit = s.TRACE_ID_LIMIT
        return lambda parent, trace_id: trace_id & limit < bound
    return None


def _root_bound(s: Any) -> int:
    """The decision of the SDK sampler ``s`` for a root span (no parent) as a bound: sampled when the
    trace id's low 64 bits are below it (as ``TraceIdRatioBased`` decides; always on: 2**64, always
    off: 0); -1 for a sampler that does not decide so."""
    from opentelemetry.sdk.trace import sampling  # optional: only when on

    if isinstance(s, sampling.ParentBased):
        s = getattr(s, "_root", None)
    if type(s) is sampling.StaticSampler:
        on = getattr(s, "_decision", None) is sampling.Decision.RECORD_AND_SAMPLE
        return 1 << 64 if on else 0
    if type(s) is sampling.TraceIdRatioBased and s.TRACE_ID_LIMIT == (1 << 64) - 1:
        return int(s.bound)
    return -1


def _child_sampled(s: Any) -> bool:
    """Whether the SDK sampler ``s`` samples every child of a recording lean span: always on; a trace id
    ratio (the parent recording, its trace id was below the bound, the same bound: every lean span is
    decided by ``_DECIDE``); parent based with an always-on sampler for a sampled local parent."""
    from opentelemetry.sdk.trace import sampling  # optional: only when on

    if isinstance(s, sampling.ParentBased):
        s = getattr(s, "_local_parent_sampled", None)
        return type(s) is sampling.StaticSampler and s._decision is sampling.Decision.RECORD_AND_SAMPLE
    if type(s) is sampling.StaticSampler:
        return getattr(s, "_decision", None) is sampling.Decision.RECORD_AND_SAMPLE
    return type(s) is sampling.TraceIdRatioBased


def _lean_setup(provider: Any, tracer: Any, processor: Any) -> None:
    """Whether the request path's spans may be recorded lean (``_LEAN``, see ``_Span``): the sampler is
    one of the SDK's own, the id generator its random one, no attribute value length limit (``_FAST``),
    the provider's only span processor the node's batch processor, whose queue takes the spans."""
    global _LEAN, _DECIDE, _EMIT, _QUEUE, _QUEUE_MAX, _MAX_EVENTS, _DIRECT, _BATCH, _AWAKE, _ROOT_BOUND
    global _CHILD_SAMPLED
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator  # optional: only when on

    decide = _decider(getattr(provider, "sampler", None))
    bp = getattr(processor, "_batch_processor", None)
    emit = getattr(bp, "emit", None)
    queue = getattr(bp, "_queue", None)
    procs = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    _LEAN = (
        decide is not None
        and _FAST
        and type(getattr(tracer, "id_generator", None)) is RandomIdGenerator
        and callable(emit)
        and queue is not None
        and procs == (processor,)
    )
    if not _LEAN:  # the SDK's spans: no root bound (a set-up before may have left one)
        _ROOT_BOUND, _CHILD_SAMPLED = -1, False
        return
    assert decide is not None and emit is not None
    _DECIDE, _EMIT, _QUEUE = decide, emit, queue
    _ROOT_BOUND = _root_bound(getattr(provider, "sampler", None))
    _CHILD_SAMPLED = _child_sampled(getattr(provider, "sampler", None))
    _QUEUE_MAX = int(getattr(bp, "_max_queue_size", 2048))
    awake = getattr(bp, "_worker_awaken", None)
    batch = getattr(bp, "_max_export_batch_size", None)
    _DIRECT = (
        awake is not None
        and isinstance(batch, int)
        and getattr(bp, "_shutdown", True) is False
        and getattr(bp, "_pid", None) == os.getpid()
    )
    if _DIRECT and isinstance(batch, int):
        _AWAKE, _BATCH = awake, batch
    limits = getattr(tracer, "_span_limits", None)
    if limits is not None and limits.max_events is not None:
        _MAX_EVENTS = limits.max_events
    _Span.resource = provider.resource
    _Span.instrumentation_scope = getattr(tracer, "_instrumentation_scope", None)


# while ``_LEAN``: the current span and the context it continues (the request's incoming context, for its
# baggage; None: none), in the node's own context variable (no OpenTelemetry context made per span)
_CURRENT: contextvars.ContextVar[tuple[Span, otel_context.Context | None] | None] = contextvars.ContextVar(
    "smg_trace_current", default=None
)


def _after_fork() -> None:
    global _DIRECT
    _DIRECT = False  # the child's spans through ``emit``: it re-inits the processor (a new worker thread)


os.register_at_fork(after_in_child=_after_fork)


def _current() -> Span:
    """The current span (``INVALID_SPAN`` without one)."""
    if _LEAN:
        cur = _CURRENT.get()
        return cur[0] if cur is not None else trace.INVALID_SPAN
    return trace.get_current_span()


def _attach(span: Span, base: otel_context.Context | None = None) -> object:
    """``span`` current (until ``_detach`` of the token), continuing ``base`` (else the current one)."""
    if _LEAN:
        if base is None:
            cur = _CURRENT.get()
            base = cur[1] if cur is not None else None
        return _CURRENT.set((span, base))
    return otel_context.attach(trace.set_span_in_context(span, base))


def _detach(token: object) -> None:
    if _LEAN:
        _CURRENT.reset(token)  # type: ignore[arg-type]
    else:
        otel_context.detach(token)  # type: ignore[arg-type]


def _context() -> otel_context.Context:
    """The OpenTelemetry context of the current span (what the propagators read)."""
    if _LEAN:
        cur = _CURRENT.get()
        if cur is not None:
            return trace.set_span_in_context(cur[0], cur[1])
    return otel_context.get_current()


def _start(
    name: str, parent: otel_context.Context | None, kind: SpanKind, attrs: dict[str, Any] | None
) -> Span:
    """A span started by the SDK's tracer (its sampler, ids, processors' ``on_start``), ``attrs`` written
    in one step after it (``_LEAN_START``: the sampler reads none) or given to the sampler; recorded lean
    while ``_LEAN``."""
    if _LEAN:
        got = _lean_start(name, parent, kind.value)
        if attrs and got.recording:
            got.attrs.update(attrs)
        return got
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
    if type(span) is _Span:
        if span.recording:
            span.attrs.update(attrs)
        return
    if _FAST:
        a: Any = getattr(span, "_attributes", None)
        if a is not None and a._immutable is False and len(a._dict) + len(attrs) <= _MAX_ATTRS:
            a._dict.update(attrs)
            return
    span.set_attributes(attrs)


def _event(span: Any, name: str, attrs: Mapping[str, Any], timestamp: int | None = None) -> None:
    """An event on ``span`` with ``attrs`` as they are (``_FAST``; the node does not change them after),
    else through ``add_event``."""
    if type(span) is _Span:
        if span.recording and len(span.events) < _MAX_EVENTS:
            span.events.append((name, timestamp or time.time_ns(), attrs))
        else:
            span.add_event(name, attrs, timestamp)
        return
    if _FAST and len(attrs) <= _MAX_EVENT_ATTRS:
        add = getattr(span, "_add_event", None)
        if add is not None:
            add(_SdkEvent(name, attrs, timestamp))
            return
    span.add_event(name, attrs, timestamp)


async def shutdown(timeout: float = 5.0) -> None:
    """Flush what is queued and stop the exporter thread (bounded: a collector that is down does not
    hold the node's exit longer than ``timeout``)."""
    global ENABLED, _DIRECT
    provider = _provider
    ENABLED = False
    _DIRECT = False  # ended spans through ``emit`` (which ignores them once the processor is shut down)
    await genai_metrics.shutdown_provider(provider, timeout, log, "tracing: spans not flushed")


# ---- the SERVER span -------------------------------------------------------------------------------------


# a route (aiohttp's route object) -> its template and its GenAI operation (None: none; the route
# untraced: the template is None)
_ROUTES: dict[Any, tuple[str | None, str | None]] = {}


def _route_of(request: web.Request) -> tuple[str | None, str | None]:
    """The request's route template (None: an untraced route) and its GenAI operation."""
    route = request.match_info.route
    got = _ROUTES.get(route)
    if got is not None:
        return got
    resource = getattr(route, "resource", None)
    path = str(resource.canonical) if resource is not None else "unmatched"
    got = (None if path in UNTRACED_ROUTES else path, _ROUTE_OPERATIONS.get(path))
    if resource is not None and len(_ROUTES) < 4096:
        _ROUTES[route] = got
    return got


@web.middleware
def server_span(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> Awaitable[web.StreamResponse]:
    """The SERVER span of one HTTP request (installed only when tracing is on), continuing the client's
    ``traceparent`` / ``tracestate``; the route's GenAI operation is noted for the engine spans.

    A request without trace headers that the sampler leaves out (decided from the trace id's low bits
    first, ``_ROOT_BOUND``) gets a non-recording span with its ids and no attributes: as with the SDK,
    its engines get a ``traceparent`` with the sampled flag off (an engine's parent-based sampler then
    drops its side too, instead of starting traces of its own) and its log lines carry the trace id."""
    got = _ROUTES.get(request.match_info.route)  # ``_route_of`` in place
    route, op = got if got is not None else _route_of(request)
    if route is None:
        return handler(request)
    headers = request.headers
    bound = _ROOT_BOUND
    if bound >= 0 and "traceparent" not in headers and "baggage" not in headers and _CURRENT.get() is None:
        low = _getrandbits(64) if bound else 1  # ratio 0 / always off: no draw
        tid = (_getrandbits(64) << 64 | low) or 1
        name = f"{request.method} {route}"
        if low < bound:
            attrs = _server_attrs(request, route)
            return _served(request, handler, op, _Span(name, _SERVER, tid, 0, False, None, True, attrs), None)
        return _served(request, handler, op, _Span(name, _SERVER, tid, 0, False, None, False), None)
    # a request with trace headers (or a sampler without a bound, or spans not recorded lean)
    parent = (
        propagate.extract(headers) if not _LEAN or "traceparent" in headers or "baggage" in headers else None
    )
    name = f"{request.method} {route}"
    span: Span
    if _LEAN:  # the sampler first: a request it leaves out makes no attributes
        lean = span = _lean_start(name, parent, _SERVER)
        if lean.recording:
            lean.attrs.update(_server_attrs(request, route))
    elif _LEAN_START:
        span = _tracer.start_span(name, parent, SpanKind.SERVER)
        if span.is_recording():
            _put(span, _server_attrs(request, route))
    else:
        span = _tracer.start_span(name, parent, SpanKind.SERVER, _server_attrs(request, route))
    base = parent
    if _LEAN and base is None:
        cur = _CURRENT.get()
        base = cur[1] if cur is not None else None
    return _served(request, handler, op, span, base)


async def _served(
    request: web.Request,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    op: str | None,
    span: Span,
    base: otel_context.Context | None,
) -> web.StreamResponse:
    """The request handled with ``span`` current (continuing ``base``: the incoming context, for its
    baggage) and the route's operation ``op`` noted (unless it is already the current one: chat, the
    default); ``span`` ended with the answer's status."""
    op_token = _OPERATION.set(op) if op is not None and op != _OPERATION.get() else None
    lean_token = token = None
    if _LEAN:  # ``_attach`` in place
        lean_token = _CURRENT.set((span, base))
    else:
        token = _attach(span, base)
    try:
        resp = await handler(request)
    except BaseException as e:
        span.set_attribute("error.type", type(e).__qualname__)
        span.set_status(Status(StatusCode.ERROR))
        span.end()
        raise
    finally:
        if lean_token is not None:
            _CURRENT.reset(lean_token)
        else:
            _detach(token)
        if op_token is not None:
            _OPERATION.reset(op_token)
    lean = span if type(span) is _Span else None
    if lean.recording if lean is not None else span.is_recording():
        status = resp.status
        end: dict[str, Any] = lean.attrs if lean is not None else {}  # a lean span's: written in place
        end["http.response.status_code"] = status
        got_rid = resp.headers.get("x-request-id")
        if got_rid:
            end["shepherd.request.id"] = got_rid
        if status >= 500:
            end["error.type"] = str(status)
            span.set_status(Status(StatusCode.ERROR))
        if lean is None:
            _put(span, end)
        span.end()
    return resp


def _server_attrs(request: web.Request, route: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": request.path,
        "url.scheme": "https" if request.secure else "http",
    }
    if request.remote:
        attrs["client.address"] = request.remote
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128:
        attrs["shepherd.request.id"] = rid
    return attrs


def current_trace_id() -> str | None:
    """The trace id (32 hex) of the span in the current context, if one is recording (logs)."""
    span = _current()
    if type(span) is _Span:
        return f"{span.trace_id:032x}"
    ctx = span.get_span_context()
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

    __slots__ = ("cache", "parent", "span", "stats", "token")

    def __init__(
        self,
        name: str,
        attrs: Mapping[str, Any] | None,
        kind: SpanKind,
        stats: Callable[[], Sequence[int]] | None,
        parent: otel_context.Context | None = None,
    ) -> None:
        self.span: Span = _start(name, parent, kind, dict(attrs) if attrs else None)
        self.parent = parent
        self.token: object = None
        self.stats = stats
        self.cache: Sequence[int] | None = None

    def __enter__(self) -> _Stage:
        self.token = _attach(self.span, self.parent)
        if self.stats is not None:
            self.cache = self.stats()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        _detach(self.token)
        span = self.span
        if self.stats is not None and self.cache is not None:
            cache: dict[str, Any] = {}
            _cache_attrs(self.cache, self.stats(), cache)
            _put(span, cache)
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
        self,
        span: Span,
        name: str,
        attrs: Mapping[str, Any] | None,
        stats: Callable[[], Sequence[int]] | None,
    ) -> None:
        self.name = name
        self.span = span
        self.attrs: dict[str, Any] = {**attrs} if attrs else {}
        self.stats = stats
        self.cache: Sequence[int] | None = stats() if stats is not None else None
        self.start = _time_ns()

    def __enter__(self) -> _Event:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        attrs = self.attrs
        attrs["shepherd.duration_ms"] = (_time_ns() - self.start) / 1e6
        stats = self.stats
        before = self.cache
        if stats is not None and before is not None:
            _cache_attrs(before, stats(), attrs)
        if e is not None:
            attrs["error.type"] = getattr(e, "code", None) or type(e).__qualname__
        span = self.span
        if type(span) is _Span and len(span.events) < _MAX_EVENTS:  # ``_event``'s first case, in place
            span.events.append((self.name, self.start, attrs))
        else:
            _event(span, self.name, attrs, self.start)

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
        url = worker.url
        attrs["shepherd.route.worker"] = url if type(url) is str else str(url)
        decision = getattr(policy, "last", None)
        if decision is not None and getattr(decision, "worker", None) is not None:
            attrs["shepherd.route.reason"] = str(decision.reason)
            attrs["shepherd.route.prefix_match_tokens"] = int(decision.matched_tokens)


def _cache_attrs(before: Sequence[int], after: Sequence[int], out: dict[str, Any]) -> None:
    """Tokenizer cache lookups the stage made (the service's counters, before and after, as
    ``TokenizerService.cache_counters`` gives them: render, L0 and L1 hits and misses; other requests
    running meanwhile may add theirs) and whether it was served from cache, written into ``out``. A
    counter that did not move is left out (absent: 0; most stages miss or hit at a level, not both)."""
    # unrolled (no loop per level)
    rh, rm, l0h, l0m = after[0] - before[0], after[1] - before[1], after[2] - before[2], after[3] - before[3]
    l1h, l1m = after[4] - before[4], after[5] - before[5]
    if rh:
        out["shepherd.tokenizer.render_hits"] = rh
    if rm:
        out["shepherd.tokenizer.render_misses"] = rm
    if l0h:
        out["shepherd.tokenizer.l0_hits"] = l0h
    if l0m:
        out["shepherd.tokenizer.l0_misses"] = l0m
    if l1h:
        out["shepherd.tokenizer.l1_hits"] = l1h
    if l1m:
        out["shepherd.tokenizer.l1_misses"] = l1m
    out["shepherd.tokenizer.cache"] = "miss" if rm or l0m or l1m else "hit" if rh or l0h or l1h else "none"


def stage(
    name: str,
    attrs: Mapping[str, Any] | None = None,
    *,
    cache_stats: Callable[[], Sequence[int]] | None = None,
) -> _Noop:
    """A context manager timing one stage of the request as an event on its current span, with the
    stage's duration (``NOOP`` while tracing is off, and in a request the sampler left out).
    ``cache_stats``: the tokenizer service's cache counters, read before and after (cache hit or miss;
    ``TokenizerService.cache_counters``)."""
    if not ENABLED:
        return NOOP
    if _LEAN:  # ``_current`` in place: the request's span, recording unless the sampler left it out
        cur = _CURRENT.get()
        if cur is None:
            return NOOP
        sp = cur[0]
        if type(sp) is not _Span or not sp.recording or sp.end_time:
            return NOOP
        ev = _new(_Event)  # ``_Event.__init__`` in place
        ev.name = name
        ev.span = sp
        ev.attrs = {**attrs} if attrs else {}
        ev.stats = cache_stats
        ev.cache = cache_stats() if cache_stats is not None else None
        ev.start = _time_ns()
        return ev
    span = _current()
    if not span.is_recording():
        return NOOP
    return _Event(span, name, attrs, cache_stats)


def client_stage(name: str, url: str) -> _Noop:
    """A CLIENT span of a call to ``url`` (an HTTP worker), current while it runs (``NOOP`` when off, or
    in a request the sampler left out)."""
    if not ENABLED or not _current().is_recording():
        return NOOP
    host, port = _address(url)
    attrs: dict[str, Any] = {"server.address": host, "http.request.method": "POST"}
    if port is not None:
        attrs["server.port"] = port
    return _Stage(name, attrs, SpanKind.CLIENT, None)


def event(name: str, attrs: Mapping[str, Any] | None = None) -> None:
    """An event on the current span (a retry, a decision), when tracing is on."""
    if ENABLED:
        _current().add_event(name, attributes=attrs)


def record_error(e: BaseException) -> None:
    """An error reported in-band (a stream whose headers were already sent): on the current span."""
    if ENABLED:
        span = _current()
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


# (operation, model, worker url, provider) -> the CLIENT span's name and the attributes every call with
# them has (the GenAI metrics' attributes): copied per call
_CALLS: dict[tuple[str, str, str, str], tuple[str, dict[str, Any]]] = {}
_NO_METRIC_ATTRS: dict[str, Any] = {}  # shared, never written: the GenAI metrics export is off
_perf_counter = time.perf_counter


def _call_base(key: tuple[str, str, str, str]) -> tuple[str, dict[str, Any]]:
    op, model, worker_url, provider = key
    host, port = _address(worker_url)
    common: dict[str, Any] = {
        "gen_ai.operation.name": op,
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        "server.address": host,
    }
    if port is not None:
        common["server.port"] = port
    got = (f"{op} {model}", common)
    if len(_CALLS) < 4096:
        _CALLS[key] = got
    return got


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

    __slots__ = ("base", "ended", "metric_attrs", "span", "t0", "ttfc", "usage")

    def __init__(
        self,
        model: str,
        request_id: str,
        sampling: SamplingParams | None,
        worker_url: str,
        provider: str,
        attempt: int = 0,
        input_tokens: int | None = None,
        pd_role: str | None = None,
    ) -> None:
        op = _OPERATION.get()
        key = (op, model, worker_url, provider)
        base = _CALLS.get(key) or _call_base(key)
        name, common = base
        attrs = common.copy()  # the call's own: the span's attribute map
        attrs["shepherd.engine.request_id"] = request_id
        # the GenAI metrics' attributes (only while they are exported)
        self.metric_attrs: dict[str, Any] = common.copy() if genai_metrics.ENABLED else _NO_METRIC_ATTRS
        if attempt:
            attrs["shepherd.retry.attempt"] = attempt
        if pd_role is not None:  # PD disaggregation: "prefill" or "decode"
            attrs["shepherd.pd.role"] = pd_role
        if input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = input_tokens
        if sampling is not None:  # the request's sampling parameters
            s = sampling
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
        cur = _CURRENT.get() if _LEAN else None
        parent = cur[0] if cur is not None else None
        self.base = cur[1] if cur is not None else None  # the context ``first`` continues (lean)
        if type(parent) is _Span and parent.recording:  # ``_lean_start``'s local parent, in place
            tid = parent.trace_id
            self.span: Span = _Span(
                name, _CLIENT, tid, parent.span_id, False, parent.state,
                _CHILD_SAMPLED or _DECIDE(parent, tid), attrs,
            )  # fmt: skip
        else:
            self.span = _start(name, None, SpanKind.CLIENT, attrs)
        self.t0 = _perf_counter()
        self.ended = False
        self.ttfc: float | None = None
        self.usage: tuple[int, int] | None = None

    async def first(self, reply: Awaitable[T]) -> T:
        """Await the engine's first reply with this span current; a failure ends the span."""
        span = self.span
        lean_token = token = None
        if _LEAN:  # ``_attach`` / ``_detach`` in place
            lean_token = _CURRENT.set((span, self.base))
        else:
            token = _attach(span)
        try:
            got = await reply
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            if lean_token is not None:
                _CURRENT.reset(lean_token)
            else:
                _detach(token)
        # the time to the first chunk as its attribute only (an event at start + ttfc would repeat it)
        ttfc = self.ttfc = _perf_counter() - self.t0
        if type(span) is _Span:  # ``_put`` in place
            if span.recording:
                span.attrs["gen_ai.response.time_to_first_chunk"] = ttfc
        else:
            _put(span, {"gen_ai.response.time_to_first_chunk": ttfc})
        return got

    def fail(self, e: BaseException) -> None:
        if self.ended:
            return
        code = getattr(e, "code", None)
        kind = code if isinstance(code, str) and code else type(e).__qualname__
        self.span.set_attribute("error.type", kind)
        if self.metric_attrs is not _NO_METRIC_ATTRS:
            self.metric_attrs["error.type"] = kind
        self.span.set_status(Status(StatusCode.ERROR, str(e)[:200]))
        self.end()

    def response(
        self, response_id: str, choices: Sequence[_Choice], input_tokens: int, cached_tokens: int
    ) -> None:
        """The answer's attributes, once the stream is consumed."""
        span = self.span
        if len(choices) == 1:  # most requests: no generator, no list
            c = choices[0]
            output_tokens = c.tokens
            reasons: tuple[str, ...] = (c.finish_reason or "",)
        else:
            output_tokens = sum([c.tokens for c in choices])
            reasons = tuple([c.finish_reason or "" for c in choices])
        if genai_metrics.ENABLED:  # read by ``end`` only then
            self.usage = (input_tokens, output_tokens)
        if type(span) is _Span:  # ``_put`` in place
            if span.recording:
                a = span.attrs
                a["gen_ai.response.id"] = response_id
                a["gen_ai.response.finish_reasons"] = reasons
                a["gen_ai.usage.input_tokens"] = input_tokens
                a["gen_ai.usage.output_tokens"] = output_tokens
                a["gen_ai.usage.cache_read.input_tokens"] = cached_tokens
        else:
            _put(
                span,
                {
                    "gen_ai.response.id": response_id,
                    "gen_ai.response.finish_reasons": reasons,
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
    *,
    pd_role: str | None = None,
) -> EngineCall | None:
    """The CLIENT span of an engine call, or None in a request the sampler left out (the engine still
    gets the context the request continues, sampled flag off) unless the GenAI metrics export measures
    it. ``pd_role``: the half of a PD request the call is (``shepherd.pd.role``)."""
    if not genai_metrics.ENABLED:
        if _LEAN:  # ``_current`` and ``is_recording`` in place
            cur = _CURRENT.get()
            if cur is None:
                return None
            sp = cur[0]
            if type(sp) is _Span:
                if not sp.recording or sp.end_time:
                    return None
            elif not sp.is_recording():
                return None
        elif not _current().is_recording():
            return None
    return EngineCall(model, request_id, sampling, worker_url, provider, attempt, None, pd_role)


def input_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """The prompt's messages on the current span, only when the operator opted in
    (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``)."""
    if ENABLED and CAPTURE_CONTENT:
        _current().set_attribute("gen_ai.input.messages", json.dumps(list(messages), default=str))


# ---- propagation ------------------------------------------------------------------------------------------


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current context added to ``headers`` (HTTP, gRPC
    metadata); unchanged while tracing is off."""
    if ENABLED:
        propagate.inject(headers, context=_context())
    return headers


_TRACEPARENT = (b"00-%032x-%016x-00", b"00-%032x-%016x-01")  # by a lean span's flags (0 or 1)
# ``encode`` -> what it writes before a traceparent value (every value is 55 bytes): the header's name and
# the value's length, written once; None: ``encode`` does not write the value as it is (Huffman, say)
_TRACEPARENT_HEADS: dict[Callable[[bytes, bytes], bytes], bytes | None] = {}


def _traceparent_head(encode: Callable[[bytes, bytes], bytes]) -> bytes | None:
    a, b = b"00-%032x-%016x-01" % (1, 2), b"00-%032x-%016x-00" % (3, 4)
    ea, eb = encode(b"traceparent", a), encode(b"traceparent", b)
    head = ea[: -len(a)] if ea.endswith(a) and eb.endswith(b) and ea[: -len(a)] == eb[: -len(b)] else None
    if len(_TRACEPARENT_HEADS) < 64:
        _TRACEPARENT_HEADS[encode] = head
    return head


def grpc_header_block(encode: Callable[[bytes, bytes], bytes]) -> bytes:
    """The current context's ``traceparent`` / ``tracestate`` as HPACK literals (``encode(name, value)``)
    for the lean gRPC client's request headers; b"" while tracing is off or without a context."""
    if not ENABLED:
        return b""
    if _LEAN:
        cur = _CURRENT.get()
        if cur is None:
            return b""
        span, base = cur
        if _W3C and type(span) is _Span and (base is None or not baggage.get_all(base)):  # no baggage
            value = _TRACEPARENT[span.flags] % (span.trace_id, span.span_id)
            head = _TRACEPARENT_HEADS.get(encode, b"")
            if head == b"":  # not seen yet
                head = _traceparent_head(encode)
            out = head + value if head is not None else encode(b"traceparent", value)
            if span.state:
                out += encode(b"tracestate", span.state.to_header().encode("latin-1"))
            return out
    elif _W3C:  # what the W3C propagator writes, without its carrier and setter (no baggage to add)
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
    propagate.inject(carrier, context=_context())
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
        propagate.inject(carrier, context=_context())
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
            if not _current().is_recording():  # background work (retention): no trace
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
