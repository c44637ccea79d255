"""The floor of tracing a request with opentelemetry-sdk: what the SDK alone costs to make the request's
two spans (a SERVER span, current while a CLIENT span is started and ended under it), with the node's
tracer provider, sampler (``traceidratio`` 1.0) and ``BatchSpanProcessor`` (``tracing.setup``), no
attributes, no events, and an exporter that encodes nothing: instructions per request, under callgrind.

    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        --callgrind-out-file=/tmp/floor.out .venv/bin/python bench/trace_floor_bench.py
        # prints nothing itself: the sum of the "totals:" lines of /tmp/floor.out.1-* / --requests

Without valgrind (no ``--callgrind``): CPU µs per request (``time.process_time``). Prints figures only.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--callgrind", action="store_true", help="under valgrind: count the measured loop only")
    args = ap.parse_args()
    random.seed(0)
    os.environ["OTEL_TRACES_SAMPLER"] = "traceidratio"
    os.environ["OTEL_TRACES_SAMPLER_ARG"] = "1.0"
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.trace import SpanKind

    from shepherd.node.observe import tracing

    class Sink:
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None: ...

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    tracing._exporter = lambda s: Sink()
    tracing.setup(tracing.TraceSettings("http://127.0.0.1:9", "grpc"), "bench")
    tracer = tracing._tracer

    def one() -> None:
        server = tracer.start_span("POST /v1/chat/completions", None, SpanKind.SERVER)
        token = otel_context.attach(trace.set_span_in_context(server))
        tracer.start_span("chat qwen3", None, SpanKind.CLIENT).end()
        otel_context.detach(token)
        server.end()

    def callgrind(*a: str) -> None:
        subprocess.run(["callgrind_control", *a, str(os.getpid())], check=True, capture_output=True)

    for _ in range(100):
        one()
    tracing._provider.force_flush()
    if args.callgrind:
        callgrind("-i", "on")
    t0 = time.process_time()
    for _ in range(args.requests):
        one()
    tracing._provider.force_flush()
    cpu = time.process_time() - t0
    if args.callgrind:
        callgrind("-i", "off")
        callgrind("-d", "floor")
    print(f"two empty SDK spans per request: {cpu / args.requests * 1e6:.1f} µs CPU per request")


if __name__ == "__main__":
    main()
