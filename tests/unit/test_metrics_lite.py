"""The lock-free per-request metrics render exactly what prometheus_client's own types render."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shepherd.node.api.smg_metrics import smg_error_type
from shepherd.node.metrics import LATENCY_BUCKETS, LiteCounter, LiteHistogram, NodeMetrics, merge_processes

observations = st.lists(
    st.tuples(
        st.sampled_from(["qwen3", "llama"]),
        st.one_of(st.sampled_from([0.0, *LATENCY_BUCKETS]), st.floats(0, 400, allow_nan=False)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(observations)
def test_histogram_renders_like_prometheus_client(obs: list[tuple[str, float]]) -> None:
    ref_reg, lite_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("smg_x_seconds", "doc", ["model"], buckets=LATENCY_BUCKETS, registry=ref_reg)
    lite = LiteHistogram("smg_x_seconds", "doc", ["model"], buckets=LATENCY_BUCKETS)
    lite_reg.register(lite)
    for model, v in obs:
        ref.labels(model).observe(v)
        lite.labels(model).observe(v)
    assert _samples(lite_reg) == _samples(ref_reg)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 1000)), max_size=30))
def test_counter_renders_like_prometheus_client(incs: list[tuple[str, int]]) -> None:
    ref_reg, lite_reg = CollectorRegistry(), CollectorRegistry()
    ref = Counter("smg_y", "doc", ["kind"], registry=ref_reg)
    lite = LiteCounter("smg_y", "doc", ["kind"])
    lite_reg.register(lite)
    for kind, n in incs:
        ref.labels(kind).inc(n)
        lite.labels(kind).inc(n)
    assert _samples(lite_reg) == _samples(ref_reg)


def _samples(reg: CollectorRegistry) -> list[str]:
    """Exposition lines without the ``_created`` timestamps prometheus_client adds."""
    return sorted(ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln)


def test_wrong_label_count_is_refused() -> None:
    h = LiteHistogram("smg_z", "doc", ["model"], buckets=(1.0,))
    try:
        h.labels("a", "b")
    except ValueError as e:
        assert "expected labels" in str(e)
    else:
        raise AssertionError("two values for one label were accepted")


def test_node_metrics_expose_the_per_request_families() -> None:
    m = NodeMetrics()
    m.count_request("/v1/chat/completions", "qwen3", 200)
    m.ttft.labels("qwen3", "chat").observe(0.02)
    m.overhead.observe(0.0004)
    text = m.render().decode()
    assert 'smg_requests_total{model="qwen3",route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'smg_time_to_first_token_seconds_bucket{endpoint="chat",le="0.025",model="qwen3"} 1.0' in text
    assert "smg_gateway_overhead_seconds_count 1.0" in text


def test_smg_error_types_name_server_errors_as_such() -> None:
    for code, want in (
        ("engine_overloaded", "backend_error"),
        ("storage_unavailable", "internal_error"),
        ("storage_error", "internal_error"),
        ("no_available_worker", "no_workers"),
        ("engine_timeout", "timeout"),
        ("500", "internal_error"),
        ("model_not_found", "validation_error"),
        ("invalid_request", "validation_error"),
    ):
        assert smg_error_type(code) == want, code


def test_the_processes_expositions_merge_into_one_valid_page() -> None:
    a, b = NodeMetrics(), NodeMetrics()
    for m in (a, b):
        m.count_request("/v1/chat/completions", "qwen3", 200)
        m.for_model("qwen3", "chat").ttft.observe(0.1)
    b.count_request("/v1/chat/completions", "qwen3", 200)
    reg = CollectorRegistry()  # a family one process lacks, a label value to escape, _created samples
    Counter("only_in_b", "doc", ["l"], registry=reg).labels('a"b\\c\nd').inc()
    page = merge_processes({"0": a.render(), "1": b.render() + generate_latest(reg)}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(page)}
    got = {s.labels["proc"]: s.value for s in fams["smg_requests"].samples if s.name == "smg_requests_total"}
    assert got == {"0": 1.0, "1": 2.0}
    (only,) = [s for s in fams["only_in_b"].samples if s.name == "only_in_b_total"]
    assert only.labels == {"proc": "1", "l": 'a"b\\c\nd'}
    ttft = [s for s in fams["smg_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["proc"] for s in ttft) == ["0", "1"]
    comments = [ln for ln in page.splitlines() if ln.startswith("#")]
    assert len(comments) == len(set(comments))  # each family's HELP and TYPE once
