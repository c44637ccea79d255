"""The prefix-index replication wire: delta and repair batches, and the digests replicas compare.

The replicated state is a prefix index's map (block, worker) -> last access (the replicas:
``policies.prefix_replica``); the mesh state carries these values inside its envelope (``mesh.state``).

Batch body (tag ``"i"``): ``[model, [group, ...]]``, a group being ``[worker, time, hashes]`` (one
float time for all, the shape of a routing decision) or ``[worker, times, hashes]`` (``times``:
float64 array bytes, one per hash, for repair and snapshots); ``hashes`` are int64 array bytes,
little-endian. A block costs 8 (or 16) bytes on the wire. ``encode_index_bodies`` cuts groups into
bodies that fit a byte budget; ``decode_index_body`` validates one into ``Group`` values.

Digest: per (worker, time slot) bucket, the entry count and the sum of the block hashes mod 2**64
(``Digest``), a slot being ``int(last_access // granularity)`` (or the exact time with granularity 0).
On the wire, ``[[worker, [[slot, count, sum], ...]], ...]`` (``encode_index_digest`` /
``decode_index_digest``).

Turn ends (tag ``"t"``, sparse replication: ``TurnBatch``): ``[model, time, [worker, ...], widx, keys,
blocks]``, per record a uint8 index into the workers, the int64 name of the prompt's last full block and
its number of blocks (uint16), little-endian: 11 bytes a record (``encode_turn_bodies`` /
``decode_turn_body``). Builds without it skip the tag.

Decoding raises ``StateDecodeError`` (``shepherd.proto.state_decode``) on anything malformed.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shepherd.proto.state_decode import StateDecodeError, expect_int, expect_list, expect_str

__all__ = [
    "MAX_TURN_BLOCKS",
    "MAX_WORKER_LEN",
    "Digest",
    "Group",
    "Slot",
    "TurnBatch",
    "decode_index_body",
    "decode_index_digest",
    "decode_turn_body",
    "encode_index_bodies",
    "encode_index_digest",
    "encode_turn_bodies",
]

_BIG = sys.byteorder == "big"
MAX_WORKER_LEN = 256

Group = tuple[str, "float | array[float]", "array[int]"]
"""(worker, one time or one time per hash, block hashes)."""

Slot = int | float
"""A digest bucket's time slot: ``int(t // granularity)``, or the exact time if the granularity is 0."""

Digest = dict[str, dict[Slot, tuple[int, int]]]
"""worker -> time slot -> (entry count, sum of block hashes mod 2**64)."""


def _to_bytes(a: array[Any]) -> bytes:
    if _BIG:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_bytes(code: str, b: bytes) -> array[Any]:
    a = array(code)
    a.frombytes(b)
    if _BIG:
        a.byteswap()
    return a


# -- batches ------------------------------------------------------------------------------------------


def _str_size(s: str) -> int:
    n = len(s.encode())
    return n + (1 if n <= 31 else 2 if n <= 255 else 3)


def _bin_size(n: int) -> int:
    return n + (2 if n <= 255 else 3 if n <= 65535 else 5)


