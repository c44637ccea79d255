"""Hybrid logical clock: monotone, causal, tolerant of skewed and stepping clocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.hlc import HLC, ClockDriftError, make_stamp, stamp_logical, stamp_ms, stamp_seconds
from shepherd.proto.state_decode import StateDecodeError, expect_float, expect_int, expect_list, expect_str


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_stamp_layout() -> None:
    s = make_stamp(1234, 5)
    assert stamp_ms(s) == 1234 and stamp_logical(s) == 5 and stamp_seconds(s) == 1.234
    assert make_stamp(1, 0) > make_stamp(0, 65535)


def test_now_is_strictly_monotone_when_the_wall_clock_stands_or_steps_back() -> None:
    c = Clock()
    h = HLC(c)
    a = h.now()
    b = h.now()  # same wall time: logical tick
    c.t -= 5.0  # wall clock stepped back
    d = h.now()
    assert a < b < d
    assert stamp_ms(d) == stamp_ms(a)  # the physical part does not follow the step back
    c.t += 10.0
    assert stamp_ms(h.now()) == int(c.t * 1000)  # and catches up with the wall clock


def test_receive_is_after_both_clocks() -> None:
    c = Clock()
    h = HLC(c)
    local = h.now()
    remote = make_stamp(int((c.t + 0.4) * 1000), 7)  # a peer 0.4 s ahead
    r = h.receive(remote)
    assert r > remote and r > local
    assert h.now() > r


def test_a_stamp_beyond_the_drift_bound_is_refused_and_ignored() -> None:
    c = Clock()
    h = HLC(c, max_drift_s=1.0)
    before = h.now()
    far = make_stamp(int((c.t + 5.0) * 1000))
    with pytest.raises(ClockDriftError):
        h.receive(far)
    assert not h.observe(far)
    assert h.refused == 2
    assert stamp_ms(h.now()) - stamp_ms(before) < 1000


@settings(max_examples=100, deadline=None)
@given(
    skews=st.lists(st.floats(-0.5, 0.5), min_size=3, max_size=3),
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.floats(0.0, 0.05), st.booleans()),
        max_size=60,
    ),
)
def test_skewed_nodes_keep_causality_and_stay_near_real_time(
    skews: list[float], ops: list[tuple[int, int, float, bool]]
) -> None:
    real = [1_000_000.0]

    def clock(i: int) -> Callable[[], float]:
        return lambda: real[0] + skews[i]

    hlcs = [HLC(clock(i)) for i in range(3)]
    last = [0, 0, 0]
    for src, dst, dt, back in ops:
        real[0] += dt
        if back:
            skews[src] -= 0.01  # the sender's clock is slewed back a little
        s = hlcs[src].now()
        assert s > last[src]
        last[src] = s
        r = hlcs[dst].receive(s)
        assert r > s and r > last[dst]
        last[dst] = r
        # the physical part never runs ahead of the fastest clock (plus the slew applied)
        assert stamp_seconds(r) <= real[0] + 0.5 + 0.001
    for h in hlcs:
        assert h.refused == 0


def test_decode_helpers_reject_wrong_types() -> None:
    with pytest.raises(StateDecodeError):
        expect_int(True)
    with pytest.raises(StateDecodeError):
        expect_int(1.0)
    with pytest.raises(StateDecodeError):
        expect_float(float("nan"))
    with pytest.raises(StateDecodeError):
        expect_str("")
    with pytest.raises(StateDecodeError):
        expect_list((1, 2))
    assert expect_float(3) == 3.0
