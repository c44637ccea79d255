"""manual: sticky routing by the ``x-smg-routing-key`` header, with failover.

A key stays on the worker it was first given until that worker is no longer routable; then it moves
to another worker, remembered as its second candidate (up to 2 per key, the oldest dropped, as SMG
does); the first routable candidate in that order wins, so a key goes back home when its first
worker recovers. New keys and requests without a key are assigned at random or to the least
loaded worker. The key map is bounded (least recently used keys are forgotten), and so is each key:
one longer than ``MAX_KEY_CHARS`` (256: a session or user id is shorter) is held as a 33-character
digest, so the map holds at most ``max_keys`` x ~400 bytes whatever the keys.
"""

from __future__ import annotations

import hashlib
import random as _random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded

MAX_CANDIDATES = 2
MAX_KEY_CHARS = 256


def bounded_key(key: str) -> str:
    """``key`` itself when short, else a digest of it (the same key always maps to the same digest)."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    return "#" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class Manual:
    name = "manual"

    def __init__(
        self,
        assignment: Literal["random", "min_load"] = "random",
        max_keys: int = 100_000,
        seed: int | None = None,
    ) -> None:
        self.assignment = assignment
        self.uses_loads = assignment == "min_load"  # (random assignment never reads the engines' loads)
        self.max_keys = max_keys
        self._rng = _random.Random(seed)
        self._keys: OrderedDict[str, list[str]] = OrderedDict()

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        key = req.routing_key
        if not key:
            return self._assign(workers)
        if len(key) > MAX_KEY_CHARS:
            key = bounded_key(key)
        cands = self._keys.get(key)
        if cands is not None:
            self._keys.move_to_end(key)
            by_id = {w.id: w for w in workers}
            for wid in cands:
                w = by_id.get(wid)
                if w is not None:
                    return w
            chosen = self._assign(workers)
            cands.append(chosen.id)
            del cands[:-MAX_CANDIDATES]
            return chosen
        chosen = self._assign(workers)
        self._keys[key] = [chosen.id]
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return chosen

    def candidates(self, key: str) -> list[str]:
        """The workers a key sticks to, in preference order (empty if unknown)."""
        return list(self._keys.get(bounded_key(key), ()))

    def _assign(self, workers: Sequence[WorkerView]) -> WorkerView:
        if self.assignment == "min_load":
            return least_loaded(workers)
        return workers[self._rng.randrange(len(workers))]
