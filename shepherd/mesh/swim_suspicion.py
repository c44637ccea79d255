"""Lifeguard suspicion timer and local health awareness (pure; times are passed in).

``Suspicion``: starts at ``max`` (or ``min`` when no confirmations are expected, k < 1) and shrinks
on each independent confirmation toward ``min`` (memberlist's suspicion.go, with a deadline instead
of a running timer). ``Awareness``: the local health multiplier (LHM).
"""

from __future__ import annotations

from shepherd.mesh.swim_types import remaining_suspicion_time


class Suspicion:
    """Suspicion of one member at one incarnation, started by ``src`` at ``start``."""

    __slots__ = (
        "_confirmed",
        "deadline",
        "deferred",
        "incarnation",
        "k",
        "max_s",
        "min_s",
        "n",
        "start",
        "verifies_left",
    )

    def __init__(self, incarnation: int, src: str, k: int, min_s: float, max_s: float, start: float) -> None:
        self.incarnation = incarnation
        self.k = k
        self.min_s = min_s
        self.max_s = max_s
        self.start = start
        self.n = 0
        self.deferred = False
        self.verifies_left = 0
        # the accuser never confirms its own suspicion (our message may be gossiped back to us)
        self._confirmed = {src}
        self.deadline = start + (min_s if k < 1 else max_s)

    def verify_at(self, spacing: float) -> float:
        """When to send the next last-chance ping (``verifies_left`` of them, ``spacing`` apart, the
        last one ``spacing`` before the deadline): inf when none is left."""
        if self.verifies_left <= 0:
            return float("inf")
        return max(self.start, self.deadline - self.verifies_left * spacing)

    def confirm(self, src: str, now: float) -> bool:
        """An independent confirmation; True if it was new (then the suspicion is re-gossiped)."""
        if self.n >= self.k or src in self._confirmed:
            return False
        self._confirmed.add(src)
        self.n += 1
        self.deadline = now + remaining_suspicion_time(
            self.n, self.k, now - self.start, self.min_s, self.max_s
        )
        return True


class Awareness:
    """Lifeguard local health multiplier: timeouts scale by ``score + 1``, score in 0..max_score."""

    __slots__ = ("max_score", "score")

    def __init__(self, max_score: int) -> None:
        self.max_score = max_score
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.max_score, max(0, self.score + delta))

    def scale(self, timeout: float) -> float:
        return timeout * (self.score + 1)
