"""Exact-state unit tests written against the mutants ``make mutate`` found surviving (mutmut over the
circuit breaker, the SWIM suspicion timer and refutation, the rate limiter's admission, the prefix index's
match and the stop matcher): each test pins a value or a transition the older tests left free, so that a
changed comparison, constant or assignment fails here. Pure, fast, no I/O."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, cast

import pytest

from shepherd.mesh.ratelimit import RateLimiter
from shepherd.mesh.ratelimit_keys import unit_hash
from shepherd.mesh.swim_suspicion import Awareness, Suspicion
from shepherd.mesh.swim_types import MemberDead, MemberLeft, remaining_suspicion_time
from shepherd.node.dispatch.circuit_breaker import BreakerState, CircuitBreaker, HealthTracker
from shepherd.node.output.stop import StopMatcher
from shepherd.policies.prefix_index import PrefixIndex
from shepherd.proto.mesh_messages import Alive, Dead, Suspect
from shepherd.proto.mesh_messages import MemberState as _MemberState
from tests.unit.test_mesh_swim import ME, mk

SUSPECT = _MemberState.SUSPECT

# ---- the circuit breaker ---------------------------------------------------------------------------------


def cb(**kw: Any) -> CircuitBreaker:
    return CircuitBreaker(**{"failure_threshold": 2, "success_threshold": 2, "open_secs": 10.0, **kw})


def test_a_closed_breaker_lets_sends_through_and_keeps_its_state() -> None:
    b = cb()
    assert b.allows(0.0) and b.acquire(0.0) and b.acquire(0.0)  # closed: no reservation needed
    assert b == cb()
    b.record_failure(1.0)
    assert b == cb(failures=1)
    b.record_success()  # a success clears the failures
    assert b == cb(failures=0)


def test_the_cool_down_counts_from_the_opening_time() -> None:
    b = cb()
    b.record_failure(100.0)
    b.record_failure(100.0)
    assert b == cb(state=BreakerState.OPEN, opened_at=100.0)  # every counter reset, no trial
    for t in (100.0, 105.0, 109.99):  # still cooling down: 10 s from 100, not from 0
        assert not b.allows(t) and not b.acquire(t)
        assert b.state is BreakerState.OPEN
    assert b.allows(110.0)
    assert b.acquire(110.0)
    assert b == cb(state=BreakerState.HALF_OPEN, opened_at=100.0, trial_in_flight=True)


def test_half_open_allows_one_trial_at_a_time() -> None:
    b = cb(state=BreakerState.OPEN, opened_at=0.0, trial_in_flight=True)  # a stale flag from before
    assert b.allows(10.0)
    assert b.acquire(10.0)  # the cool-down over: half-open, the flag reset, this send is the trial
    assert b == cb(state=BreakerState.HALF_OPEN, opened_at=0.0, trial_in_flight=True)
    assert not b.allows(10.0) and not b.acquire(10.0)  # the trial is out
    b.release()  # it ended without a verdict: another may go
    assert b == cb(state=BreakerState.HALF_OPEN, trial_in_flight=False)
    assert b.allows(10.0) and b.acquire(10.0)
    b.record_success()
    assert b == cb(state=BreakerState.HALF_OPEN, successes=1, trial_in_flight=False)
    assert b.acquire(11.0)
    b.record_success()  # the second success closes it, counters back to zero
    assert b == cb(state=BreakerState.CLOSED, successes=0, failures=0, trial_in_flight=False)


def test_release_outside_half_open_changes_nothing() -> None:
    for b in (cb(), cb(state=BreakerState.OPEN, opened_at=5.0, trial_in_flight=True)):
        before = dataclasses.replace(b)
        b.release()
        assert b == before


def test_a_failed_trial_reopens_from_its_time_with_everything_reset() -> None:
    b = cb(state=BreakerState.OPEN, opened_at=0.0)
    assert b.acquire(10.0)
    b.record_failure(12.0)
    assert b == cb(state=BreakerState.OPEN, opened_at=12.0)
    assert not b.acquire(21.0) and b.acquire(22.0)


def test_health_hysteresis_resets_the_other_counter() -> None:
    h = HealthTracker(failure_threshold=3, success_threshold=2)
    assert h.observe(True) and h.healthy  # the first check decides at once
    assert not h.observe(False) and not h.observe(False)
    assert (h.fails, h.oks) == (2, 0)
    assert not h.observe(True)  # one good check clears the failures
    assert (h.healthy, h.fails, h.oks) == (True, 0, 1)
    assert not h.observe(False) and not h.observe(False)  # 2 < 3 again: still healthy
    assert h.observe(False)
    assert (h.healthy, h.fails, h.oks) == (False, 3, 0)
    assert not h.observe(True)  # 1 < 2
    assert h.observe(True)
    assert (h.healthy, h.fails, h.oks) == (True, 0, 2)


def test_the_first_check_decides_either_way() -> None:
    h = HealthTracker()
    assert not h.observe(False)  # unknown -> unhealthy: the flag did not change
    assert h.checked and not h.healthy and (h.fails, h.oks) == (0, 0)


# ---- SWIM suspicion (Lifeguard) ---------------------------------------------------------------------------


def test_a_suspicion_starts_at_max_or_at_min_without_expected_confirmations() -> None:
    s = Suspicion(7, "a", k=3, min_s=2.0, max_s=12.0, start=100.0)
    assert (s.incarnation, s.k, s.min_s, s.max_s, s.start, s.n) == (7, 3, 2.0, 12.0, 100.0, 0)
    assert (s.deferred, s.verifies_left, s.deadline) == (False, 0, 112.0)
    assert Suspicion(7, "a", k=0, min_s=2.0, max_s=12.0, start=100.0).deadline == 102.0
    assert Suspicion(7, "a", k=1, min_s=2.0, max_s=12.0, start=100.0).deadline == 112.0


def test_verification_pings_are_spaced_before_the_deadline() -> None:
    s = Suspicion(1, "a", k=3, min_s=2.0, max_s=12.0, start=100.0)  # deadline 112
    assert s.verify_at(1.0) == math.inf  # none left
    s.verifies_left = 1
    assert s.verify_at(1.0) == 111.0  # the last one a spacing before the deadline
    s.verifies_left = 3
    assert s.verify_at(1.5) == 107.5
    assert s.verify_at(10.0) == 100.0  # never before the suspicion began
    s.verifies_left = -1
    assert s.verify_at(1.0) == math.inf


def test_confirmations_shrink_the_deadline_and_count_once_each() -> None:
    s = Suspicion(1, "acc", k=2, min_s=2.0, max_s=12.0, start=100.0)
    assert not s.confirm("acc", 101.0)  # the accuser never confirms its own suspicion
    assert s.confirm("b", 101.0)
    assert s.n == 1
    assert s.deadline == pytest.approx(101.0 + remaining_suspicion_time(1, 2, 1.0, 2.0, 12.0))
    assert s.deadline == pytest.approx(100.0 + 12.0 - math.log(2) / math.log(3) * 10.0, abs=1e-3)
    assert not s.confirm("b", 102.0)  # the same confirmer again
    assert s.confirm("c", 103.0)
    assert s.n == 2 and s.deadline == pytest.approx(102.0)  # all k in: the minimum from the start
    assert not s.confirm("d", 103.0)  # past k: nothing changes
    assert s.n == 2


def test_awareness_clamps_its_score_and_scales_timeouts() -> None:
    a = Awareness(max_score=3)
    assert (a.max_score, a.score) == (3, 0)
    assert a.scale(0.5) == 0.5
    a.apply(-1)
    assert a.score == 0
    a.apply(2)
    assert (a.score, a.scale(0.5)) == (2, 1.5)
    a.apply(5)
    assert (a.score, a.scale(0.5)) == (3, 2.0)
    a.apply(-1)
    assert a.score == 2


def test_a_stale_accusation_is_counted_and_answered_with_one_alive() -> None:
    s = mk(4)
    s.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))  # refuted: incarnation 2
    assert s.incarnation == 2
    assert "stale_accusations" not in s.stats.extra
    for i in (1, 2):
        s.on_packet(1.0 + i, ("x", 1), Suspect(1, "me", "p2"))  # an accusation of the refuted incarnation
        assert s.incarnation == 2  # not refuted again
        assert s.stats.extra["stale_accusations"] == i
    # our Alive re-gossiped under our own name: it replaces the queued one instead of piling up
    assert _queued_alives_of_me(s) == [Alive("me", ME.host, ME.port, 2)]


def _queued_alives_of_me(s: Any) -> list[Alive]:
    q = s._table.queue
    items = [it for bucket in q._buckets.values() for it in bucket.values()]
    return [it.value for it in items if isinstance(it.value, Alive) and it.value.name == "me"]


def test_each_refutation_is_counted_once_and_replaces_the_last_one() -> None:
    s = mk(4)
    assert s.stats.refutations == 0
    s.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))
    assert (s.incarnation, s.stats.refutations) == (2, 1)
    s.on_packet(2.0, ("x", 1), Suspect(2, "me", "p2"))
    assert (s.incarnation, s.stats.refutations) == (3, 2)
    assert _queued_alives_of_me(s) == [Alive("me", ME.host, ME.port, 3)]  # only the newest is gossiped


def test_a_refutation_tells_its_accuser_only_when_there_is_one() -> None:
    t = mk(4)._table
    t.urgent_to.clear()
    t.refute(5)  # no accuser (another "us" claimed a newer incarnation): gossiped, nobody told directly
    assert (t.local.incarnation, t.urgent_to, t.urgent_alive) == (6, {}, True)
    t.refute(6, "p1")
    assert (t.local.incarnation, t.urgent_to) == (7, {"p1": None})
    t.refute(7, "me")  # an accusation carrying our own name as the accuser: not sent to ourselves
    assert (t.local.incarnation, t.urgent_to) == (8, {"p1": None})
    assert t.stats.refutations == 3


# ---- the prefix index's match ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_worker_holding_only_the_first_block_matches_one_block(n: int) -> None:
    ix = PrefixIndex()
    chain = list(range(100, 100 + n))
    ix.insert_blocks(chain[:1], "w", 1.0)  # only the first block
    ix.insert_blocks(chain, "v", 1.0)  # the whole chain
    assert ix.match_blocks(chain) == {"w": 1, "v": n}
    assert ix.match_blocks(chain[:1]) == {"w": 1, "v": 1}
    assert ix.match_blocks([7, *chain]) == {}  # a chain is matched from its first block only
    assert ix.match_blocks([]) == {}


class _Namer:
    def names(self, ids: Any) -> list[int]:
        return [len(ids), 7]


def test_hashes_come_from_the_configured_namer() -> None:
    ix = PrefixIndex()
    ix.namer = _Namer()  # type: ignore[assignment]  # (the Python namer when the C names are not built)
    ids = list(range(40))
    assert ix.hashes(ids) == [40, 7]
    assert ix.hashes(ids) == [40, 7]  # the same object again: the cached answer


# ---- the stop matcher's token ids ---------------------------------------------------------------------


def test_a_stop_token_first_leaves_no_text_or_only_itself() -> None:
    m = StopMatcher(stop_token_ids=[9])
    assert list(m.text_ids([9, 1, 2])) == []  # the very first id stops: nothing before it
    assert list(m.text_ids([1, 9, 2])) == [1]
    assert list(m.text_ids([1, 2])) == [1, 2]
    inc = StopMatcher(stop_token_ids=[9], include_stop_str_in_output=True)
    assert list(inc.text_ids([9, 1])) == [9]
    assert list(inc.text_ids([1, 9, 2])) == [1, 9]


def test_on_suspect_starts_one_suspicion_counts_it_and_queues_it_under_the_members_name() -> None:
    t = mk(5)._table
    seen: list[tuple[str, int]] = []
    t.on_suspected = lambda node, k: seen.append((node, k))
    out: list[Any] = []
    t.on_suspect(Suspect(1, "p1", "p2"), 3.0, out)
    n = t.nodes["p1"]
    assert (n.state, n.incarnation, n.state_change) == (SUSPECT, 1, 3.0)
    assert t.stats.suspicions == 1 and len(out) == 1
    k = t.cfg.expected_confirmations(len(t.nodes))
    assert seen == [("p1", k)] and k >= 2
    assert t.queue._by_key["p1"].value == Suspect(1, "p1", "p2")
    # the accuser's own message coming back is no confirmation
    t.on_suspect(Suspect(1, "p1", "p2"), 3.5, out)
    assert t.suspicions["p1"].n == 0
    # two confirmations from two members: each counted, each queued under its own key
    t.on_suspect(Suspect(1, "p1", "p3"), 4.0, out)
    t.on_suspect(Suspect(1, "p1", "p0"), 4.5, out)
    assert t.suspicions["p1"].n == 2
    keys = ["p1\x00confirm\x00p3", "p1\x00confirm\x00p0"]
    assert t._confirm_keys == {"p1": keys}
    assert [t.queue._by_key[key].value for key in keys] == [Suspect(1, "p1", "p3"), Suspect(1, "p1", "p0")]
    # our own suspicion of another member: counted, but not reported as someone else's
    t.on_suspect(Suspect(1, "p4", "me"), 5.0, out)
    assert t.stats.suspicions == 2 and seen == [("p1", k)]


def test_a_stale_suspicion_of_another_member_is_ignored() -> None:
    t = mk(4)._table
    t.nodes["p1"].incarnation = 3
    t.on_suspect(Suspect(2, "p1", "p2"), 1.0, [])  # an older incarnation of p1: nothing to do
    assert t.nodes["p1"].state != SUSPECT and "p1" not in t.suspicions
    assert "stale_accusations" not in t.stats.extra  # that is only for accusations of us


def test_on_dead_ends_the_suspicion_reports_the_previous_state_and_counts_only_our_declarations() -> None:
    t = mk(5)._table
    out: list[Any] = []
    t.on_suspect(Suspect(1, "p1", "p2"), 1.0, out)
    t.on_suspect(Suspect(1, "p1", "p3"), 1.5, out)  # a confirmation, queued under its own key
    assert "p1" in t.suspicions and t._confirm_keys
    out.clear()
    t.on_dead(Dead(1, "p1", "p2"), 2.0, out)  # declared by another member
    assert "p1" not in t.suspicions and not t._confirm_keys
    assert out == [MemberDead(t.nodes["p1"].snapshot(), SUSPECT)]
    assert (t.nodes["p1"].state, t.nodes["p1"].state_change) == (_MemberState.DEAD, 2.0)
    assert t.queue._by_key["p1"].value == Dead(1, "p1", "p2")  # replaces the suspicion in the queue
    assert t.stats.deaths_declared == 0 and t.urgent_dead == []
    t.on_dead(Dead(1, "p2", "me"), 3.0, out)  # our own declarations are counted, and sent at once
    t.on_dead(Dead(1, "p3", "me"), 3.0, out)
    assert t.stats.deaths_declared == 2 and t.urgent_dead == [Dead(1, "p2", "me"), Dead(1, "p3", "me")]
    out.clear()
    t.on_dead(Dead(1, "p4", "p4"), 4.0, out)  # a member's own death notice: it left, not counted
    assert out == [MemberLeft(t.nodes["p4"].snapshot(), _MemberState.ALIVE)]
    assert t.stats.deaths_declared == 2


def test_a_stale_death_notice_of_us_is_answered_and_one_of_another_member_ignored() -> None:
    t = mk(4)._table
    t.local.incarnation = 5
    t.urgent_to.clear()
    t.on_dead(Dead(1, "p1", "p2"), 1.0, [])  # p1 is at incarnation 1: not stale, p1 dead
    t.on_dead(Dead(0, "p2", "p3"), 1.0, [])  # p2 is at incarnation 1: a stale notice, ignored
    assert t.nodes["p2"].state == _MemberState.ALIVE and "stale_accusations" not in t.stats.extra
    t.on_dead(Dead(3, "me", "p3"), 10.0, [])  # declares an incarnation of ours we already outbid
    assert t.stats.extra["stale_accusations"] == 1 and t.local.incarnation == 5
    assert t.urgent_to == {"p3": None} and t._told["p3"] == 10.0  # the accuser is told directly
    t.on_dead(Dead(1, "nobody", "p3"), 11.0, [])  # an unknown member: nothing
    assert "nobody" not in t.nodes and t.stats.extra["stale_accusations"] == 1


# ---- the rate limiter's admission ------------------------------------------------------------------------


def test_exactly_one_node_is_designated_per_slot_and_it_is_the_rendezvous_winner() -> None:
    """With no demand anywhere every share is equal, and the designation is a rendezvous hash: the node
    with the largest ``unit_hash(tenant, model, slot, node)``; every node computes the same winner."""
    names = ["node-a", "node-b", "node-c"]
    limiters = {n: RateLimiter(n, 1) for n in names}
    for lim in limiters.values():
        lim.set_membership(names, 3)
    key = ("tenant-1", "model-x")
    wins: Counter[str] = Counter()
    for slot in range(300):
        chosen = [n for n, lim in limiters.items() if lim._designated(key, slot, cast(Any, None), 0, 0.0)]
        want = max(names, key=lambda n: unit_hash(key[0], key[1], slot, n))
        assert chosen == [want], (slot, chosen, want)
        wins[want] += 1
    assert all(wins[n] >= 60 for n in names), wins  # spread over the nodes, slot by slot
    other = ("tenant-2", "model-x")  # another key: another draw
    assert [max(names, key=lambda n: unit_hash(*other, s, n)) for s in range(20)] != [
        max(names, key=lambda n: unit_hash(*key, s, n)) for s in range(20)
    ]
