"""Prometheus metrics of one node, all prefixed ``smg_``, in a registry of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _Callback(Collector):
    """Reads figures kept elsewhere (tokenizer caches, worker registry) only when scraped."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "smg_requests", "HTTP requests served", ["route", "model", "status"], registry=r
        )
        self.errors = Counter("smg_errors", "Requests that ended in an error", ["route", "kind"], registry=r)
        self.ttft = Histogram(
            "smg_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "smg_inter_token_latency_seconds",
            "Time between streamed engine messages, per token",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "smg_request_duration_seconds",
            "End-to-end request duration",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "smg_gateway_overhead_seconds",
            "Gateway time before dispatch to the engine (parse, template, tokenize, route)",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("smg_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.in_flight = Gauge("smg_in_flight_requests", "Requests in flight on this node", registry=r)
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self.retries = Counter("smg_engine_retries", "Engine calls retried on another worker", registry=r)
        self.aborts = Counter(
            "smg_engine_aborts", "Engine requests aborted by the gateway", ["reason"], registry=r
        )

    def count_request(self, route: str, model: str, status: int) -> None:
        key = (route, model, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, model, str(status))
        child.inc()

    def track_in_flight(self, read: Callable[[], float]) -> None:
        """The in-flight gauge reads the node's own counter when scraped (no work per request)."""
        self.in_flight.set_function(read)

    def add_callback(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.registry.register(_Callback(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for lv, val in rows:
        g.add_metric(lv, val)
    return g


def counter(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    c = CounterMetricFamily(name, doc, labels=labels)
    for lv, val in rows:
        c.add_metric(lv, val)
    return c
