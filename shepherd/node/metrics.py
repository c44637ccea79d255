"""Prometheus metrics of one node, all prefixed ``smg_``, in a registry of their own.

The per-request metrics (requests, errors, latencies, tokens) are ``LiteCounter`` / ``LiteHistogram``:
plain numbers updated on the event loop (one dict lookup per ``labels``, a ``bisect`` per observation,
no lock) and turned into Prometheus families only when ``/metrics`` is scraped. prometheus_client's own
types take a lock and walk the buckets in Python on every update: measured ~2-3 µs per update against
~0.3 µs here, and a request makes about ten of them. Every update happens on the node's event loop.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

_C = TypeVar("_C", bound=Collector)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# SMG's *duration_seconds buckets (lightseekorg/smg observability/metrics.rs), 1 ms .. 240 s, fewer steps
SMG_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 240)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _Callback(Collector):
    """Reads figures kept elsewhere (tokenizer caches, worker registry) only when scraped."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LiteCounter(Collector):
    """A counter family: ``labels(*values).inc(n)``, or ``inc(n)`` when it has no labels."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._children: dict[tuple[str, ...], _CounterChild] = {}

    def labels(self, *values: str) -> _CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = _CounterChild()
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in list(self._children.items()):
            fam.add_metric(list(values), child.value)
        yield fam


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: Prometheus' ``le``
        self.sum += value


class LiteHistogram(Collector):
    """A histogram family with fixed buckets: ``labels(*values).observe(v)``, or ``observe(v)``."""

    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = _HistogramChild(self.bounds)
        return child

    def observe(self, value: float) -> None:
        child = self._children.get(())
        if child is None:
            child = self.labels()
        child.observe(value)

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in list(self._children.items()):
            running = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip([*map(repr, self.bounds), "+Inf"], child.counts, strict=True):
                running += n
                buckets.append((bound, running))
            fam.add_metric(list(values), buckets, child.sum)
        yield fam


# the node's route -> SMG's ``endpoint`` label
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/classify": "classify",
    "/generate": "generate",
}


class ModelMetrics:
    """One model's children of the per-request families for one endpoint (SMG's ``endpoint`` label:
    ``chat``, ``completions``, ``responses``...), looked up once per request (not per update)."""

    __slots__ = ("completion_tokens", "e2e", "generation", "itl", "prompt_tokens", "ttft")

    def __init__(self, m: NodeMetrics, model: str, endpoint: str) -> None:
        self.ttft = m.ttft.labels(model, endpoint)
        self.itl = m.itl.labels(model, endpoint)
        self.e2e = m.e2e.labels(model, endpoint)
        self.generation = m.generation.labels(model, endpoint)
        self.prompt_tokens = m.tokens.labels(model, "prompt", endpoint)
        self.completion_tokens = m.tokens.labels(model, "completion", endpoint)


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def reg(c: _C) -> _C:
            r.register(c)
            return c

        self.requests = reg(LiteCounter("smg_requests", "HTTP requests served", ["route", "model", "status"]))
        self.errors = reg(LiteCounter("smg_errors", "Requests that ended in an error", ["route", "kind"]))
        self.ttft = reg(
            LiteHistogram(
                "smg_time_to_first_token_seconds",
                "Time to first token",
                ["model", "endpoint"],
                buckets=LATENCY_BUCKETS,
            )
        )
        self.itl = reg(
            LiteHistogram(
                "smg_inter_token_latency_seconds",
                "Time between streamed engine messages, per token",
                ["model", "endpoint"],
                buckets=ITL_BUCKETS,
            )
        )
        self.e2e = reg(
            LiteHistogram(
                "smg_request_duration_seconds",
                "End-to-end request duration",
                ["model", "endpoint"],
                buckets=LATENCY_BUCKETS,
            )
        )
        self.overhead = reg(
            LiteHistogram(
                "smg_gateway_overhead_seconds",
                "Gateway time before dispatch to the engine (parse, template, tokenize, route)",
                buckets=OVERHEAD_BUCKETS,
            )
        )
        self.tokens = reg(LiteCounter("smg_tokens", "Tokens processed", ["model", "kind", "endpoint"]))
        self.in_flight = Gauge(
            "smg_in_flight_requests",
            "Inference requests (generation, embeddings, pooling) in flight on this node; probes, metrics "
            "and admin calls are not counted",
            registry=r,
        )
        self.retries = reg(LiteCounter("smg_engine_retries", "Engine calls retried on another worker"))
        self.aborts = reg(
            LiteCounter(
                "smg_engine_aborts",
                "Engine requests aborted by the gateway, by reason (client_disconnect: the client went away)",
                ["reason", "model"],
            )
        )
        # SMG's smg_http_request_duration_seconds{method, path} (its count: smg_http_requests_total), not
        # registered: shepherd.node.api.smg_metrics serves it under SMG's names
        self.http_duration = LiteHistogram(
            "smg_http_request_duration_seconds",
            "HTTP request duration by method and path",
            ["method", "path"],
            buckets=SMG_DURATION_BUCKETS,
        )
        # SMG's smg_router_generation_duration_seconds{model, endpoint} (first token to last token), served
        # under SMG's name only (shepherd.node.api.smg_metrics)
        self.generation = LiteHistogram(
            "smg_router_generation_duration_seconds",
            "Generation time, first token to last token",
            ["model", "endpoint"],
            buckets=SMG_DURATION_BUCKETS,
        )
        # (route, model) -> streamed requests among those counted (SMG's ``streaming`` label)
        self.streamed: dict[tuple[str, str], int] = {}
        self._http_by_route: dict[tuple[str, str], _HistogramChild] = {}
        self._models: dict[tuple[str, str], ModelMetrics] = {}
        # (route, model, status) -> its requests child: no str(status) and label tuple per request
        self._requests_by_status: dict[tuple[str, str, int], _CounterChild] = {}

    def for_model(self, model: str, endpoint: str) -> ModelMetrics:
        """The model's per-request metric children for an endpoint (a model is a configured or a worker's
        model, an endpoint one of SMG's few: few of either)."""
        mm = self._models.get((model, endpoint))
        if mm is None:
            mm = self._models[(model, endpoint)] = ModelMetrics(self, model, endpoint)
        return mm

    def count_request(self, route: str, model: str, status: int, streaming: bool = False) -> None:
        """One HTTP request answered (``streaming``: its answer was a stream)."""
        if streaming:
            sk = (route, model)
            got = self.streamed.get(sk)
            if got is not None:
                self.streamed[sk] = got + 1
            elif len(self.streamed) < 4096:
                self.streamed[sk] = 1
        key = (route, model, status)
        child = self._requests_by_status.get(key)
        if child is None:
            child = self.requests.labels(route, model, str(status))
            if len(self._requests_by_status) < 4096:
                self._requests_by_status[key] = child
        child.value += 1.0

    def observe_http(self, method: str, path: str, seconds: float) -> None:
        """One HTTP request's duration (its method and route label)."""
        key = (method, path)
        child = self._http_by_route.get(key)
        if child is None:
            child = self.http_duration.labels(method, path)
            if len(self._http_by_route) < 4096:
                self._http_by_route[key] = child
        child.observe(seconds)

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


