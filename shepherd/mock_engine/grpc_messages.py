"""The protobuf side the mock engine's SGLang and vLLM servicers share (``grpc_services``): messages built
from the core's values (``logprobs_pb``, ``scheduler_load`` for GetLoads), the SubscribeKvEvents stream
(``kv_event_stream``: KV event batches with the engine's load attached, load-only records, heartbeats)
and the GetTokenizer stream (``tokenizer_chunks``, over the archive ``Tokenizers`` builds once).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from smg_grpc_proto import sglang_scheduler_pb2
from smg_grpc_proto.generated import common_pb2

from shepherd.mock_engine.cache import AllBlocksCleared, BlockRemoved, BlockStored
from shepherd.mock_engine.engine import EngineCore
from shepherd.mock_engine.kv_events import KvBatch
from shepherd.mock_engine.requests import MockRpcError
from shepherd.mock_engine.scheduler import LoadSnapshot
from shepherd.mock_engine.tokenizer_zip import TokenizerArchive, build_tokenizer_zip
from shepherd.proto.engine_types import PromptLogprobs, TokenLogprob

__all__ = [
    "Tokenizers",
    "input_logprobs_pb",
    "kv_event_pb",
    "kv_event_stream",
    "logprobs_pb",
    "scheduler_load",
    "tokenizer_chunks",
]

KV_HEARTBEAT_S = 1.0
KV_COALESCE_S = 0.005

SGL = sglang_scheduler_pb2


def input_logprobs_pb(module: Any, plp: PromptLogprobs) -> Any:
    """The dialect's InputLogProbs, as its servicer fills them: a value per position but the first's,
    every prompt id, and alternatives per position (the first's empty) only when some were asked."""
    return module.InputLogProbs(
        token_logprobs=[
            module.InputTokenLogProb() if v is None else module.InputTokenLogProb(value=v)
            for v in plp.logprobs
        ],
        token_ids=plp.token_ids,
        top_logprobs=[
            module.TopLogProbs(values=[v for _, v in top], token_ids=[t for t, _ in top])
            for top in (plp.top(i) for i in range(len(plp)))
        ]
        if plp.top_ids
        else [],
    )


def logprobs_pb(module: Any, lps: Sequence[TokenLogprob]) -> Any:
    return module.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps],
        token_ids=[lp.token_id for lp in lps],
        top_logprobs=[
            module.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in lps
        ],
    )


class Tokenizers:
    """The tokenizer archive, built once on first use (off the event loop)."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._archive: TokenizerArchive | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> TokenizerArchive:
        async with self._lock:
            if self._archive is None:
                self._archive = await asyncio.to_thread(build_tokenizer_zip, self._directory)
            return self._archive


def kv_event_pb(ev: BlockStored | BlockRemoved | AllBlocksCleared) -> Any:
    if isinstance(ev, BlockStored):
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=h, token_ids=toks, block_size=ev.block_size)
                for h, toks in zip(ev.block_hashes, ev.token_ids, strict=True)
            ]
        )
        if ev.parent_hash is not None:
            stored.parent_block_hash = ev.parent_hash
        return common_pb2.KvCacheEvent(event_id=ev.event_id, stored=stored)
    if isinstance(ev, BlockRemoved):
        return common_pb2.KvCacheEvent(
            event_id=ev.event_id, removed=common_pb2.KvBlocksRemoved(block_hashes=ev.block_hashes)
        )
    return common_pb2.KvCacheEvent(event_id=ev.event_id, cleared=common_pb2.KvCacheCleared())


def _engine_load_pb(load: LoadSnapshot, sample: int, *, load_only: bool, telemetry: bool) -> Any:
    msg = common_pb2.EngineLoad(
        running_requests=load.running,
        waiting_requests=load.waiting,
        waiting_uncached_tokens=load.waiting_uncached_tokens,
        token_usage=load.token_usage,
        active_token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        max_running_requests=load.max_running,
        age_ms=0,
        sample=sample,
        load_only=load_only,
        prefill_pending_tokens=load.prefill_pending_tokens,
    )
    if telemetry:
        msg.cache_hit_rate = load.cache_hit_rate
        msg.num_used_tokens = load.used_tokens
        msg.max_total_num_tokens = load.max_total_tokens
    return msg


async def kv_event_stream(core: EngineCore, request: Any) -> AsyncIterator[Any]:
    """SubscribeKvEvents: batches from real cache changes, each with the engine's load attached;
    load-only records (numbered with the last sequence sent) when the load changes without a KV event
    and as a heartbeat while idle."""
    sub = core.kv_log.subscribe(request.start_sequence_number)
    early_loads = request.load_records_before_first_batch
    sample = 0
    last_seq = 0
    sent_batch = False
    try:
        if early_loads:
            sample += 1
            yield common_pb2.KvEventBatch(
                sequence_number=0,
                timestamp=core.wallclock(),
                load=_engine_load_pb(core.loads(), sample, load_only=True, telemetry=True),
            )
        while True:
            await sub.wait(KV_HEARTBEAT_S)
            if sub.overflowed:
                raise MockRpcError("RESOURCE_EXHAUSTED", "KV event subscriber fell too far behind")
            batches: list[KvBatch] = sub.take()
            dirty = sub.load_dirty
            sub.load_dirty = False
            load = core.loads()
            if batches:
                for batch in batches:
                    sample += 1
                    yield common_pb2.KvEventBatch(
                        sequence_number=batch.sequence_number,
                        timestamp=batch.timestamp,
                        events=[kv_event_pb(ev) for ev in batch.events],
                        load=_engine_load_pb(load, sample, load_only=False, telemetry=not sent_batch),
                    )
                    sent_batch = True
                last_seq = batches[-1].sequence_number
            elif sent_batch or early_loads:
                sample += 1
                yield common_pb2.KvEventBatch(
                    sequence_number=last_seq,
                    timestamp=core.wallclock(),
                    load=_engine_load_pb(load, sample, load_only=True, telemetry=True),
                )
            if dirty:
                await asyncio.sleep(KV_COALESCE_S)
    finally:
        sub.close()


async def tokenizer_chunks(tokenizers: Tokenizers) -> AsyncIterator[Any]:
    archive = await tokenizers.get()
    chunks = archive.chunks()
    for i, data in enumerate(chunks):
        last = i == len(chunks) - 1
        yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")


def scheduler_load(module: Any, load: LoadSnapshot, include: Sequence[str], role: str) -> Any:
    msg = module.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=load.running,
        num_waiting_reqs=load.waiting,
        num_total_reqs=load.running + load.waiting,
        num_used_tokens=load.used_tokens,
        max_total_num_tokens=load.max_total_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        cache_hit_rate=load.cache_hit_rate,
        utilization=load.utilization,
        max_running_requests=load.max_running,
        num_waiting_uncached_tokens=load.waiting_uncached_tokens,
    )
    if module is SGL:
        sections = set(include)
        every = "all" in sections
        if every or "memory" in sections:
            msg.memory.CopyFrom(SGL.MemoryMetrics(token_capacity=load.max_total_tokens))
        if every or "queues" in sections:
            msg.queues.CopyFrom(SGL.QueueMetrics(waiting=load.waiting))
        if every or "disagg" in sections:
            msg.disaggregation.CopyFrom(SGL.DisaggregationMetrics(mode="null" if role == "both" else role))
    return msg
