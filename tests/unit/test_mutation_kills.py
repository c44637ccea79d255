"""Exact-state unit tests written against the mutants ``make mutate`` found surviving (mutmut over the
circuit breaker, the SWIM suspicion timer and refutation, the rate limiter's admission, the prefix index's
match and the stop matcher): each test pins a value or a transition the older tests left free, so that a
changed comparison, constant or assignment fails here. Pure, fast, no I/O."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from typing import Any, cast

import pytest

from shepherd.mesh.ratelimit import Denial, Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_keys import unit_hash
from shepherd.mesh.ratelimit_shards import wait_until_fits
from shepherd.mesh.swim_suspicion import Awareness, Suspicion
from shepherd.mesh.swim_types import MemberDead, MemberLeft, remaining_suspicion_time
from shepherd.node.dispatch.circuit_breaker import BreakerState, CircuitBreaker, HealthTracker
from shepherd.node.output import stop as stop_mod
from shepherd.node.output.stop import StopMatcher, StoppingDecoder, StopResult
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


# ---- the rate limiter's lease arithmetic (``_share``, ``_fits``, ``_check``) ------------------------------


class _View:
    """A ``View`` with chosen numbers: demand per (node, metric); an unknown (node, metric) is an error."""

    def __init__(
        self,
        demand: dict[tuple[str, int], float] | None = None,
        *,
        req: tuple[float, float] = (0.0, 0.0),
        tok: tuple[float, float] = (0.0, 0.0),
        conc: int = 0,
        own_level: int = 0,
        own_areq: float = 120.0,
    ) -> None:
        self._d = demand or {}
        self.req_prev, self.req_cur = req
        self.tok_prev, self.tok_cur = tok
        self.conc, self.own_level = conc, own_level
        self.own_areq = own_areq  # own attempts in the sliding window (120 a minute: 2.1 within τ)

    def demand(self, node: str, me: str, m: int) -> float:
        return self._d[(node, m)]

    def total_demand(self, m: int) -> float:
        return sum(d for (_, mm), d in self._d.items() if mm == m)


def _pair(**cfg: Any) -> RateLimiter:
    """Node "a" of a two-node mesh (share floor 0.2), with the fixed-τ lease these pin (``propagation_max``
    0: no τ from the ages and no coin toss for the lease's remainder, see ``test_ratelimit_arrival``)."""
    lim = RateLimiter("a", 1, LimiterConfig(**{"propagation_max": 0.0, **cfg}))
    lim.set_membership(["a", "b"], 2)
    return lim


# requests: a and b want the same (shares 0.5 / 0.5); tokens: a wants 3 of 4 (0.7 / 0.3)
_DEMAND = {("a", 0): 1.0, ("b", 0): 1.0, ("a", 1): 3.0, ("b", 1): 1.0}
KEY = ("tenant-1", "model-x")


def test_shares_are_the_floor_split_equally_plus_the_rest_by_demand() -> None:
    lim = _pair()
    v = cast(Any, _View({("a", 0): 1.0, ("b", 0): 3.0, ("a", 1): 30.0, ("b", 1): 10.0}))
    assert lim._share(v, 0, "a", 4.0) == pytest.approx(0.2 / 2 + 0.8 * 1 / 4)  # 0.3
    assert lim._share(v, 1, "a", 40.0) == pytest.approx(0.2 / 2 + 0.8 * 30 / 40)  # 0.7: tokens, not requests
    assert lim._share(v, 1, "b", 40.0) == pytest.approx(0.1 + 0.8 * 10 / 40)  # 0.3
    assert lim._share(v, 0, "a", 0.0) == 0.5  # no demand known yet: equal shares
    small = cast(Any, _View({("a", 0): 0.5, ("b", 0): 0.0}))  # a total under one attempt still counts
    assert lim._share(small, 0, "a", 0.5) == pytest.approx(0.9)
    assert lim._share(small, 0, "b", 0.5) == pytest.approx(0.1)


def test_the_designated_node_is_the_share_weighted_rendezvous_winner() -> None:
    names = ["a", "b"]
    v = cast(Any, _View(_DEMAND))
    share = {"a": 0.7, "b": 0.3}  # tokens (m = 1)
    lims = {n: RateLimiter(n, 1) for n in names}
    for lim in lims.values():
        lim.set_membership(names, 2)
    wins: Counter[str] = Counter()
    for slot in range(200):
        want = max(names, key=lambda n: share[n] / -math.log(unit_hash(*KEY, slot, n)))
        chosen = [n for n, lim in lims.items() if lim._designated(KEY, slot, v, 1, 4.0)]
        assert chosen == [want], slot
        wins[want] += 1
    assert wins["a"] > wins["b"] > 20, wins  # weighted: the bigger share wins more slots


def test_the_count_check_is_limit_plus_epsilon_inclusive() -> None:
    lim = _pair(lease=False)  # the count check alone
    v = cast(Any, _View(_DEMAND))
    # est + cost == limit + 1e-9 exactly (in floats): still fits
    assert 9.999999999 + 1e-9 == 9.0 + 1.0
    assert lim._fits(KEY, 0, 9.0, 0.0, 9.999999999, 1.0, v, 0) == 0
    assert lim._fits(KEY, 0, 9.0, 0.0, 9.99999999, 1.0, v, 0) == 1  # 1e-8 over: full
    assert lim._fits(KEY, 0, 9.0, 5.0, 10.0, 1.0, v, 0) == 0  # (no lease: u does not matter)


def test_the_lease_is_the_share_of_the_headroom_everyone_sees() -> None:
    lim = _pair()
    v = cast(Any, _View(_DEMAND))
    # requests, share 0.5: budget = 0.5 * (10 - 6 + u)
    assert lim._fits(KEY, 0, 6.0, 1.0, 10.0, 1.0, v, 0) == 0  # 1 + 1 <= 2.5
    assert lim._fits(KEY, 0, 6.0, 2.0, 10.0, 1.0, v, 0) == 0  # 2 + 1 <= 3
    assert lim._fits(KEY, 0, 6.0, 2.5, 10.0, 1.0, v, 0) == 2  # 3.5 > 3.25: spent, u > 0: no designation
    # exactly at the budget (+ 1e-9): admitted; u + cost == 0.5 * (2.999999998 + 1) + 1e-9 in floats
    assert 1.0 + 1.0 == 0.5 * (2.999999998 - 0.0 + 1.0) + 1e-9
    assert lim._fits(KEY, 0, 0.0, 1.0, 2.999999998, 1.0, v, 0) == 0
    assert lim._fits(KEY, 0, 0.0, 1.0, 2.99999999, 1.0, v, 0) == 2
    # tokens, share 0.7: budget = 0.7 * (100 - 40 + 10) = 49
    assert lim._fits(KEY, 0, 40.0, 10.0, 100.0, 39.0, v, 1) == 0
    assert lim._fits(KEY, 0, 40.0, 10.0, 100.0, 39.5, v, 1, rate=False) == 2
    # with share 0.5 (the requests' share) it would not fit:
    assert lim._fits(KEY, 0, 40.0, 10.0, 100.0, 30.0, v, 1) == 0


def _designated_slots(m: int, slots: range) -> list[bool]:
    share = {"a": 0.5, "b": 0.5} if m == 0 else {"a": 0.7, "b": 0.3}
    return [max(["a", "b"], key=lambda n: share[n] / -math.log(unit_hash(*KEY, s, n))) == "a" for s in slots]


def test_a_spent_lease_admits_only_in_the_designated_slot_with_nothing_unseen() -> None:
    lim = _pair()
    v = cast(Any, _View(_DEMAND))
    slots = range(40)
    want = _designated_slots(0, slots)
    assert True in want and False in want
    # budget 0.5 * (10 - 9) = 0.5 < 1: a fraction of a request; no coin toss (rate=False)
    got = [lim._fits(KEY, s, 9.0, 0.0, 10.0, 1.0, v, 0, rate=False) for s in slots]
    assert got == [0 if d else 2 for d in want]
    # with anything unseen (u > 0) no designation: 0.5 + 1 > 0.5 * 1.5
    assert [lim._fits(KEY, s, 9.0, 0.5, 10.0, 1.0, v, 0, rate=False) for s in slots] == [2] * len(slots)


@pytest.mark.parametrize("u", [0.0, -3.0])
def test_a_fraction_of_a_request_is_admitted_with_probability_lease_over_cost(u: float) -> None:
    """Tokens (share 0.7) at cost 4, limit 10, 6 used: budget 0.7 x (10 - 6 + u), 2.8 or 0.7 (the node
    gave some back), under the cost; the draw is ``unit_hash(node, version)`` against budget / cost, in a
    slot where "a" is not designated."""
    lim = _pair()
    v = cast(Any, _View(_DEMAND))
    slot = next(s for s, d in zip(range(100), _designated_slots(1, range(100)), strict=True) if not d)
    p = 0.7 * (4.0 + u) / 4.0
    vers = range(200)
    want = [0 if unit_hash("a", ver) < p else 2 for ver in vers]
    assert 0 in want and 2 in want
    got = []
    for ver in vers:
        lim._ver = ver
        got.append(lim._fits(KEY, slot, 6.0, u, 10.0, 4.0, v, 1))  # rate defaults to True
    assert got == want
    for ver in vers:  # not for the concurrency (rate=False), nor with anything unseen
        lim._ver = ver
        assert lim._fits(KEY, slot, 6.0, u, 10.0, 4.0, v, 1, rate=False) == 2
        assert lim._fits(KEY, slot, 6.0, 0.5, 10.0, 4.0, v, 1) == 2


class _FitsSpy:
    def __init__(self, verdicts: list[int]) -> None:
        self.verdicts = verdicts
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kw: Any) -> int:
        self.calls.append((args, kw))
        return self.verdicts.pop(0)


