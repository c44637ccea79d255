"""Engines' KV-event streams, wire to types: ``smg.grpc.common.KvEventBatch`` and its ``EngineLoad`` record.

Both engine services (SGLang, vLLM) stream the same message, so every engine client decodes it here.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from shepherd.proto.engine_types import (
    EngineLoad,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheCleared,
    KvCacheEvent,
    KvEventBatch,
)

_REMOTE = 2  # smg.grpc.common.KvCacheLocality.KV_CACHE_LOCALITY_REMOTE


def decode_load(msg: Any) -> EngineLoad:
    """A ``smg.grpc.common.EngineLoad`` record; telemetry fields it lacks are 0."""
    has = msg.HasField
    return EngineLoad(
        running=msg.running_requests,
        waiting=msg.waiting_requests,
        used_tokens=msg.num_used_tokens if has("num_used_tokens") else 0,
        max_total_tokens=msg.max_total_num_tokens if has("max_total_num_tokens") else 0,
        token_usage=msg.token_usage,
        waiting_uncached_tokens=msg.waiting_uncached_tokens if has("waiting_uncached_tokens") else 0,
        max_running=msg.max_running_requests,
        cache_hit_rate=msg.cache_hit_rate if has("cache_hit_rate") else 0.0,
    )


def decode_kv_batch(msg: Any) -> KvEventBatch:
    """A ``smg.grpc.common.KvEventBatch`` (both services stream the same message)."""
    events: list[KvCacheEvent] = []
    for ev in msg.events:
        kind = ev.WhichOneof("data")
        if kind == "stored":
            st = ev.stored
            if st.HasField("locality") and st.locality == _REMOTE:
                continue  # a shared pool's blocks, not this worker's
            blocks = st.blocks
            events.append(
                KvBlocksStored(
                    block_hashes=tuple([b.block_hash for b in blocks]),
                    parent_hash=st.parent_block_hash if st.HasField("parent_block_hash") else None,
                    token_ids=tuple(chain.from_iterable([b.token_ids for b in blocks])),
                    block_size=(blocks[0].block_size or len(blocks[0].token_ids)) if blocks else 0,
                )
            )
        elif kind == "removed":
            rm = ev.removed
            if rm.HasField("locality") and rm.locality == _REMOTE:
                continue
            events.append(KvBlocksRemoved(tuple(rm.block_hashes)))
        elif kind == "cleared":
            events.append(KvCacheCleared())
    load = decode_load(msg.load) if msg.HasField("load") else None
    return KvEventBatch(
        sequence_number=msg.sequence_number,
        events=tuple(events),
        load=load,
        load_only=load is not None and msg.load.load_only and not events,
    )
