"""Rate limits with Redis as the counter store (``--rate-limit-backend redis``).

The same limits, keys and window maths as the mesh's limiter (``shepherd.mesh.ratelimit``): per key
(tenant, "") and (tenant, model), requests and net tokens are counted per window and admitted against
the sliding estimate ``prev * (1 - f) + cur``; tokens are reserved at admission (prompt + max_tokens)
and settled with the real usage (a refund into the reservation's window if it is still the current or
the previous one, an excess into the current one); concurrency is a set of in-flight slots. The
difference: one shared count instead of gossiped shards, so there is no lease and no share: a request
is admitted if every rule's ``estimate + cost <= limit``, decided atomically by one Lua script (one
round trip, ``EVALSHA``), and the answers (``Grant`` / ``Denial``, x-ratelimit-* headers, Retry-After,
the 429 envelope) are built by the same code as the mesh's.

**Layout** (prefix ``shepherd:rl:`` by default; tenant and model percent-quoted)::

    {p}{<tenant>}:<model>:w:<window>   hash r (requests), t (tokens reserved + extras), f (refunds);
                                       expires two windows after its last write
    {p}{<tenant>}:<model>:c            zset of in-flight slots (<node>/<gen>/<seq>) scored by expiry

The tenant is the hash tag: the keys of one admission share a Redis Cluster slot. A slot expires
``lease`` seconds after its node last renewed it (every lease / 3, for as long as the request runs), so
a crashed node's in-flight requests stop counting within a lease; a settled request's slot is removed
at once. Window numbers come from the node's wall clock (NTP-level skew: as in the mesh).

**When Redis is unreachable** (a connection error, a Redis error or a call over ``timeout``): the node
admits against ``limit / N`` on its own counts, N being the mesh's nodes that have not left (the
gossip limiter's N, with its unreachable grace) or, if more, the nodes that counted in Redis lately
(a presence set ``{p}nodes`` each node renews every lease / 3; its last count holds during the
outage, so nodes without a mesh split the limit too): a ``local`` ``RateLimiter`` that
every admission through Redis is also charged to, so a node's share includes what it already admitted
in the window. Nothing waits on Redis again until a background ping (every ``PROBE_S``) succeeds; then
the requests and tokens the node admitted meanwhile are added to Redis's windows (so the shared count
holds them) and Redis decides again. Settlements and slot renewals go through one background task in
pipelined batches (a settlement waits up to ``SETTLE_BATCH_S``, 5 ms, for others), never on the request
path; lost ones cost only precision (a slot expires with its lease, a refund is not made). Every
fallback decision is counted (``smg_rate_limit_redis_fallbacks``). A request cancelled while its
admission is in flight may have been counted (a slot then expires with its lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError
from redis.maint_notifications import MaintNotificationsConfig

from shepherd.mesh.ratelimit import Denial, Grant, Limits, Quota, RateLimiter, quota_of
from shepherd.mesh.ratelimit_keys import Key
from shepherd.mesh.ratelimit_shards import sliding, wait_until_fits, window_of

__all__ = ["PROBE_S", "RedisCounters", "RemoteGrant", "redacted"]

log = logging.getLogger("shepherd.node.ratelimit")

PROBE_S = 1.0  # while Redis is down: one ping this often (requests never wait on it)
POOL_SIZE = 32  # connections; a request waiting longer than the timeout for one falls back
SETTLE_BATCH_S = 0.005  # settlements wait this long for others to share their round trip (a slot, 5 ms)
MAX_QUEUED = 65536  # settlements waiting for the background task (beyond: dropped, the lease cleans up)
MAX_OWED = 4096  # (key, window) counts admitted while Redis was down, added back when it returns
MAX_CACHED = 4096  # key names kept per (tenant, model)
_METRICS = ("requests", "tokens", "concurrency")

# KEYS, per rule: current window hash, previous window hash, in-flight zset.
# ARGV[1], one string of space-separated fields (one argument to encode, not 7 + 3 per rule): f, tokens,
# window ttl ms, now, slot expiry, slot member ("-": none), lease ms, then per rule rpm, tpm,
# max_concurrent (0: none). Returns {admitted, rule, metric, then per rule: req prev, req cur, tok prev,
# tok cur, in flight}.
_ADMIT = r"""
local A = {}
for x in string.gmatch(ARGV[1], '%S+') do A[#A + 1] = x end
local f, tokens, ttl = tonumber(A[1]), tonumber(A[2]), tonumber(A[3])
local now, exp, member, lease = tonumber(A[4]), tonumber(A[5]), A[6], tonumber(A[7])
local eps = 1e-9
local out, deny_rule, deny_metric = {}, 0, 0
local n = #KEYS / 3
for i = 1, n do
  local k, a = 3 * (i - 1), 7 + 3 * (i - 1)
  local rpm, tpm, mc = tonumber(A[a + 1]), tonumber(A[a + 2]), tonumber(A[a + 3])
  local c = redis.call('HMGET', KEYS[k + 1], 'r', 't', 'f')
  local p = redis.call('HMGET', KEYS[k + 2], 'r', 't', 'f')
  local rc, tc = tonumber(c[1] or 0), tonumber(c[2] or 0) - tonumber(c[3] or 0)
  local rp, tp = tonumber(p[1] or 0), tonumber(p[2] or 0) - tonumber(p[3] or 0)
  local conc = 0
  if mc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now)
    conc = redis.call('ZCARD', KEYS[k + 3])
  end
  local o = 5 * (i - 1)
  out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = rp, rc, tp, tc, conc
  if deny_rule == 0 then
    if rpm > 0 and rp * (1 - f) + rc + 1 > rpm + eps then
      deny_rule, deny_metric = i, 1
    elseif tpm > 0 and (tokens > tpm or tp * (1 - f) + tc + tokens > tpm + eps) then
      deny_rule, deny_metric = i, 2
    elseif mc > 0 and conc + 1 > mc + eps then
      deny_rule, deny_metric = i, 3
    end
  end
