"""TensorRT-LLM's ``trtllm.TrtllmService`` (smg-grpc-proto ``trtllm_service.proto``) <-> our engine types.

``trtllm_generate``: a ``GenerateRequest`` -> the service's GenerateRequest, refusing (``EngineError``
``invalid_request``, naming the field) what the service cannot carry. ``TrtllmEvents``: one Generate
call's responses -> ``EngineChunk`` / ``EngineComplete``, as TensorRT-LLM's servicer
(NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/smg/servicer.py``) sends them: streaming, delta chunks per
``sequence_index`` then, in the same step, one ``GenerateComplete`` per sequence holding *every* output
token (cumulative, not a delta: dropped here once that sequence's chunks were seen); not streaming, the
completes only. A ``cancelled`` / ``timeout`` / ``error`` finish, or a stream that ends without every
sequence's complete, is an ``EngineError``. The other calls' answers: ``decode_trtllm_model_info``,
``decode_trtllm_server_info``, ``trtllm_healthy`` (``status`` is the free text ``"OK"`` when healthy, as
SMG reads it: lightseekorg/smg ``model_gateway/src/routers/grpc/client.rs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from smg_grpc_proto import trtllm_service_pb2 as tr

from shepherd.proto.engine_requests import choice_grammar
from shepherd.proto.engine_responses import _printable as printable_name
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    GenerateRequest,
    ModelInfo,
    ServerInfo,
    TokenLogprob,
)

TRTLLM_SERVICE = "trtllm.TrtllmService"

_GUIDE = tr.GuidedDecodingParams
# TensorRT-LLM's finish reasons (tensorrt_llm.executor.result: stop, length, timeout, cancelled; the
# servicer sends "" when the engine gave none, "error" for a result without outputs)
_FINISH = {"": "stop", "stop": "stop", "stop_word": "stop", "length": "length"}
_FAILED = {"cancelled": "the engine cancelled the request", "timeout": "the engine timed it out"}


def refuse(engine: str, field: str, why: str) -> EngineError:
    """The 400 for a request field an engine kind cannot honour (never dropped silently)."""
    return EngineError(
        f"{engine} workers cannot honour {field}: {why}", code="invalid_request", retryable=False
    )


def _uint64(v: int) -> int:
    return v % (1 << 64)  # a negative seed: its two's complement, as a C cast would


def trtllm_generate(req: GenerateRequest, vocab_size: int = 0) -> tr.GenerateRequest:
    """``req`` as TrtllmService's GenerateRequest. ``vocab_size`` (GetModelInfo's): the length of the
    ``embedding_bias`` vector ``logit_bias`` becomes. Raises ``EngineError`` (invalid_request) for
    what the service cannot carry: SGLang's PD bootstrap and vLLM's KV transfer parameters, a
    ``logit_bias`` without a known vocabulary size or with an id outside it."""
    p = req.sampling
    if req.bootstrap_host is not None or req.kv_transfer_params_json is not None:
        raise refuse(
            "TensorRT-LLM", "PD disaggregation parameters", "this node pairs SGLang or vLLM workers only"
        )
    if p.max_new_tokens is None:
        raise refuse("TensorRT-LLM", "a request without max_tokens", "the engine requires max_tokens")
    if req.prompt_logprobs is not None:
        raise refuse(
            "TensorRT-LLM",
            "prompt_logprobs (or echo with logprobs)",
            "this node does not read the prompt's logprobs from TensorRT-LLM answers",
        )
    sc = tr.SamplingConfig(
        beam_width=1,
        num_return_sequences=p.n,
        top_p=p.top_p,
        temperature=p.temperature,
        min_tokens=p.min_new_tokens,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_p=p.min_p,
    )
    if p.top_k > 0:  # ours: -1 is every token; TensorRT-LLM's: unset (0 disables it too)
        sc.top_k = p.top_k
    if p.seed is not None:
        sc.seed = _uint64(p.seed)
    oc = tr.OutputConfig(exclude_input_from_output=True)
    if req.logprobs:
        # at least 1: the sampled token's own logprob comes with its top list (trimmed back to
        # ``top_logprobs`` when decoded)
        oc.logprobs = max(1, req.top_logprobs)
    msg = tr.GenerateRequest(
        request_id=req.request_id,
        tokenized=tr.TokenizedInput(original_text=req.text, input_token_ids=req.input_ids),
        sampling_config=sc,
        output_config=oc,
        max_tokens=p.max_new_tokens,
        streaming=req.stream,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        # the gateway trims stop tokens and strings itself (as with SGLang's no_stop_trim)
        include_stop_token_in_output=True,
    )
    guide = _guide(req)
    if guide is not None:
        msg.guided_decoding.CopyFrom(guide)
    if p.logit_bias:
        if not 0 < vocab_size <= MAX_VOCAB:
            raise refuse("TensorRT-LLM", "logit_bias", "the engine did not report its vocabulary size")
        bias = [0.0] * vocab_size
        for tok, b in p.logit_bias:
            if not 0 <= tok < vocab_size:
                raise refuse("TensorRT-LLM", "logit_bias", f"token {tok} is outside the vocabulary")
            bias[tok] = b
        msg.embedding_bias.extend(bias)
    return msg


def _guide(req: GenerateRequest) -> tr.GuidedDecodingParams | None:
    p = req.sampling
    if p.json_schema is not None:
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_JSON_SCHEMA, guide=p.json_schema)
    if p.regex is not None:
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_REGEX, guide=p.regex)
    if p.ebnf is not None:
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_EBNF_GRAMMAR, guide=p.ebnf)
    if p.structural_tag is not None:
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_STRUCTURAL_TAG, guide=p.structural_tag)
    if p.choice is not None:  # no choice guide: the grammar vLLM builds for one
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_EBNF_GRAMMAR, guide=choice_grammar(p.choice))
    if p.json_object:
        return _GUIDE(guide_type=_GUIDE.GUIDE_TYPE_JSON, guide='{"type":"object"}')
    return None


def _logprobs(entries: Sequence[Any], top: int) -> list[TokenLogprob]:
    """TrtllmService's TokenLogprob list -> ours; each token's top list cut to the ``top`` asked for."""
    return [
        TokenLogprob(
            int(e.token_id), float(e.logprob), tuple((t.token_id, t.logprob) for t in e.top_logprobs[:top])
        )
        for e in entries
    ]


class TrtllmEvents:
    """One Generate call's responses -> our events (see the module doc)."""

    __slots__ = ("_chunked", "_done", "_n", "_top")

    def __init__(self, req: GenerateRequest) -> None:
        self._n = req.sampling.n
        self._top = req.top_logprobs
        self._chunked: set[int] = set()  # sequences whose chunks were seen
        self._done: set[int] = set()

    def decode(self, resp: Any) -> EngineEvent | None:
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            c = resp.chunk
            if not c.token_ids:
                return None  # the servicer's empty chunk of a step without output
            self._chunked.add(c.sequence_index)
            return EngineChunk(
                c.sequence_index,
                list(c.token_ids),
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
                _logprobs(c.logprobs, self._top),
            )
        if kind != "complete":
            return None
        c = resp.complete
        i = c.sequence_index
        reason = c.finish_reason
        if reason in _FAILED or reason not in _FINISH:
            why = _FAILED.get(reason, f"the engine ended it with finish reason {reason!r}")
            # retryable: before the first token another worker may serve it (after it, an SSE error)
            raise EngineError(f"TensorRT-LLM worker failed the request: {why}", retryable=True)
        self._done.add(i)
        stop = c.WhichOneof("matched_stop")
        seen = i in self._chunked  # streaming: the chunks carried every token, output_token_ids repeats them
        return EngineComplete(
            i,
            _FINISH[reason],
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            () if seen else list(c.output_token_ids),
            c.matched_token_id if stop == "matched_token_id" else None,
            c.matched_stop_str if stop == "matched_stop_str" else None,
            () if seen else _logprobs(c.logprobs, self._top),
        )

    def end(self) -> None:
        """The stream ended OK: every sequence must have had its complete (an abort ends it early)."""
        if len(self._done) < self._n:
            raise EngineError(
                "TensorRT-LLM worker ended the stream before every choice finished (aborted)", retryable=True
            )


