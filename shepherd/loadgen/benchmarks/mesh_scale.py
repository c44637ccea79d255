"""``smg-bench mesh-scale``: the mesh's replicated state at fleet sizes, in simulation.

N nodes of ``shepherd.mesh.sim`` (real ``Swim``, datagrams through the real codec ``mesh_wire``, message
loss, push-pull over simulated TCP), each carrying a real ``MeshState`` with a real ``RateLimiter``
registered: the delivery path is SWIM's (piggybacked broadcasts with the retransmit limit, relays by the
receivers, push-pull repair), what a mesh without ``first_hand`` does. Per N, measured:

* **rate limits**: one tenant with an rpm limit, requests arriving at every node (Poisson) at 2x the
  limit in total; per fixed window the mesh's admitted count / the limit (mean over the windows after
  warm-up, and the worst window); the staleness of peers' shards: every second, for sampled (observer,
  origin) pairs, how long ago the origin made the first change the observer has not seen (0 if it saw
  the latest), p50 / p99 / max.
* **health and worker adds**: every node observes every one of W workers (the node's health loop:
  ``observe_health`` each tick; only a change is gossiped, as a delta of the observer's record, plus
  a small beacon every 10 s); at times a random node flips a worker's health or adds a worker: the
  time until each other node's state has it, p99 (and how many never got it within 20 s).
* **push-pull**: during the run, the largest push-pull state a node sent (``local_state``: a request
  carries digests and the node's own parts, a reply what the requester lacks) and the p99 of the time
  a merge took (``merge_remote_state``, less the garbage collector's pauses in it: this one process
  holds every node's heap, 35 ms pauses at N = 100 where a node's own heap is 1/N of it); after the
  run, a fresh peer's join exchange with a node (its request, the reply with the whole state, and the
  merge of that reply) -- the loop time one exchange costs.
* **index replication** (``mesh_index``: a few nodes with real replicas route a follow-up-heavy chat
  trace through the real codec, then computed per N): per design (``before``: slot-move re-sends to
  every member; ``all``: new blocks only, to every member or to the nodes routing the same model;
  ``auto``: the engines' KV events on every node, nothing gossiped), the payloads per request, the CPU
  per datagram sent and received, the share of cross-node follow-ups that find their prefix; per node
  per second at N, at 100 and 1,000 req/s per node: datagrams and bytes out (and in) and their CPU, and
  for ``auto`` the KV feed's.

Figures are deterministic for a seed (the CPU ones are timed on this machine). ``--mode`` picks the
rate-limit delivery to measure: ``before`` (deltas ride piggybacking unkeyed, never relayed) or ``after``
(``LimiterConfig.relay``: received shards re-gossiped, one queued delta per shard), or ``first-hand``:
the node's own delivery (``MeshStateConfig(first_hand=True)``, what ``MeshNode`` runs): nothing is
relayed or piggybacked; each node sends its ``owned_batches`` (registry entries, health deltas and
beacons, rate-limit shards; and ``index_batches``) as datagrams of their own to every alive member,
flushed as ``MeshNode.flush_soon`` does (a rate-limit change ``LIMIT_FLUSH_S`` after the last flush, a
worker or health change ``INDEX_FLUSH_S``, a member event, and every tick), over the same lossy
transport; push-pulls merge only the peer's own entries (``merge_remote_state_from``). Its price is the
owner's: the datagrams and bytes per node per second it sends (``owned dg/s, KB/s``).
"""

from __future__ import annotations

import argparse
import bisect
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shepherd.loadgen.benchmarks import Benchmark
from shepherd.loadgen.benchmarks.mesh_index import CAPACITY, DESIGNS, SHAPES, index_cost, models_for, project
from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.sim import Sim
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_registry import WorkerRecord
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.state_wire import peek
from shepherd.mesh.swim_types import Action, MemberDead, MemberLeft, MemberUp
from shepherd.policies.prefix_replica_native import Replica, make_replica

