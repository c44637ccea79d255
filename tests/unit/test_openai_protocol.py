"""Request validation: every bad input is a 4xx ApiError in the OpenAI envelope, never an exception."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.http.body import DENSE_FROM, parse_json_body
from shepherd.node.openai.requests import parse_chat, parse_completion
from shepherd.proto.openai_errors import ApiError

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **kw}


def test_defaults_are_semantic() -> None:
    r = parse_chat(chat())
    s = r.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.n) == (
        1.0,
        1.0,
        -1,
        0.0,
        1.0,
        1,
    )
    assert s.max_tokens is None and not s.stream and not s.include_usage


def test_max_completion_tokens_alias() -> None:
    assert parse_chat(chat(max_completion_tokens=7)).sampling.max_tokens == 7


def test_content_parts_flattened() -> None:
    r = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        }
    )
    assert r.messages[0]["content"] == "a\nb"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(max_tokens=0), "max_tokens"),
        (chat(n=0), "n"),
        (chat(temperature=3), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(stop=[1, 2]), "stop"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(top_logprobs=3), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=50), "top_logprobs"),
        (chat(logit_bias={"x": 1}), "logit_bias"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages.0.content"),
        ({"model": 7, "messages": MSG}, "model"),  # absent is fine: the gateway serves its one model
        (chat(tools=[{"type": "function"}]), "tools.0"),
        # a tool answer names the call it answers (OpenAI: missing_required_parameter)
        (chat(messages=[*MSG, {"role": "tool", "content": "42"}]), "messages.1.tool_call_id"),
        (
            chat(messages=[*MSG, {"role": "tool", "content": "42", "tool_call_id": 7}]),
            "messages.1.tool_call_id",
        ),
        # metadata: string values, at most 16 pairs (as OpenAI, and as the Responses API here)
        (chat(metadata={"a": 5}), "metadata.a"),
        (chat(metadata={str(i): "v" for i in range(17)}), "metadata"),
        (chat(metadata=["a"]), "metadata"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            "messages.0.content",
        ),
    ],
)
def test_bad_chat_fields(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_chat(body)
    assert ei.value.status == 400
    assert ei.value.param == param
    env = orjson.loads(ei.value.body())
    assert set(env["error"]) == {"message", "type", "param", "code"}


def test_echo_with_logprobs_asks_the_prompts_logprobs() -> None:
    """The echoed prompt's logprobs are returned (the engine's prompt logprobs, as vLLM answers): echo
    with logprobs asks them of the engine, with that many alternatives (test_prompt_logprobs.py)."""
    req = parse_completion({"model": "m", "prompt": "a b", "echo": True, "logprobs": 0})
    assert (req.echo, req.logprobs, req.engine_prompt_logprobs) == (True, 0, 0)
    assert parse_completion({"model": "m", "prompt": "a b", "echo": True}).echo
    assert parse_completion({"model": "m", "prompt": "a b", "logprobs": 2}).logprobs == 2


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b'"x"', b"\xff\xfe"])
def test_bad_json(raw: bytes) -> None:
    with pytest.raises(ApiError) as ei:
        parse_json_body(raw)
    assert ei.value.status == 400


def test_completion_prompt_forms() -> None:
    assert parse_completion({"model": "m", "prompt": "a"}).prompts == ["a"]
    assert parse_completion({"model": "m", "prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"model": "m", "prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert parse_completion({"model": "m", "prompt": "a"}).sampling.max_tokens == 16
    for bad in (
        {"model": "m"},
        {"model": "m", "prompt": []},
        {"model": "m", "prompt": [1, "a"]},
        {"model": "m", "prompt": "a", "suffix": "z"},
        {"model": "m", "prompt": "a", "best_of": 3},
    ):
        with pytest.raises(ApiError):
            parse_completion(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=10,
)
fields = st.sampled_from(
    [
        "model",
        "messages",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "max_tokens",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "seed",
        "tools",
        "logit_bias",
        "chat_template_kwargs",
        "response_format",
        "prompt",
        "min_p",
        "ignore_eos",
        "echo",
        "suffix",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=8))
def test_fuzzed_bodies_never_raise_anything_but_api_error(body: dict[str, Any]) -> None:
    for parse in (parse_chat, parse_completion):
        try:
            parse(body)
        except ApiError as e:
            assert 400 <= e.status < 500


def test_a_large_body_dense_in_arrays_and_objects_is_refused_before_decoding() -> None:
    """A body over DENSE_FROM bytes with more than one "[" or "{" per DENSE_BYTES bytes is a 400 before
    orjson builds its objects; a large body of text, numbers and a few containers decodes as before."""
    n = DENSE_FROM // 3 + 10
    for dense in (b'{"messages":[' + b"[]," * n + b"[]]}", b'{"tools":[' + b"{}," * n + b"{}]}"):
        with pytest.raises(ApiError) as e:
            parse_json_body(dense)
        assert e.value.status == 400 and "arrays and objects" in str(e.value.body())
    text = orjson.dumps({"messages": [{"role": "user", "content": "x" * (2 * DENSE_FROM)}]})
    assert len(parse_json_body(text)["messages"][0]["content"]) == 2 * DENSE_FROM
    ids = orjson.dumps({"prompt": [[7] * 50 for _ in range(DENSE_FROM // 100)]})  # ~1 array a 150 bytes
    assert len(ids) > DENSE_FROM and len(parse_json_body(ids)["prompt"]) == DENSE_FROM // 100
    small = b'{"a":[' + b"[]," * (DENSE_FROM // 4) + b"[]]}"  # as dense, under DENSE_FROM: decoded
    assert len(small) < DENSE_FROM and len(parse_json_body(small)["a"]) == DENSE_FROM // 4 + 1
