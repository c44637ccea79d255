"""The envelope codec of the mesh state's payloads, and the decoding of a peer's state digest.

Every payload of ``state.MeshState`` is one msgpack envelope ``[VERSION, tag, body]`` (``envelope``;
``peek`` checks the version and returns the tag and the body, raising ``StateDecodeError`` on anything
malformed); ``chunks`` splits wire items into bodies that fit a payload budget; ``decode_digest``
validates the body of a ``MeshState.digest()`` into a ``StateDigest``. The tags:

====  ======================================  ===============================================
tag   body                                    meaning
====  ======================================  ===============================================
"r"   [registry entry, ...]                   registry delta (or repair)
"f"   [health delta, ...]                     an observer's flips from version prev (``state_health``)
"b"   [health beacon, ...]                    an observer's version, unhealthy set, checked-set hash
"H"   [checked sets, [record, ...]]           full health records (repair)
"h"   [observation, ...]                      health observations of the earlier format (read only)
"i"   [model, [group, ...]]                   prefix-index delta (or repair)
"t"   [model, time, [worker, ...], widx,      turn ends of routing decisions (sparse index
       keys, blocks]                          replication; ``index_wire.TurnBatch``)
"c"   update bytes                            config (Yjs) update
"x"   [name, delta]                           an extra component's delta
"X"   [name, snapshot]                        an extra component's snapshot (repair)
"S"   {"r", "hr", "c", "i", "x"}              full snapshot (``snapshot`` / ``merge_snapshot``)
"P"   {"n", "r", "hr", "c", "x", "d",         push-pull state: a request has the digests ("hd"
       "hd", "rd", "cd", "xd"}                health versions, "rd", "cd", "xd") and the sender's own
                                              health record; a reply only what the requester lacks
"D"   {"n", "r", "h", "hv", "c", "d", "x"}    digest (``digest`` / ``repair``)
"~"   minor                                   test-next build only (skipped by this minor)
====  ======================================  ===============================================

Versions follow ``shepherd.proto.wire_version`` (the scheme and the upgrade rule): ``VERSION`` is
``major << 4 | minor`` (``1`` = 0.1, what builds before versioning sent); ``peek`` accepts our major
with a minor at most one away, and ignores fields after ``body`` (a later minor's); a tag this build
does not know is skipped by ``MeshState.apply`` (counted in ``MeshStateStats.unknown_skipped``), never an
error. A test-next build (``wire_version.set_test_next``) sends ``MINOR + 1``, an extra trailing
field and the ``"~"`` tag.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from shepherd.proto import wire_version
from shepherd.proto.index_wire import Digest, decode_index_digest
from shepherd.proto.msgpack_bounds import BoundsError, Limits, unpack, unpack_steps
from shepherd.proto.state_decode import StateDecodeError, expect_bytes, expect_list, expect_str

__all__ = [
    "ENVELOPE_OVERHEAD",
    "MAX_MODELS",
    "TEST_NEXT_TAG",
    "VERSION",
    "StateDigest",
    "chunks",
    "decode_digest",
    "decode_index_digests",
    "envelope",
    "peek",
    "peek_steps",
]

VERSION = wire_version.version_byte(wire_version.MAJOR, wire_version.MINOR)
TEST_NEXT_TAG = "~"
ENVELOPE_OVERHEAD = 8  # bytes the envelope adds to a body (array header, version, tag; rounded up)
MAX_MODELS = 256  # prefix indexes created on a peer's word, at most


def envelope(tag: str, body: Any) -> bytes:
    fields = [wire_version.encode(), tag, body]
    if wire_version.is_test_next():
        fields.append(1)  # the next minor's extra trailing field
    out: bytes = msgpack.packb(fields, use_bin_type=True)
    return out


# what a payload may decode into (``msgpack_bounds``; its size is the transport's bound: a datagram, a
# push-pull frame): no extension types, and at most an array or map per 2 bytes (the densest entries are
# pairs, 3 bytes and more): a push-pull state of empty arrays, 16 million lists, is refused at 8 million
LIMITS = Limits(
    max_bytes=1 << 30,
    max_str_len=1 << 30,
    max_bin_len=1 << 30,
    max_array_len=1 << 30,
    max_map_len=1 << 30,
    bytes_per_container=2,
)


def peek(payload: bytes) -> tuple[str, Any]:
    if type(payload) is not bytes:
        raise StateDecodeError("a state payload is bytes")
    try:
        v = unpack(payload, LIMITS)
    except BoundsError as e:
        raise StateDecodeError(f"not msgpack: {e}") from None
    return _fields(v)


def peek_steps(payload: bytes) -> Generator[None, None, tuple[str, Any]]:
    """``peek`` a slice at a time (``msgpack_bounds.unpack_steps``): a push-pull state can be MBs."""
    if type(payload) is not bytes:
        raise StateDecodeError("a state payload is bytes")
    try:
        v = yield from unpack_steps(payload, LIMITS)
    except BoundsError as e:
        raise StateDecodeError(f"not msgpack: {e}") from None
    return _fields(v)


def _fields(v: Any) -> tuple[str, Any]:
    f = expect_list(v, max_len=16)
    if len(f) < 3 or (wire_version.is_strict() and len(f) != 3):
        raise StateDecodeError("a state payload has 3 fields at least")
    try:
        wire_version.check(f[0])
    except wire_version.VersionError as e:
        raise StateDecodeError(f"state payload: {e}") from None
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
