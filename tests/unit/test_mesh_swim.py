"""The SWIM + Lifeguard state machine, by value: formulas, precedence, probing, LHM, gossip, join, leave,
reaping."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.swim import Swim, grid_tick
from shepherd.mesh.swim_broadcast import BroadcastQueue, TransmitLimitedQueue
from shepherd.mesh.swim_suspicion import Suspicion
from shepherd.mesh.swim_types import (
    Action,
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
    push_pull_scale,
    remaining_suspicion_time,
    retransmit_limit,
    suspicion_timeout,
)
from shepherd.proto.mesh_messages import (
    USER_MSG_OVERHEAD,
    Ack,
    Alive,
    Dead,
    Member,
    MemberState,
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
from shepherd.proto.mesh_wire import decode_packet, encode_packet

A, S, D, L = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
ME = NodeAddr("me", "10.0.0.1", 7946)
# docs/DESIGN.md §6's numbers and memberlist's formula: the tests of mechanics below spell times out in them
MEMBERLIST = SwimConfig(
    probe_interval=0.5, probe_timeout=0.25, nack_timeout=0.2, suspicion_mult=4, log_n_min_suspicion=True
)


def peer(i: int) -> NodeAddr:
    return NodeAddr(f"p{i}", f"10.0.1.{i}", 7946)


def mk(
    n_peers: int = 4, cfg: SwimConfig | None = None, seed: int = 1, delegate: NullDelegate | None = None
) -> Swim:
    """A started, joined node that knows ``n_peers`` alive peers at incarnation 1."""
    s = Swim(cfg or SwimConfig(), ME, random.Random(seed), delegate or NullDelegate(), incarnation=1)
    s.start(0.0, [])
    members = tuple(Member(p.name, p.host, p.port, 1, A) for p in map(peer, range(n_peers)))
    s.merge_push_pull(0.0, PushPullState(members))
    return s


def sends(actions: list[Action]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send)]


def msgs_of(actions: list[Action], kind: type) -> list[tuple[Send, Message]]:
    return [(a, m) for a in sends(actions) for m in a.msgs if isinstance(m, kind)]


def run_until_probe(s: Swim, t: float = 0.0) -> tuple[float, Send, Ping]:
    """Tick at each deadline until a ping goes out; the time, the Send and the Ping."""
    for _ in range(100):
        t = s.next_deadline()
        pings = msgs_of(s.tick(t), Ping)
        if pings:
            send, ping = pings[0]
            assert isinstance(ping, Ping)
            return t, send, ping
    raise AssertionError("no probe")


def advance(s: Swim, until: float, *, ack: bool = False) -> list[Action]:
    """Tick at every deadline up to ``until`` (as the shell does), then at ``until``.

    ``ack``: every peer answers every ping at once (a healthy cluster)."""
    out: list[Action] = []

    def step(t: float) -> None:
        acts = s.tick(t)
        out.extend(acts)
        if ack:
            for _, m in msgs_of(acts, Ping):
                assert isinstance(m, Ping)
                s.on_packet(t, m.src.addr, Ack(m.seq))

    for _ in range(100_000):
        t = s.next_deadline()
        if t > until:
            break
        step(t)
    step(until)
    return out


def state(s: Swim, name: str) -> tuple[MemberState, int] | None:
    m = s.member(name)
    return None if m is None else (m.state, m.incarnation)


# ------------------------------------------------------------------------------------ formulas


def test_suspicion_timeout_formula() -> None:
    assert suspicion_timeout(4, 1, 0.5) == 2.0
    assert suspicion_timeout(4, 10, 0.5) == 2.0
    assert suspicion_timeout(4, 100, 0.5) == pytest.approx(4.0)
    assert suspicion_timeout(4, 20, 0.5) == pytest.approx(4 * math.log10(20) * 0.5)
    assert MEMBERLIST.suspicion_bounds(10) == (2.0, 12.0)
    assert MEMBERLIST.suspicion_bounds(20) == pytest.approx((2.6021, 15.6124), abs=1e-4)
    assert MEMBERLIST.expected_confirmations(3) == 0  # n - 2 < k
    assert MEMBERLIST.expected_confirmations(10) == 2


def test_default_timers_keep_the_floor_at_any_n() -> None:
    """The defaults: probe 0.4 s, mult 5: a fully confirmed suspicion ends after 2.0 s at any n;
    log10 n only stretches the unconfirmed maximum."""
    cfg = SwimConfig()
    assert (cfg.probe_interval, cfg.probe_timeout, cfg.suspicion_mult) == (0.4, 0.2, 5)
    assert cfg.nack_timeout < cfg.probe_timeout
    assert cfg.suspicion_bounds(3) == pytest.approx((2.0, 12.0))
    assert cfg.suspicion_bounds(10) == pytest.approx((2.0, 12.0))
    assert cfg.suspicion_bounds(20) == pytest.approx((2.0, 12.0 * math.log10(20)))
    assert cfg.suspicion_bounds(100) == pytest.approx((2.0, 24.0))
    assert [cfg.expected_confirmations(n) for n in (3, 4, 5, 20)] == [0, 0, 3, 3]


@pytest.mark.parametrize(
    ("n", "k", "elapsed", "expected"),
    # memberlist's suspicion_test.go table (min 2 s, max 30 s)
    [
        (0, 3, 0.0, 30.0),
        (1, 3, 2.0, 14.0),
        (2, 3, 3.0, 4.81),
        (3, 3, 4.0, -2.0),
        (4, 3, 5.0, -3.0),
        (5, 3, 10.0, -8.0),
    ],
)
def test_remaining_suspicion_time_matches_memberlist(n: int, k: int, elapsed: float, expected: float) -> None:
    assert remaining_suspicion_time(n, k, elapsed, 2.0, 30.0) == pytest.approx(expected)


def test_suspicion_shrinks_with_independent_confirmations() -> None:
    sus = Suspicion(7, "a", k=3, min_s=2.0, max_s=30.0, start=100.0)
    assert sus.deadline == 130.0
    assert not sus.confirm("a", 101.0)  # the accuser does not confirm itself
    assert sus.confirm("b", 102.0)
    assert sus.deadline == pytest.approx(116.0)
    assert not sus.confirm("b", 102.5)  # one confirmation per peer
    assert sus.confirm("c", 103.0)
    assert sus.deadline == pytest.approx(107.81)
    assert sus.confirm("d", 104.0)
    assert sus.deadline == pytest.approx(102.0)  # at min: fires at once
    assert not sus.confirm("e", 105.0)  # k reached: no more re-gossip
    assert Suspicion(1, "a", k=0, min_s=2.0, max_s=12.0, start=0.0).deadline == 2.0


def test_retransmit_limit_and_push_pull_scale() -> None:
    assert [retransmit_limit(4, n) for n in (1, 3, 9, 10, 99, 100)] == [4, 4, 4, 8, 8, 12]
    assert push_pull_scale(15.0, 32) == 15.0
    assert push_pull_scale(15.0, 33) == 30.0
    assert push_pull_scale(15.0, 64) == 30.0
    assert push_pull_scale(15.0, 65) == 45.0


# ------------------------------------------------------------------------------------ queues


def test_transmit_limited_queue_order_replace_and_limit() -> None:
    q: TransmitLimitedQueue[str] = TransmitLimitedQueue(retransmit_mult=1, num_nodes=lambda: 5)  # limit 1
    q.queue("a1", 10, key="a")
    q.queue("b", 10, key="b")
    q.queue("a2", 10, key="a")  # replaces a1
    assert len(q) == 2
    assert q.get(25) == ["a2", "b"]  # newest first
    assert len(q) == 0  # limit 1: each sent once then dropped

    q2: TransmitLimitedQueue[str] = TransmitLimitedQueue(retransmit_mult=2, num_nodes=lambda: 5)  # limit 2
    q2.queue("old", 10)
    assert q2.get(100) == ["old"]
    q2.queue("new", 10)
    assert q2.get(15) == ["new"]  # fewest transmits first, and only what fits
    assert q2.get(100) == ["new", "old"]
    assert len(q2) == 0


def test_transmit_limited_queue_is_bounded() -> None:
    q: TransmitLimitedQueue[int] = TransmitLimitedQueue(4, lambda: 3, max_items=10)
    for i in range(100):
        q.queue(i, 1)
    assert len(q) == 10
    assert sorted(q.get(1000)) == list(range(90, 100))


def test_broadcast_queue_budget_counts_overhead() -> None:
    q = BroadcastQueue(retransmit_mult=4, num_nodes=lambda: 10)  # limit 8
    q.queue(b"x" * 100, key="k")
    q.queue(b"y" * 100)
    assert q.get(100 + USER_MSG_OVERHEAD) == [b"y" * 100]
    for _ in range(20):
        q.get(10_000)
    assert len(q) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 50)), max_size=30), st.integers(20, 200))
def test_queue_never_exceeds_budget_and_sends_each_at_most_limit(
    items: list[tuple[str, int]], budget: int
) -> None:
    q: TransmitLimitedQueue[tuple[str, int, int]] = TransmitLimitedQueue(2, lambda: 3)  # limit 2
    for i, (key, size) in enumerate(items):
        q.queue((key, size, i), size, key=key)
    counts: dict[int, int] = {}
    for _ in range(50):
        got = q.get(budget)
        assert sum(size for _, size, _ in got) <= budget
        for _, _, i in got:
            counts[i] = counts.get(i, 0) + 1
    assert all(c <= 2 for c in counts.values())
    latest = {key: i for i, (key, _) in enumerate(items)}
    assert set(counts) <= set(latest.values())  # a replaced item is never sent after its replacement


# ------------------------------------------------------------------------------------ precedence


def test_alive_suspect_dead_precedence() -> None:
    s = mk()
    out = s.on_packet(1.0, ("x", 1), Suspect(1, "p0", "p1"))
    assert state(s, "p0") == (S, 1)
    assert any(isinstance(a, MemberSuspect) for a in out)
    s.on_packet(1.1, ("x", 1), Alive("p0", "10.0.1.0", 7946, 1))  # same incarnation: no override
    assert state(s, "p0") == (S, 1)
    out = s.on_packet(1.2, ("x", 1), Alive("p0", "10.0.1.0", 7946, 2))
    assert state(s, "p0") == (A, 2)
    assert [a.prev for a in out if isinstance(a, MemberUp)] == [S]
    s.on_packet(1.3, ("x", 1), Suspect(1, "p0", "p1"))  # stale suspicion
    assert state(s, "p0") == (A, 2)
    s.on_packet(1.4, ("x", 1), Dead(1, "p0", "p1"))  # stale death
    assert state(s, "p0") == (A, 2)
    out = s.on_packet(1.5, ("x", 1), Dead(2, "p0", "p1"))
    assert state(s, "p0") == (D, 2)
    assert any(isinstance(a, MemberDead) for a in out)
    s.on_packet(1.6, ("x", 1), Suspect(2, "p0", "p1"))  # no going back to suspect
    s.on_packet(1.7, ("x", 1), Alive("p0", "10.0.1.0", 7946, 2))
    assert state(s, "p0") == (D, 2)
    s.on_packet(1.8, ("x", 1), Alive("p0", "10.0.1.0", 7946, 3))  # rejoin with a higher incarnation
    assert state(s, "p0") == (A, 3)


def test_dead_from_self_means_left() -> None:
    s = mk()
    out = s.on_packet(1.0, ("x", 1), Dead(1, "p2", "p2"))
    assert state(s, "p2") == (L, 1)
    assert [type(a) for a in out if not isinstance(a, Send)] == [MemberLeft]


def test_unknown_member_suspect_dead_ignored_alive_added() -> None:
    s = mk()
    assert s.on_packet(1.0, ("x", 1), Suspect(5, "zz", "p1")) == []
    assert s.on_packet(1.0, ("x", 1), Dead(5, "zz", "p1")) == []
    assert s.member("zz") is None
    out = s.on_packet(1.0, ("x", 1), Alive("zz", "10.9.9.9", 1, 0))
    assert state(s, "zz") == (A, 0)
    assert [a.prev for a in out if isinstance(a, MemberUp)] == [None]


_EVENTS = st.lists(
    st.tuples(st.sampled_from(["alive", "suspect", "dead", "left"]), st.integers(0, 6)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=80, deadline=None)
@given(_EVENTS)
def test_precedence_invariants(events: list[tuple[str, int]]) -> None:
    """Incarnation never decreases; the state follows memberlist's table at every step."""
    s = mk(3)
    for i, (kind, inc) in enumerate(events):
        before = s.member("p0")
        assert before is not None
        table: dict[str, Message] = {
            "alive": Alive("p0", "10.0.1.0", 7946, inc),
            "suspect": Suspect(inc, "p0", "p1"),
            "dead": Dead(inc, "p0", "p1"),
            "left": Dead(inc, "p0", "p0"),
        }
        msg = table[kind]
        s.on_packet(float(i), ("x", 1), msg)
        after = s.member("p0")
        assert after is not None
        assert after.incarnation >= before.incarnation
        gone = before.state in (D, L)
        if kind == "alive":
            expect = (A, inc) if inc > before.incarnation else (before.state, before.incarnation)
        elif kind == "suspect":
            applies = inc >= before.incarnation and before.state == A
            expect = (S, inc) if applies else (before.state, before.incarnation)
        else:
            applies = inc >= before.incarnation and not gone
            target = L if kind == "left" else D
            expect = (target, inc) if applies else (before.state, before.incarnation)
        assert (after.state, after.incarnation) == expect


