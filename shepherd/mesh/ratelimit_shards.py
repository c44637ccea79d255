"""Rate-limit counter shards: the CRDT and the window maths under ``shepherd.mesh.ratelimit``.

One *entry* is the shard that one node process (``node``, ``gen``) holds for one limit key
(tenant, model). It counts, for the current time window and the one before it::

    REQ   admitted requests                      (G-counter)
    TOK   tokens reserved at admission + extras  (G-counter)
    REF   tokens refunded at settlement          (G-counter; net tokens = TOK - REF)
    AREQ  attempted requests, admitted or not    (G-counter; the node's demand)
    ATOK  attempted tokens                       (G-counter)

plus a concurrency gauge as two monotonic counters ``inc``/``dec`` (a PN pair: in flight = inc - dec)
and ``ver``, the owner's version stamp (for digests and relays): when the owner publishes a changed entry
it becomes ``max(ver + 1, ver_at(t, gen))``, t the time of the entry's last change (``ver_at``: the
milliseconds since the process generation's start, ``gen`` being its start time in microseconds), so
that a receiver can tell how old the state it holds is (``time_of_ver``). A build that reads ``ver``
as an opaque counter (the earlier ones) sees a counter that only grows, as before: the wire is the
same. Only the owner increments its entry.

``join`` is the merge: entries of different ``born`` (the owner re-created the entry after garbage
collecting it) are ordered by ``born`` and the later wins whole; otherwise the newer window wins and
counters are joined field-wise by max, with the older entry's current window joining the newer one's
previous window when they are adjacent. This is the join of a semilattice, so it is commutative,
associative and idempotent (property-tested), and memory per entry is constant: windows older than
the previous one are dropped by every join, which keeps the laws because a window that is dropped
once would be dropped by any later join too.

Windows are ``floor(now / window)`` on the wall clock every node shares (NTP-level skew shifts a
boundary by the skew, an error of skew/window on the previous window's weight).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import Any

REQ, TOK, REF, AREQ, ATOK = range(5)
NFIELDS = 5
ZERO: tuple[int, ...] = (0,) * NFIELDS

WIRE_LEN = 9 + 2 * NFIELDS  # tenant, model, node, gen, born, win, cur*5, prev*5, inc, dec, ver
# positions in a wire entry
W_GEN, W_BORN, W_WIN, W_CUR = 3, 4, 5, 6
W_PREV = W_CUR + NFIELDS
W_INC, W_DEC, W_VER = W_PREV + NFIELDS, W_PREV + NFIELDS + 1, W_PREV + NFIELDS + 2


class Entry:
    """One node's shard for one key. Mutable only by its owner (``add``); everyone else ``join``s."""

    __slots__ = ("born", "cur", "dec", "inc", "prev", "ver", "win")

    def __init__(
        self,
        born: int,
        win: int,
        cur: list[int] | None = None,
        prev: list[int] | None = None,
        inc: int = 0,
        dec: int = 0,
        ver: int = 0,
    ) -> None:
        self.born = born
        self.win = win
        self.cur = cur if cur is not None else [0] * NFIELDS
        self.prev = prev if prev is not None else [0] * NFIELDS
        self.inc = inc
        self.dec = dec
        self.ver = ver

    def key(self) -> tuple[Any, ...]:
        return (self.born, self.win, tuple(self.cur), tuple(self.prev), self.inc, self.dec, self.ver)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"Entry{self.key()}"

    def copy(self) -> Entry:
        return Entry(self.born, self.win, list(self.cur), list(self.prev), self.inc, self.dec, self.ver)

    def roll(self, w: int) -> None:
        """Owner only: move the entry to window ``w`` (>= its window); same as joining an empty entry."""
        if w == self.win:
            return
        if w == self.win + 1:
            self.prev = self.cur
        else:
            self.prev = [0] * NFIELDS
        self.cur = [0] * NFIELDS
        self.win = w

    def aligned(self, w: int) -> tuple[Sequence[int], Sequence[int]]:
        """(previous, current) counts as seen from window ``w``."""
        if self.win == w:
            return self.prev, self.cur
        if self.win == w - 1:
            return self.cur, ZERO
        if self.win == w + 1:  # the owner's clock is a little ahead: count all of it as current
            return ZERO, [a + b for a, b in zip(self.prev, self.cur, strict=True)]
        return ZERO, ZERO


