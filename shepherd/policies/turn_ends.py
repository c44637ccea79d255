"""Turn ends: what a node keeps of its peers' routing decisions under sparse index replication
(``--mesh-index-replication ends``, README "Mesh at scale").

Block names are chained (``block_names``: ``h_i = hash((h_{i-1}, block_i))``), so the name of a prompt's
last full block stands for the whole prefix. A peer that routed a prompt of n blocks to worker w sends
the record (name of block n, w, n) instead of the blocks; a receiver keeps the records, and a match of
a later prompt (a follow-up that landed elsewhere) looks each of its block names up: a record
(name of block i, w, i) says w holds the first i blocks, and w's match is the longer of the index's own
walk and the longest such record (``combine``). Shared system prompts are still learned by each node
from its own decisions and KV events.

``TurnEnds`` is the pure-Python table (the reference, and what the Python replica uses); the native
replica's is ``_prefixcore.Turns`` (same rules, 16 bytes a cell): two generations, records put in the
newer; when it holds half of ``max_records`` or spans half of ``span`` seconds, the older generation
is dropped whole and a new one begun, so a record lives between half and all of either bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["TurnEnds"]


class _Gen:
    __slots__ = ("cells", "first", "last", "used")

    def __init__(self) -> None:
        self.cells: dict[int, dict[str, int]] = {}  # end name -> worker -> blocks
        self.used = 0
        self.first = self.last = 0.0


class TurnEnds:
    """Received turn ends (see the module docstring)."""

    def __init__(self, max_records: int, span: float) -> None:
        self.max_records = max(2, max_records)
        self.span = max(0.0, span)
        self._gens = [_Gen(), _Gen()]  # [0]: the records put now, [1]: the generation before

    def __len__(self) -> int:
        return self._gens[0].used + self._gens[1].used

    def put(self, key: int, worker: str, blocks: int, time: float) -> None:
        g = self._gens[0]
        if g.used and (g.used * 2 >= self.max_records or (self.span > 0 and time - g.first >= self.span / 2)):
            g = _Gen()
            self._gens = [g, self._gens[0]]
        if not g.used:
            g.first = g.last = time
        g.first, g.last = min(g.first, time), max(g.last, time)
        per = g.cells.setdefault(key, {})
        if worker not in per:
            g.used += 1
        per[worker] = blocks

    def best(self, hs: Sequence[int]) -> dict[str, int]:
        """Per worker, the longest leading run of the chain ``hs`` a record names (in blocks)."""
        out: dict[str, int] = {}
        for g in self._gens:
            if not g.used:
                continue
            get = g.cells.get
            for i, h in enumerate(hs):  # bounded by the prompt
                per = get(h)
                if per is None:
                    continue
                for w, n in per.items():
                    if n == i + 1 and n > out.get(w, 0):
                        out[w] = n
        return out

    def combine(self, matched: dict[str, int], hs: Sequence[int], unit: int = 1) -> int:
        """Raise ``matched[worker]`` (in units of ``unit`` per block) to the worker's longest turn end of
        ``hs``; returns the workers improved."""
        n = 0
        for w, b in self.best(hs).items():
            if matched.get(w, 0) < b * unit:
                matched[w] = b * unit
                n += 1
        return n

    def clear(self, worker: str) -> int:
        """Forget the worker's records (it left the index); returns how many. They still count towards
        their generation's bound (as the C table's cells do) until it goes."""
        n = 0
        for g in self._gens:
            for per in g.cells.values():
                if per.pop(worker, None) is not None:
                    n += 1
        return n

    def expire(self, cutoff: float) -> int:
        """Drop the generations whose records are all older than ``cutoff``; returns the records dropped."""
        n = 0
        for i in (1, 0):
            g = self._gens[i]
            if g.used and g.last < cutoff:
                n += g.used
                self._gens[i] = _Gen()
        return n

    def snapshot(self) -> Mapping[int, Mapping[str, int]]:
        """Every record kept, newest generation winning (for tests)."""
        out: dict[int, dict[str, int]] = {}
        for g in reversed(self._gens):
            for k, per in g.cells.items():
                out.setdefault(k, {}).update(per)
        return out
