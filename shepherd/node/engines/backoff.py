"""Exponential back-off with jitter, shared by the engine connection and the KV-event feeds."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Exponential back-off between failed connection attempts (pure: the caller passes ``now``)."""

    def __init__(
        self,
        initial: float = 0.1,
        maximum: float = 5.0,
        multiplier: float = 2.0,
        jitter: float = 0.2,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
        self._rand = rand
        self._delay = initial
        self.until = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.until

    def failed(self, now: float) -> float:
        """Record a failed attempt; returns when the next attempt may start."""
        d = self._delay * (1.0 + self.jitter * (2.0 * self._rand() - 1.0))
        self._delay = min(self.maximum, self._delay * self.multiplier)
        self.until = now + d
        return self.until

    def succeeded(self) -> None:
        self._delay = self.initial
        self.until = 0.0
