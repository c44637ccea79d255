"""Glue over smg-grpc-proto: our engine types <-> the SGLang scheduler and vLLM engine messages.

Every sampling field is set explicitly: proto3 zero defaults are not the semantic defaults.
Both the grpcio client and any other transport share this module, so the wire mapping exists once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.node.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    ServerInfo,
    TokenLogprob,
)

SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"


@functools.lru_cache(maxsize=4096)
def sglang_sampling(p: SamplingParams) -> sg.SamplingParams:
    """Cached per distinct parameters (frozen, hashable); callers copy it into their request."""
    sp = sg.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        stop_token_ids=p.stop_token_ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        n=p.n,
        min_new_tokens=p.min_new_tokens,
        ignore_eos=p.ignore_eos,
        # the gateway trims stop strings itself; the engine sees only token ids
        no_stop_trim=True,
    )
    if p.max_new_tokens is not None:
        sp.max_new_tokens = p.max_new_tokens
    if p.stream_interval is not None:
        sp.stream_interval = p.stream_interval
    for tok, bias in p.logit_bias:
        sp.logit_bias[str(tok)] = bias
    if p.json_schema is not None:
        sp.json_schema = p.json_schema
    elif p.regex is not None:
        sp.regex = p.regex
    elif p.ebnf is not None:
        sp.ebnf_grammar = p.ebnf
    elif p.structural_tag is not None:
        sp.structural_tag = p.structural_tag
    if p.seed is not None:
        sp.custom_params.update({"seed": p.seed})
    return sp


def sglang_generate(req: GenerateRequest) -> sg.GenerateRequest:
    msg = sg.GenerateRequest(
        request_id=req.request_id,
        tokenized=sg.TokenizedInput(original_text=req.text, input_ids=req.input_ids),
        sampling_params=sglang_sampling(req.sampling),
        return_logprob=req.logprobs,
        logprob_start_len=-1,
        top_logprobs_num=req.top_logprobs,
        stream=req.stream,
    )
    if req.bootstrap_host is not None:
        msg.disaggregated_params.bootstrap_host = req.bootstrap_host
        msg.disaggregated_params.bootstrap_port = req.bootstrap_port or 0
        msg.disaggregated_params.bootstrap_room = req.bootstrap_room or 0
    return msg


@functools.lru_cache(maxsize=4096)
def vllm_sampling(p: SamplingParams, logprobs: bool, top_logprobs: int) -> vl.SamplingParams:
    """Cached per distinct parameters (frozen, hashable); callers copy it into their request."""
    sp = vl.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),  # vLLM: 0 means all tokens
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_new_tokens,
        stop_token_ids=p.stop_token_ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        ignore_eos=p.ignore_eos,
        n=p.n,
        include_stop_str_in_output=True,
    )
    if p.max_new_tokens is not None:
        sp.max_tokens = p.max_new_tokens
    if p.seed is not None:  # vLLM's seed field is int32: a 64-bit seed is folded into it
        sp.seed = ((p.seed + (1 << 31)) % (1 << 32)) - (1 << 31)
    if logprobs:
        sp.logprobs = top_logprobs
    for tok, bias in p.logit_bias:
        sp.logit_bias[tok] = bias
    if p.json_schema is not None:
        sp.json_schema = p.json_schema
    elif p.regex is not None:
        sp.regex = p.regex
    elif p.ebnf is not None:
        sp.grammar = p.ebnf
    elif p.structural_tag is not None:
        sp.structural_tag = p.structural_tag
    return sp


def vllm_generate(req: GenerateRequest) -> vl.GenerateRequest:
    msg = vl.GenerateRequest(
        request_id=req.request_id,
        tokenized=vl.TokenizedInput(original_text=req.text, input_ids=req.input_ids),
        sampling_params=vllm_sampling(req.sampling, req.logprobs, req.top_logprobs),
        stream=req.stream,
    )
    if req.kv_transfer_params_json is not None:
        msg.kv_transfer_params_json = req.kv_transfer_params_json
    return msg


def _logprobs(lp: Any) -> list[TokenLogprob]:
    """OutputLogProbs (either engine) -> our TokenLogprob list."""
    ids: Sequence[int] = lp.token_ids
    if not ids:
        return []
    vals: Sequence[float] = lp.token_logprobs
    tops = lp.top_logprobs
    out: list[TokenLogprob] = []
    for i, tid in enumerate(ids):
        top: tuple[tuple[int, float], ...] = ()
        if i < len(tops):
            t = tops[i]
            top = tuple(zip(t.token_ids, t.values, strict=False))
        out.append(TokenLogprob(tid, vals[i] if i < len(vals) else 0.0, top))
    return out


def _has(msg: Any, name: str) -> bool:
    """HasField that answers False for a field the message type does not have (SGLang vs vLLM),
    without raising: the type's field names are looked up once."""
    names = _FIELD_NAMES.get(msg.DESCRIPTOR.full_name)
    if names is None:
        names = _FIELD_NAMES[msg.DESCRIPTOR.full_name] = frozenset(msg.DESCRIPTOR.fields_by_name)
    return name in names and bool(msg.HasField(name))


