"""Engine client for MLX workers (``mlx://host:port``, or ``grpc://`` detected by GetServerInfo): the
``mlx.grpc.engine.MlxEngine`` of smg-grpc-proto, as SMG's MLX servicer serves it (lightseekorg/smg
``grpc_servicer/smg_grpc_servicer/mlx/servicer.py``).

Requests and responses go through ``proto.mlx_codec`` (which refuses what MLX cannot honour); calls
through an ``rpc.Rpc`` (either transport). The service has no GetLoads, Embed or SubscribeKvEvents:
``loads`` reads GetServerInfo's ``active_requests``; ``embed`` answers 400; the KV feed is told
UNIMPLEMENTED and stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from smg_grpc_proto import mlx_engine_pb2 as mx

from shepherd.node.engines.errors import UNIMPLEMENTED, engine_error
from shepherd.node.engines.rpc import Rpc, RpcEngineClient
from shepherd.proto.engine_responses import decode_model_info
from shepherd.proto.engine_types import (
    EmbedResult,
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
    decode_mlx_server_info,
    mlx_generate,
    mlx_load,
)
from shepherd.proto.trtllm_codec import refuse


class MlxEngineClient(RpcEngineClient):
    """EngineClient for MLX workers."""

    kind = "mlx"

    def __init__(self, url: str, rpc: Rpc) -> None:
        super().__init__(url, rpc, MLX_SERVICE)

    def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        """The call's events; the request is encoded (and refused, naming a field it cannot honour) at
        the first step. Closing it cancels the call."""
        return self._events(lambda: mlx_generate(req), mx.GenerateResponse, MlxEvents(req), timeout)

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        raise refuse("MLX", "embeddings", "the MLX engine has no Embed call")

    async def abort(self, request_id: str, reason: str = "") -> None:
        await self._abort(mx.AbortRequest(request_ids=[request_id]), mx.AbortResponse)

    async def health_check(self, timeout: float = 2.0) -> bool:
        r = await self._health(mx.HealthCheckRequest(), mx.HealthCheckResponse, timeout)
        return r is not None and bool(r.healthy)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        return decode_model_info(
            await self._unary("GetModelInfo", mx.GetModelInfoRequest(), mx.GetModelInfoResponse, timeout)
        )

    async def _server_info(self, timeout: float = 5.0) -> mx.GetServerInfoResponse:
        return await self._unary(
            "GetServerInfo", mx.GetServerInfoRequest(), mx.GetServerInfoResponse, timeout
        )

    async def server_info(self, timeout: float = 5.0) -> ServerInfo:
        return decode_mlx_server_info(await self._server_info(timeout))

    async def loads(self) -> EngineLoad:
        return mlx_load(await self._server_info())

    def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        return _NoKvEvents()


class _NoKvEvents:
    """SubscribeKvEvents of an engine without it: UNIMPLEMENTED at the first step (the feed then stops)."""

    def __aiter__(self) -> _NoKvEvents:
        return self

    async def __anext__(self) -> KvEventBatch:
        raise engine_error(UNIMPLEMENTED, "the MLX engine has no SubscribeKvEvents")

    async def aclose(self) -> None:
        return None
