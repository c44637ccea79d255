"""The routes: OpenAI generation and the rest, embeddings, responses (the stateful Responses API),
messages (the Anthropic Messages API),
pooling (rerank, score, classify: relayed to HTTP workers),
conversations, admin, keys, mesh, cors (browsers of other origins on the data plane);
native (the routes vLLM / SGLang / SMG scripts probe: /generate,
/version, /get_model_info, /flush_cache...); admission (rate limits; ratelimit_redis: the Redis counter
store backend); generation driving; reload (SIGHUP and
``POST /admin/reload``: the configuration file's dynamic parts, applied without a restart).

Callers (``shepherd.node.app`` only) use each module's ``routes()`` / ``install(app)``, ``common``
(the app keys ``GATEWAY``, ``ADMISSION``, ``KEEPALIVE_TICKER`` and the error middleware) and
``admission.Admission`` (rate limits).
"""

__all__ = [
    "admin",
    "admission",
    "common",
    "conversations",
    "cors",
    "embeddings",
    "generation",
    "keys",
    "mesh",
    "messages",
    "native",
    "openai",
    "pooling",
    "ratelimit_redis",
    "reload",
    "responses",
    "smg_metrics",
]
