"""Routing policies, tested by value over snapshots (workers with loads, requests)."""

from __future__ import annotations

import pytest

from shepherd.policies.base import Policy, RouteRequest, WorkerView, least_loaded, worker_load
from shepherd.policies.bucket import Bucket, BucketConfig
from shepherd.policies.hashing import ConsistentHashing, HashRing, PrefixHash, PrefixHashConfig, stable_hash64
from shepherd.policies.load import LeastLoad, PowerOfTwo
from shepherd.policies.manual import Manual
from shepherd.policies.simple import POLICY_NAMES, RandomPolicy, RoundRobin, make_policy


def w(wid: str, running: int = 0, waiting: int = 0, in_flight: int = 0, usage: float = 0.0) -> WorkerView:
    return WorkerView(
        id=wid,
        url=f"grpc://{wid}:1",
        in_flight=in_flight,
        running=running,
        waiting=waiting,
        token_usage=usage,
    )


def req(ids: list[int] | None = None, key: str | None = None, model: str = "m") -> RouteRequest:
    return RouteRequest(model=model, input_ids=ids or [], routing_key=key)


def pid(p: Policy, ws: list[WorkerView], r: RouteRequest) -> str:
    chosen = p.pick(ws, r)
    assert chosen is not None
    return chosen.id


# -- load -------------------------------------------------------------------------------------------


def test_worker_load_is_engine_count_or_own_in_flight_whichever_is_higher() -> None:
    assert worker_load(w("a", running=3, waiting=2)) == 5
    assert worker_load(w("a", running=3, waiting=2, in_flight=4)) == 5
    assert worker_load(w("a", running=1, in_flight=7)) == 7
    assert worker_load(w("a")) == 0


def test_least_loaded_ties_by_token_usage_then_id() -> None:
    assert least_loaded([w("b", 2), w("a", 3), w("c", 1, usage=0.9)]).id == "c"
    assert least_loaded([w("b", 1, usage=0.2), w("c", 1, usage=0.1)]).id == "c"
    assert least_loaded([w("b"), w("a"), w("c")]).id == "a"


def test_least_load() -> None:
    p = LeastLoad()
    assert p.pick([], req()) is None
    assert p.pick([w("only", 99)], req()) == w("only", 99)
    assert pid(p, [w("a", 5), w("b", 2, in_flight=3), w("c", 4)], req()) == "b"
    assert pid(p, [w("a", in_flight=9), w("b", running=4)], req()) == "b"


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    p = PowerOfTwo(seed=1)
    assert p.pick([], req()) is None
    assert pid(p, [w("only", 9)], req()) == "only"
    two = [w("busy", 10), w("idle", 0)]
    assert {pid(p, two, req()) for _ in range(20)} == {"idle"}
    # with three workers the busiest can never win (it loses to whichever is sampled with it)
    three = [w("a", 1), w("b", 2), w("c", 30)]
    picks = [pid(p, three, req()) for _ in range(60)]
    assert set(picks) == {"a", "b"}
    # all equal: the lower id of the pair
    eq = [w("a"), w("b")]
    assert {pid(p, eq, req()) for _ in range(10)} == {"a"}


def test_power_of_two_is_reproducible_with_a_seed() -> None:
    ws = [w(str(i), i) for i in range(8)]
    a = [PowerOfTwo(seed=5).pick(ws, req()) for _ in range(1)]
    b = [PowerOfTwo(seed=5).pick(ws, req()) for _ in range(1)]
    assert a == b


def test_round_robin_and_random() -> None:
    rr = RoundRobin()
    ws = [w("b"), w("a"), w("c")]
    assert [pid(rr, ws, req()) for _ in range(4)] == ["a", "b", "c", "a"]
    assert pid(rr, [w("a"), w("c")], req()) == "a"  # worker b gone: cursor 4 over 2 workers
    rnd = RandomPolicy(seed=3)
    assert rnd.pick([], req()) is None
    assert {pid(rnd, ws, req()) for _ in range(50)} == {"a", "b", "c"}


# -- consistent hashing -----------------------------------------------------------------------------


def test_stable_hash64_is_pinned() -> None:
    assert stable_hash64("user-1") == 11145382709976293768


def test_hash_ring_lookup() -> None:
    ring = HashRing(["a", "b", "c"], vnodes=50)
    assert len(ring.points) == 150
    owners = {ring.lookup(stable_hash64(f"k{i}")) for i in range(200)}
    assert owners == {"a", "b", "c"}
    assert HashRing([]).lookup(5) is None
    assert ring.lookup(ring.points[3]) == ring.owners[3]
    assert ring.lookup(ring.points[3] + 1) == ring.owners[4]
    assert ring.lookup(ring.points[-1] + 1) == ring.owners[0]  # past the last point: wraps around


def test_consistent_hashing_is_sticky_and_moves_only_the_lost_workers_keys() -> None:
    p = ConsistentHashing()
    ws = [w(x) for x in "abcd"]
    keys = [f"user-{i}" for i in range(400)]
    before = {k: pid(p, ws, req(key=k)) for k in keys}
    assert {k: pid(p, ws, req(key=k)) for k in keys} == before
    assert set(before.values()) == set("abcd")
    after = {k: pid(p, ws[:3], req(key=k)) for k in keys}  # "d" disappears
    moved = {k for k in keys if after[k] != before[k]}
    assert moved == {k for k in keys if before[k] == "d"}
    # and a new worker takes keys only for itself
    grown = {k: pid(p, [*ws, w("e")], req(key=k)) for k in keys}
    assert all(grown[k] in (before[k], "e") for k in keys)
    assert 0 < sum(grown[k] == "e" for k in keys) < 200


