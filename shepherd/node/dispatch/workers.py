"""Worker registry: engine clients, health checks with hysteresis, circuit breakers, engine loads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from shepherd.auth.tls import EngineTls
from shepherd.node.config import ConfigError, NodeConfig, WorkerAllow, check_worker_url
from shepherd.node.dispatch.circuit_breaker import BreakerState, CircuitBreaker, HealthTracker
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.http import HttpRelayClient
from shepherd.node.engines.kinds import SERVICE_KINDS, service_client, settle_kind
from shepherd.policies.base import Policy, RouteRequest, WorkerView
from shepherd.proto.engine_types import (
    EngineClient,
    EngineError,
    EngineLoad,
    EngineTimeout,
    EngineUnavailable,
    ModelInfo,
    worker_id,
)
from shepherd.proto.openai_errors import ApiError

log = logging.getLogger("shepherd.workers")


def make_client(
    url: str,
    transport: str = "h2",
    tls: EngineTls | None = None,
    allow: WorkerAllow | None = None,
    timeout: float = 600.0,
) -> EngineClient | HttpRelayClient:
    """The client for a worker URL; gRPC engines over the lean HTTP/2 client or grpcio. gRPC goes over TLS
    when ``tls`` is given (every gRPC worker) or the URL is ``grpcs://`` (system CAs unless ``tls``).
    ``allow``: the node's ``worker_allow`` (an HTTP worker's connections, and a gRPC one's on the lean
    HTTP/2 transport, are checked against it where its name resolves). ``timeout``: an HTTP worker's
    relayed requests (the node's ``request_timeout_secs``; gRPC calls are given theirs per call)."""
    check_worker_url(url)
    if allow is not None:
        allow.check_url(url)
    scheme, _, rest = url.partition("://")
    target = rest.rstrip("/")
    if scheme in ("http", "https"):
        return HttpRelayClient(url, timeout=timeout, allow=allow)
    kind = {"sglang": "sglang", "vllm": "vllm"}.get(scheme)
    if tls is None and scheme == "grpcs":
        tls = EngineTls()
    base: GrpcEngineClient | H2EngineClient
    if transport == "grpcio":
        base = GrpcEngineClient(url, target, kind, tls.grpc_credentials() if tls else None)
    else:
        base = H2EngineClient(url, target, kind, tls=tls.ssl_context() if tls else None, allow=allow)
    # trtllm:// and mlx://: their own client, over the connection made here
    return service_client(url, scheme, base) if scheme in SERVICE_KINDS else base


@dataclass(slots=True)
class Worker:
    id: str
    url: str
    model: str
    client: EngineClient | HttpRelayClient
    health: HealthTracker
    breaker: CircuitBreaker
    in_flight: int = 0
    load: EngineLoad = field(default_factory=EngineLoad)
    info: ModelInfo | None = None
    # admitted: its model info (and a grpc:// worker's kind) is in; until then it takes no request, is
    # asked again on its own (``WorkerRegistry._admit``), and ``admit_error`` says why it is not in yet
    initialized: bool = False
    admit_error: str | None = None
    admit_overdue: bool = False  # not admitted within worker_startup_timeout_secs of being added
    requests: int = 0
    failures: int = 0
    # the engine answered GetLoads UNIMPLEMENTED (vLLM's entrypoint): not asked again; load-aware
    # policies then see this node's own in-flight count for it (``policies.base.worker_load``)
    loads_unsupported: bool = False
    # when (the registry's clock) the engine's KV-event stream last pushed a load record, whole or partial
    # (every field routing reads: running, waiting, token usage...), and when the telemetry a partial one
    # lacks (used and total tokens, cache hit rate: shown by metrics and /get_loads, read by no policy)
    # was last fresh (a whole record pushed, or a GetLoads answer). A GetLoads poll due within the poll
    # interval after a push is skipped while the telemetry is younger than TELEMETRY_POLLS intervals
    load_pushed_at: float = float("-inf")
    telemetry_at: float = float("-inf")
    # SMG's worker spec (admin API): routing weight and cost are recorded and shown; labels are free-form
    priority: int = 50
    cost: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_http(self) -> bool:
        return isinstance(self.client, HttpRelayClient)

    def routable(self, now: float) -> bool:
        return self.health.healthy and self.breaker.allows(now)

    def view(self) -> WorkerView:
        load = self.load
        return WorkerView(self.id, self.url, self.in_flight, load.running, load.waiting, load.token_usage)

    @property
    def status(self) -> str:
        """SMG's ``WorkerStatus``: ``pending`` (not admitted yet, or its first health check not in),
        ``failed`` (not admitted within ``worker_startup_timeout_secs``; still asked), ``ready``
        (healthy), ``not_ready`` (admitted, failing its health checks)."""
        if not self.initialized:
            return "failed" if self.admit_overdue else "pending"
        if self.health.healthy:
            return "ready"
        return "not_ready" if self.health.checked else "pending"

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "model": self.model,
            "kind": self.client.kind,
            "healthy": self.health.healthy,
            "status": self.status,
            "status_reason": None if self.initialized else self.admit_error,
            "circuit": self.breaker.state.value,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "failures": self.failures,
            "load": self.in_flight,  # SMG's: a number (this node's requests on the worker)
            "engine_load": {
                "running": self.load.running,
                "waiting": self.load.waiting,
                "token_usage": self.load.token_usage,
            },
            "max_context_length": self.info.max_context_length if self.info else None,
            # the KV pool in tokens when the engine reports it in place of the context (SGLang)
            "kv_capacity_tokens": (self.info.kv_capacity_tokens or None) if self.info else None,
            # the model's sampling defaults the engine reports (unset request fields get them)
            "sampling_defaults": (
                self.info.sampling_defaults.as_dict() if self.info and self.info.sampling_defaults else None
            ),
            "engine_loads": not self.loads_unsupported,
            # SMG's WorkerInfo (sgl-model-gateway / smg: protocols/worker_spec.rs), alongside
            "model_id": self.model,
            "worker_type": "regular",  # a PD node's admin API says "prefill" / "decode" for its pools
            "connection_mode": "http" if self.is_http else "grpc",
            "runtime_type": None if self.is_http else self.client.kind,
            "is_healthy": self.health.healthy,
            "priority": self.priority,
            "cost": self.cost,
            "labels": dict(self.labels),
        }


