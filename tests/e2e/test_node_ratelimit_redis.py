"""End to end: ``--rate-limit-backend redis`` on real nodes (two processes sharing one redis-server, a
mock engine on loopback), through HTTP and the openai SDK: the limits hold across the nodes, a refusal
is the OpenAI 429 envelope, and a node whose Redis is stopped keeps to its share (limit / N).

Skipped only where redis-server cannot be installed (tests.services; a failure under CI=true)."""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from shepherd.node.config import EMBEDDED_MODEL_DIR
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_node_ratelimit import MSGS, client, holding_the_slot, wait_admitted
from tests.services import Service, redis_service, service_or_skip

CONFIG = """
models:
  - {{name: qwen3, model_path: "{path}", worker_urls: ["grpc://127.0.0.1:{grpc}"]}}
rate_limits:
  - {{tenant: "*", rpm: 3}}
  - {{tenant: slow, max_concurrent: 1}}
rate_limit_backend: redis
rate_limit_redis_url: "{url}"
rate_limit_redis_prefix: "{prefix}"
"""


@pytest.fixture(scope="module")
def redis() -> Iterator[Service]:
    with service_or_skip("Redis", redis_service) as svc:
        yield svc


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "20", "--output-len", "8") as e:
        yield e


def _config(d: str, engine: MockEngineProc, url: str) -> str:
    cfg = Path(d) / f"node-{uuid.uuid4().hex[:6]}.yaml"
    prefix = f"e2e{uuid.uuid4().hex[:8]}:"
    cfg.write_text(CONFIG.format(path=EMBEDDED_MODEL_DIR, grpc=engine.grpc_port, url=url, prefix=prefix))
    return str(cfg)


@pytest.fixture(scope="module")
def nodes(engine: MockEngineProc, redis: Service) -> Iterator[tuple[NodeProc, NodeProc]]:
    with tempfile.TemporaryDirectory() as d:
        cfg = _config(d, engine, redis.url)
        with (
            running_node("--config", cfg, "--auth-trust-tenant-header") as a,
            running_node("--config", cfg, "--auth-trust-tenant-header") as b,
        ):
            yield a, b


def _metric(node: NodeProc, name: str) -> float:
    text = httpx.get(node.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_requests_per_minute_hold_across_two_nodes(nodes: tuple[NodeProc, NodeProc]) -> None:
    a, b = nodes
    for node, left in ((a, 2), (b, 1), (a, 0)):
        raw = client(node, "alpha").chat.completions.with_raw_response.create(
            model="qwen3", messages=MSGS, max_tokens=4
        )
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
    for node in (b, a):
        with pytest.raises(openai.RateLimitError) as ei:
            client(node, "alpha").chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        e = ei.value
        assert e.status_code == 429 and e.code == "rate_limit_exceeded" and e.type == "requests"
        assert isinstance(e.body, dict) and set(e.body) >= {"message", "type", "param", "code"}
        assert "Rate limit reached for requests per min (RPM) of tenant 'alpha': Limit 3, Used 3" in e.message
        h = e.response.headers
        assert int(h["retry-after"]) >= 1 and h["x-ratelimit-remaining-requests"] == "0"
    assert _metric(a, "smg_rate_limit_redis_up") == 1.0
    assert _metric(a, "smg_rate_limit_redis_fallbacks_total") == 0.0


def test_background_responses_are_admitted_through_redis(nodes: tuple[NodeProc, NodeProc]) -> None:
    a, b = nodes
    for node in (a, b, b):
        r = client(node, "gamma").responses.create(model="qwen3", input="hello", background=True)
        assert r.status in ("queued", "in_progress", "completed")
    with pytest.raises(openai.RateLimitError) as ei:
        client(a, "gamma").responses.create(model="qwen3", input="hello", background=True)
    assert "of tenant 'gamma': Limit 3, Used 3" in ei.value.message


def test_concurrency_holds_across_two_nodes(nodes: tuple[NodeProc, NodeProc]) -> None:
    a, b = nodes
    with holding_the_slot(a, "slow"):  # streaming on node a: the tenant's only slot is taken
        with pytest.raises(openai.RateLimitError) as ei:
            client(b, "slow").chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        assert "Too many concurrent requests for tenant 'slow': Limit 1" in ei.value.message
    # the client hung up: node a settles, and node b is let in
    wait_admitted(client(b, "slow"), "the slot was not given back")


def test_a_node_whose_redis_stops_keeps_to_its_share(engine: MockEngineProc) -> None:
    with (
        service_or_skip("Redis", redis_service) as svc,
        tempfile.TemporaryDirectory() as d,
        running_node("--config", _config(d, engine, svc.url), "--auth-trust-tenant-header") as n,
    ):
        c = client(n, "beta")
        c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        os.kill(svc.pid, signal.SIGKILL)  # Redis gone: no mesh, so N = 1 and the share is the limit
        c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        with pytest.raises(openai.RateLimitError) as ei:
            c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
        assert ei.value.code == "rate_limit_exceeded"
        assert _metric(n, "smg_rate_limit_redis_up") == 0.0
        assert _metric(n, "smg_rate_limit_redis_fallbacks_total") == 3.0
        assert "Redis at redis://127.0.0.1:" in n.log() and "unreachable" in n.log()
