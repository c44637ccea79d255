"""Engine client for TensorRT-LLM workers (``trtllm://host:port``, or ``grpc://`` detected by GetServerInfo):
the ``trtllm.TrtllmService`` of smg-grpc-proto, as TensorRT-LLM's own servicer serves it
(NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/smg/servicer.py``).

Requests and responses go through ``proto.trtllm_codec``; calls through an ``rpc.Rpc`` (either transport).
The service has no GetLoads: ``loads`` raises (the load poller keeps the node's own in-flight count), and
Embed is the engine's (its servicer answers UNIMPLEMENTED today: a 502 naming it). KV events: the common
SubscribeKvEvents.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from smg_grpc_proto import trtllm_service_pb2 as tr
from smg_grpc_proto.generated import common_pb2

from shepherd.node.engines.errors import UNIMPLEMENTED, engine_error
from shepherd.node.engines.rpc import Rpc, RpcEngineClient, RpcFailure
from shepherd.proto.engine_responses import decode_embed
from shepherd.proto.engine_types import (
    EmbedResult,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    KvEventBatch,
    ModelInfo,
    ServerInfo,
)
from shepherd.proto.kv_codec import decode_kv_batch
from shepherd.proto.trtllm_codec import (
    TRTLLM_SERVICE,
    TrtllmEvents,
    decode_trtllm_model_info,
    decode_trtllm_server_info,
    trtllm_generate,
    trtllm_healthy,
)

_UINT32_MAX = (1 << 32) - 1  # (max_tokens is a uint32)


class TrtllmEngineClient(RpcEngineClient):
    """EngineClient for TensorRT-LLM workers."""

    kind = "trtllm"

    def __init__(self, url: str, rpc: Rpc) -> None:
        super().__init__(url, rpc, TRTLLM_SERVICE)
        self.vocab_size = 0  # GetModelInfo's (logit_bias becomes an embedding-bias vector this long)

    def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        """The call's events; the request is encoded (and refused, naming a field it cannot honour) at
        the first step. Closing it cancels the call. A request without ``max_new_tokens`` (the client gave
        no max_tokens: SGLang and vLLM apply their own bound) gets the node's (``token_limit``: what the
        context leaves): the service requires one."""
        p = req.sampling
        if p.max_new_tokens is None and req.token_limit is not None:
            req = replace(req, sampling=replace(p, max_new_tokens=min(max(req.token_limit, 1), _UINT32_MAX)))
        return self._events(
            lambda: trtllm_generate(req, self.vocab_size), tr.GenerateResponse, TrtllmEvents(req), timeout
        )

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        req = tr.EmbedRequest(request_id=request_id, tokenized=tr.TokenizedInput(input_token_ids=ids))
        return decode_embed(await self._unary("Embed", req, tr.EmbedResponse, timeout), len(ids))

    async def abort(self, request_id: str, reason: str = "") -> None:
        await self._abort(tr.AbortRequest(request_id=request_id), tr.AbortResponse)

    async def health_check(self, timeout: float = 2.0) -> bool:
        r = await self._health(tr.HealthCheckRequest(), tr.HealthCheckResponse, timeout)
        return r is not None and trtllm_healthy(r)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        info = decode_trtllm_model_info(
            await self._unary("GetModelInfo", tr.GetModelInfoRequest(), tr.GetModelInfoResponse, timeout)
        )
        self.vocab_size = info.vocab_size
        return info

    async def server_info(self, timeout: float = 5.0) -> ServerInfo:
        return decode_trtllm_server_info(
            await self._unary("GetServerInfo", tr.GetServerInfoRequest(), tr.GetServerInfoResponse, timeout)
        )

    async def loads(self) -> EngineLoad:
        raise engine_error(UNIMPLEMENTED, "TensorRT-LLM's service has no GetLoads")

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        req = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start_seq, load_records_before_first_batch=True
        )
        it = self.rpc.stream(self._prefix + "SubscribeKvEvents", req, common_pb2.KvEventBatch, None)
        try:
            async for msg in it:
                yield decode_kv_batch(msg)
        except RpcFailure as e:
            raise e.engine_error() from None
        finally:
            await it.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the call
