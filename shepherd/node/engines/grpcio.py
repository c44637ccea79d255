"""Engine client over grpcio (grpc.aio): SGLang scheduler and vLLM engine services.

One channel per worker, reused by every call; keepalive and large windows. The service is chosen by the
worker URL (``sglang://``, ``vllm://``) or detected from GetServerInfo (``grpc://``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto import vllm_engine_pb2_grpc as vl_grpc
from smg_grpc_proto.generated import common_pb2

from shepherd.node.engines.errors import engine_error, health_timeout, sglang_context
from shepherd.node.observe import tracing
from shepherd.proto.engine_requests import sglang_embed, sglang_generate, vllm_embed, vllm_generate
from shepherd.proto.engine_responses import (
    decode_embed,
    decode_loads,
    decode_model_info,
    decode_response,
    decode_server_info,
)
from shepherd.proto.engine_types import (
    EmbedResult,
    EngineError,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    KvEventBatch,
    ModelInfo,
    ServerInfo,
)
from shepherd.proto.kv_codec import decode_kv_batch

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    # reconnects back off as the lean client's do (``backoff.Backoff``: capped at 5 s), not gRPC's default
    # up to 120 s: an engine back from a restart or a weight reload serves again within seconds
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def map_rpc_error(err: grpc.aio.AioRpcError) -> EngineError:
    """A grpcio call's failure, through the transports' one status table (``errors.engine_error``)."""
    return engine_error(err.code().value[0], err.details() or "")


class GrpcEngineClient:
    """EngineClient for ``grpc://``, ``sglang://`` and ``vllm://`` workers."""

    def __init__(
        self,
        url: str,
        target: str,
        kind: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.url = url
        self.target = target
        self.kind = kind or "unknown"
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        )
        self._sg = sg_grpc.SglangSchedulerStub(self._channel)
        self._vl = vl_grpc.VllmEngineStub(self._channel)

    async def detect(self, timeout: float = 5.0) -> str:
        """Settle ``kind`` by asking GetServerInfo of each service (SGLang first)."""
        if self.kind in ("sglang", "vllm"):
            return self.kind
        try:
            await self._sg.GetServerInfo(sg.GetServerInfoRequest(), timeout=timeout)
            self.kind = "sglang"
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise map_rpc_error(e) from None
            try:
                await self._vl.GetServerInfo(vl.GetServerInfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e2:
                raise map_rpc_error(e2) from None
            self.kind = "vllm"
        return self.kind

    def _generate_call(self, req: GenerateRequest, timeout: float | None) -> Any:
        # the caller's trace context (traceparent, tracestate) as gRPC metadata, when tracing is on
        md = tuple(tracing.inject({}).items()) if tracing.ENABLED else None
        if self.kind == "vllm":
            return self._vl.Generate(vllm_generate(req), timeout=timeout, metadata=md)
        return self._sg.Generate(sglang_generate(req), timeout=timeout, metadata=md)

    async def generate(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[EngineEvent]:
        if self.kind == "unknown":
            await self.detect()
        call = self._generate_call(req, timeout)
        decode = decode_response
        try:
            async for resp in call:
                ev = decode(resp)
                if ev is not None:
                    yield ev
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        finally:
            if not call.done():
                call.cancel()

    async def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        """grpc.aio hands over one message at a time: batches of one."""
        async for ev in self.generate(req, timeout):
            yield [ev]

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        """One Embed call (unary) of ``ids``; raises EngineError."""
        if self.kind == "unknown":
            await self.detect()
        try:
            if self.kind == "vllm":
                r: Any = await self._vl.Embed(vllm_embed(request_id, ids), timeout=timeout)
            else:
                r = await self._sg.Embed(sglang_embed(request_id, ids), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return decode_embed(r, len(ids))

    async def abort(self, request_id: str, reason: str = "") -> None:
        try:
            if self.kind == "vllm":
                await self._vl.Abort(vl.AbortRequest(request_ids=[request_id]), timeout=5.0)
            else:
                await self._sg.Abort(sg.AbortRequest(request_id=request_id, reason=reason), timeout=5.0)
        except grpc.aio.AioRpcError:
            pass  # best effort: the stream cancellation also frees the request

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            if self.kind == "unknown":
                await self.detect(timeout)
            timeout = health_timeout(self.kind, timeout)
            if self.kind == "vllm":
                r: Any = await self._vl.HealthCheck(vl.HealthCheckRequest(), timeout=timeout)
            else:
                r = await self._sg.HealthCheck(sg.HealthCheckRequest(), timeout=timeout)
        except (grpc.aio.AioRpcError, EngineError):
            return False
        return bool(r.healthy)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        try:
            if self.kind == "vllm":
                r: Any = await self._vl.GetModelInfo(vl.GetModelInfoRequest(), timeout=timeout)
            else:
                r = await self._sg.GetModelInfo(sg.GetModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return decode_model_info(r, await sglang_context(self.kind, lambda: self.server_info(timeout)))

    async def server_info(self, timeout: float = 5.0) -> ServerInfo:
        try:
            if self.kind == "vllm":
                r: Any = await self._vl.GetServerInfo(vl.GetServerInfoRequest(), timeout=timeout)
            else:
                r = await self._sg.GetServerInfo(sg.GetServerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return decode_server_info(r, self.kind)

    async def loads(self) -> EngineLoad:
        try:
            if self.kind == "vllm":
                r: Any = await self._vl.GetLoads(vl.GetLoadsRequest(include=["core"]), timeout=5.0)
            else:
                r = await self._sg.GetLoads(sg.GetLoadsRequest(include=["core"]), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return decode_loads(r)

    async def flush_cache(self, timeout: float = 30.0) -> tuple[bool, str]:
        """FlushCache: (success, the engine's message)."""
        if self.kind == "unknown":
            await self.detect()
        stub: Any = self._vl if self.kind == "vllm" else self._sg
        try:
            r: Any = await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return bool(r.success), str(r.message)

    async def get_tokenizer(self, timeout: float = 120.0) -> tuple[bytes, str]:
        """GetTokenizer (server stream): the zip's bytes, concatenated, and the last chunk's sha256."""
        if self.kind == "unknown":
            await self.detect()
        stub: Any = self._vl if self.kind == "vllm" else self._sg
        parts: list[bytes] = []
        sha = ""
        try:
            async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout):
                parts.append(chunk.data)
                sha = chunk.sha256 or sha
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        return b"".join(parts), sha

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        """SubscribeKvEvents (server stream, no deadline); closing the iterator cancels the call."""
        if self.kind == "unknown":
            await self.detect()
        req = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start_seq, load_records_before_first_batch=True
        )
        stub: Any = self._vl if self.kind == "vllm" else self._sg
        call = stub.SubscribeKvEvents(req)
        try:
            async for msg in call:
                yield decode_kv_batch(msg)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e) from None
        finally:
            if not call.done():
                with contextlib.suppress(Exception):
                    call.cancel()

    def confirm_alive(self, timeout: float) -> None:
        """Nothing: grpcio's channel sends no PING on demand; its own keepalive (a ping every 30 s, 10 s
        for the ACK) fails the calls of an engine that stopped answering."""

    async def close(self) -> None:
        await self._channel.close(grace=None)
