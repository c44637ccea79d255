"""Per-worker circuit breaker and health hysteresis: pure state machines over an injected clock value."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; after ``open_secs`` lets one trial through
    (half-open); ``success_threshold`` successes in half-open close it, any failure re-opens it."""

    failure_threshold: int = 5
    success_threshold: int = 2
    open_secs: float = 10.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Does not reserve the half-open trial; see ``acquire``.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self.opened_at >= self.open_secs
        return not self.trial_in_flight

    def acquire(self, now: float) -> bool:
        """Reserve a send: moves OPEN -> HALF_OPEN once the cool-down is over."""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_secs:
            self.state = BreakerState.HALF_OPEN
            self.successes = 0
            self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            if self.trial_in_flight:
                return False
            self.trial_in_flight = True
            return True
        return self.state is BreakerState.CLOSED

    def record_success(self) -> None:
        self.failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = False
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state = BreakerState.CLOSED
                self.successes = 0

    def release(self) -> None:
        """The reserved send ended without telling anything about the worker (the client went away,
        the request was refused as invalid): a half-open trial may be tried again."""
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = False

    def record_failure(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        self.failures += 1
        if self.state is BreakerState.CLOSED and self.failures >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.failures = 0
        self.successes = 0
        self.trial_in_flight = False


@dataclass(slots=True)
class HealthTracker:
    """Healthy/unhealthy with hysteresis: ``failure_threshold`` failed checks in a row mark a worker down,
    ``success_threshold`` good ones mark it up again. Starts unknown (not healthy) until the first check."""

    failure_threshold: int = 3
    success_threshold: int = 2
    healthy: bool = False
    checked: bool = False
    fails: int = 0
    oks: int = 0

    def observe(self, ok: bool) -> bool:
        """Feed one check result; returns True when the healthy flag changed."""
        before = self.healthy
        if not self.checked:
            self.checked = True
            self.healthy = ok
            return before != ok
        if ok:
            self.fails = 0
            self.oks += 1
            if not self.healthy and self.oks >= self.success_threshold:
                self.healthy = True
        else:
            self.oks = 0
            self.fails += 1
            if self.healthy and self.fails >= self.failure_threshold:
                self.healthy = False
        return before != self.healthy
