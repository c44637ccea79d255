"""gRPC servicers of the mock engine: ``sglang.grpc.scheduler.SglangScheduler`` and
``vllm.grpc.engine.VllmEngine`` (grpc.aio), thin translations between protobuf and ``EngineCore``, and
``start_grpc_server``. The messages and streams both servicers share are in ``grpc_messages``.

The wire imitates SMG's servicers (``SmgShape``): in a streaming Generate the tokens travel in chunks
and a finished choice's complete repeats its last chunk's ids; with ``stream=false`` only the
complete(s) are sent, with all output_ids (SGLang: every complete of n > 1 says index 0). A client
that cancels the stream frees the request's slot (the run is closed by the handler's ``finally`` and
by the RPC's done callback, whichever comes first).
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

from shepherd.mock_engine.embeddings import embed_ids
from shepherd.mock_engine.engine import EngineCore, Run
from shepherd.mock_engine.grpc_messages import (
    Tokenizers,
    input_logprobs_pb,
    kv_event_stream,
    logprobs_pb,
    scheduler_load,
    tokenizer_chunks,
)
from shepherd.mock_engine.lean_grpc import LeanGrpcServer
from shepherd.mock_engine.outputs import OutputSpec
from shepherd.mock_engine.pd_check import BootstrapClient, verify_decode
from shepherd.mock_engine.requests import MockRequest, MockRpcError
from shepherd.mock_engine.scheduler import LoadSnapshot
from shepherd.mock_engine.wire import ChunkWire
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent, PromptChunk

MAX_TOP_LOGPROBS = 20

SGL = sglang_scheduler_pb2
VLLM = vllm_engine_pb2


class SmgShape:
    """The mock's events as SMG's servicers shape them on the wire (the default; the README's "mock
    engine" section): streamed, a finished choice's Complete repeats its last chunk's ids and logprobs
    (SMG's SGLang servicer builds chunk and Complete from one output; its vLLM servicer sends the last
    DELTA in both); not streamed, SGLang's request manager numbers no choice, so every Complete of
    n > 1 says index 0 (lightseekorg/smg grpc_servicer/smg_grpc_servicer/sglang/request_manager.py)."""

    __slots__ = ("_last", "_stream", "_zero_index")

    def __init__(self, kind: str, stream: bool, n: int) -> None:
        self._stream = stream
        self._zero_index = kind == "sglang" and not stream and n > 1
        self._last: dict[int, EngineChunk] = {}

    def shape(self, ev: EngineEvent) -> EngineEvent:
        if isinstance(ev, EngineChunk):  # (a PromptChunk too)
            if self._stream:
                self._last[ev.index] = ev
            return ev
        assert isinstance(ev, EngineComplete)
        if self._stream and not ev.output_ids:
            last = self._last.get(ev.index)
            if last is not None:
                ev.output_ids = last.token_ids
                if last.logprobs and not ev.logprobs:
                    ev.logprobs = last.logprobs
        elif self._zero_index:
            ev.index = 0
        return ev


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


async def info_delay(core: EngineCore) -> None:
    """The ``info_delay_seconds`` fault: GetModelInfo and GetServerInfo answer that late."""
    delay = core.injector.faults.info_delay_seconds
    if delay > 0:
        await asyncio.sleep(delay)


def _close_on_done(context: Any, run: Run) -> None:
    context.add_done_callback(lambda _ctx: run.close())


# ---- SGLang ----------------------------------------------------------------------------------------


class _Service:
    """What the SGLang and vLLM servicers share; ``KIND`` names the service, ``_request`` and
    ``_response`` translate its messages."""

    KIND = ""

    def __init__(self, core: EngineCore, tokenizers: Tokenizers, *, raw_chunks: bool = False) -> None:
        """``raw_chunks``: yield streamed chunks as pre-encoded bytes (servers that pass bytes through)."""
        self._core = core
        self._tokenizers = tokenizers
        self._raw_chunks = raw_chunks
        self._bootstrap = BootstrapClient()  # a decode-role engine asks its prefill side (pd_check)

    def _request(self, request: Any) -> MockRequest:
        raise NotImplementedError

    def _note_request(self, request: Any) -> Any:
        """Record a GenerateRequest in the stats (its dialect, sampling params and constraint); returns
        its sampling params."""
        sp = request.sampling_params
        stats = self._core.stats
        stats.last_request_kind = self.KIND
        stats.last_sampling_params = lazy = _lazy_dict(sp)
        stats.record_constraint(request.request_id, sp)
        reasoning = bool(request.require_reasoning) if self.KIND == "sglang" else None
        stats.record_request(request.request_id, self.KIND, lazy, reasoning)
        return sp

    PB: Any = None  # the dialect's generated module (GenerateResponse, GenerateStreamChunk, ...)

    def _response(self, rid: str, ev: EngineEvent) -> Any:
        """An engine event as the dialect's GenerateResponse (SGLang's names its request)."""
        pb = self.PB
        named = {"request_id": rid} if self.KIND == "sglang" else {}
        if isinstance(ev, EngineChunk):
            chunk = pb.GenerateStreamChunk(
                token_ids=ev.token_ids,
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens,
                index=ev.index,
            )
            if ev.logprobs:
                chunk.output_logprobs.CopyFrom(logprobs_pb(pb, ev.logprobs))
            if type(ev) is PromptChunk and ev.prompt_logprobs is not None:
                chunk.input_logprobs.CopyFrom(input_logprobs_pb(pb, ev.prompt_logprobs))
            return pb.GenerateResponse(chunk=chunk, **named)
        complete = pb.GenerateComplete(
            output_ids=ev.output_ids,
            finish_reason=ev.finish_reason,
            prompt_tokens=ev.prompt_tokens,
            completion_tokens=ev.completion_tokens,
            cached_tokens=ev.cached_tokens,
            index=ev.index,
        )
        if ev.matched_token_id is not None:
            complete.matched_token_id = ev.matched_token_id
        if self.KIND == "vllm" and ev.kv_transfer_params_json is not None:
            complete.kv_transfer_params_json = ev.kv_transfer_params_json
        if ev.logprobs:
            complete.output_logprobs.CopyFrom(logprobs_pb(pb, ev.logprobs))
        if ev.prompt_logprobs is not None:
            complete.input_logprobs.CopyFrom(input_logprobs_pb(pb, ev.prompt_logprobs))
        return pb.GenerateResponse(complete=complete, **named)

    def _wire(self, request_id: str, run: Run) -> ChunkWire | None:
        if not self._raw_chunks or not run.req.stream:
            return None
        g = run.group
        return ChunkWire(self.KIND, request_id, len(g.prompt), g.cached_tokens)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        core = self._core
        core.stats.count_rpc(f"{self.KIND}.Generate")
        core.stats.record_trace(request.request_id, context.invocation_metadata())  # traceparent, if sent
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
        smg = SmgShape(self.KIND, run.req.stream, len(run.plans))
        try:
            if wire is not None:
                ready = run.take_ready()
                if ready is not None:  # zero latency: the whole stream at once, as a list of messages
                    yield [
                        wire.chunk(ev.token_ids, ev.completion_tokens, ev.index)
                        if type(ev) is EngineChunk and not ev.logprobs
                        else self._response(rid, ev).SerializeToString()
                        for ev in map(smg.shape, ready)
                    ]
                    return
            async for ev in run.events():
                smg.shape(ev)
                if wire is not None and type(ev) is EngineChunk and not ev.logprobs:
                    yield wire.chunk(ev.token_ids, ev.completion_tokens, ev.index)
                else:
                    yield self._response(rid, ev)
        finally:
            run.close()

    def _embedding(self, request: Any) -> tuple[list[float], int]:
        """(vector, prompt tokens) of an EmbedRequest; MockRpcError for what an engine refuses."""
        core = self._core
        core.stats.count_rpc(f"{self.KIND}.Embed")
        ids = request.tokenized.input_ids
        cfg = core.config
        if not ids:
            raise MockRpcError("INVALID_ARGUMENT", "the input is empty")
        if len(ids) > cfg.context_length:
            raise MockRpcError(
                "INVALID_ARGUMENT",
                f"the input has {len(ids)} tokens; the context length is {cfg.context_length}",
            )
        return embed_ids(ids, cfg.embedding_dim, cfg.seed), len(ids)

    async def Embed(self, request: Any, context: Any) -> Any:
        try:
            vec, n = self._embedding(request)
        except MockRpcError as e:
            await context.abort(_status(e.code), e.message)
            raise  # not reached: abort raises
        module = VLLM if self.KIND == "vllm" else SGL
        return module.EmbedResponse(embedding_dim=len(vec), embedding=vec, prompt_tokens=n)

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc(f"{self.KIND}.HealthCheck")
        return self.PB.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc(f"{self.KIND}.GetModelInfo")
        await info_delay(core)
        cfg = core.config
        versioned = {"weight_version": "mock"} if self.KIND == "sglang" else {}  # a field vLLM's has not
        return self.PB.GetModelInfoResponse(
            model_path=cfg.model,
            tokenizer_path=cfg.tokenizer_path,
            is_generation=not cfg.embedding_model,
            served_model_name=cfg.model,
            max_context_length=cfg.context_length,
            vocab_size=core.tokenizer.vocab_size,
            supports_vision=False,
            model_type="mock",
            eos_token_ids=list(core.tokenizer.eos_token_ids),
            max_req_input_len=cfg.context_length - 1,
            architectures=["MockForCausalLM"],
            default_sampling_params_json=cfg.default_sampling_params_json,
            **versioned,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        """The one scheduler's load (``include`` picks the sections SGLang's has; vLLM's has none)."""
        core = self._core
        core.stats.count_rpc(f"{self.KIND}.GetLoads")
        load = core.loads()
        pb = self.PB
        return pb.GetLoadsResponse(
            timestamp=_iso_now(),
            version="mock",
            dp_rank_count=1,
            loads=[scheduler_load(pb, load, list(request.include), core.config.role)],
            **self._loads_extra(load),
        )

    def _loads_extra(self, load: LoadSnapshot) -> dict[str, Any]:
        """Fields of the dialect's GetLoadsResponse beyond those both have."""
        return {}

    async def FlushCache(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc(f"{self.KIND}.FlushCache")
        ok = self._core.flush_cache()
        return common_pb2.FlushCacheResponse(success=ok, message="" if ok else "requests in flight")

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self._core.stats.count_rpc(f"{self.KIND}.GetTokenizer")
        async for chunk in tokenizer_chunks(self._tokenizers):
            yield chunk

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self._core.stats.count_rpc(f"{self.KIND}.SubscribeKvEvents")
        try:
            async for batch in kv_event_stream(self._core, request):
                yield batch
        except MockRpcError as e:
            await context.abort(_status(e.code), e.message)


class SglangService(_Service, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    KIND = "sglang"
    PB = SGL

    def _request(self, request: Any) -> MockRequest:
        sp = self._note_request(request)
        stats = self._core.stats
        if self._core.config.skip_tokenizer_init and sp.min_new_tokens > 0:
            # (SGLang without its tokenizer refuses a minimum output length)
            stats.rejected += 1
            raise MockRpcError("INVALID_ARGUMENT", "min_new_tokens is not supported with skip_tokenizer_init")
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
            # SGLang: the prompt's logprobs from logprob_start_len on (the mock: from 0, or none)
            prompt_logprobs=min(max(request.top_logprobs_num, 0), MAX_TOP_LOGPROBS)
            if request.return_logprob and request.logprob_start_len >= 0
            else None,
            prompt_text=request.tokenized.original_text,
            disaggregated=disagg,
            bootstrap_host=request.disaggregated_params.bootstrap_host if disagg else None,
            bootstrap_port=request.disaggregated_params.bootstrap_port if disagg else None,
            bootstrap_room=request.disaggregated_params.bootstrap_room if disagg else None,
        )

    async def Abort(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("sglang.Abort")
        found = self._core.abort(request.request_id, prefix=True)  # SGLang's scheduler: by id prefix
        return SGL.AbortResponse(
            success=found, message=f"request {request.request_id} {'aborted' if found else 'not found'}"
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("sglang.GetServerInfo")
        await info_delay(core)
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
                "skip_tokenizer_init": cfg.skip_tokenizer_init,
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

    def _loads_extra(self, load: LoadSnapshot) -> dict[str, Any]:
        """SGLang's GetLoads also sums its dp ranks (here the one)."""
        return {
            "aggregate": SGL.AggregateMetrics(
                total_running_reqs=load.running,
                total_waiting_reqs=load.waiting,
                total_reqs=load.running + load.waiting,
                avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput,
                avg_utilization=load.utilization,
            ),
        }


# ---- vLLM ------------------------------------------------------------------------------------------


def _capped(k: int) -> int:
    """vLLM's logprobs count within the mock's cap (-1, the whole vocabulary: the cap)."""
    return MAX_TOP_LOGPROBS if k < 0 else min(k, MAX_TOP_LOGPROBS)


class VllmService(_Service, vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    KIND = "vllm"
    PB = VLLM

    def _request(self, request: Any) -> MockRequest:
        core = self._core
        sp = self._note_request(request)
        stats = core.stats
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
            prompt_logprobs=_capped(sp.prompt_logprobs) if sp.HasField("prompt_logprobs") else None,
            prompt_text=text,
            kv_transfer_params_json=kv_json,
        )

    async def Abort(self, request: Any, context: Any) -> Any:
        self._core.stats.count_rpc("vllm.Abort")
        for rid in request.request_ids:
            self._core.abort(rid)
        return VLLM.AbortResponse()

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        core = self._core
        core.stats.count_rpc("vllm.GetServerInfo")
        await info_delay(core)
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


# ---- server ----------------------------------------------------------------------------------------

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    # grpcio sets SO_REUSEPORT by default: a second engine started on a port in use would share it in
    # silence (the kernel spreading connections over both) instead of failing to start
    ("grpc.so_reuseport", 0),
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
    tokenizers = Tokenizers(core.config.tokenizer_path)
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
