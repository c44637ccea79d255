"""How discovery's decisions reach the node (shepherd.node.discovery.kube.GatewaySink): a worker leaving
with requests in flight is drained (no new request at once, removed when they are done or at the drain
bound), without holding up the decisions after it; re-adding its URL meanwhile ends the drain."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from shepherd.node.discovery.kube import GatewaySink
from shepherd.node.discovery.pods import Target
from shepherd.node.dispatch.circuit_breaker import HealthTracker
from shepherd.proto.engine_types import worker_id

URL = "grpc://10.0.0.1:8000"


@dataclass
class FakeWorker:
    id: str
    url: str
    model: str
    in_flight: int = 0
    health: HealthTracker = field(default_factory=HealthTracker)


@dataclass
class FakeRegistry:
    """The part of WorkerRegistry the sink uses: add / remove / get and the health hook."""

    workers: dict[str, FakeWorker] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    health_changes: list[bool] = field(default_factory=list)

    def on_health_change(self, w: FakeWorker) -> None:
        self.health_changes.append(w.health.healthy)

    def get(self, wid: str) -> FakeWorker | None:
        return self.workers.get(wid)

    async def add(self, url: str, model: str) -> FakeWorker:
        w = self.workers.get(worker_id(url))
        if w is None:
            w = self.workers[worker_id(url)] = FakeWorker(worker_id(url), url, model)
            w.health.observe(True)
            self.log.append(("add", url))
        return w

    async def remove(self, wid: str) -> FakeWorker | None:
        w = self.workers.pop(wid, None)
        if w is not None:
            self.log.append(("remove", w.url))
        return w


@dataclass
class FakeGateway:
    registry: FakeRegistry = field(default_factory=FakeRegistry)
    pd: Any = None


async def until(cond: Any, what: str) -> None:
    for _ in range(500):  # bounded: 10 s at most
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_an_idle_worker_leaves_at_once() -> None:
    gw = FakeGateway()
    sink = GatewaySink(cast(Any, gw))
    await sink.add(Target(URL, "m"))
    await sink.remove(Target(URL, "m"))
    assert gw.registry.log == [("add", URL), ("remove", URL)]


async def test_a_busy_worker_is_drained_then_removed() -> None:
    gw = FakeGateway()
    sink = GatewaySink(cast(Any, gw), drain_s=30)
    await sink.add(Target(URL, "m"))
    w = gw.registry.workers[worker_id(URL)]
    w.in_flight = 2
    await sink.remove(Target(URL, "m"))  # returns at once: the drain runs on its own
    assert not w.health.healthy and gw.registry.health_changes == [False]
    assert worker_id(URL) in gw.registry.workers  # still there: its requests are running
    for _ in range(5):  # good health checks meanwhile do not make it routable again
        w.health.observe(True)
    assert not w.health.healthy
    await asyncio.sleep(0.2)
    assert worker_id(URL) in gw.registry.workers
    w.in_flight = 0
    await until(lambda: worker_id(URL) not in gw.registry.workers, "removed once idle")
    assert gw.registry.log == [("add", URL), ("remove", URL)]
    await sink.close()


async def test_the_drain_is_bounded() -> None:
    gw = FakeGateway()
    sink = GatewaySink(cast(Any, gw), drain_s=0.2)
    await sink.add(Target(URL, "m"))
    gw.registry.workers[worker_id(URL)].in_flight = 1  # never finishes
    await sink.remove(Target(URL, "m"))
    await until(lambda: worker_id(URL) not in gw.registry.workers, "removed at the drain bound")


async def test_re_adding_a_draining_url_brings_it_back_fresh() -> None:
    gw = FakeGateway()
    sink = GatewaySink(cast(Any, gw), drain_s=30)
    await sink.add(Target(URL, "m"))
    old = gw.registry.workers[worker_id(URL)]
    old.in_flight = 1
    await sink.remove(Target(URL, "m"))
    await sink.add(Target(URL, "m"))  # the pod is ready again
    new = gw.registry.workers[worker_id(URL)]
    assert new is not old and new.health.healthy
    assert gw.registry.log == [("add", URL), ("remove", URL), ("add", URL)]
    await sink.close()
    assert gw.registry.workers == {worker_id(URL): new}  # closing ends drains only


async def test_the_worker_allowlist_applies_to_discovered_workers() -> None:
    """A selected, ready pod whose IP ``--worker-allow`` does not cover is refused (400, nothing
    registered, nothing dialed), as the admin API's adds are; one inside it is registered."""
    from shepherd.node.config import build_config  # not at the top: only this test needs a real registry
    from shepherd.node.dispatch.workers import WorkerRegistry  # not at the top: as above
    from shepherd.proto.openai_errors import ApiError  # not at the top: as above

    with socket.socket() as s:  # a loopback port nothing listens on: the first check fails at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cfg = build_config({}, {"worker_allow": ["127.0.0.0/8"], "health_check_timeout_secs": 0.5})
    reg = WorkerRegistry(cfg)
    sink = GatewaySink(cast(Any, FakeGateway(registry=cast(Any, reg))))
    try:
        with pytest.raises(ApiError) as ei:
            await sink.add(Target("grpc://10.0.0.1:8000", "m"))
        assert ei.value.status == 400 and ei.value.code == "worker_not_allowed"
        assert reg.workers == {}
        allowed = f"grpc://127.0.0.1:{closed}"
        await sink.add(Target(allowed, "m"))
        assert set(reg.workers) == {worker_id(allowed)}
    finally:
        await sink.close()
        await reg.close()


@dataclass
class FakePools:
    """The part of PdRouter the sink uses: its pools and their join / leave."""

    prefill_ids: frozenset[str] = frozenset()
    decode_ids: frozenset[str] = frozenset()

    def join_pool(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        if role == "prefill":
            self.prefill_ids |= {worker_id(url)}
        else:
            self.decode_ids |= {worker_id(url)}

    def leave_pool(self, url: str) -> None:
        self.prefill_ids -= {worker_id(url)}
        self.decode_ids -= {worker_id(url)}

    def role_of(self, wid: str) -> str:
        return "prefill" if wid in self.prefill_ids else "decode" if wid in self.decode_ids else "regular"


async def test_a_relabelled_pod_moves_to_its_new_pool() -> None:
    """A pod whose PD role label changed leaves its pool (and the registry) and joins the new one, fresh:
    never in both pools (each would route to it in its own role)."""
    pools = FakePools()
    gw = FakeGateway(pd=pools)
    sink = GatewaySink(cast(Any, gw))
    await sink.add(Target(URL, "m", role="prefill"))
    await sink.add(Target(URL, "m", role="prefill"))  # (the same again: nothing moves)
    assert (set(pools.prefill_ids), set(pools.decode_ids)) == ({worker_id(URL)}, set())
    await sink.add(Target(URL, "m", role="decode"))
    assert (set(pools.prefill_ids), set(pools.decode_ids)) == (set(), {worker_id(URL)})
    assert gw.registry.log == [("add", URL), ("remove", URL), ("add", URL)]
