"""shepherd.node.observe.otlp_wire writes the same ExportTraceServiceRequest the OpenTelemetry exporter's
own encoder (opentelemetry-exporter-otlp-proto-common ``encode_spans``) builds, for spans of every shape
the node makes: kinds, parents (local and remote), attributes of every type, events, error status,
trace state, several resources and scopes. The node's lean records are written in C when it is built
(``_otlp_spans.request``): its bytes are the Python encoder's, on generated spans of every shape."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from shepherd.node.observe import otlp_wire
from shepherd.node.observe.otlp_wire import encode_request

NEEDS_C = pytest.mark.skipif(otlp_wire._c_request is None, reason="the C extension _otlp_spans is not built")


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _spans() -> list[ReadableSpan]:
    keep = _Keep()
    out: list[ReadableSpan] = []
    for service in ("node-a", "node-b"):
        provider = TracerProvider(resource=Resource.create({"service.name": service, "n": 3}))
        provider.add_span_processor(SimpleSpanProcessor(keep))
        tracer = provider.get_tracer("shepherd.node", "1.0")
        remote = SpanContext(
            0x0AF7651916CD43DD8448EB211C80319C,
            0xB7AD6B7169203331,
            is_remote=True,
            trace_flags=TraceFlags(1),
            trace_state=TraceState([("vendor", "1"), ("x", "y")]),
        )
        parent = trace.set_span_in_context(NonRecordingSpan(remote))
        attrs: dict[str, Any] = {
            "http.route": "/v1/chat/completions",
            "server.port": 30000,
            "neg": -5,
            "big": 1 << 40,
            "ratio": 0.25,
            "ok": True,
            "no": False,
            "reasons": ["stop", "length"],
            "ints": [1, 2, 3],
            "empty": "",
        }
        server = tracer.start_span("POST /v1/chat/completions", parent, SpanKind.SERVER, attrs)
        server.add_event("render_tokenize", {"shepherd.duration_ms": 0.5, "shepherd.tokenizer.cache": "hit"})
        server.add_event("bare")
        inner = trace.set_span_in_context(server)
        client = tracer.start_span("chat qwen3", inner, SpanKind.CLIENT, {"gen_ai.request.model": "qwen3"})
        client.set_status(Status(StatusCode.ERROR, "engine went away"))
        client.end()
        tracer.start_span("storage get", inner).end()
        tracer.start_span("root").end()
        server.end()
        provider.get_tracer("other.scope").start_span("x", kind=SpanKind.PRODUCER).end()
        out.extend(keep.spans)
        keep.spans.clear()
    return out


def test_the_bytes_parse_to_the_stock_encoders_message() -> None:
    spans = _spans()
    mine = ExportTraceServiceRequest.FromString(encode_request(spans))
    assert mine == encode_spans(spans)
    assert len(mine.resource_spans) == 2


def test_repeated_attributes_encode_the_same_from_the_cache() -> None:
    spans = _spans()
    first, second = encode_request(spans), encode_request(spans)
    assert first == second
    assert ExportTraceServiceRequest.FromString(second) == encode_spans(spans)


def test_values_that_keep_changing_are_written_not_cached() -> None:
    """An id (a new string each request) or a duration (a new float) is cached for at most 256 values of
    its key; the bytes stay those of the stock encoder's message, before and after the bound."""
    from shepherd.node.observe import otlp_wire

    provider = TracerProvider(resource=Resource.create({"service.name": "n"}))
    keep = _Keep()
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("shepherd.node")
    for i in range(400):
        with tracer.start_as_current_span("s") as span:
            span.set_attributes({"test.unique.id": f"id-{i}", "test.unique.ms": i + 0.5, "test.same": 1.0})
    spans = keep.spans
    for s in (spans[:10], spans[-10:], spans):
        assert ExportTraceServiceRequest.FromString(encode_request(s)) == encode_spans(s)
    cached = [k for k in otlp_wire._KV_CACHE if k[0] in ("test.unique.id", "test.unique.ms", "test.same")]
    assert sum(k[0] == "test.unique.id" for k in cached) <= otlp_wire._DISTINCT_MAX
    assert sum(k[0] == "test.unique.ms" for k in cached) <= otlp_wire._DISTINCT_MAX
    assert ("test.same", float, 1.0) in otlp_wire._KV_CACHE  # a repeating float is looked up


