"""Rate limits with Redis as the counter store (``--rate-limit-backend redis``), against a real
redis-server (tests.services; skipped only where it cannot be installed, a failure under CI=true):
limits held across two nodes' ``Admission``s sharing one Redis (rpm, tpm with refunds, concurrency and
its lease), the sliding window, the same answers as the mesh backend, and Redis going away (stopped by
pid, or answering nothing) and coming back: the fallback rule, limit / N on the node's own counts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from shepherd.node.api.admission import Admission, RateLimited, Ticket
from shepherd.node.api.ratelimit_redis import PROBE_S, redacted
from shepherd.node.config import ConfigError, RateLimitRule, build_config
from shepherd.node.observe import logs
from tests.services import Service, redis_service, service_or_skip

WINDOW = 60.0
T0 = 6000.0  # a window boundary (100 x 60 s)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _redis(url: str, prefix: str, clock: Clock, node: str, *rules: RateLimitRule, **kw: float) -> Admission:
    settings = {
        "url": url,
        "prefix": prefix,
        "timeout": kw.pop("timeout", 0.5),
        "lease": kw.pop("lease", 30.0),
    }
    return Admission(rules, node=node, gen=1, token_estimate=100, clock=clock, redis=settings)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def pair(redis_service_: Service, prefix: str) -> AsyncIterator[tuple[Clock, Admission, Admission]]:
    """Two nodes' admissions on one Redis, one clock (the tests move it)."""
    clock = Clock()
    rules = (
        RateLimitRule("a", None, 5, None, None),
        RateLimitRule("t", None, None, 1000, None),
        RateLimitRule("c", None, None, None, 2),
        RateLimitRule("s", None, 10, None, None),
    )
    one = _redis(redis_service_.url, prefix, clock, "n1", *rules)
    two = _redis(redis_service_.url, prefix, clock, "n2", *rules)
    yield clock, one, two
    await one.close()
    await two.close()


async def _try(a: Admission, tenant: str, prompt: int = 1, out: int | None = 1) -> Ticket | RateLimited:
    try:
        return await a.admit_async(tenant, "m", prompt, out)
    except RateLimited as e:
        return e


async def test_requests_per_minute_hold_across_two_nodes(pair: tuple[Clock, Admission, Admission]) -> None:
    _, one, two = pair
    got = [await _try(one if i % 2 else two, "a") for i in range(8)]
    assert [isinstance(g, Ticket) for g in got] == [True] * 5 + [False] * 3
    assert one.admitted + two.admitted == 5 and one.backend is not None and one.backend.fallbacks == 0
    first = got[0]
    assert isinstance(first, Ticket)
    assert first.headers["x-ratelimit-limit-requests"] == "5"
    assert first.headers["x-ratelimit-remaining-requests"] == "4"
    last = got[4]
    assert isinstance(last, Ticket) and last.headers["x-ratelimit-remaining-requests"] == "0"
    e = got[5]
    assert isinstance(e, RateLimited) and e.status == 429 and e.code == "rate_limit_exceeded"
    assert "Rate limit reached for requests per min (RPM) of tenant 'a': Limit 5, Used 5" in e.message
    # the window must end and a fifth of the next one pass before one of the 5 has slid out: 72 s
    assert e.headers["retry-after"] == "72" and e.headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant has its own count
    assert isinstance(await _try(two, "s"), Ticket)


async def test_the_sliding_window(pair: tuple[Clock, Admission, Admission]) -> None:
    clock, one, two = pair
    assert await _admitted(one, "s", 10) == 10
    assert isinstance(await _try(two, "s"), RateLimited)
    clock.t = T0 + WINDOW * 1.5  # half way through the next window: the estimate is 10 x 0.5 = 5
    got = [await _try(two if i % 2 else one, "s") for i in range(7)]
    assert [isinstance(g, Ticket) for g in got] == [True] * 5 + [False] * 2
    e = got[5]
    assert isinstance(e, RateLimited)
    # 10 requests of the last window weigh 0.5: the next one fits when 1 of them has slid out: 6 s
    assert e.headers["retry-after"] == "6"
    clock.t = T0 + WINDOW * 3  # two windows later nothing counts any more
    assert await _admitted(two, "s", 10) == 10


