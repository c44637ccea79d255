"""Types of the SWIM + Lifeguard membership layer: config, formulas, actions, delegate, stats.

This module is the contract between the pure state machine (``shepherd.mesh.swim.Swim``), the wire
codec (``shepherd.proto.mesh_wire``), the I/O shell (``shepherd.mesh.runtime``) and the replicated
state that rides on gossip (``shepherd.mesh.state``). It holds no logic beyond a few formulas. The
wire vocabulary (``Addr``, ``NodeAddr``, ``Member``, ``MemberState``, the messages, ``Packet``,
``PushPullState`` and the size limits) lives in ``shepherd.proto.mesh_messages``, next to its codec.

The state machine (``shepherd.mesh.swim``)::

    swim = Swim(config: SwimConfig, me: NodeAddr, rng: random.Random, delegate: Delegate,
                *, incarnation: int = 0, meta: bytes = b"")
    # every entry point is pure: `now` (seconds, monotonic) in, list[Action] out; no I/O, no clock
    swim.start(now, seeds: Sequence[Addr]) -> list[Action]      # join: PushPull(join=True) to each seed,
                                                               # retried with capped back-off until joined
    swim.tick(now) -> list[Action]                             # call at (or after) swim.next_deadline()
    swim.next_deadline() -> float                              # time of the next timer (inf before start)
    swim.on_packet(now, src: Addr, packet: Packet | Message) -> list[Action]  # one decoded UDP datagram
    swim.local_push_pull(join: bool = False) -> PushPullState  # what to send on a TCP push-pull
    swim.merge_push_pull(now, remote: PushPullState) -> list[Action]  # what we received on one
    swim.leave(now) -> list[Action]                            # graceful leave (others mark us LEFT)
    swim.set_lag(now, lag_s) -> list[Action]                   # event-loop lag -> Lifeguard health
    swim.set_meta(now, meta: bytes) -> list[Action]            # new metadata (<= MAX_META_LEN), gossiped
    swim.members() -> list[Member]; swim.member(name) -> Member | None; swim.alive_members() -> list[Member]
    swim.num_members() -> int; swim.health -> int (LHM 0..lhm_max); swim.incarnation -> int
    swim.joined -> bool; swim.left -> bool; swim.pending_broadcasts -> int; swim.stats -> SwimStats
    swim.tombstones() -> list[Member]                           # reaped members still remembered

The shell's loop (all of it):

* On a UDP datagram: ``pkt = mesh_wire.decode_packet(data)`` (``WireError`` -> drop and count), then
  run ``swim.on_packet(now, src_addr, pkt)``.
* On a timer at ``swim.next_deadline()``: run ``swim.tick(now)``. Re-read ``next_deadline()`` after
  every call into ``swim`` (any call may move it, also into the past: then tick at once). Calling
  ``tick`` early is harmless; calling it more than ``lag_threshold * probe_timeout`` after the
  deadline is taken for what it is, event-loop lag (see the LHM below).
* Event-loop lag monitor (e.g. a 100 ms sleeper measuring its overshoot): ``swim.set_lag(now, lag)``.
* Executing actions:

  - ``Send(dest, msgs)``: ``data = mesh_wire.encode_packet(msgs, budget=config.packet_budget,
    sender=me.name)``, seal it, send it as ONE UDP datagram. Swim sizes ``msgs`` to fit
    ``config.packet_budget`` (= ``max_packet_bytes - seal_overhead``).
  - ``PushPull(dest, name, join)``: open a TCP (mTLS) connection to ``dest``, send
    ``encode_push_pull(swim.local_push_pull(join))``, read the peer's state, call
    ``swim.merge_push_pull(now, decode_push_pull(reply))``. On failure just log: swim retries.
    The TCP server side: read the remote state, ``merge_push_pull`` it, then reply with
    ``local_push_pull(join=remote.join)`` (merge first, so the reply carries our refutations).
  - ``MemberUp / MemberSuspect / MemberDead / MemberLeft / MemberReaped``: notify the state layer
    (e.g. ``MeshState.on_member_dead(name)``), metrics, logs. ``JoinFailed``: give up or alert.

Addresses are ``(host, port)`` tuples; one port serves UDP (gossip) and TCP (push-pull).

Semantics (as HashiCorp memberlist + Lifeguard):

* Incarnation precedence, for a member at incarnation ``i`` in state ``s`` (accusations whose
  ``src`` we hold as DEAD/LEFT are ignored: a node that can send but not receive is not believed):
  ``Alive(j)`` applies iff ``j > i`` (or the member is unknown); ``Suspect(j)`` applies iff
  ``j >= i`` and ``s`` is ALIVE (a SUSPECT member only counts it as a confirmation);
  ``Dead(j)`` applies iff ``j >= i`` and ``s`` is not DEAD/LEFT; ``Dead`` with ``src == node`` means
  the node LEFT. Any ``Suspect``/``Dead`` about ourselves (not leaving) is refuted by
  broadcasting ``Alive(max(inc + 1, j + 1))``; a stale one (``j`` < ours: the accuser missed our
  refutation) re-gossips our current ``Alive``, on the very ack if it came with a ping, and sends
  it straight to the accuser and to the member that passed the accusation on (at most once per
  ``gossip_interval`` each). In a push-pull, a remote DEAD/SUSPECT entry is applied as a suspicion
  (never an instant death), a remote LEFT as a leave, and a remote ALIVE for a member we hold DEAD
  at the same incarnation makes us gossip a suspicion of it (so that, if it lives, it hears and
  refutes: partition heal).
* Suspicion timeout (Lifeguard): ``max = suspicion_max_timeout_mult * suspicion_mult *
  max(1, log10(max(1, n))) * probe_interval``, ``min = suspicion_mult * probe_interval`` (memberlist
  scales min with log10 n as well: ``log_n_min_suspicion=True``), k = ``suspicion_mult - 2`` expected
  independent confirmations (0 when n - 2 < k: then the timeout is min); after c confirmations the
  timeout from the suspicion's start is ``max(min, max - log(c + 1) / log(k + 1) * (max - min))``.
  Each confirmation is re-gossiped under its own queue key (memberlist keys them by member, so a
  second confirmation replaced the first one before it was sent and the accuser waited for max).
* Retransmit limit of every piggybacked broadcast: ``retransmit_mult * ceil(log10(n + 1))``.
* Local health multiplier (LHM, 0..lhm_max): probe interval and probe timeout scale by ``LHM + 1``;
  +1 per failed probe (or +missing nacks when nacks were expected), +1 when refuting a suspicion
  about ourselves, +1 (at most once per probe interval) when ``set_lag`` reports lag above
  ``lag_threshold * probe_timeout``; -1 per successful probe.
  A ``tick`` that runs late (more than ``lag_threshold * probe_timeout`` past ``next_deadline()``)
  means we were stalled: it counts as lag, and the in-flight probe and the suspicions that fell
  due meanwhile get one grace period, so that the datagrams queued during the stall (acks,
  refutations) are read before anyone is accused.
* Clearing a live node fast (beyond memberlist; what lets the suspicion timer be short): when the
  direct ping times out, the ping-reqs go out with a second direct ping (memberlist's TCP fallback
  ping, over UDP; an ack on either path counts); the suspicion raised by our failed probe is sent
  to the suspect at once; a refutation is sent at once (to the accuser and ``gossip_nodes`` random
  members, small packets of just our ``Alive``), not at the next gossip tick; a stall of a whole
  ``probe_interval`` or more (a late ``tick``, or ``set_lag``) is refuted at once (new incarnation,
  sent the same way) before any suspicion it caused reaches us (once per stall; the LHM is raised
  by the lag, not again by this). A death we declare is sent at once to ``gossip_nodes`` random
  members too.
* Timers on a grid: probes and gossip rounds fall on multiples of their interval of the clock
  (``swim.grid_tick``), so processes sharing a clock wake together rather than at random phases.
* Probing: randomized round-robin (a shuffled member list, re-shuffled every round); a SUSPECT
  target gets the suspicion with the ping (buddy system). Beyond memberlist: on first hearing
  someone else's suspicion, about 2(k + 1) members (whatever n) probe the suspect next, so
  confirmations (or its refutation) come within a probe period; before a suspicion ends, the
  holder sends ``suspicion_verify_pings`` last-chance pings with it, so a live suspect's
  refutation comes back on the ack even when every gossip of it missed us; a ping from a node we
  never heard of triggers a push-pull with it (rate-limited), so missed join gossip is repaired.
* Dissemination: every datagram piggybacks pending membership updates, then delegate payloads
  (``USER_MSG_OVERHEAD`` each), up to ``packet_budget``; every ``gossip_interval`` pending updates
  go to ``gossip_nodes`` random live members plus one recently DEAD member (so a wrongly declared
  node hears it and refutes, without slowing dissemination among the living).
* Dead/left members are gossiped to for ``gossip_to_the_dead_time``, then reaped into a bounded
  tombstone set (name, address, incarnation) kept ``tombstone_time``: tombstones block stale
  ``Alive`` messages, are offered in push-pulls (so a restarted node learns it was dead and
  refutes), and are reconnect candidates (with the seeds) so that a healed partition converges.
  A restarted node may pass ``incarnation=`` above its previous life's (e.g. wall-clock seconds)
  to be accepted at once; with 0 it learns it was dead from its join push-pull and refutes.

``BroadcastQueue`` (retransmit-limited queue of user payloads for the delegate) lives in
``shepherd.mesh.swim_broadcast``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from shepherd.proto.mesh_messages import Addr, Member, MemberState, Message

# ---------------------------------------------------------------------------------------- formulas


def retransmit_limit(mult: int, n: int) -> int:
    """How many times a broadcast is piggybacked: ``mult * ceil(log10(n + 1))`` (memberlist)."""
    return mult * math.ceil(math.log10(max(1, n) + 1))


def suspicion_timeout(mult: int, n: int, interval: float) -> float:
    """The minimum suspicion timeout: ``mult * max(1, log10(max(1, n))) * interval`` (memberlist)."""
    return mult * max(1.0, math.log10(max(1, n))) * interval


def remaining_suspicion_time(confirmations: int, k: int, elapsed: float, min_s: float, max_s: float) -> float:
    """Lifeguard: time left before a suspicion becomes DEAD, given ``confirmations`` of ``k`` expected."""
    if k < 1:
        return min_s - elapsed
    frac = math.log(confirmations + 1.0) / math.log(k + 1.0)
    raw = max_s - frac * (max_s - min_s)
    timeout = math.floor(1000.0 * raw) / 1000.0
    return max(timeout, min_s) - elapsed


def push_pull_scale(interval: float, n: int, threshold: int = 32) -> float:
    """memberlist's pushPullScale: the push-pull interval grows with log2(n) beyond 32 members."""
    if n <= threshold:
        return interval
    return interval * (math.ceil(math.log2(n) - math.log2(threshold)) + 1)