def test_no_spans_is_an_empty_request() -> None:
    assert encode_request([]) == b""
    assert ExportTraceServiceRequest.FromString(b"") == encode_spans([])


# ---- the node's lean spans (tracing._Span) --------------------------------------------------------------


def _lean_spans() -> list[Any]:
    from shepherd.node.observe.tracing import _Span

    remote_state = TraceState([("vendor", "1")])
    root = _Span("POST /v1/chat/completions", SpanKind.SERVER.value, 0x0AF7651916CD43DD8448EB211C80319C,
                 0xB7AD6B7169203331, True, remote_state, True)  # fmt: skip
    root.attrs.update({"http.route": "/v1/chat/completions", "server.port": 30000, "neg": -5, "ok": True})
    root.attrs.update({"ratio": 0.25, "reasons": ["stop", "length"], "empty": "", "big": 1 << 40})
    root.add_event("render_tokenize", {"shepherd.duration_ms": 0.5, "shepherd.tokenizer.cache": "hit"})
    root.add_event("bare")
    child = _Span("chat qwen3", SpanKind.CLIENT.value, root.trace_id, root.span_id, False, root.state, True)
    child.set_attributes({"gen_ai.request.model": "qwen3", "gen_ai.usage.output_tokens": 32})
    child.set_status(Status(StatusCode.ERROR, "engine went away"))
    fresh = _Span("GET /v1/models", SpanKind.SERVER.value, 0x1234, 0, False, None, True)  # a root span
    fresh.set_status(Status(StatusCode.OK))
    for i, s in enumerate((root, child, fresh)):
        s.end_time = s.start_time + 1000 * (i + 1)  # ended (not through end(): no exporter here)
    return [root, child, fresh]


def test_lean_spans_encode_as_the_stock_encoder_encodes_their_readable_spans() -> None:
    from shepherd.node.observe.tracing import _Span

    saved = (_Span.resource, _Span.instrumentation_scope)
    provider = TracerProvider(resource=Resource.create({"service.name": "node-a"}))
    tracer: Any = provider.get_tracer("shepherd.node", "1.0")
    _Span.resource, _Span.instrumentation_scope = provider.resource, tracer._instrumentation_scope
    try:
        spans = _lean_spans()
        readable = [s.readable() for s in spans]
        mine = ExportTraceServiceRequest.FromString(encode_request(spans))
        assert mine == encode_spans(readable)
        assert ExportTraceServiceRequest.FromString(encode_request(spans)) == mine  # from the caches
        got = mine.resource_spans[0].scope_spans[0].spans
        assert [s.name for s in got] == ["POST /v1/chat/completions", "chat qwen3", "GET /v1/models"]
        assert got[1].parent_span_id == got[0].span_id and got[1].status.message == "engine went away"
        assert [e.name for e in got[0].events] == ["render_tokenize", "bare"]
        # lean spans and the SDK's in one request (grouped by resource and scope as the stock encoder)
        sdk = _spans()
        mixed = ExportTraceServiceRequest.FromString(encode_request([*spans, *sdk]))
        assert mixed == encode_spans([*readable, *sdk])
    finally:
        _Span.resource, _Span.instrumentation_scope = saved


