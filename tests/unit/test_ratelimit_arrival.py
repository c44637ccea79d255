"""τ from the held states' ages (``LimiterConfig.propagation_max``) tells an idle peer from a slow channel:
a node notes, per peer shard, the delay of the newest state at its arrival (arrival minus the state's
stamp); where shards come first-hand (no ``relay``) every change is sent at once, so a held state lacks
only what its owner changed within about one delay of now: its age counts up to that delay, and a peer
that changed nothing since (its load moved away) does not raise τ, while a slow channel shows in the
delays themselves (issue 24: the moved-load case gave 0.77 of the limit with ages alone)."""

from __future__ import annotations

from shepherd.mesh.ratelimit import LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_sim import Load, NetModel, Rule, Scenario, even, simulate, summarize
from tests.unit.test_ratelimit_echo import GEN, NOW, Clock, _admit, _run


def _pair(clock: Clock | None = None, relay: bool = False) -> tuple[RateLimiter, RateLimiter]:
    cfg = LimiterConfig(window=60.0, propagation=1.0, propagation_max=15.0, relay=relay)
    a, b = RateLimiter("a", GEN, cfg, clock), RateLimiter("b", GEN, cfg, clock)
    for lim in (a, b):
        lim.set_membership(["a", "b"], 2)
    return a, b


# Without a clock a node notes a newer state when it next looks (at its next request, here once a second):
# the delay it measures includes up to that second.
SLACK = {True: 0.25, False: 2.0}


def test_an_idle_peer_does_not_raise_tau() -> None:
    # b's load moves away after 10 s: its admissions stay in the window, the state a holds of it ages, but
    # it lacks nothing: τ stays at most a flush or two above ``propagation`` (with the ages alone: 15 s)
    for clock in (Clock(NOW), None):
        a, b = _pair(clock)
        taus = _run(a, b, 0.0, busy=10.0, seconds=40.0, clock=clock)
        if clock is not None:
            assert max(taus) == 1.0, taus
        assert max(taus) <= 1.0 + SLACK[clock is not None], taus


def test_on_a_relaying_mesh_the_ages_count_in_full() -> None:
    # relays' queues can hold a busy peer's states back for seconds while others arrive: silence there is
    # not idleness, and an idle peer's state ages τ up (towards ``propagation_max``)
    a, b = _pair(relay=True)
    taus = _run(a, b, 0.0, busy=10.0, seconds=40.0, clock=None)
    assert max(taus[:10]) == 1.0 and taus[-1] == 15.0, taus


def test_a_slow_channel_raises_tau_and_an_idle_peer_behind_it_keeps_it() -> None:
    for clock in (Clock(NOW), None):
        a, b = _pair(clock)
        taus = _run(a, b, 4.0, busy=20.0, seconds=40.0, clock=clock)
        # busy behind a 4 s channel: τ is the age of the held state (4 s, to a slot of 0.25 s)
        assert all(4.0 - 1e-6 <= t <= 4.25 + 1e-6 for t in taus[8:20]), taus
        # idle after 20 s: τ stays about where the channel put it (with the ages alone it reached 15 s)
        assert all(4.0 - 1e-6 <= t <= 4.25 + SLACK[clock is not None] + 1e-6 for t in taus[20:]), taus


def test_first_hand_shards_bring_tau_down_to_one_slot() -> None:
    # a node's mesh (``first_hand``): every member gets each shard from its owner, a flush (~0.05 s) old;
    # with the node's clock the stamps are the publication times, the delays 0, and τ is one slot
    # (``propagation / slots``), below ``propagation``: the configured τ held back about τ / window of
    # the limit and more (issue 24: 0.90 of it in steady state with a 15 s window)
    clock = Clock(NOW)
    cfg = LimiterConfig(window=60.0, propagation=1.0, propagation_max=15.0)
    names = [f"n{i}" for i in range(5)]
    lims = [RateLimiter(nm, GEN + i, cfg, clock) for i, nm in enumerate(names)]
    for lim in lims:
        lim.set_membership(names, len(names))
    for k in range(600):  # 60 s: every node takes a request every 0.1 s and flushes its own shard to all
        clock.t = NOW + k * 0.1
        for i, lim in enumerate(lims):
            _admit(lim, clock.t + i * 0.01)
        clock.t += 0.05
        for i, lim in enumerate(lims):
            d = lim.take_delta(1 << 20)
            assert d is not None
            for j, other in enumerate(lims):
                if j != i:
                    other.apply_delta_from(d, names[i])
    slot = cfg.propagation / cfg.slots
    assert all(lim.propagation == slot for lim in lims), [lim.propagation for lim in lims]
    # without a clock a node does not know when it published: τ stays at ``propagation``
    lims = [RateLimiter(nm, GEN + i, cfg) for i, nm in enumerate(names)]
    for lim in lims:
        lim.set_membership(names, len(names))
    for k in range(100):
        for i, lim in enumerate(lims):
            _admit(lim, NOW + k * 0.1 + i * 0.01)
        for i, lim in enumerate(lims):
            d = lim.take_delta(1 << 20)
            assert d is not None
            for j, other in enumerate(lims):
                if j != i:
                    other.apply_delta_from(d, names[i])
    assert all(lim.propagation == 1.0 for lim in lims), [lim.propagation for lim in lims]


def test_load_moving_between_nodes_keeps_the_limit_with_tau_from_ages() -> None:
    rpm, rate = 600, 20.0
    cfg = LimiterConfig(propagation_max=15.0)
    loads = (Load("a", (rate, 0, 0), end=150), Load("a", (0, 0, rate), start=150))
    r = simulate(Scenario(3, 300, (Rule("a", Limits(rpm=rpm)),), loads, limiter=cfg))
    mean, hi, lo = summarize(r.ratios("a", "requests", rpm))
    assert lo >= 0.95 and hi <= 1.10, (mean, hi, lo)  # ages alone: 0.77 in the window of the move


def test_tau_from_ages_holds_a_slow_channel_to_the_limit() -> None:
    rpm, rate = 600, 20.0
    slow = NetModel(delay=5.0)
    rules = (Rule("a", Limits(rpm=rpm)),)
    load = (Load("a", even(rate, 3)),)
    fixed = simulate(Scenario(3, 300, rules, load, net=slow, limiter=LimiterConfig(propagation_max=0.0)))
    aged = simulate(Scenario(3, 300, rules, load, net=slow, limiter=LimiterConfig(propagation_max=15.0)))
    f_mean, f_hi, _ = summarize(fixed.ratios("a", "requests", rpm))
    a_mean, a_hi, a_lo = summarize(aged.ratios("a", "requests", rpm))
    assert a_hi < f_hi and a_hi <= 1.01 and a_lo >= 0.95, (f_mean, f_hi, a_mean, a_hi, a_lo)