# ------------------------------------------------------------------------------------ refutation


@pytest.mark.parametrize("accusation", [Suspect(5, "me", "p1"), Dead(5, "me", "p1")])
def test_refutation_bumps_incarnation_and_goes_out_at_once(accusation: Message) -> None:
    s = mk(6)
    assert s.incarnation == 1
    out = s.on_packet(1.0, ("x", 1), accusation)
    assert s.incarnation == 6  # above the accused incarnation
    assert s.health == 1  # refuting costs local health
    assert s.member("me") == Member("me", ME.host, ME.port, 6, A)
    # at once, not at the next gossip tick: to the accuser and gossip_nodes other members
    now = [a.dest for a, m in msgs_of(out, Alive) if isinstance(m, Alive) and m.name == "me"]
    assert peer(1).addr in now
    assert len(set(now)) == len(now) == 1 + SwimConfig().gossip_nodes
    assert all(a.msgs == (Alive("me", ME.host, ME.port, 6),) for a in sends(out))  # nothing else
    # and still gossiped as usual afterwards (those packets did not use up its retransmits)
    later = advance(s, 3.0)
    assert [m for _, m in msgs_of(later, Alive) if isinstance(m, Alive) and m.name == "me"]


def test_stale_accuser_and_its_carrier_are_told_directly_rate_limited() -> None:
    s = mk(6)
    s.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))  # refuted: incarnation 2
    out = s.on_packet(5.0, peer(3).addr, Packet("p3", (Suspect(1, "me", "p2"),)))
    told = {a.dest for a, m in msgs_of(out, Alive) if isinstance(m, Alive) and m.incarnation == 2}
    assert told == {peer(2).addr, peer(3).addr}  # the accuser and the one that passed it on
    out = s.on_packet(5.05, peer(3).addr, Packet("p3", (Suspect(1, "me", "p2"),)))
    assert not msgs_of(out, Alive)  # once per gossip interval
    assert s.incarnation == 2


