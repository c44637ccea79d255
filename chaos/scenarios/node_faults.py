"""Faults on nodes behind the load balancer: crash and restart, pauses, rolling restart, a node joining."""

from __future__ import annotations

import time

from chaos.fleet import Fleet, FleetSpec
from chaos.report import ScenarioResult
from chaos.scenarios.base import Traffic, scenario

BASELINE_S = 3.0


@scenario(
    "node_crash",
    "a node is killed (SIGKILL) under load and restarted",
    short=True,
    must_hold="through the LB, a client with one retry loses no request",
)
def node_crash(fleet: Fleet, result: ScenarioResult) -> None:
    victim = fleet.node(1)
    with Traffic(fleet, result) as tr:
        tr.sleep(BASELINE_S)
        slow = tr.baseline_slow_s(time.monotonic())
        fault_at = fleet.crash_node(victim)
        down = fleet.wait_lb(victim.name, up=False, timeout=15.0)
        tr.sleep(2.0)
        restart_at = time.monotonic()
        fleet.start_node(victim)
        ready_s = round(time.monotonic() - restart_at, 2)
        up = fleet.wait_lb(victim.name, up=True, timeout=20.0)
        served_before = _served(fleet, victim.name)
        tr.sleep(2.0)
    t = result.traffic
    assert t is not None
    result.figures.update(
        lb_marked_down_s=tr.monitor.first(victim.name, up=False, after=fault_at) or down,
        restart_until_ready_s=ready_s,
        lb_marked_up_after_ready_s=up,
        routed_around_s=tr.routed_around(fault_at, slow, until=restart_at),
        requests_to_victim_after_restart=tr.requests_to(victim.name) - served_before,
    )
    result.check("the LB marked the crashed node down", down is not None, f"after {down} s")
    result.check("the LB took the restarted node back", up is not None, f"{up} s after it was ready")
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")
    result.check("the restarted node serves again", tr.requests_to(victim.name) > served_before)


def _served(fleet: Fleet, name: str) -> int:
    """Requests HAProxy has sent to server ``name`` so far."""
    st = fleet.lb_stats().get(name)
    return st.sessions_total if st is not None else 0


def _pause(fleet: Fleet, result: ScenarioResult, seconds: float) -> None:
    victim = fleet.node(1)
    assert fleet.lb_cfg is not None
    check_timeout = fleet.lb_cfg.health_check_timeout_s
    with Traffic(fleet, result) as tr:
        tr.sleep(BASELINE_S)
        slow = tr.baseline_slow_s(time.monotonic())
        fault_at = fleet.pause(victim)
        try:
            tr.sleep(seconds)
        finally:
            fleet.resume(victim)
        resumed_at = time.monotonic()
        back = fleet.wait_lb(victim.name, up=True, timeout=20.0)
        tr.sleep(2.0)
    t = result.traffic
    assert t is not None
    went_down = tr.monitor.first(victim.name, up=False, after=fault_at)
    result.figures.update(
        pause_s=seconds,
        lb_health_check_timeout_s=check_timeout,
        lb_marked_down_s=went_down,
        lb_up_after_resume_s=back,
        routed_around_s=tr.routed_around(fault_at, slow, until=resumed_at),
        first_attempt_failures=sum(t.first_errors.values()),
    )
    if seconds < check_timeout:
        result.check(
            "a pause shorter than the health-check timeout fails no request (not even a first attempt)",
            t.failed == 0 and not t.first_errors,
            f"failed {t.failed}, first attempts failed {t.first_errors}",
        )
        result.check("the LB did not mark the paused node down", went_down is None, f"down after {went_down}")
    else:
        result.check("the LB marked the paused node down", went_down is not None, f"after {went_down} s")
        result.check(
            "a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}"
        )
    result.check("the node is back in the pool after the pause", back is not None, f"{back} s after SIGCONT")


@scenario("node_pause_0.5s", "a node is paused (SIGSTOP) for 0.5 s", must_hold="no request fails")
def node_pause_short(fleet: Fleet, result: ScenarioResult) -> None:
    _pause(fleet, result, 0.5)


@scenario("node_pause_1.5s", "a node is paused (SIGSTOP) for 1.5 s", must_hold="no request fails")
def node_pause_medium(fleet: Fleet, result: ScenarioResult) -> None:
    _pause(fleet, result, 1.5)


@scenario(
    "node_pause_10s",
    "a node is paused (SIGSTOP) for 10 s",
    must_hold="the LB routes around it; a client with one retry loses no request",
)
def node_pause_long(fleet: Fleet, result: ScenarioResult) -> None:
    _pause(fleet, result, 10.0)


@scenario(
    "rolling_restart",
    "every node is restarted in turn under load (SIGTERM: drain, exit, start, rejoin the pool)",
    short=True,
    must_hold="through the LB, a client with one retry loses no request; every node exits cleanly (0)",
)
def rolling_restart(fleet: Fleet, result: ScenarioResult) -> None:
    drains: list[float] = []
    readies: list[float] = []
    codes: list[int | None] = []
    with Traffic(fleet, result) as tr:
        tr.sleep(BASELINE_S)
        start = tr.mark("rolling restart begins")
        for n in fleet.active_nodes():
            t0 = time.monotonic()
            codes.append(fleet.terminate_node(n))
            drains.append(round(time.monotonic() - t0, 2))
            t1 = time.monotonic()
            fleet.start_node(n)
            readies.append(round(time.monotonic() - t1, 2))
            fleet.wait_lb(n.name, up=True, timeout=20.0)
        total = round(time.monotonic() - start, 2)
        tr.mark("rolling restart done")
        tr.sleep(2.0)
    t = result.traffic
    assert t is not None
    result.figures.update(
        nodes=len(codes),
        drain_s_max=max(drains),
        restart_until_ready_s_max=max(readies),
        rolling_restart_total_s=total,
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check("every node exited cleanly after SIGTERM", all(c == 0 for c in codes), f"exit codes {codes}")
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")


@scenario(
    "node_join",
    "a new node starts while the fleet is loaded (declared to the LB from the start, health-checked in)",
    spec=FleetSpec(spare_nodes=1),
    must_hold="no request fails; the new node gets traffic once ready",
)
def node_join(fleet: Fleet, result: ScenarioResult) -> None:
    newcomer = next(n for n in fleet.nodes if n.spare)
    with Traffic(fleet, result) as tr:
        tr.sleep(BASELINE_S)
        t0 = time.monotonic()
        fleet.start_node(newcomer)
        ready_s = round(time.monotonic() - t0, 2)
        up = fleet.wait_lb(newcomer.name, up=True, timeout=20.0)
        tr.sleep(3.0)
    t = result.traffic
    assert t is not None
    got = tr.requests_to(newcomer.name)
    result.figures.update(
        start_until_ready_s=ready_s,
        lb_up_after_ready_s=up,
        requests_to_new_node=got,
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check("the LB took the new node in", up is not None, f"{up} s after it was ready")
    result.check("the new node served requests", got > 0, f"{got} requests")
    result.check("no request fails", t.failed == 0, f"failed {t.failed}: {t.errors}")
