"""Keys chosen to collide under a fixed hash: the int64 whose splitmix64 finalizer (``mix`` in
_prefixcore.c, the KV map's and the index's former fixed placement) is a given value, so that tests can
send keys that all shared one probe run (a hash-flooding input)."""

from __future__ import annotations

import random

M64 = (1 << 64) - 1


def _unshift(z: int, s: int) -> int:
    """The inverse of ``z ^ (z >> s)`` on 64 bits."""
    x = z
    for _ in range(64 // s + 1):  # bounded: each turn fixes s more bits
        x = z ^ (x >> s)
    return x & M64


def unmix(z: int) -> int:
    """The int64 whose splitmix64 finalizer is z."""
    x = _unshift(z, 31)
    x = _unshift(x * pow(0x94D049BB133111EB, -1, 1 << 64) & M64, 27)
    x = _unshift(x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & M64, 30)
    return x - (1 << 64) if x >> 63 else x


def colliding_keys(n: int, seed: int, low_bits: int = 20) -> list[int]:
    """``n`` int64 keys whose fixed-mix values share their low ``low_bits`` bits (one probe run at any
    table size up to 2**low_bits)."""
    rng = random.Random(seed)
    return [unmix(rng.getrandbits(64 - low_bits) << low_bits) for _ in range(n)]
