"""The mock's embeddings: a deterministic unit vector per token-id sequence (``embed_ids``), what the
gRPC ``Embed`` RPCs and HTTP ``/v1/embeddings`` return.

The vector is a seeded hash of the ids: blake2b of the ids (and the engine's seed) seeds a PRNG whose
``dim`` Gaussian draws, normalized, are the embedding. The same ids give the same vector on every run,
any engine and either surface; different ids give (almost surely) different vectors.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections.abc import Sequence

DEFAULT_DIM = 64


def embed_ids(ids: Sequence[int], dim: int = DEFAULT_DIM, seed: int = 0) -> list[float]:
    """A unit vector of ``dim`` floats (float32 values), a function of ``ids`` and ``seed`` only."""
    if dim <= 0:
        raise ValueError("dim must be positive")
    h = hashlib.blake2b(digest_size=16, person=b"smg-mock-embed")
    h.update(seed.to_bytes(8, "little", signed=True))
    h.update(array("q", ids).tobytes())
    rng = random.Random(int.from_bytes(h.digest(), "little"))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(math.fsum(x * x for x in vec)) or 1.0
    return list(array("f", [x / norm for x in vec]))  # the float32 values the wire carries
