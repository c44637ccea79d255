"""Prefix index invariants (hypothesis): matching against a reference, the max-merge semilattice, every
layout (``tests.unit.index_layouts``) through the same checks, and the run and native layouts held to the
flat one's state."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shepherd.policies.block_names import block_hashes
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig, merge_entries
from shepherd.policies.run_index import RunPrefixIndex
from tests.unit.index_layouts import LAYOUTS as LAYOUT_PARAMS
from tests.unit.index_layouts import NATIVE

LAYOUTS = pytest.mark.parametrize("Ix", LAYOUT_PARAMS)

WORKERS = ["a", "b", "c"]

# prompts built from a few shared pieces, so that prefixes overlap often
pieces = st.lists(st.sampled_from([tuple(range(i * 10, i * 10 + 16)) for i in range(4)]), max_size=6)
prompts = pieces.map(lambda ps: [t for p in ps for t in p])
ops = st.lists(st.tuples(prompts, st.sampled_from(WORKERS), st.integers(0, 50)), max_size=25)

entry_keys = st.tuples(st.integers(0, 6), st.sampled_from(WORKERS))
states = st.dictionaries(entry_keys, st.floats(0, 100, allow_nan=False), max_size=12)


def reference_match(held: dict[str, set[int]], prompt: list[int]) -> dict[str, int]:
    out = {}
    hs = block_hashes(prompt)
    for w, blocks in held.items():
        n = 0
        while n < len(hs) and hs[n] in blocks:
            n += 1
        if n:
            out[w] = n * 16
    return out


@LAYOUTS
@settings(max_examples=150, deadline=None)
@given(ops, prompts)
def test_match_agrees_with_a_reference(
    Ix: type[PrefixIndex], inserts: list[tuple[list[int], str, int]], probe: list[int]
) -> None:
    ix = Ix()
    held: dict[str, set[int]] = {}
    for prompt, w, t in inserts:
        ix.insert(prompt, w, float(t))
        held.setdefault(w, set()).update(block_hashes(prompt))
    for prompt in [probe] + [p for p, _, _ in inserts]:
        assert ix.match(list(prompt)) == reference_match(held, prompt)


@LAYOUTS
@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 6))
def test_capacity_bounds_and_invariants(
    Ix: type[PrefixIndex], inserts: list[tuple[list[int], str, int]], cap: int
) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=cap))
    now = 0.0
    for prompt, w, _ in inserts:
        now += 1.0
        ix.insert(prompt, w, now)
        assert ix.worker_blocks(w) <= cap
        # the worker just chosen keeps the newest prompt's leading blocks
        assert ix.match(prompt).get(w, 0) == min(cap, len(prompt) // 16) * 16
    # masks and per-worker maps agree: every exported entry is a holder, and the live count matches
    exported = ix.export()
    assert {b for b, _ in exported} == {b for b, _ in exported if ix.holders(b)}
    assert ix.live_blocks == len({b for b, _ in exported})
    for b, w in exported:
        assert w in ix.holders(b)


@settings(max_examples=200, deadline=None)
@given(states, states, states)
def test_merge_is_commutative_associative_idempotent(
    a: dict[tuple[int, str], float], b: dict[tuple[int, str], float], c: dict[tuple[int, str], float]
) -> None:
    assert merge_entries(a, b) == merge_entries(b, a)
    assert merge_entries(merge_entries(a, b), c) == merge_entries(a, merge_entries(b, c))
    assert merge_entries(a, a) == a
    assert merge_entries(merge_entries(a, b), b) == merge_entries(a, b)


@LAYOUTS
@settings(max_examples=100, deadline=None)
@given(states, states)
def test_index_merge_converges_in_any_order(
    Ix: type[PrefixIndex], a: dict[tuple[int, str], float], b: dict[tuple[int, str], float]
) -> None:
    x, y = Ix(), Ix()
    x.merge(a)
    x.merge(b)
    y.merge(b)
    y.merge(a)
    y.merge(b)
    assert x.export() == y.export() == merge_entries(a, b)


block_lists = st.lists(st.integers(0, 5), max_size=4)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), prompts, st.sampled_from(WORKERS)),
        st.tuples(st.just("remove"), block_lists, st.sampled_from(WORKERS)),
        st.tuples(st.just("clear"), st.just([]), st.sampled_from(WORKERS)),
        st.tuples(st.just("expire"), st.just([]), st.just("")),
        st.tuples(st.just("capacity"), st.integers(1, 5).map(lambda n: [n]), st.sampled_from(WORKERS)),
        st.tuples(st.just("merge"), st.integers(0, 3).map(lambda n: [n]), st.sampled_from(WORKERS)),
    ),
    max_size=40,
)


@LAYOUTS
@settings(max_examples=200, deadline=None)
@given(actions, st.integers(1, 8))
# a block queued twice (merged, removed, merged again) once counted twice toward an eviction's k, which left
# the worker over its capacity
@example(
    [("insert", list(range(16)), "a"), ("merge", [0], "a"), ("remove", [0], "c"), ("merge", [1], "c")], 1
)
def test_any_sequence_of_updates_keeps_the_index_consistent(
    Ix: type[PrefixIndex], acts: list[tuple[str, list[int], str]], cap: int
) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=cap, max_age_s=5.0))
    peer = Ix()
    peer.insert(list(range(64)), "c", 3.0)
    now = 0.0
    seen: list[int] = []  # block names met so far, for removals
    for kind, arg, w in acts:
        now += 1.0
        if kind == "insert":
            ix.insert(list(arg), w, now)
            seen += block_hashes(arg)
        elif kind == "remove":
            ix.remove_blocks([seen[i % len(seen)] for i in arg] if seen else [], w)
        elif kind == "clear":
            ix.clear_worker(w)
        elif kind == "expire":
            ix.expire(now, budget=3)
        elif kind == "capacity":
            ix.set_capacity(w, arg[0])
        else:
            ix.merge({(b, w): now - arg[0] for b in block_hashes(list(range(16 * (arg[0] + 1))))})
            ix.merge(peer.export())
        exported = ix.export()
        for wk in ix.workers:
            assert ix.worker_blocks(wk) <= ix.capacity(wk)
        assert ix.live_blocks == len({b for b, _ in exported})
        assert all(wk in ix.holders(b) for b, wk in exported)
        assert sum(len(ix.holders(b)) for b in {b for b, _ in exported}) == len(exported)


def held_run_end(ix: PrefixIndex, w: str, hs: list[int], a: int) -> bool:
    """``a`` blocks of chain ``hs`` for worker ``w`` is the end of a run of blocks ``w`` holds."""
    return (a == 0 or w in ix.holders(hs[a - 1])) and (a == len(hs) or w not in ix.holders(hs[a]))


no_age_actions = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), prompts, st.sampled_from(WORKERS)),
        st.tuples(st.just("remove"), block_lists, st.sampled_from(WORKERS)),
        st.tuples(st.just("clear"), st.just([]), st.sampled_from(WORKERS)),
        st.tuples(st.just("merge"), st.integers(0, 3).map(lambda n: [n]), st.sampled_from(WORKERS)),
        st.tuples(st.just("kv"), prompts, st.sampled_from(WORKERS)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(no_age_actions, st.lists(prompts, min_size=1, max_size=4))
def test_the_layouts_hold_the_same_state_and_match_alike(
    acts: list[tuple[str, list[int], str]], probes: list[list[int]]
) -> None:
    """Without capacity pressure or expiry (where their eviction orders differ by design), the run
    and native layouts hold exactly what the flat one holds, and their answers are the reference's."""
    flat = PrefixIndex()
    others: list[PrefixIndex] = [RunPrefixIndex()] + ([NativePrefixIndex()] if NATIVE_INDEX else [])
    seen: list[int] = []
    now = 0.0
    for kind, arg, w in acts:
        now += 1.0
        for ix in (flat, *others):
            if kind == "insert":
                ix.insert(list(arg), w, now)
            elif kind == "kv":  # a KV "stored" event: the blocks after the first one, from its name
                hs = block_hashes(arg)
                if hs:
                    ix.store_token_blocks(w, arg[16:], now, parent=hs[0])
            elif kind == "remove":
                ix.remove_blocks([seen[i % len(seen)] for i in arg] if seen else [], w)
            elif kind == "clear":
                ix.clear_worker(w)
            else:
                ix.merge({(b, w): now - arg[0] for b in block_hashes(list(range(16 * (arg[0] + 1))))})
        if kind in ("insert", "kv"):
            seen += block_hashes(arg)
        for other in others:
            assert other.export() == flat.export()
            assert other.live_blocks == flat.live_blocks
            for wk in WORKERS:
                assert other.worker_blocks(wk) == flat.worker_blocks(wk)
    for p in probes + [a[1] for a in acts if a[0] == "insert"]:
        hs = block_hashes(p)
        for ix in others:
            got = ix.match_blocks(hs)
            for w in WORKERS:
                a = got.get(w, 0)
                assert held_run_end(ix, w, hs, a)
                ref = reference_match({w: {b for b, x in ix.export() if x == w}}, p).get(w, 0) // 16
                if all(w not in ix.holders(b) for b in hs[ref:]):  # what w holds of p is a prefix
                    assert a == ref


