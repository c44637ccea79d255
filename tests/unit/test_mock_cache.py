"""The mock engine's paged prefix KV cache: chained hashes, LRU eviction, reference counts, KV events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mock_engine.cache import (
    ROOT_HASH,
    AllBlocksCleared,
    Allocation,
    BlockRemoved,
    BlockStored,
    KvEvent,
    PrefixCache,
    block_hashes,
)

BS = 4


def seq(start: int, blocks: int, bs: int = BS) -> list[int]:
    return list(range(start, start + blocks * bs))


def replay(events: list[KvEvent], state: dict[int, int | None]) -> None:
    """Apply KV events to a subscriber's view (block hash -> parent), checking they are consistent."""
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_hash
            assert parent is None or parent in state, "stored under an unknown parent"
            for h, toks in zip(ev.block_hashes, ev.token_ids, strict=True):
                assert h not in state, "stored twice"
                assert len(toks) == ev.block_size
                state[h] = parent
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in state, "removed an unknown block"
                del state[h]
        else:
            assert isinstance(ev, AllBlocksCleared)
            state.clear()


def test_hashes_are_chained_and_deterministic() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a == block_hashes((1, 2, 3, 4, 5, 6, 7, 8, 99), BS)  # partial block ignored
    assert a[1] != b[1]  # same second block, different prefix
    assert a[1] == hash((a[0], (5, 6, 7, 8))) and a[0] == hash((ROOT_HASH, (1, 2, 3, 4)))


def test_insert_lookup_longest_prefix() -> None:
    c = PrefixCache(capacity_blocks=16, block_size=BS)
    ids = seq(0, 3)
    assert c.lookup(ids) == 0
    chain = c.insert(ids)
    assert len(chain) == 3 and len(c) == 3
    assert c.lookup([*ids, 1000, 1001]) == 12
    assert c.lookup([*ids[:8], 7, 7, 7, 7]) == 8  # diverges in the third block
    assert c.lookup([5, *ids[1:]]) == 0  # diverges in the first block
    s = c.stats()
    assert s.lookup_tokens == 12 + 14 + 12 + 12 and s.hit_tokens == 12 + 8


def test_lru_evicts_least_recently_used_chain() -> None:
    c = PrefixCache(capacity_blocks=4, block_size=BS)
    a, b, d = seq(0, 2), seq(100, 2), seq(200, 2)
    c.insert(a)
    c.insert(b)
    c.drain_events()
    c.lookup(a)  # a is now more recent than b
    c.insert(d)
    assert c.cached_prefix_tokens(a) == 8
    assert c.cached_prefix_tokens(b) == 0
    assert c.cached_prefix_tokens(d) == 8
    events = c.drain_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(block_hashes(b, BS))


def test_eviction_takes_leaves_first() -> None:
    c = PrefixCache(capacity_blocks=3, block_size=BS)
    c.insert(seq(0, 3))
    c.insert(seq(500, 1))  # needs one block: the deepest block of the first chain goes
    assert c.cached_prefix_tokens(seq(0, 3)) == 8


def test_stored_events_carry_parent_and_tokens() -> None:
    c = PrefixCache(capacity_blocks=16, block_size=BS)
    first = seq(0, 2)
    c.insert(first)
    longer = first + seq(50, 1)
    c.insert(longer)
    ev = c.drain_events()
    assert [type(e) for e in ev] == [BlockStored, BlockStored]
    s1, s2 = ev
    assert isinstance(s1, BlockStored) and isinstance(s2, BlockStored)
    assert s1.parent_hash is None and s1.token_ids == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert s2.parent_hash == s1.block_hashes[-1] and s2.token_ids == ((50, 51, 52, 53),)
    assert s1.event_id < s2.event_id


def test_referenced_blocks_are_not_evicted_and_allocation_can_wait() -> None:
    c = PrefixCache(capacity_blocks=4, block_size=BS)
    alloc = c.allocate(seq(0, 2), total_tokens=12)  # 2 prompt blocks hashed + 1 private
    assert alloc is not None and alloc.cached_tokens == 0 and alloc.private_blocks == 1
    assert c.used_blocks == 3 and c.free_blocks == 1
    assert c.allocate(seq(100, 2), total_tokens=8) is None  # 2 needed, 1 free, nothing evictable
    assert c.used_blocks == 3  # nothing changed
    c.release(alloc)
    assert c.used_blocks == 0 and c.stats().evictable_blocks == 2
    again = c.allocate(seq(100, 2), total_tokens=8)
    assert again is not None and c.stats().evicted_blocks_total == 0
    c.release(again)


