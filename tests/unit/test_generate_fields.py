"""SGLang's ``/generate`` as its own clients call it: the fields of ``GenerateReqInput`` and of its sampling
params that they send on every call at their defaults (``sglang.bench_serving``'s ``lora_path: null`` and
``logprob_start_len: -1``, the frontend's ``regex`` / ``json_schema`` / ``stop_regex`` null) ask for
nothing and are accepted, as SGLang and SMG accept them; the same fields asking for something are a 400
naming them."""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.node.api.native import _sampling as generate_sampling
from shepherd.proto.openai_errors import ApiError

# python/sglang/bench_serving.py, async_request_sglang_generate (--backend sglang)
BENCH_SERVING = {
    "text": "hello",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    "stream": True,
    "lora_path": None,
    "return_logprob": False,
    "logprob_start_len": -1,
}
# python/sglang/lang/ir.py SglSamplingParams.to_srt_kwargs (sent by lang/backend/runtime_endpoint.py)
FRONTEND_SAMPLING = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "max_new_tokens": 8,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "stop_regex": None,
    "temperature": 0.7,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "regex": None,
    "json_schema": None,
}


def test_bench_serving_payload_is_accepted() -> None:
    s, prompt, ask, _ = generate_sampling(BENCH_SERVING)
    assert prompt == "hello" and s.max_tokens == 8 and s.ignore_eos and ask is None


def test_frontend_payload_is_accepted() -> None:
    body = {
        "text": "hello",
        "sampling_params": FRONTEND_SAMPLING,
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
    }
    s, _, ask, _ = generate_sampling(body)
    assert s.max_tokens == 8 and s.temperature == pytest.approx(0.7) and ask is None


@pytest.mark.parametrize(
    "extra",
    [
        {"image_data": None, "modalities": None, "session_params": None, "custom_logit_processor": None},
        {"return_hidden_states": False, "log_metrics": True, "data_parallel_rank": None},
        {"bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None},
        # a whole GenerateReqInput serialized (python/sglang/srt/managers/io_struct.py): unset fields
        {
            "priority": None,
            "session_id": None,
            "no_logs": False,
            "background": False,
            "extra_key": None,
            "custom_labels": None,
            "return_entropy": False,
            "return_bytes": False,
            "conversation_id": None,
            "routing_key": None,
            "routed_dp_rank": None,
            "cache_salt": None,
            "require_reasoning": False,
            "return_prompt_token_ids": False,
            "received_time": None,
            "max_thinking_tokens": None,
        },
    ],
)
def test_fields_at_their_defaults_are_accepted(extra: dict[str, Any]) -> None:
    generate_sampling({"text": "x", **extra})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"image_data": "http://x/y.png"}, "image_data"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"return_hidden_states": 0}, "return_hidden_states"),
        ({"bootstrap_host": "10.0.0.1"}, "bootstrap_host"),
        ({"priority": 5}, "priority"),
        ({"return_entropy": True}, "return_entropy"),
        ({"session_id": "s1"}, "session_id"),
        ({"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ],
)
def test_the_same_fields_asking_for_something_are_refused(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        generate_sampling({"text": "x", **extra})
    assert e.value.status == 400 and e.value.param == param


# ---- return_logprob (SGLang's RL clients: slime, verl, AReaL call /generate with it) -------------------


def test_return_logprob_and_its_companions_are_read() -> None:
    _, _, ask, _ = generate_sampling({"input_ids": [1, 2, 3], "return_logprob": True})
    assert ask is not None and (ask.start, ask.top, ask.text) == (-1, 0, False)
    body = {
        "text": "x",
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 5,
        "return_text_in_logprobs": True,
    }
    _, _, ask, _ = generate_sampling(body)
    assert ask is not None and (ask.start, ask.top, ask.text) == (0, 5, True)
    # the companions without return_logprob ask nothing (SGLang's), and are still checked
    _, _, ask, _ = generate_sampling({"text": "x", "logprob_start_len": 3, "top_logprobs_num": 2})
    assert ask is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": "5"}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"return_logprob": True, "logprob_start_len": 1.5}, "logprob_start_len"),
        ({"return_logprob": True, "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
    ],
)
def test_bad_logprob_fields_are_400s_naming_them(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        generate_sampling({"text": "x", **extra})
    assert e.value.status == 400 and e.value.param == param


def test_max_new_tokens_0_asks_the_prefill_alone() -> None:
    """SGLang's prefill without output (a cache warm-up, or a prompt scored with return_logprob): read as
    one token asked of the engine, none taken; a negative count stays a 400."""
    s, _, _, prefill_only = generate_sampling({"text": "x", "sampling_params": {"max_new_tokens": 0}})
    assert prefill_only and s.max_tokens == 1
    assert not generate_sampling({"text": "x", "sampling_params": {"max_new_tokens": 1}})[3]
    with pytest.raises(ApiError) as e:
        generate_sampling({"text": "x", "sampling_params": {"max_new_tokens": -1}})
    assert e.value.param == "sampling_params.max_new_tokens"


def test_a_temperature_above_2_is_taken_as_sglang_takes_it() -> None:
    """SGLang's sampling takes any temperature from 0 up (the OpenAI routes stop at 2): sent as given;
    a negative or non-finite one stays a 400 naming the field."""
    s, _, _, _ = generate_sampling({"text": "x", "sampling_params": {"temperature": 3.5}})
    assert s.temperature == 3.5 and "temperature" not in s.unset
    assert generate_sampling({"text": "x", "sampling_params": {"temperature": 0.7}})[0].temperature == 0.7
    for bad in (-1, "hot", True):
        with pytest.raises(ApiError) as e:
            generate_sampling({"text": "x", "sampling_params": {"temperature": bad}})
        assert e.value.param == "sampling_params.temperature"