def _vmax(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The field-wise max of two count vectors (unrolled for the NFIELDS = 5 fields: a third of the
    cost of a comprehension, on every merge)."""
    a0, a1, a2, a3, a4 = a
    b0, b1, b2, b3, b4 = b
    return [
        a0 if a0 >= b0 else b0,
        a1 if a1 >= b1 else b1,
        a2 if a2 >= b2 else b2,
        a3 if a3 >= b3 else b3,
        a4 if a4 >= b4 else b4,
    ]


def join(a: Entry, b: Entry) -> Entry:
    """The least upper bound of two states of the same shard (a new Entry; inputs are not changed)."""
    if a.born != b.born:
        return (a if a.born > b.born else b).copy()
    if a.win == b.win:
        win, cur, prev = a.win, _vmax(a.cur, b.cur), _vmax(a.prev, b.prev)
    else:
        hi, lo = (a, b) if a.win > b.win else (b, a)
        win, cur = hi.win, list(hi.cur)
        prev = _vmax(hi.prev, lo.cur) if hi.win == lo.win + 1 else list(hi.prev)
    return Entry(a.born, win, cur, prev, max(a.inc, b.inc), max(a.dec, b.dec), max(a.ver, b.ver))


# ---- wire form: flat lists of ints and strings, msgpack-able ------------------------------------------


def entry_to_wire(tenant: str, model: str, node: str, gen: int, e: Entry) -> list[Any]:
    return [tenant, model, node, gen, e.born, e.win, *e.cur, *e.prev, e.inc, e.dec, e.ver]


def entry_from_wire(item: Any) -> tuple[str, str, str, int, Entry] | None:
    """Parse one wire entry; None if it is malformed (a bad peer must not crash the node)."""
    if not isinstance(item, (list, tuple)) or len(item) != WIRE_LEN:
        return None
    tenant, model, node, gen = item[0], item[1], item[2], item[3]
    nums = item[4:]
    if not (isinstance(tenant, str) and isinstance(model, str) and isinstance(node, str)):
        return None
    if type(gen) is not int or not all(type(x) is int for x in nums) or min(nums[2:]) < 0:
        return None
    born, win = nums[0], nums[1]
    cur = list(nums[2 : 2 + NFIELDS])
    prev = list(nums[2 + NFIELDS : 2 + 2 * NFIELDS])
    inc, dec, ver = nums[2 + 2 * NFIELDS :]
    return tenant, model, node, gen, Entry(born, win, cur, prev, inc, dec, ver)


_SEQ_TYPES = frozenset({list, tuple})
_STR_TYPES = frozenset({str})
_INT_TYPES = frozenset({int})


def _wire_ok(item: Any) -> bool:
    return (
        type(item) in _SEQ_TYPES
        and len(item) == WIRE_LEN
        and type(item[0]) is str
        and type(item[1]) is str
        and type(item[2]) is str
        and _INT_TYPES.issuperset(map(type, item[W_GEN:]))
        and min(item[W_CUR:]) >= 0
    )


def wire_entries_ok(items: Sequence[Any]) -> bool:
    """True if every item passes ``entry_from_wire``'s checks, made column-wise over the whole list (the
    per-item checks cost ~2 µs an entry, this ~0.7). False also for what only the per-item checks
    accept (subclasses of list, tuple or str): the caller then checks item by item."""
    if len(items) < 8:  # few: item by item is cheaper than the columns
        return all(map(_wire_ok, items))
    if not _SEQ_TYPES.issuperset(map(type, items)) or set(map(len, items)) != {WIRE_LEN}:
        return False
    cols = list(zip(*items, strict=True))
    return (
        _STR_TYPES.issuperset(map(type, chain(cols[0], cols[1], cols[2])))
        and _INT_TYPES.issuperset(map(type, chain.from_iterable(cols[W_GEN:])))
        and min(map(min, cols[W_CUR:])) >= 0
    )


def entry_of_wire(item: Sequence[Any]) -> Entry:
    """The entry of a wire item that passed the checks (``wire_entries_ok`` or ``entry_from_wire``)."""
    if type(item) is list:  # its slices are new lists already
        cur, prev = item[W_CUR:W_PREV], item[W_PREV:W_INC]
    else:
        cur, prev = list(item[W_CUR:W_PREV]), list(item[W_PREV:W_INC])
    return Entry(item[W_BORN], item[W_WIN], cur, prev, item[W_INC], item[W_DEC], item[W_VER])


def join_wire(a: Entry, item: Sequence[Any]) -> bool:
    """``a`` becomes ``join(a, entry_of_wire(item))``, in place (no entry decoded); True if it changed.
    For a receiver's merge: the held entry is the receiver's alone (nothing else refers to it)."""
    born = item[W_BORN]
    if born != a.born:
        if born < a.born:
            return False
        a.born, a.win, a.cur, a.prev = born, item[W_WIN], list(item[W_CUR:W_PREV]), list(item[W_PREV:W_INC])
        a.inc, a.dec, a.ver = item[W_INC], item[W_DEC], item[W_VER]
        return True
    win, aw = item[W_WIN], a.win
    if win == aw:
        cur, prev = item[W_CUR:W_PREV], item[W_PREV:W_INC]
        same = item[W_VER] == a.ver and cur == a.cur and prev == a.prev
        if same and item[W_INC] == a.inc and item[W_DEC] == a.dec:
            return False  # the same state again (a relayed copy, a converged peer's diff)
        cur, prev = _vmax(a.cur, cur), _vmax(a.prev, prev)
    elif win > aw:
        cur = list(item[W_CUR:W_PREV])
        prev = _vmax(item[W_PREV:W_INC], a.cur) if win == aw + 1 else list(item[W_PREV:W_INC])
    else:
        win, cur = aw, a.cur
        prev = _vmax(a.prev, item[W_CUR:W_PREV]) if aw == item[W_WIN] + 1 else a.prev
    inc, dec, ver = max(a.inc, item[W_INC]), max(a.dec, item[W_DEC]), max(a.ver, item[W_VER])
    if win == aw and cur == a.cur and prev == a.prev and inc == a.inc and dec == a.dec and ver == a.ver:
        return False
    a.win, a.cur, a.prev, a.inc, a.dec, a.ver = win, cur, prev, inc, dec, ver
    return True


def wire_size(item: Sequence[Any]) -> int:
    """An upper bound of the msgpack size of a wire entry (to fill gossip payloads without encoding)."""
    n = 3
    for x in item:
        if isinstance(x, str):
            n += len(x.encode()) + 2
        else:
            n += 1 if 0 <= x < 128 else 3 if -32768 <= x < 65536 else 5 if -(2**31) <= x < 2**32 else 9
    return n


def ver_at(t: float, gen: int) -> int:
    """The version stamp of a state last changed at ``t`` (wall-clock seconds) by generation ``gen``
    (its start time, microseconds since the epoch): whole milliseconds since that start."""
    return math.floor(t * 1000.0 - gen / 1000.0)


def time_of_ver(ver: int, gen: int) -> float:
    """When the owner last changed a state stamped ``ver`` (``ver_at``'s inverse, to the millisecond
    below; a state published faster than once a millisecond reads a little later)."""
    return (ver + gen / 1000.0) / 1000.0


# ---- window maths -----------------------------------------------------------------------------------


def window_of(now: float, window: float) -> tuple[int, float]:
    """(window index, fraction of it elapsed) for time ``now``."""
    x = now / window
    w = math.floor(x)
    return w, x - w


def sliding(prev: float, cur: float, frac: float) -> float:
    """The sliding-window-counter estimate: the previous window weighted by the part of it still inside
    the sliding window, plus the current window."""
    return prev * (1.0 - frac) + cur


def wait_until_fits(prev: float, cur: float, frac: float, window: float, limit: float, cost: float) -> float:
    """Seconds until ``sliding(prev, cur) + cost <= limit`` if nothing more is admitted (the previous
    window decays linearly, then the current one does in the next window); ``math.inf`` if never."""
    target = limit - cost
    if target < 0:
        return math.inf
    if sliding(prev, cur, frac) <= target:
        return 0.0
    if cur <= target:  # within this window: prev * (1 - frac - d/W) + cur == target
        return max(0.0, window * ((1.0 - frac) - (target - cur) / prev)) if prev > 0 else 0.0
    return (1.0 - frac) * window + window * (1.0 - target / cur)


def fmt_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: ``120ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, secs = divmod(round(seconds, 2), 60.0)  # (rounded first: 119.996 s is 2m0s, not 1m60s)
    s = f"{secs:.2f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{s}s" if minutes else f"{s}s"
