"""The large-mesh scenario's pure parts (no root, no namespaces): its fleet shape, the concurrency figures
from the client's records, the views' checks, and the load generator's extra headers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

from chaos import scenarios
from chaos.loadgen import LoadGenerator, LoadSpec, RequestRecord
from chaos.netns import Host
from chaos.scenarios import mesh, mesh_large
from chaos.scenarios.mesh_large import (
    CONC,
    LARGE_N,
    Held,
    _src_range,
    conc_windows,
    exact_view,
    held,
    mean_in_flight,
    peak_in_flight,
    workers_equal,
)
from chaos.spec import ENGINE_BASE, NODE_BASE
from shepherd.mesh import faults as node_faults
from tests.chaos.test_chaos_units import serving


def test_the_large_fleet_fits_the_network_and_names_its_fault() -> None:
    s = scenarios.REGISTRY["mesh_large"]
    assert s.fn is not None and s.spec.mesh and not s.short and s.must_hold
    assert s.spec.nodes == LARGE_N and NODE_BASE + s.spec.total_nodes <= ENGINE_BASE  # no address overlap
    assert LARGE_N % 3 == 0  # a 2/3 | 1/3 split with no rounding
    args = s.spec.node_args
    for flag in ("--rate-limit-rpm", "--rate-limit-max-concurrent", "--auth-trust-tenant-header"):
        assert flag in args
    assert args[args.index("--tokenizer-workers") + 1] == "0"  # the lightest node: no tokenizer pool
    assert mesh.CATCHES["mesh_large"] == node_faults.IGNORE_PARTITION_RULE
    # its bounds: the README's rate figures, and the simulation's concurrency figure less the same margin
    assert math.isclose(mesh_large.CONC_MIN_RATIO, mesh_large.CONC_SIM_MEAN - mesh.RL_UNDER_MARGIN)
    assert mesh_large.CONC_OVER_BAR == mesh.RL_OVER_BAR
    assert "mesh_large" not in {x.name for x in scenarios.short()}


def test_in_flight_time_averaged_and_peak() -> None:
    hs = [Held(0.0, 10.0, "a"), Held(5.0, 15.0, "a"), Held(5.0, 6.0, "b"), Held(20.0, 30.0, "a")]
    assert mean_in_flight(hs, 0.0, 10.0, {"a"}) == pytest.approx(1.5)  # 10 + 5 busy seconds over 10 s
    assert mean_in_flight(hs, 0.0, 10.0, {"a", "b"}) == pytest.approx(1.6)
    assert mean_in_flight(hs, 0.0, 20.0, {"b"}) == pytest.approx(0.05)
    assert mean_in_flight(hs, 5.0, 5.0, {"a"}) == 0.0
    assert peak_in_flight(hs, 0.0, 20.0, {"a", "b"}) == 3
    assert peak_in_flight(hs, 0.0, 20.0, {"a"}) == 2
    assert peak_in_flight(hs, 16.0, 19.0, {"a", "b"}) == 0
    # a request ending as another starts is not two at once
    assert peak_in_flight([Held(0.0, 1.0, "a"), Held(1.0, 2.0, "a")], 0.0, 2.0, {"a"}) == 1


def test_held_keeps_admitted_requests_by_node_and_windows_scale_the_limit_by_side() -> None:
    recs = [
        RequestRecord(0, 1.0, 3.0, False, True, 1, None, None, "http://n1", 200),
        RequestRecord(1, 1.0, 1.1, False, False, 1, "http_429", "http_429", "http://n2", 429),
        RequestRecord(2, 2.0, 4.0, False, True, 1, None, None, "http://n2", 200),
    ]
    hs = held(recs, 100.0, {"http://n1": "node-1", "http://n2": "node-2"})
    assert hs == [Held(101.0, 103.0, "node-1"), Held(102.0, 104.0, "node-2")]
    rows = conc_windows(hs, "w", 100.0, 110.0, {"one": ["node-1"], "all": ["node-1", "node-2"]}, n=15)
    assert [r.allowance for r in rows] == [pytest.approx(CONC / 15), pytest.approx(CONC * 2 / 15)]
    assert rows[1].mean == pytest.approx(0.4) and rows[1].peak == 2
    assert rows[0].ratio == pytest.approx(0.2 / (CONC / 15))


def test_views_and_workers_checks() -> None:
    names = ["a", "b"]
    whole = {"a": {"a": "alive", "b": "alive"}, "b": {"a": "alive", "b": "alive"}}
    assert exact_view(names)(whole)
    lingering = {"a": {"a": "alive", "b": "alive", "c": "dead"}, "b": {"a": "alive", "b": "alive"}}
    assert not exact_view(names)(lingering)  # a dead member left in a view
    assert not exact_view(names)({"a": whole["a"]})  # b did not answer
    w = {"workers": [{"id": "w1", "url": "grpc://e1", "owner": "a"}]}
    other = {"workers": [{"id": "w1", "url": "grpc://e1", "owner": "b"}]}
    assert workers_equal({"a": w, "b": dict(w)})
    assert not workers_equal({"a": w, "b": other})
    assert not workers_equal({"a": w, "b": None})
    assert not workers_equal({"a": {"workers": []}, "b": {"workers": []}})  # nothing listed is no proof


async def test_load_generator_sends_the_extra_headers() -> None:
    from aiohttp import web  # not at the top: only this test serves HTTP

    seen: list[str | None] = []
    enough = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-smg-tenant"))
        if len(seen) >= 6:
            enough.set()
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    async with serving(app) as url:
        gens = [
            LoadGenerator(
                LoadSpec(url=url, rate=100.0, stream_fraction=0.0, headers=(("x-smg-tenant", "t1"),))
            ),
            LoadGenerator(LoadSpec(url=url, rate=100.0, stream_fraction=0.0)),
        ]
        try:
            for g in gens:
                g.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), timeout=10.0)
        finally:
            records = [await asyncio.to_thread(g.stop) for g in gens]
    assert all(r.ok for rs in records for r in rs) and all(records)
    assert "t1" in seen and None in seen and set(seen) <= {"t1", None}


def test_a_side_is_one_source_range_of_consecutive_addresses() -> None:
    hosts = [Host(f"node-{i}", f"ns{i}", f"10.213.0.{10 + i}") for i in (3, 1, 2)]
    assert _src_range(hosts) == "10.213.0.11-10.213.0.13"
    with pytest.raises(ValueError, match="consecutive"):
        _src_range([*hosts, Host("node-9", "ns9", "10.213.0.19")])
