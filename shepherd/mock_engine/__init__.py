"""``smg-mock-engine``: a faithful stand-in for an inference engine (tests, benchmarks, chaos, compose).

Pure state machines:
- ``cache``: paged prefix KV cache (chained block hashes, reference counts, LRU, KV events).
- ``scheduler``: waiting/running queues, KV budget, prefill/decode timing model, GetLoads figures.
- ``outputs``: deterministic word-like output, fake logprobs, scripted responses.
- ``faults``: error rate, stall, slow-down, crash, hang, late model info (GetModelInfo, GetServerInfo).
- ``kv_events``: numbered event batches, history, subscribers.

Shells: ``engine`` (the async core shared by every surface; ``engine_config``: its configuration;
``requests``: the request it takes and the error a request fails with), ``grpc_services`` (SGLang and
vLLM servicers, with ``grpc_messages``: the messages and streams they share; on grpc.aio or on
``lean_grpc``, a light HTTP/2 server with ``lean_grpc_frames``, ``lean_grpc_calls``, ``hpack`` and
``wire``), ``http_api`` (OpenAI HTTP surface and the ``/mock/*`` control endpoints; ``http_params``:
request parameters and stop strings; ``http_embeddings``: ``/v1/embeddings``; ``http_pooling``: rerank,
score, classify), ``embeddings`` (the deterministic vectors of Embed and ``/v1/embeddings``), ``cli``,
``bench``.
"""