def _check(
    verdicts: list[int], *, own_level: int = 1, uc: int = 1, peak: int = 2
) -> tuple[Any, _FitsSpy, Any, list[int]]:
    lim = RateLimiter("a", 1, LimiterConfig(window=60.0, propagation=2.0))
    spy = _FitsSpy(verdicts)
    lim._fits = spy  # type: ignore[method-assign]
    v = _View(req=(40.0, 10.0), tok=(1000.0, 500.0), conc=3, own_level=own_level)
    u = [0, 2, 60, uc, peak]
    limits = Limits(rpm=20, tpm=6000, max_concurrent=8)
    out = lim._check(KEY, limits, cast(Any, None), cast(Any, v), u, 300, 0.5, 1234.5, 0.25)
    return out, spy, v, u


def test_check_passes_each_metric_its_limit_cost_and_designation_slot() -> None:
    out, spy, v, _ = _check([0, 0, 0])
    assert out is None
    assert spy.calls == [
        # rpm 20 x scale 0.5 = 10; a slot is max(τ 2, 60 / 10 = 6) s: floor(1234.5 / 6) = 205
        ((KEY, 205, 40 * 0.75 + 10, 2, 10.0, 1, v, 0), {}),
        # tpm 6000 x 0.5 = 3000; max(2, 60 x 300 / 3000 = 6): 205
        ((KEY, 205, 1000 * 0.75 + 500, 60, 3000.0, 300, v, 1), {}),
        # concurrency 8 x 0.5 = 4; slot floor(1234.5 / τ) = 617; no coin toss
        ((KEY, 617, 3, 1, 4.0, 1, v, 0), {"rate": False}),
    ]


