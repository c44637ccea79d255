"""KV events as SMG's SGLang servicer streams them, over real gRPC into the node's KV feed.

Read from lightseekorg/smg grpc_servicer/smg_grpc_servicer/sglang/servicer.py (SubscribeKvEvents:
live events only, ``start_sequence_number`` never read, numbered by the ZMQ publisher's own counter,
no load records; ``_convert_kv_event``: one BlockStored per page, chained by ``parent_block_hash``;
SGLang's default page size is 1). The node's client (``H2EngineClient``) subscribes to the replay
server and its ``KvFeed`` fills a prefix index: what the index holds is what routing would use (the
feed has no HTTP surface of its own, so the test reads the index).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shepherd.node.dispatch.kv_feed import KvFeed, WorkerKvState
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_protocol import LazyReads
from shepherd.policies.prefix_index import PrefixIndex
from tests.contract.nodes import replay
from tests.contract.replay import EngineFacts, ReplayServer, kv_batch, kv_pages_stored, kv_removed

A = list(range(40, 72))  # 32 tokens: two index blocks
B = list(range(100, 116))
C = list(range(140, 156))
D = list(range(180, 196))


def pages(tokens: list[int], first_hash: int, parent: int | None) -> list[Any]:
    """SGLang with page size 1: one stored event per token, each chained to the one before."""
    out = []
    for i, t in enumerate(tokens):
        out.append(kv_pages_stored([first_hash + i], parent if i == 0 else first_hash + i - 1, [t], 1))
    return out


@pytest.fixture
def engine() -> Iterator[ReplayServer]:
    with replay("sglang-smg", EngineFacts(page_size=1)) as s:
        yield s


async def _until(cond: Any, what: str) -> None:
    for _ in range(400):  # bounded: 20 s
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_page_size_1_live_only_stream_with_gaps(engine: ReplayServer) -> None:
    starts: list[int] = []

    def script(req: Any) -> list[Any]:
        starts.append(req.start_sequence_number)
        if len(starts) == 1:
            # the publisher's counter is where it is (500), then 502 is lost on the way
            return [
                kv_batch(500, *pages(A[:16], 1000, None)),
                kv_batch(501, *pages(A[16:], 1016, 1015)),
                kv_batch(503, *pages(B, 2000, None)),
            ]
        # asked to start at 502: the servicer streams live events only
        return [
            kv_batch(504, *pages(C, 3000, None)),
            kv_batch(507, *pages(D, 4000, None)),
            kv_batch(508, kv_removed([1031])),
        ]

    engine.kv_script = script
    client = H2EngineClient(engine.url, f"127.0.0.1:{engine.port}", "sglang")
    ix = PrefixIndex()
    feed = KvFeed()
    state = feed.start("w", client, ix)
    try:
        await _until(lambda: state.cursor.last == 508, "the last batch")
        # page-size-1 events were gathered into 16-token blocks; the lost batch (B) is missing, but
        # what came before the gap stands: no reset for a gap the engine cannot replay
        assert ix.match(C) == {"w": 16} and ix.match(D) == {"w": 16}
        assert ix.match(B) == {}
        # the page that completed A's second block was evicted: that block is no longer whole
        assert ix.match(A) == {"w": 16}
        assert state.cursor.resets == 0
        assert starts == [1, 502]  # one resubscription; the next gap (507) taken in stride
        assert state.cursor.lost == 2
    finally:
        await feed.close()
        await client.close()


def _paced(batches: list[Any], gap_s: float) -> Iterator[Any]:
    """The batches one by one, ``gap_s`` apart (the servicer's thread sleeps between them)."""
    for i, b in enumerate(batches):
        if i:
            time.sleep(gap_s)
        yield b


def _lazy_feed(engine: ReplayServer) -> tuple[H2EngineClient, PrefixIndex, KvFeed, LazyReads, WorkerKvState]:
    """A client of ``engine`` and a feed that reads its stream lazily (as a meshed node's), started."""
    client = H2EngineClient(engine.url, f"127.0.0.1:{engine.port}", "sglang")
    ix = PrefixIndex()
    feed = KvFeed()
    feed.read_lazily()
    lazy = feed.lazy_reads
    assert lazy is not None
    return client, ix, feed, lazy, feed.start("w", client, ix)


async def test_lazy_reads_deliver_a_stream_on_polls_over_its_own_connection(engine: ReplayServer) -> None:
    blocks = [list(range(1000 + 16 * i, 1016 + 16 * i)) for i in range(4)]
    engine.kv_script = lambda _req: _paced(  # type: ignore[assignment,return-value]
        [kv_batch(10 + i, *pages(b, 5000 + 100 * i, None)) for i, b in enumerate(blocks)], 0.1
    )
    client, ix, feed, lazy, state = _lazy_feed(engine)
    try:
        await _until(lambda: len(lazy) == 1, "the stream's connection")
        await asyncio.sleep(0.6)  # every batch sent by now; nothing read without a poll, not even SETTINGS
        assert state.cursor.last == 0 and lazy.reads == 0
        for _ in range(100):  # bounded: polls until the last batch is in (the mesh's tick does this)
            feed.poll()
            if state.cursor.last == 13:
                break
            await asyncio.sleep(0.05)
        assert state.cursor.last == 13
        assert all(ix.match(b) == {"w": 16} for b in blocks)
        side = client._kv_side
        assert side is not None and side._proto is not None
        assert side._proto is not client._proto  # generation calls keep their own, read at once
        reads = lazy.reads
        await asyncio.sleep(0.3)
        assert lazy.reads == reads  # no poll, no read
    finally:
        await feed.close()
        await client.close()
    assert len(lazy) == 0  # closed with the client


async def test_without_lazy_reads_the_stream_shares_the_clients_connection(engine: ReplayServer) -> None:
    engine.kv_script = lambda _req: _paced([kv_batch(1, *pages(A[:16], 1, None))], 0.0)  # type: ignore[assignment,return-value]
    client = H2EngineClient(engine.url, f"127.0.0.1:{engine.port}", "sglang")
    ix = PrefixIndex()
    feed = KvFeed()
    state = feed.start("w", client, ix)
    try:
        await _until(lambda: state.cursor.last == 1, "the batch, read as it arrives")
        assert client._kv_side is None and client.connects == 1
    finally:
        await feed.close()
        await client.close()


async def test_a_poll_applies_what_it_reads_before_it_returns(engine: ReplayServer) -> None:
    """The H2 client hands each record to the feed from the connection's frame loop (``kv_events_pushed``):
    what a poll reads is in the index when the poll returns, with no task step in between (so a routing
    decision's ``poll_fresh`` routes on it)."""
    blocks = [list(range(3000 + 16 * i, 3016 + 16 * i)) for i in range(3)]

    sent = threading.Event()

    def later(_req: Any) -> Iterator[Any]:
        time.sleep(0.3)  # after the call is open and polled: the batches wait in the socket for a poll
        yield from [kv_batch(20 + i, *pages(b, 7000 + 100 * i, None)) for i, b in enumerate(blocks)]
        sent.set()

    engine.kv_script = later  # type: ignore[assignment]
    client, ix, feed, lazy, state = _lazy_feed(engine)
    try:
        await _until(lambda: len(lazy) == 1, "the stream's connection")
        for _ in range(100):  # bounded: polls until the call is sent (the engine answers 0.3 s later)
            feed.poll()
            side = client._kv_side
            if side is not None and side._proto is not None and side._proto.conn.streams:
                break
            await asyncio.sleep(0.05)
        assert state.cursor.last == 0
        assert side is not None and side._proto is not None and side._proto.transport is not None
        sock = side._proto.transport.get_extra_info("socket")
        queued = -1
        for _ in range(200):  # bounded: until every batch is sent and waits, unread, in the socket
            await asyncio.sleep(0.05)
            n = len(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)) if sent.is_set() else 0
            if n and n == queued:
                break
            queued = n
        assert sent.is_set() and queued > 0 and state.cursor.last == 0
        feed.poll()  # no await after it: applied within the poll itself
        assert state.cursor.last == 22
        assert all(ix.match(b) == {"w": 16} for b in blocks)
    finally:
        await feed.close()
        await client.close()