# ---------------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class SwimConfig:
    """Timing and sizing of the protocol; defaults tuned for a LAN (seconds, bytes).

    Departs from docs/DESIGN.md §6 (probe 0.5 s, timeout 0.25 s, mult 4, memberlist's min growing with
    log10 n): probe 0.4 / 0.2 s, mult 5, and the log10 n growth on the maximum only. A crash is
    declared one probe period plus the suspicion floor after its first probe, at the earliest; a
    paused node survives a stall about that long. With docs/DESIGN.md's numbers that is 2.5 s at n <= 10
    but 3.1 s at n = 20, above the bar (p50 <= 3 s), and no (interval, mult) under memberlist's
    formula gives both the n = 20 bar and docs/DESIGN.md's 2.5 s of pause tolerance at n = 3..10. Here it
    is 2.4 s at every n (floor 2.0 s as before; shorter probe period, and the first probe of a dead
    node comes sooner). The floor need not grow with n: log10 n pays for gossiping the suspicion to
    the suspect and the refutation back, and here the accuser and every confirmer tell the suspect
    directly and the refutation goes straight back to the accusers (``shepherd.mesh.swim``).
    Figures: ``bench/mesh_sim_bench.py``."""

    probe_interval: float = 0.4
    probe_timeout: float = 0.2
    nack_timeout: float = 0.16
    """How long a ping-req relay waits for the target's ack before it sends a nack (under the probe
    timeout: the nacks must come back before the probe period ends)."""
    indirect_checks: int = 3
    suspicion_mult: int = 5
    """Floor of the suspicion timer (all k = mult - 2 confirmations in): ``mult * probe_interval``."""
    suspicion_max_timeout_mult: int = 6
    log_n_min_suspicion: bool = False
    """True: memberlist's ``min = mult * max(1, log10 n) * probe_interval``. False (default): the
    log10 n growth applies to ``max`` only, and a suspicion with all its k confirmations ends after
    ``mult * probe_interval`` at any n (the same for n <= 10)."""
    fault_no_refutation: bool = False
    """TEST-ONLY fault (``shepherd.mesh.faults``, ``SHEPHERD_FAULT_DISABLE_REFUTATION``): never refute an
    accusation, so that the chaos suite can show it sees a node that cannot clear itself."""
    retransmit_mult: int = 4
    suspicion_verify_pings: int = 2
    """Last-chance pings (suspicion attached) to a suspect before its timer ends, one probe interval
    apart: a live suspect's refutation comes back on the ack even when all its gossip missed us."""
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    gossip_to_the_dead_time: float = 30.0
    """Dead/left members are still gossiped to for this long, then reaped into tombstones."""
    tombstone_time: float = 60.0
    max_tombstones: int = 1024
    push_pull_interval: float = 15.0
    """Base period of the TCP full-state sync with one random alive member (scaled beyond 32 members)."""
    reconnect_interval: float = 5.0
    """Period of a push-pull with a random dead member / tombstone / unknown seed (0 disables)."""
    join_retry_interval: float = 0.5
    join_retry_max_interval: float = 8.0
    join_max_attempts: int = 0
    """0 = retry the seeds until one answers; else emit ``JoinFailed`` after that many rounds."""
    lhm_max: int = 8
    lag_threshold: float = 0.5
    """``set_lag`` above ``lag_threshold * probe_timeout`` raises the LHM."""
    max_packet_bytes: int = 1400
    seal_overhead: int = 40
    """Bytes the shell adds when sealing a datagram (AES-GCM nonce, tag, key id, version)."""
    max_broadcasts: int = 4096
    """Bound of the membership broadcast queue (oldest, most-sent dropped first)."""

    @property
    def packet_budget(self) -> int:
        """Bytes available to ``encode_packet`` for one datagram."""
        return self.max_packet_bytes - self.seal_overhead

    def expected_confirmations(self, n: int) -> int:
        k = self.suspicion_mult - 2
        return 0 if n - 2 < k else k

    def suspicion_bounds(self, n: int) -> tuple[float, float]:
        """(min, max) of the suspicion timer in an n-member cluster (see ``log_n_min_suspicion``)."""
        scaled = suspicion_timeout(self.suspicion_mult, n, self.probe_interval)
        lo = (
            scaled
            if self.log_n_min_suspicion
            else suspicion_timeout(self.suspicion_mult, 1, self.probe_interval)
        )
        return lo, scaled * self.suspicion_max_timeout_mult


