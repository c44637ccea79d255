from __future__ import annotations

from shepherd.node.dispatch.circuit_breaker import BreakerState, CircuitBreaker, HealthTracker


def state(cb: CircuitBreaker) -> BreakerState:
    return cb.state  # a call, so the type checker does not pin the state between steps


def test_opens_after_threshold_and_half_opens_after_cooldown() -> None:
    cb = CircuitBreaker(failure_threshold=3, success_threshold=2, open_secs=10)
    for _ in range(2):
        cb.record_failure(0)
    assert state(cb) is BreakerState.CLOSED and cb.allows(0)
    cb.record_failure(1)
    assert state(cb) is BreakerState.OPEN and not cb.allows(5)
    assert cb.allows(11) and cb.acquire(11)
    assert state(cb) is BreakerState.HALF_OPEN
    assert not cb.acquire(11)  # one trial at a time
    cb.record_success()
    assert state(cb) is BreakerState.HALF_OPEN and cb.acquire(12)
    cb.record_success()
    assert state(cb) is BreakerState.CLOSED


def test_half_open_failure_reopens() -> None:
    cb = CircuitBreaker(failure_threshold=1, open_secs=5)
    cb.record_failure(0)
    assert cb.acquire(6)
    cb.record_failure(6)
    assert state(cb) is BreakerState.OPEN and not cb.allows(7) and cb.allows(11)


def test_success_resets_failure_count() -> None:
    cb = CircuitBreaker(failure_threshold=2)
    cb.record_failure(0)
    cb.record_success()
    cb.record_failure(0)
    assert state(cb) is BreakerState.CLOSED


def test_health_hysteresis() -> None:
    h = HealthTracker(failure_threshold=2, success_threshold=2)
    seq = [
        (True, True, True),
        (False, False, True),
        (False, True, False),
        (True, False, False),
        (True, True, True),
    ]
    assert not h.healthy
    for ok, changed, healthy in seq:  # the first check decides at once, then hysteresis
        assert h.observe(ok) == changed
        assert h.healthy == healthy
