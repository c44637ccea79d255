"""End to end: ``/v1/completions`` with a list of prompts, as vLLM serves it: every prompt's engine call
at once (the engine batches them), streamed or not; nothing left running when the client goes; and
``continuous_usage_stats`` counted per prompt and per choice."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

PROMPTS = ["Hello", "Bye there my friend", "Foo", "Bar baz"]


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "2", "--output-len", "24") as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc) -> Iterator[NodeProc]:
    with running_node("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3") as n:
        yield n


@pytest.fixture()
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_faults(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": None, "stall_seconds": 0.0})


def _stats(engine: MockEngineProc, http: httpx.Client) -> dict[str, Any]:
    out: dict[str, Any] = http.get(f"{engine.http_url}/mock/stats").json()
    return out


def _most_active(engine: MockEngineProc, http: httpx.Client, want: int) -> int:
    """The most engine requests seen running at once while polling (bounded: ~3 s)."""
    most = 0
    for _ in range(300):
        most = max(most, _stats(engine, http)["active"])
        if most >= want:
            break
        time.sleep(0.01)
    return most


def _settled(engine: MockEngineProc, http: httpx.Client) -> int:
    for _ in range(300):  # bounded: the aborts land within a few loop turns
        active: int = _stats(engine, http)["active"]
        if active == 0:
            return 0
        time.sleep(0.02)
    return active


@pytest.mark.parametrize("stream", [False, True])
def test_every_prompt_of_a_list_runs_at_once(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, stream: bool
) -> None:
    sdk = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 1.5})
    box: list[list[tuple[int, str]]] = []

    def ask() -> None:
        if stream:
            texts: dict[int, str] = {}
            for ch in sdk.completions.create(model="qwen3", prompt=PROMPTS, max_tokens=4, stream=True):
                for c in ch.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            box.append(sorted(texts.items()))
        else:
            r = sdk.completions.create(model="qwen3", prompt=PROMPTS, max_tokens=4)
            box.append([(c.index, c.text) for c in r.choices])

    t = threading.Thread(target=ask)
    t.start()
    try:
        assert _most_active(engine, http, len(PROMPTS)) == len(PROMPTS)  # one prompt at a time: 1
    finally:
        t.join(timeout=30)
    assert box and [i for i, _ in box[0]] == [0, 1, 2, 3] and all(text for _, text in box[0])
    assert _settled(engine, http) == 0


def test_a_client_gone_mid_list_leaves_no_engine_call(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 5.0})
    body = {"model": "qwen3", "prompt": PROMPTS, "max_tokens": 8, "stream": True}
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (held: a dropped generator would close the response at once)
        for line in lines:
            if line.startswith("data: {"):
                break  # the first prompt's first token: every prompt's call is open; then the client goes
        assert _most_active(engine, http, len(PROMPTS)) == len(PROMPTS)
        assert next(lines) == ""
    assert _settled(engine, http) == 0


def test_continuous_usage_is_per_prompt_and_choice(node: NodeProc, http: httpx.Client) -> None:
    """vLLM's completion_stream_generator: a chunk's prompt_tokens are its prompt's, its completion_tokens
    its choice's (not running totals over the response)."""
    prompts = PROMPTS[:2]
    lens = [
        http.post(node.url + "/tokenize", json={"model": "qwen3", "prompt": p}).json()["count"]
        for p in prompts
    ]
    assert lens[0] != lens[1]
    body = {
        "model": "qwen3",
        "prompt": prompts,
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events: list[Any] = [json.loads(x) for x in lines[:-1]] + ["[DONE]"]
    tokens: dict[int, int] = {}
    for ev in events[:-2]:  # (the last JSON event is the whole response's usage)
        (c,) = ev["choices"]
        u = ev["usage"]
        assert u["prompt_tokens"] == lens[c["index"] // 2], (c, u)
        assert u["completion_tokens"] >= tokens.get(c["index"], 0) and u["completion_tokens"] <= 3, (c, u)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        tokens[c["index"]] = u["completion_tokens"]
    assert tokens == {0: 3, 1: 3, 2: 3, 3: 3}
    final = events[-2]["usage"]
    assert final["prompt_tokens"] == sum(lens) and final["completion_tokens"] == 12


def test_a_long_streamed_list_opens_a_bounded_window_ahead(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Streamed, the prompts' answers are relayed one after another: the engine calls opened ahead of
    the one relayed are bounded (their answers wait in memory), 1 + PROMPTS_AHEAD at most."""
    from shepherd.node.api.generation import PROMPTS_AHEAD

    prompts = [f"p{i}" for i in range(PROMPTS_AHEAD + 4)]
    http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": 1, "stall_seconds": 1.0})
    body = {"model": "qwen3", "prompt": prompts, "max_tokens": 2, "stream": True}
    most = 0
    with http.stream("POST", node.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        most = _most_active(engine, http, len(prompts))
        rest = [line for line in lines if line.startswith("data: ")]
    assert most == 1 + PROMPTS_AHEAD
    assert rest[-1] == "data: [DONE]" and len([x for x in rest if '"finish_reason":"length"' in x]) == len(
        prompts
    )
    assert _settled(engine, http) == 0
