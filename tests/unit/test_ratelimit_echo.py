"""The lease's τ derived from the staleness a node observes (``LimiterConfig.propagation_max``): a shard
state carries when its owner last changed it (its version stamp, ``ratelimit_shards.ver_at``), so a node
knows how old the peers' states it holds are; τ is their age weighted by what each peer admitted, per
key, within [``propagation``, ``propagation_max``] (issue 24: at N = 200 the relayed states are seconds
old and a 1 s lease over-admits)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_shards import W_VER, entry_from_wire, time_of_ver

NOW = 1_790_000_000.0
GEN = round((NOW - 100.0) * 1e6)  # a node's generation: its start time in microseconds
KEY = ("t", "")


def _admit(lim: RateLimiter, now: float, rpm: int = 1_000_000) -> bool:
    g = lim.acquire(now, [(KEY, Limits(rpm=rpm))], 0)
    if isinstance(g, Grant):
        lim.settle(now, g, None)
        return True
    return False


def test_a_published_state_carries_the_time_of_its_last_change() -> None:
    a = RateLimiter("a", GEN)
    b = RateLimiter("b", GEN + 7)
    for lim in (a, b):
        lim.set_membership(["a", "b"], 2)
    _admit(a, NOW + 1.2345)
    _admit(a, NOW + 2.5)
    d = a.take_delta(1 << 20)
    assert d is not None and len(d) == 1
    assert abs(time_of_ver(d[0][W_VER], GEN) - (NOW + 2.5)) < 0.001
    b.apply_delta(d)
    held = b.shard_time(KEY, "a")
    assert held is not None and abs(held - (NOW + 2.5)) < 0.001
    assert b.shard_time(KEY, "nobody") is None
    # published again within the same millisecond: the stamp still grows (digests and relays need it)
    _admit(a, NOW + 2.5)
    d2 = a.take_delta(1 << 20)
    assert d2 is not None and d2[0][W_VER] == d[0][W_VER] + 1
    # a snapshot is stamped too (a push-pull peer tells the newer state by its version)
    _admit(a, NOW + 4.0)
    snap = [x for x in a.snapshot() if x[2] == "a"]
    assert abs(time_of_ver(snap[0][W_VER], GEN) - (NOW + 4.0)) < 0.001
    parsed = entry_from_wire(snap[0])  # the wire is unchanged: an earlier build decodes it
    assert parsed is not None and parsed[4].ver == snap[0][W_VER]


def _pair(tau_max: float) -> tuple[RateLimiter, RateLimiter]:
    cfg = LimiterConfig(window=60.0, propagation=1.0, propagation_max=tau_max)
    a, b = RateLimiter("a", GEN, cfg), RateLimiter("b", GEN, cfg)
    for lim in (a, b):
        lim.set_membership(["a", "b"], 2)
    return a, b


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _run(
    a: RateLimiter,
    b: RateLimiter,
    delay: float,
    seconds: float = 20.0,
    admit_b: bool = True,
    busy: float = math.inf,
    clock: Clock | None = None,
) -> list[float]:
    """``b`` takes a request every 0.1 s for ``busy`` seconds (or only attempts, ``admit_b`` False: an rpm
    it cannot fit), publishing each; its states reach ``a`` ``delay`` seconds later; ``a`` takes one a
    second. ``clock`` (the limiters' own, if they have one) follows the run. Returns a's τ after each of
    its requests."""
    inbox: deque[tuple[float, list[list[Any]]]] = deque()
    taus: list[float] = []
    for k in range(round(seconds * 10)):
        now = NOW + k * 0.1
        if clock is not None:
            clock.t = now
        if now < NOW + busy:
            _admit(b, now, 1_000_000 if admit_b else 0)
        d = b.take_delta(1 << 20)
        if d is not None:
            inbox.append((now + delay, d))
        while inbox and inbox[0][0] <= now + 1e-9:
            a.apply_delta(inbox.popleft()[1])
        if k % 10 == 9:
            _admit(a, now)
            taus.append(a.propagation)
    return taus


def test_tau_follows_the_age_of_the_held_states() -> None:
    for delay in (0.0, 3.0, 5.0):
        a, b = _pair(tau_max=10.0)
        _run(a, b, delay)
        # the state a holds was made ``delay`` ago (b's next change is due 0.1 s later); slots of 0.25 s
        expect = max(1.0, delay)
        assert expect - 1e-6 <= a.propagation <= expect + 0.25 + 1e-6, (delay, a.propagation)


def test_tau_is_bounded_and_stays_configured_when_off() -> None:
    a, b = _pair(tau_max=2.0)
    _run(a, b, 6.0)
    assert a.propagation == 2.0
    a, b = _pair(tau_max=0.0)  # off
    _run(a, b, 5.0)
    assert a.propagation == 1.0


def test_a_peer_that_admitted_nothing_does_not_age_tau() -> None:
    # b only attempts (its rpm is 0): a state of it that a holds, however old, lacks no admission
    a, b = _pair(tau_max=10.0)
    _run(a, b, 5.0, admit_b=False)
    assert a.propagation == 1.0


def test_a_counter_version_of_an_earlier_build_is_not_an_age() -> None:
    # an earlier build stamps its shard with a mutation counter: read as a time it is decades old
    a, _ = _pair(tau_max=10.0)
    old = ["t", "", "b", GEN, 1, int((NOW + 0.5) // 60), 50, 0, 0, 50, 0, 0, 0, 0, 0, 0, 50, 50, 101]
    a.apply_delta([old])
    _admit(a, NOW + 1.0)
    assert a.propagation == 1.0


def _mesh(tau_max: float, delay: float, nodes: int = 4, rpm: int = 1200) -> float:
    """``nodes`` nodes at 2x the limit in total (evenly, a request every ``nodes / 40`` s each), every
    published state reaching the others ``delay`` seconds later. Returns admitted ÷ limit in the second
    minute (the first one starts cold)."""
    cfg = LimiterConfig(window=60.0, propagation=1.0, propagation_max=tau_max)
    names = [f"n{i}" for i in range(nodes)]
    lims = [RateLimiter(nm, GEN, cfg) for nm in names]
    for lim in lims:
        lim.set_membership(names, nodes)
    start = (NOW // 60 + 1) * 60
    inbox: deque[tuple[float, int, list[list[Any]]]] = deque()
    admitted = 0
    step = 0.025
    for k in range(round(120 / step)):
        now = start + k * step
        while inbox and inbox[0][0] <= now + 1e-9:
            _, src, got = inbox.popleft()
            for j, lim in enumerate(lims):
                if j != src:
                    lim.apply_delta(got)
        i = k % nodes
        if _admit(lims[i], now, rpm) and now >= start + 60:
            admitted += 1
        d = lims[i].take_delta(1 << 20)
        if d is not None:
            inbox.append((now + delay, i, d))
    return admitted / rpm


def test_tau_from_ages_takes_back_the_over_admission_of_stale_views() -> None:
    fixed, derived = _mesh(0.0, 5.0), _mesh(20.0, 5.0)
    # τ = 1 s against 5 s old views: about 1 / (1 - 4/60) of the limit; τ from the ages: the limit
    assert fixed > 1.04, fixed
    assert 0.95 <= derived <= 1.02, derived
    # and views fresher than the configured τ: τ from their delays (down to a slot) holds back less of
    # the limit than the configured τ does, without going over it
    fresh_fixed, fresh_derived = _mesh(0.0, 0.2), _mesh(20.0, 0.2)
    assert 0.97 <= fresh_fixed <= fresh_derived <= 1.0, (fresh_fixed, fresh_derived)