@pytest.mark.parametrize(
    "sampler",
    [
        "parentbased_traceidratio",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        "always_on",
        "always_off",
    ],
)
def test_the_lean_sampling_decision_is_the_sdk_samplers(sampler: str) -> None:
    """``tracing._decider`` decides as the SDK sampler's ``should_sample`` does, for root spans, remote
    parents sampled or not, and local parents."""
    from opentelemetry.sdk.trace import sampling

    from shepherd.node.observe.tracing import _decider, _Span

    known: Any = sampling._KNOWN_SAMPLERS[sampler]
    s: Any = known(0.3) if "ratio" in sampler else known
    decide = _decider(s)
    assert decide is not None
    rng = random.Random(7)
    for _ in range(300):
        tid = rng.getrandbits(128) or 1
        for flags in (0, 1):
            remote = SpanContext(tid, rng.getrandbits(64) or 1, is_remote=True, trace_flags=TraceFlags(flags))
            ctx = trace.set_span_in_context(NonRecordingSpan(remote))
            want = s.should_sample(ctx, tid, "x").decision.is_sampled()
            assert decide(remote, tid) == want
            local = _Span("x", 0, tid, 0, False, None, bool(flags))
            local_ctx = trace.set_span_in_context(
                NonRecordingSpan(SpanContext(tid, local.span_id, False, TraceFlags(flags)))
            )
            assert decide(local, tid) == s.should_sample(local_ctx, tid, "x").decision.is_sampled()
        assert decide(None, tid) == s.should_sample(None, tid, "x").decision.is_sampled()


# ---- the C writer of lean records (``_otlp_spans.request``) -------------------------------------------

_KEYS = st.sampled_from(["gen_ai.request.model", "server.port", "k", "", "clé", "x" * 130])
_SCALARS = st.one_of(
    st.text(max_size=140),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=140),
)
_VALUES = st.one_of(
    _SCALARS, st.lists(_SCALARS, max_size=4), st.tuples(st.text(max_size=8), st.integers(0, 9))
)
_ATTRS = st.dictionaries(_KEYS, _VALUES, max_size=6)


@st.composite
def _lean_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A lean span's fields (the span is made in the test: its ids come from ``random``)."""
    status, desc = draw(st.sampled_from([(0, ""), (1, ""), (2, ""), (2, "engine went away")]))
    return {
        "name": draw(st.sampled_from(["chat qwen3", "", "POST /v1/chat/completions", "é" * 70])),
        "kind": draw(st.integers(0, 4)),
        "trace_id": draw(st.integers(1, (1 << 128) - 1)),
        "parent": draw(st.sampled_from([0, 1, (1 << 64) - 1])),
        "remote": draw(st.booleans()),
        "state": draw(st.booleans()),  # a trace state: written by the Python encoder
        "attrs": draw(_ATTRS),
        "events": [
            (name, draw(st.integers(0, (1 << 64) - 1)), draw(_ATTRS))
            for name in draw(st.lists(st.sampled_from(["render_tokenize", "route", ""]), max_size=3))
        ],
        "dropped_events": draw(st.sampled_from([0, 0, 3])),
        "status": status,
        "desc": desc,
        "duration": draw(st.integers(0, 1 << 40)),
    }


def _made(f: dict[str, Any]) -> Any:
    from shepherd.node.observe.tracing import _Span

    state = TraceState([("vendor", "1")]) if f["state"] else None
    span = _Span(f["name"], f["kind"], f["trace_id"], f["parent"], f["remote"], state, True)
    span.attrs.update(f["attrs"])
    span.events.extend(f["events"])
    span.dropped_events, span.status, span.desc = f["dropped_events"], f["status"], f["desc"]
    span.end_time = span.start_time + f["duration"]
    return span


def _both_writers(spans: list[Any]) -> tuple[bytes, bytes]:
    """The request of ``spans`` from the C writer and from the Python one."""
    saved = otlp_wire._c_request
    try:
        c = otlp_wire.encode_request(spans)
        otlp_wire._c_request = None
        py = otlp_wire.encode_request(spans)
    finally:
        otlp_wire._c_request = saved
    return c, py