BASE = 1_790_000_000.0  # the simulated wall clock starts here (HLC stamps need a plausible time)
TENANT = ("t", "")
MODEL = "m"
# the node's flush timing (``shepherd.node.cluster.mesh_node``, which loadgen may not import; a test
# checks they agree): index, worker and health deltas at most this often, a rate-limit shard this soon
INDEX_FLUSH_S = 0.02
LIMIT_FLUSH_S = 0.002


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def default_workers(n: int) -> int:
    """Workers in the fleet at N nodes (the issue's shapes: 16 up to 50 nodes, 64 at 100, 2N beyond)."""
    return 16 if n <= 50 else 64 if n <= 100 else 2 * n


# ---- the simulated mesh ------------------------------------------------------------------------------


class _Node:
    """A node's delegate: its ``MeshState`` (the SWIM ``Delegate``), with push-pull sizes and merge
    times recorded."""

    def __init__(self, name: str, state: MeshState[Replica], limiter: RateLimiter) -> None:
        self.name = name
        self.state = state
        self.limiter = limiter
        self.pp_bytes: list[int] = []
        self.pp_merge_s: list[float] = []
        self.flusher: _Flusher | None = None  # first_hand: the node's sends of its own deltas

    def broadcasts(self, budget: int) -> list[bytes]:
        return self.state.broadcasts(budget)

    def on_user(self, payload: bytes, src_name: str) -> None:
        self.state.on_user(payload, src_name)

    def local_state(self) -> bytes:
        data = self.state.local_state()
        self.pp_bytes.append(len(data))
        return data

    def merge_remote_state(self, data: bytes) -> None:
        g0 = _GC.spent
        t0 = time.process_time()
        # first_hand: the runtime passes the peer's certificate identity; here, the name it states
        peer = _pp_sender(data) if self.state.cfg.first_hand else ""
        self.state.merge_remote_state_from(data, peer)
        # less the collector's pauses: this process holds all N nodes' heaps, a node only its own
        self.pp_merge_s.append(time.process_time() - t0 - (_GC.spent - g0))


