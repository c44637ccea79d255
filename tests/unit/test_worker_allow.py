"""Worker URLs and ``worker_allow``: what a worker URL may be (scheme://host:port, for HTTP workers too),
the allowlist's matching rules, the connect-time check of names (DNS re-binding), the caps on what the
node reads from a worker, the registry refusing (config, admin, mesh) and the probe budget.

Real components on loopback: ``HttpRelayClient`` against a counting TCP listener and a small aiohttp
upstream, ``WorkerRegistry`` behind the mesh's ``RegistryBridge``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from shepherd.mesh.state import MeshState
from shepherd.node.cluster.mesh_node import RegistryBridge
from shepherd.node.config import ConfigError, WorkerAllow, build_config, check_worker_url
from shepherd.node.dispatch.workers import ProbeBudget, Worker, WorkerRegistry, client_error
from shepherd.node.engines.http import INFO_MAX_BYTES, AllowResolver, BodyTooLarge, HttpRelayClient
from shepherd.policies.prefix_replica_native import make_replica
from shepherd.proto.engine_types import EngineError, EngineUnavailable, worker_id
from shepherd.proto.openai_errors import ApiError

pytestmark = pytest.mark.timeout(60)

# ---- URLs ------------------------------------------------------------------------------------------

BAD_HTTP_URLS = [
    "http://127.0.0.1:8000/internal#",  # the appended /v1/... becomes a fragment
    "http://127.0.0.1:8000#",
    "http://127.0.0.1:8000?",
    "http://127.0.0.1:8000/?x=1",
    "http://127.0.0.1:8000/v1",
    "http://127.0.0.1:8000//",
    "http://user:pw@127.0.0.1:8000",
    "http://@127.0.0.1:8000",
    "https://evil.example@127.0.0.1:8000",
    "http://127.0.0.1:8000\\@x",
    "http://%31%32%37.0.0.1:8000",
    "http://127.0.0.1:0",
    "http://exa mple:80",
    "grpc://user@127.0.0.1:50051",
]


@pytest.mark.parametrize("url", BAD_HTTP_URLS)
def test_worker_urls_are_scheme_host_port_only(url: str) -> None:
    with pytest.raises(ConfigError):
        check_worker_url(url)
    with pytest.raises(ConfigError):
        build_config({}, {"worker_urls": [url]})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "https://vllm.internal",
        "http://[::1]:80",
        "http://w_1:80",
    ],
)
def test_plain_worker_urls_pass(url: str) -> None:
    assert check_worker_url(url) == url


# ---- the allowlist ---------------------------------------------------------------------------------


def test_allow_rules() -> None:
    a = WorkerAllow(("10.0.0.0/8", "192.168.1.7", "fd00::/8", "vllm.internal", ".svc.cluster.local"))
    assert a.address_allowed("10.1.2.3") and a.address_allowed("192.168.1.7") and a.address_allowed("fd00::1")
    assert a.address_allowed("::ffff:10.0.0.1")  # IPv4-mapped: as its IPv4 address
    assert not a.address_allowed("192.168.1.8") and not a.address_allowed("169.254.169.254")
    assert not a.address_allowed("not-an-ip")
    assert a.name_listed("vllm.internal") and a.name_listed("VLLM.Internal.")
    assert a.name_listed("w.ns.svc.cluster.local")
    assert not a.name_listed("svc.cluster.local") and not a.name_listed("evilsvc.cluster.local")
    assert not a.name_listed("vllm.internal.evil.com")
    a.check_url("http://10.0.0.5:8000")
    a.check_url("grpc://vllm.internal:50051")
    a.check_url("http://anything.example:80")  # HTTP, name not listed: checked where it resolves
    for bad in (
        "http://127.0.0.1:8000",
        "http://169.254.169.254",
        "grpc://anything.example:1",
        "http://[::1]:1",
    ):
        with pytest.raises(ConfigError):
            a.check_url(bad)
    names_only = WorkerAllow(("vllm.internal",))
    with pytest.raises(ConfigError):
        names_only.check_url("http://other.example:80")  # no network a resolution could land in
    assert WorkerAllow().empty and not WorkerAllow().any
    with pytest.raises(ConfigError):
        WorkerAllow().check_url("http://169.254.169.254")  # empty: any but link-local / metadata


def test_allow_entries_and_config_urls_are_checked() -> None:
    for bad in ("", "10.0.0.0/33", "a b", "x/y"):
        with pytest.raises(ConfigError):
            build_config({}, {"worker_allow": [bad]})
    with pytest.raises(ConfigError):
        build_config({}, {"worker_allow": ["10.0.0.0/8"], "worker_urls": ["http://127.0.0.1:8000"]})
    with pytest.raises(ConfigError):
        build_config(
            {"models": [{"name": "m", "model_path": "/x", "worker_urls": ["grpc://127.0.0.1:1"]}]},
            {"worker_allow": ["10.0.0.0/8"]},
        )
    cfg = build_config({}, {"worker_allow": "127.0.0.0/8", "worker_urls": ["grpc://127.0.0.1:1"]})
    assert cfg.worker_allow == ("127.0.0.0/8",)
    with pytest.raises(ConfigError):
        build_config({}, {"max_client_connections": 0})


# ---- connect-time check: names resolve to allowed addresses only ---------------------------------------


class _Counting:
    """A TCP listener on loopback that counts the connections it accepts (and answers /health 200)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.accepted += 1
            with contextlib.suppress(Exception):
                await r.readuntil(b"\r\n\r\n")
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await w.drain()
            w.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_a_name_resolving_outside_the_allowed_networks_is_never_dialed() -> None:
    listener = _Counting()
    port = await listener.start()
    try:
        refused = HttpRelayClient(f"http://localhost:{port}", allow=WorkerAllow(("10.0.0.0/8",)))
        allowed = HttpRelayClient(f"http://localhost:{port}", allow=WorkerAllow(("127.0.0.0/8", "::1/128")))
        try:
            assert await refused.health_check(2.0) is False
            assert listener.accepted == 0
            assert await allowed.health_check(2.0) is True
            assert listener.accepted == 1
        finally:
            await refused.close()
            await allowed.close()
    finally:
        await listener.close()