_FIELD_NAMES: dict[str, frozenset[str]] = {}


def decode_response(resp: Any) -> EngineEvent | None:
    """A GenerateResponse of either engine -> EngineChunk / EngineComplete (None if empty)."""
    kind = resp.WhichOneof("response")
    if kind == "chunk":
        c = resp.chunk
        return EngineChunk(
            index=c.index,
            token_ids=c.token_ids,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            cached_tokens=c.cached_tokens,
            logprobs=_logprobs(c.output_logprobs) if c.HasField("output_logprobs") else (),
        )
    if kind == "complete":
        c = resp.complete
        stop = c.WhichOneof("matched_stop")
        kv = c.kv_transfer_params_json if _has(c, "kv_transfer_params_json") else None
        return EngineComplete(
            index=c.index,
            finish_reason=c.finish_reason or "stop",
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            cached_tokens=c.cached_tokens,
            output_ids=c.output_ids,
            matched_token_id=c.matched_token_id if stop == "matched_token_id" else None,
            matched_stop_str=c.matched_stop_str if stop == "matched_stop_str" else None,
            logprobs=_logprobs(c.output_logprobs) if c.HasField("output_logprobs") else (),
            kv_transfer_params_json=kv,
        )
    return None


def decode_batch(raws: Iterable[bytes], parse: Callable[[bytes], Any]) -> list[EngineEvent]:
    """Several serialized GenerateResponses that arrived together -> events, with consecutive chunks of
    the same choice merged into one (one id list, logprobs concatenated, latest counts): the consumer
    then detokenizes, stop-checks and encodes them once."""
    out: list[EngineEvent] = []
    run: EngineChunk | None = None
    ids: list[int] = []
    for raw in raws:
        resp = parse(raw)
        if resp.WhichOneof("response") == "chunk":
            c = resp.chunk
            if run is not None and run.index == c.index:
                ids.extend(c.token_ids)
                run.completion_tokens = c.completion_tokens
                if c.cached_tokens > run.cached_tokens:
                    run.cached_tokens = c.cached_tokens
                if c.HasField("output_logprobs"):
                    run.logprobs = [*run.logprobs, *_logprobs(c.output_logprobs)]
                continue
            ids = list(c.token_ids)
            run = EngineChunk(
                c.index,
                ids,
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
                _logprobs(c.output_logprobs) if c.HasField("output_logprobs") else (),
            )
            out.append(run)
            continue
        run = None
        ev = decode_response(resp)
        if ev is not None:
            out.append(ev)
    return out


def decode_model_info(resp: Any) -> ModelInfo:
    bos = int(resp.bos_token_id)
    return ModelInfo(
        served_model_name=resp.served_model_name,
        model_path=resp.model_path,
        max_context_length=int(resp.max_context_length),
        vocab_size=int(resp.vocab_size),
        eos_token_ids=tuple(int(x) for x in resp.eos_token_ids),
        bos_token_id=bos if bos > 0 else None,
    )


def decode_server_info(resp: Any, kind: str) -> ServerInfo:
    if kind == "sglang":
        return ServerInfo(
            kind="sglang",
            version=resp.sglang_version,
            active_requests=resp.active_requests,
            max_total_num_tokens=resp.max_total_num_tokens,
            extra={"server_type": resp.server_type},
        )
    return ServerInfo(
        kind="vllm",
        active_requests=resp.active_requests,
        extra={"server_type": resp.server_type, "kv_role": resp.kv_role, "kv_connector": resp.kv_connector},
    )


def decode_loads(resp: Any) -> EngineLoad:
    running = waiting = used = total = uncached = max_running = 0
    usage = hit = 0.0
    n = 0
    for ld in resp.loads:
        n += 1
        running += ld.num_running_reqs
        waiting += ld.num_waiting_reqs
        used += ld.num_used_tokens
        total += ld.max_total_num_tokens
        uncached += ld.num_waiting_uncached_tokens
        max_running += ld.max_running_requests
        usage += ld.token_usage
        hit += ld.cache_hit_rate
    return EngineLoad(
        running=running,
        waiting=waiting,
        used_tokens=used,
        max_total_tokens=total,
        token_usage=usage / n if n else 0.0,
        waiting_uncached_tokens=uncached,
        max_running=max_running,
        cache_hit_rate=hit / n if n else 0.0,
    )


def sampling_as_dict(msg: Any) -> dict[str, Any]:
    """For diagnostics and tests: every field, including zero values."""
    out: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return out
