"""Seeing inside the node: ``tracing`` (OpenTelemetry spans with the GenAI conventions, off by default,
and the trace context passed on to engines and peers), ``logs`` (text or JSON lines carrying the request
and trace ids, the access log, secrets redacted), ``genai_metrics`` (the optional OTLP export of the
GenAI metrics) and ``otlp_wire`` (the spans' OTLP bytes, written directly; the node's lean records in C,
``_otlp_spans.c``, where it is built). Root leaves of the node:
every room may read them; they import nothing of the node but its config.
"""

__all__ = ["genai_metrics", "logs", "otlp_wire", "tracing"]
