"""gRPC servicers of the mock engine: ``sglang.grpc.scheduler.SglangScheduler`` and
``vllm.grpc.engine.VllmEngine`` (grpc.aio), thin translations between protobuf and ``EngineCore``.

In a streaming Generate the tokens travel in chunks and the final complete carries no output_ids;
with ``stream=false`` only the complete(s) are sent, with all output_ids. A client that cancels the
stream frees the request's slot (the run is closed by the handler's ``finally`` and by the RPC's
done callback, whichever comes first).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf import json_format, struct_pb2, timestamp_pb2
from smg_grpc_proto import (
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)
from smg_grpc_proto.generated import common_pb2

from shepherd.mock_engine.cache import AllBlocksCleared, BlockRemoved, BlockStored
from shepherd.mock_engine.engine import EngineCore, MockRequest, MockRpcError, Run
from shepherd.mock_engine.kv_events import KvBatch
from shepherd.mock_engine.lean_grpc import LeanGrpcServer
from shepherd.mock_engine.outputs import OutputSpec
from shepherd.mock_engine.pd_check import BootstrapClient, verify_decode
from shepherd.mock_engine.scheduler import LoadSnapshot
from shepherd.mock_engine.tokenizer_zip import TokenizerArchive, build_tokenizer_zip
from shepherd.mock_engine.wire import ChunkWire
from shepherd.proto.engine_types import EngineChunk, EngineEvent, TokenLogprob

KV_HEARTBEAT_S = 1.0
KV_COALESCE_S = 0.005
MAX_TOP_LOGPROBS = 20

SGL = sglang_scheduler_pb2
VLLM = vllm_engine_pb2


def _status(code: str) -> grpc.StatusCode:
    status = getattr(grpc.StatusCode, code, None)
    return status if isinstance(status, grpc.StatusCode) else grpc.StatusCode.INTERNAL


def _to_dict(message: Any) -> dict[str, object]:
    out: dict[str, object] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return out


def _lazy_dict(message: Any) -> Callable[[], dict[str, object]]:
    return lambda: _to_dict(message)


def _iso_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _logprobs_pb(module: Any, lps: Sequence[TokenLogprob]) -> Any:
    return module.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps],
        token_ids=[lp.token_id for lp in lps],
        top_logprobs=[
            module.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in lps
        ],
    )


def _close_on_done(context: Any, run: Run) -> None:
    context.add_done_callback(lambda _ctx: run.close())


class _Tokenizers:
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


# ---- shared pieces -------------------------------------------------------------------------------


def _kv_event_pb(ev: BlockStored | BlockRemoved | AllBlocksCleared) -> Any:
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


async def _kv_event_stream(core: EngineCore, request: Any) -> AsyncIterator[Any]:
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
                        events=[_kv_event_pb(ev) for ev in batch.events],
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


async def _tokenizer_chunks(tokenizers: _Tokenizers) -> AsyncIterator[Any]:
    archive = await tokenizers.get()
    chunks = archive.chunks()
    for i, data in enumerate(chunks):
        last = i == len(chunks) - 1
        yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")


def _scheduler_load(module: Any, load: LoadSnapshot, include: Sequence[str], role: str) -> Any:
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


# ---- SGLang ----------------------------------------------------------------------------------------


class _Service:
    """What the SGLang and vLLM servicers share; ``KIND`` names the service, ``_request`` and
    ``_response`` translate its messages."""

    KIND = ""

    def __init__(self, core: EngineCore, tokenizers: _Tokenizers, *, raw_chunks: bool = False) -> None:
        """``raw_chunks``: yield streamed chunks as pre-encoded bytes (servers that pass bytes through)."""
        self._core = core
        self._tokenizers = tokenizers
        self._raw_chunks = raw_chunks
        self._bootstrap = BootstrapClient()  # a decode-role engine asks its prefill side (pd_check)

    def _request(self, request: Any) -> MockRequest:
        raise NotImplementedError

    def _response(self, rid: str, ev: EngineEvent) -> Any:
        raise NotImplementedError

    def _wire(self, request_id: str, run: Run) -> ChunkWire | None:
        if not self._raw_chunks or not run.req.stream:
            return None
        g = run.group
        return ChunkWire(self.KIND, request_id, len(g.prompt), g.cached_tokens)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        core = self._core
        core.stats.count_rpc(f"{self.KIND}.Generate")
        try:
            mreq = self._request(request)
            if core.config.role == "decode":
                await verify_decode(mreq, self._bootstrap, wait_s=core.config.pd_wait_s)
            run = core.start(mreq)
        except MockRpcError as e:
            await context.abort(_status(e.code), e.message)
            return
        _close_on_done(context, run)
        rid = request.request_id
        wire = self._wire(rid, run)
        try:
            if wire is not None:
                ready = run.take_ready()
                if ready is not None:  # zero latency: the whole stream at once, as a list of messages
                    yield [
                        wire.chunk(ev.token_ids, ev.completion_tokens, ev.index)
                        if type(ev) is EngineChunk and not ev.logprobs
                        else self._response(rid, ev).SerializeToString()
                        for ev in ready
                    ]
                    return
            async for ev in run.events():
                if wire is not None and type(ev) is EngineChunk and not ev.logprobs:
                    yield wire.chunk(ev.token_ids, ev.completion_tokens, ev.index)
                else:
                    yield self._response(rid, ev)
        finally:
            run.close()

    async def FlushCache(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc(f"{self.KIND}.FlushCache")
        ok = self._core.flush_cache()
        return common_pb2.FlushCacheResponse(success=ok, message="" if ok else "requests in flight")

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self._core.stats.count_rpc(f"{self.KIND}.GetTokenizer")
        async for chunk in _tokenizer_chunks(self._tokenizers):
            yield chunk

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self._core.stats.count_rpc(f"{self.KIND}.SubscribeKvEvents")
        try:
            async for batch in _kv_event_stream(self._core, request):
                yield batch
        except MockRpcError as e:
            await context.abort(_status(e.code), e.message)


class SglangService(_Service, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    KIND = "sglang"

    def _request(self, request: Any) -> MockRequest:
        core = self._core
        sp = request.sampling_params
        stats = core.stats
        stats.last_request_kind = "sglang"
        stats.last_sampling_params = _lazy_dict(sp)
        stats.record_constraint(request.request_id, sp)
        disagg = request.HasField("disaggregated_params") and bool(
            request.disaggregated_params.bootstrap_host
        )
        if request.HasField("disaggregated_params"):
            stats.last_disaggregated_params = _lazy_dict(request.disaggregated_params)
            stats.disaggregated_requests += 1
        return MockRequest(
            request_id=request.request_id,
            prompt=tuple(request.tokenized.input_ids),
            spec=OutputSpec(
                max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
                min_new_tokens=sp.min_new_tokens,
                stop_token_ids=frozenset(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos,
                greedy=sp.temperature == 0.0,
            ),
            n=sp.n or 1,
            stream=request.stream,
            stream_interval=sp.stream_interval if sp.HasField("stream_interval") else None,
            logprobs=request.return_logprob,
            top_logprobs=min(max(request.top_logprobs_num, 0), MAX_TOP_LOGPROBS),
            prompt_text=request.tokenized.original_text,
            disaggregated=disagg,
            bootstrap_host=request.disaggregated_params.bootstrap_host if disagg else None,
            bootstrap_port=request.disaggregated_params.bootstrap_port if disagg else None,
            bootstrap_room=request.disaggregated_params.bootstrap_room if disagg else None,
        )

    def _response(self, rid: str, ev: EngineEvent) -> Any:
        if isinstance(ev, EngineChunk):
            chunk = SGL.GenerateStreamChunk(
                token_ids=ev.token_ids,
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens,
                index=ev.index,
            )
            if ev.logprobs:
                chunk.output_logprobs.CopyFrom(_logprobs_pb(SGL, ev.logprobs))
            return SGL.GenerateResponse(request_id=rid, chunk=chunk)
        complete = SGL.GenerateComplete(
            output_ids=ev.output_ids,
            finish_reason=ev.finish_reason,
            prompt_tokens=ev.prompt_tokens,
            completion_tokens=ev.completion_tokens,
            cached_tokens=ev.cached_tokens,
            index=ev.index,
        )
        if ev.matched_token_id is not None:
            complete.matched_token_id = ev.matched_token_id
        if ev.logprobs:
            complete.output_logprobs.CopyFrom(_logprobs_pb(SGL, ev.logprobs))
        return SGL.GenerateResponse(request_id=rid, complete=complete)

    async def Abort(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("sglang.Abort")
        found = self._core.abort(request.request_id)
        return SGL.AbortResponse(
            success=found, message=f"request {request.request_id} {'aborted' if found else 'not found'}"
        )

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("sglang.HealthCheck")
        return SGL.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("sglang.GetModelInfo")
        cfg = core.config
        return SGL.GetModelInfoResponse(
            model_path=cfg.model,
            tokenizer_path=cfg.tokenizer_path,
            is_generation=True,
            weight_version="mock",
            served_model_name=cfg.model,
            max_context_length=cfg.context_length,
            vocab_size=core.tokenizer.vocab_size,
            supports_vision=False,
            model_type="mock",
            eos_token_ids=list(core.tokenizer.eos_token_ids),
            max_req_input_len=cfg.context_length - 1,
            architectures=["MockForCausalLM"],
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("sglang.GetServerInfo")
        cfg = core.config
        load = core.loads()
        server_args = struct_pb2.Struct()
        server_args.update(
            {
                "model_path": cfg.model,
                "served_model_name": cfg.model,
                "tokenizer_path": cfg.tokenizer_path,
                "context_length": cfg.context_length,
                "max_running_requests": cfg.max_running,
                "page_size": cfg.block_size,
                "tp_size": 1,
                "dp_size": 1,
                "disaggregation_mode": "null" if cfg.role == "both" else cfg.role,
                "random_seed": cfg.seed,
            }
        )
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(
            {
                "max_total_num_tokens": load.max_total_tokens,
                "max_running_requests": cfg.max_running,
                "max_req_input_len": cfg.context_length - 1,
            }
        )
        start = timestamp_pb2.Timestamp()
        start.FromNanoseconds(int(core.started_at * 1e9))
        return SGL.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=core.active_requests,
            is_paused=False,
            last_receive_timestamp=core.last_receive_time,
            uptime_seconds=core.wallclock() - core.started_at,
            sglang_version="mock",
            server_type="grpc",
            start_time=start,
            max_total_num_tokens=load.max_total_tokens,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("sglang.GetLoads")
        load = core.loads()
        return SGL.GetLoadsResponse(
            timestamp=_iso_now(),
            version="mock",
            dp_rank_count=1,
            loads=[_scheduler_load(SGL, load, list(request.include), core.config.role)],
            aggregate=SGL.AggregateMetrics(
                total_running_reqs=load.running,
                total_waiting_reqs=load.waiting,
                total_reqs=load.running + load.waiting,
                avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput,
                avg_utilization=load.utilization,
            ),
        )


# ---- vLLM ------------------------------------------------------------------------------------------


class VllmService(_Service, vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    KIND = "vllm"

    def _request(self, request: Any) -> MockRequest:
        core = self._core
        sp = request.sampling_params
        stats = core.stats
        stats.last_request_kind = "vllm"
        stats.last_sampling_params = _lazy_dict(sp)
        stats.record_constraint(request.request_id, sp)
        if request.HasField("tokenized"):
            prompt = tuple(request.tokenized.input_ids)
            text = request.tokenized.original_text
        else:
            text = request.text
            prompt = tuple(core.tokenizer.encode(text)) if text else ()
        kv_json: str | None = None
        if request.HasField("kv_transfer_params_json"):
            kv_json = request.kv_transfer_params_json
            stats.last_kv_transfer_params_json = kv_json
            stats.disaggregated_requests += 1
        want_lp = sp.HasField("logprobs")
        top = sp.logprobs if want_lp else 0
        return MockRequest(
            request_id=request.request_id,
            prompt=prompt,
            spec=OutputSpec(
                max_new_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
                min_new_tokens=sp.min_tokens,
                stop_token_ids=frozenset(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos,
                greedy=sp.HasField("temperature") and sp.temperature == 0.0,
                seed=sp.seed if sp.HasField("seed") else None,
            ),
            n=sp.n or 1,
            stream=request.stream,
            logprobs=want_lp,
            top_logprobs=MAX_TOP_LOGPROBS if top < 0 else min(top, MAX_TOP_LOGPROBS),
            prompt_text=text,
            kv_transfer_params_json=kv_json,
        )

    def _response(self, rid: str, ev: EngineEvent) -> Any:
        if isinstance(ev, EngineChunk):
            chunk = VLLM.GenerateStreamChunk(
                token_ids=ev.token_ids,
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens,
                index=ev.index,
            )
            if ev.logprobs:
                chunk.output_logprobs.CopyFrom(_logprobs_pb(VLLM, ev.logprobs))
            return VLLM.GenerateResponse(chunk=chunk)
        complete = VLLM.GenerateComplete(
            output_ids=ev.output_ids,
            finish_reason=ev.finish_reason,
            prompt_tokens=ev.prompt_tokens,
            completion_tokens=ev.completion_tokens,
            cached_tokens=ev.cached_tokens,
            index=ev.index,
        )
        if ev.matched_token_id is not None:
            complete.matched_token_id = ev.matched_token_id
        if ev.kv_transfer_params_json is not None:
            complete.kv_transfer_params_json = ev.kv_transfer_params_json
        if ev.logprobs:
            complete.output_logprobs.CopyFrom(_logprobs_pb(VLLM, ev.logprobs))
        return VLLM.GenerateResponse(complete=complete)

    async def Abort(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("vllm.Abort")
        for rid in request.request_ids:
            self._core.abort(rid)
        return VLLM.AbortResponse()

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("vllm.HealthCheck")
        return VLLM.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("vllm.GetModelInfo")
        cfg = core.config
        return VLLM.GetModelInfoResponse(
            model_path=cfg.model,
            is_generation=True,
            max_context_length=cfg.context_length,
            vocab_size=core.tokenizer.vocab_size,
            supports_vision=False,
            served_model_name=cfg.model,
            tokenizer_path=cfg.tokenizer_path,
            model_type="mock",
            architectures=["MockForCausalLM"],
            eos_token_ids=list(core.tokenizer.eos_token_ids),
            max_req_input_len=cfg.context_length - 1,
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("vllm.GetServerInfo")
        cfg = core.config
        pd = cfg.role != "both"
        return VLLM.GetServerInfoResponse(
            active_requests=core.active_requests,
            is_paused=False,
            last_receive_timestamp=core.last_receive_time,
            uptime_seconds=core.wallclock() - core.started_at,
            server_type="vllm-grpc",
            kv_connector="NixlConnector" if pd else "",
            kv_role={"prefill": "kv_producer", "decode": "kv_consumer"}.get(cfg.role, ""),
            kv_engine_id=cfg.engine_id if pd else "",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=cfg.block_size,
            model_dtype="torch.bfloat16",
            max_num_seqs=cfg.max_running,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("vllm.GetLoads")
        load = core.loads()
        return VLLM.GetLoadsResponse(
            timestamp=_iso_now(),
            version="mock",
            dp_rank_count=1,
            loads=[_scheduler_load(VLLM, load, (), core.config.role)],
        )


# ---- server ----------------------------------------------------------------------------------------

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
]


class GrpcServer(Protocol):
    async def stop(self, grace: float | None) -> None: ...


GRPC_IMPLS = ("auto", "grpcio", "lean")


async def start_grpc_server(
    core: EngineCore,
    host: str,
    port: int,
    engines: Sequence[str] = ("sglang", "vllm"),
    impl: str = "grpcio",
) -> tuple[GrpcServer, int]:
    """Serve the chosen services on ``host:port`` (0 picks a port); returns the server and the bound port.

    ``impl``: "grpcio" (grpc.aio, what real engines run), "lean" (the HTTP/2 server of
    ``lean_grpc``, several times cheaper per call), "auto" (lean in zero-latency mode, else grpcio).
    """
    if impl == "auto":
        impl = "lean" if core.config.zero_latency else "grpcio"
    tokenizers = _Tokenizers(core.config.tokenizer_path)
    services: list[tuple[Callable[[Any, Any], None], Any]] = []
    raw = impl == "lean"  # the lean server passes bytes through; grpc.aio serializes protobufs only
    if "sglang" in engines:
        sgl = SglangService(core, tokenizers, raw_chunks=raw)
        services.append((sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server, sgl))
    if "vllm" in engines:
        vllm = VllmService(core, tokenizers, raw_chunks=raw)
        services.append((vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, vllm))
    if impl == "lean":
        lean = LeanGrpcServer()
        for add, servicer in services:
            lean.add(add, servicer)
        bound = await lean.start(host, port)
        core.grpc_port = bound
        return lean, bound
    if impl != "grpcio":
        raise ValueError(f"unknown gRPC server implementation {impl!r}; use one of {GRPC_IMPLS}")
    server = grpc.aio.server(options=SERVER_OPTIONS)
    for add, servicer in services:
        add(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    await server.start()
    core.grpc_port = bound
    return server, bound
