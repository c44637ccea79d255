"""Routing policies on simulated engines: hit rate, balance and TTFT of a multi-turn trace, in seconds.

    smg-bench routing-sim [--trace fleet|routing|both] [--load light|heavy|both] [--kv-events]

The real policies (``shepherd.policies``, the prefix index in C where built) decide; the engines are a
model: a paged prefix cache per engine (16-token blocks, LRU, prompt and answer cached after each
request, ``--cache-fraction`` of the trace's peak live conversation tokens per engine), a running
limit with a FIFO queue, prefill charged per uncached prompt token and decode per output token. Time is
simulated (an event queue), so a run takes seconds and is the same on every machine: it measures the
*decisions*, the complement of ``smg-bench routing`` (real processes, real TTFT, SMG beside it).

Two traces (both seeded):

- ``fleet``: built to resemble the one of issue 21: 200 users arriving over two minutes, 4-8 turns
  each, three shared system prompts of ~1,500 tokens, think time between turns, engines that hold about
  a quarter of the live conversations each.
- ``routing``: the shape of ``smg-bench routing``'s trace (150 users, 4-12 turns, four system prompts of
  700-1,500 tokens, think time 1 s mean).

Light load keeps the engines well below their running limit; heavy load compresses the arrivals and
think times until they queue. ``--kv-events`` feeds the policy's index from the engines' cache (stored
and evicted blocks), as ``SubscribeKvEvents`` does on a node.

Printed per (trace, load) row and policy: hit rate (cached prompt tokens / prompt tokens, as the
engines count them), requests per engine, busiest / mean, TTFT p50 / p99 (queue + prefill). The
ceiling is perfect user partitioning: each new user on the engine carrying the fewest live users, every
turn on its user's engine. ``mesh3`` is three nodes' cache_aware behind a round-robin balancer.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from shepherd.loadgen.benchmarks import Benchmark
from shepherd.policies.base import Policy, RouteRequest, WorkerView
from shepherd.policies.block_names import BLOCK, block_hashes
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.prefix_index import PrefixIndex
from shepherd.policies.simple import make_policy


@dataclass(frozen=True, slots=True)
class SimTrace:
    users: int
    arrival_s: float
    turns: tuple[int, int]
    systems: int
    system_tokens: tuple[int, int]
    user_tokens: tuple[int, int]
    answer_tokens: tuple[int, int]
    think_s: float  # mean (exponential), capped at 6x
    seed: int = 0


FLEET = SimTrace(200, 120.0, (4, 8), 3, (1400, 1600), (40, 200), (40, 160), 8.0)
ROUTING = SimTrace(150, 10.0, (4, 12), 4, (700, 1500), (20, 160), (20, 80), 1.0)


@dataclass(frozen=True, slots=True)
class EngineModel:
    engines: int = 4
    running_limit: int = 16
    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 10.0
    cache_blocks: int = 0  # 0: from --cache-fraction


@dataclass(slots=True)
class Engine:
    wid: str
    cap: int
    running: int = 0
    queue: list[tuple[float, int]] = field(default_factory=list)  # (arrival, request)
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    served: int = 0

    def cached_prefix(self, names: Sequence[int]) -> int:
        n = 0
        for h in names:
            if h not in self.cache:
                break
            n += 1
        for h in names[:n]:
            self.cache.move_to_end(h)
        return n

    def store(self, names: Sequence[int]) -> tuple[list[int], list[int]]:
        stored = []
        for h in names:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        evicted = []
        while len(self.cache) > self.cap:
            h, _ = self.cache.popitem(last=False)
            evicted.append(h)
        return stored, evicted


@dataclass(slots=True)
class Conv:
    user: int
    start: float
    system: int
    turns: list[tuple[list[int], list[int], float]]  # (user ids, answer ids, think before)
    history: list[int] = field(default_factory=list)
    turn: int = 0


def build(trace: SimTrace) -> tuple[list[list[int]], list[Conv]]:
    rng = random.Random(trace.seed)
    vocab = 150_000

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(*lo_hi))]

    systems = [ids(trace.system_tokens) for _ in range(trace.systems)]
    convs = []
    t = 0.0
    rate = trace.users / trace.arrival_s
    for u in range(trace.users):
        if u:
            t += rng.expovariate(rate)
        system = rng.randrange(trace.systems)
        n = rng.randint(*trace.turns)
        turns = [
            (
                ids(trace.user_tokens),
                ids(trace.answer_tokens),
                0.0 if i == 0 else min(6 * trace.think_s, rng.expovariate(1 / trace.think_s)),
            )
            for i in range(n)
        ]
        convs.append(Conv(u, min(t, trace.arrival_s), system, turns))
    return systems, convs


class Partition:
    """The ceiling: a new user on the engine with the fewest live users; every turn on its user's."""

    name = "ceiling"

    def __init__(self) -> None:
        self.home: dict[int, str] = {}
        self.live: dict[str, int] = {}

    def pick_user(self, user: int, workers: Sequence[WorkerView]) -> str:
        wid = self.home.get(user)
        if wid is None:
            wid = min(workers, key=lambda w: (self.live.get(w.id, 0), w.id)).id
            self.home[user] = wid
            self.live[wid] = self.live.get(wid, 0) + 1
        return wid

    def done(self, user: int) -> None:
        wid = self.home[user]
        self.live[wid] -= 1