def test_stale_accusation_not_refuted_and_other_self_alive_is() -> None:
    s = mk()
    s.on_packet(1.0, ("x", 1), Suspect(0, "me", "p1"))
    assert s.incarnation == 1
    s.on_packet(1.0, ("x", 1), Alive("me", ME.host, ME.port, 1))
    assert s.incarnation == 1  # that is us
    s.on_packet(1.0, ("x", 1), Alive("me", ME.host, ME.port, 3))  # an older instance of us
    assert s.incarnation == 4


# ------------------------------------------------------------------------------------ probing


def test_probe_round_robin_covers_everyone_each_round() -> None:
    s = mk(5)
    t = 0.0
    targets: list[str] = []
    rounds = 6
    for _ in range(5 * rounds):
        t, send, ping = run_until_probe(s, t)
        targets.append(ping.target)
        s.on_packet(t + 0.001, send.dest, Ack(ping.seq))
    orders = [tuple(targets[5 * r : 5 * r + 5]) for r in range(rounds)]
    assert all(sorted(o) == [f"p{i}" for i in range(5)] for o in orders)  # everyone once per round
    # re-shuffled every round (memberlist's shuffle after each full pass): with the fixed seed the orders
    # differ; a round-robin that never re-shuffles repeats its first order every round
    assert len(set(orders)) > 1, orders


def test_probe_ack_keeps_member_alive_and_heals_lhm() -> None:
    s = mk()
    s.set_lag(0.0, 1.0)
    assert s.health == 1
    t, send, ping = run_until_probe(s)
    assert send.dest == peer(int(ping.target[1:])).addr
    assert ping.src == ME
    s.on_packet(t + 0.01, send.dest, Ack(ping.seq))
    assert s.health == 0
    assert state(s, ping.target) == (A, 1)


def test_indirect_probe_via_k_relays_then_ack_saves_target() -> None:
    s = mk(5, cfg=MEMBERLIST)
    t, _, ping = run_until_probe(s)
    out = advance(s, t + 0.25)  # probe timeout: ping-req through k = 3 relays
    reqs = msgs_of(out, PingReq)
    assert len(reqs) == 3
    relays = {send.dest for send, _ in reqs}
    assert peer(int(ping.target[1:])).addr not in relays
    req = reqs[0][1]
    assert isinstance(req, PingReq) and req.target.name == ping.target and req.seq == ping.seq and req.nack
    s.on_packet(t + 0.3, reqs[0][0].dest, Ack(ping.seq))  # forwarded by a relay
    out = advance(s, t + 0.5)
    assert state(s, ping.target) == (A, 1)
    assert s.stats.probes_failed == 0


def test_failed_probe_suspects_and_lhm_counts_missing_nacks() -> None:
    s = mk(5, cfg=MEMBERLIST)
    t, _, ping = run_until_probe(s)
    reqs = msgs_of(advance(s, t + 0.25), PingReq)
    s.on_packet(t + 0.45, reqs[0][0].dest, Nack(ping.seq))  # one relay nacks, two are silent
    out = advance(s, t + 0.5)
    assert state(s, ping.target) == (S, 1)
    assert s.health == 2  # 3 expected nacks - 1 received
    sus = [m for _, m in msgs_of(out, Suspect)]
    assert (
        any(isinstance(m, Suspect) and m.node == ping.target and m.src == "me" for m in sus)
        or s.pending_broadcasts
    )


def test_all_nacks_mean_target_is_down_not_us() -> None:
    s = mk(5, cfg=MEMBERLIST)
    t, _, ping = run_until_probe(s)
    for send, _ in msgs_of(advance(s, t + 0.25), PingReq):
        s.on_packet(t + 0.45, send.dest, Nack(ping.seq))
    advance(s, t + 0.5)
    assert state(s, ping.target) == (S, 1)
    assert s.health == 0