async def test_same_answers_as_the_mesh_backend(redis_service_: Service, prefix: str) -> None:
    """A lone node: the mesh's limiter and Redis see the same counts, so they answer the same."""
    rules = (RateLimitRule("x", None, 4, 900, None), RateLimitRule("x", "m", None, 500, None))
    clock = Clock(T0 + 12.0)
    mesh = Admission(rules, node="n0", gen=1, token_estimate=100, clock=clock)
    red = _redis(redis_service_.url, prefix, clock, "n0", *rules)
    try:
        for prompt, out, settle in (
            (100, 100, 150),
            (100, 200, None),
            (50, 10, 60),
            (30, 30, 20),
            (600, 1, 0),
        ):
            clock.t += 3.0
            want: Ticket | RateLimited
            try:
                want = mesh.admit("x", "m", prompt, out)
            except RateLimited as e:
                want = e
            got = await _try(red, "x", prompt, out)
            assert type(got) is type(want)
            if isinstance(want, RateLimited):
                assert isinstance(got, RateLimited)
                assert (got.message, got.headers) == (want.message, want.headers)
                continue
            assert isinstance(got, Ticket)
            assert got.headers == want.headers
            want.settle(settle)
            got.settle(settle)
            assert red.backend is not None
            await red.backend.flush()
    finally:
        await red.close()


async def test_tokens_reserved_then_refunded_across_nodes(pair: tuple[Clock, Admission, Admission]) -> None:
    _, one, two = pair
    t1 = await _try(one, "t", 100, 500)  # 600 reserved of 1000
    assert isinstance(t1, Ticket) and t1.headers["x-ratelimit-remaining-tokens"] == "400"
    e = await _try(two, "t", 100, 700)  # 800 more does not fit
    assert isinstance(e, RateLimited) and "tokens per min (TPM)" in e.message and "Used 600" in e.message
    t1.settle(150)  # the request used 150: 450 refunded, in Redis by the background task
    assert one.backend is not None
    await one.backend.flush()
    t2 = await _try(two, "t", 100, 700)
    assert isinstance(t2, Ticket) and t2.headers["x-ratelimit-remaining-tokens"] == "50"
    t2.settle(900)  # used more than reserved: the excess counts too
    assert two.backend is not None
    await two.backend.flush()
    big = await _try(one, "t", 1, 60)
    assert isinstance(big, RateLimited) and "Used 1050" in big.message
    huge = await _try(one, "t", 900, 200)  # over the limit itself: never fits, no Retry-After
    assert isinstance(huge, RateLimited) and "too large" in huge.message and "retry-after" not in huge.headers


async def test_concurrency_across_nodes_and_the_lease(pair: tuple[Clock, Admission, Admission]) -> None:
    clock, one, two = pair
    a = await _try(one, "c")
    b = await _try(two, "c")
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    e = await _try(one, "c")
    assert isinstance(e, RateLimited) and "Too many concurrent requests for tenant 'c': Limit 2" in e.message
    a.settle(None)
    assert one.backend is not None and two.backend is not None
    await one.backend.flush()
    c = await _try(two, "c")
    assert isinstance(c, Ticket)
    assert isinstance(await _try(one, "c"), RateLimited)
    # node two keeps its requests alive by renewing their slots; were it to crash, they would expire
    clock.t += 25.0
    await two.backend.renew()
    clock.t += 25.0  # 50 s after admission, 25 s after the renewal: still counted
    assert isinstance(await _try(one, "c"), RateLimited)
    clock.t += 31.0  # past the lease since the last renewal: node two's slots no longer count
    x = await _try(one, "c")
    y = await _try(one, "c")
    assert isinstance(x, Ticket) and isinstance(y, Ticket)
    assert isinstance(await _try(one, "c"), RateLimited)


async def _admitted(a: Admission, tenant: str, n: int) -> int:
    """Of ``n`` requests one after the other, how many were admitted."""
    return sum([isinstance(await _try(a, tenant), Ticket) for _ in range(n)])


def _kill(svc: Service) -> None:
    os.kill(svc.pid, signal.SIGKILL)


async def _until_up(a: Admission) -> None:
    assert a.backend is not None
    for _ in range(int(10 / 0.05)):  # bounded: a probe every PROBE_S
        if a.backend.up:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("Redis did not come back within 10 s")


