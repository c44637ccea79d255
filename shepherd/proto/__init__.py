"""Vocabulary and codecs shared by every part; imports nothing of ours.

Callers use: ``addresses`` (``client_key``: the key a client's address counts under),
``anthropic_errors`` (the Anthropic error envelope of the Messages API routes),
``engine_types`` (what a node says to an engine and hears back: ``GenerateRequest``,
``EngineChunk``, ``EngineComplete``, ``EngineError``, ``EngineLoad``, KV events, ``worker_id``),
``engine_requests`` / ``engine_responses`` (those types <-> smg-grpc-proto messages and wire bytes),
``trtllm_codec`` / ``mlx_codec`` (the same for TensorRT-LLM's and MLX's services),
``kv_codec`` (KV-event streams), ``openai_errors`` (``ApiError``, ``error_response``: the OpenAI
error envelope), ``prompt_ids`` (``PromptIds``: ids with the pieces they came from),
``mesh_messages`` and ``mesh_wire`` (SWIM messages and their msgpack datagrams), ``index_wire``
(prefix-index deltas and digests), ``state_decode`` (checks of decoded mesh state), ``msgpack_bounds``
(bounded, sliced msgpack decoding of what peers send), ``wire_version``
(the mesh protocol version and its upgrade rule), ``varint`` (and
``_varint.c``).
"""

__all__ = [
    "addresses",
    "anthropic_errors",
    "engine_requests",
    "engine_responses",
    "engine_types",
    "index_wire",
    "kv_codec",
    "mesh_messages",
    "mesh_wire",
    "mlx_codec",
    "msgpack_bounds",
    "openai_errors",
    "prompt_ids",
    "state_decode",
    "trtllm_codec",
    "varint",
    "wire_version",
]
