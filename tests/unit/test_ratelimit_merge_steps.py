"""Rate-limit merges without decoding every entry (``join_wire``) and in slices (``merge_snapshot_steps``,
``MeshState.merge_remote_state_steps``): the same state as the one-shot merge, validated first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.ratelimit import Limits, RateLimiter
from shepherd.mesh.ratelimit_shards import Entry, entry_to_wire, join, join_wire, wire_entries_ok
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.policies.prefix_replica_native import Replica, make_replica
from tests.unit.test_ratelimit_crdt import entries


@settings(max_examples=200, deadline=None)
@given(entries, entries, st.booleans())
def test_join_wire_is_the_join_in_place(a: Entry, b: Entry, as_tuple: bool) -> None:
    item = entry_to_wire("t", "m", "n", 1, b)
    held = a.copy()
    changed = join_wire(held, tuple(item) if as_tuple else item)
    assert held == join(a, b)
    assert changed == (join(a, b) != a)
    assert type(held.cur) is list and type(held.prev) is list  # (a tuple's slices are copied)


def _shards(nodes: int, tenants: int, t: float = 1000.0) -> list[list[object]]:
    """Every node's shard of every tenant, as a joining node's push-pull carries them."""
    out: list[list[object]] = []
    for i in range(nodes):
        lim = RateLimiter(f"n{i}", 1)
        for k in range(tenants):
            lim.acquire(t, [((f"t{k}", ""), Limits(rpm=10**6))], 10 + i)
        out += lim.snapshot()
    return out


def test_merge_in_steps_yields_and_ends_in_the_same_state() -> None:
    snap = _shards(40, 5)  # 200 entries
    at_once = RateLimiter("me", 1)
    at_once.merge_snapshot(snap)
    stepped = RateLimiter("me", 1)
    steps = stepped.merge_snapshot_steps(snap, step=16)
    n = 0
    for _ in steps:
        n += 1
        if n == 20:  # an admission between two slices: its own shard is this node's alone
            stepped.acquire(1000.5, [(("t0", ""), Limits(rpm=10**6))], 7)
            at_once.acquire(1000.5, [(("t0", ""), Limits(rpm=10**6))], 7)
    assert n >= 2 * len(snap) // 16  # validated, then merged, a slice per step
    assert stepped.entries() == at_once.entries()
    assert len(at_once.entries()) == 200 + 1


def test_merge_in_steps_validates_everything_first() -> None:
    snap = _shards(20, 5)
    bad = [*snap, ["t0", "", "n99", 1, 1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, "x"]]  # the last slice
    lim = RateLimiter("me", 1)
    with pytest.raises(ValueError):
        for _ in lim.merge_snapshot_steps(bad, step=8):
            pass
    assert lim.entries() == {}  # nothing merged, though the earlier slices were fine


def test_merge_in_steps_from_a_source_keeps_its_shards_only() -> None:
    snap = _shards(10, 3)
    lim = RateLimiter("me", 1)
    for _ in lim.merge_snapshot_steps(snap, "n3", step=4):
        pass
    assert {sid for _, sid in lim.entries()} == {("n3", 1)}
    assert lim.foreign_dropped == len(snap) - 3


def test_wire_entries_ok_agrees_with_the_item_checks() -> None:
    good = _shards(5, 4)
    assert wire_entries_ok(good) and wire_entries_ok(good[:3]) and wire_entries_ok([])
    for i, bad_value in ((3, True), (7, -1), (1, 5), (18, 1.5), (0, None)):
        bad = [list(x) for x in good]
        bad[-1][i] = bad_value
        assert not wire_entries_ok(bad) and not wire_entries_ok(bad[-3:])
    assert not wire_entries_ok([*good, good[0][:-1]])


def _node_state(name: str) -> tuple[MeshState[Replica], RateLimiter]:
    st: MeshState[Replica] = MeshState(name, lambda: 1000.0, MeshStateConfig(), new_index=make_replica)
    lim = RateLimiter(name, 1)
    st.register("ratelimit", lim)
    return st, lim


def test_mesh_state_merges_a_join_in_steps_like_at_once() -> None:
    big, big_lim = _node_state("seed")
    big_lim.merge_snapshot(_shards(60, 40))
    (fresh, fresh_lim), (stepped, stepped_lim) = _node_state("fresh"), _node_state("fresh")
    big.merge_remote_state(fresh.local_state())
    reply = big.local_state()
    fresh.merge_remote_state(reply)
    steps = list(stepped.merge_remote_state_steps(reply, "seed"))
    assert len(steps) >= 2400 // 1000  # the limiter's 2,400 shards, a slice per step
    want = fresh_lim.entries()
    assert len(want) == 2400 and stepped_lim.entries() == want
    # a malformed state is counted and dropped, as merge_remote_state does
    errors = stepped.stats.decode_errors
    assert list(stepped.merge_remote_state_steps(b"\x00not a state", "seed")) == []
    assert stepped.stats.decode_errors == errors + 1
