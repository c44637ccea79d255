"""Admission on the node: which rate limits apply to a request, the mesh-wide decision
(``shepherd.mesh.ratelimit``) and the OpenAI-style answer: 429 with ``Retry-After`` and the
``x-ratelimit-*`` headers, which successful responses carry too. The Messages API's answers
(``/v1/messages*``) carry Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``
besides (the same figures; ``reset`` the RFC 3339 time the limit is whole again; the token limit counts
prompt and output together, so there are no ``input-tokens`` / ``output-tokens`` variants).

Rules come from the config (``rate_limits`` plus the ``--rate-limit-*`` defaults; later the control-plane
document, through ``set_rules``). A rule names a tenant ("*": every tenant, each on its own count) and
optionally a model; a request is held to its tenant's all-models rule and to its (tenant, model) rule,
the tenant's own rule winning over a "*" one.

The tenant is ``principal_of(request).tenant`` (``shepherd.auth``): without authentication every
caller is the tenant "default", unless the auth layer trusts the ``x-smg-tenant`` header
(``--auth-trust-tenant-header``: for tests and trusted fronts only).

Backends: ``mesh`` (default) counts in the gossiped shards, decided on the node without I/O (``admit``,
synchronous); ``redis`` counts in one Redis (``shepherd.node.api.ratelimit_redis``), decided by one
script call (``admit_async``; ``admitting`` says which to call, ``guard`` does). Both answer with the
same ``Grant`` / ``Denial`` and so the same headers and 429s.

Cost: a node without rate limits has no ``Admission`` (the app key ``ADMISSION`` holds None: the handlers
test one value).
With limits, a request pays a cached rule lookup and the limiter's acquire + settle (about 20 µs); with
Redis, a round trip besides (README "Where gossip stops").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from shepherd.auth.principal import Principal, principal_of
from shepherd.mesh.ratelimit import Denial, Grant, LimiterConfig, Limits, Quota, RateLimiter
from shepherd.mesh.ratelimit_keys import Key
from shepherd.mesh.ratelimit_shards import fmt_duration
from shepherd.node.config import NodeConfig, RateLimitRule
from shepherd.node.metrics import counter, gauge
from shepherd.node.observe import tracing
from shepherd.node.openai.requests import Sampling
from shepherd.proto.anthropic_errors import is_messages_path
from shepherd.proto.openai_errors import ApiError, error_response

if TYPE_CHECKING:  # redis (and the OpenTelemetry SDK it imports): only with the Redis backend, below
    from shepherd.node.api.ratelimit_redis import RedisCounters

MAX_CACHED = 4096  # (tenant, model) rule resolutions kept


class RateLimited(ApiError):
    """A 429 in OpenAI's shape: code ``rate_limit_exceeded``, type the limit that refused it as OpenAI's
    (``requests``: RPM, and here the concurrent requests too; ``tokens``: TPM); ``headers`` go on the
    response (Retry-After, x-ratelimit-*); ``anthropic_headers``: Anthropic's ``anthropic-ratelimit-*``
    of the same figures (the Messages API's 429s carry them too)."""

    def __init__(
        self,
        message: str,
        headers: dict[str, str],
        anthropic_headers: dict[str, str] | None = None,
        type: str = "requests",
    ) -> None:
        super().__init__(429, message, type=type, code="rate_limit_exceeded", headers=headers)
        self.anthropic_headers = anthropic_headers or {}


def quota_headers(q: Quota) -> dict[str, str]:
    h: dict[str, str] = {}
    if q.limit_requests is not None:
        h["x-ratelimit-limit-requests"] = str(q.limit_requests)
        h["x-ratelimit-remaining-requests"] = str(q.remaining_requests)
        h["x-ratelimit-reset-requests"] = fmt_duration(q.reset_requests)
    if q.limit_tokens is not None:
        h["x-ratelimit-limit-tokens"] = str(q.limit_tokens)
        h["x-ratelimit-remaining-tokens"] = str(q.remaining_tokens)
        h["x-ratelimit-reset-tokens"] = fmt_duration(q.reset_tokens)
    return h


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(math.ceil(ts), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_quota_headers(q: Quota, now: float) -> dict[str, str]:
    """Anthropic's ``anthropic-ratelimit-*`` of the figures ``quota_headers`` gives: limit, remaining,
    and reset as the RFC 3339 time (``now`` + the reset delay, to the second above) the limit is whole
    again."""
    h: dict[str, str] = {}
    if q.limit_requests is not None:
        h["anthropic-ratelimit-requests-limit"] = str(q.limit_requests)
        h["anthropic-ratelimit-requests-remaining"] = str(q.remaining_requests)
        h["anthropic-ratelimit-requests-reset"] = _rfc3339(now + q.reset_requests)
    if q.limit_tokens is not None:
        h["anthropic-ratelimit-tokens-limit"] = str(q.limit_tokens)
        h["anthropic-ratelimit-tokens-remaining"] = str(q.remaining_tokens)
        h["anthropic-ratelimit-tokens-reset"] = _rfc3339(now + q.reset_tokens)
    return h


def denial_error(d: Denial, now: float | None = None) -> RateLimited:
    """The 429 of a denial; ``now`` (default: the wall clock): the time its Anthropic headers' resets
    count from."""
    tenant, model = d.key
    where = f"tenant '{tenant}'" + (f" on model '{model}'" if model else "")
    share = d.used + d.requested <= d.limit  # refused by this node's share, not the mesh-wide count
    q = d.quota
    if share and not math.isinf(d.retry_after):  # what this node can admit now: none of the metric
        if d.metric == "tokens":
            q = dataclasses.replace(q, remaining_tokens=0 if q.limit_tokens is not None else None)
        elif q.limit_requests is not None:
            q = dataclasses.replace(q, remaining_requests=0)
    headers = quota_headers(q)
    anthropic = anthropic_quota_headers(q, time.time() if now is None else now)
    kind = "tokens" if d.metric == "tokens" else "requests"  # OpenAI's error types
    if math.isinf(d.retry_after):
        return RateLimited(
            f"Request too large for tokens per min (TPM) of {where}: Limit {d.limit}, Requested "
            f"{d.requested}. Reduce the prompt or max_tokens.",
            headers,
            anthropic,
            "tokens",
        )
    wait = max(d.retry_after, 0.001)
    headers["retry-after"] = str(max(1, math.ceil(wait)))
    headers["retry-after-ms"] = str(math.ceil(wait * 1000))
    anthropic["retry-after"] = headers["retry-after"]
    used = max(0, round(d.used))
    if share:
        # the mesh-wide count has room, this node's share of it (its lease) has not: the others'
        # latest counts are not in yet (a gossip round; the sibling processes of --procs alike)
        what = {"concurrency": "concurrent requests", "requests": "RPM", "tokens": "TPM"}[d.metric]
        msg = (
            f"This node's share of the {what} limit of {where} is in use until the other nodes' counts "
            f"reach it (Limit {d.limit}, Used {used} mesh-wide)."
        )
    elif d.metric == "concurrency":
        msg = f"Too many concurrent requests for {where}: Limit {d.limit}."
    else:
        unit = "requests per min (RPM)" if d.metric == "requests" else "tokens per min (TPM)"
        msg = (
            f"Rate limit reached for {unit} of {where}: Limit {d.limit}, Used {used}, "
            f"Requested {d.requested}."
        )
    return RateLimited(f"{msg} Please try again in {fmt_duration(wait)}.", headers, anthropic, kind)


class Ticket:
    """An admitted request. ``settle(real_tokens)`` when it ends, however it ends (idempotent);
    ``headers`` are the x-ratelimit-* values right after admission, ``anthropic_headers`` the same
    figures as Anthropic's ``anthropic-ratelimit-*`` (the Messages API's answers)."""

    __slots__ = ("_adm", "_anthropic", "_grant", "_headers")

    def __init__(self, adm: Admission | None, grant: Grant | None) -> None:
        self._adm = adm
        self._grant = grant
        self._headers: dict[str, str] | None = None
        self._anthropic: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = quota_headers(self._grant.quota()) if self._grant is not None else {}
        return self._headers

    @property
    def anthropic_headers(self) -> dict[str, str]:
        if self._anthropic is None:
            grant, adm = self._grant, self._adm
            self._anthropic = (
                anthropic_quota_headers(grant.quota(), adm.clock())
                if grant is not None and adm is not None
                else {}
            )
        return self._anthropic

    def settle(self, real_tokens: int | None) -> None:
        """Release the concurrency slot; the token reservation becomes ``real_tokens`` (None: kept)."""
        adm = self._adm
        if adm is not None and self._grant is not None:
            (adm.backend or adm.limiter).settle(adm.clock(), self._grant, real_tokens)

    def release(self) -> None:
        self.settle(None)


UNLIMITED = Ticket(None, None)  # for a tenant no rule applies to
# request[TICKET_KEY]: the request's Ticket, for the response headers (Generation._headers)
TICKET_KEY: web.RequestKey[Ticket] = web.RequestKey("shepherd.ratelimit.ticket", Ticket)


class _State(Protocol):
    @property
    def tokens(self) -> int: ...

    @property
    def finished(self) -> bool: ...


class _Job(Protocol):
    @property
    def ids(self) -> Sequence[int]: ...

    @property
    def states(self) -> Sequence[_State]: ...


def propagation_max_of(cfg: NodeConfig) -> float:
    """``LimiterConfig.propagation_max`` of a node: ``rate_limit_propagation_max_secs``, or by default the
    limiter's (15 s), at most the window; 0: off."""
    pmax = cfg.rate_limit_propagation_max_secs
    if pmax is None:
        return min(LimiterConfig().propagation_max, cfg.rate_limit_window_secs)
    return pmax


def tokens_used(jobs: Iterable[_Job]) -> int:
    """Prompt + generated tokens of the engine requests that produced anything (also after an error or
    a disconnect: the tokens generated so far count)."""
    total = 0
    for job in jobs:
        gen = sum(st.tokens for st in job.states)
        if gen or any(st.finished for st in job.states):
            total += len(job.ids) + gen
    return total


class Admission:
    """The node's rate limiter front: rules, the mesh limiter, and the HTTP answer."""

    def __init__(
        self,
        rules: Sequence[RateLimitRule],
        *,
        node: str,
        gen: int | None = None,
        token_estimate: int = 1024,
        config: LimiterConfig | None = None,
        clock: Callable[[], float] = time.time,
        redis: dict[str, Any] | None = None,
    ) -> None:
        """``redis``: the Redis backend's settings (``url``, and ``RedisCounters``' ``prefix``,
        ``timeout``, ``lease``); ``limiter`` is then the node's local count, its fallback rule
        (``LimiterConfig.local``)."""
        self.clock = clock
        self.token_estimate = token_estimate
        if redis is not None:
            config = dataclasses.replace(config or LimiterConfig(), local=True)
        self.limiter = RateLimiter(node, gen if gen is not None else time.time_ns() // 1000, config, clock)
        self.backend: RedisCounters | None = None
        if redis is not None:
            from shepherd.node.api.ratelimit_redis import RedisCounters  # optional: the Redis backend

            self.backend = RedisCounters(local=self.limiter, clock=clock, **redis)
        self.admitting = self.backend is None  # admit() decides (no I/O); else await admit_async()
        self._rules: dict[tuple[str, str | None], Limits] = {}
        self._cache: dict[tuple[str, str], list[tuple[Key, Limits]]] = {}
        self.admitted = 0
        self.rejected: dict[str, int] = {"requests": 0, "tokens": 0, "concurrency": 0}
        self.set_rules(rules)

    @classmethod
    def from_config(cls, cfg: NodeConfig, node: str | None = None, metrics: Any = None) -> Admission | None:
        """None when no rate limit is configured (the hot path then pays nothing). ``metrics``: a
        ``NodeMetrics`` to export counters through."""
        rules = cls.rules_of(cfg)
        if not rules:
            return None
        adm = cls(
            rules,
            node=node or f"{cfg.host}:{cfg.port}",
            token_estimate=cfg.rate_limit_token_estimate,
            config=LimiterConfig(
                window=cfg.rate_limit_window_secs,
                propagation=cfg.rate_limit_propagation_secs,
                propagation_max=propagation_max_of(cfg),
                unreachable_grace=cfg.rate_limit_unreachable_grace_secs,
            ),
            redis=(
                {
                    "url": cfg.rate_limit_redis_url,
                    "prefix": cfg.rate_limit_redis_prefix,
                    "timeout": cfg.rate_limit_redis_timeout_secs,
                    "lease": cfg.rate_limit_redis_lease_secs,
                }
                if cfg.rate_limit_backend == "redis"
                else None
            ),
        )
        if metrics is not None:
            metrics.add_callback(adm.collect)
        return adm

    @staticmethod
    def rules_of(cfg: NodeConfig) -> list[RateLimitRule]:
        """The configuration's rules: ``rate_limits``, and the ``rate_limit_*`` flags as a tenant "*"
        rule on all models (which wins over the YAML's)."""
        rules = list(cfg.rate_limits)
        if cfg.rate_limit_rpm or cfg.rate_limit_tpm or cfg.rate_limit_max_concurrent:
            rules = [r for r in rules if (r.tenant, r.model) != ("*", None)]  # the flags win over YAML
            rules.append(
                RateLimitRule(
                    "*", None, cfg.rate_limit_rpm, cfg.rate_limit_tpm, cfg.rate_limit_max_concurrent
                )
            )
        return rules

    def set_rules(self, rules: Iterable[RateLimitRule]) -> None:
        self._rules = {
            (r.tenant, r.model): Limits(r.rpm, r.tpm, r.max_concurrent)
            for r in rules
            if r.rpm or r.tpm or r.max_concurrent
        }
        self._cache.clear()

    def rules_for(self, tenant: str, model: str) -> list[tuple[Key, Limits]]:
        got = self._cache.get((tenant, model))
        if got is None:
            got = []
            wide = self._rules.get((tenant, None)) or self._rules.get(("*", None))
            if wide is not None:
                got.append(((tenant, ""), wide))
            per = self._rules.get((tenant, model)) or self._rules.get(("*", model))
            if per is not None:
                got.append(((tenant, model), per))
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            self._cache[(tenant, model)] = got
        return got

    def admit(
        self,
        principal: Principal | str,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        completions: int = 1,
    ) -> Ticket:
        """Admit a request of ``prompt_tokens`` that may generate ``completions`` x ``max_tokens``
        (None: the configured estimate) or raise ``RateLimited``. The mesh backend only (``admitting``):
        with Redis, ``admit_async``."""
        if self.backend is not None:
            raise TypeError("the Redis rate-limit backend admits with 'await admit_async(...)'")
        rules, tokens = self._need(principal, model, prompt_tokens, max_tokens, completions)
        if not rules:
            return UNLIMITED
        return self._answer(self.limiter.acquire(self.clock(), rules, tokens))

    async def admit_async(
        self,
        principal: Principal | str,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        completions: int = 1,
    ) -> Ticket:
        """``admit`` for either backend: through Redis (one round trip, bounded by its timeout) when that
        is the backend."""
        if self.backend is None:
            return self.admit(principal, model, prompt_tokens, max_tokens, completions)
        rules, tokens = self._need(principal, model, prompt_tokens, max_tokens, completions)
        if not rules:
            return UNLIMITED
        return self._answer(await self.backend.acquire(self.clock(), rules, tokens))

    def _need(
        self,
        principal: Principal | str,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        completions: int,
    ) -> tuple[list[tuple[Key, Limits]], int]:
        """The rules a request of the principal's tenant for ``model`` is under, and the tokens it
        reserves: its prompt and ``completions`` x ``max_tokens`` (None: the configured estimate)."""
        tenant = principal if isinstance(principal, str) else principal.tenant
        out = max_tokens if max_tokens is not None else self.token_estimate
        return self.rules_for(tenant, model), prompt_tokens + completions * out

    def _answer(self, got: Grant | Denial) -> Ticket:
        if isinstance(got, Denial):
            self.rejected[got.metric] += 1
            raise denial_error(got, self.clock())
        self.admitted += 1
        return Ticket(self, got)

    async def start(self) -> None:
        """Check the Redis backend once (bounded; unreachable is not fatal); nothing for the mesh's."""
        if self.backend is not None:
            await self.backend.start()

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()

    async def guard(
        self,
        request: web.Request,
        model: str,
        prompt_tokens: int,
        sampling: Sampling,
        run: Callable[[], Awaitable[web.StreamResponse]],
        jobs: Sequence[_Job] | None = None,
    ) -> web.StreamResponse:
        """Admit, run, settle: the handlers' hook. ``jobs`` (the engine requests) give the real token
        usage at the end; without them (relayed requests) the reservation stands."""
        completions = sampling.n * (len(jobs) if jobs else 1)
        with tracing.stage("admission", {"gen_ai.request.model": model}) as span:  # (tracing on)
            try:
                who = principal_of(request)
                if self.admitting:  # the mesh: decided here, no await
                    ticket = self.admit(who, model, prompt_tokens, sampling.max_tokens, completions)
                else:
                    ticket = await self.admit_async(
                        who, model, prompt_tokens, sampling.max_tokens, completions
                    )
            except RateLimited as e:
                span.set("shepherd.admission.result", "rejected")
                refused = error_response(e)
                if is_messages_path(request.path):  # (its envelope: the error middleware's)
                    refused.headers.update(e.anthropic_headers)
                return refused
            span.set("shepherd.admission.result", "admitted")
        if ticket is UNLIMITED:
            return await run()
        request[TICKET_KEY] = ticket
        try:
            resp = await run()
        finally:
            ticket.settle(tokens_used(jobs) if jobs is not None else None)
        if not resp.prepared:
            resp.headers.update(ticket.headers)
            if is_messages_path(request.path):
                resp.headers.update(ticket.anthropic_headers)
        return resp

    def collect(self) -> list[Any]:
        lim = self.limiter
        return [
            counter(
                "smg_rate_limit_admitted", "Requests admitted under a rate limit", [], [([], self.admitted)]
            ),
            counter(
                "smg_rate_limit_rejected",
                "Requests refused with 429, by the limit that refused them",
                ["limit"],
                [([k], float(v)) for k, v in self.rejected.items()],
            ),
            gauge(
                "smg_rate_limit_mesh_nodes",
                "Nodes the rate limits count: reachable, and known (N)",
                ["kind"],
                [(["reachable"], float(lim.reachable)), (["known"], float(lim.cluster_size))],
            ),
            gauge("smg_rate_limit_keys", "Rate-limit keys held", [], [([], float(lim.key_count()))]),
            *self._redis_metrics(),
        ]

    def _redis_metrics(self) -> list[Any]:
        b = self.backend
        if b is None:
            return []
        family = Callable[[str, str, list[str], Iterable[tuple[list[str], float]]], Any]  # gauge or counter
        rows: tuple[tuple[family, str, str, float], ...] = (
            (
                gauge,
                "smg_rate_limit_redis_up",
                "1 while Redis decides admissions, 0 while it is unreachable",
                b.up,
            ),
            (
                counter,
                "smg_rate_limit_redis_fallbacks",
                "Admissions decided by the fallback rule (limit / N on the node's counts): Redis unreachable",
                b.fallbacks,
            ),
            (counter, "smg_rate_limit_redis_errors", "Redis calls that failed or timed out", b.errors),
            (
                counter,
                "smg_rate_limit_redis_settles_dropped",
                "Settlements not made in Redis (Redis down, queue full): slots expire with their lease",
                b.settles_dropped,
            ),
        )
        return [make(name, doc, [], [([], float(value))]) for make, name, doc, value in rows]
