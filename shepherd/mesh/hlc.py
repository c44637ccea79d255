"""Hybrid logical clock (HLC): the stamps of the mesh state CRDTs.

A stamp is one int: ``(wall_ms << 16) | logical``. Comparing stamps as ints is the HLC order:
physical milliseconds first, then the logical counter. ``now()`` (a local event or a send) returns
``max(last + 1, wall)``; ``receive(remote)`` returns ``max(last + 1, remote + 1, wall)``, so a
stamp is always greater than every stamp its node has issued or seen (causality), stamps of one
node strictly increase even when the wall clock steps back, and the physical part stays within the
mesh's clock skew of real time (a clock 0.5 s behind adopts a peer's time as soon as it hears from
it; a logical counter that overflows 16 bits carries into the milliseconds, which stay monotone).

A remote stamp more than ``max_drift_s`` ahead of the local wall clock is refused
(``ClockDriftError``): adopting it would drag this node's clock, and every stamp it issues
afterwards, into the future. Callers drop the entry that carried it.

The clock is injected (``clock() -> seconds``, wall time: stamps are compared across nodes). The
decoding helpers the CRDTs validate their payloads with are in ``shepherd.proto.state_decode``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "HLC",
    "LOGICAL_BITS",
    "MAX_STAMP",
    "ClockDriftError",
    "make_stamp",
    "stamp_logical",
    "stamp_ms",
    "stamp_seconds",
]

LOGICAL_BITS = 16
_LOGICAL_MASK = (1 << LOGICAL_BITS) - 1
MAX_STAMP = (1 << 63) - 1  # fits a msgpack int64


class ClockDriftError(ValueError):
    """A remote stamp is further ahead of the local wall clock than the HLC tolerates."""


def make_stamp(wall_ms: int, logical: int = 0) -> int:
    return (wall_ms << LOGICAL_BITS) | (logical & _LOGICAL_MASK)


def stamp_ms(stamp: int) -> int:
    return stamp >> LOGICAL_BITS


def stamp_logical(stamp: int) -> int:
    return stamp & _LOGICAL_MASK


def stamp_seconds(stamp: int) -> float:
    return (stamp >> LOGICAL_BITS) / 1000.0


class HLC:
    """A hybrid logical clock over an injected wall clock (seconds)."""

    __slots__ = ("_clock", "_last", "_max_drift_ms", "refused")

    def __init__(self, clock: Callable[[], float], max_drift_s: float = 60.0) -> None:
        self._clock = clock
        self._last = 0
        self._max_drift_ms = int(max_drift_s * 1000)
        self.refused = 0  # remote stamps refused for drift

    def wall(self) -> int:
        """The wall clock as a stamp with logical 0."""
        return make_stamp(int(self._clock() * 1000))

    @property
    def last(self) -> int:
        """The last stamp issued or seen (0 before any)."""
        return self._last

    def now(self) -> int:
        """A new stamp for a local event or a send: greater than every stamp issued or seen."""
        s = self._last + 1
        w = self.wall()
        if w > s:
            s = w
        self._last = s
        return s

    def check(self, remote: int) -> None:
        """Raise ``ClockDriftError`` if ``remote`` is too far ahead of the wall clock (no update)."""
        if stamp_ms(remote) - int(self._clock() * 1000) > self._max_drift_ms:
            self.refused += 1
            raise ClockDriftError(
                f"remote stamp {stamp_seconds(remote):.3f} s is ahead beyond the drift bound"
            )

    def receive(self, remote: int) -> int:
        """Merge a remote stamp (a receive event); returns the new local stamp, greater than both."""
        self.check(remote)
        s = self._last + 1
        if remote >= s:
            s = remote + 1
        w = self.wall()
        if w > s:
            s = w
        self._last = s
        return s

    def horizon(self) -> int:
        """The greatest remote stamp ``check`` accepts now (for checking a batch without a call each)."""
        return make_stamp(int(self._clock() * 1000) + self._max_drift_ms, (1 << LOGICAL_BITS) - 1)

    def observe(self, remote: int) -> bool:
        """Like ``receive`` without issuing a stamp for the caller: False if refused for drift."""
        try:
            self.check(remote)
        except ClockDriftError:
            return False
        if remote > self._last:
            self._last = remote
        return True
