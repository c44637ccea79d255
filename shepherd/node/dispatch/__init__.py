"""Which worker, and the engine stream's life: the gateway, the worker registry, circuit breakers, PD,
the engines' KV-event feeds.

Callers use: ``gateway.Gateway`` (models, tokenizers, ``pick``, ``open_stream`` with retry),
``stream.EngineStream`` (an open stream that aborts its engine request unless it completed),
``workers`` (``WorkerRegistry``, ``Worker``), ``pd.PdRouter``, ``kv_feed.KvFeed``,
``model_source.resolve_models`` (served names and tokenizers from the engines, aliases).
"""

__all__ = ["circuit_breaker", "gateway", "kv_feed", "model_source", "pd", "stream", "workers"]