async def test_the_resolver_filters_every_resolution() -> None:
    """DNS re-binding: the name answers an allowed address once, then a refused one; each resolution
    is checked, so the second never reaches a connection."""
    answers = [["10.0.0.7"], ["127.0.0.1", "169.254.169.254"]]

    class Flipping:
        async def resolve(
            self, host: str, port: int = 0, family: Any = socket.AF_INET
        ) -> list[dict[str, Any]]:
            return [
                {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
                for a in answers.pop(0)
            ]

        async def close(self) -> None:
            pass

    r = AllowResolver(WorkerAllow(("10.0.0.0/8",)))
    r._inner = Flipping()  # type: ignore[assignment]
    assert [x["host"] for x in await r.resolve("w.example", 80)] == ["10.0.0.7"]
    with pytest.raises(OSError):
        await r.resolve("w.example", 80)


# ---- what the node reads from a worker is capped; redirects are not followed -----------------------------


@contextlib.asynccontextmanager
async def upstream(routes: list[web.RouteDef]) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_model_info_and_loads_are_capped() -> None:
    big = orjson.dumps({"data": [{"id": "m", "max_model_len": 4096, "pad": "x" * INFO_MAX_BYTES}]})

    async def models(_r: web.Request) -> web.Response:
        return web.Response(body=big, content_type="application/json")

    async def loads(_r: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})  # chunked: no length declared
        await resp.prepare(_r)
        await resp.write(b'{"loads": [{"num_running_reqs": 3}], "pad": "')
        for _ in range(INFO_MAX_BYTES // 65536 + 2):
            await resp.write(b"x" * 65536)
        await resp.write(b'"}')
        return resp

    async with upstream([web.get("/v1/models", models), web.get("/v1/loads", loads)]) as url:
        c = HttpRelayClient(url)
        try:
            with pytest.raises(EngineUnavailable) as ei:
                await c.model_info()
            assert url not in str(ei.value) and "127.0.0.1" not in str(ei.value)
            load = await c.loads()
            assert load.running == 0  # over the cap: read as no load, not parsed
        finally:
            await c.close()


async def test_redirects_are_not_followed() -> None:
    hits: list[str] = []

    async def redirect(_r: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/internal")

    async def internal(_r: web.Request) -> web.Response:
        hits.append(_r.path)
        return web.json_response({"data": [{"id": "secret", "max_model_len": 7}], "status": "ok"})

    routes = [
        web.get("/health", redirect),
        web.get("/v1/models", redirect),
        web.post("/v1/chat/completions", redirect),
        web.route("*", "/internal", internal),
    ]
    async with upstream(routes) as url:
        c = HttpRelayClient(url)
        try:
            assert await c.health_check(2.0) is False
            info = await c.model_info()
            assert info.served_model_name == ""
            r = await c.post("/v1/chat/completions", b"{}", {"Content-Type": "application/json"})
            assert r.status == 307
            r.release()
            assert hits == []
        finally:
            await c.close()


async def test_read_capped() -> None:
    from shepherd.node.engines.http import read_capped  # not at the top: only this test uses it

    async def body(_r: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(_r)
        for _ in range(4):
            await resp.write(b"y" * 1000)
        return resp

    async with upstream([web.get("/b", body)]) as url:
        c = HttpRelayClient(url)
        try:
            async with c.session().get(url + "/b") as r:
                with pytest.raises(BodyTooLarge):
                    await read_capped(r, 3000)
            async with c.session().get(url + "/b") as r:
                assert len(await read_capped(r, 4000)) == 4000
        finally:
            await c.close()


# ---- the registry: refused URLs are never dialed (config, admin API, mesh); the probe budget ----------


def _worker(url: str) -> Worker:
    from shepherd.node.dispatch.circuit_breaker import (
        CircuitBreaker,
        HealthTracker,
    )  # not at the top: here only
    from shepherd.node.dispatch.workers import make_client  # not at the top: only this helper uses it

    return Worker(worker_id(url), url, "m", make_client(url), HealthTracker(), CircuitBreaker(5, 2, 10.0))


def test_client_errors_name_workers_by_id() -> None:
    w = _worker("grpc://10.1.2.3:50051")
    e = client_error(EngineUnavailable("engine unavailable: cannot connect to 10.1.2.3:50051: refused"), w)
    assert "10.1.2.3" not in str(e) and w.id in str(e) and e.code == "engine_unavailable"
    e2 = client_error(
        EngineError("engine error (INTERNAL): grpc://10.1.2.3:50051 said no", retryable=False), w
    )
    assert "10.1.2.3" not in str(e2) and e2.code == "engine_error" and not e2.retryable
    plain = EngineError("engine rejected the request: bad", code="invalid_request", retryable=False)
    assert client_error(plain, w) is plain


async def test_registry_refuses_what_the_allowlist_refuses_without_dialing() -> None:
    listener = _Counting()
    port = await listener.start()
    reg = WorkerRegistry(build_config({}, {"worker_allow": ["10.0.0.0/8"]}))
    try:
        for url in (f"http://127.0.0.1:{port}", f"grpc://127.0.0.1:{port}", f"http://127.0.0.1:{port}/x#"):
            with pytest.raises(ApiError) as ei:
                await reg.add(url, "m")
            assert ei.value.status == 400
        assert reg.workers == {} and listener.accepted == 0
    finally:
        await reg.close()
        await listener.close()


async def test_a_worker_from_the_mesh_that_the_local_allowlist_refuses_is_left_out() -> None:
    """Node a (no allowlist) adds a worker; it reaches node b through the replicated registry; b's
    allowlist refuses it: b never registers nor dials it."""
    listener = _Counting()
    port = await listener.start()
    url = f"http://127.0.0.1:{port}"
    t = [1_800_000_000.0]
    a_state = MeshState("a", lambda: t[0], new_index=make_replica)
    b_state = MeshState("b", lambda: t[0], new_index=make_replica)
    a_state.on_member_up(b_state.node)
    b_state.on_member_up(a_state.node)
    b_reg = WorkerRegistry(build_config({}, {"worker_allow": ["10.0.0.0/8"]}))
    bridge = RegistryBridge(b_state, b_reg, models={"m"}, pinned=set(), ident=worker_id)
    b_reg.on_added = bridge.local_added
    b_reg.on_removed = bridge.local_removed
    try:
        from shepherd.mesh.state_registry import WorkerRecord  # not at the top: only this test uses it

        a_state.add_worker(WorkerRecord(worker_id(url), url, "m", "http"), pin=False)
        for _ in range(50):  # bounded: gossip in memory until b has heard and its bridge is idle
            for p in a_state.outgoing_batches(1100):
                b_state.apply(p, a_state.node)
            for _ in range(20):
                await asyncio.sleep(0)
            if b_state.worker(worker_id(url)) is not None and not bridge.busy:
                break
        assert b_state.worker(worker_id(url)) is not None  # b heard of it ...
        assert b_reg.workers == {}  # ... and left it out
        assert listener.accepted == 0  # never dialed
    finally:
        await b_reg.close()
        await listener.close()


def test_probe_budget() -> None:
    t = [0.0]
    b = ProbeBudget(burst=3, per_sec=0.5, clock=lambda: t[0])
    for _ in range(3):
        assert b.available()
        b.spend()
    assert not b.available() and b.retry_after() == 2
    t[0] += 2.0
    assert b.available()


async def test_run_time_adds_that_fail_their_first_check_are_rate_limited() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    reg = WorkerRegistry(build_config({}, {"health_check_timeout_secs": 0.5}))
    reg.probes = ProbeBudget(burst=2, per_sec=0.001)
    reg._started = True  # run-time adds (what ``start`` marks), without the background loops
    try:
        for i in range(2):
            w = await reg.add(f"http://127.0.0.{i + 2}:{dead}", "m")
            assert not w.health.healthy
        with pytest.raises(ApiError) as ei:
            await reg.add(f"http://127.0.0.9:{dead}", "m")
        assert ei.value.status == 429 and ei.value.code == "worker_probe_rate_limited"
        assert len(reg.workers) == 2
    finally:
        await reg.close()


async def test_relay_client_errors_name_the_worker_by_id() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    c = HttpRelayClient(f"http://127.0.0.1:{dead}")
    try:
        with pytest.raises(EngineUnavailable) as ei:
            await c.post("/v1/chat/completions", b"{}", {})
        assert "127.0.0.1" not in str(ei.value) and str(dead) not in str(ei.value) and c.id in str(ei.value)
    finally:
        await c.close()
