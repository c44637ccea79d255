"""An engine that hangs (its process SIGSTOPped) with requests in flight on the node's lean HTTP/2 client:
once its health checks judge the worker unhealthy, the node pings the engine's connection, and with no
answer fails the calls on it, seconds after the hang rather than when the connection's keepalive gives
up (60 s of silence, then 20 s for the ACK). A streamed answer under way ends with an SSE error event;
a whole (non-streamed) answer, nothing of it sent yet, is run again on the other worker."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.node_procs import NodeProc, start_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

# vLLM's service: its HealthCheck takes the configured timeout (SGLang's waits at least 2.5 s)
SLOW = ("--engine", "vllm", "--decode-ms-per-token", "50", "--output-len", "2000")
HEALTH = (
    *("--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "0.5"),
    *("--health-failure-threshold", "2"),
)
# the hung call must fail this soon after the hang (the probe: ~2 s; room for a loaded machine); without it
# the keepalive fails it after 60-80 s, and the client's read times out first
WITHIN = 40.0
MSGS: list[Any] = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def cluster() -> Iterator[tuple[NodeProc, list[MockEngineProc]]]:
    """A node over two slow mock engines, round robin; every engine resumed (SIGCONT) before anything is
    stopped, so that a test failing with one stopped still tears down at once."""
    with start_mock_engine(*SLOW) as a, start_mock_engine(*SLOW) as b:
        node = start_node(
            *("--worker-urls", f"grpc://{a.grpc_target}", f"grpc://{b.grpc_target}"),
            *("--model-id", "qwen3", "--policy", "round_robin", *HEALTH),
        )
        try:
            yield node, [a, b]
        finally:
            for e in (a, b):
                if e.alive():
                    os.kill(e.pid, signal.SIGCONT)
            node.stop()


def active(engine: MockEngineProc) -> int:
    n: int = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()["active"]
    return n


def hang_the_serving_engine(engines: list[MockEngineProc]) -> MockEngineProc:
    """SIGSTOP the engine a request runs on, as soon as it has it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for e in engines:
            if active(e):
                os.kill(e.pid, signal.SIGSTOP)
                return e
        time.sleep(0.01)
    raise AssertionError("no engine took the request")


def test_a_stream_on_an_engine_that_hangs_ends_with_an_error_event(
    cluster: tuple[NodeProc, list[MockEngineProc]],
) -> None:
    node, engines = cluster
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 400, "stream": True}  # 20 s of tokens
    after: list[str] = []
    with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=WITHIN) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for ln in lines:  # bounded: until the first token (the read timeout ends a stall)
            if '"content"' in ln:
                break
        hung = hang_the_serving_engine(engines)
        t0 = time.monotonic()
        for ln in lines:  # bounded: the stream ends, or the read times out
            if ln.startswith("data: "):
                after.append(ln)
            assert time.monotonic() - t0 < WITHIN, "the stream did not end after its engine hung"
    elapsed = time.monotonic() - t0
    assert elapsed < WITHIN
    assert after and after[-1] == "data: [DONE]", after[-3:]
    err = json.loads(after[-2][6:])
    assert "error" in err, after[-3:]
    assert len(after) < 300  # it ended early: not the whole answer
    assert f"{hung.grpc_port}" not in err["error"]["message"]  # (the worker named by id, not its address)
    assert "did not answer a ping" in node.log()


def test_a_whole_answer_whose_engine_hangs_is_retried_on_the_other(
    cluster: tuple[NodeProc, list[MockEngineProc]],
) -> None:
    node, engines = cluster
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 20}  # 1 s of tokens
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            result["r"] = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=WITHIN + 5)
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=ask)
    t.start()
    try:
        hung = hang_the_serving_engine(engines)
        t0 = time.monotonic()
    finally:
        t.join()
    elapsed = time.monotonic() - t0
    assert "error" not in result, result
    r = result["r"]
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 20
    assert elapsed < WITHIN
    (other,) = [e for e in engines if e is not hung]
    assert httpx.get(other.http_url + "/mock/stats", timeout=5).json()["completed"] >= 1  # the retry
    assert "did not answer a ping" in node.log()
