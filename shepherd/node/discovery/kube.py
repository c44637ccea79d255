"""The I/O shell of Kubernetes worker discovery: list + watch pods through lightkube, feed
``PodTracker`` (``shepherd.node.discovery.pods``) and apply its decisions to the node's workers.

- **List, then watch** from the list's ``resourceVersion``; every event's object carries the version to
  resume from. A watch the server ends cleanly is re-opened by lightkube from the last version; a
  dropped connection (or any other error) waits a back-off (0.5 s doubling to 30 s, jittered, reset by
  the next event) and resumes the watch from the last version; ``410 Gone`` (the version expired) lists
  again, and the listing replaces everything known (``PodTracker.resync``).
- **Applying** goes through ``WorkerSink``: for the node, ``GatewaySink`` registers workers exactly as
  ``POST /workers`` does (``WorkerRegistry.add``: URL checks, ``--worker-allow``, the first check, and in
  a mesh the registry bridge replicates it, so one node running discovery is enough for every node to
  route), and prefill / decode workers join their PD pool first. An add that fails (refused, probe
  budget) is retried every ``RETRY_ADDS_S`` while its pod still offers it; a worker leaving with
  requests in flight is drained first (``GatewaySink``).
- lightkube is an optional dependency (``pip install 'shepherd[k8s]'``); ``build_config`` refuses
  ``service_discovery`` without it, and it is imported here only when discovery starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from shepherd.node.config import NodeConfig
from shepherd.node.discovery.pods import (
    Decision,
    DiscoverySettings,
    ModelIdSource,
    PodTracker,
    Target,
    parse_selector,
)
from shepherd.node.metrics import counter, gauge
from shepherd.proto.engine_types import worker_id
from shepherd.proto.openai_errors import ApiError

if TYPE_CHECKING:  # annotations only: lightkube is optional (imported when discovery starts)
    from lightkube import AsyncClient

    from shepherd.node.dispatch.gateway import Gateway

log = logging.getLogger("shepherd.discovery")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
WATCH_SERVER_TIMEOUT_S = 300  # the API server ends each watch after this; lightkube re-opens it
RETRY_ADDS_S = 5.0  # failed adds are retried this often while their pod still offers them
DRAIN_S = 30.0  # a leaving worker's requests in flight get this long to finish


class WorkerSink(Protocol):
    async def add(self, t: Target) -> None: ...

    async def remove(self, t: Target) -> None: ...

    async def close(self) -> None: ...


class GatewaySink:
    """Applies decisions to a gateway's registry (the admin API's path) and its PD pools.

    A worker leaving with requests in flight (its pod terminating, or no longer ready) is drained first:
    it gets no new request at once (marked unhealthy for good), and leaves the registry, everywhere in a
    mesh, when its requests are done or after ``drain_s``, in a task of its own (the decisions after it
    are not held up). Adding the same URL again meanwhile ends the drain (the worker leaves, then comes
    back fresh)."""

    def __init__(self, gw: Gateway, drain_s: float = DRAIN_S) -> None:
        self.gw = gw
        self.drain_s = drain_s
        self._draining: dict[str, tuple[asyncio.Task[None], Target]] = {}

    async def add(self, t: Target) -> None:
        await self._end_drain(t.url)
        pd = self.gw.pd
        w = self.gw.registry.get(worker_id(t.url))
        if w is not None and pd is not None and pd.role_of(w.id) != t.role:
            # its pod's role changed (relabelled): it leaves its pool, and comes back fresh in the new one
            # (in both, the two pools would each route to it)
            await self.gw.registry.remove(w.id)
            pd.leave_pool(t.url)
        if t.role != "regular":
            if pd is None:
                raise ApiError(400, f"a {t.role} worker needs --pd-disaggregation", code="pd_off")
            pd.join_pool(t.url, t.role, t.bootstrap_port)
        try:
            await self.gw.registry.add(t.url, t.model)
        except BaseException:
            if pd is not None and t.role != "regular":
                pd.leave_pool(t.url)
            raise

    async def remove(self, t: Target) -> None:
        await self._end_drain(t.url)
        w = self.gw.registry.get(worker_id(t.url))
        if w is None or w.in_flight == 0 or self.drain_s <= 0:
            await self._leave(t)
            return
        # no new requests from now on: unhealthy, and no run of good checks makes it healthy again
        w.health.success_threshold = sys.maxsize
        if w.health.healthy:
            w.health.healthy = False
            if self.gw.registry.on_health_change is not None:
                self.gw.registry.on_health_change(w)
        self._draining[t.url] = (asyncio.create_task(self._drain(t, w.in_flight)), t)

    async def _drain(self, t: Target, in_flight: int) -> None:
        log.info("Kubernetes discovery: draining worker %s (%d requests in flight)", t.url, in_flight)
        w = self.gw.registry.get(worker_id(t.url))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while w is not None and w.in_flight > 0 and loop.time() < deadline:  # noqa: ASYNC110 - polled, bounded
            await asyncio.sleep(0.05)
        self._draining.pop(t.url, None)
        await self._leave(t)

    async def _leave(self, t: Target) -> None:
        await self.gw.registry.remove(worker_id(t.url))
        if self.gw.pd is not None and t.role != "regular":
            self.gw.pd.leave_pool(t.url)

    async def _end_drain(self, url: str) -> None:
        entry = self._draining.pop(url, None)
        if entry is not None:  # cut short (it may not have started): the worker leaves now
            task, t = entry
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self._leave(t)

    async def close(self) -> None:
        for url in list(self._draining):
            await self._end_drain(url)


def settings_from_config(cfg: NodeConfig, models: list[str]) -> DiscoverySettings:
    return DiscoverySettings(
        selector=parse_selector(cfg.selector),
        prefill_selector=parse_selector(cfg.prefill_selector),
        decode_selector=parse_selector(cfg.decode_selector),
        port=cfg.service_discovery_port,
        protocol=cfg.service_discovery_protocol,
        worker_ports_annotation=cfg.worker_ports_annotation,
        bootstrap_port_annotation=cfg.bootstrap_port_annotation,
        model_id_source=ModelIdSource.parse(cfg.model_id_source) if cfg.model_id_source else None,
        default_model=models[0] if len(models) == 1 else None,
        models=frozenset(models),
    )


@dataclass(slots=True)
class DiscoveryStats:
    lists: int = 0
    relists_gone: int = 0  # 410 Gone: the resourceVersion expired
    watch_errors: int = 0  # dropped watches and other failures (each followed by a back-off)
    added: int = 0
    removed: int = 0
    add_failures: int = 0


class PodDiscovery:
    """List + watch the pods of ``namespace`` matching the settings' shared selector; keep ``sink`` in line.

    ``client``: a lightkube ``AsyncClient`` (its config says where the API server is). ``start`` runs
    it in a task, ``close`` stops it (the workers it added stay: the node is going away)."""

    def __init__(
        self,
        client: AsyncClient,
        settings: DiscoverySettings,
        sink: WorkerSink,
        *,
        namespace: str | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.sink = sink
        self.namespace = namespace or client.namespace
        if settings.namespace is None and self.namespace != "*":  # "*": lightkube's every namespace
            settings = replace(settings, namespace=self.namespace)
        self.settings = settings
        self.tracker = PodTracker(settings)
        self.stats = DiscoveryStats()
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set after the first listing was applied
        self._retry: dict[str, Target] = {}  # url -> an add that failed, retried while still wanted
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._backoff = BACKOFF_MIN_S
        self._tasks: list[asyncio.Task[None]] = []
        self._applying = asyncio.Lock()  # decisions and retries one at a time, in order
        labels = settings.list_selector()
        self._labels: dict[str, Any] | None = (
            dict(p.split("=", 1) for p in labels.split(",")) if labels else None
        )

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        log.info(
            "Kubernetes discovery: pods in namespace %r, selector %r (regular %s, prefill %s, decode %s)",
            self.namespace,
            self.settings.list_selector(),
            dict(self.settings.selector) or "-",
            dict(self.settings.prefill_selector) or "-",
            dict(self.settings.decode_selector) or "-",
        )
        self._tasks = [asyncio.create_task(self.run()), asyncio.create_task(self._retrying())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.sink.close()
        with contextlib.suppress(Exception):
            await self.client.close()

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        from lightkube import ApiError as KubeApiError  # optional dependency: not at the top
        from lightkube.resources.core_v1 import Pod  # optional dependency: not at the top

        while True:  # one turn per list (first, after 410 Gone, or when a resume is impossible)
            try:
                if self.resource_version is None:
                    await self._list(Pod)
                await self._watch(Pod)
            except asyncio.CancelledError:
                raise
            except KubeApiError as e:
                if e.status.code == 410:
                    self.stats.relists_gone += 1
                    log.info("Kubernetes discovery: resourceVersion %s expired (410): listing again",
                             self.resource_version)  # fmt: skip
                    self.resource_version = None
                    continue
                self.stats.watch_errors += 1
                log.warning("Kubernetes discovery: API error %s: %s", e.status.code, e.status.message)
            except Exception as e:
                self.stats.watch_errors += 1
                log.warning("Kubernetes discovery: %s: %s (resuming from %s)",
                            type(e).__name__, e, self.resource_version)  # fmt: skip
            await self._pause()

    async def _pause(self) -> None:
        """The back-off after a failure (jittered, doubling); failed adds are retried meanwhile."""
        delay = self._backoff * (0.5 + self._rng.random() / 2)
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
        await self._sleep(delay)

    async def _list(self, pod_type: Any) -> None:
        listing = self.client.list(pod_type, namespace=self.namespace, labels=self._labels)
        pods = [p.to_dict() async for p in listing]
        self.stats.lists += 1
        self.resource_version = listing.resourceVersion
        await self._apply(self.tracker.resync(pods))
        self.synced.set()
        self._backoff = BACKOFF_MIN_S

    async def _watch(self, pod_type: Any) -> None:
        events = self.client.watch(
            pod_type,
            namespace=self.namespace,
            labels=self._labels,
            resource_version=self.resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
        )
        async for kind, pod in events:
            raw = pod.to_dict()
            rv = (raw.get("metadata") or {}).get("resourceVersion")
            if rv:
                self.resource_version = str(rv)
            self._backoff = BACKOFF_MIN_S
            await self._apply(self.tracker.event(kind, raw))

    # ---- applying ----------------------------------------------------------------------------------

    async def _apply(self, decisions: list[Decision]) -> None:
        async with self._applying:
            await self._apply_now(decisions)

    async def _apply_now(self, decisions: list[Decision]) -> None:
        for note in self.tracker.notes:
            log.warning("Kubernetes discovery: %s", note)
        self.tracker.notes.clear()
        for d in decisions:
            if d.action == "remove":
                if self._retry.pop(d.target.url, None) is not None:
                    # its add never went through: nothing of ours to remove (a worker at that URL from the
                    # flags or the admin API stays)
                    log.info("Kubernetes discovery: pod %s: worker %s no longer offered (never added)",
                             d.pod, d.target.url)  # fmt: skip
                    continue
                log.info("Kubernetes discovery: pod %s: removing worker %s", d.pod, d.target.url)
                try:
                    await self.sink.remove(d.target)
                    self.stats.removed += 1
                except Exception:
                    log.exception("Kubernetes discovery: removing worker %s failed", d.target.url)
            else:
                log.info("Kubernetes discovery: pod %s: adding %s worker %s (model %s)",
                         d.pod, d.target.role, d.target.url, d.target.model)  # fmt: skip
                await self._add(d.target)

    async def _add(self, t: Target) -> None:
        try:
            await self.sink.add(t)
        except ApiError as e:
            self.stats.add_failures += 1
            # a line at the first refusal, not every retry (a pod --worker-allow refuses stays refused)
            level = logging.DEBUG if self._retry.get(t.url) == t else logging.WARNING
            self._retry[t.url] = t
            log.log(level, "Kubernetes discovery: worker %s not added (%s): retried every %.0f s while "
                    "its pod offers it", t.url, e.message, RETRY_ADDS_S)  # fmt: skip
            return
        self._retry.pop(t.url, None)
        self.stats.added += 1

    async def _retrying(self) -> None:
        while True:
            await self._sleep(RETRY_ADDS_S)
            if self._retry:
                async with self._applying:
                    await self._retry_adds()

    async def _retry_adds(self) -> None:
        for url, t in list(self._retry.items()):
            if self.tracker.active.get(url) == t:
                await self._add(t)
            else:
                self._retry.pop(url, None)

    # ---- metrics -----------------------------------------------------------------------------------

    def metrics(self) -> list[Any]:
        s = self.stats
        return [
            gauge(
                "smg_discovery_workers",
                "Workers the Kubernetes discovery keeps (ready selected pods' ports)",
                [],
                [([], float(len(self.tracker.active)))],
            ),
            counter(
                "smg_discovery_events",
                "Kubernetes discovery: lists, relists after 410 Gone, watch errors, workers added / removed",
                ["event"],
                [
                    (["list"], float(s.lists)),
                    (["relist_gone"], float(s.relists_gone)),
                    (["watch_error"], float(s.watch_errors)),
                    (["added"], float(s.added)),
                    (["removed"], float(s.removed)),
                    (["add_failed"], float(s.add_failures)),
                ],
            ),
        ]


def kube_client(namespace: str | None = None) -> AsyncClient:
    """A lightkube client configured as kubectl would be: the pod's service account in a cluster, else
    ``$KUBECONFIG`` / ``~/.kube/config``."""
    from lightkube import AsyncClient as Client  # optional dependency: not at the top
    from lightkube.config.kubeconfig import KubeConfig  # optional dependency: not at the top

    try:
        config = KubeConfig.from_env()
    except Exception as e:  # lightkube's ConfigError, or a kubeconfig file that does not parse
        log.error(
            "service discovery: no Kubernetes API configuration (no service account in this pod, no "
            "$KUBECONFIG or ~/.kube/config): %s",
            e,
        )
        raise SystemExit(2) from None
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per watch request at info
    return Client(config, namespace=namespace)


def start_discovery(cfg: NodeConfig, gw: Gateway) -> PodDiscovery:
    """The node's discovery, started (``app.serve`` closes it before the gateway)."""
    d = PodDiscovery(
        kube_client(cfg.service_discovery_namespace),
        settings_from_config(cfg, list(gw.models)),
        GatewaySink(gw),
        namespace=cfg.service_discovery_namespace,
    )
    gw.metrics.add_callback(d.metrics)
    d.start()
    return d
