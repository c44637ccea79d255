"""The metric names SMG exports (lightseekorg/smg ``model_gateway/src/observability/metrics.rs``, its
``crates/mesh/src/metrics.rs`` and ``docs/reference/metrics.md``), served on the node's ``/metrics`` beside
its own ``smg_*`` names so that dashboards written for SMG read a Shepherd fleet unchanged.

Every family here is made when ``/metrics`` is scraped, from figures the node keeps anyway (its request
histograms and counters, the worker registry, the KV feeds, the mesh members, the rate limiter): the
request path pays nothing for them (beyond the generation duration's observation and a streamed
request's count). Labels follow SMG's (``streaming`` of ``smg_router_requests_total`` included).
``router_type`` is ``grpc`` (the node tokenizes and talks gRPC to engines) and ``backend_type`` ``pd`` on
a PD node, else ``regular``.

Also the node's own tracing figures (``smg_trace_spans_*``: exported, dropped, lost in failed exports).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from shepherd.node.api.admission import Admission
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.engines.http import HttpRelayClient
from shepherd.node.metrics import ENDPOINTS
from shepherd.node.observe import tracing

__all__ = ["SmgNames", "trace_families"]

_CB_STATE = {"closed": 0.0, "open": 1.0, "half_open": 2.0}


def alias(
    fam: Metric,
    name: str,
    doc: str,
    *,
    rename: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
    values: Mapping[str, Mapping[str, str]] | None = None,
) -> Metric:
    """``fam`` under another name: its labels renamed (``rename``), constant ones added (``extra``) and
    label values mapped (``values``: label -> old value -> new value)."""
    out = Metric(name, doc, fam.type)
    rename = rename or {}
    extra = extra or {}
    for s in fam.samples:
        labels: dict[str, str] = {}
        for k, v in s.labels.items():
            if k == "le":
                labels[k] = v
                continue
            new = rename.get(k, k)
            labels[new] = values[new].get(v, v) if values is not None and new in values else v
        labels.update(extra)
        out.samples.append(Sample(name + s.name[len(fam.name) :], labels, s.value, s.timestamp, s.exemplar))
    return out


_SMG_ERROR_TYPES = {
    "no_available_worker": "no_workers",
    "service_unavailable": "no_workers",
    "timeout": "timeout",
    "engine_timeout": "timeout",
    "engine_unavailable": "backend_error",
    "engine_error": "backend_error",
    "engine_abort": "backend_error",
    "engine_overloaded": "backend_error",
    "unimplemented": "backend_error",
    "internal": "internal_error",
    "tokenizer": "internal_error",
    "storage_unavailable": "internal_error",
    "storage_error": "internal_error",
    "owner_unavailable": "internal_error",
}


def smg_error_type(kind: str) -> str:
    """One of this node's error codes as SMG's ``error_type``: every code not named above is the
    request's (a 4xx: ``validation_error``), but a 5xx status given as the code."""
    got = _SMG_ERROR_TYPES.get(kind)
    if got is not None:
        return got
    return "internal_error" if kind.isdigit() and kind.startswith("5") else "validation_error"


def _first(fams: Iterable[Metric]) -> Metric:
    return next(iter(fams))


def trace_families() -> list[Metric]:
    """The tracing pipeline's figures (zero while tracing is off)."""
    st = tracing.STATS
    spans = CounterMetricFamily(
        "smg_trace_spans",
        "Spans by outcome: ended on this node, exported, dropped (the export queue was full), "
        "export_failed (the collector was down or refused them)",
        labels=["outcome"],
    )
    for outcome, n in (
        ("ended", st.ended),
        ("exported", st.exported),
        ("dropped", st.dropped),
        ("export_failed", st.export_failed),
    ):
        spans.add_metric([outcome], float(n))
    dropped = CounterMetricFamily(
        "smg_trace_spans_dropped",
        "Spans never delivered: the export queue was full, or their export failed",
        labels=["reason"],
    )
    dropped.add_metric(["queue_full"], float(st.dropped))
    dropped.add_metric(["export_failed"], float(st.export_failed))
    queue = GaugeMetricFamily("smg_trace_queue_capacity", "The span export queue's bound (0: tracing off)")
    queue.add_metric([], float(st.queue_size))
    return [spans, dropped, queue]


