"""Prefix index: naming, matching, updates, eviction, KV events, replication (by value), for both
layouts (``PrefixIndex``: a time per (block, worker); ``RunPrefixIndex``: times per run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shepherd.policies.block_names import CHAIN_SEED, block_hashes
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex, PrefixIndexConfig, merge_entries
from shepherd.policies.prefix_replica import ReplicatedPrefixIndex
from shepherd.policies.run_index import RunPrefixIndex
from shepherd.proto.prompt_ids import PromptIds
from tests.unit.index_layouts import LAYOUTS

Index = type[PrefixIndex]


@pytest.fixture(params=LAYOUTS)
def Ix(request: pytest.FixtureRequest) -> Index:
    cls: Index = request.param
    return cls


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# -- naming -----------------------------------------------------------------------------------------


def test_block_hashes_name_full_blocks_only() -> None:
    assert block_hashes([]) == []
    assert block_hashes(ids(15)) == []
    assert len(block_hashes(ids(16))) == 1
    assert len(block_hashes(ids(47))) == 2


def test_block_hashes_are_chained() -> None:
    a = ids(64)
    hs = block_hashes(a)
    assert hs[0] == hash((CHAIN_SEED, tuple(a[:16])))
    assert hs[1] == hash((hs[0], tuple(a[16:32])))
    # a prefix's names are a prefix of the names; continuing from a parent gives the same chain
    assert block_hashes(a[:40]) == hs[:2]
    assert block_hashes(a[32:], seed=hs[1]) == hs[2:]
    # the same block after a different prefix has a different name
    b = [7] * 16 + a[16:]
    assert block_hashes(b)[1] != hs[1]


def test_block_hashes_golden_values() -> None:
    # pinned: every node of a mesh must name blocks alike (CPython int-tuple hash, 64-bit)
    assert block_hashes(list(range(40))) == [-2145823571251449545, 1797344433456423261]
    assert block_hashes([151643, 872, 198] * 11) == [6443247515929785514, -4494935017373956285]


def test_block_hashes_do_not_depend_on_the_hash_seed() -> None:
    code = "from shepherd.policies.block_names import block_hashes; print(block_hashes(list(range(48))))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        outs.add(p.stdout)
    assert outs == {f"{block_hashes(list(range(48)))}\n"}


def test_hashes_are_cached_for_the_same_ids_object(Ix: Index) -> None:
    ix = Ix()
    a = ids(64)
    assert ix.hashes(a) is ix.hashes(a)
    a.extend(ids(16, 5))  # grown: recomputed
    assert len(ix.hashes(a)) == 5


# -- match / insert ---------------------------------------------------------------------------------


def test_empty_index_matches_nothing(Ix: Index) -> None:
    ix = Ix()
    assert ix.match(ids(100)) == {}
    assert ix.match([]) == {}


def test_match_longest_prefix_per_worker(Ix: Index) -> None:
    ix = Ix()
    system = ids(64)
    ix.insert(system + ids(50, 9000), "a", 1.0)  # 7 blocks (114 tokens)
    ix.insert(system + ids(40, 7000), "b", 2.0)  # 6 blocks
    ix.insert(system[:32], "c", 3.0)  # 2 blocks
    assert ix.match(system + ids(50, 9000)) == {"a": 112, "b": 64, "c": 32}
    assert ix.match(system + ids(40, 7000) + ids(30)) == {"a": 64, "b": 96, "c": 32}
    assert ix.match(ids(64, 1)) == {}
    assert ix.match(system[:20]) == {"a": 16, "b": 16, "c": 16}
    assert ix.live_blocks == 4 + 3 + 2
    assert sorted(ix.holders(block_hashes(system)[0])) == ["a", "b", "c"]


def test_insert_records_last_access(Ix: Index) -> None:
    ix = Ix()
    a = ids(48)
    ix.insert(a, "w", 5.0)
    h = block_hashes(a)
    assert [ix.last_access(x, "w") for x in h] == [5.0, 5.0, 5.0]
    ix.insert(a[:16], "w", 9.0)
    assert [ix.last_access(x, "w") for x in h] == [9.0, 5.0, 5.0]
    assert ix.last_access(h[0], "other") is None


def test_remove_blocks_and_clear_worker(Ix: Index) -> None:
    ix = Ix()
    a = ids(64)
    ix.insert(a, "a", 1.0)
    ix.insert(a, "b", 1.0)
    h = block_hashes(a)
    ix.remove_blocks(h[2:], "a")
    assert ix.match(a) == {"a": 32, "b": 64}
    ix.clear_worker("b")
    assert ix.match(a) == {"a": 32}
    assert ix.live_blocks == 2
    assert ix.workers == ["a"]
    ix.remove_blocks(h, "nobody")  # unknown worker: nothing happens
    ix.clear_worker("nobody")
    assert ix.match(a) == {"a": 32}


def test_freed_slot_is_reused_without_leaking_blocks(Ix: Index) -> None:
    ix = Ix()
    a, b = ids(32), ids(32, 50_000)
    ix.insert(a, "old", 1.0)
    ix.clear_worker("old")
    ix.insert(b, "new", 2.0)
    assert ix.match(a) == {}
    assert ix.match(b) == {"new": 32}


def test_insert_after_match_of_the_same_prompt_and_after_a_removal(Ix: Index) -> None:
    ix = Ix()
    a = ids(80)
    ix.insert(a[:48], "w", 1.0)
    assert ix.match(a) == {"w": 48}
    ix.remove_blocks(block_hashes(a)[:1], "w")  # invalidates what match saw
    ix.insert(a, "w", 2.0)
    assert ix.match(a) == {"w": 80}
    assert ix.worker_blocks("w") == 5


def test_reinsert_after_a_hole_in_the_middle(Ix: Index) -> None:
    ix = Ix()
    a = ids(48)
    h = block_hashes(a)
    ix.insert(a, "w", 1.0)
    ix.remove_blocks([h[1], h[1]], "w")  # a KV "removed" event for a middle block (listed twice)
    assert ix.holders(h[1]) == []
    ix.insert(a, "w", 2.0)
    assert [ix.holders(b) for b in h] == [["w"], ["w"], ["w"]]
    assert ix.match(a) == {"w": 48}


# -- capacity and age -------------------------------------------------------------------------------


def test_capacity_evicts_least_recently_used_keeping_prefixes(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=4))
    a, b = ids(32, 1), ids(32, 500)
    ix.insert(a, "w", 1.0)
    ix.insert(b, "w", 2.0)
    ix.insert(a, "w", 3.0)  # a is recent again
    ix.insert(ids(32, 900), "w", 4.0)  # 6 blocks > 4: b (oldest) goes
    assert ix.worker_blocks("w") == 4
    assert ix.match(a) == {"w": 32}
    assert ix.match(b) == {}


def test_eviction_drops_deeper_blocks_first_on_equal_times(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=3))
    a = ids(80)
    ix.insert(a, "w", 1.0)  # 5 blocks at the same time, capacity 3
    assert ix.match(a) == {"w": 48}


def test_capacity_from_the_engine(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=100))
    ix.insert(ids(160), "w", 1.0)
    assert ix.capacity("w") == 100
    ix.set_capacity("w", 4)
    assert ix.capacity("w") == 4
    assert ix.worker_blocks("w") == 4
    assert ix.match(ids(160)) == {"w": 64}
    ix.set_capacity("fresh", 2)
    ix.insert(ids(64, 7), "fresh", 1.0)
    assert ix.worker_blocks("fresh") == 2


def test_expire_by_age(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(max_age_s=10.0))
    old, recent = ids(32, 1), ids(32, 500)
    ix.insert(old, "w", 0.0)
    ix.insert(recent, "w", 8.0)
    ix.insert(ids(16, 900), "v", 1.0)
    assert ix.expire(now=12.0) == 3
    assert ix.match(old) == {}
    assert ix.match(recent) == {"w": 32}
    assert ix.workers == ["w", "v"]
    assert ix.expire(now=12.0) == 0


def test_expire_reaches_old_entries_behind_recent_ones_over_calls(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(max_age_s=10.0))
    ix.insert(ids(32, 1), "w", 0.0)
    ix.insert(ids(32, 500), "w", 0.0)
    ix.insert(ids(32, 1), "w", 20.0)  # front entries refreshed, behind them old ones
    # CLOCK (flat) scans the 2 recent ones first, moves them back, and reaches the old ones next call;
    # the run layout's heap finds the old ones first: over two calls, both drop them
    assert ix.expire(now=25.0, budget=2) + ix.expire(now=25.0, budget=2) == 2
    assert ix.match(ids(32, 1)) == {"w": 32}
    assert ix.match(ids(32, 500)) == {}


# -- KV events --------------------------------------------------------------------------------------


def test_stored_token_blocks_chain_from_their_parent(Ix: Index) -> None:
    ix = Ix()
    a = ids(64)
    first = ix.store_token_blocks("w", a[:32], 1.0)
    assert first == block_hashes(a)[:2]
    rest = ix.store_token_blocks("w", a[32:], 2.0, parent=first[-1])
    assert first + rest == block_hashes(a)
    assert ix.match(a + ids(10)) == {"w": 64}
    ix.remove_blocks(rest[1:], "w")  # "removed" event
    assert ix.match(a) == {"w": 48}
    ix.clear_worker("w")  # "all cleared" event
    assert ix.match(a) == {}


# -- replication ------------------------------------------------------------------------------------


def test_export_and_export_since(Ix: Index) -> None:
    ix = Ix()
    ix.insert(ids(32), "a", 1.0)
    ix.insert(ids(16, 77), "b", 5.0)
    h = block_hashes(ids(32))
    h2 = block_hashes(ids(16, 77))
    assert ix.export() == {(h[0], "a"): 1.0, (h[1], "a"): 1.0, (h2[0], "b"): 5.0}
    assert ix.export(since=2.0) == {(h2[0], "b"): 5.0}


def test_merge_takes_the_newer_time_and_adds_holders(Ix: Index) -> None:
    x, y = Ix(), Ix()
    a = ids(48)
    x.insert(a, "w1", 1.0)
    y.insert(a[:32], "w1", 4.0)
    y.insert(a, "w2", 2.0)
    x.merge(y.export())
    assert x.match(a) == {"w1": 48, "w2": 48}
    h = block_hashes(a)
    assert [x.last_access(b, "w1") for b in h] == [4.0, 4.0, 1.0]
    assert x.export() == merge_entries(x.export(), y.export())


def test_merge_respects_capacity(Ix: Index) -> None:
    x = Ix(PrefixIndexConfig(capacity_blocks=2))
    y = Ix()
    y.insert(ids(80), "w", 1.0)
    x.merge(y.export())
    assert x.worker_blocks("w") == 2
    assert x.match(ids(80)) == {"w": 32}


def test_merge_entries_is_max() -> None:
    a = {(1, "w"): 1.0, (2, "w"): 5.0}
    b = {(1, "w"): 3.0, (3, "v"): 0.5}
    assert merge_entries(a, b) == {(1, "w"): 3.0, (2, "w"): 5.0, (3, "v"): 0.5}
    assert BLOCK_TOKENS == 16


# -- a request's chain over several inserts (the run layout keeps one time list per insert) ---------


def test_touching_a_prefix_held_through_several_inserts(Ix: Index) -> None:
    ix = Ix()
    system = ids(48)
    first, second = system + ids(32, 5000), system + ids(64, 7000)
    ix.insert(first, "w", 1.0)  # system prompt + first conversation
    ix.insert(second, "w", 2.0)  # the system prompt is held: only the new blocks are added
    ix.insert(second + ids(16, 9000), "w", 3.0)  # a follow-up turn
    h1, h2 = block_hashes(first), block_hashes(second + ids(16, 9000))
    assert [ix.last_access(b, "w") for b in h2] == [3.0] * 8
    assert [ix.last_access(b, "w") for b in h1[3:]] == [1.0, 1.0]  # the first conversation: untouched
    assert ix.match(second + ids(16, 9000)) == {"w": 128}
    assert ix.worker_blocks("w") == 3 + 2 + 4 + 1


def test_eviction_takes_the_least_recently_used_conversation_first(Ix: Index) -> None:
    ix = Ix(PrefixIndexConfig(capacity_blocks=9))
    system = ids(48)
    a, b, c = system + ids(32, 5000), system + ids(32, 6000), system + ids(32, 7000)
    ix.insert(a, "w", 1.0)
    ix.insert(b, "w", 2.0)
    ix.insert(a, "w", 3.0)  # a again: b is the least recently used
    ix.insert(c, "w", 4.0)  # 3 + 2 + 2 + 2 = 9 blocks: at capacity
    ix.insert(c + ids(16, 8000), "w", 5.0)  # one more: b's last block goes
    assert ix.match(b) == {"w": 64}
    assert ix.match(a) == {"w": 80}
    assert ix.match(c + ids(16, 8000)) == {"w": 96}


def test_shared_blocks_leave_one_holder_and_stay_with_the_others(Ix: Index) -> None:
    ix = Ix()
    a = ids(64)
    ix.insert(a, "x", 1.0)
    ix.insert(a, "y", 2.0)
    ix.insert(a[:32], "z", 3.0)
    h = block_hashes(a)
    ix.remove_blocks(h[1:], "y")  # KV "removed": y keeps one leading block
    assert ix.match(a) == {"x": 64, "y": 16, "z": 32}
    ix.set_capacity("x", 1)
    assert ix.match(a) == {"x": 16, "y": 16, "z": 32}
    assert sorted(ix.holders(h[0])) == ["x", "y", "z"]
    assert sorted(ix.holders(h[1])) == ["z"]
    ix.clear_worker("z")
    assert ix.live_blocks == 1
    assert ix.holders(h[1]) == []
    assert ix.match(a) == {"x": 16, "y": 16}


def test_kv_stored_blocks_continue_a_routed_chain() -> None:
    # the run layout only: the flat layout's CLOCK takes the older ancestors first here (a hole)
    ix = RunPrefixIndex()
    a = ids(96)
    ix.insert(a, "w", 1.0)  # the routing decision
    h = block_hashes(a)
    ix.store_token_blocks("w", a[32:], 2.0, parent=h[1])  # the engine reports what it stored past its cache
    assert [ix.last_access(b, "w") for b in h] == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert ix.worker_blocks("w") == 6
    ix.set_capacity("w", 4)  # the newer tail is still the deeper part: it goes first, a prefix stays
    assert ix.match(a) == {"w": 64}


def test_block_hashes_from_an_offset_read_no_copy_and_agree() -> None:
    a = ids(16 * 9 + 5)
    for start in (0, 16, 40, 16 * 9, 500):
        want = block_hashes(a[start:], seed=7)
        assert block_hashes(a, 7, start) == want
        assert block_hashes(PromptIds(a, (("x", len(a)),)), 7, start) == want  # a list subclass
        assert block_hashes(tuple(a), 7, start) == want  # any sequence (sliced)


@pytest.mark.parametrize("cls", [RunPrefixIndex, ReplicatedPrefixIndex], ids=["runs", "mesh"])
def test_an_insert_over_capacity_evicts_a_little_more_so_the_next_ones_evict_nothing(cls: Index) -> None:
    ix = cls(PrefixIndexConfig(capacity_blocks=128))
    old = block_hashes(ids(16 * 128))
    ix.insert_blocks(old, "w", 1.0)
    assert ix.worker_blocks("w") == 128
    ix.insert_blocks(block_hashes(ids(16 * 3, start=50_000)), "w", 2.0)
    # 3 over: 3 + 128 // 64 go, the least recently used tail first (a prefix of the old chain stays)
    assert ix.worker_blocks("w") == 126 and ix.match_blocks(old) == {"w": 123}
    ix.insert_blocks(block_hashes(ids(16 * 2, start=60_000)), "w", 3.0)
    assert ix.worker_blocks("w") == 128 and ix.match_blocks(old) == {"w": 123}  # nothing evicted


def test_reinsert_after_holes_whose_count_matches_the_unheld_tail(Ix: Index) -> None:
    # holes at 1, 3, 5: the binary search says 3 leading blocks held and 3 blocks are new, as if the
    # new ones were the last three (found by hypothesis; the flat layout then missed block 1's mask)
    ix = Ix()
    a = ids(16 * 6)
    h = block_hashes(a)
    ix.insert(a, "w", 1.0)
    ix.remove_blocks([h[1], h[3], h[5]], "w")
    ix.insert(list(a), "w", 2.0)
    assert ix.live_blocks == 6 and all(ix.holders(b) == ["w"] for b in h)
    assert ix.match(a) == {"w": 96}
