"""Routing policies (pure functions over a snapshot of workers) and the mergeable prefix index.

Callers use: ``simple.make_policy`` / ``POLICY_NAMES`` (policies by their SGLang/SMG names),
``base`` (``Policy``, ``RouteRequest``, ``WorkerView``), ``cache_aware.CacheAware``, the prefix index
layouts (``prefix_index``: the API and the flat layout; ``run_index``: the run layout; ``native_index``
over ``_prefixcore.c``), their mesh replicas (``prefix_replica``, ``prefix_replica_native.make_replica``:
the mesh carries them through its merge interface and never imports this package; ``turn_ends``: what
sparse replication keeps of peers' decisions), ``block_names``, ``kv_events`` and ``text_ids`` (a relayed
request's text as pseudo token ids). Imports proto only.
"""

__all__ = [
    "base",
    "block_names",
    "bucket",
    "cache_aware",
    "hashing",
    "kv_events",
    "load",
    "manual",
    "native_index",
    "prefix_index",
    "prefix_replica",
    "prefix_replica_native",
    "run_index",
    "simple",
    "text_ids",
    "turn_ends",
]