def test_check_retry_is_the_wait_for_the_count_or_tau_for_the_lease() -> None:
    out, *_ = _check([2])
    assert out == (KEY, "requests", 20, 40.0, 2.0)
    out, *_ = _check([0, 2])
    assert out == (KEY, "tokens", 6000, 1250.0, 2.0)
    out, *_ = _check([0, 1])
    assert out == (KEY, "tokens", 6000, 1250.0, wait_until_fits(1000.0, 500.0, 0.25, 60.0, 3000.0, 300))
    assert out[4] not in (2.0, math.inf)


@pytest.mark.parametrize(
    ("verdict", "own_level", "uc", "peak", "admitted"),
    [
        (2, 2, -1, 3, True),  # freed one within τ, peak 3: refilling to 3 is allowed
        (2, 2, -1, 0, True),  # the level before the change (2 + 1) bounds the refill too
        (2, 2, 0, 2, False),  # nothing freed: 3 > 2
        (1, 2, -1, 3, False),  # the mesh-wide count is full: no refill
        (0, 0, 0, 0, True),
    ],
)
def test_a_node_may_refill_concurrency_slots_it_freed_itself(
    verdict: int, own_level: int, uc: int, peak: int, admitted: bool
) -> None:
    out, *_ = _check([0, 0, verdict], own_level=own_level, uc=uc, peak=peak)
    assert out == (None if admitted else (KEY, "concurrency", 8, 3.0, 2.0))