def test_release_caches_the_output_and_next_turn_hits() -> None:
    c = PrefixCache(capacity_blocks=32, block_size=BS)
    prompt = [*seq(0, 2), 900, 901]  # 2 full blocks + 2 tokens
    output = [1, 2, 3, 4, 5, 6]
    alloc = c.allocate(prompt, total_tokens=len(prompt) + len(output))
    assert alloc is not None
    c.release(alloc, tuple(prompt + output))
    assert c.stats().private_blocks == 0 and c.used_blocks == 0
    follow_up = prompt + output + [77] * 9
    assert c.cached_prefix_tokens(follow_up) == 16  # all 4 full blocks of the previous turn


def test_group_allocation_shares_the_prompt() -> None:
    c = PrefixCache(capacity_blocks=32, block_size=BS)
    allocs = c.allocate_group(seq(0, 3), [12 + 5, 12 + 5, 12 + 5])
    assert allocs is not None and len(allocs) == 3
    assert len(c) == 3  # the prompt is stored once
    assert all(a.private_blocks == 2 for a in allocs)
    assert c.used_blocks == 3 + 6
    for a in allocs:
        c.release(a)
    assert c.used_blocks == 0


def test_clear_is_refused_while_referenced() -> None:
    c = PrefixCache(capacity_blocks=8, block_size=BS)
    alloc = c.allocate(seq(0, 2), 8)
    assert alloc is not None
    assert not c.clear()
    c.release(alloc)
    c.drain_events()
    assert c.clear() and len(c) == 0
    assert [type(e) for e in c.drain_events()] == [AllBlocksCleared]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lookup", "alloc", "release", "release_out"]),
        st.integers(0, 3),  # which of a few prompt families (shared prefixes)
        st.integers(1, 6),  # blocks
        st.integers(0, 9),  # output tokens
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(2, 12))
def test_events_replay_to_the_cache_state_and_invariants_hold(
    ops: list[tuple[str, int, int, int]], capacity: int
) -> None:
    c = PrefixCache(capacity_blocks=capacity, block_size=BS)
    view: dict[int, int | None] = {}
    held: list[tuple[Allocation, list[int]]] = []
    last_id = 0
    for op, family, blocks, out in ops:
        ids = [family * 1000 + i for i in range(blocks * BS)]
        if op == "insert":
            c.insert(ids)
        elif op == "lookup":
            c.lookup(ids)
        elif op == "alloc":
            alloc = c.allocate(ids, len(ids) + out)
            if alloc is not None:
                held.append((alloc, ids + [7] * out))
        elif held:
            alloc, full = held.pop(0)
            c.release(alloc, tuple(full) if op == "release_out" else None)
        events = c.drain_events()
        for e in events:
            assert e.event_id > last_id
            last_id = e.event_id
        replay(events, view)
        s = c.stats()
        assert s.used_blocks + s.evictable_blocks + c.free_blocks == capacity
        assert c.free_blocks >= 0 and s.private_blocks >= 0
        assert set(view) == {h for h in view if h in c} and len(view) == len(c)
        for h, parent in view.items():  # prefix-closed: every parent is cached
            assert parent is None or parent in c
            assert c.block_parent(h) == (ROOT_HASH if parent is None else parent)
    for alloc, _ in held:
        c.release(alloc)
    assert c.used_blocks == 0


def test_kv_event_log_numbers_batches_replays_and_bounds_history() -> None:
    from shepherd.mock_engine.kv_events import KvEventLog

    log = KvEventLog(history=3, history_blocks=100)
    live = log.subscribe(0)
    for i in range(5):
        log.publish([BlockRemoved(event_id=i + 1, block_hashes=(i,))], timestamp=float(i))
    assert log.publish([], 9.0) is None  # no events, no batch
    assert [b.sequence_number for b in live.take()] == [1, 2, 3, 4, 5]
    assert [b.sequence_number for b in log.replay_from(4)] == [4, 5]
    assert [b.sequence_number for b in log.replay_from(1)] == [3, 4, 5]  # older batches are gone
    late = log.subscribe(5)
    assert [b.sequence_number for b in late.take()] == [5]
    big = BlockStored(
        event_id=9, block_hashes=tuple(range(80)), parent_hash=None, token_ids=((0,) * 4,) * 80, block_size=4
    )
    log.publish([big], 10.0)
    log.publish([big], 11.0)  # 160 blocks held > 100: the older big batch goes
    assert [b.sequence_number for b in log.replay_from(1)] == [7]
    live.close()
    late.close()
    assert log.subscriber_count == 0
