"""SWIM + Lifeguard membership as a pure state machine (HashiCorp memberlist's protocol).

Events in (``start``, ``tick``, ``on_packet``, ``merge_push_pull``, ``leave``, ``set_lag``), actions
out (``Send``, ``PushPull``, member events); ``now`` is passed in, randomness comes from the injected
``random.Random``; no I/O, no clock. The contract (signatures, semantics, the shell's loop) is in
``shepherd.mesh.swim_types``; the precedence rules in ``shepherd.mesh.swim_members``.

Failure detection, per probe period (``probe_interval * (LHM + 1)``): ping the next member of a
shuffled round-robin list (re-shuffled every round; a SUSPECT target also gets the suspicion, so it
can refute at once); no ack within ``probe_timeout * (LHM + 1)`` -> ping-req through
``indirect_checks`` random alive members, which forward the ack or answer a nack; still no ack at
the end of the period -> suspect it. Dissemination: every datagram piggybacks membership updates
then delegate broadcasts, and every ``gossip_interval`` pending updates go to ``gossip_nodes``
random live members plus one recently dead one (so a wrongly-declared node hears it and refutes).
Probe bookkeeping is in ``shepherd.mesh.swim_probe``, the suspicion timer in ``swim_suspicion``.

Beyond memberlist, to cut the time a live node needs to clear itself (so that a short suspicion
timer stays safe against pauses): the ping-reqs go out with a second direct ping (the same seq);
a failed probe's suspicion goes to the suspect at once; a refutation is sent at once (to the
accuser and ``gossip_nodes`` random members) rather than at the next gossip tick; a node that finds
it was stalled for a whole probe period (its own timers fired that late, or the lag monitor says
so) refutes before it even hears the suspicion that stall most likely caused. A death we declare
is sent at once as well. Others' suspicions make some members probe the suspect next (so the k
confirmations come within about a probe period), and each confirmation is gossiped on its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from shepherd.mesh.swim_members import ALIVE, DEAD, LEFT, SUSPECT, MemberTable, Node
from shepherd.mesh.swim_probe import Probe, ProbeOrder, Relay, Relays
from shepherd.mesh.swim_suspicion import Awareness
from shepherd.mesh.swim_types import (
    Action,
    Delegate,
    JoinFailed,
    PushPull,
    Send,
    SwimConfig,
    SwimStats,
    push_pull_scale,
)
from shepherd.proto.mesh_messages import (
    MAX_META_LEN,
    MAX_NAME_LEN,
    Ack,
    Addr,
    Alive,
    Dead,
    Member,
    Message,
    Nack,
    NodeAddr,
    Packet,
    Ping,
    PingReq,
    PushPullState,
    Suspect,
    User,
)
from shepherd.proto.mesh_wire import MAX_INCARNATION, encoded_size, packet_overhead

__all__ = ["Swim"]

_INF = float("inf")
_SEQ_MASK = 2**32 - 1
_MAX_UNKNOWN = 1024


class Swim:
    """One node's view of the cluster. See ``shepherd.mesh.swim_types`` for the full contract."""

    def __init__(
        self,
        config: SwimConfig,
        me: NodeAddr,
        rng: random.Random,
        delegate: Delegate,
        *,
        incarnation: int = 0,
        meta: bytes = b"",
    ) -> None:
        if not 0 < len(me.name) <= MAX_NAME_LEN or len(meta) > MAX_META_LEN:
            raise ValueError(f"swim: name must be 1..{MAX_NAME_LEN} chars and meta <= {MAX_META_LEN} bytes")
        self.config = config
        self.lag_floor = config.lag_threshold * config.probe_timeout  # ``set_lag`` ignores lag up to it
        self.me = me
        self.rng = rng
        self.delegate = delegate
        # the delegate's optional ``has_broadcasts``, looked up once: asked before every piggyback and
        # timer re-arm (an idle node's datagrams then skip the delegate's queues)
        self._has_broadcasts: Callable[[], bool] | None = getattr(delegate, "has_broadcasts", None)
        self.stats = SwimStats()
        self._aw = Awareness(config.lhm_max)
        self._table = MemberTable(
            config, me, incarnation, meta, self._aw, self.stats, self._order_add, self._on_suspected
        )
        self._overhead = packet_overhead(me.name)
        self._seq = rng.getrandbits(32)
        self._order = ProbeOrder(me.name, rng)
        self._probe: Probe | None = None
        self._relays = Relays()
        self._unknown_synced: dict[str, float] = {}
        self._seeds: list[Addr] = []
        self._started = False
        self._joined = False
        self._left = False
        self._join_attempts = 0
        self._join_backoff = config.join_retry_interval
        self._last_lag_bump = -_INF
        self._last_stall_refute = -_INF
        self._last_call = -_INF
        self._t_probe = self._t_gossip = self._t_push_pull = self._t_reconnect = self._t_join = _INF

    # --------------------------------------------------------------------------------- views

    @property
    def incarnation(self) -> int:
        return self._table.local.incarnation

    @property
    def health(self) -> int:
        """Local health multiplier (0 = healthy .. ``lhm_max``)."""
        return self._aw.score

    @property
    def joined(self) -> bool:
        return self._joined

    @property
    def left(self) -> bool:
        return self._left

    @property
    def pending_broadcasts(self) -> int:
        return len(self._table.queue)

    def num_members(self) -> int:
        """Members known (ourselves and not-yet-reaped DEAD/LEFT ones included): the n of the formulas."""
        return len(self._table)

    def members(self) -> list[Member]:
        return [n.snapshot() for n in self._table.nodes.values()]

    def alive_members(self) -> list[Member]:
        return [n.snapshot() for n in self._table.nodes.values() if n.state == ALIVE]

    def member(self, name: str) -> Member | None:
        n = self._table.nodes.get(name)
        return None if n is None else n.snapshot()

    def tombstones(self) -> list[Member]:
        return [n.snapshot() for n in self._table.tombstones.values()]

    def next_deadline(self) -> float:
        """When ``tick`` is next due. The gossip timer counts only while there is something to gossip
        (membership updates queued, or the delegate's ``has_broadcasts``, where it has one, says so):
        an idle node does not wake for empty gossip rounds. What becomes pending meanwhile rides on
        the next datagram (every ping and ack piggybacks) and on the round due at the next call."""
        t = self._deadline_but_gossip()
        return self._t_gossip if self._t_gossip < t and self._gossip_pending() else t

    def _deadline_but_gossip(self) -> float:
        # (asked at every wake-up of an idle node: the relay and suspicion tables only when they hold any)
        probe = self._probe.next_deadline() if self._probe is not None else self._t_probe
        t = min(self._t_push_pull, self._t_reconnect, self._t_join, probe)
        if self._relays.by_seq:
            t = min(t, self._relays.next_deadline())
        if self._table.suspicions:
            t = min(t, self._table.next_suspicion_deadline())
        return t

    def _gossip_pending(self) -> bool:
        if self._table.queue:
            return True
        pending = self._has_broadcasts
        return True if pending is None else bool(pending())

    # --------------------------------------------------------------------------------- entry points

    def start(self, now: float, seeds: Sequence[Addr] = ()) -> list[Action]:
        """Start probing and gossiping; join through ``seeds`` (push-pull, retried until one answers)."""
        if self._started:
            return []
        cfg, rng = self.config, self.rng
        self._started = True
        self._last_call = now
        self._table.local.state_change = now
        self._table.broadcast(self._table.alive_msg(), self.me.name)
        # the first probe and gossip round on the timers' grid (``grid_tick``), not at a random phase;
        # the first probe half a period on at least (the join's push-pull first)
        self._t_probe = grid_tick(now + 0.5 * cfg.probe_interval, cfg.probe_interval)
        self._t_gossip = grid_tick(now, cfg.gossip_interval)
        if cfg.push_pull_interval > 0:
            self._t_push_pull = now + rng.uniform(0.5, 1.0) * cfg.push_pull_interval
        if cfg.reconnect_interval > 0:
            self._t_reconnect = now + rng.uniform(0.5, 1.0) * cfg.reconnect_interval
        self._seeds = [s for s in dict.fromkeys((h, p) for h, p in seeds) if s != self.me.addr]
        if not self._seeds:
            self._joined = True
            return []
        return self._join_round(now)

    def tick(self, now: float) -> list[Action]:
        """Run every timer due at ``now`` (call at ``next_deadline()``; early is harmless, late is lag)."""
        out: list[Action] = []
        if not self._started:
            return out
        cfg = self.config
        # a deadline that was already past when we last returned was due right then, not earlier. Not
        # the gossip round's: it may have become due (a delegate's broadcast) while no timer was
        # armed for it, and a late one delays nobody's verdict
        late = now - max(self._deadline_but_gossip(), self._last_call)
        self._last_call = max(self._last_call, now)
        if late > self.lag_floor:
            # our own timer fired late: we were stalled (GC, CPU, SIGSTOP), not the others; give the
            # datagrams that queued up meanwhile a chance before accusing anyone
            out += self.set_lag(now, late)  # a stall of a probe period or more: refuted at once
            self._table.defer_due_suspicions(now, cfg.probe_timeout)
        if now >= self._t_join:
            out += self._join_round(now)
        self._tick_probe(now, out)
        table = self._table
        if self._relays.by_seq:  # (the tables' steps only when they hold something: an idle node's do not)
            out.extend(self._send(r.orig, [Nack(r.orig_seq)]) for r in self._relays.due_nacks(now))
        if table.suspicions:
            for n in table.due_verifications(now):
                self._seq = (self._seq + 1) & _SEQ_MASK
                msgs: list[Message] = [
                    Ping(self._seq, n.name, self.me),
                    Suspect(n.incarnation, n.name, self.me.name),
                ]
                out.append(self._send(n.addr, msgs))
            table.expire_suspicions(now, out)
        if now >= self._t_gossip:
            # a round with nothing pending sends nothing (``_gossip`` stops at the first empty
            # piggyback): skipped, so that an idle node's probe ticks do not pick gossip targets
            if self._gossip_pending():
                self._gossip(now, out)
            self._t_gossip = _next(self._t_gossip, cfg.gossip_interval, now)
        if now >= self._t_push_pull:
            self._t_push_pull = now + push_pull_scale(cfg.push_pull_interval, len(self._table))
            target = self._random_peers(1, lambda n: n.state == ALIVE)
            if target and not self._left:
                out.append(PushPull(target[0].addr, target[0].name, False))
        if now >= self._t_reconnect:
            self._t_reconnect = now + cfg.reconnect_interval * self.rng.uniform(0.75, 1.25)
            self._reconnect(now, out)
        if table.urgent_alive or table.urgent_to or table.urgent_dead:
            self._flush_urgent(out)
        else:  # (what ``_flush_urgent`` does with nothing urgent)
            table.stale_seen = False
        return out

    def on_packet(self, now: float, src: Addr, packet: Packet | Message) -> list[Action]:
        """One decoded datagram from ``src`` (or a single message, for tests)."""
        pkt = packet if isinstance(packet, Packet) else Packet("", (packet,))
        self._last_call = max(self._last_call, now)
        out: list[Action] = []
        self.stats.packets_in += 1
        self.stats.msgs_in += len(pkt.msgs)
        table = self._table
        probes: list[Ping | PingReq] = []
        for msg in pkt.msgs:
            match msg:
                case Ping() | PingReq():
                    probes.append(msg)  # answered last, so the reply piggybacks what this packet taught us
                case Ack(seq):
                    self._on_ack(seq, out)
                case Nack(seq):
                    if self._probe is not None and self._probe.seq == seq:
                        self._probe.nacks += 1
                        self.stats.nacks_received += 1
                case Alive():
                    table.on_alive(msg, now, out)
                case Suspect():
                    table.on_suspect(msg, now, out)
                case Dead():
                    table.on_dead(msg, now, out)
                case User(payload):
                    self.delegate.on_user(payload, pkt.sender)
        for msg in probes:
            if isinstance(msg, Ping):
                self._on_ping(now, msg, out)
            else:
                self._on_ping_req(now, msg, out)
        if table.stale_seen:  # whoever passed a stale accusation on missed our refutation too
            table.stale_seen = False
            if pkt.sender:
                table.tell(pkt.sender, now)
        if not self._joined and any(n.state == ALIVE for n in table.peers()):
            self._joined = True
            self._t_join = _INF
        self._flush_urgent(out)
        return out

    def _quiet(self) -> bool:
        """Joined, nothing urgent, nothing to piggyback: a lone ping or ack then changes no more than
        ``on_ack_alone`` / ``on_ping_alone`` do (what ``on_packet`` would do besides is a no-op)."""
        t = self._table
        return (
            self._joined
            and not (t.urgent_alive or t.urgent_to or t.urgent_dead or t.stale_seen)
            and not self._gossip_pending()
        )

    def on_ack_alone(self, now: float, seq: int) -> bool:
        """A packet of just ``Ack(seq)``, an idle node's most common datagram: if it acks the probe in
        flight and nothing else is going on (``_quiet``), handled here exactly as ``on_packet`` would
        (it sends nothing then) and True; else False and nothing changed (call ``on_packet``)."""
        p = self._probe
        if p is None or p.seq != seq or not self._quiet():
            return False
        self._count_lone(now)
        self._probe = None
        self._aw.apply(-1)
        return True

    def on_ping_alone(self, now: float, seq: int, target: str, src_name: str) -> bool:
        """A packet of just ``Ping(seq, target, src)`` from a member we hold as alive or suspect,
        addressed to us: if nothing else is going on (``_quiet``), counted here exactly as
        ``on_packet`` would and True: the answer is ``Ack(seq)`` alone, to the ping's source address
        (the caller sends it); else False and nothing changed (call ``on_packet``)."""
        if target != self.me.name:
            return False
        n = self._table.nodes.get(src_name)
        if n is None or n.state == DEAD or not self._quiet():
            return False
        self._count_lone(now)
        self.stats.packets_out += 1
        return True

    def _count_lone(self, now: float) -> None:
        """A lone ping or ack taken (``on_*_alone``): the clock and counts ``on_packet`` would move."""
        if now > self._last_call:
            self._last_call = now
        st = self.stats
        st.packets_in += 1
        st.msgs_in += 1

    def local_push_pull(self, join: bool = False) -> PushPullState:
        """Our full state for a TCP push-pull: members, tombstones (as DEAD/LEFT), delegate state."""
        t = self._table
        members = [n.snapshot() for n in t.nodes.values()] + [n.snapshot() for n in t.tombstones.values()]
        return PushPullState(tuple(members), self.delegate.local_state(), join)

    def merge_push_pull(self, now: float, remote: PushPullState) -> list[Action]:
        """Merge a peer's full state (memberlist's mergeState: a remote DEAD is only a suspicion)."""
        out: list[Action] = []
        t = self._table
        self._last_call = max(self._last_call, now)
        self.stats.push_pulls += 1
        for m in remote.members:
            if m.state == ALIVE:
                t.on_alive(Alive(m.name, m.host, m.port, m.incarnation, m.meta), now, out)
                if m.name != self.me.name:
                    t.hint_dead(m.name, m.incarnation)
            elif m.state == LEFT:
                t.on_dead(Dead(m.incarnation, m.name, m.name), now, out)
            else:
                t.on_suspect(Suspect(m.incarnation, m.name, self.me.name), now, out)
        if remote.user_state:
            self.delegate.merge_remote_state(remote.user_state)
        if not self._joined:
            self._joined = True
            self._t_join = _INF
        self._flush_urgent(out)
        return out

    def leave(self, now: float) -> list[Action]:
        """Leave gracefully: broadcast a ``Dead`` about ourselves (others mark us LEFT), stop probing.

        Keep calling ``tick`` for a second or so (``pending_broadcasts`` drops to 0) before closing."""
        if self._left:
            return []
        out: list[Action] = []
        self._left = True
        t = self._table
        t.leaving = True
        t.on_dead(Dead(t.local.incarnation, self.me.name, self.me.name), now, out)
        self._probe = None
        self._t_probe = self._t_push_pull = self._t_reconnect = self._t_join = _INF
        self._gossip(now, out)
        return out

    def set_meta(self, now: float, meta: bytes) -> list[Action]:
        """Change our metadata: a new incarnation, gossiped (others emit ``MemberUp`` with it)."""
        if len(meta) > MAX_META_LEN:
            raise ValueError(f"swim: meta > {MAX_META_LEN} bytes")
        loc = self._table.local
        if meta != loc.meta and not self._left:
            loc.meta = meta
            loc.incarnation = min(loc.incarnation + 1, MAX_INCARNATION)
            self._table.broadcast(self._table.alive_msg(), self.me.name)
        return []

    def set_lag(self, now: float, lag_s: float) -> list[Action]:
        """Event-loop lag measured by the shell: a slow node probes less and waits longer (Lifeguard);
        a stall of a whole probe period or more is refuted at once (see ``_stalled``)."""
        cfg = self.config
        if lag_s <= self.lag_floor:
            return []
        if now - self._last_lag_bump >= cfg.probe_interval:
            self._last_lag_bump = now
            self._aw.apply(1)
            self.stats.lag_events += 1
        if self._probe is not None:  # we were not listening: don't blame the target for it
            self._probe.extend(now, lag_s, cfg.probe_interval, cfg.probe_timeout)
        out: list[Action] = []
        self._stalled(now, lag_s)
        self._flush_urgent(out)
        return out

    def _stalled(self, now: float, stall: float) -> None:
        """We did not run for ``stall`` seconds. From a whole probe period on, whoever probed us
        meanwhile got no ack and suspects us now, or will at the end of its probe period: refute at
        once, before the suspicion even reaches us (a suspect's refutation otherwise waits for the
        accuser's gossip or its next ping). An ``Alive`` at a new incarnation from the node itself
        is always legitimate; this only brings it forward. Once per stall (the late tick and the
        lag monitor both report it)."""
        cfg = self.config
        if (
            stall < cfg.probe_interval
            or not self._started
            or self._left
            or now - self._last_stall_refute < cfg.probe_interval
        ):
            return
        self._last_stall_refute = now
        self._table.refute(self._table.local.incarnation, lhm=False)  # the lag already raised the LHM
        self.stats.extra["stall_refutations"] = self.stats.extra.get("stall_refutations", 0) + 1

    # --------------------------------------------------------------------------------- probing

    def _order_add(self, name: str) -> None:
        self._order.add(name)

    def _on_suspected(self, name: str, k: int) -> None:
        """Someone else suspects ``name``: probe it next (with the suspicion attached), so that
        independent confirmations, or its refutation, come within a probe period. Only about
        2(k + 1) of the cluster do it, whatever its size (no thundering herd on a slow node), off the
        probe grid (then back on it)."""
        n = len(self._table)
        if self.rng.random() < min(1.0, 2 * (k + 1) / max(1, n - 2)):
            self._order.prioritize(name)
            # and as soon as the probe in flight ends, not at the next grid point: on the grid, the
            # suspicion lands just after every node's own tick, a whole period before their next one.
            # Not while leaving (no more probes: the timer must not stay due) nor while Lifeguard
            # slows our probing (a degraded node keeps its scaled period)
            if self._started and not self._left and self._aw.score == 0:
                self._t_probe = min(self._t_probe, self._last_call)

    def _tick_probe(self, now: float, out: list[Action]) -> None:
        p = self._probe
        if p is not None and not p.indirect_sent and now >= p.direct_deadline:
            self._send_indirect(p, out)
        if p is not None and now >= p.deadline:
            self._probe_failed(p, now, out)
            p = None
        if p is None and now >= self._t_probe and not self._left:
            self._table.reap(now, out)
            self._start_probe(now, out)

    def _start_probe(self, now: float, out: list[Action]) -> None:
        cfg = self.config
        target = self._order.next(self._table.nodes, lambda: self._table.reap(now, out))
        if target is None:
            self._t_probe = _next(self._t_probe, cfg.probe_interval, now)
            return
        self._seq = (self._seq + 1) & _SEQ_MASK
        msgs: list[Message] = [Ping(self._seq, target.name, self.me)]
        if target.state == SUSPECT:
            msgs.append(Suspect(target.incarnation, target.name, self.me.name))
        out.append(self._send(target.addr, msgs))
        interval = self._aw.scale(cfg.probe_interval)  # Lifeguard: a degraded node probes less, waits longer
        timeout = self._aw.scale(cfg.probe_timeout)
        self._probe = Probe(self._seq, target.name, target.incarnation, now + timeout, now + interval)
        # the next probe one (LHM-scaled) period on, on the grid of the base period: a tick up to half a
        # base period late (lag, a slow ack) still keeps its grid point, a later one skips it (as a
        # ticker skips missed ticks)
        base = cfg.probe_interval
        self._t_probe = grid_tick(now + interval - 0.5 * base, base)
        self.stats.probes += 1

    def _send_indirect(self, p: Probe, out: list[Action]) -> None:
        p.indirect_sent = True
        target = self._table.nodes.get(p.target)
        if target is None:
            return
        relays = self._random_peers(
            self.config.indirect_checks, lambda n: n.state == ALIVE and n.name != p.target
        )
        req = PingReq(p.seq, NodeAddr(target.name, target.host, target.port), self.me, True)
        out.extend(self._send(r.addr, [req]) for r in relays)
        # and ping it directly once more (memberlist's TCP fallback ping, over UDP): a lost ping or
        # ack is the likeliest cause of a missed ack, and with few relays (n = 3: one) the indirect
        # path alone fails too often under loss; an ack on either path counts (same seq)
        msgs: list[Message] = [Ping(p.seq, target.name, self.me)]
        if target.state == SUSPECT:
            msgs.append(Suspect(target.incarnation, target.name, self.me.name))
        out.append(self._send(target.addr, msgs))
        p.expected_nacks = len(relays)
        self.stats.indirect_probes += 1

    def _probe_failed(self, p: Probe, now: float, out: list[Action]) -> None:
        self._probe = None
        self.stats.probes_failed += 1
        # Lifeguard: missing nacks mean *we* may be the problem; without relays, blame ourselves a bit
        self._aw.apply(p.expected_nacks - p.nacks if p.expected_nacks else 1)
        sus = Suspect(p.incarnation, p.target, self.me.name)
        self._table.on_suspect(sus, now, out)
        target = self._table.nodes.get(p.target)
        if target is not None and target.state == SUSPECT and not self._left:
            # tell the suspect at once (not at our next gossip or ping): if it lives (the probe was
            # lost, or it was briefly stalled), its refutation comes back before anyone confirms
            out.append(self._send(target.addr, [sus], piggyback=False))

    def _on_ack(self, seq: int, out: list[Action]) -> None:
        p = self._probe
        if p is not None and p.seq == seq:
            self._probe = None
            self._aw.apply(-1)
            return
        r = self._relays.pop(seq)
        if r is not None:
            out.append(self._send(r.orig, [Ack(r.orig_seq)]))

    def _on_ping(self, now: float, ping: Ping, out: list[Action]) -> None:
        if ping.target and ping.target != self.me.name:
            return  # misdirected (e.g. another node now lives at that address)
        msgs: list[Message] = [Ack(ping.seq)]
        name = ping.src.name
        n = self._table.nodes.get(name) or self._table.tombstones.get(name)
        if n is not None and n.state == DEAD:  # tell a node we hold as dead, so it refutes
            msgs.append(Suspect(n.incarnation, n.name, self.me.name))
        ack = self._send(ping.src.addr, msgs)
        out.append(ack)
        if name in self._table.urgent_to and self._table.alive_msg() in ack.msgs:
            del self._table.urgent_to[name]  # our refutation rides on this ack already
        # a prober we never heard of (we missed its join gossip): sync with it, at most once per
        # reconnect interval per name
        last = self._unknown_synced.get(name, -_INF)
        if (
            n is None
            and name != self.me.name
            and not self._left
            and now - last >= self.config.reconnect_interval
        ):
            if len(self._unknown_synced) >= _MAX_UNKNOWN:
                self._unknown_synced.clear()
            self._unknown_synced[name] = now
            out.append(PushPull(ping.src.addr, name, False))

    def _on_ping_req(self, now: float, req: PingReq, out: list[Action]) -> None:
        cfg = self.config
        self._seq = (self._seq + 1) & _SEQ_MASK
        relay = Relay(req.seq, req.src.addr, req.nack, now + cfg.nack_timeout, now + 2 * cfg.probe_interval)
        if self._relays.add(self._seq, relay):
            out.append(self._send(req.target.addr, [Ping(self._seq, req.target.name, self.me)]))

    # --------------------------------------------------------------------------------- dissemination

    def _send(self, dest: Addr, primary: list[Message], *, piggyback: bool = True) -> Send:
        msgs = primary
        if piggyback and self._gossip_pending():  # (sized only when something may ride along)
            used = self._overhead + sum(encoded_size(m) for m in primary)
            msgs = primary + self._table.piggyback(self.config.packet_budget - used, self.delegate)
        self.stats.packets_out += 1
        return Send(dest, tuple(msgs))

    def _piggyback(self, budget: int) -> list[Message]:
        if not self._gossip_pending():  # nothing queued anywhere (exact where the delegate says so)
            return []
        return self._table.piggyback(budget, self.delegate)

    def _gossip(self, now: float, out: list[Action]) -> None:
        """Pending updates to ``gossip_nodes`` random live members, plus one recently DEAD member (so
        a wrongly-declared node hears it and refutes) that does not take a live member's slot: in a
        partition or a mass failure, dissemination among the living keeps its speed."""
        dead_time = self.config.gossip_to_the_dead_time
        targets = self._random_peers(self.config.gossip_nodes, lambda n: n.state in (ALIVE, SUSPECT))
        targets += self._random_peers(1, lambda n: n.state == DEAD and now - n.state_change <= dead_time)
        for n in targets:
            msgs = self._piggyback(self.config.packet_budget - self._overhead)
            if not msgs:
                return
            out.append(Send(n.addr, tuple(msgs)))
            self.stats.packets_out += 1

    def _flush_urgent(self, out: list[Action]) -> None:
        """Send what cannot wait for the next gossip tick: our refutation (to the accusers and, for a
        new incarnation, ``gossip_nodes`` random members) and the deaths we just declared (to
        ``gossip_nodes`` random members). Small packets of just that: the gossip queue keeps its
        retransmits for them."""
        t, cfg = self._table, self.config
        t.stale_seen = False
        if t.urgent_alive or t.urgent_to:
            live = (ALIVE, SUSPECT)
            named = [t.nodes.get(name) for name in t.urgent_to]
            targets = [n for n in named if n is not None and n.state in live]
            if t.urgent_alive:
                told = set(t.urgent_to)
                targets += self._random_peers(
                    cfg.gossip_nodes, lambda n: n.state in live and n.name not in told
                )
            t.urgent_alive = False
            t.urgent_to.clear()
            if not self._left:
                alive = t.alive_msg()
                out.extend(self._send(n.addr, [alive], piggyback=False) for n in targets)
        if t.urgent_dead:
            deads: list[Message] = []
            room = cfg.packet_budget // 2  # the rest of a mass failure rides on the gossip queue
            for d in t.urgent_dead:
                room -= encoded_size(d)
                if room < 0:
                    break
                deads.append(d)
            t.urgent_dead.clear()
            targets = self._random_peers(cfg.gossip_nodes, lambda n: n.state in (ALIVE, SUSPECT))
            out.extend(self._send(n.addr, deads, piggyback=False) for n in targets)

    def _random_peers(self, k: int, keep: Callable[[Node], bool]) -> list[Node]:
        cands = [n for n in self._table.peers() if keep(n)]
        return cands if len(cands) <= k else self.rng.sample(cands, k)

    # --------------------------------------------------------------------------------- join, reconnect

    def _join_round(self, now: float) -> list[Action]:
        cfg = self.config
        self._join_attempts += 1
        if cfg.join_max_attempts and self._join_attempts > cfg.join_max_attempts:
            self._t_join = _INF
            return [JoinFailed(self._join_attempts - 1)]
        self._t_join = now + self._join_backoff * self.rng.uniform(0.8, 1.2)
        self._join_backoff = min(self._join_backoff * 2, cfg.join_retry_max_interval)
        return [PushPull(s, "", True) for s in self._seeds]

    def _reconnect(self, now: float, out: list[Action]) -> None:
        """Push-pull with a random DEAD member, tombstone or unknown seed: heals partitions."""
        if self._left or not self._joined:
            return
        cands = self._table.reconnect_candidates(self._seeds)
        if cands:
            addr, name = self.rng.choice(cands)
            out.append(PushPull(addr, name, False))