class _GcClock:
    """Process CPU spent in the garbage collector (``gc.callbacks``), while installed."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.process_time()
        else:
            self.spent += time.process_time() - self._t0


_GC = _GcClock()


def _pp_sender(data: bytes) -> str:
    """The node a push-pull state says it is from (its body's ``n``), "" if none."""
    try:
        _, body = peek(data)
    except ValueError:
        return ""
    n = body.get("n") if isinstance(body, dict) else None
    return n if isinstance(n, str) else ""


class _Flusher:
    """A node's first-hand delivery as ``MeshNode`` runs it: ``soon(gap)`` is ``flush_soon`` (flush now,
    or ``gap`` after the last such flush; one pending flush, an earlier due time re-arms it), ``flush()``
    is ``flush_index``: the state's ``owned_batches`` and ``index_batches``, each a datagram of its own
    to every alive member (``send_user``). The datagrams and bytes it sent from ``count_from`` on are
    counted (the owner's price)."""

    def __init__(self, sim: Sim, name: str, state: MeshState[Replica]) -> None:
        self.sim = sim
        self.name = name
        self.state = state
        self._last = -INDEX_FLUSH_S
        self._due: float | None = None
        self._token = 0
        self.count_from = math.inf  # [count_from, count_until): the sends counted
        self.count_until = math.inf
        self.datagrams = 0
        self.bytes = 0

    def soon(self, gap: float = INDEX_FLUSH_S) -> None:
        now = self.sim.now
        due = max(self._last + gap, now)
        if self._due is not None and self._due <= due:
            return
        self._due = due
        self._token += 1
        self.sim.at(due, partial(self._flush_due, self._token))

    def _flush_due(self, token: int) -> None:
        if token != self._token:
            return
        self._due = None
        self._last = self.sim.now
        self.flush()

    def flush(self) -> int:
        swim = self.sim.nodes[self.name].swim
        if swim is None:
            return 0
        payloads = self.state.owned_batches() + self.state.index_batches()
        if not payloads:
            return 0
        dests = [m.addr for m in swim.alive_members() if m.name != self.name]
        stats = self.sim.nodes[self.name].stats
        b0 = stats.bytes_sent
        n = self.sim.send_user(self.name, dests, payloads)
        if self.count_from <= self.sim.now < self.count_until:
            self.datagrams += n
            self.bytes += stats.bytes_sent - b0
        return n


class StateSim(Sim):
    """``Sim`` whose nodes' delegates are ``_Node``s, told of SWIM's membership events."""

    def _execute(self, node: Any, actions: list[Action]) -> None:
        super()._execute(node, actions)
        d = node.delegate
        if isinstance(d, _Node):
            for a in actions:
                if isinstance(a, MemberUp | MemberDead | MemberLeft):
                    d.state.on_member_event(a)
                    if d.flusher is not None:
                        d.flusher.soon()


def _members_of(sim: Sim, name: str) -> int:
    swim = sim.nodes[name].swim
    return 1 if swim is None else swim.num_members()


@dataclass(slots=True)
class ScaleResult:
    n: int
    workers: int
    admitted: list[float] = field(default_factory=list)  # per window, admitted / limit
    staleness: list[float] = field(default_factory=list)
    health_lag: list[float] = field(default_factory=list)
    health_missed: int = 0
    add_lag: list[float] = field(default_factory=list)
    add_missed: int = 0
    pp_bytes: int = 0  # the reply to a fresh peer (a join): the whole state
    pp_merge_ms: float = 0.0  # the fresh peer's merge of it
    pp_run_max_bytes: int = 0  # the largest push-pull state sent during the run
    pp_run_merge_p99_ms: float = 0.0
    false_deaths: int = 0
    gossip_bps: float = 0.0  # bytes per node per second, all datagrams
    queue_len: float = 0.0  # mean broadcast queue length at the end
    tau: list[float] = field(default_factory=list)  # each node's τ (the lease's) at the end
    datagrams_s: float = 0.0  # datagrams per node per second, all (SWIM's and the state's)
    owned_datagrams_s: float = 0.0  # first_hand: the owned deltas' datagrams per node per second, under load
    owned_bps: float = 0.0  # and their bytes
    wall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    loss: float = 0.01
    window: float = 60.0
    windows: int = 3  # measured windows (after one warm-up window)
    per_node_limit: float = 1.0  # requests per second of the limit, per node
    load: float = 2.0  # arrivals / limit
    relay: bool = False
    propagation: float = 1.0  # the limiter's τ (LimiterConfig.propagation)
    relay_batch: int = 4  # LimiterConfig.relay_batch
    propagation_max: float = LimiterConfig().propagation_max  # τ from the held states' ages, up to this
    stale_sample_pairs: int = 400
    trials: int = 6  # health flips and worker adds
    seed: int = 1
    first_hand: bool = False  # the node's delivery (MeshStateConfig.first_hand, owned_batches to all)


def run_scale(n: int, workers: int, cfg: ScaleConfig) -> ScaleResult:
    wall0 = time.process_time()
    res = ScaleResult(n, workers)
    rng = random.Random(f"scale-{cfg.seed}-{n}")
    lim_cfg = LimiterConfig(
        window=cfg.window,
        relay=cfg.relay,
        propagation=cfg.propagation,
        relay_batch=cfg.relay_batch,
        propagation_max=cfg.propagation_max,
    )
    limit_rpw = round(cfg.per_node_limit * n * cfg.window)  # requests per window
    rules = [(TENANT, Limits(rpm=limit_rpw))]
    nodes: dict[str, _Node] = {}
    sim_ref: list[StateSim] = []

    def clock() -> float:
        return BASE + sim_ref[0].now

    def make(name: str) -> _Node:
        sim = sim_ref[0]
        limiter = RateLimiter(name, round(clock() * 1e6), lim_cfg, clock)  # gen: its start (µs), as a node's
        state: MeshState[Replica] = MeshState(
            name,
            clock,
            MeshStateConfig(first_hand=cfg.first_hand),
            new_index=lambda: make_replica(),
            num_nodes=partial(_members_of, sim, name),
        )
        state.register("ratelimit", limiter)
        node = _Node(name, state, limiter)
        if cfg.first_hand:
            fl = node.flusher = _Flusher(sim, name, state)
            limiter.on_dirty = partial(fl.soon, LIMIT_FLUSH_S)
        nodes[name] = node
        return node

    sim = StateSim(n, seed=cfg.seed, loss=cfg.loss, delegates=make, seeds=3, start_spread=2.0)
    sim_ref.append(sim)
    names = sim.names
    wids = [f"w{i}" for i in range(workers)]

    # origin -> the times of its own shard's changes (each arrival: an attempt)
    history: dict[str, list[float]] = {nm: [] for nm in names}
    admitted: dict[int, int] = {}
    joined = 8.0 + n * 0.02  # membership settles (start spread, joins through 3 seeds)
    t_load = joined
    t_end = t_load + cfg.window * (cfg.windows + 1)
    first_window = math.floor((BASE + t_load) / cfg.window) + 1

    def tick(name: str) -> None:
        node = nodes.get(name)
        swim = sim.nodes[name].swim
        if node is None or swim is None:
            sim.at(sim.now + 1.0, lambda: tick(name))
            return
        node.limiter.update_members([(m.name, m.state.name.lower()) for m in swim.members()], clock())
        for w in wids:
            node.state.observe_health(w, healthy[w].get(name, True))
        node.state.tick()
        if node.flusher is not None:  # the node's tick ends with a flush (expiries, renewals, beacons)
            node.flusher.flush()
        sim.at(sim.now + 1.0, lambda: tick(name))

    healthy: dict[str, dict[str, bool]] = {w: {} for w in wids}

    def arrival(name: str, rate: float) -> None:
        node = nodes[name]
        now = clock()
        g = node.limiter.acquire(now, rules, 0)
        if isinstance(g, Grant):
            w = math.floor(now / cfg.window)
            admitted[w] = admitted.get(w, 0) + 1
            node.limiter.settle(now, g, None)
        history[name].append(now)
        if sim.now < t_end:
            sim.at(sim.now + rng.expovariate(rate), lambda: arrival(name, rate))

    def sample_staleness() -> None:
        now = clock()
        for _ in range(cfg.stale_sample_pairs):
            obs, origin = rng.sample(names, 2)
            ts = history[origin]
            held = nodes[obs].limiter.shard_time(TENANT, origin)  # its last change (to the ms below)
            i = 0 if held is None else bisect.bisect_right(ts, held + 0.001)
            res.staleness.append(0.0 if i >= len(ts) else now - ts[i])
        if sim.now + 1.0 < t_end:
            sim.at(sim.now + 1.0, sample_staleness)

    for i, nm in enumerate(names):
        sim.at(1.0 + i / n, partial(tick, nm))
    rate = cfg.load * cfg.per_node_limit
    for nm in names:
        sim.at(t_load + rng.uniform(0, 1), partial(arrival, nm, rate))
    sim.at(t_load + cfg.window, sample_staleness)

    # health flips and worker adds, spread over the measured windows
    trial_times = [
        t_load + cfg.window * (1 + (k + 0.5) * cfg.windows / cfg.trials) for k in range(cfg.trials)
    ]
    lags: list[tuple[str, str, float, str, dict[str, float]]] = []  # kind, subject, start, origin, seen

    def on_health(name: str, w: str) -> None:
        for kind, subj, start, origin, seen in lags:
            if kind == "health" and subj == w and name != origin and name not in seen:
                view = nodes[name].state.health_view(w)
                if view.unhealthy > 0:
                    seen[name] = sim.now - start

    def on_added(name: str, rec: WorkerRecord) -> None:
        for kind, subj, start, origin, seen in lags:
            if kind == "add" and subj == rec.id and name != origin and name not in seen:
                seen[name] = sim.now - start

    def start_trial(k: int) -> None:
        origin = rng.choice(names)
        if k % 2 == 0 and wids:
            w = rng.choice(wids)
            healthy[w][origin] = False
            nodes[origin].state.observe_health(w, False)
            lags.append(("health", w, sim.now, origin, {}))
        else:
            wid = f"added-{k}"
            lags.append(("add", wid, sim.now, origin, {}))
            nodes[origin].state.add_worker(WorkerRecord(wid, f"http://10.9.0.{k}:8000", MODEL, "sglang"))
        fl = nodes[origin].flusher
        if fl is not None:  # the node's registry hooks (on_added, on_health_change): flush_soon
            fl.soon()

    def hook() -> None:
        for nm, node in nodes.items():
            node.state.on_health_changed.append(partial(on_health, nm))
            node.state.on_worker_added.append(partial(on_added, nm))
            if node.flusher is not None:
                node.flusher.count_from, node.flusher.count_until = sim.now, t_end

    sim.at(t_load, hook)
    for k, t in enumerate(trial_times):
        sim.at(t, partial(start_trial, k))

    # workers of the fleet, spread over the nodes (each pinned by its owner), before the load
    def add_fleet() -> None:
        for i, w in enumerate(wids):
            owner = nodes[names[i % n]]
            owner.state.add_worker(WorkerRecord(w, f"http://10.8.{i // 250}.{i % 250}:8000", MODEL))
            if owner.flusher is not None:
                owner.flusher.soon()

    sim.at(2.0, add_fleet)
    gc.callbacks.append(_GC)
    try:
        sim.run(t_end + 8.0)
    finally:
        gc.callbacks.remove(_GC)

    for kind, _, _, _, seen in lags:
        got = list(seen.values())
        missed = n - 1 - len(seen)
        if kind == "health":
            res.health_lag.extend(got)
            res.health_missed += missed
        else:
            res.add_lag.extend(got)
            res.add_missed += missed
    res.admitted = [admitted.get(w, 0) / limit_rpw for w in range(first_window, first_window + cfg.windows)]
    res.false_deaths = len(sim.false_dead())
    res.gossip_bps = sim.gossip_bytes() / n / sim.now
    res.datagrams_s = sum(nd.stats.packets_sent for nd in sim.nodes.values()) / n / sim.now
    flushers = [nd.flusher for nd in nodes.values() if nd.flusher is not None]
    if flushers:  # counted from the load's start to its end
        res.owned_datagrams_s = sum(f.datagrams for f in flushers) / n / (t_end - t_load)
        res.owned_bps = sum(f.bytes for f in flushers) / n / (t_end - t_load)
    res.queue_len = statistics.mean(len(nd.state._queue) for nd in nodes.values())
    res.tau = sorted(nd.limiter.propagation for nd in nodes.values())
    res.pp_run_max_bytes = max((b for nd in nodes.values() for b in nd.pp_bytes), default=0)
    res.pp_run_merge_p99_ms = _pct([x for nd in nodes.values() for x in nd.pp_merge_s], 0.99) * 1000
    # push-pull: a fresh peer joins through one node: its request, the node's reply (everything), merged
    src = nodes[names[-1]]
    fresh: MeshState[Replica] = MeshState("fresh", clock, MeshStateConfig(), new_index=lambda: make_replica())
    fresh.register("ratelimit", RateLimiter("fresh", 0, lim_cfg))
    src.state.merge_remote_state(fresh.local_state())
    data = src.state.local_state()
    res.pp_bytes = len(data)
    gc.collect()  # not a node's pause: this process holds every node's heap
    t0 = time.process_time()
    fresh.merge_remote_state(data)
    res.pp_merge_ms = (time.process_time() - t0) * 1000
    res.wall_s = time.process_time() - wall0
    return res


# ---- push-pull at fleet sizes (no membership simulated: the state of a converged mesh) ------------------


@dataclass(frozen=True, slots=True)
class PushPullCost:
    request_bytes: int  # what a node of the converged mesh sends to start a push-pull
    request_merge_ms: float  # a converged peer's merge of it
    reply_bytes: int  # that peer's reply (it holds the same state)
    reply_merge_ms: float
    join_bytes: int  # the reply to a fresh peer's request (everything)
    join_merge_ms: float  # the fresh peer's merge of it
    join_stall_ms: float = 0.0  # that merge in steps, as the runtime runs it: the longest step
    join_steps: int = 0  # and how many


def pushpull_cost(n: int, workers: int, tenants: int = 1) -> PushPullCost:
    """Push-pull exchanges in a converged N-node mesh (``workers`` workers owned round-robin, every node
    checking every worker, every node's rate-limit shard of ``tenants`` keys): between two converged
    nodes (request, reply) and a fresh peer's join (the reply carries everything): bytes and the
    process CPU (ms) each merge takes."""
    now = [BASE]
    cfg = MeshStateConfig()
    big: MeshState[Replica] = MeshState("n0", lambda: now[0], cfg, new_index=make_replica)
    gen = round((BASE - 60.0) * 1e6)  # the processes started a minute ago (version stamps: ms since then)
    big.register("ratelimit", RateLimiter("n0", gen))
    for i in range(n):
        name = f"n{i}"
        st: MeshState[Replica] = MeshState(name, lambda: now[0], cfg, new_index=make_replica)
        lim = RateLimiter(name, gen)
        st.register("ratelimit", lim)
        for k in range(tenants):
            lim.acquire(now[0], [((f"t{k}", ""), Limits(rpm=1_000_000))], 100)
        for j in range(i, workers, n):
            st.add_worker(WorkerRecord(f"w{j}", f"http://10.8.{j // 250}.{j % 250}:8000", MODEL, owner=name))
        for j in range(workers):
            st.observe_health(f"w{j}", True)
        big.merge_remote_state(st.local_state())
    big.local_state()  # (the reply to the last one)

    def exchange(a: MeshState[Replica], b: MeshState[Replica]) -> tuple[int, float, int, float]:
        req = a.local_state()
        t0 = time.process_time()
        b.merge_remote_state(req)
        t1 = time.process_time()
        rep = b.local_state()
        t2 = time.process_time()
        a.merge_remote_state(rep)
        t3 = time.process_time()
        return len(req), (t1 - t0) * 1000, len(rep), (t3 - t2) * 1000

    peer: MeshState[Replica] = MeshState("fresh", lambda: now[0], cfg, new_index=make_replica)
    peer.register("ratelimit", RateLimiter("fresh", gen))
    _, _, join_b, join_ms = exchange(peer, big)
    req_b, req_ms, rep_b, rep_ms = exchange(peer, big)  # now converged (its own parts aside)
    # another fresh peer's join merged in steps (``merge_remote_state_steps``, the runtime's way: the
    # loop runs between steps): the longest step is the loop stall (less the collector's pauses, as in
    # the simulation: this process holds N + 2 nodes' heaps, a node its own, frozen at start-up)
    steps: MeshState[Replica] = MeshState("fresh2", lambda: now[0], cfg, new_index=make_replica)
    steps.register("ratelimit", RateLimiter("fresh2", 0))
    big.merge_remote_state(steps.local_state())
    it, stall, k = steps.merge_remote_state_steps(big.local_state()), 0.0, 0
    gc.callbacks.append(_GC)
    try:
        for _ in range(1 << 20):  # (bounded: the generator ends with its input's parts)
            g0, t0 = _GC.spent, time.process_time()
            done = next(it, False) is False  # (a step yields None)
            stall = max(stall, time.process_time() - t0 - (_GC.spent - g0))
            k += 1
            if done:
                break
    finally:
        gc.callbacks.remove(_GC)
    return PushPullCost(req_b, req_ms, rep_b, rep_ms, join_b, join_ms, stall * 1000, k)


# ---- index replication cost: mesh_index (the designs, the cross-node hit rate) -------------------------


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="20,50,100,200", help="node counts")
    p.add_argument(
        "--mode",
        choices=("before", "after", "first-hand"),
        default="after",
        help="state delivery: relayed (before/after: LimiterConfig.relay) or the node's first-hand",
    )
    p.add_argument("--loss", type=float, default=0.01, help="datagram loss probability")
    p.add_argument("--window", type=float, default=60.0, help="rate-limit window, seconds")
    p.add_argument("--windows", type=int, default=3, help="measured windows after a warm-up one")
    p.add_argument("--workers", default="", help="workers per size, e.g. 16,16,64,400 (default by size)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-index", action="store_true", help="skip the index replication cost")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated mesh")
    p.add_argument("--no-pushpull", action="store_true", help="skip the push-pull sizes of a converged mesh")
    p.add_argument("--index-flush", type=float, default=0.02, help="seconds between index flushes")
    p.add_argument(
        "--index-designs",
        default=",".join(DESIGNS),
        help="index replication designs to measure (before, all, auto, ends; mesh_index)",
    )
    p.add_argument(
        "--index-turn-flush",
        type=float,
        default=0.02,
        help="seconds between index flushes for the ends design (turn ends coalesce per flush)",
    )
    p.add_argument(
        "--index-turn-ends",
        type=int,
        default=0,
        help="turn ends a replica keeps, for the ends design (0: the default, IndexReplConfig.turn_ends_max)",
    )
    p.add_argument(
        "--index-capacity", type=int, default=CAPACITY, help="index blocks per worker in the index figures"
    )
    p.add_argument("--tenants", type=int, default=1, help="rate-limit keys in the push-pull figures")
    p.add_argument("--propagation", type=float, default=1.0, help="the limiter's τ (lease), seconds")
    p.add_argument("--relay-batch", type=int, default=4, help="relayed rate-limit shards per packet")
    p.add_argument(
        "--propagation-max",
        type=float,
        default=LimiterConfig().propagation_max,
        help="τ from the held states' ages, up to this (0: off; LimiterConfig.propagation_max)",
    )