async def test_redis_down_then_back(prefix: str) -> None:
    """Redis stopped by pid: the node admits limit / N on its own counts (N = 3: the mesh's size), never
    unlimited, counts each fallback; Redis back on its port: it decides again, holding what the node
    admitted while it was away."""
    rule = RateLimitRule("f", None, 30, None, None)
    clock = Clock(T0 + 6.0)
    with service_or_skip("Redis", redis_service) as svc:
        a = _redis(svc.url, prefix, clock, "n0", rule)
        try:
            a.limiter.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "suspect")], clock.t)
            assert a.limiter.cluster_size == 3 and a.limiter.reachable == 1
            assert await _admitted(a, "f", 4) == 4
            _kill(svc)
            got = [await _try(a, "f") for _ in range(10)]
            # its share is 30 / 3 = 10, and 4 of it were admitted through Redis: 6 more
            assert [isinstance(g, Ticket) for g in got] == [True] * 6 + [False] * 4
            assert a.backend is not None and not a.backend.up
            assert a.backend.fallbacks == 10 and a.backend.errors >= 1
            e = got[-1]
            assert isinstance(e, RateLimited) and e.headers["x-ratelimit-limit-requests"] == "30"
            metrics = {m.name: m.samples[0].value for m in a.collect() if m.samples}
            assert metrics["smg_rate_limit_redis_fallbacks"] == 10 and metrics["smg_rate_limit_redis_up"] == 0
            with redis_service(port=svc.port) as back:  # an empty Redis where the old one was
                await _until_up(a)
                r = aioredis.Redis.from_url(back.url)
                try:  # the 6 admitted while it was away were added to its window
                    keys = [k async for k in r.scan_iter(f"{prefix}{{*")]  # the windows, not the presence
                    assert len(keys) == 1 and await r.hget(keys[0], "r") == b"6"
                finally:
                    await r.aclose()
                got = [await _try(a, "f") for _ in range(26)]
                assert [isinstance(g, Ticket) for g in got] == [True] * 24 + [False] * 2
                assert a.backend.fallbacks == 10
                # settlements reach the new Redis too (its script cache was empty): 2 reserved, 5 used
                t = got[0]
                assert isinstance(t, Ticket)
                t.settle(5)
                await a.backend.flush()
                r = aioredis.Redis.from_url(back.url)
                try:
                    assert await r.hmget(keys[0], ["r", "t"]) == [b"30", b"63"]  # (6 + 24) x 2 + 3
                finally:
                    await r.aclose()
                assert a.backend.settles_dropped == 0
        finally:
            await a.close()


async def test_what_the_fallback_admitted_is_repaid_at_its_real_usage(prefix: str) -> None:
    """A request admitted by the fallback rule and settled while Redis is away owes Redis its real
    usage, not its reservation: the tenant is not charged max_tokens once Redis is back (a 1,010-token
    reservation that used 20 left 1,990 of 3,000, not 2,980)."""
    rule = RateLimitRule("g", None, None, 3000, None)
    clock = Clock(T0 + 6.0)
    with service_or_skip("Redis", redis_service) as svc:
        a = _redis(svc.url, prefix, clock, "n0", rule)
        try:
            assert isinstance(await _try(a, "g", 10, 10), Ticket)  # through Redis
            _kill(svc)
            t = await _try(a, "g", 10, 1000)
            assert isinstance(t, Ticket) and a.backend is not None and not a.backend.up
            t.settle(20)
            with redis_service(port=svc.port):  # an empty Redis where the old one was
                await _until_up(a)
                assert isinstance(await _try(a, "g", 10, 2900), Ticket)
        finally:
            await a.close()


async def test_nodes_without_a_mesh_split_the_limit_while_redis_is_down(prefix: str) -> None:
    """Two nodes sharing Redis but no mesh (each counts N = 1 on its own): the presence set tells each
    that two count in Redis, so while Redis is down each admits 30 / 2 on its own counts, not 30; a node
    that closes leaves the set."""
    rule = RateLimitRule("f", None, 30, None, None)
    clock = Clock(T0 + 6.0)
    with service_or_skip("Redis", redis_service) as svc:
        a = _redis(svc.url, prefix, clock, "n0", rule)
        b = _redis(svc.url, prefix, clock, "n1", rule)
        c = _redis(svc.url, prefix, clock, "n2", rule)
        try:
            for x in (a, b, c):
                assert x.backend is not None
                await x.backend.start()
            await c.close()  # leaves: two remain
            for x in (a, b):
                assert x.backend is not None
                await x.backend.announce()
                assert x.backend.nodes_seen == 2 and x.limiter.cluster_size == 2
            assert await _admitted(a, "f", 4) == 4
            _kill(svc)
            # a's share is 30 / 2 = 15, 4 of it admitted through Redis: 11 more; b's 15, none yet
            assert await _admitted(a, "f", 20) == 11
            assert await _admitted(b, "f", 20) == 15
        finally:
            await a.close()
            await b.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a Redis that hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


