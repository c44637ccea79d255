"""A removed worker leaves routing at once and its client closes once the requests it serves have ended
(a rolling update: remove the worker, then stop its engine; the streams in flight there finish), at
most ``request_timeout_secs`` later; the registry's close closes it at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import Worker, WorkerRegistry
from shepherd.node.metrics import NodeMetrics


class _Client:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


def _registry(timeout: float = 600.0) -> tuple[WorkerRegistry, Worker, _Client]:
    reg = WorkerRegistry(build_config({}, {"request_timeout_secs": timeout}))
    client = _Client()
    w = Worker("w0", "grpc://127.0.0.1:1", "m", client, HealthTracker(), CircuitBreaker())  # type: ignore[arg-type]
    reg.workers[w.id] = w
    return reg, w, client


async def _until(cond: object, what: str) -> None:
    for _ in range(200):
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_an_idle_worker_closes_at_once() -> None:
    reg, w, client = _registry()
    assert await reg.remove(w.id) is w
    assert client.closed == 1 and reg.retiring == 0 and w.id not in reg.workers


async def test_a_busy_worker_leaves_routing_and_closes_when_its_requests_end() -> None:
    reg, w, client = _registry()
    w.in_flight = 2
    await reg.remove(w.id)
    assert w.id not in reg.workers  # no new request goes there
    await asyncio.sleep(0.5)
    assert client.closed == 0 and reg.retiring == 1  # the streams in flight go on
    w.in_flight = 0
    await _until(lambda: client.closed == 1, "closed once its requests ended")
    await _until(lambda: reg.retiring == 0, "forgotten")
    await reg.close()
    assert client.closed == 1


async def test_a_stuck_request_keeps_it_at_most_the_request_timeout() -> None:
    reg, w, client = _registry(timeout=0.3)
    w.in_flight = 1
    await reg.remove(w.id)
    await _until(lambda: client.closed == 1, "closed at the request timeout")


async def test_closing_the_registry_closes_a_retiring_client() -> None:
    reg, w, client = _registry()
    w.in_flight = 1
    await reg.remove(w.id)
    await reg.close()
    assert client.closed == 1 and reg.retiring == 0


class _AbortingClient(_Client):
    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[str] = []
        self.gate = asyncio.Event()

    async def abort(self, request_id: str, reason: str) -> None:
        await self.gate.wait()
        assert not self.closed, "aborted on a closed client"
        self.aborts.append(request_id)


async def test_a_removed_workers_last_abort_goes_out_before_its_client_closes() -> None:
    """A stream closed on a removed worker aborts its engine request in the background: the client
    stays open until that Abort is sent (it counts as the worker's work in flight)."""
    reg = WorkerRegistry(build_config({}, {}))
    client = _AbortingClient()
    w = Worker("w0", "grpc://127.0.0.1:1", "m", client, HealthTracker(), CircuitBreaker())  # type: ignore[arg-type]
    reg.workers[w.id] = w
    w.in_flight = 1
    tasks: set[asyncio.Task[None]] = set()
    gw = SimpleNamespace(metrics=NodeMetrics(), spawn=lambda c: tasks.add(asyncio.create_task(c)))
    await reg.remove(w.id)
    w.in_flight -= 1  # the stream closes (EngineStream.close), then its Abort goes in the background
    Gateway.abort_in_background(gw, w, "req-1", "client_disconnect")  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    assert client.closed == 0  # the Abort is still on its way
    client.gate.set()
    await _until(lambda: client.closed == 1, "closed after its Abort")
    assert client.aborts == ["req-1"] and w.in_flight == 0
