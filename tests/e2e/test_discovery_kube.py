"""Kubernetes discovery's list + watch loop (shepherd.node.discovery.kube) through lightkube against a
local API server stand-in (tests/kube_standin.py, real HTTP on loopback): the list, then watch events
resumed from its resourceVersion; a dropped watch resumed from the last version seen; 410 Gone (an
expired version) answered by a new list; readiness flips; a refused add retried.

The sink records what discovery asks of the node; tests/e2e/test_discovery_node.py drives real nodes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from lightkube import AsyncClient, KubeConfig

from shepherd.node.discovery import kube
from shepherd.node.discovery.kube import PodDiscovery
from shepherd.node.discovery.pods import DiscoverySettings, Target
from shepherd.proto.openai_errors import ApiError
from tests.kube_standin import KubeApiStandIn, make_pod

SETTINGS = DiscoverySettings({"app": "engine"}, {}, {}, port=8000, default_model="m")
LABELS = {"app": "engine"}


class Sink:
    def __init__(self, refuse: int = 0) -> None:
        self.workers: dict[str, Target] = {}
        self.log: list[tuple[str, str]] = []
        self.refuse = refuse  # refuse this many adds first (as a 429 from the probe budget would)

    async def add(self, t: Target) -> None:
        if self.refuse > 0:
            self.refuse -= 1
            self.log.append(("refused", t.url))
            raise ApiError(429, "Too many new workers failed their first check lately; retry later.")
        self.log.append(("add", t.url))
        self.workers[t.url] = t

    async def remove(self, t: Target) -> None:
        self.log.append(("remove", t.url))
        self.workers.pop(t.url, None)

    async def close(self) -> None:
        self.log.append(("close", ""))


async def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` (bounded; the deadline only guards against a hang)."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def pod(name: str, port: int, **kw: object) -> dict[str, object]:
    return make_pod(name, labels=LABELS, annotations={"smg.ai/worker-ports": str(port)}, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def api() -> AsyncIterator[KubeApiStandIn]:
    server = KubeApiStandIn()
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def client_for(api: KubeApiStandIn, tmp_path: Path) -> AsyncClient:
    return AsyncClient(KubeConfig.from_file(api.kubeconfig(tmp_path / "kubeconfig")))


async def call(fn: Callable[..., object], *args: object) -> object:
    return await asyncio.to_thread(fn, *args)


async def test_list_then_watch_follows_pods_and_readiness(api: KubeApiStandIn, tmp_path: Path) -> None:
    await call(api.put_pod, pod("e0", 9000))
    await call(api.put_pod, pod("e1", 9001, ready=False))
    await call(api.put_pod, make_pod("other", labels={"app": "db"}))
    listed_at = api.version
    sink = Sink()
    d = PodDiscovery(client_for(api, tmp_path), SETTINGS, sink)
    d.start()
    try:
        await asyncio.wait_for(d.synced.wait(), 20)
        assert set(sink.workers) == {"grpc://127.0.0.1:9000"}  # e1 not ready, "other" not selected
        # the kubeconfig's namespace is the one listed, and the only one whose pods may offer workers
        assert d.namespace == "default" and d.tracker.settings.namespace == "default"
        assert {path for path, _ in api.requests} == {"/api/v1/namespaces/default/pods"}
        await until(lambda: len(api.watch_requests()) == 1, "the watch")
        (w,) = api.watch_requests()
        assert w["resourceVersion"] == str(listed_at) and w["labelSelector"] == "app=engine"
        assert api.list_requests()[0]["labelSelector"] == "app=engine"
        # readiness flips on: added; a new pod: added; readiness off: removed; deleted: removed
        await call(api.put_pod, pod("e1", 9001))
        await call(api.put_pod, pod("e2", 9002))
        await until(lambda: len(sink.workers) == 3, "e1 and e2 added")
        await call(api.put_pod, pod("e0", 9000, ready=False))
        await until(lambda: "grpc://127.0.0.1:9000" not in sink.workers, "e0 removed when not ready")
        await call(api.delete_pod, "e2")
        await until(lambda: set(sink.workers) == {"grpc://127.0.0.1:9001"}, "e2 removed when deleted")
        assert sink.workers["grpc://127.0.0.1:9001"] == Target("grpc://127.0.0.1:9001", "m")
        assert len(api.list_requests()) == 1 and d.stats.watch_errors == 0
    finally:
        await d.close()


async def test_a_dropped_watch_resumes_from_the_last_version(api: KubeApiStandIn, tmp_path: Path) -> None:
    await call(api.put_pod, pod("e0", 9000))
    sink = Sink()
    d = PodDiscovery(client_for(api, tmp_path), SETTINGS, sink)
    d.start()
    try:
        await asyncio.wait_for(d.synced.wait(), 20)
        await call(api.put_pod, pod("e1", 9001))
        await until(lambda: len(sink.workers) == 2, "e1 added")
        seen = api.version
        assert d.resource_version == str(seen)
        assert await call(api.drop_watches) == 1
        # while the watch is down: e0 deleted, e2 created; both arrive through the resumed watch
        await call(api.delete_pod, "e0")
        await call(api.put_pod, pod("e2", 9002))
        await until(
            lambda: set(sink.workers) == {"grpc://127.0.0.1:9001", "grpc://127.0.0.1:9002"}, "caught up"
        )
        resumed = api.watch_requests()[1]
        assert resumed["resourceVersion"] == str(seen)  # resumed, not relisted
        assert len(api.list_requests()) == 1
        assert d.stats.watch_errors >= 1 and d.stats.relists_gone == 0
    finally:
        await d.close()


async def test_410_gone_lists_again_and_the_listing_wins(api: KubeApiStandIn, tmp_path: Path) -> None:
    await call(api.put_pod, pod("e0", 9000))
    await call(api.put_pod, pod("e1", 9001))
    sink = Sink()
    d = PodDiscovery(client_for(api, tmp_path), SETTINGS, sink)
    d.start()
    try:
        await asyncio.wait_for(d.synced.wait(), 20)
        assert len(sink.workers) == 2
        await until(lambda: api.open_watches() == 1, "the watch open")
        # the watch is cut and cannot come back (503s) while e0 goes, e3 comes and the history is
        # compacted past our version; then the resumed watch gets 410 Gone
        api.hold_watches = True
        await call(api.drop_watches)
        await call(api.delete_pod, "e0")
        await call(api.put_pod, pod("e3", 9003))
        await call(api.compact)
        api.hold_watches = False
        await until(lambda: len(api.list_requests()) == 2, "a second list after 410 Gone")
        await until(
            lambda: set(sink.workers) == {"grpc://127.0.0.1:9001", "grpc://127.0.0.1:9003"}, "relisted"
        )
        assert d.stats.relists_gone == 1
        assert all(
            q["resourceVersion"] == api.watch_requests()[0]["resourceVersion"]
            for q in api.watch_requests()[:-1]
        )
        # the watch after the relist starts from the new listing's version, and events flow again
        await call(api.put_pod, pod("e4", 9004))
        await until(lambda: "grpc://127.0.0.1:9004" in sink.workers, "e4 after the relist")
        assert api.watch_requests()[-1]["resourceVersion"] != api.watch_requests()[0]["resourceVersion"]
    finally:
        await d.close()


async def test_a_refused_add_is_retried_while_the_pod_offers_it(
    api: KubeApiStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "RETRY_ADDS_S", 0.05)
    await call(api.put_pod, pod("e0", 9000))
    sink = Sink(refuse=2)
    d = PodDiscovery(client_for(api, tmp_path), SETTINGS, sink)
    d.start()
    try:
        await until(lambda: "grpc://127.0.0.1:9000" in sink.workers, "e0 added after two refusals")
        assert sink.log[:3] == [("refused", "grpc://127.0.0.1:9000")] * 2 + [("add", "grpc://127.0.0.1:9000")]
        assert d.stats.add_failures == 2
        # refused again, then the pod goes away: the retry is dropped, nothing is added later
        sink.refuse = 1000
        await call(api.put_pod, pod("e1", 9001))
        await until(lambda: ("refused", "grpc://127.0.0.1:9001") in sink.log, "e1 refused")
        await call(api.delete_pod, "e1")
        await until(lambda: "grpc://127.0.0.1:9001" not in d.tracker.active, "e1 gone")
        refused = sink.log.count(("refused", "grpc://127.0.0.1:9001"))
        await asyncio.sleep(0.3)  # several retry periods: no more attempts for a pod that is gone
        assert sink.log.count(("refused", "grpc://127.0.0.1:9001")) == refused
        # never added, so never removed (a worker at that URL from flags or the admin API would stay)
        assert ("remove", "grpc://127.0.0.1:9001") not in sink.log
    finally:
        await d.close()


async def test_api_errors_back_off_and_recover(api: KubeApiStandIn, tmp_path: Path) -> None:
    """A 403 (no RBAC grant yet) is retried with a jittered, doubling, capped back-off; once allowed,
    discovery lists and the back-off starts over."""
    api.forbidden.add("default")
    await call(api.put_pod, pod("e0", 9000))
    delays: list[float] = []

    async def sleep(s: float) -> None:
        delays.append(s)
        await asyncio.sleep(0.01)

    sink = Sink()
    d = PodDiscovery(client_for(api, tmp_path), SETTINGS, sink, rng=random.Random(7), sleep=sleep)
    d.start()
    try:
        await until(lambda: d.stats.watch_errors >= 9, "repeated 403s")
        backoffs = [x for x in delays if x != kube.RETRY_ADDS_S][:9]
        caps = [min(kube.BACKOFF_MAX_S, kube.BACKOFF_MIN_S * 2**i) for i in range(9)]
        assert all(c / 2 <= x <= c for x, c in zip(backoffs, caps, strict=True)), backoffs
        assert max(backoffs) <= kube.BACKOFF_MAX_S and not sink.workers and not d.synced.is_set()
        api.forbidden.clear()
        await asyncio.wait_for(d.synced.wait(), 20)
        assert set(sink.workers) == {"grpc://127.0.0.1:9000"}
        assert d._backoff == kube.BACKOFF_MIN_S
    finally:
        await d.close()
