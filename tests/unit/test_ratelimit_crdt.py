"""Rate-limit shards: the merge laws (hypothesis), the wire form, and the window maths."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.ratelimit import Denial, Grant, Limits, RateLimiter
from shepherd.mesh.ratelimit_shards import (
    NFIELDS,
    Entry,
    entry_from_wire,
    entry_to_wire,
    fmt_duration,
    join,
    sliding,
    wait_until_fits,
    window_of,
    wire_size,
)

counts = st.lists(st.integers(0, 50), min_size=NFIELDS, max_size=NFIELDS)
entries = st.builds(
    Entry,
    born=st.integers(1, 2),
    win=st.integers(10, 13),
    cur=counts,
    prev=counts,
    inc=st.integers(0, 20),
    dec=st.integers(0, 20),
    ver=st.integers(0, 100),
)
SETTINGS = settings(max_examples=120, deadline=None)


@SETTINGS
@given(entries, entries)
def test_join_commutes(a: Entry, b: Entry) -> None:
    assert join(a, b) == join(b, a)


@SETTINGS
@given(entries, entries, entries)
def test_join_associates(a: Entry, b: Entry, c: Entry) -> None:
    assert join(join(a, b), c) == join(a, join(b, c))


@SETTINGS
@given(entries, entries)
def test_join_is_idempotent_and_absorbing(a: Entry, b: Entry) -> None:
    assert join(a, a) == a
    ab = join(a, b)
    assert join(ab, a) == ab and join(ab, b) == ab


@SETTINGS
@given(entries, st.integers(10, 15))
def test_roll_is_join_with_an_empty_entry(a: Entry, w: int) -> None:
    w = max(w, a.win)
    rolled = a.copy()
    rolled.roll(w)
    assert rolled == join(a, Entry(a.born, w, ver=0))


def test_join_keeps_adjacent_windows_and_drops_older() -> None:
    old = Entry(1, 10, [5, 0, 0, 5, 0], [9, 0, 0, 9, 0])
    new = Entry(1, 11, [1, 0, 0, 1, 0], [3, 0, 0, 3, 0])
    j = join(old, new)
    assert (j.win, j.cur[0], j.prev[0]) == (11, 1, 5)  # old's current joins new's previous
    far = Entry(1, 13, [2, 0, 0, 2, 0])
    assert join(j, far).prev[0] == 0  # window 11 is two windows back: dropped
    reborn = Entry(2, 5)
    assert join(far, reborn) == reborn  # a re-created entry (higher born) wins whole


@SETTINGS
@given(entries, st.text(max_size=8), st.text(max_size=8), st.text(min_size=1, max_size=8))
def test_wire_round_trip(e: Entry, tenant: str, model: str, node: str) -> None:
    item = entry_to_wire(tenant, model, node, 7, e)
    assert entry_from_wire(item) == (tenant, model, node, 7, e)
    msgpack = pytest.importorskip("msgpack")
    assert len(msgpack.packb(item, use_bin_type=True)) <= wire_size(item)


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "x",
        [],
        ["t", "m", "n", 1] + [0] * 14,  # short
        ["t", "m", "n", 1] + [0] * 14 + ["x"],
        ["t", "m", "n", 1] + [0] * 6 + [-1] + [0] * 8,  # negative count
        ["t", 3, "n", 1] + [0] * 15,
        ["t", "m", "n", True] + [0] * 15,
    ],
)
def test_malformed_wire_entries_are_refused(bad: object) -> None:
    assert entry_from_wire(bad) is None
    lim = RateLimiter("a", 1)
    lim.apply_delta([entry_to_wire("t", "m", "b", 1, Entry(1, 0, [1, 1, 0, 1, 1]))])
    before = lim.snapshot()
    with pytest.raises(ValueError):
        lim.apply_delta([entry_to_wire("t", "m", "b", 1, Entry(1, 0, [2, 2, 0, 2, 2])), bad])
    assert lim.snapshot() == before  # validated first: nothing merged


def _replica_states(seed: int) -> list[RateLimiter]:
    """Three nodes admitting at random times, with a few gossip exchanges."""
    rng = random.Random(seed)
    nodes = [RateLimiter(f"n{i}", 1) for i in range(3)]
    for n in nodes:
        n.set_membership(["n0", "n1", "n2"], 3)
    rules = [(("t", ""), Limits(rpm=1000, tpm=10**9, max_concurrent=1000))]
    grants: list[tuple[int, Grant | Denial]] = []
    now = 0.0
    for _ in range(60):
        now += rng.uniform(0.0, 20.0)
        i = rng.randrange(3)
        g = nodes[i].acquire(now, rules, rng.randint(1, 100))
        grants.append((i, g))
        if rng.random() < 0.3:
            j, old = grants[rng.randrange(len(grants))]
            if isinstance(old, Grant):
                nodes[j].settle(now, old, rng.randint(0, 50))
        if rng.random() < 0.2:
            src, dst = rng.sample(range(3), 2)
            d = nodes[src].take_delta()
            if d:
                nodes[dst].apply_delta(d)
    return nodes


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.permutations([0, 1, 2]))
def test_snapshot_merges_converge_in_any_order(seed: int, order: list[int]) -> None:
    nodes = _replica_states(seed)
    snaps = [n.snapshot() for n in nodes]
    a, b = RateLimiter("x", 1), RateLimiter("y", 1)
    for i in order:
        a.merge_snapshot(snaps[i])
    for i in reversed(order):
        b.merge_snapshot(snaps[i])
        b.merge_snapshot(snaps[i])  # idempotent
    assert a.entries() == b.entries()
    # every node that merges everyone's snapshot holds the same state too (its own shard included)
    for n in nodes:
        for s in snaps:
            n.merge_snapshot(s)
    assert nodes[0].entries() == nodes[1].entries() == nodes[2].entries() == a.entries()


def test_window_of_and_sliding() -> None:
    w, f = window_of(125.0, 60.0)
    assert w == 2 and f == pytest.approx(5 / 60)
    assert sliding(60, 10, 0.25) == 55.0
    assert sliding(60, 10, 0.0) == 70.0


@SETTINGS
@given(
    st.floats(0, 200),
    st.floats(0, 200),
    st.floats(0, 0.999),
    st.floats(1, 300),
    st.floats(0, 50),
)
def test_wait_until_fits_is_the_first_time_it_fits(
    prev: float, cur: float, frac: float, limit: float, cost: float
) -> None:
    W = 60.0
    d = wait_until_fits(prev, cur, frac, W, limit, cost)

    def est_after(t: float) -> float:
        if frac + t / W < 1.0:
            return sliding(prev, cur, frac + t / W)
        return cur * max(0.0, 1.0 - (t - (1.0 - frac) * W) / W)

    if cost > limit:
        assert math.isinf(d)
        return
    assert 0.0 <= d <= 2 * W
    assert est_after(d) + cost <= limit + 1e-6
    if d > 1e-6:
        assert est_after(d * 0.99 - 1e-6) + cost > limit - 1e-6


def test_fmt_duration() -> None:
    assert fmt_duration(0.12) == "120ms"
    assert fmt_duration(1.0) == "1s"
    assert fmt_duration(8.642) == "8.64s"
    assert fmt_duration(360.0) == "6m0s"
    assert fmt_duration(61.5) == "1m1.5s"
    # rounded before it is split: never "1000ms", "60s" or "1m60s" (OpenAI's, Go's: "1s", "1m0s", "2m0s")
    assert fmt_duration(0.9996) == "1s"
    assert fmt_duration(59.999) == "1m0s"
    assert fmt_duration(119.996) == "2m0s"
