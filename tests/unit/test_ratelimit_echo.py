"""The lease's τ derived from the staleness a node observes (``LimiterConfig.propagation_max``): on a
relaying mesh a node's own shard comes back to it, and how old the echoed state is (since the first
change it lacks) is how stale peers' copies are. τ follows a quantile of those ages within
[``propagation``, ``propagation_max``]; without echoes (no relay) it stays ``propagation``."""

from __future__ import annotations

from collections import deque
from typing import Any

from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter

NOW = 1_790_000_000.0
KEY = ("t", "")


def _pair(relay: bool, tau_max: float) -> tuple[RateLimiter, RateLimiter]:
    cfg = LimiterConfig(window=60.0, propagation=1.0, propagation_max=tau_max, relay=relay)
    a, b = RateLimiter("a", 1, cfg), RateLimiter("b", 1, cfg)
    for lim in (a, b):
        lim.set_membership(["a", "b"], 2)
    return a, b


def _run(a: RateLimiter, b: RateLimiter, delay: float, rpm: int, seconds: float = 30.0) -> int:
    """``a`` takes a request every 0.1 s; its shard reaches ``b`` at once, and ``b``'s relay of it comes
    back to ``a`` ``delay`` seconds later. Returns how many ``a`` admitted."""
    rules = [(KEY, Limits(rpm=rpm))]
    back: deque[tuple[float, list[list[Any]]]] = deque()
    admitted = 0
    for k in range(round(seconds * 10)):
        now = NOW + k * 0.1
        while back and back[0][0] <= now - delay + 1e-9:
            a.apply_delta(back.popleft()[1])
        g = a.acquire(now, rules, 0)
        if isinstance(g, Grant):
            admitted += 1
            a.settle(now, g, None)
        d = a.take_delta(1 << 20)
        if d is not None:
            b.apply_delta(d)
        for _, item in b.take_keyed_deltas():
            back.append((now, item))
    return admitted


def test_tau_follows_the_age_of_the_echoes() -> None:
    for delay in (0.0, 3.0, 5.0):
        a, b = _pair(relay=True, tau_max=10.0)
        _run(a, b, delay, rpm=1_000_000)
        # echoes of a state made at t come back at t + delay, lacking the change made 0.1 s after it
        expect = max(1.0, delay - 0.1)
        assert expect - 1e-6 <= a.propagation <= expect + 0.25 + 1e-6, (delay, a.propagation)


def test_tau_is_bounded_and_stays_configured_without_echoes() -> None:
    a, b = _pair(relay=True, tau_max=2.0)
    _run(a, b, 6.0, rpm=1_000_000)
    assert a.propagation == 2.0
    a, b = _pair(relay=False, tau_max=10.0)  # a node that does not relay: nothing comes back
    _run(a, b, 0.0, rpm=1_000_000)
    assert a.propagation == 1.0
    a, b = _pair(relay=True, tau_max=0.0)  # off
    _run(a, b, 5.0, rpm=1_000_000)
    assert a.propagation == 1.0


def test_a_longer_tau_holds_back_more_of_what_the_peers_have_not_seen() -> None:
    # a is the only node with demand; b's unseen share is empty: the lease bounds what a admitted in the
    # last τ by its share of the headroom, so with τ derived from 5 s echoes a admits less than with τ = 1 s
    got = {}
    for tau_max in (0.0, 10.0):
        a, b = _pair(relay=True, tau_max=tau_max)
        got[tau_max] = _run(a, b, 5.0, rpm=300, seconds=60.0)
    assert got[10.0] < got[0.0], got