def _index_report(
    args: argparse.Namespace, sizes: list[int], workers: list[int], out: Callable[[str], None]
) -> None:
    """The index replication designs (``mesh_index``): per request measured, then per node at each N."""
    designs = [d.strip() for d in args.index_designs.split(",") if d.strip()]
    shapes = ", ".join(
        f"{r:g} req/s: {s.nodes} nodes, {s.workers} workers, {s.warmup:g} s warm-up, {s.seconds:g} s measured"
        for r, s in SHAPES.items()
    )
    out(
        f"# index replication (mesh_index; {shapes}; {args.index_capacity} blocks per worker; flush every "
        f"{args.index_flush:g} s, ends every {args.index_turn_flush:g} s"
        + (f", {args.index_turn_ends} turn ends kept" if args.index_turn_ends else "")
        + "): per request sent to one member; per node per second at N (out = in)"
    )
    out(
        "design  rate  dg/req  B/req  send+recv us  cross-node hits  |  N    W    fanout        "
        "dg out/s  KB out/s  gossip CPU  KV feed CPU"
    )
    for rate, shape in SHAPES.items():
        for d in designs:
            c = index_cost(
                rate,
                seconds=shape.seconds,
                seed=args.seed,
                workers=shape.workers,
                flush=args.index_turn_flush if d == "ends" else args.index_flush,
                design=d,
                nodes=shape.nodes,
                warmup=shape.warmup,
                capacity=args.index_capacity,
                turn_ends_max=args.index_turn_ends or None,
            )
            dpr, bpr = c.per_request
            head = (
                f"{d:<7} {rate:<5g} {dpr:>6.3f} {bpr:>6.0f} {c.send_us:>5.1f}+{c.recv_us:<6.1f} "
                f"{c.hits:>6}/{c.follow_ups:<6} {_fmt(c.hit_rate, '.3f')}"
            )
            for n, w in zip(sizes, workers, strict=True):
                per_model = math.ceil(n / models_for(n, w))
                fans = [("every", n - 1)]
                if per_model < n:
                    fans.append(("same model", per_model - 1))
                if d == "before":
                    fans = fans[:1]
                for label, f in fans:
                    dg, kb, cpu, kv = project(c, n, f)
                    out(
                        f"{head}  |  {n:<4} {w:<4} {label:<10} {f:>3}  {dg:>8.0f}  {kb:>8.0f}  "
                        f"{cpu:>10.1%}  {kv:>11.1%}"
                    )
                    head = " " * len(head)
            if d == "auto":
                out(f"{' ' * 7} (KV feed: {c.kv_us:.1f} us per event applied, one event per request routed)")