class Mesh:
    """``n`` nodes, each with its own cache_aware, behind a round-robin balancer: each request to the next
    node; every decision replicated to the other nodes' indexes at once (gossip's best case; the
    shared-prefix counts and carried conversations stay each node's own, as on a real mesh)."""

    def __init__(self, n: int = 3) -> None:
        self.name = f"cache_aware x{n}"
        self.nodes = [CacheAware() for _ in range(n)]
        self._next = 0

    def set_clock(self, clock: Callable[[], float]) -> None:
        for p in self.nodes:
            p.clock = clock

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        node = self.nodes[self._next]
        self._next = (self._next + 1) % len(self.nodes)
        w = node.pick(workers, req)
        if w is not None:
            for other in self.nodes:
                if other is not node:
                    other.index(req.model).insert(req.input_ids, w.id, node.clock())
        return w

    def indexes(self, model: str) -> list[PrefixIndex]:
        return [p.index(model) for p in self.nodes]


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    hit_rate: float
    per_engine: list[int]
    ttft_p50_ms: float
    ttft_p99_ms: float

    @property
    def imbalance(self) -> float:
        mean = sum(self.per_engine) / len(self.per_engine)
        return max(self.per_engine) / mean if mean else 0.0


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else 0.0


def simulate(
    trace: SimTrace, model: EngineModel, policy: Policy | Partition, *, kv_events: bool, cache_blocks: int
) -> Result:
    systems, convs = build(trace)
    engines = [Engine(f"e{i}", cache_blocks) for i in range(model.engines)]
    by_id = {e.wid: e for e in engines}
    clock = [0.0]
    if isinstance(policy, CacheAware):
        policy.clock = lambda: clock[0]
    elif isinstance(policy, Mesh):
        policy.set_clock(lambda: clock[0])
    kv_indexes = (
        [policy.index("m")]
        if isinstance(policy, CacheAware)
        else policy.indexes("m")
        if isinstance(policy, Mesh)
        else []
    )
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, conv)
    seq = 0

    def push(t: float, kind: str, c: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, c))

    for i, c in enumerate(convs):
        c.history = list(systems[c.system])
        push(c.start, "arrive", i)
    prompts: dict[int, tuple[list[int], list[int], str, float]] = {}  # conv -> (prompt, names, engine, t)
    cached = total = 0
    ttfts: list[float] = []

    def start(e: Engine, i: int, arrived: float) -> None:
        nonlocal cached, total
        prompt, names, _, _ = prompts[i]
        hit = e.cached_prefix(names) * BLOCK
        cached += hit
        total += len(prompt)
        prefill = (len(prompt) - hit) * model.prefill_ms_per_token / 1000
        ttfts.append((clock[0] - arrived + prefill) * 1000)
        out = len(convs[i].turns[convs[i].turn][1])
        e.running += 1
        push(clock[0] + prefill + out * model.decode_ms_per_token / 1000, "finish", i)

    while events:
        t, _, kind, i = heapq.heappop(events)
        clock[0] = t
        c = convs[i]
        if kind == "arrive":
            user_ids, _, _ = c.turns[c.turn]
            prompt = [*c.history, *user_ids]
            views = [WorkerView(e.wid, e.wid, running=e.running, waiting=len(e.queue)) for e in engines]
            if isinstance(policy, Partition):
                wid = policy.pick_user(c.user, views)
            else:
                w = policy.pick(views, RouteRequest(model="m", input_ids=prompt))
                assert w is not None
                wid = w.id
            e = by_id[wid]
            e.served += 1
            prompts[i] = (prompt, block_hashes(prompt), wid, t)
            if e.running < model.running_limit:
                start(e, i, t)
            else:
                e.queue.append((t, i))
        else:  # finish
            prompt, _, wid, _ = prompts.pop(i)
            e = by_id[wid]
            e.running -= 1
            _, answer, _ = c.turns[c.turn]
            full = [*prompt, *answer]
            stored, evicted = e.store(block_hashes(full))
            for ix in kv_indexes if kv_events else []:
                if stored:
                    ix.insert_blocks(stored, wid, t)
                if evicted:
                    ix.remove_blocks(evicted, wid)
            c.history = full
            c.turn += 1
            if c.turn < len(c.turns):
                push(t + c.turns[c.turn][2], "arrive", i)
            elif isinstance(policy, Partition):
                policy.done(c.user)
            if e.queue:
                arrived, j = e.queue.pop(0)
                start(e, j, arrived)
    return Result(
        policy.name,
        cached / total if total else 0.0,
        [e.served for e in engines],
        _pct(ttfts, 0.5),
        _pct(ttfts, 0.99),
    )


