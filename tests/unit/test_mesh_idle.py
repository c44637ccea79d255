"""What an idle meshed node does: no gossip round, flush or lag sample of its own while nothing is pending
(issue 25 item 5: idle cost per node), and what still wakes it when something is written."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from shepherd.mesh.ratelimit import Limits, RateLimiter
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_config import TenantRecord
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.swim import Swim
from shepherd.mesh.swim_types import NullDelegate, Send, SwimConfig
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.policies.base import RouteRequest
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto.mesh_messages import Ack, Member, MemberState, NodeAddr, Packet, Ping, PushPullState
from tests.unit.mesh_fixtures import eventually, two_mesh_nodes

MODEL = "m"
CFG = SwimConfig()


class Pending(NullDelegate):
    """A delegate that says whether it has broadcasts."""

    def __init__(self) -> None:
        self.pending = False

    def has_broadcasts(self) -> bool:
        return self.pending


PEER = NodeAddr("p", "10.0.0.2", 7946)


def joined(delegate: NullDelegate) -> Swim:
    s = Swim(CFG, NodeAddr("me", "10.0.0.1", 7946), random.Random(3), delegate, incarnation=1)
    s.start(0.0, [])
    s.merge_push_pull(0.0, PushPullState((Member(PEER.name, PEER.host, PEER.port, 1, MemberState.ALIVE),)))
    return s


def step(s: Swim, now: float) -> None:
    """One tick at ``now``; the peer answers every ping at once (a healthy, idle pair)."""
    for a in s.tick(now):
        if isinstance(a, Send):
            for m in a.msgs:
                if isinstance(m, Ping):
                    s.on_packet(now, PEER.addr, Packet("p", (Ack(m.seq),)))


def run(s: Swim, start: float, until: float) -> list[float]:
    """Every deadline from ``start`` up to ``until``, each ticked."""
    out = []
    for _ in range(10_000):  # bounded
        now = max(start, s.next_deadline())
        if now > until:
            break
        out.append(now)
        step(s, now)
    return out


def test_gossip_rounds_only_while_something_is_pending() -> None:
    d = Pending()
    s = joined(d)
    run(s, 0.0, 30.0)
    assert s.pending_broadcasts == 0  # the join's news went out and stopped
    # with nothing to gossip, the probe timer wakes the node (25 probes in 10 s), the push-pull and
    # reconnect timers now and then; not the 50 gossip rounds
    woke = run(s, 30.0, 40.0)
    assert len(woke) <= 10 / CFG.probe_interval + 6, woke
    assert (s.health, s.stats.lag_events) == (0, 0)
    # a delegate with something to send: its gossip round is due again
    d.pending = True
    assert s.next_deadline() <= 40.0 + CFG.gossip_interval
    # a delegate that cannot tell (no has_broadcasts) keeps every gossip round (the old behaviour)
    plain = joined(NullDelegate())
    run(plain, 0.0, 30.0)
    assert len(run(plain, 30.0, 40.0)) >= 10 / CFG.gossip_interval


def test_a_gossip_round_that_became_due_while_idle_is_not_lag() -> None:
    d = Pending()
    s = joined(d)
    run(s, 0.0, 30.0)
    probe = s.next_deadline()  # armed for the next probe: nothing to gossip
    d.pending = True  # a broadcast queued meanwhile: the gossip deadline it left behind is not lateness
    step(s, probe)
    assert (s.health, s.stats.lag_events) == (0, 0)


def test_state_has_broadcasts_exactly_when_a_config_update_is_pending() -> None:
    st: MeshState[Replica] = MeshState(
        "a", time.time, MeshStateConfig(first_hand=True), new_index=make_replica
    )
    st.broadcasts(10_000)
    assert not st.has_broadcasts()
    st.config.set_tenant(TenantRecord("t1"))
    assert st.has_broadcasts()
    assert st.broadcasts(10_000)  # what it said it had
    # not first-hand: it cannot tell cheaply, so it always says yes
    other: MeshState[Replica] = MeshState("b", time.time, new_index=make_replica)
    assert other.has_broadcasts()


def test_limiter_says_once_that_it_has_a_delta() -> None:
    lim = RateLimiter("a", 1)
    calls: list[int] = []
    lim.on_dirty = lambda: calls.append(1)
    rules = [(("tenant", "t"), Limits(rpm=100))]
    now = time.time()
    lim.acquire(now, rules, 1)
    lim.acquire(now, rules, 1)
    assert calls == [1]  # one delta pending: said once
    while lim.take_delta() is not None:  # bounded by the keys dirty
        pass
    lim.acquire(now, rules, 1)
    assert calls == [1, 1]


async def test_a_node_flushes_when_something_was_written_and_not_otherwise(tmp_path: Path) -> None:
    flushes: list[float] = []

    def count_flushes(a: MeshNode) -> None:
        due = a._flush_due

        def counted() -> None:
            flushes.append(time.monotonic())
            due()

        a._flush_due = counted  # type: ignore[method-assign]

    async with two_mesh_nodes(tmp_path, MODEL, prepare_a=count_flushes) as (gw_a, a, gw_b, b):
        url = "grpc://127.0.0.1:9"
        await gw_a.registry.add(url, MODEL)
        gb = gw_b
        await eventually(lambda: gb.registry.find(url) is not None, what="the worker on b")
        w = gw_a.registry.find(url)
        assert w is not None
        await asyncio.sleep(0.3)  # the add's own flush done
        before = len(flushes)
        await asyncio.sleep(0.5)  # nothing written: no flush of its own (the old loop ran 25 here)
        assert len(flushes) == before
        ids = list(range(5000, 5320))
        assert gw_a.policy_for(MODEL).pick([w.view()], RouteRequest(MODEL, ids)) is not None
        pb = gw_b.policy_for(MODEL)
        await eventually(lambda: len(flushes) > before, what="the decision's flush")
        ib = b.state.index(MODEL)
        await eventually(lambda: ib.match(ids) == {w.id: 320}, what="a's decision in b's index")
        # the runtime's timer: no empty gossip round, no lone lag sample, no probe-timeout wake-up
        # once the ack is in: a bounded number of wake-ups per probe period (it used to be ~4x this)
        rt = a.runtime
        assert rt is not None
        t0, ticks0 = time.monotonic(), rt.metrics.ticks
        await asyncio.sleep(2.0)
        periods = (time.monotonic() - t0) / CFG.probe_interval
        assert rt.metrics.ticks - ticks0 <= 1.5 * periods + 2
        assert pb is not None


async def test_the_node_tick_rides_on_the_runtimes_wake_ups(tmp_path: Path) -> None:
    async with two_mesh_nodes(tmp_path, MODEL) as (_gw_a, a, _gw_b, _b):
        rt = a.runtime
        assert rt is not None
        assert rt._job == a._wake and a._tasks == []  # no timer task of its own
        assert rt._timer_at <= rt._job_due  # the runtime's timer wakes it when due at the latest
        runs: list[float] = []
        rt.call_every(1.0, lambda: runs.append(now[0]), slack=0.25)
        now = [100.0]
        rt._now = lambda: now[0]  # type: ignore[method-assign]
        try:
            rt._job_due = 101.0
            for t in (100.5, 100.74):  # a datagram or a probe tick before the slack window: not yet
                now[0] = t
                rt._run_job()
            assert runs == []
            now[0] = 100.8  # the first wake-up within the window runs it, due a period later
            rt._run_job()
            assert runs == [100.8] and rt._job_due == 101.8
            now[0] = 101.0
            rt._run_job()
            assert runs == [100.8]
            rt._closing = True  # never once the runtime is closing (the leave's drain)
            now[0] = 102.0
            rt._run_job()
            assert runs == [100.8]
            rt._closing = False
        finally:
            del rt._now
        with pytest.raises(ValueError):
            rt.call_every(1.0, lambda: None, slack=1.0)


async def test_the_runtimes_wake_ups_read_the_kv_streams_and_tick_when_due(tmp_path: Path) -> None:
    async with two_mesh_nodes(tmp_path, MODEL) as (gw_a, a, _gw_b, _b):
        lazy = gw_a.kv_feed.lazy_reads
        assert lazy is not None  # the mesh made the node's KV-event streams lazily read
        polls: list[int] = []
        ticks: list[int] = []
        gw_a.kv_feed.poll = lambda: polls.append(1)  # type: ignore[method-assign]
        a.tick = lambda: ticks.append(1)  # type: ignore[method-assign]
        a._tick_due = time.monotonic() + 100.0
        for _ in range(3):  # every wake-up reads; the tick is not due
            a._wake()
        assert len(polls) == 3 and ticks == []
        a._tick_due = 0.0
        before = time.monotonic()
        a._wake()
        assert len(polls) == 4 and ticks == [1]
        assert a._tick_due >= before + 0.5  # due again 0.5 s on: with reads 0.5 s apart at most, <= 1 s
        a._wake()
        assert ticks == [1]