class ProbeBudget:
    """How many new workers may fail their first check, and how fast that allowance comes back: a token
    bucket of ``burst`` tokens refilled at ``per_sec``. Adding a worker probes its address and the
    answer says whether it is healthy; a run-time add (admin API, mesh) needs a token left, and costs
    one only when the first check fails: adding live workers spends nothing (only a run of failed adds
    holds the next ones back), while sweeping addresses for open ports is slowed to ``per_sec`` after
    ``burst`` (the ``worker_allow`` list bounds where at all; config workers at start-up are free)."""

    def __init__(
        self, burst: float = 20.0, per_sec: float = 0.5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.per_sec = per_sec
        self.clock = clock
        self.tokens = burst
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_sec)
        self.at = now

    def available(self) -> bool:
        self._refill()
        return self.tokens >= 1.0

    def spend(self) -> None:
        self._refill()
        self.tokens -= 1.0

    def retry_after(self) -> int:
        self._refill()
        return max(1, int((1.0 - self.tokens) / self.per_sec + 0.999))


# a worker no policy routes by load is polled while its loads were read (API, metrics) within this many poll
# intervals: a scraper every 15-60 s keeps them fresh; an idle node with no reader polls nothing
LOADS_READ_HOLD_POLLS: Final = 60
# a worker whose KV-event stream pushes load records (each with every field routing reads) is still asked
# for its loads (GetLoads) once its telemetry, which partial records lack, is this many poll intervals old
TELEMETRY_POLLS: Final = 5
# while no worker is polled, the poll loop looks again this often (or at once when loads are read)
LOADS_IDLE_RECHECK_SECS: Final = 30.0
# a removed worker's client closes once the requests it serves have ended: looked at this often
RETIRE_POLL_SECS: Final = 0.2
# a worker whose model info is not in yet (an engine loading its weights, or too busy to answer in
# time) is asked again on its own: after ADMIT_RETRY_SECS, the pause doubling up to the health-check
# interval; each attempt's deadline starts at the health-check timeout + 3 s and doubles after each
# attempt that ran out of time, up to ADMIT_TIMEOUT_MAX_SECS (slow is not dead: it is heard once it
# answers within that); the log says so at the first failure and every ADMIT_LOG_SECS after
ADMIT_RETRY_SECS: Final = 1.0
ADMIT_TIMEOUT_MAX_SECS: Final = 60.0
ADMIT_LOG_SECS: Final = 30.0