def test_consistent_hashing_without_a_key_and_with_one_worker() -> None:
    p = ConsistentHashing()
    assert p.pick([], req(key="x")) is None
    assert pid(p, [w("a", 5), w("b", 1)], req()) == "b"
    assert pid(p, [w("solo", 50)], req(key="x")) == "solo"


# -- prefix hash ------------------------------------------------------------------------------------


def test_prefix_hash_same_head_same_worker() -> None:
    p = PrefixHash(PrefixHashConfig(prefix_tokens=8))
    ws = [w(x) for x in "abcd"]
    head = list(range(100, 108))
    first = p.pick(ws, req([*head, 1, 2, 3]))
    assert first is not None
    assert all(p.pick(ws, req(head + list(range(i, i + 20)))) == first for i in range(10))
    chosen = {pid(p, ws, req(list(range(i, i + 8)))) for i in range(0, 400, 8)}
    assert chosen == set("abcd")


def test_prefix_hash_overloaded_choice_goes_to_least_loaded() -> None:
    p = PrefixHash(PrefixHashConfig(prefix_tokens=4))
    ids = [1, 2, 3, 4]
    ws = [w(x) for x in "abc"]
    home = pid(p, ws, req(ids))
    first_other, second_other = (x for x in "abc" if x != home)
    load = {home: 30, first_other: 2, second_other: 1}
    assert pid(p, [w(x, load[x]) for x in "abc"], req(ids)) == second_other
    # within the limit ((total + 1) / n * 1.25) the home stays
    mild = [w(x, 2 if x == home else 1) for x in "abc"]
    assert pid(p, mild, req(ids)) == home


def test_prefix_hash_edge_cases() -> None:
    p = PrefixHash()
    assert p.pick([], req([1])) is None
    assert pid(p, [w("a", 3), w("b", 0)], req()) == "b"  # no tokens: least loaded
    assert pid(p, [w("solo", 100)], req([1, 2])) == "solo"


# -- manual -----------------------------------------------------------------------------------------


def test_manual_sticky_with_failover_and_return() -> None:
    p = Manual(seed=0)
    ws = [w(x) for x in "abc"]
    home = pid(p, ws, req(key="s1"))
    assert all(pid(p, ws, req(key="s1")) == home for _ in range(10))
    rest = [v for v in ws if v.id != home]
    second = pid(p, rest, req(key="s1"))
    assert second != home
    assert p.candidates("s1") == [home, second]
    assert all(pid(p, rest, req(key="s1")) == second for _ in range(5))
    assert pid(p, ws, req(key="s1")) == home  # home is back
    # both candidates gone: a third worker, and only the last 2 are remembered
    only = [v for v in ws if v.id not in (home, second)]
    third = pid(p, only, req(key="s1"))
    assert p.candidates("s1") == [second, third]


def test_manual_assignment_modes_and_bounds() -> None:
    p = Manual(assignment="min_load", max_keys=2)
    ws = [w("a", 5), w("b", 1), w("c", 3)]
    assert pid(p, ws, req(key="k1")) == "b"
    assert pid(p, ws, req()) == "b"  # no key: assignment, nothing remembered
    assert pid(p, [w("a", 0), w("b", 9)], req(key="k1")) == "b"  # sticky despite load
    p.pick(ws, req(key="k2"))
    p.pick(ws, req(key="k3"))  # k1 is the least recently used: forgotten
    assert p.candidates("k1") == []
    assert p.candidates("k3") == ["b"]
    assert p.pick([], req(key="k2")) is None
    assert pid(Manual(), [w("solo")], req(key="z")) == "solo"


def test_manual_random_assignment_spreads_keys() -> None:
    p = Manual(seed=1)
    ws = [w(x) for x in "abc"]
    assert {pid(p, ws, req(key=f"u{i}")) for i in range(60)} == {"a", "b", "c"}


# -- bucket -----------------------------------------------------------------------------------------


def test_bucket_by_prompt_length() -> None:
    p = Bucket(BucketConfig(boundaries=(10, 100)))
    assert [p.bucket_of(n) for n in (0, 9, 10, 99, 100, 5000)] == [0, 0, 1, 1, 2, 2]
    ws = [w(x) for x in "fedcba"]  # sorted by id: a b | c d | e f
    assert pid(p, ws, req([0] * 5)) == "a"
    assert pid(p, ws, req([0] * 50)) == "c"
    assert pid(p, ws, req([0] * 500)) == "e"
    busy = [w("a", 9), w("b", 1), *ws[:4]]
    assert pid(p, busy, req([0] * 5)) == "b"  # least loaded within the bucket's group


def test_bucket_with_fewer_workers_than_buckets_and_a_worker_gone() -> None:
    p = Bucket(BucketConfig(boundaries=(10, 100)))
    two = [w("a"), w("b")]
    assert [pid(p, two, req([0] * n)) for n in (1, 50, 500)] == ["a", "a", "b"]
    assert pid(p, [w("solo", 7)], req([0] * 500)) == "solo"
    assert p.pick([], req()) is None
    with pytest.raises(ValueError):
        BucketConfig(boundaries=(100, 10))


# -- factory ----------------------------------------------------------------------------------------


def test_make_policy_knows_every_name() -> None:
    for name in POLICY_NAMES:
        p = make_policy(name)
        assert p.name == name
        assert pid(p, [w("a")], req([1] * 40, key="k")) == "a"
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
