"""RateLimiter behaviour with a fake clock: limits, settlement, membership, gossip, memory."""

from __future__ import annotations

import math

import pytest

from shepherd.mesh.ratelimit import GC_STEP, Denial, Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.ratelimit_keys import Key

A: Key = ("a", "")
B: Key = ("b", "")


def rules(key: Key = A, **kw: int) -> list[tuple[Key, Limits]]:
    return [(key, Limits(**kw))]


def grant(x: Grant | Denial) -> Grant:
    assert isinstance(x, Grant), x
    return x


def denial(x: Grant | Denial) -> Denial:
    assert isinstance(x, Denial), x
    return x


def fill(lim: RateLimiter, now: float, r: list[tuple[Key, Limits]], tokens: int = 10) -> int:
    n = 0
    while isinstance(lim.acquire(now, r, tokens), Grant):
        n += 1
        assert n < 10_000
    return n


def test_requests_per_minute_then_retry_after() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(rpm=10)
    assert fill(lim, 30.0, r) == 10
    d = denial(lim.acquire(30.0, r, 10))
    assert (d.key, d.metric, d.limit, d.requested) == (A, "requests", 10, 1)
    assert d.used == pytest.approx(10)
    # the sliding window: 10 in the current window carry into the next one and decay through it
    assert d.retry_after == pytest.approx(30.0 + 6.0)
    assert isinstance(lim.acquire(30.0 + d.retry_after - 0.5, r, 10), Denial)
    grant(lim.acquire(30.0 + d.retry_after + 0.01, r, 10))


def test_steady_rate_is_the_limit() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(rpm=60)
    admitted = [0] * 5
    for i in range(5 * 60 * 4):  # 4 requests a second: 4x the limit, for 5 windows
        t = i / 4
        if isinstance(lim.acquire(t, r, 1), Grant):
            admitted[int(t // 60)] += 1
    assert admitted[0] == 60
    assert all(58 <= n <= 60 for n in admitted[1:]), admitted


def test_tokens_are_reserved_then_settled() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(tpm=1000)
    g1 = grant(lim.acquire(1.0, r, 600))
    d = denial(lim.acquire(1.0, r, 600))
    assert (d.metric, d.requested) == ("tokens", 600)
    lim.settle(2.0, g1, 100)  # used 100 of the 600 reserved: 500 come back
    g2 = grant(lim.acquire(2.0, r, 600))
    assert g2.quota().remaining_tokens == 1000 - 700
    lim.settle(3.0, g2, 900)  # used more than reserved: the extra counts
    assert lim.quota(3.0, r).remaining_tokens == 1000 - 1000
    lim.settle(3.0, g2, 0)  # settling twice changes nothing
    assert lim.quota(3.0, r).remaining_tokens == 0


def test_refund_into_the_previous_window() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(tpm=1000)
    g = grant(lim.acquire(59.0, r, 1000))
    lim.settle(61.0, g, 0)  # the reservation was in window 0, refunded there
    q = lim.quota(61.0, r)
    assert q.remaining_tokens == 1000


def test_request_larger_than_the_limit_never_fits() -> None:
    lim = RateLimiter("n0", 1)
    d = denial(lim.acquire(0.0, rules(tpm=100), 101))
    assert math.isinf(d.retry_after)


def test_concurrency_and_release() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(max_concurrent=2)
    g1, g2 = grant(lim.acquire(0.0, r, 1)), grant(lim.acquire(0.0, r, 1))
    d = denial(lim.acquire(0.0, r, 1))
    assert d.metric == "concurrency" and d.retry_after > 0
    lim.settle(5.0, g1, None)
    grant(lim.acquire(5.0, r, 1))
    lim.settle(5.0, g2, None)
    lim.settle(5.0, g2, None)  # idempotent: one slot back, not two
    grant(lim.acquire(5.0, r, 1))
    denial(lim.acquire(5.0, r, 1))


def test_every_rule_must_admit_and_tenants_are_separate() -> None:
    lim = RateLimiter("n0", 1)
    both = [(("a", ""), Limits(rpm=5)), (("a", "m"), Limits(rpm=2))]
    other_model = [(("a", ""), Limits(rpm=5)), (("a", "n"), Limits(rpm=2))]
    assert fill(lim, 0.0, both) == 2
    assert denial(lim.acquire(0.0, both, 1)).key == ("a", "m")
    assert fill(lim, 0.0, other_model) == 2  # the tenant's all-models count has 3 left, model n 2
    assert denial(lim.acquire(0.0, other_model, 1)).key == ("a", "n")
    assert fill(lim, 0.0, rules(("a", ""), rpm=5)) == 1
    assert fill(lim, 0.0, rules(B, rpm=5)) == 5  # another tenant: its own count


def test_quota_reports_the_tightest_rule() -> None:
    lim = RateLimiter("n0", 1)
    r = [(("a", ""), Limits(rpm=100, tpm=10_000)), (("a", "m"), Limits(rpm=10))]
    g = grant(lim.acquire(0.0, r, 500))
    q = g.quota()
    assert (q.limit_requests, q.remaining_requests) == (10, 9)
    assert (q.limit_tokens, q.remaining_tokens) == (10_000, 9_500)
    assert q.reset_requests == pytest.approx(6.0)  # 1 of 10 per 60 s drains in 6 s
    assert q.reset_tokens == pytest.approx(3.0)


def test_partitioned_side_admits_its_share() -> None:
    lim = RateLimiter("n0", 1)
    lim.set_membership(["n0"], 3)  # two of three members unreachable
    assert (lim.reachable, lim.cluster_size) == (1, 3)
    assert fill(lim, 0.0, rules(rpm=30)) == 10
    lim.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "suspect"), ("n3", "left")], 0.0)
    assert (lim.reachable, lim.cluster_size) == (2, 3)


