"""The MLX engine's ``mlx.grpc.engine.MlxEngine`` (smg-grpc-proto ``mlx_engine.proto``) <-> our engine types.

``mlx_generate``: a ``GenerateRequest`` -> the service's GenerateRequest, refusing (``EngineError``
``invalid_request``, naming the field) what MLX cannot honour, as SMG's MLX client does
(lightseekorg/smg ``crates/grpc_client/src/mlx_engine.rs``): n > 1, structured outputs, min_tokens,
PD parameters. Stop strings are the gateway's own work (it detokenizes and stops; the engine gets stop
token ids only), so they are honoured on MLX too. ``MlxEvents``: one Generate call's responses -> our
events, as SMG's MLX servicer (lightseekorg/smg ``grpc_servicer/smg_grpc_servicer/mlx/servicer.py``)
sends them: streaming, one chunk per token (index 0) then a ``GenerateComplete`` with no ids; not
streaming, one complete with every id. An Abort ends the stream with status OK and no complete: an
``EngineError`` here. ``decode_mlx_server_info``: the other answer (GetModelInfo has SGLang's and vLLM's
field names: ``engine_responses.decode_model_info`` reads it).
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto import mlx_engine_pb2 as mx

from shepherd.proto.engine_requests import fold_seed
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    ServerInfo,
    TokenLogprob,
)
from shepherd.proto.trtllm_codec import refuse

MLX_SERVICE = "mlx.grpc.engine.MlxEngine"

# mlx-lm's BatchGenerator ends a sequence with "stop" (EOS, a stop token) or "length"
_FINISH = {"": "stop", "stop": "stop", "length": "length"}


def mlx_generate(req: GenerateRequest) -> mx.GenerateRequest:
    """``req`` as MlxEngine's GenerateRequest; raises ``EngineError`` (invalid_request) naming a field MLX
    cannot honour."""
    p = req.sampling
    if p.n != 1:
        raise refuse("MLX", "n > 1", "the MLX engine generates one sequence per request")
    constraint = next(
        (
            name
            for name, on in (
                ("json_schema", p.json_schema is not None),
                ("regex", p.regex is not None),
                ("ebnf", p.ebnf is not None),
                ("structural_tag", p.structural_tag is not None),
                ("choice", p.choice is not None),
                ("json_object", p.json_object),
            )
            if on
        ),
        None,
    )
    if constraint is not None:
        raise refuse(
            "MLX",
            f"structured outputs ({constraint}: response_format or a forced tool call)",
            "the MLX engine has no constrained decoding",
        )
    if p.min_new_tokens:
        raise refuse("MLX", "min_tokens", "the MLX engine has no minimum output length")
    if req.prompt_logprobs is not None:
        raise refuse(
            "MLX",
            "prompt_logprobs (or echo with logprobs)",
            "the MLX engine does not return the prompt's logprobs",
        )
    if req.bootstrap_host is not None or req.kv_transfer_params_json is not None:
        raise refuse("MLX", "PD disaggregation parameters", "the MLX engine serves whole requests only")
    sp = mx.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),  # ours: -1 is every token; mlx-lm's: 0
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    if p.max_new_tokens is not None:
        sp.max_tokens = p.max_new_tokens
    if p.seed is not None:
        sp.seed = fold_seed(p.seed)
    if req.logprobs:
        # the servicer sends none for 0: ask for 1 (the sampled token's logprob comes with it), cut back
        sp.logprobs = max(1, req.top_logprobs)
    for tok, b in p.logit_bias:
        sp.logit_bias[tok] = b
    return mx.GenerateRequest(
        request_id=req.request_id,
        tokenized=mx.TokenizedInput(original_text=req.text, input_ids=req.input_ids),
        sampling_params=sp,
        stream=req.stream,
    )


def _logprobs(lp: Any, top: int) -> list[TokenLogprob]:
    """OutputLogProbs -> ours; each token's top list cut to the ``top`` asked for."""
    ids = lp.token_ids
    vals = lp.token_logprobs
    tops = lp.top_logprobs
    out: list[TokenLogprob] = []
    for i, tid in enumerate(ids):
        t = tops[i] if i < len(tops) else None
        pairs = tuple(zip(t.token_ids, t.values, strict=False))[:top] if t is not None else ()
        out.append(TokenLogprob(int(tid), float(vals[i]) if i < len(vals) else 0.0, pairs))
    return out


class MlxEvents:
    """One Generate call's responses -> our events (see the module doc)."""

    __slots__ = ("_chunked", "_done", "_top")

    def __init__(self, req: GenerateRequest) -> None:
        self._top = req.top_logprobs
        self._chunked = False
        self._done = False

    def decode(self, resp: Any) -> EngineEvent | None:
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            c = resp.chunk
            if not c.token_ids:
                return None
            self._chunked = True
            return EngineChunk(
                c.index,
                list(c.token_ids),
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
                _logprobs(c.output_logprobs, self._top) if c.HasField("output_logprobs") else [],
            )
        if kind != "complete":
            return None
        c = resp.complete
        reason = _FINISH.get(c.finish_reason)
        if reason is None:
            raise EngineError(
                f"MLX worker failed the request: finish reason {c.finish_reason!r}", retryable=True
            )
        self._done = True
        seen = self._chunked
        return EngineComplete(
            c.index,
            reason,
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            () if seen else list(c.output_ids),
            c.matched_stop_token_id if c.HasField("matched_stop_token_id") else None,
            None,
            _logprobs(c.output_logprobs, self._top) if not seen and c.HasField("output_logprobs") else (),
        )

    def end(self) -> None:
        """The stream ended OK: without its complete it was aborted (the servicer's sentinel)."""
        if not self._done:
            raise EngineError(
                "MLX worker ended the stream before the choice finished (aborted)", retryable=True
            )


def decode_mlx_server_info(resp: Any) -> ServerInfo:
    return ServerInfo(
        kind="mlx",
        active_requests=int(resp.active_requests),
        extra={"server_type": resp.server_type, "uptime_seconds": resp.uptime_seconds},
    )


def mlx_load(resp: Any) -> EngineLoad:
    """MLX has no GetLoads: its running requests are GetServerInfo's ``active_requests``."""
    return EngineLoad(running=int(resp.active_requests))