# expiry with a budget that stops midway: two runs' tails with the same time (the chain's first block,
# touched when the deeper one was inserted), the deeper one must go first, as eviction takes them
_A, _B, _D = list(range(10, 26)), list(range(16)), list(range(10, 26))


@pytest.mark.parametrize("Ix", [pytest.param(RunPrefixIndex, id="runs"), NATIVE])
@settings(max_examples=150, deadline=None)
@given(actions, st.integers(1, 8))
@example(
    [("insert", _A + _B + _B, "a"), ("insert", _A + _D, "a")]
    + [("insert", [], "b")] * 5
    + [("expire", [], "")],
    4,
)
def test_runs_keep_what_a_worker_holds_of_its_latest_chain_a_prefix(
    Ix: type[PrefixIndex], acts: list[tuple[str, list[int], str]], cap: int
) -> None:
    """Evictions and expiry of the run (and native) layouts take tails: after any updates, what a worker
    holds of the chain it was last given (when nothing removed a block of it since) is a prefix of it."""
    ix = Ix(PrefixIndexConfig(capacity_blocks=cap, max_age_s=5.0))
    last: dict[str, list[int]] = {}
    now = 0.0
    for kind, arg, w in acts:
        now += 1.0
        if kind == "insert":
            ix.insert(list(arg), w, now)
            last[w] = block_hashes(arg)
        elif kind == "clear":
            ix.clear_worker(w)
            last.pop(w, None)
        elif kind == "expire":
            ix.expire(now, budget=3)
        elif kind == "capacity":
            ix.set_capacity(w, arg[0])
        for wk, hs in last.items():
            held = [wk in ix.holders(b) for b in hs]
            assert held == sorted(held, reverse=True), (wk, held)