async def test_pushed_records_end_the_call_on_a_consumers_error_or_a_stop(engine: ReplayServer) -> None:
    """``kv_events_pushed``: what ``on_batch`` raises ends the call and is raised to the caller (not into
    the frame loop); False from it ends the call quietly; either way the engine's stream is cancelled."""
    engine.kv_script = lambda _req: _paced(  # type: ignore[assignment,return-value]
        [kv_batch(30 + i, *pages(B, 8000 + 100 * i, None)) for i in range(5)], 0.05
    )
    client = H2EngineClient(engine.url, f"127.0.0.1:{engine.port}", "sglang")
    seen: list[int] = []

    def boom(batch: Any) -> bool:
        seen.append(batch.sequence_number)
        if len(seen) == 2:
            raise ValueError("the consumer's bug")
        return True

    def stop_at_two(batch: Any) -> bool:
        seen.append(batch.sequence_number)
        return len(seen) < 2

    try:
        with pytest.raises(ValueError, match="consumer's bug"):
            await asyncio.wait_for(client.kv_events_pushed(0, boom), 10.0)
        assert seen == [30, 31]
        seen.clear()
        await asyncio.wait_for(client.kv_events_pushed(0, stop_at_two), 10.0)
        assert seen == [30, 31]
        proto = client._proto
        assert proto is not None
        await _until(lambda: not proto.conn.streams, "the calls cancelled")
    finally:
        await client.close()


async def test_an_engine_without_the_stream_stops_the_pushed_feed(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's entrypoint servicer has no SubscribeKvEvents: grpc answers UNIMPLEMENTED, which the pushed
    path raises as the iterator did, and the feed says so once and stops (no resubscription loop)."""
    with replay("vllm-entrypoint") as vllm:
        client = H2EngineClient(vllm.url, f"127.0.0.1:{vllm.port}", "vllm")
        feed = KvFeed()
        try:
            with caplog.at_level("INFO", logger="shepherd.kv_feed"):
                state = feed.start("w", client, PrefixIndex())
                await _until(lambda: not feed.running("w"), "the feed's task to end")
            assert "does not serve SubscribeKvEvents" in caplog.text
            assert state.stats.subscriptions == 1 and state.stats.failures == 0
        finally:
            await feed.close()
            await client.close()
