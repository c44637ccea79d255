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
from collections.abc import Iterator
from typing import Any

import pytest

from shepherd.node.dispatch.kv_feed import KvFeed
from shepherd.node.engines.h2 import H2EngineClient
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