# ---------------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msgs`` to ``dest`` as one UDP datagram (see the module doc for the encoding)."""

    dest: Addr
    msgs: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class PushPull:
    """Open a TCP push-pull with ``dest`` (``name`` is "" for a seed whose name is unknown)."""

    dest: Addr
    name: str = ""
    join: bool = False


@dataclass(frozen=True, slots=True)
class MemberUp:
    """A member became ALIVE (new, rejoined, refuted a suspicion) or changed its address/meta."""

    member: Member
    prev: MemberState | None


@dataclass(frozen=True, slots=True)
class MemberSuspect:
    member: Member
    prev: MemberState | None


@dataclass(frozen=True, slots=True)
class MemberDead:
    member: Member
    prev: MemberState | None


@dataclass(frozen=True, slots=True)
class MemberLeft:
    member: Member
    prev: MemberState | None


@dataclass(frozen=True, slots=True)
class MemberReaped:
    """A DEAD/LEFT member was forgotten (after ``gossip_to_the_dead_time``)."""

    name: str


@dataclass(frozen=True, slots=True)
class JoinFailed:
    """No seed answered after ``join_max_attempts`` rounds (only if that is > 0)."""

    attempts: int


MemberEvent = MemberUp | MemberSuspect | MemberDead | MemberLeft | MemberReaped
Action = Send | PushPull | MemberUp | MemberSuspect | MemberDead | MemberLeft | MemberReaped | JoinFailed