def test_a_reaped_member_keeps_counting_for_the_grace() -> None:
    """SWIM drops a dead member from its list after ~30 s; a partition lasts longer than that, and a
    side that stopped counting the other would admit the whole limit (the chaos scenario measured
    1.45x). An unreachable member that did not leave counts in N for ``unreachable_grace``."""
    lim = RateLimiter("n0", 1, LimiterConfig(unreachable_grace=300.0))
    lim.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "alive")], 0.0)
    assert (lim.reachable, lim.cluster_size) == (3, 3)
    lim.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "dead")], 10.0)
    assert (lim.reachable, lim.cluster_size) == (2, 3)
    lim.update_members([("n0", "alive"), ("n1", "alive")], 45.0)  # reaped
    assert (lim.reachable, lim.cluster_size) == (2, 3)
    assert fill(lim, 45.0, rules(rpm=30)) == 10  # half (its lease) of its side's 2/3 of the limit
    lim.update_members([("n0", "alive"), ("n1", "alive")], 310.5)  # 300 s after it was last seen
    assert (lim.reachable, lim.cluster_size) == (2, 2)
    # back before the grace ends: counted again at once, as alive
    lim.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "dead")], 320.0)
    lim.update_members([("n0", "alive"), ("n1", "alive"), ("n2", "alive")], 330.0)
    assert (lim.reachable, lim.cluster_size) == (3, 3)


def test_a_member_that_leaves_stops_counting_at_once() -> None:
    lim = RateLimiter("n0", 1)
    lim.update_members([("n0", "alive"), ("n1", "suspect")], 0.0)
    assert lim.cluster_size == 2
    lim.update_members([("n0", "alive"), ("n1", "left")], 1.0)
    assert lim.cluster_size == 1
    lim.update_members([("n0", "alive")], 40.0)  # the left member reaped
    assert lim.cluster_size == 1


def test_what_a_member_that_left_admitted_still_counts() -> None:
    """A graceful leave (a rolling restart) takes the node out of N at once, not its admissions of the
    window: the others counting without them would admit them again (3 nodes at rpm 30, the leaving one
    had 10: 40 in the window)."""
    r = rules(rpm=30, max_concurrent=30)
    a, c = RateLimiter("n0", 1), RateLimiter("n2", 1)
    c.set_membership(["n2"], 1)
    assert fill(c, 5.0, r, 1) == 30
    a.update_members([("n0", "alive"), ("n2", "alive")], 5.0)
    gossip(c, a)
    a.update_members([("n0", "alive"), ("n2", "left")], 6.0)
    assert a.cluster_size == 1
    q = a.quota(6.0, r)
    assert q.remaining_requests == 0 and isinstance(a.acquire(6.0, r, 1), Denial)
    a.update_members([("n0", "alive")], 40.0)  # reaped from the list: still counted for its window
    assert isinstance(a.acquire(40.0, r, 1), Denial)
    # two windows later its counts are gone, as any window's are
    assert fill(a, 200.0, r, 1) == 30


