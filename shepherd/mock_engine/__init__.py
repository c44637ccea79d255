"""``smg-mock-engine``: a faithful stand-in for an inference engine (tests, benchmarks, chaos, compose).

Pure state machines:
- ``cache``: paged prefix KV cache (chained block hashes, reference counts, LRU, KV events).
- ``scheduler``: waiting/running queues, KV budget, prefill/decode timing model, GetLoads figures.
- ``outputs``: deterministic word-like output, fake logprobs, scripted responses.
- ``faults``: error rate, stall, slow-down, crash, hang.
- ``kv_events``: numbered event batches, history, subscribers.

Shells: ``engine`` (the async core shared by every surface), ``grpc_services`` (SGLang and vLLM
servicers on grpc.aio or on ``lean_grpc``, a light HTTP/2 server with ``hpack`` and ``wire``),
``http_api`` (OpenAI HTTP surface and the ``/mock/*`` control endpoints), ``cli``, ``bench``.
"""