def test_lhm_scales_probe_interval_and_timeout() -> None:
    s = mk(5, cfg=MEMBERLIST)
    s.set_lag(0.0, 1.0)
    s.set_lag(0.6, 1.0)
    s.set_lag(0.7, 1.0)  # rate-limited: at most one bump per probe interval
    assert s.health == 2
    t, send, ping = run_until_probe(s, 1.0)
    assert not msgs_of(advance(s, t + 0.26), PingReq)  # timeout scaled x3 = 0.75
    assert msgs_of(advance(s, t + 0.75), PingReq)
    s.on_packet(t + 0.8, send.dest, Ack(ping.seq))
    assert s.health == 1
    t2, _, _ = run_until_probe(s, t + 0.8)
    assert t2 == pytest.approx(t + 1.5)  # the period was scaled x3 too
    s.set_lag(5.0, 0.1)  # below lag_threshold * probe_timeout: no bump
    assert s.health == 1


def _probe_times(s: Swim, until: float) -> list[float]:
    """When ``s`` sends its probes up to ``until``, every peer acking at once."""
    times: list[float] = []
    for _ in range(10_000):
        t = s.next_deadline()
        if t > until:
            break
        acts = s.tick(t)
        for _, m in msgs_of(acts, Ping):
            assert isinstance(m, Ping)
            times.append(t)
            s.on_packet(t + 0.001, m.src.addr, Ack(m.seq))
    return times


def _on_grid(t: float, interval: float) -> bool:
    return abs(t / interval - round(t / interval)) < 1e-6


def test_probes_of_nodes_started_apart_fall_on_one_grid() -> None:
    """Nodes sharing a clock probe at the same instants (multiples of the interval) whenever each started,
    so that their datagrams mostly reach processes awake already; one probe a period each, as before."""
    cfg = SwimConfig()
    interval = cfg.probe_interval
    runs = []
    for start, seed in ((0.0, 1), (0.137, 2), (3.91, 3)):
        s = Swim(cfg, ME, random.Random(seed), NullDelegate(), incarnation=1)
        s.start(start, [])
        members = tuple(Member(p.name, p.host, p.port, 1, A) for p in map(peer, range(4)))
        s.merge_push_pull(start, PushPullState(members))
        runs.append(_probe_times(s, 20.0))
    for times in runs:
        assert times and all(_on_grid(t, interval) for t in times)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(g == pytest.approx(interval) for g in gaps)  # every period, no grid point skipped
    assert set(runs[0][-20:]) == set(runs[1][-20:]) == set(runs[2][-20:])


def test_grid_tick() -> None:
    assert grid_tick(0.0, 0.4) == 0.0
    assert grid_tick(0.01, 0.4) == pytest.approx(0.4)
    assert grid_tick(0.8, 0.4) == pytest.approx(0.8)  # on the grid already (float noise aside)
    assert grid_tick(0.4 * 3 + 1e-12, 0.4) == pytest.approx(1.2)
    assert grid_tick(86_400.123, 0.4) == pytest.approx(86_400.4)
    assert grid_tick(5.0, 0.0) == 5.0  # no grid: the time itself


def test_a_late_probe_tick_keeps_or_skips_its_grid_point() -> None:
    """A tick up to half a period late keeps the next grid point; a later one skips to the one after
    (no burst of catch-up probes); the gossip rounds' timer keeps its phase as well."""
    s = mk(4, cfg=SwimConfig(lag_threshold=10.0))  # (lateness not taken for lag: no LHM scaling here)

    def probe_at(t: float) -> None:
        [(send, ping)] = msgs_of(s.tick(t), Ping)
        assert isinstance(ping, Ping)
        s.on_packet(t + 0.001, send.dest, Ack(ping.seq))

    t, send, ping = run_until_probe(s)
    assert _on_grid(t, 0.4)
    s.on_packet(t + 0.001, send.dest, Ack(ping.seq))
    probe_at(t + 0.4 + 0.15)  # the timer fired 150 ms late...
    t2, send, ping = run_until_probe(s)
    assert t2 == pytest.approx(t + 0.8)  # ...the next probe keeps its grid point
    s.on_packet(t2 + 0.001, send.dest, Ack(ping.seq))
    probe_at(t2 + 0.4 + 0.3)  # 300 ms late...
    t3, send, ping = run_until_probe(s)
    assert t3 == pytest.approx(t2 + 1.2)  # ...that grid point is skipped, not caught up on
    assert _on_grid(s.next_deadline(), 0.2)  # (the gossip rounds, due with the join's broadcasts)


def test_a_node_that_hears_a_suspicion_probes_the_suspect_as_its_probe_ends() -> None:
    """Heard suspicions are confirmed or refuted within a period: the prioritized suspect is probed as
    soon as the probe in flight ends (its ack), not at the next grid point a period later."""
    s = mk(3)  # n - 2 <= 2(k + 1): every member that hears it probes the suspect next
    t, send, ping = run_until_probe(s)
    if ping.target == "p2":  # (the suspect must not be the probe in flight)
        s.on_packet(t + 0.001, send.dest, Ack(ping.seq))
        t, send, ping = run_until_probe(s)
    assert ping.target != "p2"
    s.on_packet(t + 0.01, ("x", 1), Suspect(1, "p2", "p1"))
    assert s.next_deadline() > t + 0.01  # nothing yet: one probe at a time
    s.on_packet(t + 0.02, send.dest, Ack(ping.seq))  # the probe in flight ends
    assert s.next_deadline() <= t + 0.02  # due at once...
    pings = [m for _, m in msgs_of(s.tick(t + 0.02), Ping) if isinstance(m, Ping)]
    assert [p.target for p in pings] == ["p2"]  # ...and it probes the suspect
    s.on_packet(t + 0.03, peer(2).addr, Ack(pings[0].seq))
    assert run_until_probe(s)[0] == pytest.approx(t + 0.4)  # then back on the grid


