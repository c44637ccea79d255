"""A TensorRT-LLM ``trtllm.TrtllmService`` that plays back, message by message, what TensorRT-LLM's own
servicer sends: NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/smg/servicer.py`` (``TrtllmServiceServicer``) over
``tensorrt_llm/grpc/smg/request_manager.py`` (``GrpcRequestManager``), the server SMG talks to with
lightseekorg/smg ``crates/grpc_client/src/trtllm_service.rs``.

What it reproduces, as read there:
- Generate, streaming: each engine step yields, per sequence that has new tokens, a ``chunk`` with only the
  new ids (``sequence_index``, ``prompt_tokens`` = prompt length, ``completion_tokens`` = that sequence's
  tokens so far, ``cached_tokens``, ``logprobs`` of the new tokens); when the result is finished, the same
  step then yields one ``complete`` per sequence whose ``output_token_ids`` hold *every* output token
  (cumulative, ``_complete_responses``), ``finish_reason`` as TensorRT-LLM names it ("stop", "length",
  "cancelled"), ``matched_token_id`` when a stop token id ended it (``stop_reason`` int), the
  generation ``logprobs`` of every token.
- Generate, not streaming: one result at the end: the completes only.
- n: ``num_return_sequences`` sequences (a finished one sends no more chunks; the completes come at the
  end, together).
- An engine-side abort: the result finishes ``cancelled`` (``GenerationResult.abort()``).
- A failure: ``context.abort(INTERNAL, str(e))`` (``INVALID_ARGUMENT`` for a ``ValueError``).
- HealthCheck: ``status`` "OK" or the error text (``GrpcRequestManager.health_check``).
- GetModelInfo: ``model_id``, ``max_input_len``, ``max_seq_len``, ``vocab_size``; GetServerInfo:
  ``version``, ``backend`` "tensorrt-llm", parallel sizes.
- SubscribeKvEvents: TensorRT-LLM's events as NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/kv_events.py``
  (``convert_batch``) puts them on the wire: one event per batch, numbered by a gateway-facing counter,
  ``stored`` blocks with ``block_size`` = their token count (TensorRT-LLM's tokens per block), hashes
  reduced to int64, ``parent_block_hash`` when the event has a parent; ``created`` / ``updated`` events
  have no wire form. (The servicer version read above answers it UNIMPLEMENTED: ``kv_unimplemented``.)
- No other service: SGLang's, vLLM's and MLX's calls answer UNIMPLEMENTED (grpc's unknown method).

What the engine generates is the test's: ``replies[i]`` is sequence i's text (then EOS), cut by
``stop_token_ids`` (kept in the output: the node asks ``include_stop_token_in_output``) and ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from smg_grpc_proto import trtllm_service_pb2 as tr
from smg_grpc_proto import trtllm_service_pb2_grpc as tr_grpc
from smg_grpc_proto.generated import common_pb2

from tests.contract.fake_service_thread import ServerThread, eos_id, reply_ids, tokenizer

Ctx = grpc.aio.ServicerContext[Any, Any]


@dataclass
class Script:
    replies: list[str] = field(default_factory=lambda: ["Hello from TensorRT-LLM."])
    cached_tokens: int = 0
    cancel_after: int | None = None  # the engine aborts the request after this many steps
    cancel_calls: int = 0  # the next this many Generate calls are aborted by the engine at once
    fail_after: int | None = None  # INTERNAL after this many steps (0: before any output)
    step_delay: float = 0.002
    health: str = "OK"


@dataclass
class _Seq:
    ids: list[int]
    finish: str
    stop_token: int | None


def _plan(script: Script, req: tr.GenerateRequest, index: int) -> _Seq:
    base = reply_ids(script.replies[index % len(script.replies)])
    ids = list(base) if req.ignore_eos else [*base, eos_id()]
    if req.ignore_eos:  # no EOS to stop at: the reply again and again, up to max_tokens
        while len(ids) < req.max_tokens:
            ids += base
    stops = set(req.stop_token_ids)
    if not req.ignore_eos:
        stops.add(eos_id())
    for i, t in enumerate(ids):
        if i >= req.max_tokens:
            return _Seq(ids[:i], "length", None)
        if t in stops:
            return _Seq(ids[: i + 1] if req.include_stop_token_in_output else ids[:i], "stop", t)
    return _Seq(ids[: req.max_tokens], "length", None)


def _logprob(tok: int, step: int, k: int) -> tr.TokenLogprob:
    lp = -0.25 - 0.01 * step
    # TokenLogprobs: the sampled token and the top-k alternatives (the servicer sends every dict entry)
    tops = [tr.TopLogprob(token_id=tok, logprob=lp)] + [
        tr.TopLogprob(token_id=tok + j, logprob=lp - j) for j in range(1, max(k, 1))
    ]
    return tr.TokenLogprob(token_id=tok, logprob=lp, top_logprobs=tops)


class FakeTrtllm(tr_grpc.TrtllmServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[tr.GenerateRequest] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # Generate calls the client cancelled (RST_STREAM)
        self.kv_batches: list[common_pb2.KvEventBatch] = []
        self.kv_unimplemented = False
        self.kv_subscriptions = 0
        # (request_id, traceparent, tracestate) of each Generate call, as its gRPC metadata carried them
        self.trace_contexts: list[tuple[str, str | None, str | None]] = []

    async def Generate(self, request: tr.GenerateRequest, context: Ctx) -> AsyncIterator[tr.GenerateResponse]:
        self.requests.append(request)
        md = dict(context.invocation_metadata() or ())
        tp, ts = md.get("traceparent"), md.get("tracestate")
        self.trace_contexts.append((request.request_id, str(tp) if tp else None, str(ts) if ts else None))
        s = self.script
        rid = request.request_id
        if not request.HasField("tokenized"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Missing tokenized input")
        prompt = len(request.tokenized.input_token_ids)
        n = max(1, request.sampling_config.num_return_sequences)
        seqs = [_plan(s, request, i) for i in range(n)]
        k = request.output_config.logprobs if request.output_config.HasField("logprobs") else None
        steps = max(len(q.ids) for q in seqs)
        cancelled = s.cancel_after is not None and s.cancel_after < steps
        if cancelled:
            steps = s.cancel_after or 0
        if s.cancel_calls > 0:
            s.cancel_calls -= 1
            cancelled, steps = True, 0
        try:
            for step in range(steps + 1):  # step ``steps``: the result is finished
                if s.fail_after is not None and step >= s.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "CUDA error: an illegal memory access")
                if step < steps and request.streaming:
                    for i, q in enumerate(seqs):
                        if step < len(q.ids):
                            delta = q.ids[step : step + 1]
                            chunk = tr.GenerateStreamChunk(
                                token_ids=delta,
                                sequence_index=i,
                                prompt_tokens=prompt,
                                completion_tokens=step + 1,
                                cached_tokens=s.cached_tokens,
                            )
                            if k is not None:
                                chunk.logprobs.append(_logprob(delta[0], step, k))
                            yield tr.GenerateResponse(request_id=rid, chunk=chunk)
                    await asyncio.sleep(s.step_delay)
                    continue
                if step < steps:
                    continue
                for i, q in enumerate(seqs):
                    out = q.ids[:steps] if cancelled else q.ids
                    c = tr.GenerateComplete(
                        output_token_ids=out,
                        sequence_index=i,
                        finish_reason="cancelled" if cancelled else q.finish,
                        prompt_tokens=prompt,
                        completion_tokens=len(out),
                        cached_tokens=s.cached_tokens,
                    )
                    if not cancelled and q.stop_token is not None:
                        c.matched_token_id = q.stop_token
                    if k is not None:
                        c.logprobs.extend(_logprob(t, j, k) for j, t in enumerate(out))
                    yield tr.GenerateResponse(request_id=rid, complete=c)
        except (asyncio.CancelledError, GeneratorExit):
            # cancelled while awaiting, or closed at a ``yield`` (grpc.aio closes the generator when the
            # client's RST_STREAM lands while a message is being sent): either way the call ended under it
            self.cancelled.append(rid)
            raise

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Ctx
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        self.kv_subscriptions += 1
        if self.kv_unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        for b in self.kv_batches:
            yield b
        await asyncio.sleep(30)  # a live stream stays open (the client cancels it)

    async def HealthCheck(self, request: tr.HealthCheckRequest, context: Ctx) -> tr.HealthCheckResponse:
        return tr.HealthCheckResponse(status=self.script.health)

    async def Abort(self, request: tr.AbortRequest, context: Ctx) -> tr.AbortResponse:
        self.aborts.append(request.request_id)
        return tr.AbortResponse(success=False, message=f"Request {request.request_id} not found")

    async def GetModelInfo(self, request: tr.GetModelInfoRequest, context: Ctx) -> tr.GetModelInfoResponse:
        return tr.GetModelInfoResponse(
            model_id="/models/Qwen3-0.6B", max_input_len=4096, max_seq_len=8192, vocab_size=151936
        )

    async def GetServerInfo(self, request: tr.GetServerInfoRequest, context: Ctx) -> tr.GetServerInfoResponse:
        return tr.GetServerInfoResponse(
            version="1.2.0rc1",
            backend="tensorrt-llm",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=1,
        )


def start_fake_trtllm(port: int = 0) -> tuple[FakeTrtllm, ServerThread]:
    tokenizer()  # loaded before serving: its seconds of loading would stall the server's loop
    fake = FakeTrtllm()
    server = ServerThread(lambda s: tr_grpc.add_TrtllmServiceServicer_to_server(fake, s), port)
    server.start()
    return fake, server


def trtllm_kv_batch(
    seq: int, event_id: int, blocks: list[tuple[int, list[int]]], parent: int | None
) -> common_pb2.KvEventBatch:
    """A ``stored`` event as ``convert_batch`` (tensorrt_llm/grpc/kv_events.py) sends it: the engine's
    unsigned 64-bit hashes reduced to int64, one event per batch."""

    def to_int64(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    stored = common_pb2.KvBlocksStored(
        blocks=[
            common_pb2.KvBlock(block_hash=to_int64(h), token_ids=toks, block_size=len(toks))
            for h, toks in blocks
        ]
    )
    if parent is not None:
        stored.parent_block_hash = to_int64(parent)
    return common_pb2.KvEventBatch(
        sequence_number=seq, events=[common_pb2.KvCacheEvent(event_id=event_id, stored=stored)]
    )