class SmgNames:
    """The ``/metrics`` collector callback of SMG's names (``NodeMetrics.add_callback(names.collect)``)."""

    def __init__(self, gw: Gateway, mesh: MeshNode | None = None, admission: Admission | None = None) -> None:
        self.gw = gw
        self.mesh = mesh
        self.admission = admission
        self.backend_type = "pd" if gw.pd is not None else "regular"

    def collect(self) -> list[Metric]:
        out = self._router()
        out.extend(self._http())
        out.extend(self._workers())
        out.extend(self._mesh())
        return out

    def _router(self) -> list[Metric]:
        m = self.gw.metrics
        extra = {"router_type": "grpc", "backend_type": self.backend_type}
        return [
            alias(_first(m.ttft.collect()), "smg_router_ttft_seconds", "Time to first token", extra=extra),
            alias(
                _first(m.itl.collect()),
                "smg_router_tpot_seconds",
                "Time per output token (between streamed engine messages, per token)",
                extra=extra,
            ),
            alias(
                _first(m.generation.collect()),
                "smg_router_generation_duration_seconds",
                "Generation time, first token to last token",
                extra=extra,
            ),
            alias(
                _first(m.e2e.collect()),
                "smg_router_request_duration_seconds",
                "Router request duration",
                extra={**extra, "connection_mode": "grpc"},
            ),
            alias(
                _first(m.tokens.collect()),
                "smg_router_tokens",
                "Tokens processed by model and token_type (input, output)",
                rename={"kind": "token_type"},
                values={"token_type": {"prompt": "input", "completion": "output"}},
                extra=extra,
            ),
            alias(
                _first(m.overhead.collect()),
                "smg_router_stage_duration_seconds",
                "Gateway stage duration: preprocess (parse, template, tokenize, admission, route) before the "
                "engine is called",
                extra={"router_type": "grpc", "stage": "preprocess"},
            ),
            self._request_errors(extra),
            alias(
                _first(m.retries.collect()),
                "smg_worker_retries",
                "Engine calls retried on another worker",
                extra={"worker_type": "regular", "endpoint": "generate"},
            ),
        ]

    def _request_errors(self, extra: Mapping[str, str]) -> Metric:
        """SMG's ``smg_router_request_errors_total``: the inference routes' errors only (a scanner's 404s
        and the admin API's refusals are not the router's), by SMG's ``error_type`` (``smg_errors_total``
        keeps every route and this node's own codes)."""
        fam = CounterMetricFamily(
            "smg_router_request_errors",
            "Router errors by endpoint and error_type (no_workers, timeout, backend_error, "
            "validation_error, internal_error)",
            labels=["endpoint", "error_type", *extra, "connection_mode"],
        )
        sums: dict[tuple[str, str], float] = {}
        for smp in _first(self.gw.metrics.errors.collect()).samples:
            endpoint = ENDPOINTS.get(smp.labels.get("route", ""))
            if endpoint is None or not smp.name.endswith("_total"):
                continue
            key = (endpoint, smg_error_type(smp.labels.get("kind", "")))
            sums[key] = sums.get(key, 0.0) + smp.value
        for (endpoint, kind), value in sorted(sums.items()):
            fam.add_metric([endpoint, kind, *extra.values(), "grpc"], value)
        return fam

    def _http(self) -> list[Metric]:
        m = self.gw.metrics
        requests = CounterMetricFamily(
            "smg_http_responses",
            "HTTP responses by path, status_code and error_code",
            labels=["path", "status_code", "error_code"],
        )
        routed = CounterMetricFamily(
            "smg_router_requests",
            "Routed requests by model, endpoint and streaming",
            labels=["router_type", "backend_type", "connection_mode", "model", "endpoint", "streaming"],
        )
        by_status: dict[tuple[str, str], float] = {}
        by_model: dict[tuple[str, str], list[float]] = {}  # (model, endpoint) -> [all, streamed]
        for s in _first(m.requests.collect()).samples:
            if not s.name.endswith("_total"):
                continue
            route, model, status = s.labels["route"], s.labels["model"], s.labels["status"]
            by_status[(route, status)] = by_status.get((route, status), 0.0) + s.value
            endpoint = ENDPOINTS.get(route)
            if model and endpoint is not None:
                by_model.setdefault((model, endpoint), [0.0, 0.0])[0] += s.value
        for (route, model), n_streamed in list(m.streamed.items()):
            endpoint = ENDPOINTS.get(route)
            if model and endpoint is not None and (model, endpoint) in by_model:
                by_model[(model, endpoint)][1] += n_streamed
        for (route, status), n in by_status.items():
            requests.add_metric([route, status, "" if status.startswith(("1", "2", "3")) else status], n)
        for (model, endpoint), (n, streamed) in by_model.items():
            labels = ["grpc", self.backend_type, "grpc", model, endpoint]
            routed.add_metric([*labels, "true"], streamed)
            routed.add_metric([*labels, "false"], max(0.0, n - streamed))
        out: list[Metric] = [requests, routed]
        http = getattr(m, "http_duration", None)
        if http is not None:
            dur = alias(_first(http.collect()), "smg_http_request_duration_seconds", "HTTP request duration")
            out.append(dur)
            total = CounterMetricFamily(
                "smg_http_requests", "HTTP requests by method and path", labels=["method", "path"]
            )
            for s in dur.samples:
                if s.name.endswith("_count"):
                    total.add_metric([s.labels["method"], s.labels["path"]], s.value)
            out.append(total)
        adm = self.admission  # None: no rate limits configured (every request allowed, none counted)
        rl = CounterMetricFamily(
            "smg_http_rate_limit", "Rate limiting decisions by result", labels=["result"]
        )
        rl.add_metric(["allowed"], float(adm.admitted) if adm is not None else 0.0)
        rl.add_metric(["rejected"], float(sum(adm.rejected.values())) if adm is not None else 0.0)
        out.append(rl)
        return out

    def _workers(self) -> list[Metric]:
        gw = self.gw
        ws = list(gw.registry.workers.values())
        health = GaugeMetricFamily("smg_worker_health", "Worker health (1 healthy, 0 not)", labels=["worker"])
        cb = GaugeMetricFamily(
            "smg_worker_cb_state", "Circuit breaker state (0 closed, 1 open, 2 half_open)", labels=["worker"]
        )
        cb_fail = GaugeMetricFamily(
            "smg_worker_cb_consecutive_failures", "Consecutive failures per worker", labels=["worker"]
        )
        cb_out = CounterMetricFamily(
            "smg_worker_cb_outcomes", "Engine call outcomes per worker", labels=["worker", "outcome"]
        )
        active = GaugeMetricFamily(
            "smg_worker_requests_active", "This node's requests running on the worker", labels=["worker"]
        )
        pool = GaugeMetricFamily(
            "smg_worker_pool_size",
            "Workers by worker_type, connection_mode, model",
            labels=["worker_type", "connection_mode", "model"],
        )
        selection = CounterMetricFamily(
            "smg_worker_selection",
            "Worker selections (engine calls sent) by model and policy",
            labels=["worker_type", "connection_mode", "model", "policy"],
        )
        usage = GaugeMetricFamily(
            "smg_engine_token_usage",
            "Engine-reported KV token usage ratio (0-1)",
            labels=["worker", "model", "dp_rank"],
        )
        hit = GaugeMetricFamily(
            "smg_engine_cache_hit_rate",
            "Engine-reported prefix cache hit rate (0-1)",
            labels=["worker", "model", "dp_rank"],
        )
        pools: dict[tuple[str, str, str], float] = {}
        picks: dict[tuple[str, str, str, str], float] = {}
        for w in ws:
            http = isinstance(w.client, HttpRelayClient)
            mode = "http" if http else "grpc"
            wtype = self._worker_type(w.id)
            health.add_metric([w.url], float(w.health.healthy))
            cb.add_metric([w.url], _CB_STATE.get(w.breaker.state.value, 0.0))
            cb_fail.add_metric([w.url], float(w.breaker.failures))
            cb_out.add_metric([w.url, "success"], float(max(0, w.requests - w.failures)))
            cb_out.add_metric([w.url, "failure"], float(w.failures))
            active.add_metric([w.url], float(w.in_flight))
            key = (wtype, mode, w.model)
            pools[key] = pools.get(key, 0.0) + 1.0
            policy = gw.cfg.policy
            mc = gw.models.get(w.model)
            if mc is not None and mc.policy:
                policy = mc.policy
            pk = (wtype, mode, w.model, policy)
            picks[pk] = picks.get(pk, 0.0) + float(w.requests)
            if not http:
                usage.add_metric([w.url, w.model, "0"], float(w.load.token_usage))
                hit.add_metric([w.url, w.model, "0"], float(w.load.cache_hit_rate))
        for k, n in pools.items():
            pool.add_metric(list(k), n)
        for pk, n in picks.items():
            selection.add_metric(list(pk), n)
        kv = CounterMetricFamily(
            "smg_kv_event_subscription_failures",
            "KV event subscriptions that failed (the stream broke or could not open) by worker and reason",
            labels=["worker", "reason"],
        )
        for wid, state in list(gw.kv_feed.states.items()):
            fed = gw.registry.workers.get(wid)
            kv.add_metric([fed.url if fed is not None else wid, "stream_error"], float(state.stats.failures))
        return [health, cb, cb_fail, cb_out, active, pool, selection, usage, hit, kv]

    def _worker_type(self, worker_id: str) -> str:
        pd = self.gw.pd
        if pd is None:
            return "regular"
        if worker_id in pd.prefill_ids:
            return "prefill"
        return "decode" if worker_id in pd.decode_ids else "regular"

    def _mesh(self) -> list[Metric]:
        peers = GaugeMetricFamily(
            "router_mesh_peer_connections", "Mesh peers (1 alive, 0 not)", labels=["peer"]
        )
        mesh = self.mesh
        if mesh is None:  # no mesh: the family without peers
            return [peers]
        me = mesh.name
        for m in mesh.members():
            name = m.get("name")
            if isinstance(name, str) and name != me:
                peers.add_metric([name], 1.0 if m.get("state") == "alive" else 0.0)
        return [peers]
