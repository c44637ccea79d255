"""GetLoads polls and the KV-event stream's pushed load records: a poll due within the poll interval after
the stream pushed a whole record (telemetry included) is skipped (it would say no more, and an idle node
saves a wake-up for its request and one for the answer); a partial record skips it too while the
telemetry it lacks is young (``TELEMETRY_POLLS`` intervals); without pushes every due poll asks the
engine. A worker whose policy never reads loads (round_robin, random,
manual with random assignment) is polled only while something reads them (the API, a metrics scrape):
the first read of a quiet spell polls at once, later reads keep the polls going for
``LOADS_READ_HOLD_POLLS`` intervals."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import LOADS_READ_HOLD_POLLS, TELEMETRY_POLLS, Worker, WorkerRegistry
from shepherd.node.engines.h2_stream import Deadlines, GrpcStream
from shepherd.policies.manual import Manual
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
    w.load_pushed_at = w.telemetry_at = now[0]
    now[0] += 1.9
    await reg.poll_load(w)
    assert client.calls == 1  # a whole record 1.9 s ago: skipped
    now[0] += 0.2
    await reg.poll_load(w)
    assert client.calls == 2 and w.load.running == 2  # 2.1 s: asked again


async def test_partial_records_skip_the_polls_until_the_telemetry_is_old() -> None:
    """Partial records (what a busy engine's event batches carry: every field routing reads, not the
    telemetry) skip the polls too, until the telemetry (from the last whole record or poll) is
    ``TELEMETRY_POLLS`` intervals old; without pushes every due poll asks the engine."""
    now = [100.0]
    reg = WorkerRegistry(build_config({}, {"load_poll_interval_secs": 2.0}), clock=lambda: now[0])
    client = _Loads()
    w = _worker(client)
    await reg.poll_load(w)
    assert client.calls == 1 and w.telemetry_at == 100.0  # the poll's answer has the telemetry
    asked_at = [now[0]]
    for _ in range(4 * TELEMETRY_POLLS):
        now[0] += 2.0
        w.load_pushed_at = now[0] - 0.5  # a partial record half a second ago, every interval
        calls = client.calls
        await reg.poll_load(w)
        if client.calls > calls:
            asked_at.append(now[0])
    gaps = {b - a for a, b in itertools.pairwise(asked_at)}
    assert gaps == {2.0 * TELEMETRY_POLLS}, asked_at  # once per telemetry age, not every interval
    now[0] += 2.0  # no push within the interval: asked at once
    calls = client.calls
    await reg.poll_load(w)
    assert client.calls == calls + 1


def test_the_gateway_marks_pushes_and_the_telemetry_of_whole_records() -> None:
    """The KV feed's ``on_load``: every record marks the push; one with telemetry (max_total_tokens) also
    the telemetry's age; one without merges into the last load (its telemetry kept)."""
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
    on_load(EngineLoad(running=4, max_total_tokens=500))
    assert w.load_pushed_at == w.telemetry_at == 5.0 and w.load.max_total_tokens == 500
    now[0] = 6.0
    on_load(EngineLoad(running=3))
    assert w.load_pushed_at == 6.0 and w.telemetry_at == 5.0
    assert w.load.running == 3 and w.load.max_total_tokens == 500


def _gateway(policy: str, now: list[float]) -> tuple[Gateway, Worker, _Loads]:
    gw = Gateway(build_config({}, {"policy": policy, "load_poll_interval_secs": 2.0}))
    gw.registry.clock = lambda: now[0]
    client = _Loads()
    w = _worker(client)
    gw.registry.workers[w.id] = w
    return gw, w, client


async def test_a_policy_that_never_reads_loads_is_not_polled_until_they_are_read() -> None:
    now = [100.0]
    gw, w, client = _gateway("round_robin", now)
    reg = gw.registry
    for _ in range(5):  # an idle round_robin node: no GetLoads at all
        await reg.poll_load(w)
        now[0] += 2.0
    assert client.calls == 0 and w.load.running == 0
    await reg.loads_for_reading()  # /get_loads, /workers, a scrape: polled at once, before the answer
    assert client.calls == 1 and w.load.running == 1
    await reg.loads_for_reading()  # a second read right after: no second round
    assert client.calls == 1
    now[0] += 2.0
    await reg.poll_load(w)  # the periodic polls go on while reads come
    assert client.calls == 2
    now[0] += LOADS_READ_HOLD_POLLS * 2.0  # no read for the hold: the polls stop again
    await reg.poll_load(w)
    assert client.calls == 2
    await reg.loads_for_reading()
    assert client.calls == 3 and w.load.running == 3


