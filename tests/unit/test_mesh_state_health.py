"""Replicated health: per-observer LWW, the combined view, dead observers, expiry, bounds, wire."""

from __future__ import annotations

import random
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.hlc import HLC, make_stamp
from shepherd.mesh.state_health import (
    HealthConfig,
    Observation,
    ReplicatedHealth,
    observation_from_wire,
    observation_to_wire,
)
from shepherd.proto.state_decode import StateDecodeError

T0 = 1_000_000.0
T0_MS = int(T0 * 1000)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def health(node: str, clock: Clock, cfg: HealthConfig | None = None) -> ReplicatedHealth:
    return ReplicatedHealth(node, HLC(clock), cfg)


def state(h: ReplicatedHealth) -> list[Any]:
    return sorted(h.to_wire())


observations = st.builds(
    Observation,
    st.sampled_from(["w0", "w1", "w2"]),
    st.sampled_from(["n1", "n2", "n3"]),
    st.integers(0, 4).map(lambda k: make_stamp(T0_MS - 1000 + k)),
    st.booleans(),
)
obs_lists = st.lists(observations, max_size=12)


@settings(max_examples=100, deadline=None)
@given(a=obs_lists, b=obs_lists, c=obs_lists, seed=st.integers(0, 1 << 30))
def test_merge_is_commutative_associative_idempotent(
    a: list[Observation], b: list[Observation], c: list[Observation], seed: int
) -> None:
    clock = Clock()
    x, y, z, w = (health(f"r{i}", clock) for i in range(4))
    for part in (a, b, c):
        x.merge(part)
    for part in (c, a, b, c):
        y.merge(part)
    bc = health("r9", clock)
    bc.merge(b)
    bc.merge(c)
    z.merge(a)
    z.merge(bc.observations())
    allv = a + b + c + b
    random.Random(seed).shuffle(allv)
    for o in allv:
        w.merge([o])
    assert state(x) == state(y) == state(z) == state(w)
    x.merge(x.observations())
    assert state(x) == state(y)
    for wid in ("w0", "w1", "w2"):
        assert x.view(wid) == y.view(wid)


def test_combined_view_majority_then_local_then_healthy() -> None:
    clock = Clock()
    me = health("me", clock)
    others = [health(f"n{i}", clock) for i in range(3)]
    assert me.view("w").routable and me.view("w").healthy == 0  # nothing known: routable
    me.merge([o for h in others[:2] if (o := h.observe("w", False)) is not None])
    v = me.view("w")
    assert (v.healthy, v.unhealthy, v.local, v.routable) == (0, 2, None, False)
    me.observe("w", True)
    me.merge([o for h in others[2:] if (o := h.observe("w", True)) is not None])
    v = me.view("w")
    assert (v.healthy, v.unhealthy, v.local, v.routable) == (2, 2, True, True)  # a tie: ours decides
    me.observe("w", False)
    clock.t += 0.001
    assert not me.routable("w")


def test_observations_are_republished_and_stale_ones_expire() -> None:
    cfg = HealthConfig(fresh_s=6.0, refresh_s=2.0)
    clock = Clock()
    a, b = health("a", clock, cfg), health("b", clock, cfg)
    assert a.observe("w", True) is not None
    assert a.observe("w", True) is None  # unchanged and fresh: not published again
    b.merge(a.take_delta())
    for _ in range(5):
        clock.t += 2.5
        a.observe("w", True)  # the checker runs again: published once refresh_s has passed
        a.tick()
        b.merge(a.take_delta())
        b.tick()
        assert b.view("w").healthy == 1
    clock.t += 7.0  # a went silent
    assert b.view("w").healthy == 0 and b.routable("w")
    assert b.tick() == {"w"} and len(b) == 0


def test_a_dead_observer_is_dropped_and_its_late_observations_refused_until_it_is_back() -> None:
    clock = Clock()
    a, b = health("a", clock), health("b", clock)
    early = a.observe("w", False)
    assert early is not None
    b.merge([early])
    clock.t += 2.0
    assert b.on_member_dead("a") == {"w"}
    assert b.view("w").unhealthy == 0
    assert b.merge([early]) == set() and b.dropped == 1
    b.on_member_alive("a")
    clock.t += 1.5
    later = a.observe("w", True)
    assert later is not None and b.merge([later]) == {"w"} and b.view("w").healthy == 1


def test_size_stays_bounded_under_churn() -> None:
    cfg = HealthConfig(fresh_s=5.0, refresh_s=1.0)
    clock = Clock()
    nodes = [health(f"n{i}", clock, cfg) for i in range(4)]
    rng = random.Random(3)
    peak = 0
    for step in range(20_000):
        clock.t += 0.01
        n = nodes[rng.randrange(4)]
        n.observe(
            f"w{rng.randrange(step // 100, step // 100 + 20)}", rng.random() < 0.8
        )  # workers come and go
        if step % 50 == 49:
            for src in nodes:
                d = src.take_delta()
                for dst in nodes:
                    if dst is not src:
                        dst.merge([o for o in d if rng.random() > 0.1])
            for x in nodes:
                x.tick()
                peak = max(peak, len(x))
    # fresh window 5 s = 500 steps: at most ~25 workers seen per window x 4 observers
    assert peak <= 4 * 30


@settings(max_examples=100, deadline=None)
@given(observations)
def test_wire_round_trip(o: Observation) -> None:
    assert observation_from_wire(msgpack.unpackb(msgpack.packb(observation_to_wire(o)))) == o


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
        lambda inner: st.lists(inner, max_size=5),
        max_leaves=12,
    )
)
def test_malformed_observations_are_refused_or_round_trip(v: Any) -> None:
    try:
        o = observation_from_wire(v)
    except StateDecodeError:
        return
    # accepted: a well-formed observation, the one its own encoding gives back
    assert observation_from_wire(msgpack.unpackb(msgpack.packb(observation_to_wire(o)))) == o


OBS_SAMPLE = Observation("w1", "node-a", 12345, True)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_an_observation_with_one_field_changed_is_refused_or_round_trips(data: st.DataObject) -> None:
    good = observation_to_wire(OBS_SAMPLE)
    assert observation_from_wire(good) == OBS_SAMPLE
    i = data.draw(st.integers(0, len(good) - 1))
    junk = data.draw(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4))
    bad = [*good[:i], junk, *good[i + 1 :]]
    try:
        o = observation_from_wire(bad)
    except StateDecodeError:
        return
    assert observation_from_wire(msgpack.unpackb(msgpack.packb(observation_to_wire(o)))) == o
    assert o != OBS_SAMPLE or junk == good[i]  # a changed field never yields the original observation


def test_observations_of_the_wrong_shape_are_refused() -> None:
    good = observation_to_wire(OBS_SAMPLE)
    bads: tuple[Any, ...] = (None, 1, "x", b"x", {}, [], good[:-1], good[:1], [*good[:1], None, *good[2:]])
    for bad in bads:
        with pytest.raises(StateDecodeError):
            observation_from_wire(bad)
