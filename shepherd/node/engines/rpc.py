"""gRPC calls by path over either transport, for the engine kinds without a client of their own in h2.py /
grpcio.py (TensorRT-LLM, MLX), and the probe that tells a ``grpc://`` worker's kind from GetServerInfo.

``Rpc``: ``unary`` and ``stream`` calls by method path, raising ``RpcFailure`` (the gRPC status) on a
non-OK end. ``H2Rpc`` rides an ``H2EngineClient``'s connection (its ``call_unary`` / ``call_stream``),
``GrpcioRpc`` a grpcio channel; ``rpc_for`` gives the one over a client's own connection, so a worker
detected as TensorRT-LLM or MLX keeps the connection (and TLS) it was probed over. ``probe_kind`` asks
GetServerInfo of SGLang, vLLM, TensorRT-LLM and MLX in turn, as SMG's detection does
(lightseekorg/smg ``model_gateway/src/workflow/steps/local/detect_backend.rs``): UNIMPLEMENTED moves on.
``RpcEngineClient``: what the TensorRT-LLM and MLX clients share (generate, unary calls, GetTokenizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from smg_grpc_proto import mlx_engine_pb2 as mx
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import trtllm_service_pb2 as tr
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto.generated import common_pb2

from shepherd.node.engines.errors import UNIMPLEMENTED, engine_error
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_stream import RpcStatus
from shepherd.node.observe import tracing
from shepherd.proto.engine_requests import SGLANG_SERVICE, VLLM_SERVICE
from shepherd.proto.engine_types import EngineError, EngineEvent, GenerateRequest
from shepherd.proto.mlx_codec import MLX_SERVICE
from shepherd.proto.trtllm_codec import TRTLLM_SERVICE

M = TypeVar("M", bound=Message)


class RpcFailure(Exception):
    """A call ended with a non-OK gRPC status."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    def engine_error(self) -> EngineError:
        return engine_error(self.code, self.details)


