"""A model's sampling defaults (GetModelInfo's default_sampling_params_json) fill the five fields a request
leaves unset (temperature, top_p, top_k, min_p, repetition_penalty), as SMG's
apply_sampling_defaults_to_generate_request does: parsed defensively, per route (chat, completions,
/generate, Messages), per model (the decode pool's in PD, a targeted worker's own), memoized per defaults."""

from __future__ import annotations

import json
from typing import Any

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.node.anthropic.requests import parse_messages
from shepherd.node.api.generation import engine_sampling
from shepherd.node.api.native import _sampling as generate_sampling
from shepherd.node.dispatch.gateway import _facts
from shepherd.node.openai.requests import parse_chat, parse_completion
from shepherd.proto.engine_requests import sglang_sampling, vllm_sampling
from shepherd.proto.engine_responses import decode_model_info, decode_sampling_defaults
from shepherd.proto.engine_types import ModelInfo, SamplingDefaults

QWEN = '{"temperature":0.6,"top_p":0.95,"top_k":20,"min_p":0.0,"repetition_penalty":1.05}'
QWEN_D = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05)
MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> Any:
    return parse_chat({"model": "m", "messages": MSGS, **kw}).sampling


# ---- the GetModelInfo field ---------------------------------------------------------------------------


@pytest.mark.parametrize("mod", [sg, vl])
def test_model_info_carries_the_defaults(mod: Any) -> None:
    info = decode_model_info(
        mod.GetModelInfoResponse(max_context_length=4096, default_sampling_params_json=QWEN)
    )
    assert info.sampling_defaults == QWEN_D
    assert decode_model_info(mod.GetModelInfoResponse()).sampling_defaults is None  # "": none


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", None),
        ("not json", None),
        ("[0.6]", None),
        ('"x"', None),
        ("{" * 100_000, None),  # (too deep / too big: never a crash)
        ('{"max_new_tokens": 32, "stop": ["x"]}', None),  # no sampling default among them
        ('{"temperature": null, "top_k": 0}', SamplingDefaults(top_k=-1)),  # 0: every token, as a request's 0
        ('{"temperature": 0}', SamplingDefaults(temperature=0.0)),
        # each absurd value ignored, the rest kept
        (
            '{"temperature": 1e308, "top_p": 0, "top_k": 1.5, "min_p": -1, "repetition_penalty": 0.5}',
            SamplingDefaults(repetition_penalty=0.5),
        ),
        ('{"temperature": true, "top_p": "0.9", "top_k": 40.0}', SamplingDefaults(top_k=40)),
        ('{"temperature": NaN, "top_p": Infinity, "top_k": -2, "repetition_penalty": 0}', None),
        ('{"top_k": 99999999999999}', None),
    ],
)
def test_defaults_are_read_defensively(text: str, want: SamplingDefaults | None) -> None:
    assert decode_sampling_defaults(text) == want


# ---- which fields the request set -----------------------------------------------------------------------


def test_sampling_records_the_fields_left_unset() -> None:
    every = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    assert chat().unset == every
    assert chat(temperature=0, top_k=0, min_p=None).unset == {"top_p", "min_p", "repetition_penalty"}
    assert parse_completion({"model": "m", "prompt": "x", "top_p": 0.5}).sampling.unset == every - {"top_p"}
    # /generate: its sampling_params under SGLang's names
    s, _, _, _ = generate_sampling(
        {"text": "x", "sampling_params": {"temperature": 0.2, "repetition_penalty": 1.0}}
    )
    assert s.unset == {"top_p", "top_k", "min_p"}
    # Messages: no min_p or repetition_penalty field: always the model's (as SMG)
    m = parse_messages({"model": "m", "max_tokens": 8, "messages": MSGS, "temperature": 0.3, "top_k": 0})
    assert m.chat.sampling.unset == {"top_p", "min_p", "repetition_penalty"}


# ---- the fill ------------------------------------------------------------------------------------------


def test_unset_fields_get_the_model_defaults_on_both_wires() -> None:
    p = engine_sampling(chat(), None, None, None, QWEN_D)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.05)
    sgp, vlp = sglang_sampling(p), vllm_sampling(p, False, 0)
    assert sgp.top_k == 20 and vlp.top_k == 20 and abs(vlp.temperature - 0.6) < 1e-6
    # what the client set stays its own (0 too: a value, not "unset")
    p = engine_sampling(chat(temperature=0, top_k=0, repetition_penalty=1.0), None, None, None, QWEN_D)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p) == (0.0, -1, 1.0, 0.95)
    # no defaults reported: the request's own fallbacks, as before
    p = engine_sampling(chat(), None, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)


def test_a_default_top_k_of_every_token_is_vllms_zero() -> None:
    p = engine_sampling(chat(), None, None, None, SamplingDefaults(top_k=-1))
    assert sglang_sampling(p).top_k == -1 and vllm_sampling(p, False, 0).top_k == 0


def test_messages_take_min_p_and_repetition_penalty_from_the_model() -> None:
    d = {"model": "m", "max_tokens": 8, "messages": MSGS, "temperature": 0.3, "top_p": 0.5, "top_k": 5}
    s = parse_messages(d).chat.sampling
    defaults = SamplingDefaults(temperature=0.9, top_p=0.9, top_k=50, min_p=0.1, repetition_penalty=1.2)
    p = engine_sampling(s, s.max_tokens, None, None, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.3, 0.5, 5, 0.1, 1.2)


def test_the_memo_tells_models_apart() -> None:
    s = chat()
    a = engine_sampling(s, None, None, None, QWEN_D)
    b = engine_sampling(s, None, None, None, SamplingDefaults(temperature=0.1))
    c = engine_sampling(s, None, None)
    assert (a.temperature, b.temperature, c.temperature) == (0.6, 0.1, 1.0)
    assert engine_sampling(s, None, None, None, QWEN_D) is a  # (still memoized per value)


# ---- per model ------------------------------------------------------------------------------------------


def info(defaults: str = "", skip: bool = False) -> ModelInfo:
    base = decode_model_info(vl.GetModelInfoResponse(default_sampling_params_json=defaults))
    return ModelInfo(sampling_defaults=base.sampling_defaults, skip_tokenizer_init=skip)


def test_the_model_defaults_are_the_workers_most_report() -> None:
    a, b = info(QWEN), info('{"temperature": 0.1}')
    assert _facts([a, a, b], [a, a, b]).defaults == QWEN_D
    f = _facts([b, a], [b, a])  # a tie: the first worker's (by id), reported as divergent
    assert f.defaults == SamplingDefaults(temperature=0.1) and f.divergent
    assert not _facts([a, a], [a, a]).divergent and _facts([], []).defaults is None
    # PD: the decode pool's defaults; --skip-tokenizer-init on any worker of the model (prefill too)
    pd = _facts([a], [info(skip=True), a])
    assert pd.defaults == QWEN_D and pd.skip_tokenizer_init


def test_json_defaults_from_generation_config_shapes() -> None:
    """What the servicers send: SGLang's generation_config merged with --preferred-sampling-params, vLLM's
    get_diff_sampling_param() (filtered to the five keys, compact JSON)."""
    text = json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    d = decode_sampling_defaults(text)
    assert d is not None and d.as_dict() == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
