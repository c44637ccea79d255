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
    # diff 66 > 64 but 200 < 1.5 * 134: not imbalanced; but the holder is 66 requests busier, which is
    # worth more than re-prefilling 100 tokens elsewhere (rule 3: the original would stay on a)
    assert choose([w("a", 200), w("b", 134)], {"a": 100}, 100, CFG).reason == "move"
    # ratio large but diff 60 <= 64: balanced
    assert choose([w("a", 60), w("b", 0)], {"a": 100}, 100, CFG).reason != "imbalanced"


def test_a_move_must_save_more_load_than_the_prefill_it_costs() -> None:
    # Shepherd's rule 3 (the original always keeps a hit on the holder, whatever its load): moving 512
    # tokens costs move_base + 512 / move_tokens_per_load = 3 + 2 = 5 requests of load
    assert (CFG.move_base, CFG.move_tokens_per_load) == (3.0, 256.0)
    assert choose([w("a", 5), w("b", 0)], {"a": 512}, 600, CFG).reason == "hit"  # a tie stays
    d = choose([w("a", 6), w("b", 0), w("c", 1)], {"a": 512}, 600, CFG)
    assert (d.worker.id, d.reason) == ("b", "move")
    # a worker holding part of it pays only for the part it lacks: 3 + 256 / 256 = 4
    assert choose([w("a", 4), w("b", 0)], {"a": 512, "b": 256}, 600, CFG).worker.id == "a"
    assert choose([w("a", 5), w("b", 0)], {"a": 512, "b": 256}, 600, CFG).worker.id == "b"
    # a long conversation is sticky: 4,096 tokens cost 3 + 16 = 19 requests
    assert choose([w("a", 19), w("b", 0)], {"a": 4096}, 4200, CFG).worker.id == "a"
    assert choose([w("a", 20), w("b", 0)], {"a": 4096}, 4200, CFG).worker.id == "b"


def test_new_conversations_spread_over_the_holders_of_a_shared_prompt() -> None:
    # everyone holds the system prompt (1,000 tokens): nothing to move, the least loaded holder wins
    ws = [w("a", 3), w("b", 1), w("c", 2), w("d", 0)]
    d = choose(ws, {"a": 1008, "b": 1008, "c": 1008}, 1100, CFG)
    assert (d.worker.id, d.reason) == ("b", "hit")
    # (d lacks it: seeding d costs 3 + 1008 / 256 = 6.9 requests, more than the 1 it would save)
    hot = [w("a", 9), w("d", 1)]
    assert choose(hot, {"a": 1008}, 1100, CFG).worker.id == "d"  # 8 > 6.9: a second holder is seeded


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


def test_policy_move_makes_the_least_loaded_a_holder() -> None:
    p = CacheAware(clock=Clock())
    conv = list(range(64))
    assert p.pick([w("a"), w("b")], r(conv)).id == "a"  # type: ignore[union-attr]
    assert p.pick([w("a", 40), w("b", 10)], r(conv)).id == "b"  # type: ignore[union-attr]
    assert p.last is not None and p.last.reason == "move"
    assert p.index("m").match(conv) == {"a": 64, "b": 64}
    # both hold it now: the less loaded holder wins
    assert p.pick([w("a", 12), w("b", 11)], r(conv)).id == "b"  # type: ignore[union-attr]
