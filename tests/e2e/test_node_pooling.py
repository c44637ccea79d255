"""End to end: the pooling routes (rerank, score, classify) relayed by a node to an HTTP worker (the mock
engine's HTTP surface, in vLLM's shapes): each route answers what the worker answers; the node's own
checks (empty lists, unknown model, a model with gRPC workers only), auth and metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

ADMIN_KEY = "sk-smg-e2e-pool-admin-" + os.urandom(16).hex()
ENV = "SMG_E2E_POOL_ADMIN_KEY"

RERANK = {"model": "qwen3", "query": "what is a sheep?", "documents": ["a dog", {"text": "a sheep"}, "wool"]}
SCORE = {"model": "qwen3", "text_1": "what is a sheep?", "text_2": ["a dog", "a sheep"]}
CLASSIFY = {"model": "qwen3", "input": ["good", "bad", "fine"]}


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--zero-latency") as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc) -> Iterator[NodeProc]:
    with running_node(
        "--worker-urls", engine.http_url, "--model-id", "qwen3", "--tokenizer-workers", "0"
    ) as n:
        yield n


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=30)


def direct(engine: MockEngineProc, path: str, body: Any) -> dict[str, Any]:
    r = post(engine.http_url + path, body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def pooled_calls(engine: MockEngineProc) -> int:
    """The pooling requests the engine received."""
    calls = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()["rpc_calls"]
    return sum(int(calls.get(k, 0)) for k in ("http.rerank", "http.score", "http.classify"))


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The node's answer is the worker's (ids and timestamps aside)."""
    assert set(got) == set(want)
    for k in set(want) - {"id", "created"}:
        assert got[k] == want[k], k


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank(node: NodeProc, engine: MockEngineProc, path: str) -> None:
    r = post(node.url + path, {**RERANK, "top_n": 2})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["id"].startswith("rerank-") and got["usage"]["total_tokens"] > 0
    results = got["results"]
    assert len(results) == 2
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    texts = ["a dog", "a sheep", "wool"]
    assert all(x["document"]["text"] == texts[x["index"]] for x in results)
    same_answer(got, direct(engine, "/v1/rerank", {**RERANK, "top_n": 2}))
    bare = post(node.url + path, {**RERANK, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and all("document" not in x for x in bare["results"])


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score(node: NodeProc, engine: MockEngineProc, path: str) -> None:
    r = post(node.url + path, SCORE)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "list" and got["model"] == "qwen3"
    assert [(d["index"], d["object"]) for d in got["data"]] == [(0, "score"), (1, "score")]
    assert all(0.0 <= d["score"] < 1.0 for d in got["data"])
    assert got["usage"]["prompt_tokens"] > 0
    same_answer(got, direct(engine, "/v1/score", SCORE))
    newer = {"model": "qwen3", "queries": SCORE["text_1"], "documents": SCORE["text_2"]}
    assert post(node.url + path, newer).json()["data"] == got["data"]


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify(node: NodeProc, engine: MockEngineProc, path: str) -> None:
    r = post(node.url + path, CLASSIFY)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "list" and len(got["data"]) == 3
    for i, d in enumerate(got["data"]):
        assert d["index"] == i and d["num_classes"] == 2 and len(d["probs"]) == 2
        assert d["label"] in ("negative", "positive")
    same_answer(got, direct(engine, "/classify", CLASSIFY))


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/rerank", {**RERANK, "documents": []}, 400, "documents"),
        ("/v1/rerank", {**RERANK, "documents": ["x"] * 1025}, 400, "documents"),
        ("/v1/rerank", {**RERANK, "documents": [{"txt": "x"}]}, 400, "documents"),
        ("/v1/rerank", {**RERANK, "query": None}, 400, "query"),
        ("/v1/rerank", {**RERANK, "top_n": -1}, 400, "top_n"),
        ("/v1/rerank", {**RERANK, "model": "nope"}, 404, "model"),
        ("/v1/score", {**SCORE, "text_2": []}, 400, "text_2"),
        ("/v1/score", {"model": "qwen3", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1"),
        ("/v1/score", {"model": "qwen3", "text_1": "a"}, 400, "text_2"),
        ("/classify", {"model": "qwen3", "input": []}, 400, "input"),
        ("/classify", {"model": "qwen3", "input": ""}, 400, "input"),
        ("/classify", {"model": "qwen3", "input": [1, "a"]}, 400, "input"),
        ("/classify", {"input": "a"}, 400, "model"),
    ],
)
def test_refused_before_the_worker(
    node: NodeProc, engine: MockEngineProc, path: str, body: Any, status: int, param: str
) -> None:
    before = pooled_calls(engine)
    r = post(node.url + path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert pooled_calls(engine) == before  # nothing relayed


def test_content_type_and_metrics(node: NodeProc) -> None:
    r = httpx.post(node.url + "/v1/rerank", content=b"{}", headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415
    assert post(node.url + "/v1/rerank", RERANK).status_code == 200
    metrics = httpx.get(node.url + "/metrics", timeout=5).text
    rows = [ln for ln in metrics.splitlines() if ln.startswith("smg_requests_total{")]
    assert any('route="/v1/rerank"' in ln and 'model="qwen3"' in ln and 'status="200"' in ln for ln in rows)


def test_grpc_only_model_and_auth(engine: MockEngineProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, ADMIN_KEY)
    flags = (
        "--worker-urls",
        f"grpc://{engine.grpc_target}",
        "--model-id",
        "qwen3",
        "--tokenizer-workers",
        "0",
    )
    with running_node(*flags, "--auth-mode", "api_key", "--auth-admin-key-env", ENV) as grpc_node:
        assert post(grpc_node.url + "/v1/rerank", RERANK).status_code == 401
        before = pooled_calls(engine)
        key = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for path, body in (("/v1/rerank", RERANK), ("/score", SCORE), ("/classify", CLASSIFY)):
            r = post(grpc_node.url + path, body, key)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "need an HTTP worker" in err["message"] and err["code"] == "unsupported_endpoint"
            assert "grpc://" not in err["message"]
        assert pooled_calls(engine) == before