def test_each_grant_counts_in_its_own_quota() -> None:
    lim = RateLimiter("a", 1)
    rules = [(KEY, Limits(rpm=10))]
    remaining = []
    for _ in range(3):
        g = lim.acquire(100.0, rules, 5)
        assert isinstance(g, Grant)
        remaining.append(g.quota().remaining_requests)
    assert remaining == [9, 8, 7]


def test_a_denial_marks_its_key_for_gossip() -> None:
    lim = RateLimiter("a", 1)
    rules = [(KEY, Limits(rpm=1))]
    assert isinstance(lim.acquire(100.0, rules, 5), Grant)
    lim._dirty.clear()
    assert isinstance(lim.acquire(100.0, rules, 5), Denial)
    assert list(lim._dirty) == [KEY]  # the attempt counts as demand: it is gossiped


def test_a_collection_round_starts_at_its_due_time_exactly() -> None:
    lim = RateLimiter("a", 1, LimiterConfig(window=10.0, gc_interval=100.0))
    lim.gc(0.0)  # the next round is due at 100.0
    g = lim.acquire(1.0, [(("old", ""), Limits(rpm=10))], 1)
    assert isinstance(g, Grant)
    lim.settle(1.0, g, None)
    assert lim.key_count() == 1
    lim.acquire(100.0, [(KEY, Limits(rpm=10))], 1)  # due now: the old key (window 0, settled) goes
    assert lim.key_count() == 1


def test_unseen_increments_age_out_after_tau() -> None:
    lim = RateLimiter("a", 1)  # τ = 1 s in 8 slots of 0.125 s
    seen: list[list[int]] = []
    orig = lim._check

    def spy(*args: Any) -> Any:
        seen.append(list(args[4]))
        return orig(*args)

    lim._check = spy  # type: ignore[method-assign,assignment]
    rules = [(KEY, Limits(rpm=100))]
    for t in (100.0, 100.1, 102.0):
        assert isinstance(lim.acquire(t, rules, 5), Grant)
    assert [u[1] for u in seen] == [0, 1, 0]  # own admissions in the last τ: none, one, none again


# ---- the stop matcher: its public answers after a match, a flush, a finish ------------------------------


def test_no_stop_token_is_index_minus_one() -> None:
    assert StopMatcher(stop_token_ids=[9]).stop_token_index([1, 2, 3]) == -1
    assert StopMatcher().stop_token_index([1, 2, 3]) == -1
    assert StopMatcher(eos_token_ids=[2]).stop_token_index([1, 2, 2]) == 1


def test_nothing_is_held_once_a_stop_string_matched() -> None:
    m = StopMatcher(["abc"])
    assert m.feed("xab") == StopResult("x")
    assert m.held == "ab"
    assert m.feed("cd") == StopResult("", True, "abc")
    assert m.held == ""
    assert m.flush() == ""


def test_a_flush_forgets_the_partial_match() -> None:
    m = StopMatcher(["abc"])
    assert m.feed("ab") == StopResult("")
    assert m.flush() == "ab"
    assert m.held == ""
    assert m.feed("c") == StopResult("c")  # "ab" was released: "c" does not complete "abc"
    assert m.feed("a") == StopResult("")  # a new partial match from scratch
    assert m.held == "a"


class _Chars:
    """A detokenizer: id n is chr(n)."""

    def step(self, ids: Any) -> str:
        return "".join(map(chr, ids))

    def finish(self) -> str:
        return ""


def test_a_finished_decoder_answers_finished_with_what_matched() -> None:
    d = StoppingDecoder(_Chars(), StopMatcher(stop_token_ids=[0]))
    assert d.feed([ord("h"), ord("i"), 0, ord("x")]) == StopResult("hi", True, 0)
    assert d.feed([ord("y")]) == StopResult("", True, 0)
    assert d.finish() == StopResult("", True, 0)
    s = StoppingDecoder(_Chars(), StopMatcher(["yz"]))
    assert s.feed([ord("x"), ord("y")]) == StopResult("x")
    assert s.feed([ord("z"), ord("w")]) == StopResult("", True, "yz")
    assert s.feed([ord("q")]) == StopResult("", True, "yz")


