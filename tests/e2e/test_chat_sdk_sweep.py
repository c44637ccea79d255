"""End to end: chat completions swept with the official openai SDK as a demanding client would use them
(vLLM's serving_chat the reference for its extra fields), over a real mock engine and a real node on
loopback (ports in 45000-45999; both processes stopped by pid).

The node serves ``qwen3`` with Qwen3's template, the ``qwen3`` reasoning parser and the ``hermes`` tool
parser; the mock answers scripted text (``/mock/responses``, matched on a marker in the prompt), so
reasoning and tool calls come in the model's own format.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.e2e import node_fixtures
from tests.e2e.node_procs import NodeProc, reserved_port, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

_rng = random.Random()

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    }
]
THOUGHT = "<think>\nsecret plan 😀\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


def _port(taken: set[int]) -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    taken: set[int] = set()
    grpc, web = _port(taken), _port(taken)
    with start_mock_engine(
        *("--grpc-port", str(grpc), "--http-port", str(web), "--zero-latency", "--output-len", "16"),
        *("--stream-interval", "1", "--tokenizer", str(tokenizer_dir), "--context-length", "65536"),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    flags = node_fixtures.qwen3_flags(engine, tokenizer_dir)
    parsers = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes")
    with running_node(*flags, *parsers, port=_port({engine.grpc_port, engine.http_port})) as n:
        yield n


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def script(http: httpx.Client, engine: MockEngineProc, text: str, times: int = 1) -> list[Any]:
    """The messages of a request the mock answers with ``text`` (``times`` times)."""
    marker = f"case-{uuid.uuid4().hex[:12]}"
    r = http.post(
        f"http://127.0.0.1:{engine.http_port}/mock/responses",
        json={"text": text, "match": marker, "times": times},
    )
    assert r.status_code < 300, r.text
    return [{"role": "user", "content": f"{marker} go"}]


def extra(obj: Any) -> dict[str, Any]:
    return obj.model_extra or {}


# ---- include_reasoning (vLLM's request field) -----------------------------------------------------------


def test_include_reasoning_false_drops_the_reasoning(
    client: openai.OpenAI, http: httpx.Client, engine: MockEngineProc
) -> None:
    r = client.chat.completions.create(
        model="qwen3",
        messages=script(http, engine, THOUGHT + "Answer."),
        extra_body={"include_reasoning": False},
    )
    msg = r.choices[0].message
    assert msg.content == "Answer."
    assert extra(msg).get("reasoning_content") is None and extra(msg).get("reasoning") is None
    # the default still answers it
    r = client.chat.completions.create(model="qwen3", messages=script(http, engine, THOUGHT + "Answer."))
    assert extra(r.choices[0].message)["reasoning_content"] == "secret plan 😀\n"


def test_include_reasoning_false_streamed_with_calls_and_logprobs(
    client: openai.OpenAI, http: httpx.Client, engine: MockEngineProc
) -> None:
    stream = client.chat.completions.create(
        model="qwen3",
        messages=script(http, engine, THOUGHT + "Let me see. " + CALL),
        tools=TOOLS,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"include_reasoning": False},
    )
    content, args, lp_tokens, finish, usage = "", "", 0, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            d = c.delta
            assert "reasoning_content" not in extra(d) and "reasoning" not in extra(d), d
            content += d.content or ""
            for tc in d.tool_calls or []:
                args += tc.function.arguments or "" if tc.function else ""
            lp_tokens += len(c.logprobs.content or []) if c.logprobs else 0
            finish = c.finish_reason or finish
    assert content == "Let me see. " and json.loads(args) == {"tz": "UTC"} and finish == "tool_calls"
    # the dropped reasoning's tokens keep their logprobs (on empty content deltas): one per token
    assert usage is not None and lp_tokens == usage.completion_tokens


def test_include_reasoning_must_be_a_boolean(http: httpx.Client, node: NodeProc) -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "x"}], "include_reasoning": "no"}
    r = http.post(node.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"


# ---- history content parts --------------------------------------------------------------------------------


def test_assistant_refusal_and_output_text_parts_in_the_history(
    client: openai.OpenAI, http: httpx.Client, node: NodeProc
) -> None:
    history: list[Any] = [
        {"role": "user", "content": "Do the bad thing."},
        {
            "role": "assistant",
            "content": [
                {"type": "refusal", "refusal": "I cannot."},
                {"type": "output_text", "text": "Sorry."},
            ],
        },
        {"role": "user", "content": "Fine."},
    ]
    r = client.chat.completions.create(model="qwen3", messages=history, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    ids = http.post(node.url + "/tokenize", json={"model": "qwen3", "messages": history}).json()["tokens"]
    prompt = http.post(node.url + "/detokenize", json={"model": "qwen3", "tokens": ids}).json()["prompt"]
    assert "I cannot.\nSorry." in prompt
    with pytest.raises(openai.BadRequestError) as e:  # a refusal part without its text
        no_text: Any = [{"role": "assistant", "content": [{"type": "refusal"}]}]
        client.chat.completions.create(model="qwen3", messages=no_text, max_tokens=2)
    assert e.value.body["param"] == "messages.0.content"  # type: ignore[index]
    bad_type: Any = [{"role": "user", "content": [{"type": ["text"]}]}]  # unhashable: a 400, not a 500
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="qwen3", messages=bad_type, max_tokens=2)


# ---- fields OpenAI types ----------------------------------------------------------------------------------


def test_user_must_be_a_string(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    number: Any = 5
    obj: Any = {"id": 1}
    assert client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=2, user="u-1").choices
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=2, user=number)
    assert e.value.code == "invalid_type" and e.value.param == "user"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen3", prompt="x", max_tokens=2, user=obj)
    assert e.value.param == "user"


def test_audio_output_is_refused_not_answered_as_text(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="qwen3", messages=msgs, max_tokens=2, modalities=["text", "audio"]
        )
    assert e.value.param == "modalities" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="qwen3", messages=msgs, max_tokens=2, audio={"voice": "alloy", "format": "wav"}
        )
    assert e.value.param == "audio"
    assert client.chat.completions.create(
        model="qwen3", messages=msgs, max_tokens=2, modalities=["text"]
    ).choices


# ---- the sweep's checks that held (kept as regressions) ----------------------------------------------


class Weather(BaseModel):
    city: str
    temp: int


def test_parse_and_stream_helpers_with_reasoning(
    client: openai.OpenAI, http: httpx.Client, engine: MockEngineProc
) -> None:
    answer = THOUGHT + '{"city": "Oslo", "temp": -3}'
    r = client.beta.chat.completions.parse(
        model="qwen3", messages=script(http, engine, answer), response_format=Weather
    )
    assert r.choices[0].message.parsed == Weather(city="Oslo", temp=-3)
    with client.beta.chat.completions.stream(
        model="qwen3", messages=script(http, engine, answer, times=2), response_format=Weather, n=2
    ) as s:
        done = s.get_final_completion()
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.message.parsed == Weather(city="Oslo", temp=-3) for c in done.choices)
    assert all(extra(c.message)["reasoning_content"] == "secret plan 😀\n" for c in done.choices)


def test_streamed_tool_call_deltas_and_usage_chunk(
    client: openai.OpenAI, http: httpx.Client, engine: MockEngineProc
) -> None:
    stream = client.chat.completions.create(
        model="qwen3",
        messages=script(http, engine, CALL + "\n" + CALL.replace("UTC", "CET")),
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls: dict[int, list[str]] = {}
    for ch in chunks[:-1]:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.function is not None
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name == "get_time"
                    calls[tc.index] = [tc.function.arguments or ""]
                else:
                    assert tc.id is None and tc.type is None and tc.function.name is None
                    calls[tc.index].append(tc.function.arguments or "")
    assert [json.loads("".join(calls[i])) for i in sorted(calls)] == [{"tz": "UTC"}, {"tz": "CET"}]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0


def test_error_envelopes_and_exception_classes(
    client: openai.OpenAI, http: httpx.Client, node: NodeProc
) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    bad: list[tuple[dict[str, Any], type[openai.APIStatusError], str | None]] = [
        ({"model": "nope"}, openai.NotFoundError, "model"),
        ({"logprobs": True, "top_logprobs": 21}, openai.BadRequestError, "top_logprobs"),
        ({"frequency_penalty": 2.5}, openai.BadRequestError, "frequency_penalty"),
        ({"logit_bias": {"99999999": 1}}, openai.BadRequestError, "logit_bias"),
        ({"n": 1000}, openai.BadRequestError, "n"),
        ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice"),
    ]
    for kw, exc, param in bad:
        body = {"model": "qwen3", "messages": msgs, "max_tokens": 2, **kw}
        with pytest.raises(exc) as e:
            client.chat.completions.create(**body)
        assert e.value.param == param, kw
        r = http.post(node.url + "/v1/chat/completions", json=body)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    image: Any = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen3", messages=image, max_tokens=2)
    assert e.value.code == "unsupported_content"


# ---- stream_options.continuous_usage_stats (vLLM's) ---------------------------------------------------


def test_continuous_usage_counts_each_chunk_as_of_its_own_token(
    client: openai.OpenAI, http: httpx.Client, engine: MockEngineProc
) -> None:
    # zero latency: every token of both choices reaches the node in one batch of engine events; each
    # chunk still says how many tokens its choice had generated by then (one token a chunk here: a
    # byte-level tokenizer, ASCII text), as vLLM's per-step chunks do
    continuous: Any = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(
        model="qwen3",
        messages=script(http, engine, "abcdef", times=2),
        n=2,
        stream=True,
        stream_options=continuous,
    )
    seen: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            assert chunk.usage is not None
            if c.delta.content:
                seen[c.index].append((c.delta.content, chunk.usage.completion_tokens))
            if c.finish_reason:
                seen[c.index].append(("<end>", chunk.usage.completion_tokens))
    expected = [(ch, k) for k, ch in enumerate("abcdef", 1)] + [("<end>", 7)]  # (the EOS: 7 tokens)
    assert seen == {0: expected, 1: expected}
