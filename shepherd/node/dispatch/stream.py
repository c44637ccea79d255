"""An open engine stream: what dispatch hands the API's generation loop, and its close/abort rule."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shepherd.node.dispatch.workers import Worker
from shepherd.node.observe.tracing import EngineCall
from shepherd.proto.engine_types import EngineEvent

__all__ = ["Aborter", "Batches", "EngineStream"]


class Batches(Protocol):
    """What an engine client's ``generate_batches`` returns, as the gateway uses it."""

    def __anext__(self) -> Awaitable[list[EngineEvent]]: ...

    def aclose(self) -> Awaitable[None]: ...


class Aborter(Protocol):
    """Who aborts an engine request that is no longer wanted (the gateway), without waiting for it."""

    def abort_in_background(self, w: Worker, request_id: str, reason: str) -> None: ...


@dataclass(slots=True)
class Retry:
    """One request's tries across ``Gateway.open_stream`` calls: the workers that failed it and the
    attempts made (a whole answer whose engine failed after its first token is asked again from the
    start on another worker: ``Gateway.retry_midway``); every attempt counts against ``max_retries``."""

    tried: set[str] = field(default_factory=set)
    attempt: int = 0


@dataclass(slots=True)
class EngineStream:
    """An open Generate stream on one worker, handed from dispatch to the generation loop.

    Invariants: the worker's ``in_flight`` was raised when the stream opened and is lowered exactly once,
    by the first ``close()``; a stream that did not reach its ``EngineComplete`` (``completed`` False)
    is aborted on the engine by ``close()`` (in the background), so no engine request outlives its
    client; ``close()`` is idempotent. ``batches()`` iterates the stream itself: the first batch
    (already received, so a failure before the first token could still be retried elsewhere), then
    the engine's."""

    gateway: Aborter
    worker: Worker
    request_id: str
    agen: Batches
    first: list[EngineEvent] | None
    completed: bool = False
    closed: bool = False
    on_close: Callable[[], None] | None = None  # e.g. PD: the prefill half goes with the decode half
    trace: EngineCall | None = None  # the engine call's CLIENT span (tracing on), ended by close()

    def batches(self) -> EngineStream:
        return self

    def __aiter__(self) -> EngineStream:
        return self

    def __anext__(self) -> Awaitable[list[EngineEvent]]:
        first = self.first
        if first is None:
            return self.agen.__anext__()  # the engine's own awaitable: no wrapper per batch
        self.first = None
        return _Ready(first)

    async def close(self, reason: str = "cancelled") -> None:
        if self.closed:
            return
        self.closed = True
        self.worker.in_flight -= 1
        if self.on_close is not None:
            self.on_close()
        if not self.completed:
            self.gateway.abort_in_background(self.worker, self.request_id, reason)
        if self.trace is not None:
            self.trace.end(None if self.completed else reason)
        try:  # noqa: SIM105 - cheaper than contextlib.suppress, on every request
            await self.agen.aclose()
        except Exception:
            pass


class _Ready:
    """An awaitable that is already done (the first batch, received before the stream was handed on)."""

    __slots__ = ("value",)

    def __init__(self, value: list[EngineEvent]) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, list[EngineEvent]]:
        yield from ()
        return self.value