class Rpc(Protocol):
    async def unary(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> M: ...

    def stream(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> AsyncIterator[M]: ...

    def confirm_alive(self, timeout: float) -> None:
        """``EngineClient.confirm_alive`` on the connection the calls ride."""
        ...

    async def close(self) -> None: ...


class H2Rpc:
    """Calls over an ``H2EngineClient``'s connection (the lean HTTP/2 transport)."""

    def __init__(self, client: H2EngineClient) -> None:
        self.client = client

    async def unary(self, path: str, request: Message, response_type: type[M], timeout: float | None) -> M:
        try:
            return await self.client.call_unary(path, request, response_type, timeout)
        except RpcStatus as e:
            raise RpcFailure(e.code, e.details) from None

    async def stream(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> AsyncIterator[M]:
        it = self.client.call_stream(path, request, response_type, timeout)
        try:
            async for msg in it:
                yield msg
        except RpcStatus as e:
            raise RpcFailure(e.code, e.details) from None
        finally:
            await it.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the call

    def confirm_alive(self, timeout: float) -> None:
        """The ``H2EngineClient``'s liveness probe: a PING on each connection with calls in flight."""
        self.client.confirm_alive(timeout)

    async def close(self) -> None:
        await self.client.close()


def _serialize(m: Message) -> bytes:
    return m.SerializeToString()


def _trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The caller's trace context (``traceparent``, ``tracestate``) as gRPC metadata, when tracing is on
    (as the SGLang/vLLM clients send it); None otherwise."""
    return (tuple(tracing.inject({}).items()) or None) if tracing.ENABLED else None


class GrpcioRpc:
    """Calls over a grpcio channel (``--engine-transport grpcio``)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def unary(self, path: str, request: Message, response_type: type[M], timeout: float | None) -> M:
        call: Any = self.channel.unary_unary(
            path, request_serializer=_serialize, response_deserializer=response_type.FromString
        )
        try:
            out: M = await call(request, timeout=timeout, metadata=_trace_metadata())
        except grpc.aio.AioRpcError as e:
            raise RpcFailure(e.code().value[0], e.details() or "") from None
        return out

    async def stream(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> AsyncIterator[M]:
        method: Any = self.channel.unary_stream(
            path, request_serializer=_serialize, response_deserializer=response_type.FromString
        )
        call = method(request, timeout=timeout, metadata=_trace_metadata())
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise RpcFailure(e.code().value[0], e.details() or "") from None
        finally:
            if not call.done():
                call.cancel()

    def confirm_alive(self, timeout: float) -> None:
        """Nothing: grpcio's channel sends no PING on demand (its keepalive fails a silent engine's calls)."""

    async def close(self) -> None:
        await self.channel.close(grace=None)


def rpc_for(client: H2EngineClient | GrpcEngineClient) -> Rpc:
    """Calls over ``client``'s own connection."""
    if isinstance(client, H2EngineClient):
        return H2Rpc(client)
    return GrpcioRpc(client._channel)  # the channel the client was probed over


# (kind, GetServerInfo path, its request, its response type), in SMG's order of detection
_PROBES: tuple[tuple[str, str, Message, type[Message]], ...] = (
    ("sglang", f"/{SGLANG_SERVICE}/GetServerInfo", sg.GetServerInfoRequest(), sg.GetServerInfoResponse),
    ("vllm", f"/{VLLM_SERVICE}/GetServerInfo", vl.GetServerInfoRequest(), vl.GetServerInfoResponse),
    ("trtllm", f"/{TRTLLM_SERVICE}/GetServerInfo", tr.GetServerInfoRequest(), tr.GetServerInfoResponse),
    ("mlx", f"/{MLX_SERVICE}/GetServerInfo", mx.GetServerInfoRequest(), mx.GetServerInfoResponse),
)


async def probe_kind(rpc: Rpc, timeout: float) -> str:
    """The engine kind behind ``rpc``: the first service whose GetServerInfo answers. Raises
    ``EngineError`` when one fails otherwise than UNIMPLEMENTED, or when none is served."""
    for kind, path, request, response_type in _PROBES:
        try:
            await rpc.unary(path, request, response_type, timeout)
        except RpcFailure as e:
            if e.code != UNIMPLEMENTED:
                raise e.engine_error() from None
            continue
        return kind
    raise engine_error(
        UNIMPLEMENTED, "the worker serves none of SGLang's, vLLM's, TensorRT-LLM's or MLX's gRPC services"
    )


class EventDecoder(Protocol):
    """One Generate call's response decoder (``trtllm_codec.TrtllmEvents``, ``mlx_codec.MlxEvents``)."""

    def decode(self, resp: Any) -> EngineEvent | None: ...

    def end(self) -> None: ...


async def generate_events(
    rpc: Rpc,
    path: str,
    encode: Callable[[], Message],
    response_type: type[Message],
    decoder: EventDecoder,
    timeout: float | None,
) -> AsyncIterator[list[EngineEvent]]:
    """A Generate call's events, in batches of one; closing it early cancels the call. ``encode`` makes
    the request at the first step: a refusal (``EngineError`` invalid_request) raises there, where the
    gateway reads the first events."""
    it = rpc.stream(path, encode(), response_type, timeout)
    try:
        async for resp in it:
            ev = decoder.decode(resp)
            if ev is not None:
                yield [ev]
    except RpcFailure as e:
        raise e.engine_error() from None
    finally:
        await it.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the call
    decoder.end()


class RpcEngineClient:
    """What the clients over an ``Rpc`` share (``trtllm.TrtllmEngineClient``, ``mlx.MlxEngineClient``):
    ``generate`` from the subclass's ``generate_batches``, unary calls on the service's methods (a
    non-OK status raised as ``EngineError``), GetTokenizer (the same message in both services) and close."""

    kind = ""

    def __init__(self, url: str, rpc: Rpc, service: str) -> None:
        self.url = url
        self.rpc = rpc
        self._prefix = f"/{service}/"

    def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        raise NotImplementedError

    async def generate(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[EngineEvent]:
        async with contextlib.aclosing(self.generate_batches(req, timeout)) as batches:  # type: ignore[type-var]
            async for batch in batches:
                for ev in batch:
                    yield ev

    def _events(
        self,
        encode: Callable[[], Message],
        response_type: type[Message],
        decoder: EventDecoder,
        timeout: float | None,
    ) -> AsyncIterator[list[EngineEvent]]:
        """The service's Generate call (see ``generate_events``)."""
        return generate_events(self.rpc, self._prefix + "Generate", encode, response_type, decoder, timeout)

    async def _raw_unary(
        self, method: str, request: Message, response_type: type[M], timeout: float | None
    ) -> M:
        return await self.rpc.unary(self._prefix + method, request, response_type, timeout)

    async def _unary(
        self, method: str, request: Message, response_type: type[M], timeout: float | None = 5.0
    ) -> M:
        """The service's ``method``; a non-OK status raises as ``EngineError``."""
        try:
            return await self._raw_unary(method, request, response_type, timeout)
        except RpcFailure as e:
            raise e.engine_error() from None

    async def _abort(self, request: Message, response_type: type[Message]) -> None:
        with contextlib.suppress(RpcFailure):  # best effort: the stream cancellation also frees it
            await self._raw_unary("Abort", request, response_type, 5.0)

    async def _health(self, request: Message, response_type: type[M], timeout: float) -> M | None:
        """The service's HealthCheck answer; None when the call fails."""
        try:
            return await self._raw_unary("HealthCheck", request, response_type, timeout)
        except (RpcFailure, EngineError):
            return None

    async def get_tokenizer(self, timeout: float = 120.0) -> tuple[bytes, str]:
        """GetTokenizer (server stream): the zip's bytes, concatenated, and the last chunk's sha256."""
        parts: list[bytes] = []
        sha = ""
        it = self.rpc.stream(
            self._prefix + "GetTokenizer",
            common_pb2.GetTokenizerRequest(),
            common_pb2.GetTokenizerChunk,
            timeout,
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

    def confirm_alive(self, timeout: float) -> None:
        """Over the lean HTTP/2 client (``H2Rpc``): its liveness probe (``H2EngineClient.confirm_alive``);
        over grpcio: nothing."""
        self.rpc.confirm_alive(timeout)

    async def close(self) -> None:
        await self.rpc.close()
