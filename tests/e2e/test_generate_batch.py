"""End to end: SGLang's batched ``/generate`` through a real node over the mock engine in both dialects.

A list of prompts (``text`` a list of strings, ``input_ids`` a list of id lists) or ``sampling_params.n``
above 1 is answered as SGLang's ``TokenizerManager._handle_batch_request`` answers it: a list, prompt
by prompt and each prompt's samples in turn; streamed, each event is one sample's (its text and ids so
far) with its place in that list (``index``), then ``[DONE]``. ``sampling_params`` and the logprob
fields may hold one value per prompt; ``rid`` is a list of the batch's length or one id, suffixed
``_i`` per prompt; each of ``n`` samples gets an id of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import node_fixtures, test_prompt_logprobs
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

PROMPTS = ["The capital of France is", "Once upon a time", "Hello"]


# the logprob tests' engine and node: one mock in both dialects (``sglang://`` and ``vllm://`` workers of it)
engine, node = test_prompt_logprobs.engine, test_prompt_logprobs.node
SG, VL = test_prompt_logprobs.SG, test_prompt_logprobs.VL
DIALECTS = [SG, VL]


def generate(node: NodeProc, http: httpx.Client, body: dict[str, Any]) -> Any:
    r = http.post(node.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(node: NodeProc, http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", node.url + "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(e) for e in data[:-1]]


@pytest.mark.parametrize("model", DIALECTS)
def test_a_batch_of_texts_answers_each_prompt_as_its_own_call(
    node: NodeProc, http: httpx.Client, model: str
) -> None:
    sp = {"max_new_tokens": 5, "temperature": 0}
    got = generate(
        node, http, {"model": model, "text": PROMPTS, "sampling_params": sp, "rid": ["a", "b", "c"]}
    )
    assert isinstance(got, list) and len(got) == len(PROMPTS)
    for one, prompt, rid in zip(got, PROMPTS, "abc", strict=True):
        alone = generate(node, http, {"model": model, "text": prompt, "sampling_params": sp})
        assert (one["text"], one["output_ids"]) == (alone["text"], alone["output_ids"])
        assert one["meta_info"]["prompt_tokens"] == alone["meta_info"]["prompt_tokens"]
        assert one["meta_info"]["id"] == rid and one["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize("model", DIALECTS)
def test_a_batch_of_ids_takes_sampling_params_and_logprobs_per_prompt(
    node: NodeProc, http: httpx.Client, model: str
) -> None:
    ids = [[10, 11, 12, 13, 14], [20, 21], [30]]
    body = {
        "model": model,
        "input_ids": ids,
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 4}, {"max_new_tokens": 1}],
        "return_logprob": [True, False, True],
        "rid": "job",
    }
    got = generate(node, http, body)
    assert [g["meta_info"]["completion_tokens"] for g in got] == [2, 4, 1]
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [5, 2, 1]
    assert [g["meta_info"]["id"] for g in got] == ["job_0", "job_1", "job_2"]
    assert [len(g["meta_info"].get("output_token_logprobs", ())) for g in got] == [2, 0, 1]


@pytest.mark.parametrize("model", DIALECTS)
def test_n_samples_come_prompt_by_prompt_each_with_an_id_of_its_own(
    node: NodeProc, http: httpx.Client, model: str
) -> None:
    got = generate(
        node, http, {"model": model, "text": "Hello", "sampling_params": {"max_new_tokens": 3, "n": 3}}
    )
    assert isinstance(got, list) and len(got) == 3
    assert len({g["meta_info"]["id"] for g in got}) == 3
    assert all(g["meta_info"]["completion_tokens"] == 3 for g in got)
    body = {"model": model, "text": PROMPTS[:2], "sampling_params": {"max_new_tokens": 2, "n": 2}}
    got = generate(node, http, body)
    lengths = [len(test_prompt_logprobs.prompt_ids(node, http, model, p)) for p in PROMPTS[:2]]
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [lengths[0]] * 2 + [lengths[1]] * 2


@pytest.mark.parametrize("model", DIALECTS)
def test_a_streamed_batch_interleaves_indexed_events_that_end_as_the_whole_answers(
    node: NodeProc, http: httpx.Client, model: str
) -> None:
    body = {
        "model": model,
        "text": PROMPTS,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2},
    }
    whole = generate(node, http, body)
    events = stream_events(node, http, body)
    last: dict[int, dict[str, Any]] = {}
    for e in events:
        i = e["index"]
        if i in last:  # each sample's events grow its text and ids (SGLang's non-incremental stream)
            assert e["output_ids"][: len(last[i]["output_ids"])] == last[i]["output_ids"]
            assert last[i]["meta_info"]["finish_reason"] is None
        last[i] = e
    assert sorted(last) == list(range(2 * len(PROMPTS)))
    for i, w in enumerate(whole):
        assert (last[i]["text"], last[i]["output_ids"]) == (w["text"], w["output_ids"])
        assert last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": PROMPTS, "rid": ["a", "b"]}, "rid"),
        ({"text": PROMPTS, "rid": 7}, "rid"),
        ({"text": PROMPTS, "sampling_params": [{}, {}]}, "sampling_params"),
        ({"text": PROMPTS, "return_logprob": [True]}, "return_logprob"),
        ({"text": PROMPTS[:2], "sampling_params": [{"n": 2}, {"n": 1}]}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"n": True}}, "sampling_params.n"),
        ({"text": []}, "text"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"input_ids": [[1], [10**9]]}, "input_ids"),
        ({"text": ["a", 3]}, "text"),
        ({"text": ["x"] * 600, "sampling_params": {"n": 2}}, "text"),
        ({"text": "x", "sampling_params": {"n": 1025}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"n": [2]}}, "sampling_params.n"),
        ({"input_ids": [[[4, 5], [6]]]}, "input_ids"),
        ({"input_ids": [[1, 2], [[3]]]}, "input_ids"),
        ({"text": ["x"], "sampling_params": [{"n": {"a": 1}}]}, "sampling_params.n"),
    ],
)
def test_a_bad_batch_is_a_400_naming_the_field_and_sends_nothing(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    before = engine_requests(engine, http)
    r = http.post(node.url + "/generate", json={"model": SG, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert engine_requests(engine, http) == before


def engine_requests(engine: MockEngineProc, http: httpx.Client) -> int:
    r = http.get(f"http://127.0.0.1:{engine.http_port}/mock/stats")
    assert r.status_code == 200, r.text
    out: int = r.json()["requests_received"]
    return out


def test_seeded_samples_differ_as_vllm_seeds_them(node: NodeProc, http: httpx.Client) -> None:
    """vLLM seeds a request's ``n`` children ``seed + i`` (``ParentRequest``): each sample here is its own
    engine call, given the same; seeded samples were all alike."""
    sp = {"max_new_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    got = generate(node, http, {"model": VL, "text": "Once upon a time", "sampling_params": sp})
    assert len({tuple(g["output_ids"]) for g in got}) == 3
    again = generate(node, http, {"model": VL, "text": "Once upon a time", "sampling_params": sp})
    assert [g["output_ids"] for g in again] == [g["output_ids"] for g in got]  # (seeded: reproducible)


def test_an_empty_stop_string_is_taken_as_sglang_takes_it(node: NodeProc, http: httpx.Client) -> None:
    """(The OpenAI routes refuse it, as vLLM; SGLang's /generate takes it.)"""
    sp = {"max_new_tokens": 3, "stop": ["", "zzz"]}
    assert generate(node, http, {"model": SG, "text": "Hello", "sampling_params": sp})["meta_info"]


def test_a_streamed_batch_sends_each_samples_events_as_they_come(
    tokenizer_dir: Path, http: httpx.Client
) -> None:
    """An engine running one request at a time: the first sample's events go out while it runs, not once
    every sample has started (the node opened the samples one after another, each waiting for its first
    token, and sent nothing meanwhile: a batch beyond what the engine runs at once was silent, its
    events piling up)."""
    with (
        start_mock_engine(
            "--max-running", "1", "--decode-ms-per-token", "10", "--tokenizer", str(tokenizer_dir)
        ) as e,
        running_node(*node_fixtures.qwen3_flags(e, tokenizer_dir)) as node,
    ):
        stats = f"http://127.0.0.1:{e.http_port}/mock/stats"
        body = {
            "text": "Hello",
            "stream": True,
            "sampling_params": {"max_new_tokens": 200, "n": 3, "ignore_eos": True},
        }
        with http.stream("POST", node.url + "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first = json.loads(line[6:])
                    break
            assert first["index"] == 0 and first["meta_info"]["finish_reason"] is None
            assert http.get(stats).json()["completed"] == 0  # the first sample still runs
