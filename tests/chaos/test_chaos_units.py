"""The chaos harness's pure parts (no root, no namespaces): the HAProxy configuration and stats parsing, the
traffic figures, the report, the delay proxy and the load generators on loopback, the scenario registry, the
mesh seam and the mesh scenarios' figures (SWIM bounds, flapping schedule, rate-limit windows, affinity)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import lb, scenarios
from chaos.delay_proxy import DelayProxy, DelaySettings, parse_control
from chaos.fleet import Fleet, FleetSpec, MeshPlace, mesh_args
from chaos.loadgen import (
    ConversationLoad,
    ConversationSpec,
    LoadGenerator,
    LoadSpec,
    RequestRecord,
    TurnRecord,
    conversation_words,
    stream_outcome,
)
from chaos.mesh_watch import DOWN_STATES, MeshWatch, ViewChange, all_alive, parse_members
from chaos.report import ScenarioResult, Table, percentile, render_markdown, routed_around_s, summarize
from chaos.run import groups, select
from chaos.scenarios import mesh
from chaos.scenarios.base import (
    RSS_GROWTH_BOUND_MB,
    RSS_GROWTH_MARGIN_MB,
    RSS_GROWTH_README_MB,
    check_memory,
    check_traffic_flowed,
)
from shepherd.mesh import faults as node_faults
from shepherd.node.openai.sse import error_event

if TYPE_CHECKING:  # for the annotations: aiohttp is imported only where a test serves HTTP
    from aiohttp import web


def rec(
    i: int, start: float, dur: float, ok: bool = True, first: str | None = None, err: str | None = None
) -> RequestRecord:
    return RequestRecord(i, start, start + dur, False, ok, 1 if first is None else 2, first, err)


# ---- HAProxy ------


def test_haproxy_config_has_health_checks_redispatch_and_retries() -> None:
    cfg = lb.LbConfig(
        bind="10.213.0.2:8080",
        backends=(lb.Backend("node-1", "10.213.0.11:30000"), lb.Backend("node-2", "10.213.0.12:31000")),
        stats_socket="/tmp/x.sock",
    )
    text = lb.render_haproxy(cfg)
    assert "option httpchk GET /readiness" in text
    assert "http-check expect status 200" in text
    assert "option redispatch" in text
    assert "retries 3" in text
    assert "retry-on conn-failure empty-response response-timeout 503" in text
    assert "timeout check 2000ms" in text
    assert "server node-1 10.213.0.11:30000" in text
    assert "server node-2 10.213.0.12:31000" in text
    assert "bind 10.213.0.2:8080" in text
    assert "stats socket /tmp/x.sock" in text
    assert cfg.health_check_timeout_s == 2.0
    # fail open: unchecked backups, used only when every node is marked down
    assert "option allbackups" in text
    assert "server node-1-panic 10.213.0.11:30000 backup no-check" in text
    assert "panic" not in lb.render_haproxy(dataclasses.replace(cfg, fail_open=False))


SHOW_STAT = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,"
    "weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,"
    "rate_lim,rate_max,check_status\n"
    "fleet,FRONTEND,,,1,2,4096,10,,,,,,,,,,OPEN,,,,,,,,,1,2,0,,,,0,0,0,1,\n"
    "nodes,node-1,0,0,1,2,,7,,,,,,0,0,0,0,UP,1,1,0,0,0,5,0,,1,3,1,,7,,2,0,,1,L7OK\n"
    "nodes,node-2,0,0,0,1,,3,,,,,,0,0,0,0,DOWN 1/2,1,1,0,1,1,2,4,,1,3,2,,3,,2,0,,1,L4CON\n"
    "nodes,BACKEND,0,0,1,2,410,10,,,,,,0,0,0,0,UP,1,1,0,,0,5,0,,1,3,0,,10,,1,0,,1,\n"
)


def test_show_stat_parsing() -> None:
    stats = lb.parse_show_stat(SHOW_STAT)
    assert set(stats) == {"node-1", "node-2"}
    assert stats["node-1"].up and stats["node-1"].sessions_total == 7 and stats["node-1"].current == 1
    assert not stats["node-2"].up and stats["node-2"].status == "DOWN 1/2"
    assert stats["node-2"].check_status == "L4CON" and stats["node-2"].downtime_s == 4


# ---- figures ------


def test_summary_counts_failures_retries_and_abandoned() -> None:
    records = [
        rec(0, 0.0, 0.010),
        rec(1, 0.1, 0.020, first="http_502"),
        rec(2, 0.2, 0.030, ok=False, first="timeout", err="timeout"),
        rec(3, 0.3, 0.040),
    ]
    s = summarize(records, skipped=2, abandoned=1)
    assert (s.sent, s.succeeded, s.failed, s.retried_ok, s.skipped) == (5, 3, 2, 1, 2)
    assert s.errors == {"timeout": 1, "abandoned_at_stop": 1}
    assert s.first_errors == {"http_502": 1, "timeout": 1}
    assert s.p50_ms == 20.0 and s.max_ms == 40.0


def test_routed_around_is_the_start_of_the_last_touched_request() -> None:
    records = [
        rec(0, 0.5, 0.01),
        rec(1, 1.2, 0.9),
        rec(2, 1.5, 0.01, first="disconnected"),
        rec(3, 2.5, 0.01),
    ]
    assert routed_around_s(records, fault_at=1.0, slow_s=0.5) == 0.5
    assert routed_around_s(records, fault_at=1.0, slow_s=0.5, until=1.4) == pytest.approx(0.2)
    assert routed_around_s([rec(0, 2.0, 0.01)], fault_at=1.0, slow_s=0.5) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_is_a_member_between_min_and_max(values: list[float], q: float) -> None:
    vs = sorted(values)
    p = percentile(vs, q)
    assert p is not None and p in vs
    assert percentile(vs, 0) == vs[0] and percentile(vs, 100) == vs[-1]
    assert p <= (percentile(vs, min(100.0, q + 10)) or 0)


def test_report_renders_every_scenario() -> None:
    r = ScenarioResult("node_crash", "a node dies", "running", traffic=summarize([rec(0, 0, 0.01)]))
    r.figures["routed_around_s"] = 0.25
    r.check("no request lost", True)
    r.settle()
    r.tables.append(Table("Per window", ("span", "ratio"), (("steady", 0.987), ("partitioned", None))))
    skipped = ScenarioResult("mesh_partition_2_1", "mesh", "skipped", reason="a placeholder")
    text = render_markdown([r, skipped], {"wall time": "1 s"})
    assert "| node_crash | passed | 1 | 1 | 0 (-) | 0 |" in text
    assert "| mesh_partition_2_1 | skipped |" in text
    assert "- [x] no request lost" in text and "a placeholder" in text
    assert "Per window:\n\n| span | ratio |\n|---|---|\n| steady | 0.987 |\n| partitioned | - |" in text


# ---- delay proxy ------


def test_control_line_parsing() -> None:
    assert parse_control("150\n") == (150.0, 0.0)
    assert parse_control("150 20") == (150.0, 20.0)
    for bad in ("", "a", "1 2 3", "-5", "70000"):
        with pytest.raises(ValueError):
            parse_control(bad)


def test_deadlines_keep_order_under_jitter() -> None:
    import random

    s = DelaySettings(delay_ms=10, jitter_ms=50)
    rng = random.Random(1)
    last = 0.0
    for i in range(200):
        d = s.next_deadline(i * 0.001, last, rng)
        assert d >= last and d >= i * 0.001 + 0.010
        last = d


async def test_delay_proxy_forwards_and_delays_on_loopback() -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(1024):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[:2]
    proxy = DelayProxy(("127.0.0.1", 0), target, DelaySettings(delay_ms=30))
    stop = asyncio.Event()
    task = asyncio.create_task(proxy.serve(("127.0.0.1", 0), stop))
    try:
        for _ in range(100):  # bounded: the proxy binds at once
            if proxy.listen_port:
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
        t0 = time.monotonic()
        writer.write(b"hello")
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(5), 10)
        elapsed = time.monotonic() - t0
        assert got == b"hello"
        assert elapsed >= 0.060  # a lower bound only: 30 ms each way
        cr, cw = await asyncio.open_connection("127.0.0.1", proxy.control_port)
        cw.write(b"0 0\n")
        assert (await asyncio.wait_for(cr.readline(), 10)).startswith(b"ok 0")
        cw.close()
        assert proxy.settings.delay_ms == 0.0
        writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        server.close()


# ---- registry, grouping, mesh seam ------


def test_short_subset_and_mesh_scenarios() -> None:
    short = [s.name for s in scenarios.short()]
    # the test suite's subset runs one scenario with the mesh on
    assert set(short) == {"node_crash", "rolling_restart", "partition_primitives", "mesh_partition_2_1"}
    assert any(s.spec.mesh for s in scenarios.short())
    mesh_scenarios = {
        "mesh_partition_2_1",
        "mesh_partition_3_2",
        "mesh_one_way_partition",
        "mesh_flapping_partition",
        "mesh_detection_convergence",
        "mesh_ratelimit_over_admission",
        "mesh_cache_affinity_failover",
        "mesh_wire_upgrade",
    }
    for name in mesh_scenarios:
        s = scenarios.REGISTRY[name]
        assert s.fn is not None and not s.todo and s.spec.mesh and s.must_hold
        assert s.short == (name == "mesh_partition_2_1")
    # every mesh scenario names the fault it catches (python -m chaos.run --prove-can-fail), a known one
    assert mesh_scenarios <= set(mesh.CATCHES)
    for name, fault in mesh.CATCHES.items():  # (other mesh scenarios list theirs too)
        assert name in scenarios.REGISTRY and scenarios.REGISTRY[name].spec.mesh
        assert fault in node_faults.KNOWN
    assert scenarios.REGISTRY["mesh_partition_3_2"].spec.nodes == 5
    assert "--rate-limit-rpm" in scenarios.REGISTRY["mesh_ratelimit_over_admission"].spec.node_args
    affinity_spec = scenarios.REGISTRY["mesh_cache_affinity_failover"].spec
    assert affinity_spec.policy == "cache_aware" and "--no-kv-events" in affinity_spec.node_args
    assert not [s for s in scenarios.ordered() if s.todo or s.fn is None]


def test_mesh_watch_reads_views_and_their_changes() -> None:
    assert parse_members(
        {"node": "a", "members": [{"name": "a", "state": "ALIVE"}, {"name": "b", "state": "dead"}]}
    ) == {
        "a": "alive",
        "b": "dead",
    }
    assert parse_members({"error": "x"}) is None
    pred = all_alive(["a", "b"])
    assert pred({"a": {"a": "alive", "b": "alive"}, "b": {"a": "alive", "b": "alive"}})
    assert not pred({"a": {"a": "alive", "b": "suspect"}, "b": {"a": "alive", "b": "alive"}})
    assert not pred({"a": {"a": "alive", "b": "alive"}})
    watch = MeshWatch(cast(Fleet, None))
    watch.changes += [
        ViewChange(10.0, "a", "c", "suspect"),
        ViewChange(11.0, "b", "c", "suspect"),
        ViewChange(12.0, "a", "c", "dead"),
        ViewChange(13.5, "b", "c", "dead"),
        ViewChange(14.0, "a", "b", "dead"),
        ViewChange(20.0, "a", "c", "alive"),
    ]
    assert watch.first(9.0, ["a", "b"], "c", DOWN_STATES) == 1.0
    assert watch.all_saw(9.0, ["a", "b"], "c", {"dead"}) == 4.5
    assert watch.all_saw(9.0, ["a", "b"], "c", {"left"}) is None
    assert watch.marked_dead(9.0, 15.0) == {("a", "c"), ("b", "c"), ("a", "b")}
    assert watch.marked_dead(15.0) == set()


def test_scenarios_sharing_a_fleet_shape_are_grouped() -> None:
    gs = groups(select(["all"]))
    specs = [spec for spec, _ in gs]
    assert len(specs) == len(set(specs))
    default = next(members for spec, members in gs if spec == FleetSpec())
    assert {"node_crash", "rolling_restart", "engine_crash"} <= {s.name for s in default}


def test_mesh_args_only_with_the_mesh() -> None:
    first = MeshPlace("node-1", "10.213.0.11", (), "/tmp/pki")
    second = MeshPlace("node-2", "10.213.0.12", ("10.213.0.11:39527",), "/tmp/pki")
    assert mesh_args(FleetSpec(), second) == []
    spec = FleetSpec(mesh=True)
    assert mesh_args(spec, first) == [
        "--mesh-port",
        "39527",
        "--mesh-name",
        "node-1",
        "--mesh-bind",
        "10.213.0.11",
        "--mesh-dev-pki",
        "/tmp/pki",
    ]
    assert mesh_args(spec, second)[-2:] == ["--mesh-seeds", "10.213.0.11:39527"]


def test_mesh_watch_records_changes_and_unanswered_polls() -> None:
    watch = MeshWatch(cast(Fleet, None))
    watch.record("a", {"a": "alive", "b": "alive"}, 1.0)
    watch.record("a", {"a": "alive", "b": "alive"}, 1.2)  # no change: nothing stamped
    watch.record("a", None, 1.4)  # no answer: every member it knew becomes unreachable
    watch.record("a", {"a": "alive"}, 1.6)  # b dropped from the list
    assert [(c.at, c.member, c.state) for c in watch.history(0.0)] == [
        (1.0, "a", "alive"),
        (1.0, "b", "alive"),
        (1.4, "a", "unreachable"),
        (1.4, "b", "unreachable"),
        (1.6, "a", "alive"),
        (1.6, "b", "absent"),
    ]
    watch.changes.append(ViewChange(1.5, "c", "b", "dead"))  # a parallel poller's late append
    assert [c.at for c in watch.history(0.0)] == sorted(c.at for c in watch.history(0.0))


# ---- mesh scenarios: SWIM bounds and figures ------


def test_bounds_follow_the_nodes_swim_defaults() -> None:
    from shepherd.mesh.swim_types import SwimConfig

    cfg = SwimConfig()
    pi = cfg.probe_interval
    assert pi == mesh.PROBE_INTERVAL_S and cfg.suspicion_mult == mesh.SUSPICION_MULT
    for n in (1, 2, 3, 5, 10, 40):
        assert mesh.expected_confirmations(n) == cfg.expected_confirmations(n)
        assert mesh.suspicion_bounds_s(n) == cfg.suspicion_bounds(n)
    lo3, _ = cfg.suspicion_bounds(3)
    for n in (3, 5, 10):
        lo, hi = cfg.suspicion_bounds(n)
        k = cfg.expected_confirmations(n)
        if k == 0:  # n - 2 < k: no confirmation expected, the minimum at once
            assert mesh.suspicion_timeout_s(n, 0) == lo
        else:  # starts at the maximum and reaches the minimum with k confirmations
            assert mesh.suspicion_timeout_s(n, 0) == hi
            assert mesh.suspicion_timeout_s(n, k) == pytest.approx(lo)
            assert lo < mesh.suspicion_timeout_s(n, k - 1) < hi
    assert mesh.first_probe_s(3) == pytest.approx(3 * pi)
    assert mesh.detect_bound_s(3) == pytest.approx(3 * pi + pi + lo3 + mesh.GOSSIP_SLACK_S)
    assert mesh.detect_bound_s(3) == mesh.DETECT_BOUND_3_S and lo3 == mesh.SUSPICION_MIN_S
    assert mesh.CONVERGE_BOUND_S == mesh.PUSH_PULL_S + 2.0
    assert mesh.SLOW_PAUSE_S < mesh.SUSPICION_MIN_S  # the slow node must not be declared dead
    # the checked bounds are the README's figures plus a margin, and within what SWIM allows at all: the
    # README figure is no faster than a suspicion can end, and the check is tighter than the SWIM worst case
    assert mesh.DETECT_CHECK_N3_S == mesh.README_DETECT_N3_S + mesh.DETECT_MARGIN_S
    assert mesh.SUSPICION_MIN_S < mesh.README_DETECT_N3_S < mesh.DETECT_CHECK_N3_S < mesh.DETECT_BOUND_3_S
    lo5 = cfg.suspicion_bounds(5)[0]
    two_of_k = mesh.suspicion_timeout_s(5, 2)  # a 3 | 2 partition: 2 of the k confirmations
    assert lo5 < two_of_k < mesh.README_DETECT_3_2_S < mesh.DETECT_CHECK_3_2_S < mesh.detect_bound_s(5, 2)
    assert mesh.detect_check_s(3, 1) == mesh.DETECT_CHECK_N3_S
    assert mesh.detect_check_s(5, 2) == mesh.DETECT_CHECK_3_2_S
    assert 0 < mesh.RL_MIN_RATIO < mesh.README_RL_WORST_RATIO <= 1.0 < 1 + mesh.RL_OVER_BAR
    assert mesh.detect_bound_s(3) < mesh.PAUSE_LONG_S  # the long pause must be


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.integers(0, 10))
def test_suspicion_timeout_shrinks_with_confirmations(n: int, c: int) -> None:
    lo, hi = mesh.suspicion_bounds_s(n)
    t = mesh.suspicion_timeout_s(n, c)
    assert lo <= t <= hi
    assert mesh.suspicion_timeout_s(n, c + 1) <= t
    assert mesh.detect_bound_s(n, c) > mesh.suspect_bound_s(n)


def test_flap_schedule_mixes_cuts_below_and_above_the_suspicion_timeout() -> None:
    sched = mesh.flap_schedule(mesh.FLAP_SEED, mesh.FLAP_S)
    assert sched == mesh.flap_schedule(mesh.FLAP_SEED, mesh.FLAP_S)  # deterministic
    assert sum(c + h for c, h in sched) >= mesh.FLAP_S
    assert sum(c + h for c, h in sched[:-1]) < mesh.FLAP_S
    cuts = [c for c, _ in sched]
    assert all(mesh.FLAP_CUT_S[0] <= c <= mesh.FLAP_CUT_S[1] for c in cuts)
    assert all(mesh.FLAP_HEAL_S[0] <= h <= mesh.FLAP_HEAL_S[1] for _, h in sched)
    # the scenario's checks are not vacuous: short cuts (no death may follow) and long ones (deaths follow)
    assert sum(c < mesh.SUSPICION_MIN_S for c in cuts) >= 2
    assert sum(c >= mesh.FLAP_LONG_CUT_S for c in cuts) >= 2
    assert mesh.flap_schedule(1, 0.0) != []


def test_deaths_against_suspicions_and_short_cuts() -> None:
    changes = [
        ViewChange(1.0, "b", "a", "alive"),
        ViewChange(1.0, "c", "a", "alive"),
        ViewChange(10.5, "c", "a", "suspect"),  # cut at 10.0 for 4 s: the suspicion ...
        ViewChange(12.6, "c", "a", "dead"),  # ... ends after 2.1 s
        ViewChange(12.7, "b", "a", "dead"),  # b learns it from c: the suspicion (c's) began 2.2 s before
        ViewChange(14.5, "b", "a", "alive"),  # healed at 14.0
        ViewChange(14.5, "c", "a", "alive"),
        ViewChange(15.2, "c", "a", "suspect"),  # cut at 15.0 for 0.8 s
        ViewChange(15.9, "c", "a", "dead"),  # dead after a 0.7 s suspicion and a short cut: both wrong
        ViewChange(1.0, "b", "z", "alive"),
        ViewChange(20.0, "b", "z", "dead"),  # nobody was seen suspecting z
    ]
    timers = {(d.at, d.observer): g for d, g in mesh.suspicion_to_death_s(changes)}
    assert timers == {(12.6, "c"): 2.1, (12.7, "b"): 2.2, (15.9, "c"): 0.7, (20.0, "b"): None}
    cuts = [(10.0, 4.0), (15.0, 0.8)]
    bad = [(d.at, d.observer, d.member) for d in mesh.deaths_after_short_cuts(changes, cuts, 2.0)]
    assert bad == [(15.9, "c", "a"), (20.0, "b", "z")]
    # a suspicion carried over from a long cut into a short one is not the short cut's doing
    carried = [
        ViewChange(1.0, "b", "a", "alive"),
        ViewChange(11.5, "b", "a", "suspect"),
        ViewChange(13.8, "b", "a", "dead"),
    ]
    assert mesh.deaths_after_short_cuts(carried, [(10.0, 1.9), (12.0, 1.0)], 2.0) == []
    assert mesh.deaths_after_short_cuts(carried, [(11.0, 1.9)], 2.0) == [carried[-1]]


def test_rejoins_are_dead_then_alive() -> None:
    changes = [
        ViewChange(1.0, "b", "a", "suspect"),
        ViewChange(2.0, "b", "a", "dead"),
        ViewChange(3.0, "b", "a", "suspect"),
        ViewChange(4.0, "b", "a", "alive"),  # a rejoin, through suspect
        ViewChange(5.0, "c", "a", "suspect"),
        ViewChange(6.0, "c", "a", "alive"),  # refuted: not a rejoin
        ViewChange(7.0, "c", "a", "dead"),
        ViewChange(8.0, "c", "a", "alive"),
    ]
    assert mesh.count_rejoins(changes) == 2


def _rr(i: int, start: float, target: str, status: int) -> RequestRecord:
    ok = status == 200
    err = None if ok else f"http_{status}"
    return RequestRecord(i, start, start + 0.01, False, ok, 1, err, err, target, status)


def test_admissions_per_side_and_window() -> None:
    node_of = {"http://n1": "node-1", "http://n2": "node-2", "http://n3": "node-3"}
    records = [
        _rr(0, 0.5, "http://n1", 200),
        _rr(1, 1.0, "http://n2", 429),
        _rr(2, 1.5, "http://n3", 200),
        _rr(3, 2.5, "http://n3", 200),
        _rr(4, 3.0, "http://n1", 502),  # neither admitted nor refused: left out
        _rr(5, 6.5, "http://n2", 200),
    ]
    adm = mesh.to_admissions(records, 100.0, node_of)
    assert [(a.at, a.node, a.admitted) for a in adm][:3] == [
        (100.5, "node-1", True),
        (101.0, "node-2", False),
        (101.5, "node-3", True),
    ]
    sides = {"minority": ["node-3"], "majority": ["node-1", "node-2"], "all": ["node-1", "node-2", "node-3"]}
    rows = {w.side: w for w in mesh.side_windows(adm, "w", 100.0, 106.0, sides, 6.0, 3, 6.0)}
    assert (rows["minority"].offered, rows["minority"].admitted, rows["minority"].allowance) == (2, 2, 2.0)
    assert rows["minority"].ratio == 1.0 and rows["minority"].over == 0.0 and rows["minority"].under == 0.0
    assert (rows["majority"].offered, rows["majority"].admitted, rows["majority"].allowance) == (2, 1, 4.0)
    assert rows["majority"].under == 0.0  # asked for less than its allowance: not under-admission
    assert rows["all"].ratio == 0.5
    half = {w.side: w for w in mesh.side_windows(adm, "w", 100.0, 103.0, sides, 6.0, 3, 6.0)}
    assert half["all"].allowance == 3.0 and half["all"].admitted == 3
    over = mesh.SideWindow("w", "s", ("a",), 0.0, 1.0, offered=30, admitted=12, allowance=10.0)
    assert over.over == pytest.approx(0.2) and over.under == 0.0
    under = mesh.SideWindow("w", "s", ("a",), 0.0, 1.0, offered=30, admitted=8, allowance=10.0)
    assert under.under == pytest.approx(0.2) and under.over == 0.0
    assert mesh.max_sliding_ratio(adm, [102.0, 106.5], 2.0, 6.0) == 1.5
    assert mesh.max_sliding_ratio(adm, [], 2.0, 6.0) is None


def _turn(conv: int, k: int, prompt: int, cached: int, ok: bool = True, target: str = "n1") -> TurnRecord:
    return TurnRecord(conv, k, target, float(k), k + 0.1, ok, 1, None if ok else "x", prompt, cached)


def test_follow_ups_hit_when_the_engine_holds_the_previous_prompt() -> None:
    turns = [
        _turn(1, 0, 200, 0),
        _turn(1, 1, 270, 192),  # previous prompt 200: 12 whole blocks, 11 needed -> hit
        _turn(1, 2, 340, 200),  # previous 270: 16 blocks, 15 = 240 needed; 200 is turn 0's: miss
        _turn(2, 0, 100, 0),
        _turn(2, 1, 170, 0, ok=False),
        _turn(2, 2, 240, 160),  # its previous turn failed: not a follow-up
        _turn(3, 1, 90, 80),  # no turn 0 recorded: not a follow-up
    ]
    fs = mesh.follow_ups(turns)
    assert [(f.turn.conversation, f.turn.turn, f.hit) for f in fs] == [(1, 1, True), (1, 2, False)]
    assert mesh.affinity(fs) == 0.5 and mesh.affinity([]) is None
    assert mesh.follow_ups([_turn(4, 0, 10, 0), _turn(4, 1, 30, 0)]) == [
        mesh.FollowUp(_turn(4, 0, 10, 0), _turn(4, 1, 30, 0), False)  # under 2 blocks: nothing to hold
    ]


# ---- load generators on loopback ------


async def _openai_stub(
    statuses: dict[int, int],
) -> tuple[list[tuple[int, list[dict[str, str]]]], list[str], Callable[[], Awaitable[None]]]:
    """Two loopback servers answering chat completions: per server a status; usage counts the history's
    words as prompt tokens and every earlier message's words as cached. Returns (seen, urls, close)."""
    from aiohttp import web  # not at the top: only the tests that serve HTTP need it

    seen: list[tuple[int, list[dict[str, str]]]] = []
    servers = contextlib.AsyncExitStack()
    urls = []
    for i in range(2):

        async def handler(request: web.Request, i: int = i) -> web.Response:
            body = await request.json()
            msgs = body["messages"]
            seen.append((i, msgs))
            if statuses.get(i, 200) != 200:
                return web.json_response({"error": {"message": "no"}}, status=statuses[i])
            words = [len(m["content"].split()) for m in msgs]
            usage = {"prompt_tokens": sum(words), "prompt_tokens_details": {"cached_tokens": sum(words[:-1])}}
            msg = {"role": "assistant", "content": f"answer from {i}"}
            return web.json_response({"choices": [{"message": msg}], "usage": usage})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        urls.append(await servers.enter_async_context(serving(app)))
    return seen, urls, servers.aclose


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free loopback port while inside: its base URL (``http://127.0.0.1:port``)."""
    from aiohttp import web  # not at the top: only the tests that serve HTTP need it

    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def _until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    for _ in range(int(timeout / 0.02)):  # bounded
        if pred() or time.monotonic() - t0 > timeout:
            return
        await asyncio.sleep(0.02)


async def test_load_generator_spreads_over_targets_and_records_status() -> None:
    _, urls, close = await _openai_stub({1: 429})
    gen = LoadGenerator(
        LoadSpec(url="http://unused", rate=200.0, retries=0, stream_fraction=0.0, targets=tuple(urls))
    )
    try:
        gen.start()
        await _until(lambda: len(gen.snapshot()) >= 6)
    finally:
        records = await asyncio.to_thread(gen.stop)
        await close()
    assert len(records) >= 6
    for r in records:
        assert r.target == urls[r.index % 2]
        assert (r.status, r.ok) == ((200, True) if r.index % 2 == 0 else (429, False))
        assert r.error == (None if r.ok else "http_429")


async def test_conversations_carry_their_history_round_robin() -> None:
    seen, urls, close = await _openai_stub({})
    spec = ConversationSpec(
        targets=tuple(urls), conversations=2, turns=3, think_s=0.0, opening_words=5, turn_words=4
    )
    conv = ConversationLoad(spec)
    try:
        conv.start()
        await _until(lambda: len(conv.snapshot()) >= 8)
        conv.set_targets(urls[:1])
        n = len(conv.snapshot())
        await _until(lambda: len(conv.snapshot()) >= n + 6)
    finally:
        turns = await asyncio.to_thread(conv.stop)
        await close()
    assert all(t.ok for t in turns)
    first = sorted((t for t in turns if t.conversation in (0, 1)), key=lambda t: (t.conversation, t.turn))
    assert [(t.conversation, t.turn) for t in first] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for t in first:
        assert t.target == urls[(t.conversation + t.turn) % 2]  # each turn on the next node
    t2 = first[2]
    # turn 2 carried the opening (2 + 5 words), two answers (3 words each) and two more turns (4 words each)
    assert t2.prompt_tokens == 7 + 3 + 4 + 3 + 4 and t2.cached_tokens == 7 + 3 + 4 + 3
    assert any(m[1][-1]["content"] == conversation_words(0, 0, 2, 4) for m in seen)
    late = [t for t in turns if t.start > first[-1].end + 1.0]
    assert all(t.target == urls[0] for t in late)  # set_targets: the next turns go to the remaining node
    with pytest.raises(ValueError):
        conv.set_targets([])


def test_first_limiter_that_counts_fewer_members() -> None:
    log = [(1.0, "node-1", "3/3"), (5.0, "node-1", "2/3"), (9.0, "node-3", "?"), (35.0, "node-3", "1/1")]
    assert mesh.first_shrunk(log, 3, 2.0) == 35.0
    assert mesh.first_shrunk(log, 3, 40.0) is None


def test_mesh_watch_replays_when_a_view_first_held() -> None:
    watch = MeshWatch(cast(Fleet, None))
    both = all_alive(["a", "b"])
    watch.record("a", {"a": "alive", "b": "alive"}, 1.0)
    watch.record("b", {"a": "alive", "b": "alive"}, 1.1)
    watch.record("a", {"a": "alive", "b": "suspect"}, 2.0)
    watch.record("a", {"a": "alive", "b": "alive"}, 3.5)
    assert watch.when(both, 1.5) == 0.0  # already held
    assert watch.when(both, 2.5) == 1.0
    assert watch.when(both, 0.0) == 1.1  # b's view came in at 1.1
    assert watch.when(both, 2.5, until=3.0) is None


# ---- a stream is OK only when it completed without an error event ------

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"delta":{"content":"hi"}}]}\n\n'
# the node's error_event (shepherd/node/openai/sse.py) as it ends a failed engine stream
ERROR_EVENT = error_event("The worker's stream failed.", code="engine_error")
DONE = b"data: [DONE]\n\n"


