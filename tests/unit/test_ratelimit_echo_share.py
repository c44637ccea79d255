"""On a relaying mesh a node's demand share uses its own attempts as the peers relayed them back (the
echo: what the others see, as stale as its view of theirs), not its fresh ones: with every node trusting
its own fresh demand against the others' stale one, the shares sum far above 1 and the lease does not
bind (issue 24)."""

from __future__ import annotations

from typing import Any

from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter

NOW = 1_790_000_000.0
RULES = [(("t", ""), Limits(rpm=600))]


def _burst(apply_echo: bool, tau_max: float = 0.0) -> int:
    """``b`` made 100 attempts that ``a`` knows of; ``a`` made one, which ``b`` relays back (the echo),
    then ``a`` tries 400 requests at once. Returns how many ``a`` admitted."""
    cfg = LimiterConfig(window=60.0, propagation=1.0, relay=True, propagation_max=tau_max)
    a, b = RateLimiter("a", 1, cfg), RateLimiter("b", 1, cfg)
    for lim in (a, b):
        lim.set_membership(["a", "b"], 2)
    for k in range(100):
        g = b.acquire(NOW + k * 0.01, RULES, 0)
        if isinstance(g, Grant):
            b.settle(NOW + k * 0.01, g, None)
    a.apply_delta(b.take_delta(1 << 20))
    b.take_keyed_deltas()  # b's own shard: nothing for a to relay back yet
    t = NOW + 5.0
    g = a.acquire(t, RULES, 0)
    assert isinstance(g, Grant)
    a.settle(t, g, None)
    b.apply_delta(a.take_delta(1 << 20))
    echo: list[list[Any]] = [item for _, d in b.take_keyed_deltas() for item in d]
    assert echo and all(item[2] == "a" for item in echo)
    admitted = 0
    for _ in range(400):
        if apply_echo:
            a.apply_delta(echo)  # the peers keep relaying the old state back: they have not seen more
        g = a.acquire(t + 0.5, RULES, 0)
        if isinstance(g, Grant):
            admitted += 1
            a.settle(t + 0.5, g, None)
        a.take_delta(1 << 20)  # a's fresh attempts are published, but nobody has them yet
    return admitted


def test_share_uses_the_echoed_demand() -> None:
    # τ fixed (``propagation_max`` 0): the echo tells what the others see of this node's demand
    fresh, echoed = _burst(apply_echo=False), _burst(apply_echo=True)
    # own demand 1 of 101 seen by the others: share 0.1 + 0.8/101 of the headroom, not ~0.1 + 0.8 * 0.8
    assert 0 < echoed < fresh / 3, (echoed, fresh)


def test_share_uses_own_demand_as_old_as_the_held_states() -> None:
    # τ from the ages (``propagation_max``): the others' states a holds are 4 s old, so a takes its own
    # demand as published then (1 attempt), whether or not an echo comes back, however many it publishes now
    fresh = _burst(apply_echo=False)
    for echo in (False, True):
        got = _burst(apply_echo=echo, tau_max=15.0)
        assert 0 < got < fresh / 3, (got, fresh)
