"""shepherd.node.observe.otlp_wire writes the same ExportTraceServiceRequest the OpenTelemetry exporter's
own encoder (opentelemetry-exporter-otlp-proto-common ``encode_spans``) builds, for spans of every shape
the node makes: kinds, parents (local and remote), attributes of every type, events, error status,
trace state, several resources and scopes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from shepherd.node.observe.otlp_wire import encode_request


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


def test_no_spans_is_an_empty_request() -> None:
    assert encode_request([]) == b""
    assert ExportTraceServiceRequest.FromString(b"") == encode_spans([])
