"""A deterministic multi-node simulation of the mesh rate limiter, in simulated time.

K ``RateLimiter`` replicas exchange deltas over a fake network: every ``gossip_interval`` each node sends
its delta to every peer it can reach (each copy lost with probability ``loss``, delivered after
``delay`` + uniform ``jitter``), and random pairs do a full push-pull sync every ``pushpull_interval``;
or, with ``NetModel.flush``, first-hand as a node's mesh sends (each change to every peer a flush after
it), and with ``Scenario.clock`` the limiters read the simulated clock, as a node's do.
Partitions cut the network between groups of nodes; ``detect`` seconds after a cut each side marks the
other as not live (what SWIM suspicion does), ``rejoin`` seconds after the heal they are live again and
sync. A load model sends requests to each node (Poisson or evenly spaced arrivals, prompt and output
lengths, durations); admitted requests finish later and settle with their real token usage.

The report is, per fixed window of the limiter and per tenant, what the whole mesh admitted divided by
the limit (requests, real tokens, peak and mean concurrency). Same seed, same figures.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_keys import Key
from shepherd.mesh.ratelimit_shards import wire_size


@dataclass(frozen=True, slots=True)
class NetModel:
    gossip_interval: float = 0.2
    delay: float = 0.005
    jitter: float = 0.02
    loss: float = 0.0
    pushpull_interval: float = 15.0  # 0: never
    detect: float = 2.0  # partition start -> each side sees the other as not live
    rejoin: float = 1.0  # heal -> live again, with a full sync
    payload_bytes: int = 900  # one gossip payload
    max_payloads: int = 64  # per node per gossip round (the rest waits a round)
    flush: float = 0.0
    """> 0: first-hand delivery, as a node's mesh runs it (``MeshNode.flush_soon``): a node sends its delta
    to every peer it can reach ``flush`` seconds after a change (at most one send per ``flush``), instead
    of in rounds every ``gossip_interval``."""


@dataclass(frozen=True, slots=True)
class Load:
    tenant: str
    rates: tuple[float, ...]  # requests per second arriving at each node
    model: str = "m"
    prompt: tuple[int, int] = (200, 800)
    max_tokens: int = 256
    used: tuple[float, float] = (0.3, 1.0)  # completion tokens = this fraction of max_tokens
    duration: tuple[float, float] = (0.5, 3.0)  # seconds a request stays in flight
    poisson: bool = True
    start: float = 0.0
    end: float = math.inf


@dataclass(frozen=True, slots=True)
class Partition:
    start: float
    end: float
    groups: tuple[tuple[int, ...], ...]  # node indices; a node in no group is alone


@dataclass(frozen=True, slots=True)
class Rule:
    tenant: str
    limits: Limits
    model: str = ""  # "": the tenant on every model


@dataclass(frozen=True, slots=True)
class Scenario:
    nodes: int
    duration: float
    rules: tuple[Rule, ...]
    loads: tuple[Load, ...]
    net: NetModel = field(default_factory=NetModel)
    limiter: LimiterConfig = field(default_factory=LimiterConfig)
    partitions: tuple[Partition, ...] = ()
    skew: tuple[float, ...] = ()  # per-node clock offset in seconds
    seed: int = 1
    clock: bool = False  # the limiters read the simulated clock (a node's do: stamps at publication)


@dataclass(slots=True)
class WindowStat:
    offered: int = 0
    admitted: int = 0
    tokens: int = 0  # real tokens of the requests admitted in this window
    peak_concurrent: int = 0
    conc_area: float = 0.0  # integral of mesh-wide in-flight over time
    over_area: float = 0.0  # integral of in-flight above the tenant's tightest concurrency limit


@dataclass(slots=True)
class SimResult:
    window: float
    windows: int
    stats: dict[str, list[WindowStat]]  # tenant -> per window
    rejected_by_node: list[int] = field(default_factory=list)
    messages: int = 0
    bytes_estimate: int = 0
    admit_times: dict[str, list[float]] = field(default_factory=dict)  # tenant -> times, in order

    def ratios(self, tenant: str, metric: str, limit: float, skip: int = 1) -> list[float]:
        """Per window from ``skip`` on: admitted ÷ limit. metric: requests, tokens, peak_concurrent,
        mean_concurrent, excess_concurrent (time-averaged in-flight above the limit)."""
        out = []
        for ws in self.stats[tenant][skip:]:
            if metric == "requests":
                val = float(ws.admitted)
            elif metric == "tokens":
                val = float(ws.tokens)
            elif metric == "peak_concurrent":
                val = float(ws.peak_concurrent)
            elif metric == "excess_concurrent":
                val = ws.over_area / self.window
            else:
                val = ws.conc_area / self.window
            out.append(val / limit)
        return out

    def sliding_ratios(
        self, tenant: str, limit: float, start: float, end: float, step: float = 1.0
    ) -> list[float]:
        """Admitted in every sliding window of the limiter's length ending at start, start + step, ...
        <= end, ÷ limit (exact counts, not the limiter's approximation)."""
        times = self.admit_times.get(tenant, [])
        out = []
        t = start
        while t <= end + 1e-9:
            out.append((bisect.bisect_right(times, t) - bisect.bisect_right(times, t - self.window)) / limit)
            t += step
        return out


def summarize(ratios: Sequence[float]) -> tuple[float, float, float]:
    """(mean, worst over, worst under) of admitted ÷ limit ratios."""
    if not ratios:
        return 0.0, 0.0, 0.0
    return sum(ratios) / len(ratios), max(ratios), min(ratios)


_ARRIVE, _FINISH, _GOSSIP, _DELIVER, _MEMBERS, _PUSHPULL = range(6)


class _Sim:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = random.Random(sc.seed)
        k = sc.nodes
        self.t = 0.0  # the simulated time (the limiters' clock, with ``Scenario.clock``)
        self.limiters = [
            RateLimiter(f"n{i}", 1, sc.limiter, partial(self.clock_of, i) if sc.clock else None)
            for i in range(k)
        ]
        self.flush_due: list[float | None] = [None] * k  # first-hand: a node's pending send
        self.flushed = [-math.inf] * k
        for i, lim in enumerate(self.limiters):
            lim.set_membership([f"n{i}" for i in range(k)], k)
            if sc.net.flush > 0:
                lim.on_dirty = partial(self.flush_soon, i)
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.window = sc.limiter.window
        self.nwin = max(1, math.ceil(sc.duration / self.window))
        self.stats = {ld.tenant: [WindowStat() for _ in range(self.nwin)] for ld in sc.loads} | {
            r.tenant: [WindowStat() for _ in range(self.nwin)] for r in sc.rules
        }
        self.inflight: dict[str, int] = dict.fromkeys(self.stats, 0)
        self.last_change: dict[str, float] = dict.fromkeys(self.stats, 0.0)
        self.rejected = [0] * k
        self.messages = 0
        self.bytes = 0
        self.rules: dict[tuple[str, str], list[tuple[Key, Limits]]] = {}
        self.admit_times: dict[str, list[float]] = {t: [] for t in self.stats}
        self.conc_limit: dict[str, float] = {}
        for r in sc.rules:
            if r.limits.max_concurrent is not None:
                old = self.conc_limit.get(r.tenant, math.inf)
                self.conc_limit[r.tenant] = min(old, r.limits.max_concurrent)

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def rules_for(self, tenant: str, model: str) -> list[tuple[Key, Limits]]:
        got = self.rules.get((tenant, model))
        if got is None:
            got = [
                ((r.tenant, r.model), r.limits)
                for r in self.sc.rules
                if r.tenant == tenant and r.model in ("", model)
            ]
            self.rules[(tenant, model)] = got
        return got

    def group_of(self, t: float, node: int) -> int:
        for p in self.sc.partitions:
            if p.start <= t < p.end:
                for gi, g in enumerate(p.groups):
                    if node in g:
                        return gi
                return -1 - node
        return 0

    def reachable(self, t: float, a: int, b: int) -> bool:
        return self.group_of(t, a) == self.group_of(t, b)

    def now_of(self, t: float, node: int) -> float:
        return t + (self.sc.skew[node] if node < len(self.sc.skew) else 0.0)

    def clock_of(self, node: int) -> float:
        return self.now_of(self.t, node)

    def flush_soon(self, node: int) -> None:
        """First-hand (``NetModel.flush``): send ``node``'s delta ``flush`` after its last send, or now."""
        if self.flush_due[node] is None:
            due = max(self.t, self.flushed[node] + self.sc.net.flush)
            self.flush_due[node] = due
            self.push(due, _GOSSIP, node)

    def win_of(self, t: float) -> int:
        return min(self.nwin - 1, int(t // self.window))

    def conc_change(self, t: float, tenant: str, delta: int) -> None:
        # integrate in-flight over time, split at window boundaries
        t0 = self.last_change[tenant]
        level = self.inflight[tenant]
        over = max(0.0, level - self.conc_limit.get(tenant, math.inf))
        while t0 < t:
            w = self.win_of(t0)
            t1 = min(t, (w + 1) * self.window) if w < self.nwin - 1 else t
            self.stats[tenant][w].conc_area += level * (t1 - t0)
            self.stats[tenant][w].over_area += over * (t1 - t0)
            t0 = t1
        self.last_change[tenant] = t
        self.inflight[tenant] = level + delta
        ws = self.stats[tenant][self.win_of(t)]
        ws.peak_concurrent = max(ws.peak_concurrent, self.inflight[tenant])

    def send(self, t: float, src: int, dst: int, data: list[list[Any]]) -> None:
        self.messages += 1
        self.bytes += 5 + sum(wire_size(e) for e in data)
        if self.rng.random() < self.sc.net.loss:
            return
        self.push(t + self.sc.net.delay + self.rng.random() * self.sc.net.jitter, _DELIVER, (src, dst, data))

    def run(self) -> SimResult:
        sc, net, k = self.sc, self.sc.net, self.sc.nodes
        for li, ld in enumerate(sc.loads):
            for node, rate in enumerate(ld.rates):
                if rate > 0:
                    first = ld.start + (
                        self.rng.expovariate(rate) if ld.poisson else self.rng.random() / rate
                    )
                    self.push(first, _ARRIVE, (li, node))
        for node in range(k if net.flush <= 0 else 0):
            self.push(net.gossip_interval * (node + 1) / k, _GOSSIP, node)
        if net.pushpull_interval > 0:
            self.push(net.pushpull_interval, _PUSHPULL, None)
        names = [f"n{i}" for i in range(k)]
        for p in sc.partitions:
            groups = {n: next((g for g in p.groups if n in g), (n,)) for n in range(k)}
            for n in range(k):
                self.push(p.start + net.detect, _MEMBERS, (n, tuple(names[i] for i in groups[n])))
                self.push(p.end + net.rejoin, _MEMBERS, (n, tuple(names)))
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            if t >= sc.duration:
                break
            self.t = t
            if kind == _ARRIVE:
                self.arrive(t, *payload)
            elif kind == _FINISH:
                node, grant, real, tenant = payload
                self.limiters[node].settle(self.now_of(t, node), grant, real)
                self.conc_change(t, tenant, -1)
            elif kind == _GOSSIP:
                for _ in range(net.max_payloads):  # payloads of at most ~payload_bytes, as MeshState sends
                    delta = self.limiters[payload].take_delta(net.payload_bytes)
                    if delta is None:
                        break
                    for dst in range(k):
                        if dst != payload and self.reachable(t, payload, dst):
                            self.send(t, payload, dst, delta)
                if net.flush > 0:
                    self.flush_due[payload] = None
                    self.flushed[payload] = t
                else:
                    self.push(t + net.gossip_interval, _GOSSIP, payload)
            elif kind == _DELIVER:
                src, dst, data = payload
                if self.reachable(t, src, dst):
                    self.limiters[dst].apply_delta(data)
            elif kind == _MEMBERS:
                node, live = payload
                self.limiters[node].set_membership(live, k)
                if len(live) == k:  # rejoined: full sync with everyone reachable
                    for other in range(k):
                        if other != node and self.reachable(t, node, other):
                            self.send(t, node, other, self.limiters[node].snapshot())
            elif kind == _PUSHPULL:
                for a in range(k):
                    b = self.rng.randrange(k - 1) if k > 1 else 0
                    b = b + 1 if b >= a else b
                    if k > 1 and self.reachable(t, a, b):
                        self.send(t, a, b, self.limiters[a].snapshot())
                        self.send(t, b, a, self.limiters[b].snapshot())
                self.push(t + net.pushpull_interval, _PUSHPULL, None)
        for tenant in self.stats:
            self.conc_change(sc.duration, tenant, 0)
        return SimResult(
            self.window, self.nwin, self.stats, self.rejected, self.messages, self.bytes, self.admit_times
        )

    def arrive(self, t: float, li: int, node: int) -> None:
        ld = self.sc.loads[li]
        rate = ld.rates[node]
        nxt = t + (self.rng.expovariate(rate) if ld.poisson else 1.0 / rate)
        if nxt < ld.end:
            self.push(nxt, _ARRIVE, (li, node))
        prompt = self.rng.randint(*ld.prompt)
        reserve = prompt + ld.max_tokens
        ws = self.stats[ld.tenant][self.win_of(t)]
        ws.offered += 1
        got = self.limiters[node].acquire(self.now_of(t, node), self.rules_for(ld.tenant, ld.model), reserve)
        if not isinstance(got, Grant):
            self.rejected[node] += 1
            return
        real = prompt + int(ld.max_tokens * self.rng.uniform(*ld.used))
        ws.admitted += 1
        ws.tokens += real
        self.admit_times[ld.tenant].append(t)
        self.conc_change(t, ld.tenant, +1)
        self.push(t + self.rng.uniform(*ld.duration), _FINISH, (node, got, real, ld.tenant))


def simulate(scenario: Scenario) -> SimResult:
    return _Sim(scenario).run()


def even(total_rate: float, nodes: int) -> tuple[float, ...]:
    return tuple(total_rate / nodes for _ in range(nodes))


def uneven(total_rate: float, weights: Sequence[float]) -> tuple[float, ...]:
    s = sum(weights)
    return tuple(total_rate * w / s for w in weights)