# ---------------------------------------------------------------------------------------- delegate


class Delegate(Protocol):
    """Application state riding on SWIM (memberlist's Delegate). All calls are synchronous and fast."""

    def broadcasts(self, budget: int) -> list[bytes]:
        """Payloads to piggyback now; ``sum(len(p) + USER_MSG_OVERHEAD) <= budget`` (excess is dropped).

        The delegate does its own retransmit accounting (``BroadcastQueue`` does it for you). A
        delegate may also define ``has_broadcasts() -> bool`` (cheap; False: ``broadcasts`` would give
        nothing): then the machine skips gossip rounds while nothing is pending."""
        ...

    def on_user(self, payload: bytes, src_name: str) -> None:
        """A payload another node broadcast (``src_name`` = the datagram's sender)."""
        ...

    def local_state(self) -> bytes:
        """Full state for a push-pull."""
        ...

    def merge_remote_state(self, data: bytes) -> None:
        """A peer's full state from a push-pull."""
        ...


class NullDelegate:
    """A delegate with no application state."""

    def broadcasts(self, budget: int) -> list[bytes]:
        return []

    def on_user(self, payload: bytes, src_name: str) -> None:
        return None

    def local_state(self) -> bytes:
        return b""

    def merge_remote_state(self, data: bytes) -> None:
        return None


@dataclass(slots=True)
class SwimStats:
    """Counters for metrics (monotonic)."""

    probes: int = 0
    probes_failed: int = 0
    indirect_probes: int = 0
    nacks_received: int = 0
    suspicions: int = 0
    refutations: int = 0
    deaths_declared: int = 0
    packets_in: int = 0
    msgs_in: int = 0
    packets_out: int = 0
    push_pulls: int = 0
    lag_events: int = 0
    extra: dict[str, int] = field(default_factory=dict)
