"""End to end: routing state of a node — KV events from real mock engines feed the prefix index (both
gRPC transports), a policy per model, direct routing by ``x-smg-target-worker``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from shepherd.node.config import ConfigError, build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.kv_feed import BackoffConfig, WorkerKvState, feed_index_of
from shepherd.node.dispatch.workers import Worker
from shepherd.node.engines.http import HttpRelayClient
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.prefix_index import PrefixIndex
from shepherd.policies.simple import RoundRobin
from shepherd.proto.engine_types import EngineComplete, GenerateRequest, SamplingParams
from tests.e2e.node_procs import running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MODEL = "qwen3"


async def until(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``cond`` (a hang guard: the deadline only bounds the wait, nothing is timed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def gateway(
    urls: list[str], transport: str, policy: str = "cache_aware", backoff: BackoffConfig | None = None
) -> AsyncIterator[Gateway]:
    cfg = build_config(
        {},
        {
            "worker_urls": urls,
            "model_id": MODEL,
            "policy": policy,
            "engine_transport": transport,
            "tokenizer_workers": 0,
        },
    )
    gw = Gateway(cfg)
    if backoff is not None:
        gw.kv_feed.backoff = backoff
    await gw.start()
    try:
        yield gw
    finally:
        await gw.close()


async def generate(gw: Gateway, rid: str, ids: list[int], out: int) -> list[int]:
    req = GenerateRequest(rid, ids, SamplingParams(max_new_tokens=out, ignore_eos=True), stream=True)
    s = await gw.open_stream(MODEL, req)
    got: list[int] = []
    try:
        async for batch in s.batches():
            for ev in batch:
                got += list(ev.token_ids) if not isinstance(ev, EngineComplete) else list(ev.output_ids)
                if isinstance(ev, EngineComplete):
                    s.completed = True
    finally:
        await s.close()
    return got


def index_of(gw: Gateway) -> PrefixIndex:
    policy = gw.policy_for(MODEL)
    assert isinstance(policy, CacheAware)
    return policy.index(MODEL)


class EngineSlot:
    """A mock engine that a test may restart on the same ports (a new process: a new engine life)."""

    def __init__(self, engine: MockEngineProc) -> None:
        self.engine = engine

    def restart(self) -> None:
        old = self.engine
        old.stop()
        self.engine = start_mock_engine(
            "--zero-latency",
            "--cache-blocks",
            "256",
            "--grpc-port",
            str(old.grpc_port),
            "--http-port",
            str(old.http_port),
        )


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MockEngineProc, EngineSlot]]:
    """This module's two mock engines, started side by side: one with a 48-block pool (each test leaves
    it flushed), one in a slot a test may restart."""
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(start_mock_engine, "--zero-latency", "--cache-blocks", "48"),
            pool.submit(start_mock_engine, "--zero-latency", "--cache-blocks", "256"),
        ]
    started = [f.result() for f in futs if f.exception() is None]
    if len(started) < 2:
        for eng in started:
            eng.stop()
        raise next(err for f in futs if (err := f.exception()) is not None)
    slot = EngineSlot(started[1])
    try:
        yield started[0], slot
    finally:
        started[0].stop()
        slot.engine.stop()


@pytest.fixture(scope="module")
def small_engine(engines: tuple[MockEngineProc, EngineSlot]) -> MockEngineProc:
    return engines[0]


@pytest.fixture(scope="module")
def slot(engines: tuple[MockEngineProc, EngineSlot]) -> EngineSlot:
    return engines[1]


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 50_000 for i in range(n)]


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_kv_events_feed_the_index_and_evictions_leave_it(
    transport: str, small_engine: MockEngineProc
) -> None:
    eng = small_engine
    async with gateway([f"grpc://{eng.grpc_target}"], transport) as gw:
        (w,) = gw.registry.workers.values()
        ix = index_of(gw)
        state: WorkerKvState = gw.kv_feed.states[w.id]
        # capacity: the engine's pool (GetServerInfo), not the default
        await until(lambda: ix.capacity(w.id) == 48, "the engine's capacity")

        first = prompt(1, 200)  # 12 full blocks; routing inserts those
        out = await generate(gw, "r1", first, 40)
        full = first + out  # the engine caches prompt + output: 15 blocks, known only from events
        await until(lambda: ix.match(full).get(w.id) == 240, "the engine's stored blocks in the index")
        assert state.stats.stored_blocks >= 15 and state.cursor.last >= 1

        # other prompts push the first one out of the 48-block pool: its blocks leave the index
        for i in range(2, 6):
            await generate(gw, f"r{i}", prompt(i, 200), 8)
        await until(lambda: state.stats.removed_blocks > 0, "removed events")
        await until(lambda: ix.match(full).get(w.id, 0) < 240, "evicted blocks out of the index")

        # a cache flush on the engine ("all cleared") empties the worker in the index
        flush = await asyncio.to_thread(httpx.post, eng.http_url + "/mock/flush_cache", timeout=5)
        assert flush.status_code == 200
        await until(lambda: ix.worker_blocks(w.id) == 0, "the worker cleared")

        # a removed worker is no longer fed, and its entries are gone
        await generate(gw, "r9", prompt(9, 64), 4)
        await until(lambda: ix.worker_blocks(w.id) > 0, "entries again")
        await gw.registry.remove(w.id)
        assert not gw.kv_feed.running(w.id) and ix.worker_blocks(w.id) == 0


async def test_feed_survives_an_engine_restart(slot: EngineSlot) -> None:
    eng = slot.engine
    async with gateway([f"grpc://{eng.grpc_target}"], "h2", backoff=BackoffConfig(max_s=0.3)) as gw:
        (w,) = gw.registry.workers.values()
        ix = index_of(gw)
        state = gw.kv_feed.states[w.id]
        await until(lambda: state.stats.subscriptions >= 1, "a subscription")
        await generate(gw, "a", prompt(1, 100), 4)
        await until(lambda: state.stats.stored_blocks > 0, "stored events")
        await asyncio.to_thread(slot.restart)
        # the new engine counts from 1 again: the feed resets the worker, then follows it
        await until(lambda: state.stats.failures >= 1, "the stream lost")
        records = state.stats.records
        await until(lambda: state.stats.records > records, "a new subscription", timeout=30)
        # a health check that fell in the restart marked it unhealthy: the next one (5 s apart) brings it back
        await until(lambda: w.health.healthy, "healthy again", timeout=30)
        second = prompt(2, 100)
        await generate(gw, "b", second, 4)
        await until(lambda: state.cursor.resets >= 1, "a reset")
        await until(lambda: ix.match(second).get(w.id, 0) >= 96, "the new life's blocks")
        assert ix.match(prompt(1, 100)).get(w.id, 0) == 0


# ---- a policy per model ----------------------------------------------------------------------------


def fake_worker(gw: Gateway, wid: str, model: str) -> Worker:
    w = Worker(
        id=wid,
        url=f"grpc://127.0.0.1:{hash(wid) % 1000 + 4000}",
        model=model,
        client=HttpRelayClient("http://127.0.0.1:9"),  # never called: pick only
        health=HealthTracker(healthy=True, checked=True),
        breaker=CircuitBreaker(failure_threshold=1, success_threshold=1, open_secs=10),
    )
    gw.registry.workers[wid] = w
    return w


def test_each_model_has_its_own_policy_instance_and_state() -> None:
    models: list[dict[str, Any]] = [
        {"name": "sticky", "model_path": "x", "policy": "cache_aware"},
        {"name": "cycled", "model_path": "x", "policy": "round_robin"},
        {"name": "default1", "model_path": "x"},
        {"name": "default2", "model_path": "x"},
    ]
    gw = Gateway(build_config({"models": models, "policy": "round_robin", "tokenizer_workers": 0}, {}))
    p = gw.policies
    assert isinstance(p["sticky"], CacheAware)
    assert all(isinstance(p[m], RoundRobin) for m in ("cycled", "default1", "default2"))
    assert len({id(x) for x in p.values()}) == 4  # one instance each
    sticky = p["sticky"]
    assert isinstance(sticky, CacheAware) and feed_index_of(sticky, "sticky") is sticky.index("sticky")
    assert feed_index_of(p["cycled"], "cycled") is None  # no index, so no KV feed for its workers
    for m in ("sticky", "cycled", "default1", "default2"):
        for i in range(3):
            fake_worker(gw, f"{m}-{i}", m)
    ids = list(range(64))

    def picks(model: str, n: int) -> list[str]:
        out = []
        for _ in range(n):
            w = gw.pick(model, set(), ids, None, http=True)
            assert w is not None and w.model == model
            out.append(w.id)
        return out

    assert len(set(picks("sticky", 4))) == 1  # the same prompt stays on its holder
    assert picks("cycled", 3) == ["cycled-0", "cycled-1", "cycled-2"]
    # default1's cursor is its own: cycling "cycled" did not move it
    assert picks("default1", 2) == ["default1-0", "default1-1"]
    assert picks("default2", 1) == ["default2-0"]


def test_an_unknown_model_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="fastest"):
        build_config({"models": [{"name": "m", "model_path": "x", "policy": "fastest"}]}, {})


# ---- direct routing --------------------------------------------------------------------------------


def received(engine: MockEngineProc) -> int:
    n: int = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()["requests_received"]
    return n


def test_target_worker_header_routes_directly(small_engine: MockEngineProc, slot: EngineSlot) -> None:
    e1, e2 = small_engine, slot.engine
    before = (received(e1), received(e2))
    with (
        running_node(
            "--worker-urls", f"grpc://{e1.grpc_target}", f"grpc://{e2.grpc_target}", "--model-id", MODEL
        ) as node,
    ):
        c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
        msgs: Any = [{"role": "user", "content": "Hello there."}]
        url2 = f"grpc://{e2.grpc_target}"
        for _ in range(3):
            c.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=2, extra_headers={"x-smg-target-worker": url2}
            )
        wid2 = next(
            w["id"] for w in httpx.get(node.url + "/workers", timeout=5).json()["workers"] if w["url"] == url2
        )
        c.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, extra_headers={"x-smg-target-worker": wid2}
        )
        assert (received(e1) - before[0], received(e2) - before[1]) == (0, 4)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(
                model=MODEL,
                messages=msgs,
                max_tokens=2,
                extra_headers={"x-smg-target-worker": "grpc://nope:1"},
            )
