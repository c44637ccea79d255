"""Hash-ring policies: consistent_hashing (by routing key) and prefix_hash (by the first N tokens).

Ring points and keys use stable hashes (blake2b for strings, CPython's unsalted int-tuple hash for
token ids), so every node of a mesh maps a key to the same worker.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded, worker_load

_U64 = (1 << 64) - 1


def stable_hash64(data: str) -> int:
    """A 64-bit hash of a string that is the same in every process (unlike ``hash(str)``)."""
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent-hash ring over worker ids with ``vnodes`` virtual nodes each."""

    __slots__ = ("ids", "owners", "points")

    def __init__(self, worker_ids: Sequence[str], vnodes: int = 160) -> None:
        pts = sorted((stable_hash64(f"{wid}#{i}"), wid) for wid in set(worker_ids) for i in range(vnodes))
        self.points = [p for p, _ in pts]
        self.owners = [w for _, w in pts]
        self.ids = frozenset(worker_ids)

    def lookup(self, key: int) -> str | None:
        """The worker owning ``key`` (the first point clockwise from it)."""
        if not self.points:
            return None
        i = bisect_left(self.points, key & _U64)
        return self.owners[i % len(self.owners)]


class _RingCache:
    """The ring for the current set of routable workers; rebuilt only when that set changes."""

    def __init__(self, vnodes: int) -> None:
        self.vnodes = vnodes
        self._rings: dict[frozenset[str], HashRing] = {}

    def get(self, workers: Sequence[WorkerView]) -> HashRing:
        ids = frozenset(w.id for w in workers)
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= 16:  # bounded: a few recent worker sets (e.g. one worker out)
                self._rings.pop(next(iter(self._rings)))
            ring = self._rings[ids] = HashRing(sorted(ids), self.vnodes)
        return ring


class ConsistentHashing:
    """The routing key (``x-smg-routing-key``) on a ring with virtual nodes; when a worker leaves, only
    its keys move. Requests without a key go to the least loaded worker."""

    name = "consistent_hashing"

    def __init__(self, vnodes: int = 160) -> None:
        self._rings = _RingCache(vnodes)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        if not req.routing_key:
            return least_loaded(workers)
        wid = self._rings.get(workers).lookup(stable_hash64(req.routing_key))
        return next(w for w in workers if w.id == wid)


@dataclass(frozen=True, slots=True)
class PrefixHashConfig:
    prefix_tokens: int = 256
    load_factor: float = 1.25  # a ring choice above (mean load + 1/n) * load_factor is overloaded
    vnodes: int = 160


class PrefixHash:
    """Hash of the first ``prefix_tokens`` token ids -> ring -> worker, unless that worker is
    overloaded (then the least loaded worker that is not). No token ids: the least loaded worker."""

    name = "prefix_hash"

    def __init__(self, config: PrefixHashConfig | None = None) -> None:
        self.config = config or PrefixHashConfig()
        self._rings = _RingCache(self.config.vnodes)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        if not req.input_ids:
            return least_loaded(workers)
        key = hash(tuple(req.input_ids[: self.config.prefix_tokens]))  # int tuples: not salted
        wid = self._rings.get(workers).lookup(key)
        chosen = next(w for w in workers if w.id == wid)
        limit = (sum(map(worker_load, workers)) + 1) / len(workers) * self.config.load_factor
        if worker_load(chosen) <= limit:
            return chosen
        ok = [w for w in workers if worker_load(w) <= limit]
        return least_loaded(ok) if ok else chosen