async def test_a_hanging_redis_costs_one_timeout_then_the_fallback(silent_port: int) -> None:
    clock = Clock()
    a = _redis(
        f"redis://127.0.0.1:{silent_port}/0",
        "x:",
        clock,
        "n0",
        RateLimitRule("h", None, 2, None, None),
        timeout=0.2,
    )
    try:
        got = [await _try(a, "h") for _ in range(4)]
        assert [isinstance(g, Ticket) for g in got] == [True, True, False, False]  # N = 1: the whole limit
        assert a.backend is not None and not a.backend.up
        assert a.backend.errors == 1 and a.backend.fallbacks == 4  # one call waited, the rest did not
        await asyncio.sleep(PROBE_S * 1.5)
        assert not a.backend.up and a.backend.errors >= 2  # the probe times out too, off the request path
        for g in got:
            if isinstance(g, Ticket):
                g.settle(None)
    finally:
        await a.close()


def test_config() -> None:
    url = "redis://user:s3cr3t-pw@127.0.0.1:6379/0"
    cfg = build_config({"rate_limit_backend": "redis", "rate_limit_redis_url": url, "rate_limit_rpm": 5}, {})
    a = Admission.from_config(cfg)
    assert a is not None and a.backend is not None and not a.admitting
    assert a.limiter.cfg.local and a.backend.target == "redis://127.0.0.1:6379/0" == redacted(url)
    assert "s3cr3t-pw" in logs.config_secrets(cfg, {})  # redacted from every log line
    with pytest.raises(TypeError):
        a.admit("x", "m", 1, 1)
    for bad in (
        {"rate_limit_backend": "redis"},
        {"rate_limit_backend": "etcd"},
        {"rate_limit_redis_url": url},
        {"rate_limit_backend": "redis", "rate_limit_redis_url": "http://user:s3cr3t-pw@h/"},
        {"rate_limit_backend": "redis", "rate_limit_redis_url": url, "rate_limit_redis_timeout_secs": 0},
        {"rate_limit_backend": "redis", "rate_limit_redis_url": url, "rate_limit_redis_lease_secs": 0.1},
    ):
        with pytest.raises(ConfigError) as ei:
            build_config(bad, {})
        assert "s3cr3t" not in str(ei.value)
    assert Admission.from_config(build_config({"rate_limit_rpm": 5}, {})).admitting  # type: ignore[union-attr]


async def test_the_mesh_tells_the_fallback_its_size_but_does_not_gossip_it(tmp_path: Path) -> None:
    from shepherd.node.cluster.mesh_node import RATE_LIMIT_COMPONENT, MeshNode  # not at the top: a mesh
    from shepherd.node.dispatch.gateway import Gateway  # not at the top: the gateway's imports are heavy

    def node(backend: str) -> tuple[Admission, MeshNode]:
        url = {"rate_limit_redis_url": "redis://127.0.0.1:1/0"} if backend == "redis" else {}
        over = {
            "tokenizer_workers": 0,
            "model_id": "m",
            "mesh_port": 0,
            "mesh_name": "a",
            "rate_limit_rpm": 9,
        }
        cfg = build_config({"rate_limit_backend": backend, **url}, {**over, "mesh_dev_pki": str(tmp_path)})
        adm = Admission.from_config(cfg, node="a")
        assert adm is not None
        return adm, MeshNode(cfg, Gateway(cfg), limiter=adm.limiter)

    adm, mesh = node("redis")
    assert mesh.state.component(RATE_LIMIT_COMPONENT) is None and not mesh.limiter_gossip
    adm.limiter.update_members([("a", "alive"), ("b", "alive"), ("c", "dead")], T0)
    assert (adm.limiter.reachable, adm.limiter.cluster_size) == (1, 3)  # counts alone, against 9 / 3
    await adm.close()
    adm, mesh = node("mesh")
    assert mesh.state.component(RATE_LIMIT_COMPONENT) is adm.limiter and mesh.limiter_gossip