end
if deny_rule == 0 then
  for i = 1, n do
    local k, a = 3 * (i - 1), 7 + 3 * (i - 1)
    redis.call('HINCRBY', KEYS[k + 1], 'r', 1)
    if tokens > 0 then redis.call('HINCRBY', KEYS[k + 1], 't', tokens) end
    redis.call('PEXPIRE', KEYS[k + 1], ttl)
    if tonumber(A[a + 3]) > 0 then
      redis.call('ZADD', KEYS[k + 3], exp, member)
      redis.call('PEXPIRE', KEYS[k + 3], lease)
    end
  end
  return {1, 0, 0, unpack(out)}
end
return {0, deny_rule, deny_metric, unpack(out)}
"""

# KEYS, per rule: the reservation's window hash, the current window hash, the in-flight zset.
# ARGV[1], space-separated: slot member ("-": none), real - reserved tokens, window ttl ms, 1 if the
# reservation's window still counts.
_SETTLE = r"""
local A = {}
for x in string.gmatch(ARGV[1], '%S+') do A[#A + 1] = x end
local member, diff, ttl, refund = A[1], tonumber(A[2]), tonumber(A[3]), A[4] == '1'
for i = 1, #KEYS, 3 do
  if diff > 0 then
    redis.call('HINCRBY', KEYS[i + 1], 't', diff)
    redis.call('PEXPIRE', KEYS[i + 1], ttl)
  elseif diff < 0 and refund and redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HINCRBY', KEYS[i], 'f', -diff)
  end
  if member ~= '-' then redis.call('ZREM', KEYS[i + 2], member) end
end
return 1
"""


def redacted(url: str) -> str:
    """``url`` without its user and password (what logs may say about where Redis is)."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "<unparsable URL>"
    return f"{u.scheme}://{host}{port}{u.path}"


@dataclass(frozen=True, slots=True)
class _Counts:
    req_prev: float
    req_cur: float
    tok_prev: float
    tok_cur: float


class RemoteGrant(Grant):
    """A request admitted by Redis: ``local`` is its charge on the node's own counts, ``bases`` its
    keys' names, ``member`` its in-flight slot ("": no concurrency rule)."""

    __slots__ = ("bases", "local", "member")

    def __init__(
        self,
        keys: tuple[Key, ...],
        win: int,
        tokens: int,
        quota: Any,
        local: Grant,
        bases: tuple[str, ...],
        member: str,
    ) -> None:
        super().__init__(keys, win, tokens, quota)
        self.local = local
        self.bases = bases
        self.member = member


class RedisCounters:
    """The Redis backend of one node's admission. ``local`` is the node's own count (a ``RateLimiter``
    with ``LimiterConfig.local``: the mesh tells it N), the fallback rule while Redis is unreachable.
    Build it anywhere (no I/O); the first admission starts its background task; ``close()`` stops it."""

    def __init__(
        self,
        url: str,
        local: RateLimiter,
        *,
        prefix: str = "shepherd:rl:",
        timeout: float = 0.1,
        lease: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock  # wall-clock seconds: the windows' and the slots' expiry
        self.local = local
        self.cfg = local.cfg
        self.prefix = prefix
        self.timeout = timeout
        self.lease = lease
        self.target = redacted(url)
        self.up = True  # until a call fails
        self.fallbacks = 0  # admission decisions made by the fallback rule
        self.errors = 0  # Redis calls that failed or timed out
        self.settles_dropped = 0  # settlements not made (Redis down, queue full)
        self._ttl_ms = math.ceil(2 * self.cfg.window * 1000) + 1000
        self._lease_ms = math.ceil(2 * lease * 1000)
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            # off: redis-py's "auto" skips the pool's check of an idle connection the server closed
            # (a Redis restarted, its idle timeout), so each one would fail its next command
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._admit: AsyncScript = self._redis.register_script(_ADMIT)
        self._settle: AsyncScript = self._redis.register_script(_SETTLE)
        self._names: dict[Key, str] = {}
        self._member_prefix = f"{quote(local.node, safe='')}/{local.gen}/"  # no spaces (ARGV fields)
        self._presence = f"{prefix}nodes"  # zset: every node counting here, scored by expiry
        self.nodes_seen = 0  # nodes in the presence set at the last announcement (0: not yet)
        self._seq = itertools.count(1)
        self._inflight: dict[str, tuple[str, ...]] = {}  # slot -> its zsets, renewed while running
        self._queue: list[tuple[RemoteGrant, int, int]] = []  # (grant, real - reserved, window at the end)
        self._owed: dict[tuple[str, int], list[int]] = {}  # (key name, window) -> [requests, tokens]
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    # ---- admission --------------------------------------------------------------------------------

    def _name(self, key: Key) -> str:
        name = self._names.get(key)
        if name is None:
            if len(self._names) >= MAX_CACHED:
                self._names.clear()
            name = self._names[key] = f"{self.prefix}{{{quote(key[0], safe='')}}}:{quote(key[1], safe='')}"
        return name

    async def acquire(self, now: float, rules: Sequence[tuple[Key, Limits]], tokens: int) -> Grant | Denial:
        """Admit one request costing ``tokens`` under every rule, or say why not: by Redis, or by the
        fallback rule when Redis is unreachable (never waiting longer than ``timeout``)."""
        if self._worker is None and not self._closed:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-redis")
        if not self.up:
            return self._fall_back(now, rules, tokens)
        w, f = window_of(now, self.cfg.window)
        bases = tuple(self._name(k) for k, _ in rules)
        conc = any(lim.max_concurrent for _, lim in rules)
        member = f"{self._member_prefix}{next(self._seq)}" if conc else ""
        keys: list[str] = []
        arg = f"{f!r} {tokens} {self._ttl_ms} {now!r} {now + self.lease!r} {member or '-'} {self._lease_ms}"
        for base, (_, lim) in zip(bases, rules, strict=True):
            keys += (f"{base}:w:{w}", f"{base}:w:{w - 1}", f"{base}:c")
            arg += f" {lim.rpm or 0} {lim.tpm or 0} {lim.max_concurrent or 0}"
        try:
            async with asyncio.timeout(self.timeout):
                res = await self._admit(keys=keys, args=(arg,))
        except (RedisError, OSError, TimeoutError) as e:
            self._mark_down(e)
            return self._fall_back(now, rules, tokens)
        counts = [int(x) for x in res[3:]]
        if not res[0]:
            return self._denial(rules, counts, int(res[1]) - 1, _METRICS[int(res[2]) - 1], f, tokens)
        if member:
            self._inflight[member] = tuple(
                f"{base}:c" for base, (_, lim) in zip(bases, rules, strict=True) if lim.max_concurrent
            )
        local = self.local.charge(now, rules, tokens)
        quota = partial(_quota, [lim for _, lim in rules], counts, f, self.cfg.window, tokens)
        return RemoteGrant(tuple(k for k, _ in rules), w, tokens, quota, local, bases, member)

    def _denial(
        self,
        rules: Sequence[tuple[Key, Limits]],
        counts: list[int],
        i: int,
        metric: str,
        f: float,
        tokens: int,
    ) -> Denial:
        key, lim = rules[i]
        rp, rc, tp, tc, conc = counts[5 * i : 5 * i + 5]
        win = self.cfg.window
        q = _quota([lm for _, lm in rules], counts, f, win, None)
        if metric == "requests":
            assert lim.rpm is not None
            retry = wait_until_fits(rp, rc, f, win, lim.rpm, 1)
            return Denial(key, "requests", lim.rpm, sliding(rp, rc, f), 1, retry, q)
        if metric == "tokens":
            assert lim.tpm is not None
            retry = math.inf if tokens > lim.tpm else wait_until_fits(tp, tc, f, win, lim.tpm, tokens)
            return Denial(key, "tokens", lim.tpm, sliding(tp, tc, f), tokens, retry, q)
        assert lim.max_concurrent is not None
        return Denial(key, "concurrency", lim.max_concurrent, float(conc), 1, self.cfg.propagation, q)

    def _fall_back(self, now: float, rules: Sequence[tuple[Key, Limits]], tokens: int) -> Grant | Denial:
        self.fallbacks += 1
        got = self.local.acquire(now, rules, tokens)
        if isinstance(got, Grant):
            w, _ = window_of(now, self.cfg.window)
            for key, _ in rules:
                owed = self._owed.get((self._name(key), w))
                if owed is None:
                    if len(self._owed) >= MAX_OWED:
                        continue
                    owed = self._owed[(self._name(key), w)] = [0, 0]
                owed[0] += 1
                owed[1] += tokens
        return got

    # ---- settlement ---------------------------------------------------------------------------------

    def settle(self, now: float, grant: Grant, real_tokens: int | None) -> None:
        """The request ended: release its slot, replace the reservation by ``real_tokens`` (None: kept);
        on the node's own counts at once, in Redis by the background task."""
        if grant.done:
            return
        if not isinstance(grant, RemoteGrant):  # admitted by the fallback rule: local counts only
            self.local.settle(now, grant, real_tokens)
            if real_tokens is not None:  # Redis is owed its real usage, not its reservation (if not repaid)
                for key in grant.keys:
                    owed = self._owed.get((self._name(key), grant.win))
                    if owed is not None:
                        owed[1] += real_tokens - grant.tokens
            return
        grant.done = True
        self.local.settle(now, grant.local, real_tokens)
        if grant.member:
            self._inflight.pop(grant.member, None)
        diff = 0 if real_tokens is None else real_tokens - grant.tokens
        if not grant.member and not diff:
            return
        if len(self._queue) >= MAX_QUEUED:
            self.settles_dropped += 1
            return
        self._queue.append((grant, diff, window_of(now, self.cfg.window)[0]))
        self._wake.set()

    async def _run(self) -> None:
        """Settlements in pipelined batches (those of ``SETTLE_BATCH_S`` after the first go together);
        in-flight slots renewed every lease / 3."""
        renew_every = self.lease / 3
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + renew_every
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_renew - loop.time())):
                    await self._wake.wait()
            if self._queue:
                await asyncio.sleep(SETTLE_BATCH_S)
            self._wake.clear()
            try:
                await self.flush()
                if loop.time() >= next_renew:
                    next_renew = loop.time() + renew_every
                    await self.renew()
                    await self.announce()
            except Exception:
                log.exception("rate limits: Redis settlement or renewal failed")

    async def flush(self) -> None:
        """Send the queued settlements now, in one pipeline (dropped, and counted, while Redis is down)."""
        batch, self._queue = self._queue, []
        if not batch:
            return
        if not self.up:
            self.settles_dropped += len(batch)
            return
        calls: list[list[Any]] = []
        for grant, diff, w in batch:
            keys: list[str] = []
            for base in grant.bases:
                keys += (f"{base}:w:{grant.win}", f"{base}:w:{w}", f"{base}:c")
            refund = 1 if w - 1 <= grant.win <= w else 0
            calls.append([len(keys), *keys, f"{grant.member or '-'} {diff} {self._ttl_ms} {refund}"])
        try:
            async with asyncio.timeout(max(self.timeout, 1.0)):
                for _ in range(2):  # again once if Redis lost its scripts (a restart): loaded first
                    # EVALSHA by hand: a pipeline given the Script object asks SCRIPT EXISTS first, a round
                    # trip more on every batch
                    pipe = self._redis.pipeline(transaction=False)
                    for call in calls:
                        pipe.evalsha(self._settle.sha, *call)
                    results = await pipe.execute(raise_on_error=False)
                    calls = [c for c, r in zip(calls, results, strict=True) if isinstance(r, NoScriptError)]
                    if not calls:
                        break
                    await self._redis.script_load(_SETTLE)
        except (RedisError, OSError, TimeoutError) as e:
            self.settles_dropped += len(batch)
            self._mark_down(e)
            return
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            self.settles_dropped += len(failed)
            log.warning(
                "rate limits: %d settlements refused by Redis (%s)", len(failed), type(failed[0]).__name__
            )

    async def renew(self) -> None:
        """Push the expiry of this node's in-flight slots to now + lease (slots already gone stay gone)."""
        if not self._inflight or not self.up:
            return
        exp = self.clock() + self.lease
        pipe = self._redis.pipeline(transaction=False)
        for member, zsets in self._inflight.items():
            for z in zsets:
                pipe.zadd(z, {member: exp}, xx=True)
                pipe.pexpire(z, self._lease_ms)
        try:
            async with asyncio.timeout(max(self.timeout, 1.0)):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._mark_down(e)

    async def announce(self) -> None:
        """Renew this node in the presence set and count the nodes in it: the fallback rule's N is at
        least that many (``RateLimiter.set_floor``), so nodes that share Redis without sharing a mesh
        (or a node started without one) split the limit while Redis is down, instead of each admitting
        the whole of it. The last count holds during an outage."""
        if not self.up:
            return
        now = self.clock()
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(self._presence, {self._member_prefix[:-1]: now + self.lease})
        pipe.zremrangebyscore(self._presence, "-inf", now)
        pipe.pexpire(self._presence, self._lease_ms)
        pipe.zcard(self._presence)
        try:
            async with asyncio.timeout(max(self.timeout, 1.0)):
                *_, seen = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._mark_down(e)
            return
        self.nodes_seen = int(seen)
        self.local.set_floor(self.nodes_seen)

    # ---- down and back ------------------------------------------------------------------------------

    def _mark_down(self, e: BaseException) -> None:
        self.errors += 1
        if self.up:
            self.up = False
            log.warning(
                "rate limits: Redis at %s unreachable (%s): admitting against this node's share "
                "(limit / %d) until it answers again",
                self.target,
                type(e).__name__,
                self.local.cluster_size,
            )
        if (self._probe is None or self._probe.done()) and not self._closed:
            self._probe = asyncio.get_running_loop().create_task(
                self._probing(), name="ratelimit-redis-probe"
            )

    async def _probing(self) -> None:
        while not self.up and not self._closed:  # until Redis answers, or close()
            await asyncio.sleep(PROBE_S)
            try:
                async with asyncio.timeout(max(self.timeout, 1.0)):
                    await self._redis.ping()
                    await self._repay()
            except (RedisError, OSError, TimeoutError):
                self.errors += 1
                continue
            self.up = True
            log.info("rate limits: Redis at %s answers again: it decides admissions again", self.target)
            with contextlib.suppress(Exception):
                await self.announce()

    async def _repay(self) -> None:
        """Add what the node admitted while Redis was down to Redis's windows that still count."""
        owed, self._owed = self._owed, {}
        w, _ = window_of(self.clock(), self.cfg.window)
        pipe = self._redis.pipeline(transaction=False)
        n = 0
        for (base, win), (req, tok) in owed.items():
            if win >= w - 1:
                pipe.hincrby(f"{base}:w:{win}", "r", req)
                pipe.hincrby(f"{base}:w:{win}", "t", tok)
                pipe.pexpire(f"{base}:w:{win}", self._ttl_ms)
                n += 1
        if n:
            try:
                await pipe.execute()
            except BaseException:
                for k, (req, tok) in owed.items():  # not repaid: kept for the next probe, with what was
                    now_owed = self._owed.setdefault(k, [0, 0])  # added (or settled) meanwhile
                    now_owed[0] += req
                    now_owed[1] += tok
                raise

    async def start(self) -> None:
        """Check Redis once at start-up (bounded): unreachable is not fatal (the fallback rule holds)."""
        try:
            async with asyncio.timeout(max(self.timeout, 1.0)):
                await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as e:
            self._mark_down(e)
        else:
            log.info("rate limits: counted in Redis at %s", self.target)
            await self.announce()
        if self._worker is None and not self._closed:  # renewals and announcements from now on
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-redis")

    async def close(self) -> None:
        """Make the queued settlements (bounded), stop the background tasks, close the connections."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._worker, self._probe) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.flush()
        if self.up:  # leave the presence set: the others' fallback share grows back at once
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(self.timeout, 1.0)):
                    await self._redis.zrem(self._presence, self._member_prefix[:-1])
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()


def _quota(limits: list[Limits], counts: list[int], f: float, window: float, tokens: int | None) -> Quota:
    """The headers' view from the script's counts (``tokens``: the admitted request's, added to them)."""
    rows = []
    for i, lim in enumerate(limits):
        rp, rc, tp, tc, _ = counts[5 * i : 5 * i + 5]
        if tokens is not None:
            rc, tc = rc + 1, tc + tokens
        rows.append((lim, _Counts(rp, rc, tp, tc)))
    return quota_of(rows, f, window, 1.0)
