"""The chaos harness's pure parts (no root, no namespaces): the HAProxy configuration and stats parsing, the
traffic figures, the report, the delay proxy on loopback, the scenario registry and the mesh seam."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import lb, scenarios
from chaos.delay_proxy import DelayProxy, DelaySettings, parse_control
from chaos.fleet import Fleet, FleetSpec, MeshPlace, mesh_args
from chaos.loadgen import RequestRecord
from chaos.mesh_watch import DOWN_STATES, MeshWatch, ViewChange, all_alive, parse_members
from chaos.report import ScenarioResult, percentile, render_markdown, routed_around_s, summarize
from chaos.run import groups, select


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
    skipped = ScenarioResult("mesh_partition_2_1", "mesh", "skipped", reason="TODO-mesh")
    text = render_markdown([r, skipped], {"wall time": "1 s"})
    assert "| node_crash | passed | 1 | 1 | 0 (-) | 0 |" in text
    assert "| mesh_partition_2_1 | skipped |" in text
    assert "- [x] no request lost" in text and "TODO-mesh" in text


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


def test_short_subset_and_mesh_placeholders() -> None:
    short = [s.name for s in scenarios.short()]
    assert set(short) == {"node_crash", "rolling_restart", "partition_primitives"}
    mesh_done = {
        "mesh_partition_2_1",
        "mesh_partition_3_2",
        "mesh_one_way_partition",
        "mesh_flapping_partition",
    }
    for name in mesh_done:
        s = scenarios.REGISTRY[name]
        assert s.fn is not None and not s.todo and s.spec.mesh and not s.short
    assert scenarios.REGISTRY["mesh_partition_3_2"].spec.nodes == 5
    todo = [s for s in scenarios.ordered() if s.todo]
    assert {s.name for s in todo} >= {
        "mesh_detection_convergence",
        "mesh_ratelimit_over_admission",
        "mesh_cache_affinity_failover",
    }
    assert all(s.fn is None and s.todo.startswith("TODO-mesh") for s in todo)
    assert all(s.fn is not None for s in scenarios.ordered() if not s.todo)


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
