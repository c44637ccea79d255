"""Engine client for MLX workers (``mlx://host:port``, or ``grpc://`` detected by GetServerInfo): the
``mlx.grpc.engine.MlxEngine`` of smg-grpc-proto, as SMG's MLX servicer serves it (lightseekorg/smg
``grpc_servicer/smg_grpc_servicer/mlx/servicer.py``).

Requests and responses go through ``proto.mlx_codec`` (which refuses what MLX cannot honour); calls
through an ``rpc.Rpc`` (either transport). The service has no GetLoads, Embed or SubscribeKvEvents:
``loads`` reads GetServerInfo's ``active_requests``; ``embed`` answers 400; the KV feed is told
UNIMPLEMENTED and stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from smg_grpc_proto import mlx_engine_pb2 as mx
from smg_grpc_proto.generated import common_pb2

from shepherd.node.engines.errors import UNIMPLEMENTED, engine_error
from shepherd.node.engines.rpc import Rpc, RpcFailure, generate_events
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
from shepherd.proto.mlx_codec import (
    MLX_SERVICE,
    MlxEvents,
    decode_mlx_model_info,
    decode_mlx_server_info,
    mlx_generate,
    mlx_load,
)
from shepherd.proto.trtllm_codec import refuse

_P = f"/{MLX_SERVICE}/"


class MlxEngineClient:
    """EngineClient for MLX workers."""

    def __init__(self, url: str, rpc: Rpc) -> None:
        self.url = url
        self.kind = "mlx"
        self.rpc = rpc

    def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        """The call's events; the request is encoded (and refused, naming a field it cannot honour) at
        the first step. Closing it cancels the call."""
        return generate_events(
            self.rpc, _P + "Generate", lambda: mlx_generate(req), mx.GenerateResponse, MlxEvents(req), timeout
        )

    async def generate(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[EngineEvent]:
        async with contextlib.aclosing(self.generate_batches(req, timeout)) as batches:  # type: ignore[type-var]
            async for batch in batches:
                for ev in batch:
                    yield ev

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        raise refuse("MLX", "embeddings", "the MLX engine has no Embed call")

    async def abort(self, request_id: str, reason: str = "") -> None:
        with contextlib.suppress(RpcFailure):  # best effort: the stream cancellation also frees it
            await self.rpc.unary(
                _P + "Abort", mx.AbortRequest(request_ids=[request_id]), mx.AbortResponse, 5.0
            )

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            r = await self.rpc.unary(
                _P + "HealthCheck", mx.HealthCheckRequest(), mx.HealthCheckResponse, timeout
            )
        except (RpcFailure, EngineError):
            return False
        return bool(r.healthy)

    async def model_info(self) -> ModelInfo:
        try:
            r = await self.rpc.unary(
                _P + "GetModelInfo", mx.GetModelInfoRequest(), mx.GetModelInfoResponse, 5.0
            )
        except RpcFailure as e:
            raise e.engine_error() from None
        return decode_mlx_model_info(r)

    async def _server_info(self) -> mx.GetServerInfoResponse:
        try:
            return await self.rpc.unary(
                _P + "GetServerInfo", mx.GetServerInfoRequest(), mx.GetServerInfoResponse, 5.0
            )
        except RpcFailure as e:
            raise e.engine_error() from None

    async def server_info(self) -> ServerInfo:
        return decode_mlx_server_info(await self._server_info())

    async def loads(self) -> EngineLoad:
        return mlx_load(await self._server_info())

    def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        return _NoKvEvents()

    async def get_tokenizer(self, timeout: float = 120.0) -> tuple[bytes, str]:
        """GetTokenizer (server stream): the zip's bytes, concatenated, and the last chunk's sha256."""
        parts: list[bytes] = []
        sha = ""
        it = self.rpc.stream(
            _P + "GetTokenizer", common_pb2.GetTokenizerRequest(), common_pb2.GetTokenizerChunk, timeout
        )
        try:
            async for chunk in it:
                parts.append(chunk.data)
                sha = chunk.sha256 or sha
        except RpcFailure as e:
            raise e.engine_error() from None
        finally:
            await it.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the call
        return b"".join(parts), sha

    async def close(self) -> None:
        await self.rpc.close()


class _NoKvEvents:
    """SubscribeKvEvents of an engine without it: UNIMPLEMENTED at the first step (the feed then stops)."""

    def __aiter__(self) -> _NoKvEvents:
        return self

    async def __anext__(self) -> KvEventBatch:
        raise engine_error(UNIMPLEMENTED, "the MLX engine has no SubscribeKvEvents")

    async def aclose(self) -> None:
        return None
