"""The membership table of SWIM: memberlist's alive/suspect/dead precedence rules, refutation,
suspicion timers, reaping into bounded tombstones (pure; used by ``shepherd.mesh.swim.Swim``).

Every accepted update is queued for piggybacked dissemination (keyed by member name, so a newer
update about a member replaces an older one) and reported as a member event into ``out``.

Urgent news does not wait for the next gossip tick: a refutation (``urgent_alive``, plus the
accusers in ``urgent_to``) and a death we declared (``urgent_dead``) are left here for ``Swim`` to
send at once, as primary messages (so they do not use up their piggyback retransmits).

Incarnations saturate at ``mesh_wire.MAX_INCARNATION`` (2^63 - 1, the most decoding accepts): a
refutation never goes past it (a forged ``Suspect(2^63 - 1, us)`` cannot make us unencodable). At the
bound a node can no longer outbid an accusation, so there the order of equal incarnations turns: an
``Alive`` *at the bound* clears a SUSPECT or DEAD member at the bound (the accused node's refutation at
the bound still wins), never a LEFT one (a leave stays final, ``on_alive``). A node that is really
gone stops refuting and is still declared dead by its suspicion timers; only a member already at the
bound (which needs 2^63 - 1 refutations or a forged accusation) gets this tie-break.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shepherd.mesh.swim_broadcast import TransmitLimitedQueue
from shepherd.mesh.swim_suspicion import Awareness, Suspicion
from shepherd.mesh.swim_types import (
    Action,
    Delegate,
    MemberDead,
    MemberLeft,
    MemberReaped,
    MemberSuspect,
    MemberUp,
    SwimConfig,
    SwimStats,
)
from shepherd.proto.mesh_messages import (
    USER_MSG_OVERHEAD,
    Addr,
    Alive,
    Dead,
    Member,
    MemberState,
    Message,
    NodeAddr,
    Suspect,
    User,
)
from shepherd.proto.mesh_wire import MAX_INCARNATION, encoded_size

ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
_GONE = (DEAD, LEFT)
_MAX_TOLD = 1024


@dataclass(slots=True)
class Node:
    name: str
    host: str
    port: int
    incarnation: int
    state: MemberState
    meta: bytes
    state_change: float

    @property
    def addr(self) -> tuple[str, int]:
        return (self.host, self.port)

    def snapshot(self) -> Member:
        return Member(self.name, self.host, self.port, self.incarnation, self.state, self.meta)


class MemberTable:
    """Members by name (ourselves included), their suspicions, and tombstones of reaped ones."""

    def __init__(
        self,
        config: SwimConfig,
        me: NodeAddr,
        incarnation: int,
        meta: bytes,
        awareness: Awareness,
        stats: SwimStats,
        on_new: Callable[[str], None],
        on_suspected: Callable[[str, int], None] | None = None,
    ) -> None:
        self.cfg = config
        self.me = me
        self.awareness = awareness
        self.stats = stats
        self.on_new = on_new
        self.on_suspected = on_suspected
        self.nodes: dict[str, Node] = {
            me.name: Node(me.name, me.host, me.port, incarnation, ALIVE, meta, 0.0)
        }
        self.tombstones: dict[str, Node] = {}  # state_change = reaped at; insertion order = age
        self.suspicions: dict[str, Suspicion] = {}
        self.queue: TransmitLimitedQueue[Message] = TransmitLimitedQueue(
            config.retransmit_mult, lambda: len(self.nodes), config.max_broadcasts
        )
        self.leaving = False
        self.urgent_alive = False  # we refuted: our Alive goes to a few members at once
        self.urgent_to: dict[str, None] = {}  # members to send our Alive to at once (accusers)
        self.urgent_dead: list[Dead] = []  # deaths we declared, to send at once
        self.stale_seen = False  # a stale accusation of us came in (the shell tells its carrier too)
        self._told: dict[str, float] = {}  # stale accuser -> when we last told it directly
        self._confirm_keys: dict[str, list[str]] = {}  # suspect -> queue keys of its confirmations

    # --------------------------------------------------------------------------------- views

    @property
    def local(self) -> Node:
        return self.nodes[self.me.name]

    def __len__(self) -> int:
        return len(self.nodes)

    def peers(self) -> Iterator[Node]:
        return (n for n in self.nodes.values() if n.name != self.me.name)

    def broadcast(self, msg: Message, key: str) -> None:
        self.queue.queue(msg, encoded_size(msg), key)

    def alive_msg(self) -> Alive:
        n = self.local
        return Alive(n.name, n.host, n.port, n.incarnation, n.meta)

    def piggyback(self, budget: int, delegate: Delegate) -> list[Message]:
        """Pending membership updates, then the delegate's payloads, within ``budget`` bytes."""
        if budget <= 0:
            return []
        msgs = self.queue.get(budget)
        budget -= sum(encoded_size(m) for m in msgs)
        if budget > USER_MSG_OVERHEAD:
            for payload in delegate.broadcasts(budget):
                need = len(payload) + USER_MSG_OVERHEAD
                if need <= budget:
                    budget -= need
                    msgs.append(User(payload))
        return msgs

    def reconnect_candidates(self, seeds: list[Addr]) -> list[tuple[Addr, str]]:
        """DEAD members, DEAD tombstones and seeds at no live member's address (not LEFT ones)."""
        live = {n.addr for n in self.nodes.values() if n.state in (ALIVE, SUSPECT)}
        cands = [(n.addr, n.name) for n in self.nodes.values() if n.state == DEAD]
        cands += [
            (n.addr, n.name) for n in self.tombstones.values() if n.state == DEAD and n.addr not in live
        ]
        return cands + [(s, "") for s in seeds if s not in live]

    # --------------------------------------------------------------------------------- rules

    def on_alive(self, a: Alive, now: float, out: list[Action]) -> None:
        if a.name == self.me.name:
            loc = self.local
            if self.leaving or a.incarnation < loc.incarnation:
                return
            if a.incarnation == loc.incarnation and (a.host, a.port, a.meta) == (
                loc.host,
                loc.port,
                loc.meta,
            ):
                return
            self.refute(a.incarnation)  # someone claims another (or a newer) us
            return
        tomb = self.tombstones.get(a.name)
        if tomb is not None:
            if a.incarnation < tomb.incarnation or (
                a.incarnation == tomb.incarnation
                and not (a.incarnation == MAX_INCARNATION and tomb.state == DEAD)
            ):
                return
            del self.tombstones[a.name]
        n = self.nodes.get(a.name)
        if n is None:
            n = Node(a.name, a.host, a.port, a.incarnation, ALIVE, a.meta, now)
            self.nodes[a.name] = n
            self.on_new(a.name)
            self.broadcast(a, a.name)
            out.append(MemberUp(n.snapshot(), None if tomb is None else tomb.state))
            return
        if a.incarnation < n.incarnation or (
            a.incarnation == n.incarnation
            and not (a.incarnation == MAX_INCARNATION and n.state in (SUSPECT, DEAD))
        ):
            return  # at the bound, an Alive wins a tie against an accusation (module doc)
        prev = n.state
        changed = (n.host, n.port, n.meta) != (a.host, a.port, a.meta)
        n.host, n.port, n.meta, n.incarnation = a.host, a.port, a.meta, a.incarnation
        self._end_suspicion(a.name)
        if prev != ALIVE:
            n.state = ALIVE
            n.state_change = now
            if prev in _GONE:
                self.on_new(a.name)
        self.broadcast(a, a.name)
        if prev != ALIVE or changed:
            out.append(MemberUp(n.snapshot(), prev))

    def on_suspect(self, s: Suspect, now: float, out: list[Action]) -> None:
        n = self.nodes.get(s.node)
        if n is None or s.incarnation < n.incarnation:
            if n is not None and s.node == self.me.name:
                self.stale_accusation(s.src, now)
            return
        if self.discredited(s.src):
            return
        sus = self.suspicions.get(s.node)
        if sus is not None:
            if sus.confirm(s.src, now):
                # queued under its own key: a confirmation from another member must not replace
                # this one in our queue before it is sent (the accuser needs all k of them)
                key = f"{s.node}\x00confirm\x00{s.src}"
                self._confirm_keys.setdefault(s.node, []).append(key)
                self.broadcast(s, key)
            return
        if n.state != ALIVE:
            return
        if s.node == self.me.name:
            if not self.leaving:
                self.refute(s.incarnation, s.src)
            return
        self.broadcast(s, s.node)
        n.incarnation = s.incarnation
        n.state = SUSPECT
        n.state_change = now
        k = self.cfg.expected_confirmations(len(self.nodes))
        lo, hi = self.cfg.suspicion_bounds(len(self.nodes))
        sus = Suspicion(s.incarnation, s.src, k, lo, hi, now)
        sus.verifies_left = self.cfg.suspicion_verify_pings
        self.suspicions[s.node] = sus
        self.stats.suspicions += 1
        if s.src != self.me.name and self.on_suspected is not None:
            self.on_suspected(s.node, k)
        out.append(MemberSuspect(n.snapshot(), ALIVE))

    def on_dead(self, d: Dead, now: float, out: list[Action]) -> None:
        n = self.nodes.get(d.node)
        if n is None or d.incarnation < n.incarnation:
            if n is not None and d.node == self.me.name:
                self.stale_accusation(d.src, now)
            return
        if d.src != d.node and self.discredited(d.src):
            return
        self._end_suspicion(d.node)
        if n.state in _GONE:
            return
        if d.node == self.me.name and not self.leaving:
            self.refute(d.incarnation, d.src)
            return
        self.broadcast(d, d.node)
        prev = n.state
        n.incarnation = d.incarnation
        n.state = LEFT if d.node == d.src else DEAD
        n.state_change = now
        if d.src == self.me.name and n.state == DEAD:
            self.stats.deaths_declared += 1
            self.urgent_dead.append(d)
        out.append((MemberLeft if n.state == LEFT else MemberDead)(n.snapshot(), prev))

    def _end_suspicion(self, name: str) -> None:
        """Forget the suspicion of ``name`` and stop gossiping its confirmations (the ``Alive`` or
        ``Dead`` that ended it is queued under the member's own key and replaces the suspicion)."""
        self.suspicions.pop(name, None)
        for key in self._confirm_keys.pop(name, ()):
            self.queue.invalidate(key)

    def discredited(self, accuser: str) -> bool:
        """An accuser we hold as DEAD/LEFT (e.g. a node that can send but not receive) is not heard."""
        if accuser == self.me.name:
            return False
        n = self.nodes.get(accuser)
        return (n.state in _GONE) if n is not None else accuser in self.tombstones

    def refute(self, accused: int, accuser: str | None = None, *, lhm: bool = True) -> None:
        """Outbid an accusation of incarnation ``accused`` with a new ``Alive`` of ours, sent at once
        (to the ``accuser`` and a few random members) as well as gossiped."""
        if self.cfg.fault_no_refutation:  # test-only fault switch (shepherd.mesh.faults)
            return
        loc = self.local
        loc.incarnation = min(max(loc.incarnation + 1, accused + 1), MAX_INCARNATION)  # saturate
        self.broadcast(self.alive_msg(), loc.name)
        if lhm:
            self.awareness.apply(1)
        self.stats.refutations += 1
        self.urgent_alive = True
        if accuser is not None and accuser != loc.name:
            self.urgent_to[accuser] = None

    def stale_accusation(self, accuser: str, now: float) -> None:
        """Someone still accuses an incarnation we already refuted: it missed our refutation, so
        gossip it again (it rides on the ack when the accusation came with a ping), and tell the
        accuser directly (at most once per gossip interval)."""
        if self.leaving:
            return
        self.broadcast(self.alive_msg(), self.me.name)
        self.stats.extra["stale_accusations"] = self.stats.extra.get("stale_accusations", 0) + 1
        self.stale_seen = True
        self.tell(accuser, now)

    def tell(self, name: str, now: float) -> None:
        """Send our ``Alive`` to ``name`` at once, unless we did less than a gossip interval ago."""
        if name == self.me.name or now - self._told.get(name, -float("inf")) < self.cfg.gossip_interval:
            return
        if len(self._told) >= _MAX_TOLD:
            self._told.clear()
        self._told[name] = now
        self.urgent_to[name] = None

    def hint_dead(self, name: str, remote_incarnation: int) -> None:
        """A peer sees ``name`` ALIVE at an incarnation we hold as DEAD: gossip a suspicion so that
        ``name`` (if it lives, e.g. across a healed partition) hears of it and refutes."""
        n = self.nodes.get(name) or self.tombstones.get(name)
        if n is None or n.state != DEAD or n.incarnation < remote_incarnation:
            return
        self.broadcast(Suspect(n.incarnation, name, self.me.name), name + "\x00hint")

    # --------------------------------------------------------------------------------- timers

    def next_suspicion_deadline(self) -> float:
        if not self.suspicions:
            return float("inf")
        spacing = self.cfg.probe_interval
        return min(
            (min(s.deadline, s.verify_at(spacing)) for s in self.suspicions.values()), default=float("inf")
        )

    def due_verifications(self, now: float) -> list[Node]:
        """Suspects due a last-chance ping (with the suspicion attached): if alive, the target's
        refutation rides back on the ack even if every gossip of it missed us (epidemic tails)."""
        spacing = self.cfg.probe_interval
        due: list[Node] = []
        for name, s in self.suspicions.items():
            if s.verify_at(spacing) <= now:
                s.verifies_left -= 1
                n = self.nodes.get(name)
                if n is not None and n.state == SUSPECT:
                    due.append(n)
        return due

    def expire_suspicions(self, now: float, out: list[Action]) -> None:
        due = [name for name, s in self.suspicions.items() if s.deadline <= now]
        for name in due:
            sus = self.suspicions[name]
            self._end_suspicion(name)
            n = self.nodes.get(name)
            if n is not None and n.state == SUSPECT and n.incarnation == sus.incarnation:
                self.on_dead(Dead(n.incarnation, name, self.me.name), now, out)

    def defer_due_suspicions(self, now: float, grace: float) -> None:
        """Push suspicions due by ``now`` to ``now + grace``, once each (we were stalled)."""
        for s in self.suspicions.values():
            if s.deadline <= now and not s.deferred:
                s.deferred = True
                s.deadline = now + grace

    def reap(self, now: float, out: list[Action]) -> None:
        """Forget members DEAD/LEFT for over ``gossip_to_the_dead_time``; expire old tombstones."""
        cfg = self.cfg
        gone = [
            n
            for n in self.nodes.values()
            if n.state in _GONE and now - n.state_change > cfg.gossip_to_the_dead_time
        ]
        for n in gone:
            del self.nodes[n.name]
            n.state_change = now
            self.tombstones[n.name] = n
            out.append(MemberReaped(n.name))
        while self.tombstones:
            oldest = next(iter(self.tombstones.values()))
            if len(self.tombstones) <= cfg.max_tombstones and now - oldest.state_change <= cfg.tombstone_time:
                break
            del self.tombstones[oldest.name]
