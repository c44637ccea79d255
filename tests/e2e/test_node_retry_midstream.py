"""A non-streamed answer whose engine dies mid-generation: nothing reached the client yet, so the node
runs it again on another worker (with ``stop`` strings too, whose engine call streams so that a
gateway-side stop can end it early), the failed engine call aborted as ``cancelled``, one retry counted
and the usage (body and ``smg_tokens_total``) that of the answer the client gets only."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import node_fixtures
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_node_dropin import metric, settled

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

SLOW = ("--decode-ms-per-token", "20", "--output-len", "2000")  # 40 tokens: 0.8 s
MAX_TOKENS = 40
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def cluster(tokenizer_dir: Path) -> Iterator[tuple[NodeProc, list[MockEngineProc]]]:
    with start_mock_engine(*SLOW) as e1, start_mock_engine(*SLOW) as e2:
        flags = node_fixtures.qwen3_flags(e1, tokenizer_dir)
        urls = ("--worker-urls", f"grpc://{e1.grpc_target}", f"grpc://{e2.grpc_target}")
        with running_node(*urls, *flags[2:]) as node:
            yield node, [e1, e2]


def kill_the_serving_engine(engines: list[MockEngineProc], after: float) -> None:
    """SIGKILL the engine a request runs on, ``after`` seconds into its generation."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for e in engines:
            if httpx.get(e.http_url + "/mock/stats", timeout=5).json()["active"]:
                time.sleep(after)
                e.stop(signal.SIGKILL)
                return
        time.sleep(0.02)
    raise AssertionError("no engine took the request")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stop", [None, ["zzzz"]])
def test_a_whole_answer_whose_engine_dies_is_retried_on_another_worker(
    cluster: tuple[NodeProc, list[MockEngineProc]], http: httpx.Client, stop: list[str] | None, n: int
) -> None:
    node, engines = cluster
    body: dict[str, Any] = {"model": "qwen3", "messages": MSGS, "max_tokens": MAX_TOKENS, "n": n}
    if stop is not None:
        body["stop"] = stop
    killer = threading.Thread(target=kill_the_serving_engine, args=(engines, 0.3))
    killer.start()
    try:
        r = http.post(node.url + "/v1/chat/completions", json=body)
    finally:
        killer.join()
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["finish_reason"] for c in got["choices"]] == ["length"] * n
    assert got["usage"]["completion_tokens"] == MAX_TOKENS * n  # the answer's, not the failed call's too
    page = settled(http, node.url)
    assert metric(page, "smg_engine_retries_total") == 1.0
    assert metric(page, "smg_tokens_total", kind="completion") == MAX_TOKENS * n
    assert metric(page, "smg_engine_aborts_total", reason="stop") is None
    assert sum(e.alive() for e in engines) == 1