def _first_stop(stops: list[str], text: str) -> tuple[str, str] | None:
    """The reference rule: the shortest prefix of the text that ends with a stop string (ties: the longest
    one); the text before it and the stop string."""
    for e in range(1, len(text) + 1):
        hits = [s for s in stops if text[:e].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: e - len(s)], s
    return None


def _held(stops: list[str], text: str) -> str:
    """The longest suffix of the text that is a proper prefix of a stop string."""
    return next((text[i:] for i in range(len(text)) if any(s.startswith(text[i:]) for s in stops)), "")


def test_every_stop_string_and_text_over_two_letters_matches_like_the_reference() -> None:
    """Exhaustive over {a, b}: stop strings of 1-4 letters, texts of 0-7, fed at once and letter by
    letter: the cut, the stop string, and the text held back (built afresh: the spec cache is cleared,
    so the KMP tables are computed here)."""
    stop_mod._cached_spec.cache_clear()
    words = ["".join(p) for n in range(0, 8) for p in itertools.product("ab", repeat=n)]
    for stop in (w for w in words if 1 <= len(w) <= 4):
        for text in words:
            want = _first_stop([stop], text)
            for chunks in ([text], list(text)):
                m = StopMatcher([stop])
                out = "".join(m.feed(c).visible for c in chunks)
                if want is None:
                    held = _held([stop], text)
                    assert (out, m.held, m.finished) == (text[: len(text) - len(held)], held, False), (
                        stop,
                        text,
                    )
                else:
                    assert (out, m.matched, m.held) == (want[0], stop, ""), (stop, text)


def test_small_specs_are_cached_and_large_ones_built_each_time() -> None:
    """The spec cache holds only configurations of at most 256 stop characters and 256 ids (its bound in
    bytes); larger ones work the same, built per matcher."""
    cache = stop_mod._cached_spec
    cache.cache_clear()
    StopMatcher(["x" * 256])
    assert cache.cache_info().currsize == 1
    StopMatcher(["y" * 128, "z" * 129])  # 257 characters
    StopMatcher(["w" * 300])
    StopMatcher(stop_token_ids=range(257))  # 257 ids
    StopMatcher(["v"], stop_token_ids=range(300))
    assert cache.cache_info().currsize == 1
    StopMatcher(["v"], stop_token_ids=range(200), eos_token_ids=range(200, 300))  # 300 ids
    assert cache.cache_info().currsize == 1
    StopMatcher(stop_token_ids=range(256))  # 256 ids
    StopMatcher(["v"], stop_token_ids=range(200), eos_token_ids=range(200, 256))  # 256 ids and a stop
    StopMatcher(stop_token_ids=[5])  # no stop strings
    assert cache.cache_info().currsize == 4
    big = ["x" * 300, "END"]
    m = StopMatcher(big, stop_token_ids=range(1000, 1300), eos_token_ids=[7])
    assert m.feed("abEN") == StopResult("ab")
    assert m.feed("Dxx") == StopResult("", True, "END")
    m = StopMatcher(big, stop_token_ids=range(1000, 1300), eos_token_ids=[7])
    assert m.feed("a", [1, 7]) == StopResult("a", True, 7)
    m = StopMatcher(big, stop_token_ids=range(1000, 1300), eos_token_ids=[7])
    assert m.feed("a", [1100]) == StopResult("a", True, 1100)
    assert cache.cache_info().currsize == 4


def test_a_fresh_matcher_is_unfinished_with_nothing_matched() -> None:
    m = StopMatcher(["x"])
    assert m.finished is False and m.matched is None and m.held == ""


def test_a_stop_token_releases_the_held_text_with_the_new_text() -> None:
    m = StopMatcher(["abc"], stop_token_ids=[0])
    assert m.feed("xab", [5, 0]) == StopResult("xab", True, 0)  # "ab" can no longer become "abc"
    assert m.held == ""
    m = StopMatcher(["abc"], stop_token_ids=[0])
    assert m.feed("zab", [5]) == StopResult("z")
    assert m.feed("q", [0]) == StopResult("abq", True, 0)
    assert m.held == "" and m.flush() == ""


