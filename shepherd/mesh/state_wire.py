"""The envelope codec of the mesh state's payloads, and the decoding of a peer's state digest.

Every payload of ``state.MeshState`` is one msgpack envelope ``[VERSION, tag, body]`` (``envelope``;
``peek`` checks the version and returns the tag and the body, raising ``StateDecodeError`` on anything
malformed); ``chunks`` splits wire items into bodies that fit a payload budget; ``decode_digest``
validates the body of a ``MeshState.digest()`` into a ``StateDigest``. The tags:

====  ======================================  ===============================================
tag   body                                    meaning
====  ======================================  ===============================================
"r"   [registry entry, ...]                   registry delta (or repair)
"h"   [observation, ...]                      health delta (or repair)
"i"   [model, [group, ...]]                   prefix-index delta (or repair)
"c"   update bytes                            config (Yjs) update
"x"   [name, delta]                           an extra component's delta
"X"   [name, snapshot]                        an extra component's snapshot (repair)
"S"   {"r", "h", "c", "i", "x"}               full snapshot (``snapshot`` / ``merge_snapshot``)
"P"   {"n", "r", "h", "c", "x", "d"}          push-pull state: small parts in full, index digests
"D"   {"n", "r", "h", "c", "d", "x"}          digest (``digest`` / ``repair``)
====  ======================================  ===============================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from shepherd.proto.index_wire import Digest, decode_index_digest
from shepherd.proto.state_decode import StateDecodeError, expect_bytes, expect_int, expect_list, expect_str

__all__ = [
    "ENVELOPE_OVERHEAD",
    "MAX_MODELS",
    "VERSION",
    "StateDigest",
    "chunks",
    "decode_digest",
    "decode_index_digests",
    "envelope",
    "peek",
]

VERSION = 1
ENVELOPE_OVERHEAD = 8  # bytes the envelope adds to a body (array header, version, tag; rounded up)
MAX_MODELS = 256  # prefix indexes created on a peer's word, at most


def envelope(tag: str, body: Any) -> bytes:
    out: bytes = msgpack.packb([VERSION, tag, body], use_bin_type=True)
    return out


def peek(payload: bytes) -> tuple[str, Any]:
    if type(payload) is not bytes:
        raise StateDecodeError("a state payload is bytes")
    try:
        v = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, StackError, ...)
        raise StateDecodeError(f"not msgpack: {e}") from None
    f = expect_list(v, 3)
    if expect_int(f[0], 0, 255) != VERSION:
        raise StateDecodeError(f"unknown state payload version {f[0]}")
    return expect_str(f[1], 8), f[2]


def chunks(items: list[Any], budget: int) -> list[list[Any]]:
    """Split wire items into lists whose msgpack encoding fits ``budget`` (an item larger than the
    budget travels alone)."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    size = 5
    for it in items:
        n = len(msgpack.packb(it, use_bin_type=True))
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 5
        cur.append(it)
        size += n
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True, slots=True)
class StateDigest:
    registry: bytes
    health: bytes
    config_sv: bytes
    config_digest: bytes
    indexes: dict[str, Digest]
    extras: dict[str, Any]


def decode_digest(body: Any) -> StateDigest:
    if type(body) is not dict:
        raise StateDecodeError("a digest is a map")
    sv, cd = expect_list(body.get("c"), 2)
    extras = {}
    for x in expect_list(body.get("x", []), max_len=1024):
        name, value = expect_list(x, 2)
        extras[expect_str(name, 64)] = value
    return StateDigest(
        expect_bytes(body.get("r"), 64),
        expect_bytes(body.get("h"), 64),
        expect_bytes(sv),
        expect_bytes(cd, 64),
        decode_index_digests(body.get("d", [])),
        extras,
    )


def decode_index_digests(v: Any) -> dict[str, Digest]:
    out: dict[str, Digest] = {}
    for m in expect_list(v, max_len=MAX_MODELS):
        model_raw, workers = expect_list(m, 2)
        model = expect_str(model_raw, 512, allow_empty=True)
        out[model] = decode_index_digest(workers)
    return out