@pytest.fixture(scope="module")
def lean_scope() -> Iterator[None]:
    from shepherd.node.observe.tracing import _Span

    saved = (_Span.resource, _Span.instrumentation_scope)
    provider = TracerProvider(resource=Resource.create({"service.name": "node-a", "n": 3}))
    tracer: Any = provider.get_tracer(
        "shepherd.node", "1.0", schema_url="https://opentelemetry.io/schemas/1.1"
    )
    _Span.resource, _Span.instrumentation_scope = provider.resource, tracer._instrumentation_scope
    yield
    _Span.resource, _Span.instrumentation_scope = saved


@NEEDS_C
@settings(max_examples=300, deadline=None)
@given(st.lists(_lean_fields(), min_size=1, max_size=5))
def test_the_c_writer_writes_the_python_encoders_bytes(lean_scope: Any, fields: list[dict[str, Any]]) -> None:
    spans = [_made(f) for f in fields]
    c, py = _both_writers(spans)
    assert c == py
    if not any(s.dropped_events for s in spans):  # (the SDK's ReadableSpan counts none)
        assert ExportTraceServiceRequest.FromString(c) == encode_spans([s.readable() for s in spans])


@NEEDS_C
def test_the_c_writer_hands_what_it_does_not_write_to_the_python_encoder(lean_scope: Any) -> None:
    """A trace state, values of other types (a dict: ``str()`` of it, as the Python encoder writes it; a
    range: an array): those spans are the Python ``_record``'s bytes, the others the C writer's."""
    from shepherd.node.observe.tracing import _Span

    spans = []
    for odd in ({"m": {"a": 1}}, {"r": range(2)}, {"top": (1 << 64) - 1}, {}):
        s = _Span("x", 1, 0x1234, 7, False, None, True)
        s.attrs.update({"plain": "yes", **odd})
        s.end_time = s.start_time + 5
        spans.append(s)
    spans[-1].state = TraceState([("vendor", "1")])
    c, py = _both_writers(spans)
    assert c == py
    got = ExportTraceServiceRequest.FromString(c).resource_spans[0].scope_spans[0].spans
    assert [kv.value.string_value for kv in got[0].attributes if kv.key == "m"] == ["{'a': 1}"]
    assert got[3].trace_state == "vendor=1"
    assert [v.int_value for v in got[1].attributes[1].value.array_value.values] == [0, 1]
    assert got[2].attributes[1].value.int_value == -1  # 2**64 - 1 as an int64


@NEEDS_C
def test_the_c_writer_matches_the_stock_encoder_on_a_requests_spans(lean_scope: Any) -> None:
    """A SERVER span with the stage events and a CLIENT span as the node records them (the bench's
    request), a thousand of them in one batch (the lengths of the enclosing messages take 3 bytes)."""
    from shepherd.node.observe.tracing import _Span

    spans = []
    for i in range(500):
        server = _Span("POST /v1/chat/completions", 1, (i + 1) << 64 | 0xABC, 0, False, None, True)
        server.attrs.update({"http.request.method": "POST", "http.route": "/v1/chat/completions"})
        server.attrs.update({"http.response.status_code": 200, "shepherd.request.id": f"chatcmpl-{i}"})
        cache = {"shepherd.tokenizer.l1_misses": 6, "shepherd.tokenizer.cache": "miss"}
        server.events.append(("render_tokenize", server.start_time, {"shepherd.duration_ms": 1.25, **cache}))
        server.events.append(("route", server.start_time + 9, {"shepherd.route.policy": "RoundRobin"}))
        client = _Span("chat qwen3", 2, server.trace_id, server.span_id, False, None, True)
        client.attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.temperature": 1.0, "server.port": 1}
        client.attrs["gen_ai.response.finish_reasons"] = ("length",)
        client.events.append(("gen_ai.first_chunk", client.start_time + 3, MappingProxyType({})))
        for s in (client, server):
            s.end_time = s.start_time + 1000
            spans.append(s)
    c, py = _both_writers(spans)
    assert len(c) > 1 << 14 and c == py
    assert ExportTraceServiceRequest.FromString(c) == encode_spans([s.readable() for s in spans])