def test_stream_outcome_sees_error_events_and_truncation() -> None:
    assert stream_outcome(CHUNK + CHUNK + DONE) is None
    assert stream_outcome(b": keep-alive\n\n" + CHUNK.replace(b"\n\n", b"\r\n\r\n") + DONE) is None
    # the node's way of ending an engine failure mid-stream: an error event, then [DONE]: a loss
    assert stream_outcome(CHUNK + ERROR_EVENT + DONE) == "stream_error"
    assert stream_outcome(ERROR_EVENT + DONE) == "stream_error"
    assert stream_outcome(CHUNK + b"event: error\ndata: {}\n\n" + DONE) == "stream_error"
    assert stream_outcome(CHUNK) == "stream_incomplete"  # cut before [DONE]
    assert stream_outcome(CHUNK + DONE + CHUNK) == "stream_incomplete"  # [DONE] is not the last event
    assert stream_outcome(DONE + DONE) == "stream_bad_event"
    assert stream_outcome(b'data: {"choices":[\n\n' + DONE) == "stream_bad_event"  # a torn chunk
    assert stream_outcome(b"data: [1]\n\n" + DONE) == "stream_bad_event"
    assert stream_outcome(DONE) == "stream_empty"  # no chunk at all
    assert stream_outcome(b"") == "stream_incomplete"