def peak_live_blocks(trace: SimTrace) -> int:
    """Blocks of the longest history of every conversation, summed over the conversations live at the
    busiest moment (approximated by the arrival overlap): the cache a perfect partition needs."""
    systems, convs = build(trace)
    per_conv = [
        (len(systems[c.system]) + sum(len(u) + len(a) for u, a, _ in c.turns)) // BLOCK for c in convs
    ]
    span = [
        (c.start, c.start + sum(th for _, _, th in c.turns) + len(c.turns) * 1.5)
        for c in convs  # ~1.5 s per turn of generation
    ]
    points = sorted({s for s, _ in span})
    return max(sum(b for b, (s, e) in zip(per_conv, span, strict=True) if s <= p < e) for p in points)


def loaded(trace: SimTrace, load: str) -> SimTrace:
    """``heavy``: the same trace compressed until the engines queue (arrivals and think time / 8)."""
    if load == "light":
        return trace
    return replace(trace, arrival_s=trace.arrival_s / 8, think_s=trace.think_s / 8)


POLICIES: dict[str, Callable[[], Policy | Partition | Mesh]] = {
    "ceiling": Partition,
    "cache_aware": lambda: make_policy("cache_aware"),
    "mesh3": Mesh,
    "round_robin": lambda: make_policy("round_robin"),
    "least_load": lambda: make_policy("least_load"),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", choices=["fleet", "routing", "both"], default="both")
    ap.add_argument("--load", choices=["light", "heavy", "both"], default="both")
    ap.add_argument("--kv-events", choices=["off", "on", "both"], default="both")
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="of the peak live blocks, per engine")
    ap.add_argument("--policies", default=",".join(POLICIES))


def cache_blocks(trace: SimTrace, fraction: float) -> int:
    return max(64, int(peak_live_blocks(trace) * fraction))


def run(args: argparse.Namespace) -> int:
    traces = {"fleet": FLEET, "routing": ROUTING}
    model = EngineModel()
    kv = {"off": (False,), "on": (True,), "both": (False, True)}[args.kv_events]
    print("trace load kv-events policy | hit rate | requests per engine | busiest/mean | TTFT p50 / p99 ms")
    for tname in ("fleet", "routing") if args.trace == "both" else (args.trace,):
        for load in ("light", "heavy") if args.load == "both" else (args.load,):
            trace = loaded(traces[tname], load)
            cap = cache_blocks(trace, args.cache_fraction)
            for events in kv:
                for pname in args.policies.split(","):
                    r = simulate(trace, model, POLICIES[pname](), kv_events=events, cache_blocks=cap)
                    print(
                        f"{tname} {load} {'on ' if events else 'off'} {r.policy:12s} | {r.hit_rate:.3f} | "
                        f"{r.per_engine} | {r.imbalance:.2f}x | {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f}",
                        flush=True,
                    )
    return 0


BENCHMARK = Benchmark(
    "routing-sim",
    "routing decisions on simulated engines (hit rate, balance, TTFT; seconds, deterministic)",
    add_arguments,
    run,
)
