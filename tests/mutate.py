"""Byte strings with a few random edits, for the decoders' fuzz tests (the unit tests' fixed seeds and the
fuzz targets' random ones)."""

from __future__ import annotations

import random


def mutated(rng: random.Random, raw: bytes, flips: int) -> bytes:
    """raw with ``flips`` bytes changed, inserted or deleted."""
    b = bytearray(raw)
    for _ in range(flips):  # bounded
        i = rng.randrange(len(b) + 1)
        op = rng.random()
        if op < 0.4 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op < 0.7:
            b[i:i] = bytes([rng.randrange(256)])
        elif b:
            del b[min(i, len(b) - 1)]
    return bytes(b)
