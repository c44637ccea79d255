"""An ``mlx.grpc.engine.MlxEngine`` that plays back, message by message, what SMG's MLX servicer sends:
lightseekorg/smg ``grpc_servicer/smg_grpc_servicer/mlx/servicer.py`` (``MlxEngineServicer``), the server
SMG's own client (lightseekorg/smg ``crates/grpc_client/src/mlx_engine.rs``) talks to.

What it reproduces, as read there (``Generate``):
- streaming: one ``chunk`` per generated token (``token_ids=[token]``, ``index`` 0, ``prompt_tokens``,
  ``completion_tokens`` counted so far, ``cached_tokens`` 0, ``output_logprobs`` of that token when
  ``logprobs`` > 0: its id, its logprob, its top list); the token that finishes the sequence comes in a
  chunk too, then a ``complete`` with ``output_ids=[]``, the finish reason ("stop" or "length") and
  ``matched_stop_token_id`` when a single-token stop sequence (EOS or a stop token id) matched.
- not streaming: one ``complete`` with every id and the aggregated logprobs.
- an Abort (the servicer's sentinel): the stream simply ends, status OK, no complete.
- a failure: ``context.abort(INTERNAL, str(e))``; input not tokenized: ``INVALID_ARGUMENT``.
- HealthCheck: ``healthy`` and ``message``; GetModelInfo from the model's config (``max_context_length``
  from ``max_position_embeddings``); GetServerInfo: ``server_type`` "mlx-grpc", ``active_requests``.
- No other service: SGLang's, vLLM's and TensorRT-LLM's calls answer UNIMPLEMENTED.

What the engine generates is the test's: ``reply`` (then EOS), stopped by EOS / ``stop_token_ids`` (the
stop token is part of the output, as mlx-lm's state machine emits it) or ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from smg_grpc_proto import mlx_engine_pb2 as mx
from smg_grpc_proto import mlx_engine_pb2_grpc as mx_grpc
from smg_grpc_proto.generated import common_pb2

from shepherd.mock_engine.tokenizer_zip import build_tokenizer_zip
from tests.contract.fake_service_thread import ServerThread, eos_id, reply_ids, tokenizer

Ctx = grpc.aio.ServicerContext[Any, Any]


@dataclass
class Script:
    reply: str = "Hello from MLX."
    abort_after: int | None = None  # the servicer's Abort sentinel after this many tokens
    abort_calls: int = 0  # the next this many Generate calls end at once, as after an Abort
    fail_after: int | None = None  # INTERNAL after this many tokens (0: before any)
    step_delay: float = 0.002
    healthy: bool = True


def _logprobs(tok: int, step: int, k: int) -> mx.OutputLogProbs:
    lp = -0.5 - 0.01 * step
    top = mx.TopLogProbs(token_ids=[tok + j for j in range(k)], values=[lp - j for j in range(k)])
    return mx.OutputLogProbs(token_ids=[tok], token_logprobs=[lp], top_logprobs=[top])


class FakeMlx(mx_grpc.MlxEngineServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[mx.GenerateRequest] = []
        self.aborts: list[str] = []
        self.active = 0
        self.model_dir: Path | None = None  # GetTokenizer serves this directory (None: no tokenizer)
        self.tokenizer_calls = 0
        # (request_id, traceparent, tracestate) of each Generate call, as its gRPC metadata carried them
        self.trace_contexts: list[tuple[str, str | None, str | None]] = []

    def _plan(self, req: mx.GenerateRequest) -> tuple[list[int], str, int | None]:
        sp = req.sampling_params
        base = reply_ids(self.script.reply)
        ids = list(base) if sp.ignore_eos else [*base, eos_id()]
        limit = sp.max_tokens if sp.HasField("max_tokens") else 256
        while sp.ignore_eos and len(ids) < limit:
            ids += base
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {eos_id()})
        for i, t in enumerate(ids):
            if i >= limit:
                return ids[:i], "length", None
            if t in stops:
                return ids[: i + 1], "stop", t
        return ids[:limit], "length", None

    async def Generate(self, request: mx.GenerateRequest, context: Ctx) -> AsyncIterator[mx.GenerateResponse]:
        self.requests.append(request)
        md = dict(context.invocation_metadata() or ())
        tp, ts = md.get("traceparent"), md.get("tracestate")
        self.trace_contexts.append((request.request_id, str(tp) if tp else None, str(ts) if ts else None))
        if request.WhichOneof("input") != "tokenized":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "MLX servicer requires tokenized input")
        s = self.script
        sp = request.sampling_params
        k = sp.logprobs if sp.HasField("logprobs") and sp.logprobs > 0 else None
        ids, finish, matched = self._plan(request)
        prompt = len(request.tokenized.input_ids)
        if s.abort_calls > 0:
            s.abort_calls -= 1
            return
        self.active += 1
        try:
            out: list[int] = []
            lp = mx.OutputLogProbs()
            for step, tok in enumerate(ids):
                if s.fail_after is not None and step >= s.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "[metal::malloc] Resource limit exceeded")
                if s.abort_after is not None and step >= s.abort_after:
                    return  # the Abort sentinel: the stream ends, no complete
                out.append(tok)
                step_lp = _logprobs(tok, step, k) if k is not None else None
                if request.stream:
                    chunk = mx.GenerateStreamChunk(
                        token_ids=[tok],
                        prompt_tokens=prompt,
                        completion_tokens=step + 1,
                        cached_tokens=0,
                        index=0,
                    )
                    if step_lp is not None:
                        chunk.output_logprobs.CopyFrom(step_lp)
                    yield mx.GenerateResponse(chunk=chunk)
                    await asyncio.sleep(s.step_delay)
                elif step_lp is not None:
                    lp.token_ids.extend(step_lp.token_ids)
                    lp.token_logprobs.extend(step_lp.token_logprobs)
                    lp.top_logprobs.extend(step_lp.top_logprobs)
            c = mx.GenerateComplete(
                output_ids=[] if request.stream else out,
                finish_reason=finish,
                prompt_tokens=prompt,
                completion_tokens=len(out),
                cached_tokens=0,
                index=0,
            )
            if matched is not None:
                c.matched_stop_token_id = matched
            if not request.stream and k is not None:
                c.output_logprobs.CopyFrom(lp)
            yield mx.GenerateResponse(complete=c)
        finally:
            self.active -= 1

    async def HealthCheck(self, request: mx.HealthCheckRequest, context: Ctx) -> mx.HealthCheckResponse:
        ok = self.script.healthy
        return mx.HealthCheckResponse(healthy=ok, message="OK" if ok else "generation thread exited")

    async def Abort(self, request: mx.AbortRequest, context: Ctx) -> mx.AbortResponse:
        self.aborts.extend(request.request_ids)
        return mx.AbortResponse()

    async def GetModelInfo(self, request: mx.GetModelInfoRequest, context: Ctx) -> mx.GetModelInfoResponse:
        return mx.GetModelInfoResponse(
            model_path="mlx-community/Qwen3-0.6B-4bit",
            is_generation=True,
            max_context_length=40960,
            vocab_size=151936,
            served_model_name="mlx-community/Qwen3-0.6B-4bit",
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            eos_token_ids=[eos_id()],
            bos_token_id=0,
            max_req_input_len=40960,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Ctx
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """SMG's ``GetTokenizer``: the model directory's tokenizer files as a zip in chunks, the sha256 on
        the last one; a failure is ``context.abort(INTERNAL, ...)``."""
        self.tokenizer_calls += 1
        if self.model_dir is None:
            await context.abort(grpc.StatusCode.INTERNAL, "no tokenizer files in the model directory")
        archive = build_tokenizer_zip(self.model_dir)
        parts = archive.chunks(4096)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            yield common_pb2.GetTokenizerChunk(data=part, sha256=archive.sha256 if last else "")

    async def GetServerInfo(self, request: mx.GetServerInfoRequest, context: Ctx) -> mx.GetServerInfoResponse:
        return mx.GetServerInfoResponse(
            server_type="mlx-grpc", active_requests=self.active, uptime_seconds=12.5
        )


def start_fake_mlx() -> tuple[FakeMlx, ServerThread]:
    tokenizer()  # loaded before serving: its seconds of loading would stall the server's loop
    fake = FakeMlx()
    server = ServerThread(lambda s: mx_grpc.add_MlxEngineServicer_to_server(fake, s))
    server.start()
    return fake, server
