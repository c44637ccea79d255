"""The engine request fields the review of smg-grpc-proto usage found missing or mis-sent, against what
SMG sends: SGLang's require_reasoning (field 18), max_new_tokens left unset when the client gave none
(and any bound clamped to the uint32 field), stop strings (vLLM's ``stop``; single-token ones as SGLang
stop ids), vLLM's int32 seed saturated, the context from ``max_req_input_len`` and
``skip_tokenizer_init`` from SGLang's server info. The hand-built bytes stay equal to protobuf's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf.struct_pb2 import Struct
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

import shepherd.tokens as tokens_pkg
from shepherd.node.api.generation import engine_sampling, single_token_stops
from shepherd.node.openai.requests import parse_chat
from shepherd.proto.engine_requests import (
    fold_seed,
    sglang_generate,
    sglang_generate_bytes,
    vllm_generate,
    vllm_generate_bytes,
)
from shepherd.proto.engine_responses import decode_model_info, decode_server_info
from shepherd.proto.engine_types import GenerateRequest, SamplingParams, ServerInfo
from shepherd.tokens.tokenizer import VERY_LARGE_INTEGER, Tokenizer

TEXT = st.text(max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> GenerateRequest:
    sp = SamplingParams(
        max_new_tokens=draw(st.none() | st.integers(0, 2**70)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, 1000), max_size=3))),
        stop_string_ids=tuple(draw(st.lists(st.integers(0, 1000), max_size=3))),
        stop_strings=tuple(draw(st.lists(TEXT, max_size=3))),
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
    )
    return GenerateRequest(
        request_id=draw(TEXT),
        input_ids=draw(st.lists(st.integers(0, 2**20), max_size=20)),
        sampling=sp,
        stream=draw(st.booleans()),
        require_reasoning=draw(st.booleans()),
        token_limit=draw(st.none() | st.integers(0, 2**40)),
    )


@settings(max_examples=200, deadline=None)
@given(requests())
def test_the_bytes_equal_the_message_with_the_new_fields(req: GenerateRequest) -> None:
    assert sg.GenerateRequest.FromString(sglang_generate_bytes(req)) == sglang_generate(req)
    assert sglang_generate_bytes(req) == sglang_generate(req).SerializeToString()
    assert vl.GenerateRequest.FromString(vllm_generate_bytes(req)) == vllm_generate(req)


def gen(sampling: SamplingParams | None = None, **kw: Any) -> GenerateRequest:
    return GenerateRequest("r", [1, 2], sampling or SamplingParams(), **kw)


def test_require_reasoning_reaches_sglang_only() -> None:
    on = gen(require_reasoning=True)
    assert sglang_generate(on).require_reasoning
    assert sg.GenerateRequest.FromString(sglang_generate_bytes(on)).require_reasoning
    assert not sglang_generate(gen()).require_reasoning
    assert vllm_generate_bytes(on) == vllm_generate_bytes(gen())  # (vLLM has no such field)


def test_max_new_tokens_is_left_to_the_engine_when_the_client_gave_none() -> None:
    r = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    for max_new in (None, VERY_LARGE_INTEGER - 10, 2**32 + 100):  # (a node-side bound, not sent)
        req = gen(sampling=engine_sampling(r.sampling, r.sampling.max_tokens, None), token_limit=max_new)
        for build, parse in (
            (sglang_generate_bytes, sg.GenerateRequest),
            (vllm_generate_bytes, vl.GenerateRequest),
        ):
            sp = parse.FromString(build(req)).sampling_params
            assert not sp.HasField("max_new_tokens" if parse is sg.GenerateRequest else "max_tokens")


@pytest.mark.parametrize("asked", [VERY_LARGE_INTEGER, 2**32 + 100, 2**32 - 1])
def test_a_bound_past_the_field_is_clamped_not_refused(asked: int) -> None:
    req = gen(sampling=SamplingParams(max_new_tokens=asked))
    assert sglang_generate(req).sampling_params.max_new_tokens == 2**32 - 1
    assert (
        sg.GenerateRequest.FromString(sglang_generate_bytes(req)).sampling_params.max_new_tokens == 2**32 - 1
    )
    assert vl.GenerateRequest.FromString(vllm_generate_bytes(req)).sampling_params.max_tokens == 2**32 - 1


@pytest.mark.parametrize("seed", [5, -7, 0, 2**31 - 1, -(2**31)])
def test_a_vllm_seed_in_int32_goes_as_it_is(seed: int) -> None:
    assert vllm_generate(gen(sampling=SamplingParams(seed=seed))).sampling_params.seed == seed


def test_vllm_seeds_past_int32_stay_distinct() -> None:
    """vLLM's server takes any int64 seed; its gRPC field is int32: seeds past it are mixed in, so that
    distinct seeds still give distinct samples (SMG saturates them: 2**40 and 2**41 sample alike)."""
    seeds = [2**31, -(2**31) - 1, 2**40, 2**41, 2**62, 2**63 - 1, -(2**40), -(2**63), 2**40 + 5]
    got = [vllm_generate(gen(sampling=SamplingParams(seed=s))).sampling_params.seed for s in seeds]
    assert len(set(got)) == len(seeds)
    assert all(-(2**31) <= g < 2**31 for g in got)
    assert got == [fold_seed(s) for s in seeds]  # the same in every process


@given(st.integers(-(2**63), 2**63 - 1))
def test_fold_seed_is_int32_and_keeps_int32_seeds(seed: int) -> None:
    folded = fold_seed(seed)
    assert -(2**31) <= folded < 2**31
    assert folded == seed or not -(2**31) <= seed < 2**31


def test_stop_strings_reach_vllm_and_single_token_ones_sglang() -> None:
    p = SamplingParams(stop_token_ids=(7, 8), stop_string_ids=(8, 9), stop_strings=("\n\n", "END"))
    s = sglang_generate(gen(sampling=p)).sampling_params
    assert list(s.stop_token_ids) == [7, 8, 9] and not s.stop and s.no_stop_trim
    v = vllm_generate(gen(sampling=p)).sampling_params
    assert (
        list(v.stop) == ["\n\n", "END"] and list(v.stop_token_ids) == [7, 8] and v.include_stop_str_in_output
    )


QWEN3 = Path(tokens_pkg.__file__).parent / "assets" / "qwen3"


def test_single_token_stops_are_those_that_round_trip() -> None:
    tok = Tokenizer.load(QWEN3)
    nl = tok.encode_uncached("\n", add_special_tokens=False)
    dot = tok.encode_uncached(".", add_special_tokens=False)
    assert len(nl) == 1 and len(dot) == 1
    assert single_token_stops(tok, ("\n", "Hello world", "."), True) == (nl[0], dot[0])
    # a special token: its text is not the output's when special tokens are skipped
    end = tok.encode_uncached("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1
    assert single_token_stops(tok, ("<|im_end|>",), True) == ()
    assert single_token_stops(tok, ("<|im_end|>",), False) == (end[0],)
    r = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["\n", "END!"]})
    p = engine_sampling(r.sampling, None, None, None, None, single_token_stops(tok, r.sampling.stop, True))
    assert p.stop_strings == ("\n", "END!") and p.stop_string_ids == (nl[0],) and p.stop_token_ids == ()


# ---- the engine's bounds and flags -------------------------------------------------------------------------


def server(args: dict[str, Any]) -> ServerInfo:
    st_ = Struct()
    st_.update(args)
    return decode_server_info(
        sg.GetServerInfoResponse(server_args=st_, max_total_num_tokens=500000), "sglang"
    )


def test_sglang_context_falls_back_to_max_req_input_len() -> None:
    resp = sg.GetModelInfoResponse(max_context_length=500000, max_req_input_len=40954)
    info = decode_model_info(resp, server({"context_length": None}))
    assert (info.max_context_length, info.kv_capacity_tokens) == (40954, 500000)
    info = decode_model_info(resp, server({"context_length": 32768}))
    assert info.max_context_length == 32768  # what the server's arguments say, first
    bad = sg.GetModelInfoResponse(max_context_length=500000, max_req_input_len=-3)
    assert decode_model_info(bad, server({})).max_context_length == 0


def test_skip_tokenizer_init_is_read_from_the_server_arguments() -> None:
    for args, want in (
        ({"skip_tokenizer_init": True}, True),
        ({"skip_tokenizer_init": False}, False),
        ({}, False),
    ):
        srv = server(args)
        assert srv.skip_tokenizer_init is want
        assert decode_model_info(sg.GetModelInfoResponse(), srv).skip_tokenizer_init is want
    assert not server({"skip_tokenizer_init": "true"}).skip_tokenizer_init
