"""KV events into the prefix index: the cursor by value, the feed against a scripted fake engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2

from shepherd.node.dispatch.kv_feed import (
    BackoffConfig,
    KvCursor,
    KvFeed,
    WorkerKvState,
    merge_load,
)
from shepherd.node.engines.backoff import Backoff
from shepherd.policies.prefix_index import PrefixIndex
from shepherd.proto.engine_types import (
    EngineLoad,
    EngineUnavailable,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheCleared,
    KvCacheEvent,
    KvEventBatch,
    ServerInfo,
)
from shepherd.proto.kv_codec import decode_kv_batch

A = list(range(1000, 1048))  # three 16-token blocks; the fake engine names them 101, 102, 103
B = list(range(2000, 2032))  # two blocks: 201, 202


def stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> KvBlocksStored:
    return KvBlocksStored(tuple(hashes), parent, tuple(tokens), 16)


def batch(seq: int, *events: KvCacheEvent, load: EngineLoad | None = None) -> KvEventBatch:
    return KvEventBatch(seq, tuple(events), load)


A12 = stored([101, 102], None, A[:32])
A3 = stored([103], 102, A[32:])
B12 = stored([201, 202], None, B)


class FakeEngine:
    """Each subscription plays the next script (batches, then the stream ends; or an exception); with
    no script left the subscription stays open until cancelled and ``idle`` is set."""

    def __init__(
        self, scripts: Sequence[Sequence[KvEventBatch] | Exception], capacity_tokens: int = 0
    ) -> None:
        self.scripts = list(scripts)
        self.starts: list[int] = []
        self.idle = asyncio.Event()
        self.capacity_tokens = capacity_tokens
        self.cancelled = 0

    async def server_info(self) -> ServerInfo:
        return ServerInfo(kind="sglang", max_total_num_tokens=self.capacity_tokens)

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        self.starts.append(start_seq)
        if not self.scripts:
            self.idle.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        item = self.scripts.pop(0)
        if isinstance(item, Exception):
            raise item
        for b in item:
            yield b


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, d: float) -> None:
        self.delays.append(d)
        await asyncio.sleep(0)


async def run_feed(
    engine: FakeEngine, index: PrefixIndex, feed: KvFeed | None = None, worker: str = "w"
) -> tuple[KvFeed, WorkerKvState]:
    feed = feed or KvFeed(sleep=Sleeps(), clock=lambda: 5.0)
    state = feed.start(worker, engine, index)
    await asyncio.wait_for(engine.idle.wait(), 10)  # a hang guard, not a timing assertion
    return feed, state


# ---- the cursor (pure) -----------------------------------------------------------------------------


def test_cursor_in_order_duplicates_and_gap() -> None:
    c = KvCursor()
    c.opened(c.resume_from())
    assert [c.on_batch(s) for s in (1, 2, 3)] == ["apply"] * 3
    assert c.on_batch(3) == "skip"
    assert c.on_batch(5) == "resubscribe" and c.resume_from() == 4 and c.last == 3
    c.opened(c.resume_from())
    assert [c.on_batch(s) for s in (4, 5)] == ["apply", "apply"]
    assert (c.last, c.gaps, c.resets) == (5, 1, 0)


def test_cursor_first_batch_of_any_number_and_unnumbered() -> None:
    c = KvCursor()
    c.opened(1)
    assert c.on_batch(700) == "apply"  # the engine's history starts later: nothing to compare with
    assert c.on_batch(0) == "apply" and c.last == 700


def test_cursor_takes_an_unreplayed_gap_in_stride_and_resets_only_when_numbers_go_back() -> None:
    c = KvCursor()
    c.opened(1)
    c.on_batch(1)
    assert c.on_batch(9) == "resubscribe"
    c.opened(c.resume_from())
    # asked for 2, got 9: the engine does not replay (SGLang): applied, nothing cleared
    assert c.on_batch(9) == "gap" and c.last == 9 and not c.replays
    assert c.on_batch(12) == "gap" and c.last == 12  # later gaps: no subscribing again for nothing
    c.opened(c.resume_from())
    assert c.on_batch(1) == "reset" and c.last == 1  # a new subscription counting from 1: restart
    assert (c.resets, c.lost) == (1, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=60))
def test_cursor_never_moves_back_within_a_subscription(seqs: list[int]) -> None:
    c = KvCursor()
    c.opened(1)
    for i, s in enumerate(seqs):
        before = c.last
        v = c.on_batch(s)
        if v == "resubscribe":
            c.opened(c.resume_from())
        if i > 0 and v != "reset":
            assert c.last >= before
        if v == "apply" and before:
            assert c.last == before + 1


# ---- the feed --------------------------------------------------------------------------------------


async def test_events_feed_the_index() -> None:
    ix = PrefixIndex()
    engine = FakeEngine([[batch(1, A12), batch(2, A3, B12), batch(3, KvBlocksRemoved((103, 202)))]])
    feed, state = await run_feed(engine, ix)
    assert ix.match(A) == {"w": 32} and ix.match(B) == {"w": 16}
    assert (state.stats.stored_blocks, state.stats.removed_blocks) == (5, 2)
    await feed.close()


async def test_gap_resubscribes_from_the_first_missing_batch() -> None:
    ix = PrefixIndex()
    engine = FakeEngine([[batch(1, A12), batch(3, B12)], [batch(2, A3), batch(3, B12)]])
    feed, state = await run_feed(engine, ix)
    assert engine.starts == [1, 2, 4]  # then the stream ended; subscribed again from 4 (idle)
    assert ix.match(A) == {"w": 48} and ix.match(B) == {"w": 32}
    assert (state.cursor.last, state.cursor.gaps, state.cursor.resets) == (3, 1, 0)
    await feed.close()


async def test_unreplayed_gap_keeps_what_the_worker_holds() -> None:
    ix = PrefixIndex()
    engine = FakeEngine([[batch(1, A12), batch(5, B12)], [batch(5, B12)]])
    feed, state = await run_feed(engine, ix)
    assert engine.starts[:2] == [1, 2]
    # the events in the gap are lost; what came before still stands (no needless reset)
    assert ix.match(A) == {"w": 32} and ix.match(B) == {"w": 32}
    assert (state.cursor.resets, state.cursor.lost) == (0, 1)
    await feed.close()


async def test_engine_restart_clears_the_worker() -> None:
    ix = PrefixIndex()
    engine = FakeEngine([[batch(1, A12), batch(2, A3)], EngineUnavailable("gone"), [batch(1, B12)]])
    feed, _ = await run_feed(engine, ix)
    assert engine.starts[:3] == [1, 3, 3]
    assert ix.match(A) == {} and ix.match(B) == {"w": 32}
    await feed.close()


async def test_cleared_removes_only_that_workers_entries() -> None:
    ix = PrefixIndex()
    ix.insert(A, "other", 1.0)
    ix.insert(B, "w", 1.0)  # a routing decision
    engine = FakeEngine([[batch(1, A12), batch(2, KvCacheCleared()), batch(3, B12)]])
    feed, state = await run_feed(engine, ix)
    assert ix.match(A) == {"other": 48}
    assert ix.match(B) == {"w": 32}  # stored after the clear
    assert state.stats.cleared == 1
    engine2 = FakeEngine([[batch(1, KvCacheCleared())]])
    feed.stop("w", clear=False)
    feed.start("w", engine2, ix)
    await asyncio.wait_for(engine2.idle.wait(), 10)
    assert ix.worker_blocks("w") == 0 and ix.match(A) == {"other": 48}
    await feed.close()


async def test_backoff_is_exponential_jittered_and_bounded() -> None:
    ix = PrefixIndex()
    sleeps = Sleeps()
    cfg = BackoffConfig(initial_s=0.2, max_s=10.0, multiplier=2.0, jitter=0.2)
    feed = KvFeed(backoff=cfg, sleep=sleeps, rand=lambda: 1.0)  # the largest jitter every time
    engine = FakeEngine([EngineUnavailable("refused")] * 10 + [OSError("reset")] * 2)
    await run_feed(engine, ix, feed)
    d = sleeps.delays
    assert len(d) == 12 and len(engine.starts) == 13  # one wait per failure, no busy loop
    assert d[:3] == pytest.approx([0.24, 0.48, 0.96])
    assert d == sorted(d) and max(d) == pytest.approx(12.0)  # capped at max_s * (1 + jitter)
    await feed.close()


async def test_backoff_resets_once_events_flow() -> None:
    sleeps = Sleeps()
    feed = KvFeed(sleep=sleeps, rand=lambda: 0.5)  # no jitter
    engine = FakeEngine(
        [EngineUnavailable("x"), EngineUnavailable("x"), [batch(1, A12)], EngineUnavailable("x")]
    )
    await run_feed(engine, PrefixIndex(), feed)
    # 2 failures (0.2, 0.4), a stream that delivered events and ended (0.2 again), a failure (0.4)
    assert sleeps.delays == pytest.approx([0.2, 0.4, 0.2, 0.4])
    await feed.close()


def test_backoff_jitter_stays_in_its_band() -> None:
    import random

    rng = random.Random(7)
    b = Backoff(initial=1.0, maximum=4.0, jitter=0.25, rand=rng.random)
    ds = [b.failed(0.0) for _ in range(50)]
    assert all(0.75 <= x <= 5.0 for x in ds) and 0.75 <= ds[0] <= 1.25


async def test_stop_cancels_the_subscription_and_forgets_the_worker() -> None:
    ix = PrefixIndex()
    engine = FakeEngine([[batch(1, A12)]])
    feed, _ = await run_feed(engine, ix)
    assert ix.match(A) == {"w": 32}
    feed.stop("w")
    assert ix.worker_blocks("w") == 0 and not feed.running("w")
    await feed.close()
    assert engine.cancelled == 1


async def test_capacity_from_server_info_then_from_load_telemetry() -> None:
    ix = PrefixIndex()
    loads: list[EngineLoad] = []
    engine = FakeEngine(
        [[batch(1, A12, load=EngineLoad(running=2, max_total_tokens=320))]], capacity_tokens=160
    )
    feed = KvFeed(sleep=Sleeps())
    state = feed.start("w", engine, ix, loads.append)
    await asyncio.wait_for(engine.idle.wait(), 10)
    assert ix.capacity("w") == 20 and state.stats.capacity_blocks == 20
    assert loads == [EngineLoad(running=2, max_total_tokens=320)]
    await feed.close()


async def test_unimplemented_ends_the_feed_quietly() -> None:
    from shepherd.proto.engine_types import EngineError

    engine = FakeEngine([EngineError("engine error (UNIMPLEMENTED): no", retryable=False)])
    feed = KvFeed(sleep=Sleeps())
    feed.start("w", engine, PrefixIndex())
    for _ in range(100):  # bounded: the task ends after one call
        if not feed.running("w"):
            break
        await asyncio.sleep(0)
    assert not feed.running("w") and engine.starts == [1]
    await feed.close()


def test_blocks_of_other_sizes() -> None:
    ix = PrefixIndex()
    st_ = WorkerKvState(ix, "w", lambda: 1.0)
    st_.apply(batch(1, KvBlocksStored((7,), None, tuple(A[:32]), 32)))
    assert ix.match(A) == {"w": 32}
    st_.apply(batch(2, KvBlocksStored((8,), None, tuple(B[:8]), 8)))  # page size 8: half a block
    assert ix.match(B) == {}
    st_.apply(batch(3, KvBlocksStored((9, 10, 11), 8, tuple(B[8:32]), 8)))  # gathered into 2 blocks
    assert ix.match(B) == {"w": 32}
    st_.apply(batch(4, KvBlocksStored((12,), None, tuple(B[:12]), 12)))  # 12: neither: not applied
    assert st_.unsupported_block_size == 12


# ---- wire ------------------------------------------------------------------------------------------


def test_decode_a_wire_batch() -> None:
    c = common_pb2
    msg = c.KvEventBatch(
        sequence_number=7,
        events=[
            c.KvCacheEvent(
                event_id=1,
                stored=c.KvBlocksStored(
                    blocks=[
                        c.KvBlock(block_hash=-5, token_ids=A[:16], block_size=16),
                        c.KvBlock(block_hash=6, token_ids=A[16:32], block_size=16),
                    ],
                    parent_block_hash=4,
                ),
            ),
            c.KvCacheEvent(
                event_id=2,
                stored=c.KvBlocksStored(
                    blocks=[c.KvBlock(block_hash=9, token_ids=B[:16], block_size=16)],
                    locality=c.KV_CACHE_LOCALITY_REMOTE,
                ),
            ),
            c.KvCacheEvent(event_id=3, removed=c.KvBlocksRemoved(block_hashes=[6])),
            c.KvCacheEvent(event_id=4, cleared=c.KvCacheCleared()),
        ],
        load=c.EngineLoad(running_requests=3, waiting_requests=1, token_usage=0.5, max_total_num_tokens=4096),
    )
    b = decode_kv_batch(common_pb2.KvEventBatch.FromString(msg.SerializeToString()))
    assert b.sequence_number == 7 and not b.load_only
    assert b.events == (
        KvBlocksStored((-5, 6), 4, tuple(A[:32]), 16),
        KvBlocksRemoved((6,)),
        KvCacheCleared(),
    )
    assert b.load == EngineLoad(running=3, waiting=1, token_usage=0.5, max_total_tokens=4096)
    hb = decode_kv_batch(
        c.KvEventBatch(sequence_number=7, load=c.EngineLoad(running_requests=1, load_only=True))
    )
    assert hb.load_only and hb.events == () and hb.load is not None and hb.load.running == 1


def test_merge_load_keeps_telemetry_a_record_lacks() -> None:
    old = EngineLoad(running=1, used_tokens=100, max_total_tokens=1000, cache_hit_rate=0.5)
    assert merge_load(old, EngineLoad(running=4)) == EngineLoad(
        running=4, used_tokens=100, max_total_tokens=1000, cache_hit_rate=0.5
    )
    new = EngineLoad(running=2, max_total_tokens=2000)
    assert merge_load(old, new) == new


class OpenEngine:
    """Sends its batches, then keeps the stream open until told to fail it."""

    def __init__(self, batches: Sequence[KvEventBatch]) -> None:
        self.batches = list(batches)
        self.sent = asyncio.Event()
        self.fail = asyncio.Event()
        self.starts = 0

    async def server_info(self) -> ServerInfo:
        return ServerInfo(kind="sglang")

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        self.starts += 1
        for b in self.batches:
            yield b
        self.batches = []
        self.sent.set()
        await self.fail.wait()
        raise EngineUnavailable("gone")


async def test_live_while_the_stream_is_open_and_has_delivered() -> None:
    """``live``: what ``--mesh-index-replication auto`` reads; an opened stream that sent nothing yet,
    a failed one and a stopped one are not live."""
    ix = PrefixIndex()
    feed = KvFeed(sleep=Sleeps(), clock=lambda: 5.0)
    quiet = OpenEngine([])
    feed.start("q", quiet, ix)
    await asyncio.wait_for(quiet.sent.wait(), 10)  # a hang guard, not a timing assertion
    assert not feed.live("q")  # open, nothing delivered
    engine = OpenEngine([batch(1, A12)])
    feed.start("w", engine, ix)
    await asyncio.wait_for(engine.sent.wait(), 10)
    assert feed.live("w") and ix.match(A) == {"w": 32}
    engine.fail.set()
    for _ in range(100):  # bounded: until the failure was taken (the fake sleep yields once)
        if engine.starts > 1:
            break
        await asyncio.sleep(0)
    assert engine.starts > 1 and not feed.live("w")
    feed.stop("w")
    assert not feed.live("w") and not feed.live("nobody")
    await feed.close()


class LosesCancel:
    """An engine whose ``server_info`` loses a cancellation, as Python 3.11's ``asyncio.wait_for`` did
    when it landed as the call it waited for ended: the call's own outcome (a refused connection)
    comes back instead. Subscriptions are refused too."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.calls = 0
        self.subscribes = 0

    async def server_info(self) -> ServerInfo:
        self.calls += 1
        self.asked.set()
        with contextlib.suppress(asyncio.CancelledError):  # lost
            await asyncio.Event().wait()
        raise OSError("connection refused")

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        self.subscribes += 1
        if self.subscribes > 0:  # (always: an async generator that refuses at its first step)
            raise OSError("connection refused")
        yield KvEventBatch(0, ())


async def test_a_stopped_feed_ends_even_when_its_cancellation_is_lost() -> None:
    engine = LosesCancel()
    sleeps = Sleeps()
    feed = KvFeed(sleep=sleeps)
    feed.start("w", engine, PrefixIndex())
    await asyncio.wait_for(engine.asked.wait(), 10)  # a hang guard, not a timing assertion
    async with asyncio.timeout(30):  # (close is bounded itself; this guards the test)
        await feed.close()
    assert not feed.running("w")
    # the lost cancellation left the task running; it ended at its next step instead of retrying
    assert engine.calls == 1 and sleeps.delays == []
