"""An OTLP collector for tests: opentelemetry-proto's ``TraceService`` and ``MetricsService`` servicers on
``grpc.aio`` (or, ``OtlpReceiver("http/protobuf")``, an aiohttp server taking ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` body, OTLP/HTTP), on loopback, in a thread of its own (its own event loop),
keeping every span and histogram point it is sent.

``with OtlpReceiver() as rx:`` starts it on a free port (``rx.endpoint``); ``rx.wait(cond)`` polls the
spans received (bounded); the thread and the server stop on exit, also on failure.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SERVER, CLIENT, INTERNAL = 2, 3, 1  # opentelemetry.proto.trace.v1.Span.SpanKind

# the node's span exporter sends every 100 ms (the SDK's default is 5 s): a test waits less, nothing is timed
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[str] = field(default_factory=list)
    event_attributes: dict[str, dict[str, Any]] = field(default_factory=dict)  # by name (the last)
    error: bool = False


def _received(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """The spans of one export request (either protocol)."""
    got: list[ReceivedSpan] = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            got.extend(
                ReceivedSpan(
                    name=s.name,
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(),
                    kind=int(s.kind),
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    resource=resource,
                    events=[e.name for e in s.events],
                    event_attributes={
                        e.name: {a.key: _value(a.value) for a in e.attributes} for e in s.events
                    },
                    error=s.status.code == 2,
                )
                for s in ss.spans
            )
    return got


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self.sink = sink

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.sink(_received(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Keeps, per metric name, the attribute sets of its histogram points (the GenAI metrics are
    histograms) with their counts and sums."""

    def __init__(self, sink: Callable[[list[ReceivedPoint]], None]) -> None:
        self.sink = sink

    async def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: Any
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        got: list[ReceivedPoint] = []
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    got.extend(
                        ReceivedPoint(
                            m.name, m.unit, {a.key: _value(a.value) for a in p.attributes}, p.count, p.sum
                        )
                        for p in m.histogram.data_points
                    )
        self.sink(got)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@dataclass
class ReceivedPoint:
    name: str
    unit: str
    attributes: dict[str, Any]
    count: int
    sum: float


class OtlpReceiver:
    def __init__(self, protocol: str = "grpc") -> None:
        assert protocol in ("grpc", "http/protobuf"), protocol
        self.protocol = protocol
        self.spans: list[ReceivedSpan] = []
        self.points: list[ReceivedPoint] = []
        self.port = 0
        self.exports = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-receiver", daemon=True)
        self._error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        """Where the node sends: ``host:port`` (gRPC), the server's URL (HTTP: the exporter adds
        ``/v1/traces``)."""
        if self.protocol == "grpc":
            return f"127.0.0.1:{self.port}"
        return f"http://127.0.0.1:{self.port}"

    def _sink(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.exports += 1

    def _sink_points(self, points: list[ReceivedPoint]) -> None:
        with self._lock:
            self.points.extend(points)

    def metric_points(self) -> list[ReceivedPoint]:
        with self._lock:
            return list(self.points)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._start())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.close()

    async def _export_http(self, request: web.Request) -> web.Response:
        """OTLP/HTTP (binary protobuf): the body an ``ExportTraceServiceRequest``, gzip if so encoded."""
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self._sink(_received(trace_service_pb2.ExportTraceServiceRequest.FromString(body)))
        return web.Response(
            body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def _start(self) -> None:
        if self.protocol == "http/protobuf":
            app = web.Application()
            app.router.add_post("/v1/traces", self._export_http)
            runner = self._runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            return
        server = self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self._sink), server)  # type: ignore[no-untyped-call]
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _MetricsServicer(self._sink_points), server
        )
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"OTLP receiver did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        loop, server, runner = self._loop, self._server, self._runner
        if loop is not None and server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
        if loop is not None and runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait(
        self, cond: Callable[[list[ReceivedSpan]], bool], what: str, timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """Poll the received spans until ``cond`` holds (the deadline only guards against a hang)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if cond(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"timed out waiting for {what}; received {len(spans)} spans: {names}")
            time.sleep(0.05)


def in_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]
