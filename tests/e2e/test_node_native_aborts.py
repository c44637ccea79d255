"""SGLang's ``/generate`` on a node: an engine that dies mid-generation ends the engine call as
``cancelled`` (``smg_engine_aborts_total{reason}``, the engine call span's abort reason), as the OpenAI
routes do, never as ``stop`` (a gateway-side stop's), streamed (the failure in-band) or not (a 502)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from tests.e2e import node_fixtures
from tests.e2e.node_procs import running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_node_dropin import metric, settled

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

SLOW = ("--decode-ms-per-token", "20", "--output-len", "2000")  # 400 tokens: 8 s, far beyond the kill
BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 400, "temperature": 0}}
BATCH = {"text": ["hello there", "good morning"], "sampling_params": {"max_new_tokens": 400, "n": 2}}


@pytest.fixture
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine(*SLOW) as e:
        yield e


def aborts(http: httpx.Client, url: str) -> dict[str, float | None]:
    """The node's engine aborts by reason, once its in-flight count is back to 0 (the abort is spawned)."""
    page = settled(http, url)
    return {r: metric(page, "smg_engine_aborts_total", reason=r) for r in ("stop", "cancelled", "timeout")}


def test_a_streamed_generate_whose_engine_dies_is_aborted_as_cancelled(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    with running_node(*node_fixtures.qwen3_flags(engine, tokenizer_dir)) as node:
        events = stream_while_killed(http, node.url, BODY, engine, 2)
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-2:]
        assert aborts(http, node.url) == {"stop": None, "cancelled": 1.0, "timeout": None}


@pytest.mark.parametrize(("body", "calls"), [(BODY, 1.0), (BATCH, 4.0)], ids=["one", "batch"])
def test_a_whole_generate_whose_engine_dies_is_a_502_and_aborts_every_call_as_cancelled(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client, body: dict[str, object], calls: float
) -> None:
    with running_node(*node_fixtures.qwen3_flags(engine, tokenizer_dir)) as node:
        r = generate_while_killed(http, node.url, body, engine)
        assert r.status_code == 502, r.text
        assert aborts(http, node.url) == {"stop": None, "cancelled": calls, "timeout": None}


def stream_while_killed(
    http: httpx.Client, url: str, body: Mapping[str, object], engine: MockEngineProc, after: int
) -> list[str]:
    """A streamed /generate call's events (their data), its engine killed once ``after`` came (mid-
    generation: tokens already went to the client)."""
    events: list[str] = []
    with http.stream("POST", url + "/generate", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == after:
                    engine.stop(signal.SIGKILL)
    return events


def generate_while_killed(
    http: httpx.Client, url: str, body: Mapping[str, object], engine: MockEngineProc
) -> httpx.Response:
    """A whole /generate call whose engine is killed 0.5 s in (after its first token)."""
    killer = threading.Timer(0.5, engine.stop, (signal.SIGKILL,))
    killer.start()
    try:
        return http.post(url + "/generate", json=body)
    finally:
        killer.join()


def test_a_streamed_batch_whose_engine_dies_ends_with_the_error_and_aborts_every_sample(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """SGLang's batched stream: the first failure ends the stream (the error event, then ``[DONE]``);
    each of the four samples' engine calls is closed as ``cancelled``."""
    with running_node(*node_fixtures.qwen3_flags(engine, tokenizer_dir)) as node:
        events = stream_while_killed(http, node.url, BATCH, engine, 8)
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-2:]
        assert {json.loads(e)["index"] for e in events[:-2]} == {0, 1, 2, 3}
        assert aborts(http, node.url) == {"stop": None, "cancelled": 4.0, "timeout": None}


def test_a_streamed_batch_left_by_its_client_aborts_every_sample(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    with running_node(*node_fixtures.qwen3_flags(engine, tokenizer_dir)) as node:
        with http.stream("POST", node.url + "/generate", json={**BATCH, "stream": True}) as s:
            assert s.status_code == 200
            for n, _ in enumerate(s.iter_lines()):
                if n >= 8:
                    break  # the client goes: the response closed mid-stream
        page = settled(http, node.url)
        assert metric(page, "smg_engine_aborts_total", reason="client_disconnect") == 4.0
        stats = f"http://127.0.0.1:{engine.http_port}/mock/stats"
        deadline = time.monotonic() + 10
        while http.get(stats).json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get(stats).json()["active"] == 0  # no engine request left running
