"""End to end: the prompt's logprobs, as vLLM's OpenAI server answers them, through a real node over the
mock engine in both its dialects (one mock serves SGLang's and vLLM's gRPC services: ``sglang://`` and
``vllm://`` workers of it), with the official openai SDK and with the body lm-evaluation-harness's
``local-completions`` sends to score a text.

- ``/v1/completions`` with ``echo`` and ``logprobs``, streamed or not, ``max_tokens`` 0 (the prompt
  alone) or more: the choice's logprobs cover the prompt's tokens, then the generated ones; the first
  token's ``token_logprobs`` and ``top_logprobs`` entries are null (vLLM's
  ``_create_completion_logprobs`` over its prompt logprobs); the tokens spell the text, their offsets
  increase;
- vLLM's ``prompt_logprobs``: each completion choice's, chat's top-level one (null first, then
  ``{token id: {logprob, rank, decoded_token}}``, the prompt token first); a 400 naming the field over
  the cap, or streamed (vLLM's check_logprobs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, node_of_models
from tests.e2e.procs import MockEngineProc, start_mock_engine

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

SG, VL = "qwen3-sglang", "qwen3-vllm"
DIALECTS = [SG, VL]
CONTEXT = "The capital of France is"
CONTINUATION = " Paris, a city of lights."


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine("--zero-latency", "--output-len", "8", "--tokenizer", str(tokenizer_dir)) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    g = f"127.0.0.1:{engine.grpc_port}"
    models = [
        {
            "name": name,
            "model_path": str(tokenizer_dir),
            "worker_urls": [url],
            "chat_template": str(QWEN3_TEMPLATE),
        }
        for name, url in ((SG, f"sglang://{g}"), (VL, f"vllm://{g}"))
    ]
    with node_of_models(models) as n:
        yield n


client = responses_fixtures.client  # (the SDK on this module's node)


def prompt_ids(node: NodeProc, http: httpx.Client, model: str, text: str) -> list[int]:
    r = http.post(node.url + "/tokenize", json={"model": model, "prompt": text})
    assert r.status_code == 200, r.text
    out: list[int] = r.json()["tokens"]
    return out


def check_echo_logprobs(
    lp: dict[str, Any], prompt: str, n_prompt: int, text: str, generated: int, k: int
) -> None:
    """vLLM's shape of an echoed choice's logprobs: the prompt's tokens then the output's."""
    tokens, values, tops, offsets = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    assert len(tokens) == len(values) == len(tops) == len(offsets) == n_prompt + generated
    assert values[0] is None and tops[0] is None  # the first token has no logprob
    for v, top in zip(values[1:], tops[1:], strict=True):
        assert isinstance(v, float) and v <= 0 and math.isfinite(v)
        assert isinstance(top, dict) and 1 <= len(top) <= k + 1
        assert all(isinstance(x, float) and x <= 0 for x in top.values())
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(b > a for a, b in itertools.pairwise(offsets[:n_prompt]))
    assert "".join(tokens[:n_prompt]) == prompt
    assert "".join(tokens) == text
    if generated:
        assert offsets[n_prompt] == len(prompt)


@pytest.mark.parametrize("model", DIALECTS)
@pytest.mark.parametrize("max_tokens", [0, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_covers_the_prompt_then_the_output(
    client: openai.OpenAI, node: NodeProc, http: httpx.Client, model: str, max_tokens: int, stream: bool
) -> None:
    prompt = CONTEXT + CONTINUATION
    n_prompt = len(prompt_ids(node, http, model, prompt))
    kw: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
    }
    if not stream:
        r = client.completions.create(**kw)
        (choice,) = r.choices
        text, lp = choice.text, choice.logprobs
        assert lp is not None
        block = lp.model_dump()
        assert r.usage is not None and r.usage.prompt_tokens == n_prompt
        assert r.usage.completion_tokens == max_tokens
    else:
        text, block = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    for key, got in c.logprobs.model_dump().items():
                        block[key] += got or []
    assert text.startswith(prompt)
    check_echo_logprobs(block, prompt, n_prompt, text, max_tokens, 1)


@pytest.mark.parametrize("model", DIALECTS)
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(
    node: NodeProc, http: httpx.Client, model: str, max_tokens: int
) -> None:
    """The body lm-evaluation-harness's local-completions model sends to score a continuation."""
    body = {
        "model": model,
        "prompt": [CONTEXT + CONTINUATION],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    r = http.post(node.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    n_prompt = len(prompt_ids(node, http, model, CONTEXT + CONTINUATION))
    n_ctx = len(prompt_ids(node, http, model, CONTEXT))
    lp = choice["logprobs"]
    check_echo_logprobs(lp, CONTEXT + CONTINUATION, n_prompt, choice["text"], max_tokens, 1)
    # lm-eval's parse_logprobs: the continuation's logprobs summed, greedy when each is the top one
    cont = lp["token_logprobs"][n_ctx:n_prompt]
    assert cont and sum(cont) < 0
    tops = lp["top_logprobs"][n_ctx:n_prompt]
    assert all(max(t.values()) >= v for t, v in zip(tops, cont, strict=True))


@pytest.mark.parametrize("model", DIALECTS)
def test_echo_logprobs_for_a_list_of_prompts_and_token_ids(
    node: NodeProc, http: httpx.Client, model: str
) -> None:
    texts = ["Hello there friend", "Another, longer prompt to score here"]
    ids = [prompt_ids(node, http, model, t) for t in texts]
    for prompt in (texts, ids):
        for max_tokens in (0, 2):
            body = {"model": model, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": max_tokens}
            r = http.post(node.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            for c, text, pids in zip(choices, texts, ids, strict=True):
                check_echo_logprobs(c["logprobs"], text, len(pids), c["text"], max_tokens, 2)


@pytest.mark.parametrize("model", DIALECTS)
@pytest.mark.parametrize("max_tokens", [0, 2])
def test_prompt_logprobs_on_completions(
    client: openai.OpenAI, node: NodeProc, http: httpx.Client, model: str, max_tokens: int
) -> None:
    prompt = CONTEXT + CONTINUATION
    ids = prompt_ids(node, http, model, prompt)
    r = http.post(
        node.url + "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "echo": max_tokens == 0,
            "prompt_logprobs": 2,
        },
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    check_vllm_prompt_logprobs(choice["prompt_logprobs"], ids, 2)
    assert choice["logprobs"] is None  # (logprobs not asked)
    # the SDK reads it as vLLM's extra field
    c = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    extra = c.choices[0].model_extra or {}
    check_vllm_prompt_logprobs(extra["prompt_logprobs"], ids, 0)


def check_vllm_prompt_logprobs(plp: Any, ids: list[int], k: int) -> None:
    assert isinstance(plp, list) and len(plp) == len(ids)
    assert plp[0] is None
    for pos, tid in zip(plp[1:], ids[1:], strict=True):
        assert isinstance(pos, dict) and 1 <= len(pos) <= k + 1
        assert next(iter(pos)) == str(tid)  # the prompt token first
        for entry in pos.values():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] <= 0 and entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)


@pytest.mark.parametrize("model", DIALECTS)
def test_prompt_logprobs_on_chat(
    client: openai.OpenAI, node: NodeProc, http: httpx.Client, model: str
) -> None:
    messages: Any = [{"role": "user", "content": "Score this prompt please"}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    plp = (r.model_extra or {})["prompt_logprobs"]
    assert r.usage is not None and len(plp) == r.usage.prompt_tokens
    got = http.post(
        node.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "max_tokens": 2,
            "prompt_logprobs": 3,
            "return_token_ids": True,
        },
    ).json()
    check_vllm_prompt_logprobs(got["prompt_logprobs"], got["prompt_token_ids"], 3)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 21},
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 2, "stream": True},
            "prompt_logprobs",
        ),
    ],
)
def test_prompt_logprobs_bounds_are_a_400_naming_the_field(
    node: NodeProc, http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    r = http.post(node.url + path, json={"model": SG, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- SGLang's /generate with return_logprob (as RL rollout clients call it: input_ids in, logprobs out) ----


def _generate(node: NodeProc, http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """/generate's answer; streamed: the last event (SGLang's events carry the lists whole)."""
    if not body.get("stream"):
        r = http.post(node.url + "/generate", json=body)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out
    last: dict[str, Any] = {}
    with http.stream("POST", node.url + "/generate", json=body) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    seen = 0
    for e in events[:-1]:
        last = httpx.Response(200, content=e).json()
        got = len(last["meta_info"]["output_token_logprobs"])
        assert got >= seen and got == len(last["output_ids"])  # whole so far, as the ids are
        seen = got
    return last


@pytest.mark.parametrize("model", DIALECTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("start", [0, 3])
def test_generate_return_logprob_as_sglang(
    node: NodeProc, http: httpx.Client, model: str, stream: bool, start: int
) -> None:
    """SGLang's meta_info lists: ``[logprob, id, text]`` per position; the prompt's from
    ``logprob_start_len`` with its first entry null (SGLang pads it so, whatever the start); ``k``
    alternatives per position, best first; the values those of the completions API's echo."""
    ids = prompt_ids(node, http, model, CONTEXT + CONTINUATION)
    body = {
        "model": model,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "stream": stream,
    }
    g = _generate(node, http, body)
    meta = g["meta_info"]
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inp] == ids[start:]
    assert inp[0][0] is None and meta["input_top_logprobs"][0] is None
    assert [e[1] for e in out] == g["output_ids"] and len(out) == meta["completion_tokens"] == 3
    assert "".join(e[2] for e in out) == g["text"]
    for e, top in zip(
        inp[1:] + out, meta["input_top_logprobs"][1:] + meta["output_top_logprobs"], strict=True
    ):
        assert isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str)
        assert len(top) == 2 and top[0][0] >= top[1][0] and all(isinstance(t[2], str) for t in top)
    # the same values as the completions API's echoed logprobs of the same prompt and output
    c = http.post(
        node.url + "/v1/completions",
        json={"model": model, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0},
    )
    assert c.status_code == 200, c.text
    values = c.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [e[0] for e in inp[1:] + out] == pytest.approx(values[start + 1 :])


@pytest.mark.parametrize("model", DIALECTS)
def test_generate_return_logprob_defaults_and_bounds(node: NodeProc, http: httpx.Client, model: str) -> None:
    """``logprob_start_len`` -1 (SGLang's default): the output's logprobs alone, texts null, no
    alternatives asked: no top lists; a start at or past the prompt's end is a 400 naming it, as
    SGLang's "logprob_start_len ... is higher than the number of input tokens"."""
    body: dict[str, Any] = {"model": model, "text": CONTEXT, "return_logprob": True, "logprob_start_len": -1}
    body["sampling_params"] = {"max_new_tokens": 2}
    meta = _generate(node, http, body)["meta_info"]
    assert meta["input_token_logprobs"] == [] and "output_top_logprobs" not in meta
    assert [e[2] for e in meta["output_token_logprobs"]] == [None, None]
    n = len(prompt_ids(node, http, model, CONTEXT))
    r = http.post(node.url + "/generate", json={**body, "logprob_start_len": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


@pytest.mark.parametrize("model", DIALECTS)
@pytest.mark.parametrize("stream", [False, True])
def test_generate_max_new_tokens_0_scores_the_prompt(
    node: NodeProc, http: httpx.Client, model: str, stream: bool
) -> None:
    """``max_new_tokens`` 0 with ``return_logprob`` from position 0 (SGLang's prompt scoring): no text, no
    output ids, a length finish at 0, and the prompt's logprobs, the same as the completions API's echo."""
    ids = prompt_ids(node, http, model, CONTEXT + CONTINUATION)
    body = {
        "model": model,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "stream": stream,
    }
    g = _generate(node, http, body)
    meta = g["meta_info"]
    assert g["text"] == "" and g["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    c = http.post(
        node.url + "/v1/completions",
        json={"model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    values = c.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(values)


@pytest.mark.parametrize("model", DIALECTS)
def test_generate_takes_a_temperature_above_2(node: NodeProc, http: httpx.Client, model: str) -> None:
    """SGLang's sampling takes any temperature from 0 up: a hot one reaches the engine of either dialect."""
    body = {"model": model, "text": CONTEXT, "sampling_params": {"max_new_tokens": 3, "temperature": 3.0}}
    r = http.post(node.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3
