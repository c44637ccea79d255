"""One engine connection each: the lean HTTP/2 gRPC client, the grpcio one, the HTTP relay, back-off.

Callers use: ``h2.H2EngineClient`` (default; gRPC calls in ``h2_stream``, HTTP/2 in ``h2_frames``,
``h2_conn`` and ``h2_protocol``), ``grpcio.GrpcEngineClient`` (``--engine-transport
grpcio``), ``http.HttpRelayClient`` (OpenAI-compatible HTTP workers), ``backoff.Backoff``;
``trtllm.TrtllmEngineClient`` and ``mlx.MlxEngineClient`` (TensorRT-LLM and MLX workers, their calls by
path over either transport: ``rpc``), ``kinds`` (which client a ``trtllm://``, ``mlx://`` or detected
``grpc://`` worker gets). Both gRPC
clients map statuses to ``EngineError`` through one table (``errors``). Imports only the node's root leaves,
auth (engine TLS) and proto.
"""

__all__ = [
    "backoff",
    "errors",
    "grpcio",
    "h2",
    "h2_conn",
    "h2_frames",
    "h2_protocol",
    "h2_stream",
    "http",
    "kinds",
    "mlx",
    "rpc",
    "trtllm",
]