def gossip(src: RateLimiter, *dsts: RateLimiter) -> None:
    while (d := src.take_delta()) is not None:
        for dst in dsts:
            dst.apply_delta(d)


def pair() -> tuple[RateLimiter, RateLimiter]:
    a, b = RateLimiter("n0", 1), RateLimiter("n1", 1)
    for n in (a, b):
        n.set_membership(["n0", "n1"], 2)
    return a, b


def test_counts_are_mesh_wide_after_gossip() -> None:
    a, b = pair()
    r = rules(rpm=100)
    for _ in range(30):
        grant(a.acquire(0.0, r, 1))
    assert b.quota(0.0, r).remaining_requests == 100
    gossip(a, b)
    assert b.quota(0.0, r).remaining_requests == 70
    assert a.quota(0.0, r).remaining_requests == 70


def test_lease_bounds_a_burst_between_gossip_rounds() -> None:
    a, b = pair()
    r = rules(rpm=100)
    na, nb = fill(a, 0.0, r), fill(b, 0.0, r)  # neither has heard from the other
    assert na + nb <= 100
    assert na >= 45 and nb >= 45
    naive = [RateLimiter(f"n{i}", 1, LimiterConfig(lease=False)) for i in range(2)]
    for n in naive:
        n.set_membership(["n0", "n1"], 2)
    assert sum(fill(n, 0.0, r) for n in naive) == 200  # what the lease prevents


def test_lease_frees_as_gossip_arrives() -> None:
    a, b = pair()
    r = rules(rpm=100)
    total = 0
    for k in range(10):  # rounds further apart than τ: what each admitted is seen by the other
        total += fill(a, 2.0 * k, r)
        gossip(a, b)
        total += fill(b, 2.0 * k + 0.1, r)
        gossip(b, a)
    assert total == 100


def test_dead_member_gauge_and_counts_are_dropped() -> None:
    a, b = pair()
    for _ in range(4):
        grant(b.acquire(0.0, rules(rpm=100, max_concurrent=10), 1))
    gossip(b, a)
    r = rules(rpm=100, max_concurrent=4)
    assert denial(a.acquire(5.0, r, 1)).used == 4  # b's 4 in flight count here
    assert a.quota(5.0, r).remaining_requests == 96
    a.on_member_dead("n1")
    assert a.reachable == 1 and a.cluster_size == 2
    # b's in-flight requests and counts no longer count, and a admits against half the limits
    assert a.quota(5.0, r).remaining_requests == 50
    assert fill(a, 5.0, r) == 2


def test_restarted_node_keeps_its_old_window_counts_not_its_gauge() -> None:
    a = RateLimiter("n0", 1)
    a.set_membership(["n0", "n1"], 2)
    old, new = RateLimiter("n1", 1), RateLimiter("n1", 2)
    r = rules(rpm=100, max_concurrent=100)
    for _ in range(8):
        grant(old.acquire(0.0, r, 1))
    gossip(old, a)
    grant(new.acquire(1.0, r, 1))
    gossip(new, a)
    q = a.quota(1.0, r)
    assert q.remaining_requests == 100 - 9  # both processes' admissions count
    conc = sum(e.inc - e.dec for (k, (node, gen)), e in a.entries().items() if gen == 2)
    assert conc == 1


def test_restarted_node_takes_its_old_shard_back_from_a_peer() -> None:
    # first-hand gossip takes a peer's own shards only; a restarted node's earlier process shard is held
    # by the peers alone: the push-pull reply (a diff by digest) must give it back, or the restarted node
    # admits again what its previous process admitted in the window while the peers still count it
    r = rules(rpm=30)
    old, b = RateLimiter("n0", 1), RateLimiter("n1", 1)
    b.set_membership(["n0", "n1"], 2)
    assert fill(old, 10.0, r, 1) == 30  # (alone then: no share)
    while (d := old.take_delta()) is not None:
        b.apply_delta_from(d, "n0")
    new = RateLimiter("n0", 2)
    new.set_membership(["n0", "n1"], 2)
    new.merge_snapshot_from(b.diff(new.digest()), "n1")
    assert new.quota(11.0, r).remaining_requests == 0
    assert isinstance(new.acquire(11.0, r, 1), Denial)
    # another node's shard relayed by a third party is still refused, and so is a newer generation's
    stranger = RateLimiter("n2", 1)
    grant(stranger.acquire(10.0, r, 1))
    newer = RateLimiter("n0", 3)
    grant(newer.acquire(10.0, r, 1))
    c = RateLimiter("n3", 1)
    c.apply_delta(stranger.snapshot() + newer.snapshot())
    dropped = new.foreign_dropped
    new.merge_snapshot_from(c.snapshot(), "n3")
    assert new.foreign_dropped == dropped + 2


