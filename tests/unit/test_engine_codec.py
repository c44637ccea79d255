"""The wire mapping sets every sampling field explicitly (proto3 zeros are not semantic defaults)."""

from __future__ import annotations

from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.proto.engine_requests import sglang_generate, vllm_generate
from shepherd.proto.engine_responses import decode_response
from shepherd.proto.engine_types import EngineChunk, EngineComplete, GenerateRequest, SamplingParams


def req(**kw: object) -> GenerateRequest:
    return GenerateRequest(request_id="r1", input_ids=[1, 2, 3], sampling=SamplingParams(**kw))  # type: ignore[arg-type]


def test_sglang_defaults_explicit() -> None:
    m = sglang_generate(req(max_new_tokens=5))
    sp = m.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.n) == (1.0, 1.0, -1, 1.0, 1)
    assert sp.max_new_tokens == 5 and sp.skip_special_tokens and sp.no_stop_trim
    assert list(m.tokenized.input_ids) == [1, 2, 3]
    # round trip through the wire keeps them
    again = sg.GenerateRequest.FromString(m.SerializeToString())
    assert again.sampling_params.top_k == -1 and again.sampling_params.HasField("max_new_tokens")


def test_vllm_mapping() -> None:
    m = vllm_generate(req(temperature=0.0, top_k=-1, seed=7, max_new_tokens=9, stop_token_ids=(4,)))
    sp = vl.GenerateRequest.FromString(m.SerializeToString()).sampling_params
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert sp.top_k == 0 and sp.seed == 7 and sp.max_tokens == 9 and list(sp.stop_token_ids) == [4]


def test_constraints() -> None:
    assert sglang_generate(req(json_schema="{}")).sampling_params.WhichOneof("constraint") == "json_schema"
    assert vllm_generate(req(regex="a+")).sampling_params.WhichOneof("constraint") == "regex"
    # a choice: vLLM's own constraint; SGLang has none, so the grammar vLLM builds for such backends
    vsp = vllm_generate(req(choice=("a", 'b"'))).sampling_params
    assert vsp.WhichOneof("constraint") == "choice" and list(vsp.choice.choices) == ["a", 'b"']
    ssp = sglang_generate(req(choice=("a", 'b"', "c\\\n"))).sampling_params
    assert ssp.WhichOneof("constraint") == "ebnf_grammar"
    assert ssp.ebnf_grammar == 'root ::= "a" | "b\\"" | "c\\\\\\n"'
    assert vllm_generate(req(json_object=True)).sampling_params.json_object is True
    ssp = sglang_generate(req(json_object=True)).sampling_params
    assert ssp.WhichOneof("constraint") == "json_schema" and ssp.json_schema == '{"type":"object"}'


def test_decode_responses() -> None:
    chunk = sg.GenerateResponse(
        request_id="r", chunk=sg.GenerateStreamChunk(token_ids=[5, 6], index=1, cached_tokens=16)
    )
    ev = decode_response(chunk)
    assert (
        isinstance(ev, EngineChunk)
        and list(ev.token_ids) == [5, 6]
        and ev.index == 1
        and ev.cached_tokens == 16
    )
    done = vl.GenerateResponse(
        complete=vl.GenerateComplete(output_ids=[1], finish_reason="length", matched_token_id=9)
    )
    ev2 = decode_response(done)
    assert isinstance(ev2, EngineComplete) and ev2.finish_reason == "length" and ev2.matched_token_id == 9
    assert decode_response(sg.GenerateResponse()) is None
