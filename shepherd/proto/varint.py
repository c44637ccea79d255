"""Protobuf varints: the one encoder the hand-written wire paths share (engine requests, mock engine)."""

from __future__ import annotations

from typing import Final

SMALL_LIMIT: Final = 1 << 14
# the varints of 0 .. 16,383 (one or two bytes): lengths and counts, looked up instead of computed
SMALL: Final[list[bytes]] = [
    bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(SMALL_LIMIT)
]


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    if n < SMALL_LIMIT:
        return SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
