"""Prefix-index replication at fleet sizes: what each design sends, its CPU, and whether a follow-up routed
on another node finds its prefix (the index part of ``smg-bench mesh-scale``).

A few nodes (``nodes``, default 3), each a real ``MeshState`` with the node's replica (``make_replica``,
the C core where built), route a follow-up-heavy chat trace at ``rate`` req/s each: conversations share
20 system prompts, each turn adds 150-450 tokens to the previous prompt and its 100-400-token answer,
follow-ups come 20-120 s later (they cross the index's 60 s digest slots) on a node drawn at random, so
most are cross-node. Each node's flush (``MeshState.index_batches`` every ``flush`` s) is delivered
through the real codec to every other node. A cross-node follow-up is a **hit** when the node it lands on
matches, through its own replica, at least the previous turn's prompt on the worker that served it
(what ``cache_aware`` needs to send it there). Measured after a warm-up (conversations in flight).

Designs (``DESIGNS``):

- ``before``: the replica as it was: every routing decision's new blocks, and its held prefix again
  whenever it crosses a digest slot (``refresh_s`` 0); sent to every member. (Inserts learned from KV
  events were sent too, by every node that got the event; not simulated: it only adds.)
- ``all`` (``--mesh-index-replication all``, or ``auto`` for workers without KV events): a routing
  decision sends its new blocks only, a held prefix again once ``refresh_s`` old (600 s); no KV events
  (HTTP engines: gossip carries everything).
- ``ends`` (``--mesh-index-replication ends``): sparse: a routing decision sends one turn end (the name
  of the prompt's last full block, the worker, its blocks; 11 bytes), never blocks; receivers keep them
  in a bounded table (``turn_ends``) that ``match`` consults beside the walk. No KV events.
- ``auto`` (the default for gRPC engines): every node gets the engine's KV events (``stored``, through
  ``KvEventApplier``, ``kv_delay`` after the request); routing decisions of event-fed workers are not
  sent: nothing is gossiped. What each node spends instead is the KV feed: one event per request routed
  to the model's workers by any node routing the model (CPU per event applied, measured).

Per node per second at N (``project``): datagrams and bytes out (and in, by symmetry) = per request x
rate x fanout, and their CPU (send: codec + seal; receive: unseal, decode, C merge; UDP syscalls
included). Fanout: every other member (``unscoped``), or the other members routing the same model
(``scoped``: a model's index holds at most 64 workers, so a fleet of W workers is at least ceil(W / 64)
models; nodes are split evenly over them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import random
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.policies.block_names import block_hashes
from shepherd.policies.kv_events import KvEventApplier
from shepherd.policies.native_index import WORKER_LIMIT
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto import mesh_wire
from shepherd.proto.engine_types import worker_id
from shepherd.proto.mesh_messages import User

__all__ = ["CAPACITY", "DESIGNS", "SHAPES", "IndexCost", "Shape", "index_cost", "models_for", "project"]

BASE = 1_790_000_000.0
MODEL = "m"
DESIGNS = ("before", "all", "auto", "ends")
CAPACITY = 1 << 18  # blocks per worker in the index (4M tokens: every design keeps 3 minutes of the trace)


@dataclass(frozen=True, slots=True)
class Shape:
    """The simulation at one rate: nodes, workers (the engines the trace spreads over), warm-up and
    measured seconds. At 1,000 req/s a node, 2 nodes and 64 workers (an index's limit) keep ~30 req/s
    per engine and the run within a few GB."""

    nodes: int
    workers: int
    warmup: float
    seconds: float


SHAPES = {100.0: Shape(3, 16, 120.0, 60.0), 1000.0: Shape(2, 64, 100.0, 20.0)}


@dataclass(slots=True)
class IndexCost:
    design: str
    rate: float  # req/s per node
    requests: int  # measured requests, all nodes
    datagrams: int  # index payloads the nodes' flushes produced (measured window)
    bytes: int
    send_us: float  # CPU per datagram sent (codec + seal + sendto)
    recv_us: float  # CPU per datagram received (recvfrom + unseal + decode + merge)
    follow_ups: int = 0  # cross-node follow-ups measured
    hits: int = 0
    kv_events: int = 0  # KV events applied (all nodes, measured window)
    kv_us: float = 0.0  # CPU per KV event applied to one node's replica

    @property
    def hit_rate(self) -> float:
        return self.hits / self.follow_ups if self.follow_ups else math.nan

    @property
    def per_request(self) -> tuple[float, float]:
        """Datagrams and bytes one routed request costs its node to send (to one member)."""
        n = max(1, self.requests)
        return self.datagrams / n, self.bytes / n


def models_for(n: int, workers: int) -> int:
    """Models a fleet of ``workers`` workers is split into (a model's index holds ``WORKER_LIMIT``)."""
    return max(1, math.ceil(workers / WORKER_LIMIT)) if n > 1 else 1


def project(c: IndexCost, n: int, fanout: int) -> tuple[float, float, float, float]:
    """Per node per second at ``c.rate``: datagrams out, KB out, gossip CPU (share of a core: send and
    receive), KV feed CPU (auto: the events of the ``fanout + 1`` nodes routing the model)."""
    dpr, bpr = c.per_request
    dg = dpr * c.rate * fanout
    cpu = dg * (c.send_us + c.recv_us) / 1e6
    kv = c.kv_us * c.rate * (fanout + 1) / 1e6 if c.design == "auto" else 0.0
    return dg, bpr * c.rate * fanout / 1000, cpu, kv


def index_cost(
    rate: float,
    seconds: float = 60.0,
    seed: int = 1,
    workers: int = 16,
    flush: float = 0.02,
    *,
    design: str = "before",
    nodes: int = 3,
    warmup: float = 60.0,
    kv_delay: float = 1.0,
    capacity: int = CAPACITY,
    turn_ends_max: int | None = None,
) -> IndexCost:
    """``nodes`` nodes route the chat trace at ``rate`` req/s each for ``warmup + seconds`` (simulated);
    the window after the warm-up is measured (see the module docstring)."""
    if design not in DESIGNS:
        raise ValueError(f"design {design!r}: one of {DESIGNS}")
    rng = random.Random(f"ix-{seed}")
    now = [BASE]
    repl = IndexReplConfig(refresh_s=0.0) if design == "before" else IndexReplConfig()
    if turn_ends_max is not None:
        repl = dataclasses.replace(repl, turn_ends_max=turn_ends_max)
    pcfg = PrefixIndexConfig(capacity_blocks=capacity)
    names = [f"n{i}" for i in range(nodes)]
    states: list[MeshState[Replica]] = [
        MeshState(nm, lambda: now[0], MeshStateConfig(), new_index=lambda: make_replica(pcfg, repl))
        for nm in names
    ]
    ixs = [s.index(MODEL) for s in states]
    wids = [worker_id(f"http://engine-{i}:30000") for i in range(workers)]  # a node's ids: 12 hex digits
    kv = design == "auto"
    appliers: list[dict[str, KvEventApplier]] = [{} for _ in range(nodes)]
    if kv:
        for ix, ap in zip(ixs, appliers, strict=True):
            for w in wids:
                ix.set_quiet(w, True)  # auto: the engines' events are every node's source
                ap[w] = KvEventApplier(ix, w)
    if design == "ends":
        for ix in ixs:
            for w in wids:
                ix.set_quiet(w, True)  # no blocks: one turn end per routing decision
                ix.set_turns(w, True)
    pool = [rng.randrange(1, 150_000) for _ in range(1 << 18)]
    systems = [(rng.randrange(0, len(pool) - 1600), rng.randrange(400, 1600)) for _ in range(20)]

    def seg(k: int) -> tuple[int, int]:
        return rng.randrange(0, len(pool) - k), k

    def text(segs: Sequence[tuple[int, int]]) -> list[int]:
        out: list[int] = []
        for o, k in segs:
            out += pool[o : o + k]
        return out

    # conversations waiting for their next turn (a heap by due time): (due, seq, segments of the prompt
    # and answer so far, the previous prompt's length, worker, node). Each turn has a next one with
    # probability 3/4; one overdue by more than 30 s is abandoned (the backlog stays bounded)
    convs: list[tuple[float, int, tuple[tuple[int, int], ...], int, str, int]] = []
    kv_queue: deque[tuple[float, str, list[int], int]] = deque()  # (due, worker, tokens, blocks cached)
    seen_system: set[tuple[str, int]] = set()  # (worker, system prompt) its engine cached already
    payloads: list[bytes] = []
    sample: list[bytes] = []
    ring = Keyring([generate_key()])
    total = warmup + seconds
    t = 0.0
    next_flush = flush
    reqs = follow_ups = hits = kv_events = seq = 0
    kv_cpu = 0.0
    kv_timed = 0

    def do_flush(at: float) -> None:
        nonlocal kv_events, kv_cpu, kv_timed
        now[0] = BASE + at
        while kv_queue and kv_queue[0][0] <= at:  # the engines' events, to every node
            _, w, full, cached = kv_queue.popleft()
            hs = block_hashes(full)
            if cached >= len(hs):
                continue
            parent = hs[cached - 1] if cached else None
            toks = full[cached * BLOCK_TOKENS : len(hs) * BLOCK_TOKENS]
            measured = at >= warmup
            for ap in appliers:
                timed = measured and kv_timed < 5000
                t0 = time.process_time() if timed else 0.0
                ap[w].stored(hs[cached:], parent, toks, now[0])
                if timed:
                    kv_cpu += time.process_time() - t0
                    kv_timed += 1
            if measured:
                kv_events += nodes
        for i, st in enumerate(states):
            out = st.index_batches()
            if not out:
                continue
            if at >= warmup:
                payloads.extend(out)
                if len(sample) < 2000:
                    sample.extend(out[: 2000 - len(sample)])
            for p in out:  # through the codec and the seal, to every other node
                raw = ring.open(ring.seal(mesh_wire.encode_packet((User(p),), budget=1400, sender=names[i])))
                for m in mesh_wire.decode_packet(raw).msgs:
                    if isinstance(m, User):
                        for j, other in enumerate(states):
                            if j != i:
                                other.apply(m.payload, names[i])

    while t < total:  # bounded: t grows by an exponential draw each turn
        t += rng.expovariate(rate * nodes)
        while next_flush <= t:
            do_flush(next_flush)
            next_flush += flush
        now[0] = BASE + t
        node = rng.randrange(nodes)
        measured = t >= warmup
        while convs and convs[0][0] < t - 30.0:  # bounded by the heap
            heapq.heappop(convs)
        if convs and convs[0][0] <= t and rng.random() < 0.75:  # a follow-up when one is due
            _, _, segs, prev_len, w, prev_node = heapq.heappop(convs)
            full_len = sum(k for _, k in segs)
            segs = (*segs, seg(rng.randrange(150, 450)))
            prompt = text(segs)
            if node != prev_node and measured:
                follow_ups += 1
                if ixs[node].match(prompt).get(w, 0) >= prev_len // BLOCK_TOKENS * BLOCK_TOKENS:
                    hits += 1
            cached = full_len // BLOCK_TOKENS
        else:
            si = rng.randrange(len(systems))
            w = rng.choice(wids)
            segs = (systems[si], seg(rng.randrange(50, 300)))
            prompt = text(segs)
            cached = systems[si][1] // BLOCK_TOKENS if (w, si) in seen_system else 0
            seen_system.add((w, si))
        ixs[node].insert(prompt, w, now[0])
        if measured:
            reqs += 1
        segs = (*segs, seg(rng.randrange(100, 400)))  # the answer
        if kv:
            kv_queue.append((t + kv_delay, w, text(segs), cached))
        if rng.random() < 0.75:
            seq += 1
            heapq.heappush(convs, (t + rng.uniform(20.0, 120.0), seq, segs, len(prompt), w, node))
    do_flush(total)
    send, recv = _datagram_cpu(sample, ring, pcfg, repl, BASE + total)
    return IndexCost(
        design,
        rate,
        reqs,
        len(payloads),
        sum(len(p) for p in payloads),
        send * 1e6,
        recv * 1e6,
        follow_ups,
        hits,
        kv_events,
        (kv_cpu / kv_timed * 1e6) if kv_timed else 0.0,
    )


def _datagram_cpu(
    sample: Sequence[bytes], ring: Keyring, pcfg: PrefixIndexConfig, repl: IndexReplConfig, at: float
) -> tuple[float, float]:
    """CPU seconds to send one of these payloads (wrap, encode, seal, sendto) and to receive one
    (recvfrom, unseal, decode, apply to a fresh peer's replica at time ``at``): the least of 3 rounds."""
    if not sample:
        return 0.0, 0.0
    sends, recvs = [], []
    sealed: list[bytes] = []
    for _ in range(3):  # the least of 3 rounds: a shared machine's noise only ever adds
        t0 = time.process_time()
        sealed = [ring.seal(mesh_wire.encode_packet((User(p),), budget=1400, sender="a")) for p in sample]
        sends.append((time.process_time() - t0) / len(sample))
        peer: MeshState[Replica] = MeshState(
            "b", lambda: at, MeshStateConfig(), new_index=lambda: make_replica(pcfg, repl)
        )
        t0 = time.process_time()
        for s in sealed:
            for m in mesh_wire.decode_packet(ring.open(s)).msgs:
                if isinstance(m, User):
                    peer.apply(m.payload, "a")
        recvs.append((time.process_time() - t0) / len(sealed))
    sys_send, sys_recv = _udp_syscalls(sealed)
    return min(sends) + sys_send, min(recvs) + sys_recv


def _udp_syscalls(datagrams: Sequence[bytes]) -> tuple[float, float]:
    """CPU seconds per ``sendto`` and per ``recvfrom`` of these datagrams over loopback (the kernel's
    part of a datagram, which the codec timings leave out): the least of 3 rounds of 100-datagram
    batches."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(1.0)
        dest = rx.getsockname()
        batch = list(datagrams[:100]) or [b"x"]
        best_s, best_r = math.inf, math.inf
        for _ in range(3):
            t0 = time.process_time()
            for d in batch:
                tx.sendto(d, dest)
            t1 = time.process_time()
            got = 0
            with contextlib.suppress(TimeoutError):
                for _ in batch:
                    rx.recvfrom(2048)
                    got += 1
            t2 = time.process_time()
            best_s = min(best_s, (t1 - t0) / len(batch))
            best_r = min(best_r, (t2 - t1) / max(1, got))
        return best_s, best_r
    finally:
        rx.close()
        tx.close()