def _fmt(x: float, spec: str = ".2f") -> str:
    return "-" if math.isnan(x) else format(x, spec)


def run(args: argparse.Namespace) -> int:
    sizes = _ints(args.sizes)
    workers = (
        [int(x) for x in args.workers.split(",")] if args.workers else [default_workers(n) for n in sizes]
    )
    if len(workers) != len(sizes):
        raise SystemExit("--workers: one count per size")

    def out(line: str) -> None:
        print(line, flush=True)

    if not args.no_sim:
        cfg = ScaleConfig(
            loss=args.loss,
            window=args.window,
            windows=args.windows,
            relay=args.mode == "after",
            first_hand=args.mode == "first-hand",
            propagation=args.propagation,
            relay_batch=args.relay_batch,
            propagation_max=args.propagation_max,
            seed=args.seed,
        )
        out(f"# mesh-scale: mode {args.mode}, loss {args.loss:.0%}, window {args.window:g} s, 2x load")
        out(
            "N    W     admit/limit mean  worst  stale p50/p99/max s   health p99 s (missed)  "
            "add p99 s (missed)  pp max KB, merge p99 ms  join KB, ms  gossip B/s/node  dg/s/node  "
            "owned dg/s, KB/s  queue  false deaths  cpu s"
        )
        for n, w in zip(sizes, workers, strict=False):
            r = run_scale(n, w, cfg)
            out(
                f"{n:<4} {w:<5} {_fmt(statistics.mean(r.admitted) if r.admitted else math.nan):>16}  "
                f"{_fmt(max(r.admitted) if r.admitted else math.nan):>5}  "
                f"{_fmt(_pct(r.staleness, 0.5), '.1f')}/{_fmt(_pct(r.staleness, 0.99), '.1f')}/"
                f"{_fmt(max(r.staleness) if r.staleness else math.nan, '.1f'):<13}"
                f"{_fmt(_pct(r.health_lag, 0.99), '.2f'):>8} ({r.health_missed})          "
                f"{_fmt(_pct(r.add_lag, 0.99), '.2f'):>6} ({r.add_missed})       "
                f"{r.pp_run_max_bytes / 1000:>9.1f}, {r.pp_run_merge_p99_ms:>5.1f}         "
                f"{r.pp_bytes / 1000:>6.1f}, {r.pp_merge_ms:>4.1f}  {r.gossip_bps:>15.0f}  "
                f"{r.datagrams_s:>9.0f}  "
                + (
                    f"{r.owned_datagrams_s:>9.0f}, {r.owned_bps / 1000:>5.1f}"
                    if cfg.first_hand
                    else f"{'-':>16}"
                )
                + f"  {r.queue_len:>5.0f}  {r.false_deaths:>12}  {r.wall_s:>6.0f}"
            )
            if cfg.propagation_max > cfg.propagation:
                out(
                    f"#   τ at the end, over the nodes: min {r.tau[0]:.2f}, p50 {_pct(r.tau, 0.5):.2f}, "
                    f"max {r.tau[-1]:.2f} s"
                )
    if not args.no_pushpull:
        out("# push-pull in a converged mesh (every node checks every worker; rate-limit shards), bytes")
        out("# and merge ms (process CPU): between converged nodes (request, reply), and a fresh peer's join")
        out("# (merged at once; and in steps as the runtime merges it: the longest step, the steps)")
        out(
            "N     W      tenants  request B  merge ms  reply B  merge ms  join B     merge ms  "
            "stall ms  steps"
        )
        for n, w in zip(sizes, workers, strict=True):
            pc = pushpull_cost(n, w, args.tenants)
            out(
                f"{n:<5} {w:<6} {args.tenants:<8} {pc.request_bytes:<10} {pc.request_merge_ms:<9.1f} "
                f"{pc.reply_bytes:<8} {pc.reply_merge_ms:<9.1f} {pc.join_bytes:<10} {pc.join_merge_ms:<9.1f} "
                f"{pc.join_stall_ms:<9.1f} {pc.join_steps}"
            )
    if not args.no_index:
        _index_report(args, sizes, workers, out)
    return 0


BENCHMARK = Benchmark(
    name="mesh-scale",
    help="the mesh's replicated state at 20-500 nodes, simulated (rate limits, health, push-pull, index)",
    add_arguments=add_arguments,
    run=run,
    in_all=False,
)