PROC_LABEL = "proc"


def merge_processes(parts: dict[str, bytes]) -> bytes:
    """The expositions of one node's processes (``--procs N``: process index -> its /metrics, as
    ``render`` writes it) as one: every sample gains the label ``proc`` (its process), each family is
    written once (its HELP and TYPE, then all of its processes' samples). So a scrape of the node's one
    port sees every process's series, each counter monotonic (no process's value stands in for
    another's on the next scrape); ``sum without (proc) (...)`` is the node's count for counters and
    histograms (per-worker gauges, the same state seen by each process, are not summed).

    Line by line, no parse: a scrape on the serving process's event loop costs a few string operations
    a line (the text format's families are the blocks its ``# HELP`` lines begin)."""
    heads: dict[str, tuple[str, list[str]]] = {}  # family -> (the process its comments come from, them)
    samples: dict[str, list[str]] = {}
    for proc in sorted(parts, key=lambda p: (len(p), p)):
        label = f'{PROC_LABEL}="{proc}"'
        family = ""
        for line in parts[proc].decode("utf-8", "replace").splitlines():
            if not line:
                continue
            if line[0] == "#":
                if line.startswith("# HELP "):
                    family = line[7:].split(" ", 1)[0]
                    heads.setdefault(family, (proc, []))
                    samples.setdefault(family, [])
                head = heads.get(family)
                if head is not None and head[0] == proc:  # (HELP and TYPE once: the first process's)
                    head[1].append(line)
                continue
            brace, space = line.find("{"), line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                sep = "" if line[brace + 1 : brace + 2] == "}" else ","
                line = f"{line[: brace + 1]}{label}{sep}{line[brace + 1 :]}"
            elif space != -1:
                line = f"{line[:space]}{{{label}}}{line[space:]}"
            samples.setdefault(family, []).append(line)
    out: list[str] = []
    for family, lines in samples.items():
        head = heads.get(family)
        if head is not None:
            out.extend(head[1])
        out.extend(lines)
    return ("\n".join(out) + "\n").encode()