def test_a_suspicion_heard_while_leaving_or_degraded_moves_no_probe() -> None:
    """Leaving: no more probes, so a heard suspicion must not leave the probe timer due (the shell would
    fire it again and again). Degraded (LHM > 0): the node keeps its scaled period."""
    s = mk(3)
    t, send, ping = run_until_probe(s)
    s.on_packet(t + 0.001, send.dest, Ack(ping.seq))
    s.leave(t + 0.01)
    s.on_packet(t + 0.02, ("x", 1), Suspect(1, "p2", "p1"))
    for now in (t + 0.03, t + 0.04):
        s.tick(now)
        assert s.next_deadline() > now
    slow = mk(3, cfg=MEMBERLIST)
    slow.set_lag(0.0, 1.0)
    assert slow.health == 1
    t, send, ping = run_until_probe(slow)
    slow.on_packet(t + 0.01, ("x", 1), Suspect(1, "p2", "p1"))
    slow.on_packet(t + 0.02, send.dest, Ack(ping.seq))
    assert run_until_probe(slow)[0] >= t + 0.5  # not at once: a period on at the least


def test_lhm_is_capped() -> None:
    s = mk()
    for i in range(30):
        s.set_lag(float(i), 5.0)
    assert s.health == SwimConfig().lhm_max


def test_suspect_target_gets_the_suspicion_with_the_ping() -> None:
    s = mk(1)
    s.on_packet(0.0, ("x", 1), Suspect(1, "p0", "other"))
    _, send, _ = run_until_probe(s)
    assert any(isinstance(m, Suspect) and m.node == "p0" for m in send.msgs)


def test_confirmations_shorten_suspicion_to_min() -> None:
    s = mk(9, cfg=MEMBERLIST)  # n = 10: min 2 s, max 12 s, k = 2
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    assert s.next_deadline() <= 22.0
    s.on_packet(10.5, ("x", 1), Suspect(1, "p0", "p2"))
    s.on_packet(11.0, ("x", 1), Suspect(1, "p0", "p3"))
    evs: list[Action] = []
    t = 11.0
    while state(s, "p0") == (S, 1) and t < 30:
        t = s.next_deadline()
        evs += s.tick(t)
    assert state(s, "p0") == (D, 1)
    assert t == pytest.approx(12.0)  # 10 + min
    assert any(isinstance(a, MemberDead) for a in evs)
    assert s.stats.deaths_declared == 1


def test_unconfirmed_suspicion_takes_max() -> None:
    s = mk(9, cfg=MEMBERLIST)
    advance(s, 10.0, ack=True)
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    advance(s, 21.99, ack=True)
    assert state(s, "p0") == (S, 1)
    evs = advance(s, 22.0, ack=True)
    assert state(s, "p0") == (D, 1)  # 10 + max
    assert any(isinstance(a, MemberDead) for a in evs)


def test_late_tick_defers_suspicions_once() -> None:
    s = mk(9, cfg=MEMBERLIST)
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    s.tick(23.0)  # a whole second late: we were stalled, not p0
    assert state(s, "p0") == (S, 1)
    assert s.health >= 1
    s.on_packet(23.01, ("x", 1), Alive("p0", "10.0.1.0", 7946, 2))  # the refutation that waited in the socket
    s.tick(23.5)
    assert state(s, "p0") == (A, 2)


# ------------------------------------------------------------------------------------ relaying


def test_relay_forwards_ack_or_nacks() -> None:
    s = mk()
    origin = peer(0)
    out = s.on_packet(1.0, origin.addr, PingReq(77, peer(1), origin, True))
    (send, ping) = msgs_of(out, Ping)[0]
    assert isinstance(ping, Ping) and send.dest == peer(1).addr and ping.target == "p1"
    out = s.on_packet(1.01, peer(1).addr, Ack(ping.seq))
    assert [(a.dest, m) for a, m in msgs_of(out, Ack)] == [(origin.addr, Ack(77))]
    assert not msgs_of(advance(s, 1.5), Nack)  # acked: no nack

    out = s.on_packet(2.0, origin.addr, PingReq(78, peer(2), origin, True))
    assert not msgs_of(advance(s, 2.1), Nack)
    nacks = msgs_of(advance(s, 2.0 + SwimConfig().nack_timeout), Nack)
    assert [(a.dest, m) for a, m in nacks] == [(origin.addr, Nack(78))]


def test_ping_answered_misdirected_ignored_dead_sender_told() -> None:
    s = mk()
    out = s.on_packet(1.0, ("x", 1), Ping(5, "me", peer(0)))
    assert [(a.dest, m) for a, m in msgs_of(out, Ack)] == [(peer(0).addr, Ack(5))]
    assert s.on_packet(1.0, ("x", 1), Ping(6, "someone-else", peer(0))) == []
    s.on_packet(1.0, ("x", 1), Dead(1, "p1", "p2"))
    out = s.on_packet(1.1, ("x", 1), Ping(7, "me", peer(1)))
    assert any(isinstance(m, Suspect) and m.node == "p1" for a in sends(out) for m in a.msgs)


# ------------------------------------------------------------------------------------ dissemination


def test_every_packet_fits_the_budget_with_piggyback() -> None:
    class Big(NullDelegate):
        def broadcasts(self, budget: int) -> list[bytes]:
            return [b"u" * 300 for _ in range(10)]  # more than fits: the excess is dropped

    cfg = SwimConfig()
    s = mk(30, delegate=Big())
    for i in range(30):
        s.on_packet(0.0, ("x", 1), Alive(f"p{i}", f"10.0.1.{i}", 7946, 2, b"m" * 200))
    t = 0.0
    seen_user = False
    for _ in range(40):
        t = s.next_deadline()
        for a in sends(s.tick(t)):
            data = encode_packet(a.msgs, budget=cfg.packet_budget, sender="me")
            assert len(data) <= cfg.packet_budget
            assert decode_packet(data).msgs == a.msgs  # nothing dropped by the encoder
            seen_user |= any(isinstance(m, User) for m in a.msgs)
    assert seen_user


def test_broadcast_sent_retransmit_limit_times_then_stops() -> None:
    s = mk(4)  # n = 5: limit 4 * ceil(log10 6) = 4
    while s.pending_broadcasts:  # drain the join noise
        s.tick(s.next_deadline())
    s.on_packet(0.0, ("x", 1), Suspect(1, "p3", "p1"))
    count = 0
    t = 0.0
    for _ in range(200):
        t = s.next_deadline()
        for a in sends(s.tick(t)):
            # p1's suspicion, the broadcast under test, wherever it rides (a ping to the suspect carries
            # our own as well, the buddy system's; and our own probe of p3 may raise ours: other ones)
            count += sum(1 for m in a.msgs if isinstance(m, Suspect) and m.node == "p3" and m.src == "p1")
        if t > 1.5:
            break
    assert count == retransmit_limit(4, 5)