# the largest vocabulary taken from an engine (the largest real ones are ~260K): ``logit_bias`` builds a
# vector of this length; a broken engine's 2**31 would be gigabytes a request
MAX_VOCAB = 1 << 22
_MAX_CONTEXT = 2**31 - 1


def decode_trtllm_model_info(resp: Any) -> ModelInfo:
    """GetModelInfo: the context window is ``max_seq_len`` (prompt and output), else ``max_input_len``. A
    broken engine's numbers (0 or less, past any real model) mean unknown (0); its name is cleaned."""
    ctx = int(resp.max_seq_len or resp.max_input_len)
    vocab = int(resp.vocab_size)
    name = printable_name(resp.model_id)
    return ModelInfo(
        served_model_name=name,
        model_path=name,
        max_context_length=ctx if 0 < ctx <= _MAX_CONTEXT else 0,
        vocab_size=vocab if 0 < vocab <= MAX_VOCAB else 0,
    )


def decode_trtllm_server_info(resp: Any) -> ServerInfo:
    return ServerInfo(
        kind="trtllm",
        version=resp.version,
        extra={
            "backend": resp.backend,
            "tensor_parallel_size": resp.tensor_parallel_size,
            "pipeline_parallel_size": resp.pipeline_parallel_size,
            "world_size": resp.world_size,
        },
    )


def trtllm_healthy(resp: Any) -> bool:
    """HealthCheck's ``status``: ``"OK"`` when healthy, else what is wrong (SMG's reading)."""
    return bool(resp.status.strip().lower() == "ok")