async def test_policies_that_route_by_load_are_polled_without_reads() -> None:
    for policy in ("least_load", "power_of_two", "cache_aware", "prefix_hash", "bucket"):
        now = [100.0]
        gw, w, client = _gateway(policy, now)
        await gw.registry.poll_load(w)
        now[0] += 2.0
        await gw.registry.poll_load(w)
        assert client.calls == 2, policy
    for policy in ("round_robin", "random"):
        gw, w, client = _gateway(policy, [100.0])
        assert gw.registry.loads_needed is not None and not gw.registry.loads_needed(w), policy


def test_manual_reads_loads_only_with_min_load_assignment() -> None:
    assert Manual("min_load").uses_loads and not Manual("random").uses_loads


async def test_a_read_waits_no_longer_than_the_health_check_timeout() -> None:
    """An engine that does not answer GetLoads: the read's poll gives up after the health-check timeout
    and the answer shows the last figures."""

    class _Hangs:
        async def loads(self) -> EngineLoad:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    gw = Gateway(build_config({}, {"policy": "round_robin", "health_check_timeout_secs": 0.05}))
    w = _worker(_Hangs())
    w.load = EngineLoad(running=7)
    gw.registry.workers[w.id] = w
    await asyncio.wait_for(gw.registry.loads_for_reading(), 5.0)
    assert w.load.running == 7


async def test_the_poll_loop_sleeps_while_no_worker_is_polled() -> None:
    """An idle round_robin node: the poll loop does not wake every interval to skip its polls; a read of
    the loads wakes it and the periodic polls follow."""
    gw = Gateway(build_config({}, {"policy": "round_robin", "load_poll_interval_secs": 0.02}))
    client = _Loads()
    w = _worker(client)
    gw.registry.workers[w.id] = w
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def counted(delay: float, *a: Any) -> Any:
        sleeps.append(delay)
        return await real_sleep(delay, *a)

    asyncio.sleep = counted  # type: ignore[assignment]
    task = asyncio.create_task(gw.registry._poll_loads())
    try:
        await real_sleep(0.3)
        assert client.calls == 0 and sleeps == []  # asleep on the read event, not on 0.02 s timers
        await gw.registry.loads_for_reading()
        assert client.calls == 1
        for _ in range(200):  # bounded: the periodic polls resume
            if client.calls >= 3:
                break
            await real_sleep(0.02)
        assert client.calls >= 3 and sleeps
    finally:
        asyncio.sleep = real_sleep
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _timer_of(d: Deadlines) -> object:
    return d._timer


def test_the_deadline_timer_goes_when_the_last_call_ends() -> None:
    """``Deadlines``: the shared timer is cancelled once no call is left (no wake-up for nothing)."""
    loop = asyncio.new_event_loop()
    try:
        d = Deadlines(loop, 5.0)
        a, b = GrpcStream(loop), GrpcStream(loop)
        d.add(a)
        d.add(b)
        timer = d._timer
        assert timer is not None
        d.discard(a)
        assert d._timer is timer and not timer.cancelled()  # b still has its deadline
        d.discard(b)
        assert timer.cancelled() and _timer_of(d) is None
    finally:
        loop.close()


async def test_a_policy_reload_to_one_that_reads_loads_starts_the_polls_at_once() -> None:
    from shepherd.policies.load import LeastLoad  # not at the top: only this test

    gw = Gateway(build_config({}, {"policy": "round_robin", "load_poll_interval_secs": 0.02}))
    client = _Loads()
    w = _worker(client)
    gw.registry.workers[w.id] = w
    task = asyncio.create_task(gw.registry._poll_loads())
    try:
        await asyncio.sleep(0.2)
        assert client.calls == 0  # asleep: round_robin reads no loads
        gw.set_policy("m", LeastLoad())
        for _ in range(200):  # bounded: polled within a poll interval or so, not 30 s
            if client.calls:
                break
            await asyncio.sleep(0.01)
        assert client.calls >= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_adding_a_worker_wakes_the_sleeping_poll_loop() -> None:
    """A node whose poll loop sleeps (no worker read loads) gets a worker, maybe of a model routed by load:
    the loop looks again at once, not at its 30 s recheck."""
    gw = Gateway(build_config({}, {"policy": "round_robin", "health_check_timeout_secs": 0.5}))
    reg = gw.registry
    reg._loads_wanted.clear()
    try:
        await reg.add("grpc://127.0.0.1:1", "m")  # (nothing listens there: its first check fails fast)
        assert reg._loads_wanted.is_set()
    finally:
        await reg.close()
