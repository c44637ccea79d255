"""A list of prompts (``/v1/completions``): the engine calls of the prompts not driven to their end are
all closed, whatever stopped the answer; a prompt that fails cancels its siblings without calling that
a client disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any, cast

import pytest

from shepherd.node.api import generation as gen_mod
from shepherd.node.api.generation import Generation, Job, _close_opened
from shepherd.node.dispatch.stream import EngineStream
from shepherd.proto.engine_types import EngineError


class FakeStream:
    def __init__(self) -> None:
        self.closed = False
        self.completed: bool | None = None
        self.reason: str | None = None
        self.trace = None

    async def close(self, reason: str = "cancelled") -> None:
        if not self.closed:
            self.closed = True
            self.reason = reason
            await asyncio.sleep(0.01)  # (an engine stream's close awaits its aclose)


def test_every_opened_stream_is_closed_and_no_failure_left_unretrieved() -> None:
    async def main() -> None:
        done, late = FakeStream(), FakeStream()
        spawned: list[asyncio.Task[Any]] = []

        def spawn(coro: Coroutine[Any, Any, Any]) -> None:
            spawned.append(asyncio.ensure_future(coro))

        async def opened(es: FakeStream) -> FakeStream:
            return es

        async def failing() -> FakeStream:
            raise EngineError("no worker", retryable=False)

        async def winding_down() -> FakeStream:  # an opening that completes although cancelled
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)
            return late

        async def hanging() -> FakeStream:
            await asyncio.sleep(10)
            return FakeStream()

        futs = [asyncio.ensure_future(c) for c in (opened(done), failing(), winding_down(), hanging())]
        await asyncio.sleep(0)
        _close_opened(cast(list[asyncio.Future[EngineStream]], futs), spawn)
        for _ in range(100):  # bounded
            if late.closed and all(t.done() for t in spawned) and all(f.done() for f in futs):
                break
            await asyncio.sleep(0.01)
        assert done.closed and late.closed and (done.reason, late.reason) == ("cancelled", "cancelled")
        assert futs[3].cancelled()
        assert all(t.done() for t in spawned)

    loop = asyncio.new_event_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    import gc

    gc.collect()
    assert not unretrieved


def test_a_failing_prompt_cancels_its_siblings_without_calling_it_a_disconnect() -> None:
    g = object.__new__(Generation)
    streams: dict[int, FakeStream] = {}
    jobs = [Job([1, 2], "", [], 0), Job([3, 4], "", [], 1)]

    async def open_(job: Job, i: int, stream: bool, max_new: int | None = None, retry: Any = None) -> Any:
        es = streams[i] = FakeStream()
        return es

    async def drive(es: Any, job: Job, emit: Any) -> None:
        if job is jobs[0]:
            await asyncio.sleep(0.01)
            raise EngineError("boom", retryable=False)
        await asyncio.sleep(10)

    g.gw = cast(
        Any, SimpleNamespace(check_context=lambda m, n, t, *fields: 16, retry_midway=lambda *a: False)
    )
    g.model, g.engine_seconds, g.context_param = "m", 0.0, ("messages", "max_tokens")
    g.s = cast(Any, SimpleNamespace(stop=None, max_tokens=None))
    g.request = cast(Any, SimpleNamespace(headers={}))
    g.totals = gen_mod.Totals()
    g._open = open_  # type: ignore[method-assign]
    g._drive = drive  # type: ignore[method-assign,assignment]
    g._account = lambda job: None  # type: ignore[method-assign]
    with pytest.raises(EngineError):
        asyncio.run(g.collect(jobs))
    assert streams[1].closed and streams[1].reason == "cancelled"