def grid_tick(t: float, interval: float) -> float:
    """The first multiple of ``interval`` at or after ``t``. Probes and gossip rounds fall on this grid
    of the clock rather than at each node's random phase: nodes that share a clock (``--procs N`` on one
    host, which mesh over loopback) then wake together, so a probe's datagram mostly reaches a process
    that is awake already. A datagram to a sleeping process costs the sender the receiver's wake-up
    (~130-160 µs a ``sendto`` on this project's VMs against ~8 µs to an awake one), and the ping, the
    ack and the peer's own probe share wake-ups. Across hosts (clocks of their own) the phases are as
    good as random, as before. The period, targets and timeouts are SWIM's own."""
    if interval <= 0:
        return t
    k = math.ceil(t / interval - 1e-9)
    return k * interval


def _next(prev: float, interval: float, now: float) -> float:
    """The next tick of a fixed-rate timer; missed ticks are skipped, the phase kept (like a Go ticker):
    a timer on the grid (``grid_tick``) stays on it after a late tick."""
    nxt = prev + interval
    if nxt > now or interval <= 0:
        return nxt
    nxt = prev + interval * (math.floor((now - prev) / interval + 1e-9) + 1)
    return nxt if nxt > now else nxt + interval  # (float rounding at a grid point: never ``now`` itself)
