"""The workers' health checks and load polls on another component's wake-ups (``ride_rounds``, what a
meshed node does: its runtime's probes and acks drive them): no timer of their own, a round started
by ``run_due_rounds`` when due within ``early`` seconds, one round of a kind at a time, the same
periods as the timers'; and the end-to-end shape: a meshed node's rounds ride on the mesh's wake-ups
and still mark a dead engine unhealthy."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.workers import Worker, WorkerRegistry
from shepherd.proto.engine_types import EngineLoad
from tests.unit.mesh_fixtures import eventually, two_mesh_nodes


class _Engine:
    """An engine client that counts health checks and GetLoads; ``healthy`` sets the checks' answer and
    ``hold`` keeps calls in flight until set."""

    def __init__(self) -> None:
        self.checks = 0
        self.polls = 0
        self.healthy = True
        self.hold: asyncio.Event | None = None
        self.confirms: list[float] = []  # confirm_alive's timeouts (asked when the worker turns unhealthy)

    async def health_check(self, timeout: float) -> bool:
        self.checks += 1
        if self.hold is not None:
            await self.hold.wait()
        return self.healthy

    async def loads(self) -> EngineLoad:
        self.polls += 1
        return EngineLoad(running=self.polls, max_total_tokens=1000)

    def confirm_alive(self, timeout: float) -> None:
        self.confirms.append(timeout)

    async def close(self) -> None:
        pass


def _worker(eng: _Engine) -> Worker:
    w = Worker("w0", "grpc://127.0.0.1:1", "m", eng, HealthTracker(), CircuitBreaker())  # type: ignore[arg-type]
    w.initialized = True
    w.health.observe(True)
    return w


def _registry(
    now: list[float], health: float = 5.0, polls: float = 2.0
) -> tuple[WorkerRegistry, _Engine, Worker]:
    cfg = build_config({}, {"health_check_interval_secs": health, "load_poll_interval_secs": polls})
    reg = WorkerRegistry(cfg, clock=lambda: now[0])
    eng = _Engine()
    w = _worker(eng)
    reg.workers[w.id] = w
    return reg, eng, w


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_ridden_rounds_run_only_when_due_and_stop_their_own_timers() -> None:
    now = [100.0]
    reg, eng, _ = _registry(now)
    reg.start()
    assert len(reg._tasks) == 2  # the timers' loops
    reg.ride_rounds()
    assert reg._tasks == []  # handed over: no timer of their own
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (0, 0)  # nothing due yet
    now[0] += 1.6  # the poll (2 s) due within 0.45 s: started early, on this wake-up
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (0, 1)
    now[0] += 0.3
    reg.run_due_rounds(0.45)
    await _settle()
    assert eng.polls == 1  # the next one is 2 s after the last
    now[0] = 104.6  # 4.6 s: the check (5 s) within 0.45 s, the second poll (3.6 s) due
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (1, 2)
    now[0] = 104.7
    reg.run_due_rounds(0.0)
    await _settle()
    assert (eng.checks, eng.polls) == (1, 2)
    reg.own_rounds()  # handed back (the mesh closed while the node drains): the timers run again
    assert len(reg._tasks) == 2
    now[0] = 200.0
    reg.run_due_rounds()
    await _settle()
    assert (eng.checks, eng.polls) == (1, 2)  # no longer ridden: nothing started from outside
    await reg.close()
    assert reg._tasks == []


async def test_one_round_of_a_kind_at_a_time_and_close_cancels_it() -> None:
    now = [0.0]
    reg, eng, _ = _registry(now)
    reg.start()
    reg.ride_rounds()
    eng.hold = asyncio.Event()
    now[0] = 5.0
    reg.run_due_rounds()
    await _settle()
    assert eng.checks == 1
    now[0] = 11.0  # due again while the first check still waits on the engine: not a second round
    reg.run_due_rounds()
    await _settle()
    assert eng.checks == 1
    eng.hold.set()
    await _settle()
    reg.run_due_rounds()
    await _settle()
    assert eng.checks == 1  # the first ended at 11 s: the next is due an interval later, not at once
    now[0] = 16.0
    reg.run_due_rounds()
    await _settle()
    assert eng.checks == 2
    eng.hold = asyncio.Event()
    now[0] = 21.0
    reg.run_due_rounds()
    await _settle()
    assert eng.checks == 3 and reg._round_tasks
    await reg.close()  # the round in flight is cancelled, not left running
    assert not reg._round_tasks


async def test_a_ridden_load_round_polls_only_the_workers_whose_poll_is_due() -> None:
    now = [0.0]
    reg, eng, w = _registry(now, health=1000.0)
    other_eng = _Engine()
    other = _worker(other_eng)
    other.id = "w1"
    reg.workers[other.id] = other
    reg.start()
    reg.ride_rounds()
    now[0] = 2.0
    w.load_pushed_at = w.telemetry_at = 1.5  # w's KV-event stream pushed a whole load record: no poll
    reg.run_due_rounds()
    assert "loads" in reg._round_tasks  # the other's poll is due: a round, of it alone
    await _settle()
    assert (eng.polls, other_eng.polls) == (0, 1)
    now[0] = 4.1
    w.load_pushed_at = w.telemetry_at = 3.9
    other.load_pushed_at = other.telemetry_at = 3.9  # both streams push: no round, no task at all
    reg.run_due_rounds()
    assert "loads" not in reg._round_tasks
    await _settle()
    assert (eng.polls, other_eng.polls) == (0, 1)
    now[0] = 6.2  # due again 2 s on: still pushed within the interval, still nothing
    w.load_pushed_at = other.load_pushed_at = 6.0
    reg.run_due_rounds()
    assert "loads" not in reg._round_tasks
    now[0] = 30.0  # the streams went quiet: both polled again
    reg.run_due_rounds()
    await _settle()
    assert (eng.polls, other_eng.polls) == (1, 2)
    await reg.close()


async def test_ridden_checks_mark_a_failing_engine_unhealthy() -> None:
    now = [0.0]
    reg, eng, w = _registry(now)
    changes: list[bool] = []
    reg.on_health_change = lambda wk: changes.append(wk.health.healthy)
    reg.start()
    reg.ride_rounds()
    eng.healthy = False
    for i in range(1, 8):
        now[0] = 5.0 * i
        reg.run_due_rounds()
        await _settle()
        if not w.health.healthy:
            break
    assert not w.health.healthy and changes == [False]
    assert eng.confirms == [reg.cfg.health_check_timeout_secs]  # once, on the turn to unhealthy
    await reg.close()


async def test_no_load_round_while_no_worker_is_polled_and_none_without_riding() -> None:
    now = [0.0]
    reg, eng, _ = _registry(now)
    reg.run_due_rounds()  # not ridden: the timers' loops own the rounds, nothing here
    now[0] = 50.0
    reg.run_due_rounds()
    await _settle()
    assert (eng.checks, eng.polls) == (0, 0)
    reg.loads_needed = lambda w: False  # round_robin: nothing routes by the loads, nothing read them
    reg.start()
    reg.ride_rounds()
    now[0] = 60.0
    reg.run_due_rounds()
    await _settle()
    assert (eng.checks, eng.polls) == (1, 0)
    await reg.close()


async def test_the_early_start_is_at_most_a_quarter_of_the_interval() -> None:
    """Intervals shorter than the caller's slack: a round starts at most a quarter of its interval early,
    not on every wake-up; and not before the registry is started."""
    now = [0.0]
    reg, eng, _ = _registry(now, 0.4, 0.4)
    reg.ride_rounds()
    now[0] = 5.0
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (0, 0)  # not started: nothing
    reg.start()
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (1, 1)  # overdue: at once; the next 0.4 s after these ended
    now[0] = 5.2
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (1, 1)  # 0.2 s before due: more than a quarter early
    now[0] = 5.32
    reg.run_due_rounds(0.45)
    await _settle()
    assert (eng.checks, eng.polls) == (2, 2)  # 0.08 s before: within a quarter
    await reg.close()


async def test_a_meshed_node_rides_its_rounds_on_the_mesh(tmp_path: Path) -> None:
    """Two meshed nodes in this process: their registries' rounds run on the mesh runtime's wake-ups
    (no timers of their own), and an engine that stops answering health checks is marked unhealthy."""
    extra: dict[str, object] = {"health_check_interval_secs": 0.3, "load_poll_interval_secs": 0.3}
    async with two_mesh_nodes(tmp_path, "m", extra=extra) as (gw_a, a, gw_b, _):
        for gw in (gw_a, gw_b):
            gw.registry.start()  # (the app starts its gateway first: here after the mesh, the same)
            assert gw.registry._ridden and gw.registry._tasks == []  # no timers of their own
        eng = _Engine()
        w = _worker(eng)
        gw_a.registry.workers[w.id] = w
        await eventually(lambda: eng.checks >= 2 and eng.polls >= 2, 10.0, "checks and polls on the mesh")
        eng.healthy = False
        await eventually(lambda: not w.health.healthy, 10.0, "the failing engine marked unhealthy")
        await a.close()  # the mesh closes, the node may drain on: the rounds are back on their timers
        assert not gw_a.registry._ridden and len(gw_a.registry._tasks) == 2