class WorkerRegistry:
    def __init__(self, cfg: NodeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.allow = WorkerAllow(cfg.worker_allow)
        self.probes = ProbeBudget(clock=clock)  # run-time adds (after ``start``): see ProbeBudget
        self._started = False
        self.workers: dict[str, Worker] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # workers not admitted yet, each with the one task that asks it again (``_admit``)
        self._admitting: dict[str, asyncio.Task[None]] = {}
        # removed workers whose requests still run, each with the task that closes its client after them
        self._retiring: list[tuple[asyncio.Task[None], Worker]] = []
        self.on_health_change: Callable[[Worker], None] | None = None
        # called when a worker joins (after its first check) and when it leaves (before its client closes)
        self.on_added: Callable[[Worker], None] | None = None
        self.on_removed: Callable[[Worker], None] | None = None
        # a grpc:// worker's client was replaced once its kind was known (TensorRT-LLM, MLX)
        self.on_client_changed: Callable[[Worker], None] | None = None
        self._http_only: dict[str, bool] = {}  # per model, recomputed when workers change
        self.version = 0  # bumped when workers come, go or learn their model info
        # a further routability test by worker id (the mesh's combined health view); None: none
        self.gate: Callable[[str], bool] | None = None
        # workers a model may have at most (its policy's index: cache_aware's native index holds 64)
        self.worker_limit: Callable[[str], int | None] | None = None
        # whether a worker's routing policy reads engine loads (None: every policy is taken to): a worker
        # no policy routes by load is polled only while its loads are being read (``loads_for_reading``)
        self.loads_needed: Callable[[Worker], bool] | None = None
        self._loads_read_at = float("-inf")
        self._loads_wanted = asyncio.Event()  # set by a read: the poll loop, asleep, starts again
        # rounds driven by another component's wake-ups (``ride_rounds``): their next due times (clock)
        self._ridden = False
        self._due: dict[str, float] = {}  # "health" | "loads" -> when the next round is due
        self._round_tasks: dict[str, asyncio.Task[None]] = {}

    def http_only(self, model: str) -> bool:
        """Every worker of ``model`` is an OpenAI HTTP worker (and there is at least one)."""
        flag = self._http_only.get(model)
        if flag is None:
            ws = self.for_model(model)
            flag = self._http_only[model] = bool(ws) and all(w.is_http for w in ws)
        return flag

    def get(self, wid: str) -> Worker | None:
        return self.workers.get(wid)

    def find(self, key: str) -> Worker | None:
        """By id or by URL."""
        return self.workers.get(key) or self.workers.get(worker_id(key))

    def for_model(self, model: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.model == model]

    def routable(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        now = self.clock()
        gate = self.gate
        return [
            w
            for w in self.workers.values()
            if w.model == model and w.id not in exclude and w.routable(now) and (gate is None or gate(w.id))
        ]

    async def add(self, url: str, model: str) -> Worker:
        """Register a worker (idempotent by URL) and run its first check at once.

        ``ApiError`` (nothing registered, nothing dialed): 400 ``worker_not_allowed`` for a URL that
        is not scheme://host:port or that ``worker_allow`` refuses (config, admin API and workers from
        the mesh alike); 429 ``worker_probe_rate_limited`` when run-time adds failed their first check
        too often (``ProbeBudget``); 409 ``too_many_workers`` when the model has as many workers as its
        policy can route by (``worker_limit``: cache_aware's native prefix index holds 64 per model)."""
        wid = worker_id(url)
        existing = self.workers.get(wid)
        if existing is not None:
            return existing
        limit = None if self.worker_limit is None else self.worker_limit(model)
        if limit is not None and len(self.for_model(model)) >= limit:
            raise ApiError(
                409,
                f"Model {model!r} already has {limit} workers, the most its routing policy's prefix index "
                "holds; remove one first, or split the workers over several models.",
                param="url",
                code="too_many_workers",
            )
        try:
            check_worker_url(url)
            self.allow.check_url(url)
        except ConfigError as e:
            raise ApiError(400, str(e), param="url", code="worker_not_allowed") from None
        budgeted = self._started
        if budgeted and not self.probes.available():
            raise ApiError(
                429,
                "Too many new workers failed their first check lately; retry later.",
                type="rate_limit_error",
                code="worker_probe_rate_limited",
                headers={"Retry-After": str(self.probes.retry_after())},
            )
        c = self.cfg
        tls = EngineTls.configured(c.engine_tls_ca_file, c.engine_tls_cert_file, c.engine_tls_key_file)
        client = make_client(url, c.engine_transport, tls, self.allow, c.request_timeout_secs)
        w = Worker(
            id=wid,
            url=url,
            model=model,
            client=client,
            health=HealthTracker(self.cfg.health_failure_threshold, self.cfg.health_success_threshold),
            breaker=CircuitBreaker(
                self.cfg.cb_failure_threshold,
                self.cfg.cb_success_threshold,
                self.cfg.cb_timeout_duration_secs,
            ),
        )
        self.workers[wid] = w
        self._http_only.clear()
        self.version += 1
        self.wake_load_polls()  # (its policy may read loads)
        await self._first_check(w)
        if budgeted and not w.health.healthy:  # the first check sets it to its own result
            self.probes.spend()
        if self.on_added is not None and self.workers.get(wid) is w:
            self.on_added(w)
        return w

    async def remove(self, wid: str) -> Worker | None:
        """Take worker ``wid`` out of routing at once; its client is closed once the requests it serves
        have ended (at most ``request_timeout_secs`` later): a rolling update removes a worker, then
        stops its engine, and the streams in flight there finish (as SMG and vllm-router do)."""
        w = self.workers.pop(wid, None)
        self._http_only.clear()
        self.version += 1
        admitting = self._admitting.pop(wid, None)
        if admitting is not None:
            admitting.cancel()
        if w is not None:
            if self.on_removed is not None:
                self.on_removed(w)
            if w.in_flight <= 0:
                await w.client.close()
            else:
                self._retiring.append((asyncio.create_task(self._retire(w)), w))
        return w

    async def _retire(self, w: Worker) -> None:
        deadline = self.clock() + self.cfg.request_timeout_secs
        while w.in_flight > 0 and self.clock() < deadline:  # noqa: ASYNC110 - polled, bounded
            await asyncio.sleep(RETIRE_POLL_SECS)
        self._retiring = [e for e in self._retiring if e[1] is not w]
        await w.client.close()

    @property
    def retiring(self) -> int:
        """Removed workers whose client is still open for the requests they serve."""
        return len(self._retiring)

    @property
    def admitting(self) -> int:
        """Workers not admitted yet whose admission retries run (one task each)."""
        return len(self._admitting)

    async def _init(self, w: Worker, timeout: float, step: list[str]) -> None:
        """Admit ``w``: its kind (a ``grpc://`` worker's) and model info, each call within ``timeout``;
        ``step`` is told which call is under way (what a timeout names)."""
        if isinstance(w.client, GrpcEngineClient | H2EngineClient):
            step[0] = "GetServerInfo (the engine's kind)"
            settled = await settle_kind(w.client, timeout)
            if settled is not w.client:  # grpc:// found TensorRT-LLM or MLX: their client, same connection
                w.client = settled
                if self.on_client_changed is not None:
                    self.on_client_changed(w)
            else:
                await w.client.detect(timeout)
        step[0] = "GetModelInfo / GetServerInfo"
        w.info = await w.client.model_info(timeout)
        w.initialized = True
        self.version += 1

    async def _init_once(self, w: Worker, timeout: float) -> str:
        """One attempt at admitting ``w`` within ``timeout`` in all: ``admitted``, ``timeout`` (no
        answer in time) or ``failed``; why it failed is kept in ``admit_error``."""
        step = ["connecting"]
        try:
            async with asyncio.timeout(timeout):
                await self._init(w, timeout, step)
            return "admitted"
        except (TimeoutError, EngineTimeout):  # (the call's own deadline, or the attempt's)
            w.admit_error = f"no answer to {step[0]} within {timeout:g} s"
            return "timeout"
        except (EngineError, OSError) as e:
            w.admit_error = f"{step[0]}: {str(e) or type(e).__name__}"
        except Exception as e:  # an engine's answer nothing above expects: not admitted, not a crash
            w.admit_error = f"{step[0]}: its answer failed: {type(e).__name__}: {e}"
        return "failed"

    def _admit_timeout(self) -> float:
        return self.cfg.health_check_timeout_secs + 3

    async def _admit(self, w: Worker, added: float, outcome: str) -> None:
        """Ask ``w`` (added at ``added``, its first attempt's ``outcome`` not ``admitted``) for its model
        info again until it answers, then health-check it at once: it takes requests as soon as its
        engine answers. The pause between attempts and each attempt's deadline back off (``ADMIT_*``);
        said at WARNING when it starts and every ``ADMIT_LOG_SECS``, at ERROR once
        ``worker_startup_timeout_secs`` since it was added are over (then shown ``failed`` and still
        asked at the same pace, as a worker failing its health checks is: an engine loading a large
        model may take longer, and ``DELETE /workers/{id}`` removes it). One task per worker, ended by
        its admission, its removal or the registry's close."""
        interval = self.cfg.health_check_interval_secs
        pause = min(ADMIT_RETRY_SECS, interval)
        timeout = self._admit_timeout()
        startup = self.cfg.worker_startup_timeout_secs
        said = self.clock()
        log.warning(
            "worker %s is not admitted yet (it takes no requests until it answers; asked again): %s",
            w.url,
            w.admit_error,
        )
        try:
            while outcome != "admitted":  # cancelled by remove() and close()
                if outcome == "timeout":  # slow is not dead: the next attempt waits longer
                    timeout = min(ADMIT_TIMEOUT_MAX_SECS, timeout * 2)
                await asyncio.sleep(pause)
                pause = min(interval, pause * 2)
                outcome = await self._init_once(w, timeout)
                now = self.clock()
                if outcome == "admitted" or w.admit_overdue:
                    continue
                if now - added >= startup:
                    w.admit_overdue = True
                    log.error(
                        "worker %s gave no model info within --worker-startup-timeout-secs (%g s): %s; it "
                        "takes no requests and is still asked (DELETE /workers/{id} removes it)",
                        w.url,
                        startup,
                        w.admit_error,
                    )
                elif now - said >= ADMIT_LOG_SECS:
                    said = now
                    log.warning(
                        "worker %s still not admitted after %.0f s: %s", w.url, now - added, w.admit_error
                    )
            log.info("worker %s admitted %.0f s after it was added", w.url, self.clock() - added)
            w.admit_error = None
            w.admit_overdue = False
            await self.check(w)  # at once: it takes requests from its first good health check
        finally:
            if self._admitting.get(w.id) is asyncio.current_task():
                del self._admitting[w.id]

    async def _first_check(self, w: Worker) -> None:
        """A new worker's first check: its model info asked once, then its health; not admitted, its
        first check failed (not healthy) and its admission retries start (``_admit``)."""
        added = self.clock()
        outcome = "failed"
        try:
            outcome = await self._init_once(w, self._admit_timeout())
        finally:  # also when add() is cancelled on the way (its caller gone): the worker is registered
            if outcome != "admitted":
                w.health.observe(False)
                if self.workers.get(w.id) is w and w.id not in self._admitting:  # (not removed meanwhile)
                    self._admitting[w.id] = asyncio.create_task(self._admit(w, added, outcome))
        await self.check(w)

    async def check(self, w: Worker) -> None:
        """One health check of ``w`` once admitted (until then its admission asks it: ``_admit``)."""
        if not w.initialized:
            return
        ok = False
        try:
            ok = await w.client.health_check(self.cfg.health_check_timeout_secs)
        except (EngineError, TimeoutError, OSError) as e:
            log.debug("worker %s check failed: %s", w.url, e)
        except Exception as e:  # an engine's answer nothing above expects: a failed check, not a crash
            log.warning("worker %s check failed on its answer: %s: %s", w.url, type(e).__name__, e)
        if w.health.observe(ok):
            healthy = w.health.healthy
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "worker %s is now %s",
                w.url,
                "healthy" if healthy else "unhealthy",
            )
            if not healthy:
                # calls in flight on a hung engine would wait for the connection's keepalive (~80 s):
                # one PING now, and the calls fail (retried elsewhere when they can be) if it goes unanswered
                w.client.confirm_alive(self.cfg.health_check_timeout_secs)
            if self.on_health_change is not None:
                self.on_health_change(w)

    def _polls(self, w: Worker, now: float) -> bool:
        """Whether ``w``'s loads are polled now: its policy routes by them, or something read loads within
        the last ``LOADS_READ_HOLD_POLLS`` poll intervals (a metrics scraper, ``/get_loads``)."""
        if self.loads_needed is None or self.loads_needed(w):
            return True
        return now - self._loads_read_at <= LOADS_READ_HOLD_POLLS * self.cfg.load_poll_interval_secs

    def wake_load_polls(self) -> None:
        """A worker was added, a routing policy changed or loads were read: the poll loop, asleep while no
        worker was polled, looks again now rather than within ``LOADS_IDLE_RECHECK_SECS`` (ridden rounds,
        ``ride_rounds``, look at every due round anyway)."""
        self._loads_wanted.set()

    async def loads_for_reading(self) -> None:
        """Before an API answer or a metrics scrape shows engine loads: the workers whose loads were not
        being polled (no policy routes by them, nothing read them lately) are polled now, each bounded by
        the health-check timeout (an engine that does not answer leaves its last figures), and the polls
        go on while reads keep coming. One round of polls per quiet spell, not per read."""
        now = self.clock()
        ws = [w for w in self.workers.values() if not self._polls(w, now)]
        self._loads_read_at = now
        self.wake_load_polls()
        if ws:
            await asyncio.gather(*(self._poll_bounded(w) for w in ws), return_exceptions=True)

    async def _poll_bounded(self, w: Worker) -> None:
        async with asyncio.timeout(self.cfg.health_check_timeout_secs):
            await self.poll_load(w)

    def _poll_due(self, w: Worker, now: float) -> bool:
        """Whether a GetLoads poll of ``w`` is due at ``now`` (``poll_load`` asks only then)."""
        if not w.initialized or not w.health.healthy or w.loads_unsupported:
            return False
        interval = self.cfg.load_poll_interval_secs
        if now - w.load_pushed_at < interval and now - w.telemetry_at < TELEMETRY_POLLS * interval:
            return False  # the KV-event stream pushed a load record since the last poll was due
        return self._polls(w, now)  # (not for round_robin / random, unless something reads the loads)

    async def poll_load(self, w: Worker) -> None:
        if not self._poll_due(w, self.clock()):
            return
        try:
            w.load = await w.client.loads()
            w.telemetry_at = self.clock()
        except EngineError as e:
            if e.code == "unimplemented":  # detected once, said once; the worker is not asked again
                w.loads_unsupported = True
                log.warning(
                    "worker %s does not serve GetLoads: routing by load counts this node's in-flight "
                    "requests on it",
                    w.url,
                )
        except (TimeoutError, OSError):
            pass

    def record_result(self, w: Worker, ok: bool) -> None:
        w.requests += 1
        if ok:
            w.breaker.record_success()
        else:
            w.failures += 1
            before = w.breaker.state
            w.breaker.record_failure(self.clock())
            if w.breaker.state is BreakerState.OPEN and before is not BreakerState.OPEN:
                log.warning("circuit opened for worker %s", w.url)

    async def _every(
        self,
        interval: float,
        fn: Callable[[Worker], Any],
        idle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``fn`` of every worker each ``interval``; ``idle`` first, each round (it may wait)."""
        while True:
            if idle is not None:
                await idle()
            await asyncio.sleep(interval)
            await self._round(fn)

    async def _round(self, fn: Callable[[Worker], Any], only: list[Worker] | None = None) -> None:
        """``fn`` of every worker (or of ``only``), together; their errors are theirs (a check records its
        own)."""
        ws = list(self.workers.values()) if only is None else only
        if ws:
            await asyncio.gather(*(fn(w) for w in ws), return_exceptions=True)

    async def _poll_loads(self) -> None:
        """``poll_load`` of every worker each ``load_poll_interval_secs`` while any is polled (``_polls``);
        while none is (an idle node whose policies do not route by load), asleep until a read of the loads
        or for ``LOADS_IDLE_RECHECK_SECS`` (a worker added under a load-aware policy), not every interval."""
        await self._every(self.cfg.load_poll_interval_secs, self.poll_load, self._until_polled)

    async def _until_polled(self) -> None:
        if any(self._polls(w, self.clock()) for w in self.workers.values()):
            return
        self._loads_wanted.clear()
        wait = max(self.cfg.load_poll_interval_secs, LOADS_IDLE_RECHECK_SECS)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._loads_wanted.wait()

    def start(self) -> None:
        self._started = True
        if not self._ridden:
            self._start_timers()

    def _start_timers(self) -> None:
        self._tasks.append(asyncio.create_task(self._every(self.cfg.health_check_interval_secs, self.check)))
        self._tasks.append(asyncio.create_task(self._poll_loads()))

    def ride_rounds(self) -> None:
        """From now on the health checks and load polls run on another component's wake-ups (the mesh
        runtime's probes and acks, 5-7 a second), which calls ``run_due_rounds`` on each, rather than on
        timers of their own: each timer was a wake-up of its own on an otherwise quiet node (one every
        2 s for the polls, even when the KV-event streams pushed every load, and one every 5 s for the
        checks, ~15% of an idle meshed node's wake-ups). As with the timers, a round starts an interval
        after the previous one ended (up to a quarter of it early, on a wake-up that comes first); the
        timeouts are the same."""
        if self._ridden:
            return
        self._ridden = True
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        now = self.clock()
        self._due = {
            "health": now + self.cfg.health_check_interval_secs,
            "loads": now + self.cfg.load_poll_interval_secs,
        }

    def own_rounds(self) -> None:
        """The rounds go back on the registry's own timers (the mesh closes while the node drains)."""
        if not self._ridden:
            return
        self._ridden = False
        if self._started:
            self._start_timers()

    def run_due_rounds(self, early: float = 0.0) -> None:
        """With ``ride_rounds``, once started: start the health round and the load-poll round that are
        due within ``early`` seconds (at most a quarter of their interval: the caller's wake-ups, which
        come about that often), each an interval after the previous one of its kind ended; polls only
        while some worker's are wanted (``_polls``)."""
        if not self._ridden or not self._started or not self.workers:
            return
        now = self.clock()
        rounds = (
            ("health", self.check, self.cfg.health_check_interval_secs),
            ("loads", self.poll_load, self.cfg.load_poll_interval_secs),
        )
        for kind, fn, interval in rounds:
            if kind in self._round_tasks or now < self._due[kind] - min(early, interval / 4):
                continue
            only = None
            if kind == "loads":  # only the workers whose poll is due: none while their streams push loads
                only = [w for w in self.workers.values() if self._poll_due(w, now)]
                if not only:  # (no round of tasks that would each return at once)
                    self._due[kind] = now + interval
                    continue
            self._start_round(kind, fn, interval, only)

    def _start_round(
        self, kind: str, fn: Callable[[Worker], Any], interval: float, only: list[Worker] | None = None
    ) -> None:
        async def one_round() -> None:
            try:
                await self._round(fn, only)
            finally:
                self._round_tasks.pop(kind, None)
                self._due[kind] = self.clock() + interval  # an interval after this one ended (as the timers)

        self._round_tasks[kind] = asyncio.create_task(one_round())

    async def close(self) -> None:
        self._ridden = False
        rounds = list(self._round_tasks.values())
        retiring, self._retiring = self._retiring, []
        waits = [t for t, _ in retiring]
        admits = list(self._admitting.values())
        self._admitting.clear()
        for t in self._tasks + rounds + waits + admits:
            t.cancel()
        await asyncio.gather(*self._tasks, *rounds, *waits, *admits, return_exceptions=True)
        for _, w in retiring:  # (their waits cut short: closed here)
            await w.client.close()
        self._tasks.clear()
        self._round_tasks.clear()
        for w in list(self.workers.values()):
            await w.client.close()


def no_healthy_worker(message: str) -> ApiError:
    """The 503 when no worker can take a request (every one unhealthy, its circuit open, or none): the
    client may retry shortly (``Retry-After``)."""
    return ApiError(
        503, message, type="service_unavailable", code="no_available_worker", headers={"Retry-After": "1"}
    )


def client_error(e: EngineError, *ws: Worker) -> EngineError:
    """``e`` (raised by one of ``ws``) as a client may see it: workers named by id, never by URL or
    address (a worker's address is the control plane's business). A connection failure says only that
    the worker is unavailable; other messages keep the engine's words with each worker's URL and
    host:port replaced by its id (a bare host name is left: it may name something else, e.g. a PD
    bootstrap address; the error middleware scrubs addresses at the client boundary). Only on the
    error path."""
    if e.code == "engine_unavailable":
        return EngineUnavailable(f"worker {' or '.join(w.id for w in ws)} is unavailable.")
    msg = str(e)
    changed = False
    for w in ws:
        needles = (w.url.rstrip("/"), w.url.partition("://")[2].rstrip("/"))  # the URL, its host:port
        for n in needles:
            if n and n in msg:
                msg = msg.replace(n, f"worker {w.id}")
                changed = True
    return EngineError(msg, code=e.code, retryable=e.retryable) if changed else e


_CLOSED = BreakerState.CLOSED


def pick_worker(
    reg: WorkerRegistry,
    model: str,
    exclude: set[str],
    input_ids: Sequence[int],
    routing_key: str | None,
    policy: Policy,
    *,
    http: bool = False,
    only: Collection[str] | None = None,
) -> Worker | None:
    """A worker for the request, by ``policy``, among ``reg``'s routable workers of ``model`` not in
    ``exclude`` (and, if given, in ``only``: one pool of a PD node); its circuit's trial slot taken."""
    now = reg.clock()
    gate = reg.gate
    candidates: list[Worker] = []
    # one pass: what ``reg.routable(model, exclude)`` holds, of the wanted kind (and in ``only``)
    for w in reg.workers.values():
        if w.model != model or w.id in exclude or not w.health.healthy:
            continue
        b = w.breaker
        if b.state is not _CLOSED and not b.allows(now):
            continue
        if (gate is not None and not gate(w.id)) or w.is_http != http:
            continue
        if only is None or w.id in only:
            candidates.append(w)
    if not candidates:
        return None
    route = RouteRequest(model, input_ids, routing_key)
    while candidates:  # bounded: each turn removes one candidate
        choice = policy.pick([w.view() for w in candidates], route)
        if choice is None:
            return None
        chosen = reg.workers.get(choice.id)
        if chosen is not None and chosen.breaker.acquire(now):
            return chosen
        # a half-open worker whose single trial request is already out: let the policy choose again
        candidates = [c for c in candidates if c.id != choice.id]
    return None