def test_gossip_reaches_gossip_nodes_members() -> None:
    s = mk(8)
    out = s.tick(s.next_deadline())
    while not any(isinstance(m, Alive) for a in sends(out) for m in a.msgs):
        out = s.tick(s.next_deadline())
    dests = {a.dest for a in sends(out) if not any(isinstance(m, Ping) for m in a.msgs)}
    assert 1 <= len(dests) <= SwimConfig().gossip_nodes


def test_user_messages_go_to_the_delegate() -> None:
    got: list[tuple[bytes, str]] = []

    class Rec(NullDelegate):
        def on_user(self, payload: bytes, src_name: str) -> None:
            got.append((payload, src_name))

    s = mk(delegate=Rec())
    s.on_packet(1.0, ("x", 1), Packet("p1", (User(b"hello"), User(b"world"))))
    assert got == [(b"hello", "p1"), (b"world", "p1")]


# ------------------------------------------------------------------------------ join / leave / push-pull


def test_join_retries_seeds_with_capped_backoff_until_one_answers() -> None:
    cfg = SwimConfig(join_retry_interval=0.5, join_retry_max_interval=2.0)
    s = Swim(cfg, ME, random.Random(3), NullDelegate())
    seeds = [("10.0.2.1", 7946), ("10.0.2.2", 7946), ME.addr]
    out = s.start(0.0, seeds)
    assert out == [PushPull(seeds[0], "", True), PushPull(seeds[1], "", True)]
    joined_before = s.joined
    assert not joined_before
    times: list[float] = []
    t = 0.0
    while len(times) < 6:
        t = s.next_deadline()
        if any(isinstance(a, PushPull) and a.join for a in s.tick(t)):
            times.append(t)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert gaps[0] == pytest.approx(0.5, rel=0.25)
    assert gaps[1] == pytest.approx(1.0, rel=0.25)
    assert all(g <= 2.0 * 1.2 + 1e-9 for g in gaps)
    s.merge_push_pull(t + 0.1, PushPullState((Member("p0", "10.0.2.1", 7946, 1, A),), join=True))
    assert s.joined
    for _ in range(40):
        t = s.next_deadline()
        assert not any(isinstance(a, PushPull) and a.join for a in s.tick(t))


def test_join_gives_up_after_max_attempts() -> None:
    s = Swim(SwimConfig(join_max_attempts=3), ME, random.Random(3), NullDelegate())
    s.start(0.0, [("10.0.2.1", 7946)])
    failed: list[JoinFailed] = []
    for _ in range(50):
        failed += [a for a in s.tick(s.next_deadline()) if isinstance(a, JoinFailed)]
    assert failed == [JoinFailed(3)]


def test_no_seeds_means_a_cluster_of_one() -> None:
    s = Swim(SwimConfig(), ME, random.Random(3), NullDelegate())
    assert s.start(0.0, []) == []
    assert s.joined and s.members() == [Member("me", ME.host, ME.port, 0, A)]


def test_leave_broadcasts_dead_by_self_and_others_mark_left() -> None:
    s = mk(4)
    out = s.leave(5.0)
    assert s.left
    gossip = msgs_of(out, Dead)
    assert gossip and all(m == Dead(1, "me", "me") for _, m in gossip)
    other = mk(4)
    other.on_packet(0.0, ("x", 1), Alive("me2", "10.0.0.2", 7946, 1))
    evs = other.on_packet(5.1, ("x", 1), Dead(1, "me2", "me2"))
    assert [type(a) for a in evs if not isinstance(a, Send)] == [MemberLeft]
    # a leaving node neither probes nor refutes
    s.on_packet(5.2, ("x", 1), Suspect(1, "me", "p1"))
    assert s.incarnation == 1
    t = 5.0
    for _ in range(30):
        t = s.next_deadline()
        assert not msgs_of(s.tick(t), Ping)


def test_push_pull_state_and_merge_rules() -> None:
    class St(NullDelegate):
        def __init__(self) -> None:
            self.merged: list[bytes] = []

        def local_state(self) -> bytes:
            return b"state"

        def merge_remote_state(self, data: bytes) -> None:
            self.merged.append(data)

    d = St()
    s = mk(3, delegate=d)
    local = s.local_push_pull(join=True)
    assert local.join and local.user_state == b"state"
    assert {m.name for m in local.members} == {"me", "p0", "p1", "p2"}
    remote = PushPullState(
        (
            Member("p0", "10.0.1.0", 7946, 1, D),  # a remote DEAD is only a suspicion here
            Member("p1", "10.0.1.1", 7946, 1, L),
            Member("me", ME.host, ME.port, 1, D),  # we are dead over there: refute
            Member("new", "10.0.3.3", 7946, 4, A),
        ),
        b"theirs",
    )
    out = s.merge_push_pull(1.0, remote)
    assert state(s, "p0") == (S, 1)
    assert state(s, "p1") == (L, 1)
    assert state(s, "new") == (A, 4)
    assert s.incarnation == 2
    assert d.merged == [b"theirs"]
    assert {type(a) for a in out} >= {MemberSuspect, MemberLeft, MemberUp}


def test_periodic_push_pull_with_an_alive_member() -> None:
    cfg = SwimConfig(push_pull_interval=15.0)
    s = mk(3, cfg)
    pp: list[tuple[float, PushPull]] = []
    t = 0.0
    while t < 50.0:
        t = s.next_deadline()
        acts = advance(s, t, ack=True)
        pp += [(t, a) for a in acts if isinstance(a, PushPull)]
    assert len(pp) == 3
    assert all(not a.join and a.name in {"p0", "p1", "p2"} for _, a in pp)
    assert all(b - a == pytest.approx(15.0) for (a, _), (b, _) in itertools.pairwise(pp))


# ------------------------------------------------------------------------------------ reaping


def test_dead_members_reaped_then_tombstones_expire() -> None:
    cfg = SwimConfig(gossip_to_the_dead_time=5.0, tombstone_time=10.0, reconnect_interval=0)
    s = mk(3, cfg)
    s.on_packet(1.0, ("x", 1), Dead(1, "p0", "p1"))
    evs = advance(s, 6.0, ack=True)
    assert MemberReaped("p0") not in evs  # still gossiped to for gossip_to_the_dead_time
    evs = advance(s, 8.0, ack=True)
    assert MemberReaped("p0") in evs  # at the next probe round after that
    assert s.member("p0") is None
    assert [m.name for m in s.tombstones()] == ["p0"]
    assert any(m.name == "p0" and m.state == D for m in s.local_push_pull().members)
    s.on_packet(8.0, ("x", 1), Alive("p0", "10.0.1.0", 7946, 1))  # stale: blocked by the tombstone
    assert s.member("p0") is None
    advance(s, 25.0, ack=True)
    assert s.tombstones() == []
    assert {m.name for m in s.members()} == {"me", "p1", "p2"}


