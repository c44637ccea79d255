"""GetLoads polls and the KV-event stream's pushed load records: a poll due within the poll interval after
the stream pushed a whole record (telemetry included) is skipped (it would say no more, and an idle node
saves a wake-up for its request and one for the answer); a partial record does not skip it; without
pushes every due poll asks the engine."""

from __future__ import annotations

from typing import Any

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import Worker, WorkerRegistry
from shepherd.proto.engine_types import EngineLoad


class _Loads:
    """An engine client that answers GetLoads and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def loads(self) -> EngineLoad:
        self.calls += 1
        return EngineLoad(running=self.calls, max_total_tokens=1000)


def _worker(client: Any) -> Worker:
    w = Worker("w0", "grpc://127.0.0.1:1", "m", client, HealthTracker(), CircuitBreaker())
    w.initialized = True
    w.health.observe(True)
    return w


async def test_a_poll_after_a_whole_pushed_load_record_is_skipped() -> None:
    now = [100.0]
    reg = WorkerRegistry(build_config({}, {"load_poll_interval_secs": 2.0}), clock=lambda: now[0])
    client = _Loads()
    w = _worker(client)
    await reg.poll_load(w)
    assert client.calls == 1 and w.load.running == 1  # no push yet: asked
    w.load_pushed_at = now[0]
    now[0] += 1.9
    await reg.poll_load(w)
    assert client.calls == 1  # a whole record 1.9 s ago: skipped
    now[0] += 0.2
    await reg.poll_load(w)
    assert client.calls == 2 and w.load.running == 2  # 2.1 s: asked again


def test_the_gateway_marks_only_whole_pushed_records() -> None:
    """The KV feed's ``on_load``: a record with telemetry (max_total_tokens) marks the push; one without
    merges into the last load and leaves the polls on."""
    now = [5.0]
    gw = Gateway(build_config({}, {"policy": "cache_aware"}))
    gw.registry.clock = lambda: now[0]
    w = _worker(_Loads())
    captured: list[Any] = []

    def start(worker: str, client: Any, index: Any, on_load: Any) -> None:
        captured.append(on_load)

    gw.kv_feed.start = start  # type: ignore[method-assign,assignment]
    gw._worker_added(w)
    assert captured, "a cache-aware gRPC worker gets a KV feed"
    on_load = captured[0]
    on_load(EngineLoad(running=3))
    assert w.load_pushed_at == float("-inf") and w.load.running == 3
    on_load(EngineLoad(running=4, max_total_tokens=500))
    assert w.load_pushed_at == 5.0 and w.load.max_total_tokens == 500