async def test_load_generator_counts_a_stream_ending_in_an_error_event_as_failed() -> None:
    from aiohttp import web

    bodies = {"/ok": CHUNK + DONE, "/err": CHUNK + ERROR_EVENT + DONE}

    async def handler(request: web.Request) -> web.Response:
        base = request.path.removesuffix("/v1/chat/completions")
        return web.Response(body=bodies[base], content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/{base}/v1/chat/completions", handler)
    async with serving(app) as url:
        out = {}
        for base in bodies:
            gen = LoadGenerator(LoadSpec(url=url + base, rate=200.0, retries=1, stream_fraction=1.0))
            gen.start()
            snapshot = gen.snapshot
            await _until(lambda: len(snapshot()) >= 4)  # noqa: B023 - awaited within the iteration
            out[base] = await asyncio.to_thread(gen.stop)
    assert len(out["/ok"]) >= 4 and all(r.stream and r.ok and r.attempts == 1 for r in out["/ok"])
    assert len(out["/err"]) >= 4
    for r in out["/err"]:  # a 200 whose stream carried an error event: failed, retried, failed again
        assert r.stream and not r.ok and r.status == 200 and r.attempts == 2
        assert r.first_error == r.error == "stream_error"
    assert summarize(out["/err"]).failed == len(out["/err"])


# ---- traffic flowed; memory growth per scenario ------


def test_traffic_flowed_check_fails_without_traffic_or_with_skips() -> None:
    def run(launched: int, skipped: int, due: float) -> list[bool]:
        r = ScenarioResult("x", "x", "running")
        check_traffic_flowed(r, launched=launched, skipped=skipped, due=due)
        return [c.ok for c in r.checks]

    assert run(400, 0, 400.0) == [True, True]
    assert run(0, 0, 0.0) == [False, True]  # nothing sent: the scenario's checks would be vacuous
    assert run(100, 0, 400.0) == [False, True]  # the generator stalled
    assert run(400, 3, 400.0) == [True, False]  # launches skipped at the in-flight cap


def test_memory_check_is_per_scenario_and_bounded_by_the_readme_figure() -> None:
    mb = 2**20
    log = {("node-1", 10): [(0.0, 100 * mb), (5.0, 150 * mb), (10.0, 150 * mb), (11.0, 150 * mb + mb // 2)]}
    r = ScenarioResult("x", "x", "running")
    check_memory(log, r, since=9.0)  # the earlier growth belongs to an earlier scenario
    assert [c.ok for c in r.checks] == [True] and r.figures["node_rss_growth_mb_max"] == 0.5
    r = ScenarioResult("x", "x", "running")
    check_memory(log, r, since=0.0)  # 50.5 MB over the scenario: far over 0.1 MB + the margin
    assert [c.ok for c in r.checks] == [False]
    r = ScenarioResult("x", "x", "running")
    check_memory(log, r, since=0.0, bound_mb=60.0)
    assert [c.ok for c in r.checks] == [True]
    r = ScenarioResult("x", "x", "running")
    check_memory(log, r, since=20.0)  # no node sampled twice: the check cannot pass vacuously
    assert [c.ok for c in r.checks] == [False]
    assert RSS_GROWTH_BOUND_MB == RSS_GROWTH_README_MB + RSS_GROWTH_MARGIN_MB < 96