def test_tombstone_yields_to_higher_incarnation() -> None:
    cfg = SwimConfig(gossip_to_the_dead_time=1.0)
    s = mk(1, cfg)
    s.on_packet(0.5, ("x", 1), Dead(1, "p0", "x"))
    t = 0.5
    while s.member("p0") is not None and t < 20:
        t = s.next_deadline()
        s.tick(t)
    assert s.member("p0") is None
    out = s.on_packet(t, ("x", 1), Alive("p0", "10.0.1.0", 7946, 2))
    assert state(s, "p0") == (A, 2)
    assert [a.prev for a in out if isinstance(a, MemberUp)] == [D]


def test_reconnect_targets_dead_members_and_unknown_seeds() -> None:
    cfg = SwimConfig(reconnect_interval=1.0)
    s = Swim(cfg, ME, random.Random(5), NullDelegate())
    s.start(0.0, [("10.0.9.9", 7946)])
    s.merge_push_pull(0.1, PushPullState((Member("p0", "10.0.1.0", 7946, 1, A),)))
    s.on_packet(0.2, ("x", 1), Dead(1, "p0", "x"))
    dests: set[tuple[str, int]] = set()
    t = 0.2
    while t < 20:
        t = s.next_deadline()
        dests |= {a.dest for a in s.tick(t) if isinstance(a, PushPull) and not a.join}
    assert dests == {("10.0.1.0", 7946), ("10.0.9.9", 7946)}


def test_swim_modules_do_no_io() -> None:
    root = Path(__file__).resolve().parents[2] / "shepherd"
    for name in (
        "mesh/swim.py",
        "mesh/swim_members.py",
        "mesh/swim_suspicion.py",
        "mesh/swim_broadcast.py",
        "mesh/swim_types.py",
        "proto/mesh_messages.py",
    ):
        src = (root / name).read_text()
        for banned in ("import time", "import asyncio", "import socket", "time.time(", "time.monotonic("):
            assert banned not in src, (name, banned)


# ------------------------------------------------------------------------------ beyond memberlist


def test_suspect_gets_last_chance_pings_before_dead() -> None:
    s = mk(9, cfg=MEMBERLIST)
    advance(s, 10.0, ack=True)
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))  # max 12 s: verify at 21.0 and 21.5
    out = advance(s, 21.9)
    verify = [a for a in sends(out) if a.dest == peer(0).addr and any(isinstance(m, Ping) for m in a.msgs)]
    verify = [a for a in verify if any(isinstance(m, Suspect) and m.node == "p0" for m in a.msgs)]
    assert len(verify) >= SwimConfig().suspicion_verify_pings


def test_stale_accusation_regossips_alive_on_the_ack() -> None:
    s = mk()
    s.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))  # refuted: incarnation 2
    while s.pending_broadcasts:
        s.tick(s.next_deadline())
    out = s.on_packet(9.0, ("x", 1), Packet("p2", (Ping(42, "me", peer(2)), Suspect(1, "me", "p2"))))
    (ack,) = sends(out)
    assert ack.msgs[0] == Ack(42)
    assert Alive("me", ME.host, ME.port, 2) in ack.msgs
    assert s.incarnation == 2  # no new refutation for a stale accusation


def test_accusations_from_a_dead_member_are_ignored() -> None:
    s = mk()
    s.on_packet(1.0, ("x", 1), Dead(1, "p1", "p2"))
    s.on_packet(1.1, ("x", 1), Suspect(1, "p0", "p1"))
    s.on_packet(1.2, ("x", 1), Dead(1, "p3", "p1"))
    assert state(s, "p0") == (A, 1)
    assert state(s, "p3") == (A, 1)
    s.on_packet(1.3, ("x", 1), Dead(1, "p3", "p2"))  # a live accuser is heard
    assert state(s, "p3") == (D, 1)


def test_ping_from_unknown_node_triggers_a_rate_limited_push_pull() -> None:
    s = mk()
    stranger = NodeAddr("zz", "10.7.7.7", 7946)
    out = s.on_packet(1.0, stranger.addr, Ping(1, "me", stranger))
    assert PushPull(stranger.addr, "zz", False) in out
    out = s.on_packet(2.0, stranger.addr, Ping(2, "me", stranger))
    assert not any(isinstance(a, PushPull) for a in out)
    out = s.on_packet(1.0 + SwimConfig().reconnect_interval, stranger.addr, Ping(3, "me", stranger))
    assert PushPull(stranger.addr, "zz", False) in out


def test_others_suspicion_makes_us_probe_the_suspect_next() -> None:
    s = mk(5)  # n = 6: 2(k+1)/(n-2) >= 1, so always
    t, send, ping = run_until_probe(s)
    s.on_packet(t, send.dest, Ack(ping.seq))
    other = next(f"p{i}" for i in range(5) if f"p{i}" != ping.target)
    s.on_packet(t + 0.01, ("x", 1), Suspect(1, other, "p4" if other != "p4" else "p3"))
    _, send2, ping2 = run_until_probe(s, t + 0.01)
    assert ping2.target == other
    assert any(isinstance(m, Suspect) and m.node == other for m in send2.msgs)


def _to_the_suspect(a: Send) -> bool:
    """The suspicion a failed probe raises, sent at once to the suspect (not a gossip round's send; on the
    probe grid, a failed probe and a gossip round may fall on one tick)."""
    return all(isinstance(m, Suspect) and peer(int(m.node[1:])).addr == a.dest for m in a.msgs)


def test_gossip_targets_live_members_plus_one_dead() -> None:
    s = mk(8)
    for i in range(5):
        s.on_packet(0.0, ("x", 1), Dead(1, f"p{i}", "x"))
    dead = {peer(i).addr for i in range(5)}
    for _ in range(20):
        out = s.tick(s.next_deadline())
        gossip = [
            a
            for a in sends(out)
            if not any(isinstance(m, (Ping, PingReq, Ack, Nack)) for m in a.msgs) and not _to_the_suspect(a)
        ]
        if gossip:
            assert sum(1 for a in gossip if a.dest in dead) <= 1
            assert sum(1 for a in gossip if a.dest not in dead) <= SwimConfig().gossip_nodes


