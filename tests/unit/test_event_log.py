"""``EventLog``: a streamed background Response's events as its readers follow them."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.output.event_log import EventLog, events_after, split_events
from shepherd.node.output.responses import sse_event


def ev(i: int, text: str = "x") -> bytes:
    return sse_event("response.output_text.delta", {"sequence_number": i, "delta": text})


async def drain(log: EventLog, after: int) -> list[bytes]:
    out: list[bytes] = []
    async for batch in log.follow(after):
        out.extend(batch)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=8), st.integers(0, 30))
def test_writes_cut_anywhere_give_the_same_events(cuts: list[int], n: int) -> None:
    """However the bytes are split into writes (keep-alive comments among them), the log holds the
    events, in order, and a reader after ``k`` gets those after ``k``."""
    events = [ev(i, "é" * (i % 3)) for i in range(n)]
    data = b": keep-alive\n\n".join(events)
    log = EventLog()
    pos = 0
    for c in cuts:
        asyncio.run(log.write(data[pos : pos + c]))
        pos += c
    asyncio.run(log.write(data[pos:]))
    log.close()
    assert log.events == events == split_events(data)
    for k in (-1, 0, n // 2, n + 3):
        assert asyncio.run(drain(log, k)) == events[max(0, k + 1) :]
    assert events_after(log.stored(), n // 2 - 1) == events[max(0, n // 2) :]


def test_the_last_write_waits_for_close_and_readers_follow_live() -> None:
    async def go() -> None:
        log = EventLog()
        got: list[bytes] = []

        async def reader() -> None:
            async for batch in log.follow(0):
                got.extend(batch)

        task = asyncio.create_task(reader())
        await log.write(ev(0) + ev(1))
        for _ in range(5):  # (a few loop turns: the reader wakes and takes the batch)
            await asyncio.sleep(0)
        assert got == [ev(1)] and not task.done()  # as it comes, after sequence number 0
        await log.write_eof(ev(2))  # held: the writer stores the end before readers see it
        await asyncio.sleep(0.01)
        assert got == [ev(1)] and not task.done() and log.visible == 2 and len(log.stored()) == 3
        log.close()
        await asyncio.wait_for(task, 5)
        assert got == [ev(1), ev(2)]
        await log.write(ev(3))  # after close: nothing
        assert len(log.events) == 3

    asyncio.run(go())


def test_the_stored_log_stops_at_its_bound() -> None:
    log = EventLog(max_bytes=3 * len(ev(0)))
    for i in range(5):
        asyncio.run(log.write(ev(i)))
    assert [e.encode() for e in log.stored()] == [ev(0), ev(1), ev(2)] and log.cut
    assert len(log.events) == 5  # the live readers still get them all


def test_held_events_can_be_dropped_for_another_end() -> None:
    """The end the last write told was not stored (a failure, a cancel): its events go, unseen, and the
    log goes on from the last event readers saw."""

    async def go() -> None:
        log = EventLog()
        await log.write(ev(0) + ev(1))
        await log.write_eof(ev(2) + ev(3))
        assert len(log.stored()) == 4
        assert log.drop_held() == 2 and len(log.stored()) == 2 and log.stored_bytes == len(ev(0) + ev(1))
        await log.write(ev(2, "failed"))  # shown again at once
        assert log.visible == 3
        log.close()
        assert await drain(log, 0) == [ev(1), ev(2, "failed")]
        assert log.drop_held() == 3  # closed: nothing to drop

    asyncio.run(go())
