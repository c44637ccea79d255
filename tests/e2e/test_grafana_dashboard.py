"""The Grafana dashboard in the repository (deploy/grafana/shepherd.json) reads only metric names a real
node serves: every metric name in every panel's PromQL is a family (or one of its samples: ``_total``,
``_bucket``, ``_sum``, ``_count``) of the node's ``/metrics`` after a few requests. The ``smg_*`` names are
SMG's (lightseekorg/smg model_gateway/src/observability/metrics.rs, docs/reference/metrics.md), so
dashboards written for SMG read a Shepherd node.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import qwen3_flags
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import start_mock_engine

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "shepherd.json"

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

_IDENT = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"or", "and", "unless", "bool", "offset"}
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def dashboard_exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", ())]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: its identifiers other than functions (followed by a
    parenthesis), keywords, label matchers, grouping labels and range durations."""
    s = re.sub(r"\{[^}]*\}", "", expr)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    names = set()
    for m in _IDENT.finditer(s):
        if s[m.end() :].lstrip().startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_the_dashboard_is_grafana_json_with_queries() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and d["panels"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    assert all(metric_names(e) for _, e in exprs), [t for t, e in exprs if not metric_names(e)]


@pytest.fixture(scope="module")
def node(tokenizer_dir: Path) -> Iterator[NodeProc]:
    with (
        start_mock_engine("--zero-latency", "--output-len", "4", "--tokenizer", str(tokenizer_dir)) as engine,
        running_node(*qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0") as n,
    ):
        yield n


def served_names(text: str) -> set[str]:
    families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    return {f + s for f in families for s in _SUFFIXES}


def test_every_dashboard_metric_is_served_by_a_node(node: NodeProc, http: httpx.Client) -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for stream in (False, True):
        r = http.post(node.url + "/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
    assert http.post(node.url + "/v1/chat/completions", json={**body, "model": "nope"}).status_code == 404
    assert http.get(node.url + "/wp-login.php").status_code == 404  # a scanner: not the router's error
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    assert http.post(node.url + "/generate", json=gen).status_code == 200
    text = http.get(node.url + "/metrics").text
    served = served_names(text)
    missing = {(title, n) for title, e in dashboard_exprs() for n in metric_names(e) if n not in served}
    assert not missing, sorted(missing)
    # the requests just made show in SMG's names
    assert sample(text, "smg_http_requests_total", method="POST", path="/v1/chat/completions") == 3
    # SMG's endpoint label on the latency and token series, /generate's too
    assert sample(text, "smg_router_tokens_total", model="qwen3", token_type="output", endpoint="chat") == 8
    assert sample(text, "smg_router_tokens_total", token_type="output", endpoint="generate") == 3
    ttft = "smg_router_ttft_seconds_count"
    assert sample(text, ttft, model="qwen3", router_type="grpc", endpoint="chat") == 2
    assert sample(text, "smg_router_ttft_seconds_count", endpoint="generate") == 1
    assert sample(text, "smg_router_request_duration_seconds_count", endpoint="generate") == 1
    assert sample(text, "smg_worker_health") == 1
    # SMG's streaming label: one streamed and one whole answer (the 404 has no model)
    for streaming in ("true", "false"):
        assert sample(text, "smg_router_requests_total", endpoint="chat", streaming=streaming) == 1
    # SMG's generation duration (first token to last), one per answered request
    assert sample(text, "smg_router_generation_duration_seconds_count", model="qwen3", endpoint="chat") == 2
    assert sample(text, "smg_worker_cb_state") == 0
    # SMG's router errors: the inference routes' only, by SMG's error_type
    errors = [
        (s.labels["endpoint"], s.labels["error_type"], s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "smg_router_request_errors_total"
    ]
    assert errors == [("chat", "validation_error", 1.0)], errors


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    got = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert got, (name, labels)
    return float(sum(got))


def test_the_name_extraction_sees_what_it_should() -> None:
    e = 'histogram_quantile(0.99, sum by (model, le) (rate(smg_router_ttft_seconds_bucket{a="b"}[5m])))'
    assert metric_names(e) == {"smg_router_ttft_seconds_bucket"}
    assert metric_names("count(smg_worker_cb_state == 1) or vector(0)") == {"smg_worker_cb_state"}
    assert metric_names("smg_worker_requests_active") == {"smg_worker_requests_active"}