def test_values_equal_in_python_but_not_on_the_wire_are_not_served_from_one_cache_entry() -> None:
    """0.0 and -0.0, or (1,), (True,) and (1.0,), are equal keys in a dict but distinct OTLP values:
    each is written as itself whatever was written before."""

    def one(v: object) -> bytes:
        return otlp_wire._attributes(1, {"k": v})

    for _ in range(2):  # the second round is the one a cache would answer
        a, b = one(0.0), one(-0.0)
        assert a != b and a.endswith(bytes(8)) and b.endswith(b"\x00" * 7 + b"\x80")
        assert len({one((1,)), one((True,)), one((1.0,))}) == 3


_SPAN_FIELDS = (
    "trace_id",
    "span_id",
    "state",
    "parent",
    "name",
    "kind",
    "start_time",
    "end_time",
    "attrs",
    "events",
    "dropped_events",
    "status",
    "desc",
    "remote",
)


def _c_writer_calls(spans: list[Any]) -> tuple[bytes, int]:
    """The C writer's request of ``spans`` and how many it handed to the Python ``_record``."""
    assert otlp_wire._c_request is not None
    handed = 0

    def fallback(span: Any) -> bytes:
        nonlocal handed
        handed += 1
        return otlp_wire._record(span)

    return otlp_wire._c_request(spans, fallback, b"", None, "", ""), handed


@NEEDS_C
def test_the_c_writer_reads_a_subclass_of_the_span_from_its_slots(lean_scope: Any) -> None:
    from shepherd.node.observe.tracing import _Span

    class Sub(_Span):
        __slots__ = ("extra",)

    class Renamed(_Span):  # what getattr reads: the C writer too (through the Python encoder)
        __slots__ = ()

        def __getattribute__(self, name: str) -> Any:
            return "renamed" if name == "name" else object.__getattribute__(self, name)

    spans: list[Any] = [
        Sub("a", 1, 0x1234, 7, False, None, True),
        Renamed("b", 1, 0x99, 0, False, None, True),
    ]
    for s in spans:
        s.attrs["k"] = "v"
        s.end_time = s.start_time + 5
    got, handed = _c_writer_calls(spans)
    assert handed == 0  # (Renamed's fields read with getattr: its own __getattribute__)
    c, py = _both_writers(spans)
    assert c == py
    written = ExportTraceServiceRequest.FromString(c).resource_spans[0].scope_spans[0].spans
    assert list(ExportTraceServiceRequest.FromString(got).resource_spans[0].scope_spans[0].spans) == list(
        written
    )
    assert [s.name for s in written] == ["a", "renamed"]


@NEEDS_C
def test_a_class_naming_another_classes_slots_is_not_read_at_their_offsets(lean_scope: Any) -> None:
    """A class whose attributes are the member descriptors of another class (the span's field names) does
    not have that class's layout: getattr refuses them (TypeError), and the C writer, which read the
    instance at those offsets, now hands the span to the Python encoder, which raises the same."""
    from shepherd.node.observe.tracing import _Span

    owner = type("Owner", (), {"__slots__": _SPAN_FIELDS})
    ns: dict[str, Any] = {"__slots__": tuple(f"x{i}" for i in range(len(_SPAN_FIELDS))), "lean": True}
    ns.update({f: owner.__dict__[f] for f in _SPAN_FIELDS})
    ns.update(resource=_Span.resource, instrumentation_scope=_Span.instrumentation_scope)
    impostor = type("Impostor", (), ns)
    span = impostor()
    values: list[Any] = [1, 2, None, 0, "n", 1, 10, 20, {}, [], 0, 0, "", False]
    for i, v in enumerate(values):  # its own slots: where Owner's are
        object.__setattr__(span, f"x{i}", v)
    with pytest.raises(TypeError, match="doesn't apply"):
        _c_writer_calls([span])
    with pytest.raises(TypeError, match="doesn't apply"):
        _both_writers([span])
    small = type("Small", (), {**ns, "__slots__": ()})  # Owner's offsets past its end: no read there
    with pytest.raises(TypeError, match="doesn't apply"):
        _c_writer_calls([small()])
