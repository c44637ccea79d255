"""A deterministic in-memory network of ``Swim`` nodes with a fake clock (an event heap).

    sim = Sim(10, seed=1, loss=0.1)          # n0..n9; n1.. join through n0; wire codec on
    sim.run(5.0)                             # advance simulated time to t = 5 s
    sim.crash("n3"); sim.run(15.0)
    sim.detection("n3", since=5.0)           # observer -> time it marked n3 DEAD
    sim.random_pauses(rng, 15.0, 60.0, every=3.0, length=1.0)   # SIGSTOPs of random nodes
    sim.false_dead()                         # DEAD events about members that were up at the time

Faults: message loss (a probability, per datagram), delay (``(lo, hi)`` uniform seconds or a
callable), partitions (``partition(a, b)``, optionally one-way), pauses (``pause``: the node
handles nothing, datagrams queue up, its own timers fire late, like a SIGSTOP'd process), crashes
and restarts (``restart``: a new ``Swim`` instance, same name and address, higher incarnation),
event-loop lag (``lag``: every event the node handles is handled ``lag_s`` late, and its lag monitor
reports it through ``Swim.set_lag``). Push-pull is a reliable exchange between two nodes that can
reach each other both ways (lost under a partition); the responder merges, then replies.
``send_user`` sends payloads as datagrams of their own outside piggybacking (the runtime's, for the
state layer's first-hand deltas), with the same loss and delay.

Datagrams go through ``mesh_wire`` (``wire=True``, the default), so the codec is exercised and
the bytes on the wire (plus ``seal_overhead``) are counted per node. Member events (up, suspect,
dead, left, reaped) are recorded with their time and observer in ``events``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shepherd.mesh.swim import Swim
from shepherd.mesh.swim_broadcast import BroadcastQueue
from shepherd.mesh.swim_types import (
    Action,
    Delegate,
    JoinFailed,
    MemberDead,
    MemberLeft,
    MemberReaped,
    MemberSuspect,
    MemberUp,
    NullDelegate,
    PushPull,
    Send,
    SwimConfig,
)
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import Addr, MemberState, NodeAddr, Packet, PushPullState, User

Delay = tuple[float, float] | Callable[[random.Random], float]
LAN_DELAY: tuple[float, float] = (0.0002, 0.001)
_LAG_REPORT_EVERY = 0.1


@dataclass(frozen=True, slots=True)
class SimEvent:
    """``observer`` saw ``member`` become ``kind`` (up/suspect/dead/left/reaped/join_failed) at ``time``."""

    time: float
    observer: str
    kind: str
    member: str
    incarnation: int


@dataclass(slots=True)
class NodeStats:
    packets_sent: int = 0
    bytes_sent: int = 0
    packets_dropped: int = 0
    push_pulls: int = 0
    push_pull_bytes: int = 0


@dataclass(slots=True)
class _Node:
    name: str
    addr: NodeAddr
    swim: Swim | None = None
    delegate: Delegate = field(default_factory=NullDelegate)
    generation: int = 0
    paused_until: float = 0.0
    inbox: list[tuple[str, Any]] = field(default_factory=list)  # queued while paused
    wake_token: int = 0
    wake_at: float = float("inf")
    lag_s: float = 0.0
    lag_until: float = 0.0
    last_lag_report: float = -1.0
    last_incarnation: int = 0
    lives: list[list[float]] = field(default_factory=list)  # [start, end, first incarnation] per instance
    stats: NodeStats = field(default_factory=NodeStats)


@dataclass(slots=True)
class _Ev:
    """Something for ``node``: a timer ("wake", payload = token), a datagram, a push-pull half."""

    node: _Node
    gen: int
    what: str
    payload: Any
    lagged: bool = False


class GossipDelegate:
    """A delegate that floods user payloads like the state layer does: a payload seen for the first
    time is recorded (with the time) and re-broadcast through a ``BroadcastQueue``; push-pulls carry
    every payload seen (the state layer's full-state repair)."""

    def __init__(self, name: str, clock: Callable[[], float], retransmit_mult: int = 4) -> None:
        self.name = name
        self.clock = clock
        self.queue = BroadcastQueue(retransmit_mult)
        self.received: dict[bytes, float] = {}
        self.via_push_pull = 0

    def originate(self, payload: bytes) -> None:
        self.received[payload] = self.clock()
        self.queue.queue(payload)

    def broadcasts(self, budget: int) -> list[bytes]:
        return self.queue.get(budget)

    def on_user(self, payload: bytes, src_name: str) -> None:
        if payload not in self.received:
            self.received[payload] = self.clock()
            self.queue.queue(payload)

    def local_state(self) -> bytes:
        return b"\n".join(self.received)

    def merge_remote_state(self, data: bytes) -> None:
        for payload in data.split(b"\n"):
            if payload and payload not in self.received:
                self.received[payload] = self.clock()
                self.via_push_pull += 1


class Sim:
    """N ``Swim`` nodes on a simulated network. Every method runs at the current simulated time."""

    def __init__(
        self,
        n: int | Sequence[str] = 3,
        *,
        seed: int = 0,
        config: SwimConfig | None = None,
        loss: float = 0.0,
        delay: Delay = LAN_DELAY,
        wire: bool = True,
        delegates: Callable[[str], Delegate] | None = None,
        seeds: int = 1,
        start: bool = True,
        start_spread: float = 0.0,
    ) -> None:
        self.config = config or SwimConfig()
        self.seed = seed
        self.loss = loss
        self.delay = delay
        self.wire = wire
        self.now = 0.0
        self.events: list[SimEvent] = []
        self.wire_errors = 0
        self._make_delegate = delegates
        self._net = random.Random(f"net-{seed}")
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._blocked: set[tuple[str, str]] = set()
        names = [f"n{i}" for i in range(n)] if isinstance(n, int) else list(n)
        self.nodes: dict[str, _Node] = {}
        self._by_addr: dict[Addr, _Node] = {}
        for i, name in enumerate(names):
            node = _Node(name, NodeAddr(name, f"10.0.{i // 250}.{i % 250 + 1}", 7946))
            self.nodes[name] = node
            self._by_addr[node.addr.addr] = node
        self.names = names
        self.seed_addrs = [self.nodes[nm].addr.addr for nm in names[: max(1, seeds)]]
        if start:
            for i, name in enumerate(names):
                t = 0.0 if i == 0 else self._net.uniform(0, start_spread)
                self.at(t, functools.partial(self._boot, name, 0))

    # --------------------------------------------------------------------------------- clock

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulated time ``t`` (>= now)."""
        self._push(max(t, self.now), "call", fn)

    def run(self, until: float) -> None:
        """Process every event up to simulated time ``until`` (then ``now == until``)."""
        while self._heap and self._heap[0][0] <= until:
            t, _, kind, data = heapq.heappop(self._heap)
            self.now = t
            self._dispatch(kind, data)
        self.now = max(self.now, until)

    def run_for(self, duration: float) -> None:
        self.run(self.now + duration)

    def run_until(self, pred: Callable[[], bool], timeout: float, step: float = 0.05) -> float | None:
        """Advance in ``step``s until ``pred()``; the time it first held, or None after ``timeout``."""
        end = self.now + timeout
        while True:
            if pred():
                return self.now
            if self.now >= end:
                return None
            self.run(min(end, self.now + step))

    # --------------------------------------------------------------------------------- faults

    def crash(self, name: str) -> None:
        node = self.nodes[name]
        if node.swim is None:
            return
        node.last_incarnation = node.swim.incarnation
        node.swim = None
        node.generation += 1
        node.inbox.clear()
        node.paused_until = 0.0
        node.lag_s = 0.0
        node.lives[-1][1] = self.now

    def restart(
        self, name: str, *, incarnation: int | None = None, seeds: Sequence[Addr] | None = None
    ) -> None:
        """A new instance under the same name/address, by default with a higher incarnation."""
        node = self.nodes[name]
        self.crash(name)
        inc = node.last_incarnation + 1
        default_seeds = [self.nodes[n].addr.addr for n in self.names if n != name and self.is_up(n)][:3]
        self._boot(
            name, incarnation=inc if incarnation is None else incarnation, seeds=seeds or default_seeds
        )

    def boot(self, name: str) -> None:
        """Start a node that never ran (with ``start=False``, or a name booted later for churn)."""
        node = self.nodes[name]
        if node.swim is None and node.generation == 0:
            self._boot(
                name, 0, [self.nodes[n].addr.addr for n in self.names if n != name and self.is_up(n)][:3]
            )

    def pause(self, name: str, duration: float) -> None:
        """SIGSTOP for ``duration``: nothing is handled; queued datagrams and late timers on resume."""
        node = self.nodes[name]
        if node.swim is None:
            return
        until = self.now + duration
        node.paused_until = max(node.paused_until, until)
        self.at(until, functools.partial(self._resume, node, node.generation, duration))

    def random_pauses(
        self,
        rng: random.Random,
        start: float,
        end: float,
        every: float,
        length: float,
        *,
        rest: float | None = None,
    ) -> list[tuple[float, str]]:
        """Schedule a ``length`` s pause of a random node every ``every`` s on average (exponential
        gaps) between ``start`` and ``end``; the (time, name) list. Pauses of one node may overlap
        and merge into a longer stall, unless ``rest`` is given: then a node is only paused again
        ``rest`` s after its previous pause ended (another node is drawn, or none)."""
        out: list[tuple[float, str]] = []
        free_at = dict.fromkeys(self.names, -float("inf"))
        t = start
        while True:
            t += rng.expovariate(1 / every)
            if t >= end:
                return out
            name = rng.choice(self.names)
            if rest is not None:
                if free_at[name] > t:
                    ready = [n for n in self.names if free_at[n] <= t]
                    if not ready:
                        continue
                    name = rng.choice(ready)
                free_at[name] = t + length + rest
            out.append((t, name))
            self.at(t, functools.partial(self.pause, name, length))

    def lag(self, name: str, lag_s: float, duration: float) -> None:
        """For ``duration``, the node handles every event ``lag_s`` late (a saturated event loop)."""
        node = self.nodes[name]
        node.lag_s = lag_s
        node.lag_until = self.now + duration

    def partition(self, a: Iterable[str], b: Iterable[str], *, oneway: bool = False) -> None:
        """Drop traffic from ``a`` to ``b`` (and ``b`` to ``a`` unless ``oneway``)."""
        a, b = list(a), list(b)
        for x in a:
            for y in b:
                self._blocked.add((x, y))
                if not oneway:
                    self._blocked.add((y, x))

    def heal(self) -> None:
        self._blocked.clear()

    def leave(self, name: str) -> None:
        node = self.nodes[name]
        if node.swim is not None:
            self._execute(node, node.swim.leave(self.now))
            self._reschedule(node)

    def originate(self, name: str, payload: bytes) -> None:
        """Queue a user broadcast at ``name`` (its delegate must be a ``GossipDelegate``)."""
        d = self.nodes[name].delegate
        assert isinstance(d, GossipDelegate)
        d.originate(payload)

    # --------------------------------------------------------------------------------- views

    def swim(self, name: str) -> Swim:
        s = self.nodes[name].swim
        assert s is not None, f"{name} is down"
        return s

    def is_up(self, name: str) -> bool:
        return self.nodes[name].swim is not None

    def up(self) -> list[str]:
        return [n for n in self.names if self.is_up(n)]

    def view(self, observer: str) -> dict[str, MemberState]:
        return {m.name: m.state for m in self.swim(observer).members()}

    def sees(self, observers: Iterable[str], members: Iterable[str], state: MemberState) -> bool:
        """Every observer holds every member (other than itself) in ``state``."""
        ms = list(members)
        for o in observers:
            v = self.view(o)
            if any(v.get(m) != state for m in ms if m != o):
                return False
        return True

    def converged(self) -> bool:
        """Every up node sees every up node ALIVE."""
        up = self.up()
        return self.sees(up, up, MemberState.ALIVE)

    def false_dead(self) -> list[SimEvent]:
        """DEAD events about a member instance that was running (possibly paused) at the time."""
        return [
            e for e in self.events if e.kind == "dead" and self._running_at(e.member, e.time, e.incarnation)
        ]

    def detection(self, member: str, since: float) -> dict[str, float]:
        """Observer -> first time at or after ``since`` it marked ``member`` DEAD or LEFT."""
        out: dict[str, float] = {}
        for e in self.events:
            if (
                e.member == member
                and e.time >= since
                and e.kind in ("dead", "left")
                and e.observer not in out
            ):
                out[e.observer] = e.time
        return out

    def gossip_bytes(self) -> int:
        return sum(n.stats.bytes_sent for n in self.nodes.values())

    # --------------------------------------------------------------------------------- internals

    def _running_at(self, name: str, t: float, incarnation: int) -> bool:
        """An instance of ``name`` ran at ``t``, and ``incarnation`` is about it (not a former life)."""
        node = self.nodes[name]
        return any(a <= t < b and incarnation >= inc for a, b, inc in node.lives)

    def _push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, data))

    def _push_node(self, t: float, ev: _Ev) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), "node", ev))

    def _boot(self, name: str, incarnation: int, seeds: Sequence[Addr] | None = None) -> None:
        node = self.nodes[name]
        node.generation += 1
        node.lives.append([self.now, float("inf"), float(incarnation)])
        node.delegate = self._make_delegate(name) if self._make_delegate else NullDelegate()
        rng = random.Random(f"{self.seed}-{name}-{node.generation}")
        node.swim = Swim(self.config, node.addr, rng, node.delegate, incarnation=incarnation)
        if isinstance(node.delegate, GossipDelegate):
            node.delegate.queue.num_nodes = node.swim.num_members
        node.wake_at = float("inf")
        seed_list = self.seed_addrs if seeds is None else list(seeds)
        self._execute(node, node.swim.start(self.now, [s for s in seed_list if s != node.addr.addr]))
        self._reschedule(node)

    def _resume(self, node: _Node, gen: int, paused_for: float) -> None:
        if node.generation != gen or node.swim is None or self.now < node.paused_until:
            return
        # worst case order: our overdue timers first (Swim must notice it was stalled), then the
        # datagrams that queued up, then the lag monitor's report
        node.wake_at = float("inf")
        self._handle(node, "wake", None)
        inbox, node.inbox = node.inbox, []
        for what, payload in inbox:
            self._handle(node, what, payload)
        self._execute(node, node.swim.set_lag(self.now, paused_for))
        self._reschedule(node)

    def _dispatch(self, kind: str, data: Any) -> None:
        if kind == "call":
            data()
            return
        ev: _Ev = data
        node = ev.node
        if node.swim is None:
            return
        if ev.what == "wake":
            if ev.payload != node.wake_token or ev.gen != node.generation:
                return
        elif ev.what == "pp_resp" and ev.gen != node.generation:
            return  # the instance that asked is gone
        if self.now < node.paused_until:
            if ev.what != "wake":  # timers are re-armed on resume
                node.inbox.append((ev.what, ev.payload))
            return
        if not ev.lagged and node.lag_s > 0 and self.now < node.lag_until:
            if self.now - node.last_lag_report >= _LAG_REPORT_EVERY:
                node.last_lag_report = self.now
                self._execute(node, node.swim.set_lag(self.now, node.lag_s))
            self._push_node(self.now + node.lag_s, _Ev(node, ev.gen, ev.what, ev.payload, True))
            return
        if ev.what == "wake":
            node.wake_at = float("inf")
        self._handle(node, ev.what, ev.payload)
        self._reschedule(node)

    def _handle(self, node: _Node, what: str, payload: Any) -> None:
        swim = node.swim
        if swim is None:
            return
        if what == "wake":
            self._execute(node, swim.tick(self.now))
        elif what == "pkt":
            src, pkt = payload
            if isinstance(pkt, bytes):
                try:
                    pkt = mesh_wire.decode_packet(pkt)
                except mesh_wire.WireError:
                    self.wire_errors += 1
                    return
            self._execute(node, swim.on_packet(self.now, src, pkt))
        elif what == "pp_req":
            initiator, gen, state = payload
            remote = self._decode_pp(state)
            self._execute(node, swim.merge_push_pull(self.now, remote))
            self._send_pp(node, initiator, "pp_resp", swim.local_push_pull(remote.join), gen)
        elif what == "pp_resp":
            self._execute(node, swim.merge_push_pull(self.now, self._decode_pp(payload)))

    def _decode_pp(self, state: Any) -> PushPullState:
        if isinstance(state, bytes):
            return mesh_wire.decode_push_pull(state)
        assert isinstance(state, PushPullState)
        return state

    def _reschedule(self, node: _Node) -> None:
        if node.swim is None:
            return
        d = max(node.swim.next_deadline(), self.now)
        if d != node.wake_at and d != float("inf"):
            node.wake_token += 1
            node.wake_at = d
            self._push_node(d, _Ev(node, node.generation, "wake", node.wake_token))

    def _execute(self, node: _Node, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send_udp(node, a)
            elif isinstance(a, PushPull):
                self._push_pull(node, a)
            elif isinstance(a, JoinFailed):
                self.events.append(SimEvent(self.now, node.name, "join_failed", node.name, a.attempts))
            elif isinstance(a, MemberReaped):
                self.events.append(SimEvent(self.now, node.name, "reaped", a.name, 0))
            else:
                kind = _KINDS[type(a)]
                self.events.append(SimEvent(self.now, node.name, kind, a.member.name, a.member.incarnation))

    def _latency(self) -> float:
        d = self.delay
        return d(self._net) if callable(d) else self._net.uniform(d[0], d[1])

    def _send_udp(self, node: _Node, a: Send) -> None:
        cfg = self.config
        payload: bytes | Packet
        if self.wire:
            payload = mesh_wire.encode_packet(a.msgs, budget=cfg.packet_budget, sender=node.name)
            size = len(payload) + cfg.seal_overhead
            assert size <= cfg.max_packet_bytes, size
        else:
            payload = Packet(node.name, a.msgs)
            size = 0
        self._deliver(node, a.dest, payload, size)

    def send_user(self, name: str, dests: Sequence[Addr], payloads: Sequence[bytes]) -> int:
        """Each payload as a datagram of its own (one ``User`` message) from ``name`` to each of
        ``dests``, outside SWIM's piggybacking, as the runtime's ``send_user`` does (for the state
        layer's ``owned_batches`` and ``index_batches``); each datagram is encoded once for all the
        destinations (the same bytes) and lost, delayed and counted per destination. Datagrams sent."""
        node = self.nodes[name]
        if node.swim is None:
            return 0
        for p in payloads:
            msgs = (User(p),)
            payload: bytes | Packet
            if self.wire:
                payload = mesh_wire.encode_packet(msgs, budget=self.config.packet_budget, sender=name)
                size = len(payload) + self.config.seal_overhead
            else:
                payload, size = Packet(name, msgs), 0
            for dest in dests:
                self._deliver(node, dest, payload, size)
        return len(payloads) * len(dests)

    def _deliver(self, node: _Node, dest: Addr, payload: bytes | Packet, size: int) -> None:
        node.stats.packets_sent += 1
        node.stats.bytes_sent += size
        dst = self._by_addr.get(dest)
        if dst is None or (node.name, dst.name) in self._blocked or self._net.random() < self.loss:
            node.stats.packets_dropped += 1
            return
        self._push_node(
            self.now + self._latency(), _Ev(dst, dst.generation, "pkt", (node.addr.addr, payload))
        )

    def _send_pp(self, node: _Node, dst: _Node, kind: str, state: PushPullState, gen: int) -> None:
        data: bytes | PushPullState = mesh_wire.encode_push_pull(state) if self.wire else state
        node.stats.push_pulls += 1
        node.stats.push_pull_bytes += len(data) if isinstance(data, bytes) else 0
        # TCP: a handshake and the transfer, no loss; a partition either way breaks it
        if (node.name, dst.name) in self._blocked or (dst.name, node.name) in self._blocked:
            return
        payload: Any = (node, gen, data) if kind == "pp_req" else data
        self._push_node(self.now + 2 * self._latency(), _Ev(dst, gen, kind, payload))

    def _push_pull(self, node: _Node, a: PushPull) -> None:
        dst = self._by_addr.get(a.dest)
        if dst is None or dst.swim is None or node.swim is None:
            return
        self._send_pp(node, dst, "pp_req", node.swim.local_push_pull(a.join), node.generation)


_KINDS: dict[type, str] = {
    MemberUp: "up",
    MemberSuspect: "suspect",
    MemberDead: "dead",
    MemberLeft: "left",
}