def test_take_delta_is_bounded_and_digest_diff_repairs() -> None:
    a, b = pair()
    for i in range(50):
        grant(a.acquire(0.0, rules((f"tenant-{i:03d}", "model-x"), rpm=100), 1))
    sizes = []
    while (d := a.take_delta(max_bytes=900)) is not None:
        import msgpack  # type: ignore[import-untyped]

        sizes.append(len(msgpack.packb(d, use_bin_type=True)))
        if len(sizes) % 2:
            b.apply_delta(d)  # every other payload is lost
    assert len(sizes) > 2 and max(sizes) <= 900
    assert a.take_delta() is None
    missing = a.diff(b.digest())
    b.apply_delta(missing)
    assert b.entries() == a.entries()
    assert a.diff(b.digest()) == []


def test_own_shard_from_a_peer_is_ignored() -> None:
    a, b = pair()
    grant(a.acquire(0.0, rules(rpm=10), 1))
    gossip(a, b)
    grant(a.acquire(0.0, rules(rpm=10), 1))
    a.apply_delta(b.snapshot())  # b holds an older copy of a's shard
    assert a.quota(0.0, rules(rpm=10)).remaining_requests == 8


def test_idle_keys_are_collected_and_recreated_entries_win() -> None:
    a, b = pair()
    r = rules(rpm=10)
    g = grant(a.acquire(0.0, r, 1))
    a.settle(1.0, g, 1)
    gossip(a, b)
    for k in range(20):
        a.settle(1.0, grant(a.acquire(0.0, rules((f"t{k}", ""), rpm=10), 1)), 1)
    assert a.key_count() == 21
    a.gc(200.0)  # two windows later: nothing left that counts
    b.gc(200.0)
    assert a.key_count() == 0 and b.key_count() == 0
    grant(a.acquire(200.0, r, 1))
    gossip(a, b)
    assert b.quota(200.0, r).remaining_requests == 9


def test_in_flight_requests_survive_gc() -> None:
    lim = RateLimiter("n0", 1)
    r = rules(max_concurrent=1)
    g = grant(lim.acquire(0.0, r, 1))
    lim.gc(500.0)
    denial(lim.acquire(500.0, r, 1))
    lim.settle(501.0, g, None)
    grant(lim.acquire(501.0, r, 1))


def test_refill_of_own_freed_slot_under_a_small_share() -> None:
    nodes = [RateLimiter(f"n{i}", 1) for i in range(3)]
    for n in nodes:
        n.set_membership(["n0", "n1", "n2"], 3)
    r = rules(max_concurrent=3)
    gs = [grant(n.acquire(0.0, r, 1)) for n in nodes]
    for n in nodes:
        gossip(n, *[m for m in nodes if m is not n])
    for n in nodes:
        denial(n.acquire(5.0, r, 1))  # full
    nodes[0].settle(5.1, gs[0], None)
    grant(nodes[0].acquire(5.2, r, 1))  # its own slot, freed within τ
    denial(nodes[0].acquire(5.2, r, 1))


def test_collection_runs_in_steps_on_the_request_path() -> None:
    lim = RateLimiter("n0", 1)
    for k in range(100):
        lim.settle(0.5, grant(lim.acquire(0.0, rules((f"t{k}", ""), rpm=10), 1)), 1)
    busy = rules(("busy", ""), rpm=10**6)
    lim.acquire(200.0, busy, 1)  # starts a round: a bounded number of keys per admission
    assert 100 - GC_STEP <= lim.key_count() < 101
    for i in range(10):
        lim.acquire(200.0 + i / 100, busy, 1)
    assert lim.key_count() == 1
