"""Which client serves a gRPC worker: by its URL's scheme (``trtllm://``, ``mlx://``) or, for ``grpc://``,
by the service its GetServerInfo answers on (``rpc.probe_kind``).

``SERVICE_KINDS``: the schemes served by a client of their own here (TensorRT-LLM, MLX; SGLang and vLLM
are ``h2.H2EngineClient`` / ``grpcio.GrpcEngineClient``). ``service_client``: that client, over the
connection of a base client made for the URL. ``settle_kind``: a ``grpc://`` worker's kind, settled
once: SGLang and vLLM keep their client (its ``kind`` set), TensorRT-LLM and MLX get theirs on the same
connection.
"""

from __future__ import annotations

from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.mlx import MlxEngineClient
from shepherd.node.engines.rpc import probe_kind, rpc_for
from shepherd.node.engines.trtllm import TrtllmEngineClient

SERVICE_KINDS = ("trtllm", "mlx")

BaseClient = H2EngineClient | GrpcEngineClient
ServiceClient = TrtllmEngineClient | MlxEngineClient


def service_client(url: str, kind: str, base: BaseClient) -> ServiceClient:
    """The client of ``kind`` (one of ``SERVICE_KINDS``) over ``base``'s connection."""
    if kind == "trtllm":
        return TrtllmEngineClient(url, rpc_for(base))
    if kind == "mlx":
        return MlxEngineClient(url, rpc_for(base))
    raise ValueError(f"no service client for engine kind {kind!r}")


async def settle_kind(client: BaseClient, timeout: float) -> BaseClient | ServiceClient:
    """``client`` once its worker's kind is known (probed when it is "unknown"): itself for SGLang and
    vLLM, a TensorRT-LLM or MLX client on its connection otherwise. Raises ``EngineError``."""
    if client.kind != "unknown":
        return client
    kind = await probe_kind(rpc_for(client), timeout)
    if kind in SERVICE_KINDS:
        return service_client(client.url, kind, client)
    client.kind = kind
    return client
