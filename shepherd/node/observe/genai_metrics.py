"""The optional OTLP export of the GenAI semantic-convention metrics (``--otlp-metrics-endpoint``):
``gen_ai.client.token.usage``, ``gen_ai.client.operation.duration``, ``gen_ai.server.time_to_first_token``
and ``gen_ai.server.time_per_output_token``, recorded per engine call (``tracing.EngineCall``) and pushed
by the SDK's periodic reader (its own thread; ``OTEL_METRIC_EXPORT_INTERVAL``) over gRPC or
HTTP/protobuf. Off by default; the Prometheus ``/metrics`` of the node does not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ENABLED", "record", "setup", "shutdown", "shutdown_provider"]

log = logging.getLogger("shepherd.node.genai_metrics")

ENABLED = False
_provider: Any = None
_instruments: dict[str, Any] = {}

# the buckets the GenAI conventions advise (seconds; tokens)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


def setup(endpoint: str, protocol: str = "grpc", node_name: str | None = None) -> None:
    """Install a meter provider pushing the four GenAI metrics to ``endpoint``."""
    global ENABLED, _provider
    # optional: the metrics SDK and exporters are imported only when the export is on
    from opentelemetry.sdk.metrics import MeterProvider  # optional: only when on
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # optional: only when on
    from opentelemetry.sdk.metrics.view import (  # optional: only when on
        ExplicitBucketHistogramAggregation,
        View,
    )
    from opentelemetry.sdk.resources import Resource  # optional: only when on

    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # optional: only when on
            OTLPMetricExporter as GrpcMetricExporter,
        )

        exporter = GrpcMetricExporter(endpoint=endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # optional: only when on
            OTLPMetricExporter as HttpMetricExporter,
        )

        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
        exporter = HttpMetricExporter(endpoint=endpoint)
    views = [
        View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(bounds))
        for name, bounds in (
            ("gen_ai.client.operation.duration", DURATION_BUCKETS),
            ("gen_ai.server.time_to_first_token", TTFT_BUCKETS),
            ("gen_ai.server.time_per_output_token", TPOT_BUCKETS),
            ("gen_ai.client.token.usage", TOKEN_BUCKETS),
        )
    ]
    attrs: dict[str, Any] = {"service.name": "smg-node"}
    if node_name:
        attrs["service.instance.id"] = node_name
    provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(exporter)],
        resource=Resource.create(attrs),
        views=views,
        shutdown_on_exit=False,
    )
    meter = provider.get_meter("shepherd.node")
    _instruments["duration"] = meter.create_histogram(
        "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration"
    )
    _instruments["tokens"] = meter.create_histogram(
        "gen_ai.client.token.usage", unit="{token}", description="Input and output tokens used"
    )
    _instruments["ttft"] = meter.create_histogram(
        "gen_ai.server.time_to_first_token", unit="s", description="Time to generate the first token"
    )
    _instruments["tpot"] = meter.create_histogram(
        "gen_ai.server.time_per_output_token",
        unit="s",
        description="Time per output token after the first",
    )
    _provider = provider
    ENABLED = True
    log.info("GenAI metrics: OTLP %s export to %s", protocol, endpoint)


def record(
    attrs: Mapping[str, Any],
    seconds: float,
    ttft: float | None,
    input_tokens: int | None,
    output_tokens: int | None,
) -> None:
    """One engine call's figures (``attrs``: the operation, provider, model, server, error.type)."""
    if not ENABLED:
        return
    ins = _instruments
    ins["duration"].record(seconds, attrs)
    if input_tokens is not None:
        ins["tokens"].record(input_tokens, {**attrs, "gen_ai.token.type": "input"})
    if output_tokens is not None:
        ins["tokens"].record(output_tokens, {**attrs, "gen_ai.token.type": "output"})
    if ttft is not None and "error.type" not in attrs:
        ins["ttft"].record(ttft, attrs)
        if output_tokens is not None and output_tokens > 1:
            ins["tpot"].record(max(0.0, seconds - ttft) / (output_tokens - 1), attrs)


async def shutdown(timeout: float = 5.0) -> None:
    global ENABLED
    provider = _provider
    ENABLED = False
    await shutdown_provider(provider, timeout, log, "GenAI metrics: not flushed")


async def shutdown_provider(provider: Any, timeout: float, logger: logging.Logger, what: str) -> None:
    """Flush an OpenTelemetry provider and stop its exporter thread, bounded by ``timeout`` (a collector
    that is down does not hold the node's exit longer); a failure is logged as ``what``. The exporter
    thread is a daemon: it dies with the process. So is the thread that shuts the provider down: on
    the loop's default executor, the interpreter's exit waited for it, through every retry of an export
    to a collector that is down (a SIGTERMed node lived on until SIGKILL)."""
    if provider is None:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            provider.shutdown()
        except Exception as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=f"otel-shutdown-{what}", daemon=True).start()
    try:
        async with asyncio.timeout(timeout):
            await done
    except (TimeoutError, Exception) as e:
        logger.warning("%s at shutdown: %s", what, type(e).__name__)