def encode_index_bodies(model: str, groups: Iterable[Group], budget: int) -> Iterator[list[Any]]:
    """Bodies ``[model, [group, ...]]`` whose msgpack encoding takes at most ``budget`` bytes;
    a group that does not fit is split across bodies."""
    base = 1 + _str_size(model) + 5  # outer array, model, groups array header (conservative)
    if budget < base + 1 + _str_size("") + _bin_size(16) * 2 + 9:
        raise ValueError(f"budget {budget} is too small for an index batch")
    cur: list[Any] = []
    free = budget - base
    for w, t, hs in groups:
        scalar = isinstance(t, float)
        per = 8 if scalar else 16
        fixed = 1 + _str_size(w) + (9 if scalar else 0)
        i, n = 0, len(hs)
        while i < n:
            hdr = fixed + (5 if scalar else 10)  # bin headers, conservative
            k = min(n - i, (free - hdr) // per)
            if k <= 0:
                if not cur:
                    raise ValueError(f"budget {budget} is too small for worker name {w[:32]!r}")
                yield [model, cur]
                cur, free = [], budget - base
                continue
            part_h = hs[i : i + k]
            if scalar:
                cur.append([w, t, _to_bytes(part_h)])
            else:
                assert not isinstance(t, float)
                cur.append([w, _to_bytes(t[i : i + k]), _to_bytes(part_h)])
            free -= fixed + (_bin_size(8 * k) if scalar else 2 * _bin_size(8 * k))
            i += k
    if cur:
        yield [model, cur]


def decode_index_body(body: Any, max_entries: int = 1 << 20) -> tuple[str, list[Group]]:
    """Decode ``[model, groups]``; raises ``StateDecodeError`` on anything malformed."""
    f = expect_list(body, 2)
    model = expect_str(f[0], 512, allow_empty=True)
    out: list[Group] = []
    total = 0
    for g in expect_list(f[1], max_len=max_entries):
        w_raw, t_raw, h_raw = expect_list(g, 3)
        w = expect_str(w_raw, MAX_WORKER_LEN)
        if type(h_raw) is not bytes or len(h_raw) % 8:
            raise StateDecodeError("index hashes must be int64 array bytes")
        hs = _from_bytes("q", h_raw)
        total += len(hs)
        if total > max_entries:
            raise StateDecodeError("too many index entries in one payload")
        t: float | array[float]
        if type(t_raw) is float or type(t_raw) is int:
            t = float(t_raw)
            if not math.isfinite(t):
                raise StateDecodeError("index time must be finite")
        elif type(t_raw) is bytes and len(t_raw) == len(h_raw):
            t = _from_bytes("d", t_raw)
            if not all(map(math.isfinite, t)):
                raise StateDecodeError("index times must be finite")
        else:
            raise StateDecodeError("index time must be a float or a float64 array as long as the hashes")
        out.append((w, t, hs))
    return model, out


# -- turn ends (sparse replication) ---------------------------------------------------------------------

MAX_TURN_BLOCKS = 65_535  # a turn end names at most this many blocks (its blocks travel as uint16)


@dataclass(frozen=True, slots=True)
class TurnBatch:
    """Turn ends of routing decisions (``--mesh-index-replication ends``): record i says that worker
    ``workers[widx[i]]`` holds the ``blocks[i]`` leading blocks of a prompt whose ``blocks[i]``-th block is
    named ``keys[i]`` (the chained names make that one name stand for the whole prefix). ``time``: the
    newest record's. Native byte order in memory; little-endian on the wire."""

    time: float
    workers: list[str]
    widx: bytes  # uint8 per record: an index into workers
    keys: array[int]  # int64 per record
    blocks: array[int]  # uint16 per record, >= 1

    def __len__(self) -> int:
        return len(self.widx)


def encode_turn_bodies(model: str, batch: TurnBatch, budget: int) -> Iterator[list[Any]]:
    """Bodies ``[model, time, [worker, ...], widx, keys, blocks]`` (tag ``"t"``) whose msgpack encoding
    takes at most ``budget`` bytes: 11 bytes a record, and each distinct worker's name once per body."""
    base = 1 + _str_size(model) + 9 + 3 + 3 * 3  # array, model, time, names header, the bins' headers
    sizes = [_str_size(w) for w in batch.workers]
    if budget < base + 11 + max(sizes, default=0):
        raise ValueError(f"budget {budget} is too small for a turn batch")
    n = len(batch)
    widx = batch.widx
    i = 0
    while i < n:  # bounded: each body takes one record at least
        seen: dict[int, int] = {}  # batch's worker index -> the body's
        free = budget - base
        j = i
        while j < n:  # bounded by the records
            w = widx[j]
            cost = 11 if w in seen else 11 + sizes[w]
            if cost > free:
                break
            if w not in seen:
                seen[w] = len(seen)
            free -= cost
            j += 1
        table = bytearray(256)
        for w, k in seen.items():
            table[w] = k
        yield [
            model,
            batch.time,
            [batch.workers[w] for w in seen],
            widx[i:j].translate(table),
            _to_bytes(batch.keys[i:j]),
            _to_bytes(batch.blocks[i:j]),
        ]
        i = j


def decode_turn_body(body: Any, max_records: int = 1 << 16) -> tuple[str, TurnBatch]:
    """Decode ``encode_turn_bodies``' body; raises ``StateDecodeError`` on anything malformed."""
    f = expect_list(body, max_len=16)
    if len(f) < 6:
        raise StateDecodeError("a turn batch has 6 fields at least")
    model = expect_str(f[0], 512, allow_empty=True)
    t_raw = f[1]
    if type(t_raw) is not float and type(t_raw) is not int:
        raise StateDecodeError("turn batch time must be a number")
    t = float(t_raw)
    if not math.isfinite(t):
        raise StateDecodeError("turn batch time must be finite")
    workers = [expect_str(w, MAX_WORKER_LEN) for w in expect_list(f[2], max_len=256)]
    widx, k_raw, b_raw = f[3], f[4], f[5]
    if type(widx) is not bytes or type(k_raw) is not bytes or type(b_raw) is not bytes:
        raise StateDecodeError("turn batch records must be bytes")
    n = len(widx)
    if n > max_records or len(k_raw) != 8 * n or len(b_raw) != 2 * n:
        raise StateDecodeError("turn batch records differ in length (or are too many)")
    if n and max(widx) >= len(workers):
        raise StateDecodeError("turn batch names a worker it does not list")
    blocks = _from_bytes("H", b_raw)
    if n and min(blocks) < 1:
        raise StateDecodeError("a turn end names at least one block")
    return model, TurnBatch(t, workers, widx, _from_bytes("q", k_raw), blocks)


# -- digests ------------------------------------------------------------------------------------------


def encode_index_digest(digest: Digest) -> list[Any]:
    """``[[worker, [[slot, count, sum], ...]], ...]``."""
    return [[w, [[sl, c, s] for sl, (c, s) in slots.items()]] for w, slots in digest.items()]


def decode_index_digest(v: Any) -> Digest:
    """Decode ``encode_index_digest``'s value; raises ``StateDecodeError`` on anything malformed."""
    dig: Digest = {}
    for wv in expect_list(v, max_len=1 << 16):
        w_raw, slots = expect_list(wv, 2)
        per: dict[Slot, tuple[int, int]] = {}
        for sv in expect_list(slots, max_len=1 << 20):
            sl, c, s = expect_list(sv, 3)
            if type(sl) is not int and type(sl) is not float:
                raise StateDecodeError("a digest slot is a number")
            per[sl] = (expect_int(c, 0, 1 << 40), expect_int(s, 0, (1 << 64) - 1))
        dig[expect_str(w_raw)] = per
    return dig
