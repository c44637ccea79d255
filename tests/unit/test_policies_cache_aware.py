"""cache_aware: the pure decision (by value) and the policy with its prefix index and a fake clock."""

from __future__ import annotations

from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.cache_aware import CacheAware, CacheAwareConfig, choose

CFG = CacheAwareConfig()


def w(wid: str, load: int = 0, usage: float = 0.0) -> WorkerView:
    return WorkerView(wid, f"grpc://{wid}:1", running=load, token_usage=usage)


def test_defaults_are_the_ones_users_know() -> None:
    assert (CFG.cache_threshold, CFG.balance_abs_threshold, CFG.balance_rel_threshold) == (0.3, 64, 1.5)


def test_hit_goes_to_the_holder() -> None:
    d = choose([w("a", 3), w("b", 0)], {"a": 64}, 100, CFG)
    assert (d.worker.id, d.reason, d.matched_tokens) == ("a", "hit", 64)


def test_at_or_below_threshold_goes_to_the_least_loaded() -> None:
    ws = [w("a", 3), w("b", 1), w("c", 2)]
    assert choose(ws, {"a": 30}, 100, CFG).worker.id == "b"  # 0.3 is not above 0.3
    assert choose(ws, {"a": 30}, 100, CFG).reason == "miss"
    assert choose(ws, {"a": 31}, 100, CFG).worker.id == "a"
    assert choose(ws, {}, 100, CFG).worker.id == "b"
    assert choose(ws, {}, 0, CFG).worker.id == "b"  # empty prompt


def test_least_loaded_holder_among_equal_matches() -> None:
    ws = [w("a", 5), w("b", 2), w("c", 0)]
    d = choose(ws, {"a": 96, "b": 96, "c": 16}, 100, CFG)
    assert (d.worker.id, d.reason) == ("b", "hit")


def test_imbalance_needs_both_thresholds() -> None:
    # max - min > 64 and max > 1.5 * min: imbalanced, least loaded wins over the cache
    d = choose([w("a", 100), w("b", 30)], {"a": 100}, 100, CFG)
    assert (d.worker.id, d.reason) == ("b", "imbalanced")
    # diff 66 > 64 but 200 < 1.5 * 134: balanced (and the holder is not hot either: same ratio)
    assert choose([w("a", 200), w("b", 134)], {"a": 100}, 100, CFG).worker.id == "a"
    # ratio large but diff 60 <= 64: balanced
    assert choose([w("a", 60), w("b", 0)], {"a": 100}, 100, CFG).reason != "imbalanced"


def test_hot_holder_spills_to_the_least_loaded() -> None:
    # not imbalanced by the system thresholds, but the holder is 17 above the least and 2x it
    d = choose([w("a", 34), w("b", 17), w("c", 20)], {"a": 100}, 100, CFG)
    assert (d.worker.id, d.reason) == ("b", "spill")
    # a warm holder keeps its requests
    assert choose([w("a", 30), w("b", 17)], {"a": 100}, 100, CFG).reason == "hit"


def test_one_worker_and_all_equal() -> None:
    assert choose([w("solo", 500)], {}, 10, CFG).worker.id == "solo"
    assert choose([w("solo", 500)], {"solo": 10}, 10, CFG).reason == "hit"
    assert choose([w("b"), w("a"), w("c")], {}, 100, CFG).worker.id == "a"  # ties: id


def test_matches_on_workers_that_are_not_routable_are_ignored() -> None:
    d = choose([w("b", 1), w("c", 0)], {"a": 100, "b": 16}, 100, CFG)
    assert (d.worker.id, d.reason, d.matched_tokens) == ("c", "miss", 16)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def r(ids: list[int], model: str = "m") -> RouteRequest:
    return RouteRequest(model=model, input_ids=ids)


def test_policy_keeps_conversations_on_their_worker() -> None:
    clock = Clock()
    p = CacheAware(clock=clock)
    ws = [w("a"), w("b"), w("c")]
    conv1 = list(range(100))
    conv2 = list(range(5000, 5100))
    first = p.pick(ws, r(conv1))
    assert first is not None and first.id == "a"  # nothing cached: least loaded, id order
    # a is now busier: a new conversation goes elsewhere, a follow-up of conv1 stays on a
    ws = [w("a", 1), w("b"), w("c")]
    second = p.pick(ws, r(conv2))
    assert second is not None and second.id == "b"
    follow = p.pick(ws, r([*conv1, *range(9000, 9050)]))
    assert follow is not None and follow.id == "a"
    assert p.last is not None and (p.last.reason, p.last.matched_tokens) == ("hit", 96)
    ix = p.index("m")
    assert ix.match(conv1) == {"a": 96}
    assert ix.last_access(ix.hashes(conv1)[0], "a") == clock.t


def test_policy_when_the_holder_disappears_and_per_model_indexes() -> None:
    p = CacheAware(clock=Clock())
    conv = list(range(200))
    assert p.pick([w("a"), w("b")], r(conv)).id == "a"  # type: ignore[union-attr]
    # a is gone: b takes it, and then holds the prefix too
    assert p.pick([w("b"), w("c", 0)], r(conv)).id == "b"  # type: ignore[union-attr]
    assert p.index("m").match(conv) == {"a": 192, "b": 192}
    # another model shares nothing
    assert p.pick([w("c"), w("b", 1)], r(conv, model="other")).id == "c"  # type: ignore[union-attr]
    assert p.pick([], r(conv)) is None


def test_policy_spill_makes_the_least_loaded_a_holder() -> None:
    p = CacheAware(clock=Clock())
    conv = list(range(64))
    assert p.pick([w("a"), w("b")], r(conv)).id == "a"  # type: ignore[union-attr]
    assert p.pick([w("a", 40), w("b", 10)], r(conv)).id == "b"  # type: ignore[union-attr]
    assert p.last is not None and p.last.reason == "spill"
    assert p.index("m").match(conv) == {"a": 64, "b": 64}
    # both hold it now: the less loaded holder wins
    assert p.pick([w("a", 12), w("b", 11)], r(conv)).id == "b"  # type: ignore[union-attr]