def test_set_meta_bumps_incarnation_and_gossips() -> None:
    s = mk()
    s.set_meta(1.0, b"http=10.0.0.1:8080")
    assert s.incarnation == 2
    assert s.member("me") == Member("me", ME.host, ME.port, 2, A, b"http=10.0.0.1:8080")
    other = mk()
    other.on_packet(0.0, ("x", 1), Alive("me2", "10.0.0.2", 7946, 1))
    out = other.on_packet(1.0, ("x", 1), Alive("me2", "10.0.0.2", 7946, 2, b"m"))
    assert [(a.prev, a.member.meta) for a in out if isinstance(a, MemberUp)] == [(A, b"m")]
    with pytest.raises(ValueError):
        s.set_meta(1.0, b"x" * 10_000)
    with pytest.raises(ValueError):
        Swim(SwimConfig(), NodeAddr("", "h", 1), random.Random(1), NullDelegate())


def test_confirmation_that_ends_a_suspicion_at_once_is_not_lag() -> None:
    s = mk(9, cfg=MEMBERLIST)
    advance(s, 10.0, ack=True)
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    advance(s, 14.0, ack=True)
    health = s.health
    s.on_packet(14.0, ("x", 1), Suspect(1, "p0", "p2"))
    s.on_packet(14.0, ("x", 1), Suspect(1, "p0", "p3"))  # at min (2 s): overdue since 12.0
    assert s.next_deadline() < 14.0
    out = s.tick(14.0)
    assert state(s, "p0") == (D, 1)
    assert any(isinstance(a, MemberDead) for a in out)
    assert s.health == health and s.stats.lag_events == 0


# ------------------------------------------------------------------- clearing a live node fast


def test_second_direct_ping_goes_with_the_ping_reqs_and_its_ack_counts() -> None:
    s = mk(5)
    t, send, ping = run_until_probe(s)
    out = advance(s, t + s.config.probe_timeout)
    assert len(msgs_of(out, PingReq)) == s.config.indirect_checks
    again = [m for a, m in msgs_of(out, Ping) if a.dest == send.dest]
    assert again == [Ping(ping.seq, ping.target, ME)]  # same seq: an ack on either path counts
    s.on_packet(t + s.config.probe_timeout + 0.01, send.dest, Ack(ping.seq))
    advance(s, t + 2.0, ack=True)
    assert state(s, ping.target) == (A, 1)
    assert s.stats.probes_failed == 0


def test_failed_probe_tells_the_suspect_at_once() -> None:
    s = mk(5)
    t, send, ping = run_until_probe(s)
    out = advance(s, t + s.config.probe_interval)
    assert state(s, ping.target) == (S, 1)
    assert any(a.dest == send.dest and a.msgs == (Suspect(1, ping.target, "me"),) for a in sends(out))


def test_a_stall_of_a_probe_period_is_refuted_at_once_once() -> None:
    s = mk(6)
    advance(s, 5.0, ack=True)
    inc = s.incarnation
    s.tick(s.next_deadline() + 0.2)  # late by half a probe period: lag, nothing more
    assert s.incarnation == inc
    advance(s, 10.0, ack=True)
    late = s.next_deadline() + 1.0
    out = s.tick(late)  # we did not run for a second: whoever probed us suspects us by now
    assert s.incarnation == inc + 1
    alive = Alive("me", ME.host, ME.port, inc + 1)
    assert len({a.dest for a in sends(out) if a.msgs == (alive,)}) >= s.config.gossip_nodes
    s.set_lag(late, 1.0)  # the lag monitor reports the same stall
    assert s.incarnation == inc + 1
    assert s.stats.extra["stall_refutations"] == 1
    out = s.on_packet(late + 0.01, ("x", 1), Suspect(inc, "me", "p2"))  # the suspicion, arriving late
    assert s.incarnation == inc + 1  # already refuted: only re-told
    assert any(a.dest == peer(2).addr for a, _ in msgs_of(out, Alive))


def test_death_we_declare_is_sent_at_once() -> None:
    s = mk(9)  # n = 10: k = 3
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    for src in ("p2", "p3", "p4"):
        s.on_packet(10.1, ("x", 1), Suspect(1, "p0", src))
    advance(s, 11.9, ack=True)
    assert state(s, "p0") == (S, 1)
    for _ in range(100):  # tick by tick, until the one where the suspicion ends
        out = s.tick(s.next_deadline())
        if state(s, "p0") != (S, 1):
            break
    assert state(s, "p0") == (D, 1)
    assert s.stats.deaths_declared == 1
    at_once = {a.dest for a in sends(out) if a.msgs == (Dead(1, "p0", "me"),)}
    assert len(at_once) == s.config.gossip_nodes  # not at the next gossip tick


def test_confirmations_are_gossiped_each_and_dropped_with_the_suspicion() -> None:
    s = mk(9)
    for src in ("p1", "p2", "p3"):
        s.on_packet(10.0, ("x", 1), Suspect(1, "p0", src))
    out = advance(s, 10.6, ack=True)
    # none replaced another in our queue before it went out: the accuser needs all k
    assert {m.src for _, m in msgs_of(out, Suspect) if isinstance(m, Suspect) and m.node == "p0"} >= {
        "p1",
        "p2",
        "p3",
    }
    s.on_packet(10.7, ("x", 1), Alive("p0", peer(0).host, peer(0).port, 2))
    out = advance(s, 13.0, ack=True)
    assert not [m for _, m in msgs_of(out, Suspect) if isinstance(m, Suspect) and m.node == "p0"]


def test_full_confirmation_ends_at_the_floor_whatever_n() -> None:
    """Default timers at n = 20: unconfirmed, max grows with log10 n; with all k confirmations the
    suspicion ends mult * probe_interval after it began, as at n = 10."""
    cfg = SwimConfig()
    s = mk(19)
    lo, hi = cfg.suspicion_bounds(20)
    assert lo == pytest.approx(2.0) and hi > 12.0
    s.on_packet(10.0, ("x", 1), Suspect(1, "p0", "p1"))
    for src in ("p2", "p3", "p4"):
        s.on_packet(10.5, ("x", 1), Suspect(1, "p0", src))
    advance(s, 10.0 + lo - 0.01, ack=True)
    assert state(s, "p0") == (S, 1)
    advance(s, 10.0 + lo, ack=True)
    assert state(s, "p0") == (D, 1)