@pytest.mark.parametrize("stop", ["aabaaaa", "abaabab", "aabaab"])
def test_longer_self_overlapping_stop_strings_match_like_the_reference(stop: str) -> None:
    """Stop strings whose KMP fallback goes back more than one border (``aabaaaa`` in ``aabaaabaaaa``):
    every text of 7-11 letters over {a, b}, fed at once, spec built afresh."""
    stop_mod._cached_spec.cache_clear()
    for n in range(7, 12):
        for text in map("".join, itertools.product("ab", repeat=n)):
            m = StopMatcher([stop])
            out = m.feed(text).visible
            want = _first_stop([stop], text)
            if want is None:
                assert (out + m.held, m.finished) == (text, False), text
            else:
                assert (out, m.matched) == (want[0], stop), text


@pytest.mark.parametrize("stops", [["ab", "b"], ["b", "ab"]])
def test_of_two_stop_strings_ending_together_the_longer_wins_whatever_the_order(stops: list[str]) -> None:
    m = StopMatcher(stops)
    assert m.feed("xa") == StopResult("x")
    assert m.feed("by") == StopResult("", True, "ab")
    m = StopMatcher(stops, include_stop_str_in_output=True)
    assert m.feed("xaby") == StopResult("xab", True, "ab")


def test_with_tau_from_the_ages_the_leases_remainder_is_admitted_with_that_probability() -> None:
    """With ``propagation_max`` on (the default), a lease whose budget is u + a fraction of the cost
    admits with probability (budget - u) / cost (the draw ``unit_hash(node, version)``), rates only; off,
    never. Requests, share 0.5, limit 10, 6 used, u 2: budget 0.5 x (10 - 6 + 2) = 3, cost 1.5: the
    remainder 1 of 1.5."""
    on, off = _pair(propagation_max=15.0), _pair()
    v = cast(Any, _View(_DEMAND))
    slot = next(s for s, d in zip(range(100), _designated_slots(0, range(100)), strict=True) if not d)
    vers = range(200)
    want = [0 if unit_hash("a", ver) < 1.0 / 1.5 else 2 for ver in vers]
    assert 0 in want and 2 in want
    got, got_off, got_conc = [], [], []
    for ver in vers:
        on._ver = off._ver = ver
        got.append(on._fits(KEY, slot, 6.0, 2.0, 10.0, 1.5, v, 0))
        got_off.append(off._fits(KEY, slot, 6.0, 2.0, 10.0, 1.5, v, 0))
        got_conc.append(on._fits(KEY, slot, 6.0, 2.0, 10.0, 1.5, v, 0, rate=False))
    assert got == want and got_off == [2] * len(vers) and got_conc == [2] * len(vers)


def test_with_fewer_own_arrivals_than_one_within_tau_the_remainder_is_over_those_expected() -> None:
    """First-hand shards (no ``relay``): the lease's budget is per τ, so with n < 1 own arrivals expected
    within τ (own attempts in the sliding window ÷ window x (span + 0.5) slots of 0.125 s) each arrival's
    chance is the remainder's over n: (1 / 1.5) / n, and 1 once n is at most the remainder's fraction. A
    relaying mesh keeps the plain fraction."""
    on, relay = _pair(propagation_max=15.0), _pair(propagation_max=15.0, relay=True)
    slot = next(s for s, d in zip(range(100), _designated_slots(0, range(100)), strict=True) if not d)
    vers = range(400)
    tau = (on._span + 0.5) * on._slot_len  # 1.0625 s: the span's 8 slots and half the current one
    for areq, p in ((48.0, (1.0 / 1.5) / (48.0 / 60.0 * tau)), (30.0, 1.0), (120.0, 1.0 / 1.5)):
        v = cast(Any, _View(_DEMAND, own_areq=areq))
        want = [0 if unit_hash("a", ver) < p else 2 for ver in vers]
        got, got_relay = [], []
        for ver in vers:
            on._ver = relay._ver = ver
            got.append(on._fits(KEY, slot, 6.0, 2.0, 10.0, 1.5, v, 0))
            got_relay.append(relay._fits(KEY, slot, 6.0, 2.0, 10.0, 1.5, v, 0))
        assert got == want, areq
        assert got_relay == [0 if unit_hash("a", ver) < 1.0 / 1.5 else 2 for ver in vers], areq
    assert 0.7 < (1.0 / 1.5) / (48.0 / 60.0 * tau) < 0.8  # (the first case is a real probability)
