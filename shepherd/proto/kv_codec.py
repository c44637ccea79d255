"""Engines' KV-event streams, wire to types: ``smg.grpc.common.KvEventBatch`` and its ``EngineLoad`` record.

Both engine services (SGLang, vLLM) stream the same message, so every engine client decodes it here.

``decode_kv_wire`` takes the message's bytes: where the C modules are built, the batch's structure is
checked and its header read in C (``_kvwire.kv_scan``) and its events stay bytes (``WireEvents``), which
the node's KV feed applies to the prefix index in C (``policies._prefixcore.KvMap.apply``) without a
protobuf message, a Python object per event or a Python int per block hash and token id. Read as a
sequence, ``WireEvents`` decodes them with protobuf (``decode_kv_batch``'s events, the same values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, overload

from smg_grpc_proto.generated import common_pb2

from shepherd.proto.engine_types import (
    EngineLoad,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheCleared,
    KvCacheEvent,
    KvEventBatch,
)

_REMOTE = 2  # smg.grpc.common.KvCacheLocality.KV_CACHE_LOCALITY_REMOTE

LoadFields = tuple[int, int, int, int, float, int, int, float, bool]  # EngineLoad's, then load_only
kv_scan: Callable[[bytes], tuple[int, int, int, int, LoadFields | None] | None] | None = None
try:  # the scanner in C (setup.py builds it where a compiler is)
    from shepherd.proto import _kvwire

    kv_scan = _kvwire.kv_scan
except ImportError:  # pragma: no cover - an install without a C compiler
    pass


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


def decode_kv_event(ev: Any) -> KvCacheEvent | None:
    """A ``smg.grpc.common.KvCacheEvent``; None for one a worker's index does not take (a remote pool's
    blocks, no data)."""
    kind = ev.WhichOneof("data")
    if kind == "stored":
        st = ev.stored
        if st.HasField("locality") and st.locality == _REMOTE:
            return None  # a shared pool's blocks, not this worker's
        blocks = st.blocks
        return KvBlocksStored(
            block_hashes=tuple([b.block_hash for b in blocks]),
            parent_hash=st.parent_block_hash if st.HasField("parent_block_hash") else None,
            token_ids=tuple(chain.from_iterable([b.token_ids for b in blocks])),
            block_size=(blocks[0].block_size or len(blocks[0].token_ids)) if blocks else 0,
        )
    if kind == "removed":
        rm = ev.removed
        if rm.HasField("locality") and rm.locality == _REMOTE:
            return None
        return KvBlocksRemoved(tuple(rm.block_hashes))
    if kind == "cleared":
        return KvCacheCleared()
    return None


def decode_kv_event_bytes(raw: bytes) -> KvCacheEvent | None:
    """``decode_kv_event`` of a serialized ``KvCacheEvent`` (one of a batch's, from its bytes)."""
    return decode_kv_event(common_pb2.KvCacheEvent.FromString(raw))


def decode_kv_batch(msg: Any) -> KvEventBatch:
    """A ``smg.grpc.common.KvEventBatch`` (both services stream the same message)."""
    events = [e for e in map(decode_kv_event, msg.events) if e is not None]
    load = decode_load(msg.load) if msg.HasField("load") else None
    return KvEventBatch(
        sequence_number=msg.sequence_number,
        events=tuple(events),
        load=load,
        load_only=load is not None and msg.load.load_only and not events,
    )


def _varint(raw: bytes, p: int) -> tuple[int, int]:
    v = shift = 0
    while True:  # bounded: p moves on (an IndexError past the end)
        b = raw[p]
        p += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, p
        shift += 7


def kv_event_ranges(raw: bytes, start: int = 0) -> Iterator[tuple[int, int]]:
    """Where the events (``KvCacheEvent`` bodies) of a serialized ``KvEventBatch`` that ``kv_scan``
    accepted are, from byte ``start`` on: (start, end) of each, in order."""
    p, n = start, len(raw)
    while p < n:  # bounded: p moves on every turn
        tag, p = _varint(raw, p)
        wt = tag & 7
        if wt == 0:
            p = _varint(raw, p)[1]
        elif wt == 1:
            p += 8
        elif wt == 5:
            p += 4
        elif wt == 2:
            size, p = _varint(raw, p)
            if tag >> 3 == 3:
                yield p, p + size
            p += size
        else:
            raise ValueError(f"wire type {wt} in a KvEventBatch")


class WireEvents(Sequence[KvCacheEvent]):
    """A batch's events as the bytes of its message (``raw``), ``n`` of them as ``decode_kv_batch`` keeps
    them; decoded with protobuf on first use as a sequence (a consumer that applies ``raw`` in C never
    does)."""

    __slots__ = ("_decoded", "n", "raw")

    def __init__(self, raw: bytes, n: int) -> None:
        self.raw = raw
        self.n = n
        self._decoded: tuple[KvCacheEvent, ...] | None = None

    def decoded(self) -> tuple[KvCacheEvent, ...]:
        if self._decoded is None:
            self._decoded = tuple(decode_kv_batch(common_pb2.KvEventBatch.FromString(self.raw)).events)
        return self._decoded

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> KvCacheEvent: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[KvCacheEvent]: ...
    def __getitem__(self, i: int | slice) -> KvCacheEvent | Sequence[KvCacheEvent]:
        return self.decoded()[i]

    def __iter__(self) -> Iterator[KvCacheEvent]:
        return iter(self.decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WireEvents):
            return self.decoded() == other.decoded()
        return isinstance(other, tuple) and self.decoded() == other

    def __hash__(self) -> int:  # equal to the tuple of its events: hashed as it
        return hash(self.decoded())

    def __repr__(self) -> str:
        return f"WireEvents({self.n} events, {len(self.raw)} bytes)"


def decode_kv_wire(raw: bytes) -> KvEventBatch:
    """``decode_kv_batch`` of the message's bytes, the events kept as bytes (``WireEvents``) where the C
    scanner is built and accepts the message; protobuf's parse otherwise (which raises ``DecodeError`` on
    a malformed message, as before)."""
    head = kv_scan(raw) if kv_scan is not None else None
    if head is None:
        return decode_kv_batch(common_pb2.KvEventBatch.FromString(raw))
    seq, n, lo, hi, fields = head
    load = None
    load_only = False
    if fields is not None:  # read in C (plain scalars)
        load = EngineLoad(*fields[:8])
        load_only = fields[8] and not n
    elif lo >= 0:  # nested telemetry: protobuf's
        pb = common_pb2.EngineLoad.FromString(raw[lo:hi])
        load = decode_load(pb)
        load_only = pb.load_only and not n
    return KvEventBatch(
        sequence_number=seq, events=WireEvents(raw, n) if n else (), load=load, load_only=load_only
    )
