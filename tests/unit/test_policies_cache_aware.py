"""cache_aware: the pure decision (by value) and the policy with its prefix index and a fake clock."""

from __future__ import annotations

import pytest

from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.cache_aware import CacheAware, CacheAwareConfig, Placements, choose

CFG = CacheAwareConfig()
M3 = CacheAwareConfig(move_base=3.0)  # the move arithmetic below, with round numbers


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
    assert choose([w("a", 200), w("b", 134)], {"a": 100}, 100, M3).reason == "move"
    # ratio large but diff 60 <= 64: balanced
    assert choose([w("a", 60), w("b", 0)], {"a": 100}, 100, CFG).reason != "imbalanced"


def test_a_move_must_save_more_load_than_the_prefill_it_costs() -> None:
    # Shepherd's rule 3 (the original always keeps a hit on the holder, whatever its load): moving 512
    # tokens costs move_base + 512 / move_tokens_per_load = 3 + 2 = 5 requests of load
    assert (CFG.move_base, CFG.move_tokens_per_load) == (10.0, 256.0)
    assert choose([w("a", 5), w("b", 0)], {"a": 512}, 600, M3).reason == "hit"  # a tie stays
    d = choose([w("a", 6), w("b", 0), w("c", 1)], {"a": 512}, 600, M3)
    assert (d.worker.id, d.reason) == ("b", "move")
    # a worker holding part of it pays only for the part it lacks: 3 + 256 / 256 = 4
    assert choose([w("a", 4), w("b", 0)], {"a": 512, "b": 256}, 600, M3).worker.id == "a"
    assert choose([w("a", 5), w("b", 0)], {"a": 512, "b": 256}, 600, M3).worker.id == "b"
    # a long conversation is sticky: 4,096 tokens cost 3 + 16 = 19 requests
    assert choose([w("a", 19), w("b", 0)], {"a": 4096}, 4200, M3).worker.id == "a"
    assert choose([w("a", 20), w("b", 0)], {"a": 4096}, 4200, M3).worker.id == "b"


def test_new_conversations_spread_over_the_holders_of_a_shared_prompt() -> None:
    # everyone holds the system prompt (1,000 tokens): nothing to move, the least loaded holder wins
    ws = [w("a", 3), w("b", 1), w("c", 2), w("d", 0)]
    d = choose(ws, {"a": 1008, "b": 1008, "c": 1008}, 1100, M3)
    assert (d.worker.id, d.reason) == ("b", "hit")
    # (d lacks it: seeding d costs 3 + 1008 / 256 = 6.9 requests, more than the 1 it would save)
    hot = [w("a", 9), w("d", 1)]
    assert choose(hot, {"a": 1008}, 1100, M3).worker.id == "d"  # 8 > 6.9: a second holder is seeded


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
    p = CacheAware(M3, clock=Clock())
    conv = list(range(64))
    assert p.pick([w("a"), w("b")], r(conv)).id == "a"  # type: ignore[union-attr]
    assert p.pick([w("a", 40), w("b", 10)], r(conv)).id == "b"  # type: ignore[union-attr]
    assert p.last is not None and p.last.reason == "move"
    assert p.index("m").match(conv) == {"a": 64, "b": 64}
    # both hold it now: the less loaded holder wins
    assert p.pick([w("a", 12), w("b", 11)], r(conv)).id == "b"  # type: ignore[union-attr]


# ---- rule 2: new conversations by expected load, follow-ups stick --------------------------------------

SYSTEM = list(range(100_000, 101_024))  # a shared system prompt of 1,024 tokens (64 blocks)


def conversation(k: int, turns: int = 1) -> list[int]:
    """The prompt of turn ``turns`` of conversation ``k``: the shared system prompt, then its own."""
    own = [200_000 + k * 10_000 + i for i in range(80 * turns)]
    return [*SYSTEM, *own]


def test_choose_places_new_conversations_by_expected_load() -> None:
    ws = [w("a"), w("b"), w("c")]
    # a holds the shared prompt and carries 3 conversations: b (lacking 1,024 tokens = 2 requests of
    # load at shared_tokens_per_load 512) is cheaper; with the same carried load the holder wins
    d = choose(ws, {"a": 1024}, 1100, CFG, shared=True, carried={"a": 3.0})
    assert (d.worker.id, d.reason) == ("b", "spread")
    d = choose(ws, {"a": 1024}, 1100, CFG, shared=True, carried={"a": 1.0, "b": 1.0, "c": 1.0})
    assert (d.worker.id, d.reason) == ("a", "spread")
    # the same match, not shared (it is the conversation's own history): the holder keeps it
    assert choose(ws, {"a": 1024}, 1100, CFG, carried={"a": 3.0}).worker.id == "a"
    # requests now count as much as carried conversations
    ws = [w("a", 2), w("b", 0)]
    assert choose(ws, {}, 100, CFG, carried={"b": 1.5}).worker.id == "b"
    assert choose(ws, {}, 100, CFG, carried={"b": 2.5}).worker.id == "a"


def test_new_conversations_on_a_shared_prompt_spread_over_every_engine() -> None:
    # the fault of issue 21: idle engines, all holders below the balance thresholds, and every new
    # conversation matched the system prompt on the engine that first cached it
    p = CacheAware(clock=Clock())
    ws = [w("a"), w("b"), w("c"), w("d")]
    home = {}
    for k in range(40):
        chosen = p.pick(ws, r(conversation(k)))
        assert chosen is not None
        home[k] = chosen.id
    counts = sorted(sum(1 for v in home.values() if v == x) for x in "abcd")
    assert counts[0] >= 8 and counts[-1] <= 12, counts
    # the legacy rule (no spreading) puts them all on one engine: the test can see the fault
    legacy = CacheAware(CacheAwareConfig(shared_after=10**9, conversation_weight=0.0), clock=Clock())
    assert {legacy.pick(ws, r(conversation(k))).id for k in range(40)} == {"a"}  # type: ignore[union-attr]
    # follow-ups stay on their conversation's engine, whatever the carried counts say
    for k in range(40):
        chosen = p.pick(ws, r(conversation(k, turns=2)))
        assert chosen is not None and chosen.id == home[k]
        assert p.last is not None and p.last.reason == "hit"


def test_a_follow_up_moves_only_when_its_holder_is_busier_than_re_prefilling_costs() -> None:
    p = CacheAware(clock=Clock())
    first = p.pick([w("a"), w("b")], r(conversation(1)))
    assert first is not None and first.id == "a"
    follow = conversation(1, turns=2)  # holds 1,104 tokens cached -> 1,088 in blocks on a
    need = CFG.move_base + 1088 / CFG.move_tokens_per_load  # 14.25 requests of load
    assert p.pick([w("a", 14), w("b", 0)], r(follow)).id == "a"  # type: ignore[union-attr]
    assert 14 < need < 15
    assert p.pick([w("a", 15), w("b", 0)], r(follow)).id == "b"  # type: ignore[union-attr]
    assert p.last is not None and p.last.reason == "move"


def test_a_node_that_never_saw_a_prefix_end_keeps_the_follow_up_sticky() -> None:
    # in a mesh the index is replicated but the shared-prefix counts are each node's own: a follow-up
    # arriving at another node is history there (sticky), never spread
    one = CacheAware(clock=Clock())
    ws = [w("a"), w("b"), w("c")]
    for k in range(6):
        one.pick(ws, r(conversation(k)))
    other = CacheAware(clock=Clock())
    other.index("m").merge(one.index("m").export())
    for k in range(6):
        want = one.index("m").match(conversation(k))
        holder = max(want, key=lambda x: want[x])
        got = other.pick(ws, r(conversation(k, turns=2)))
        assert got is not None and got.id == holder


def test_placements_are_bounded_and_decay() -> None:
    pl = Placements(CacheAwareConfig(max_tracked=16, conversation_lifetime_s=10.0, shared_after=2))
    for h in range(1000):
        pl.ended(h)
    assert not pl.is_shared(999)
    pl.ended(999)
    assert pl.is_shared(999)
    assert len(pl._ends) <= 16
    pl.started("a", 0.0)
    pl.started("a", 0.0)
    assert pl.carried(0.0) == {"a": 2.0}
    assert abs(pl.carried(10.0)["a"] - 2.0 / 2.718281828) < 1e-6


def test_config_is_validated() -> None:
    for bad in (
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"move_tokens_per_load": 0.0},
        {"conversation_lifetime_s": 0.0},
        {"shared_after": 0},
    ):
        with pytest.raises(ValueError):
            CacheAwareConfig(**bad)


def test_node_flags_and_yaml_reach_the_policy() -> None:
    from shepherd.node.cli import config_from_args  # not at the top: the node imports grpcio
    from shepherd.node.config import ConfigError, build_config, cache_aware_config
    from shepherd.policies.simple import make_policy

    cfg = config_from_args(
        ["serve", "--policy", "cache_aware", "--cache-move-base", "5", "--shared-prefix-after", "3",
         "--cache-threshold", "0.5", "--conversation-lifetime-secs", "30"]
    )  # fmt: skip
    ca = cache_aware_config(cfg)
    assert (ca.move_base, ca.shared_after, ca.cache_threshold, ca.conversation_lifetime_s) == (
        5.0,
        3,
        0.5,
        30.0,
    )
    policy = make_policy("cache_aware", cache_aware=ca)
    assert isinstance(policy, CacheAware) and policy.config == ca
    assert cache_aware_config(build_config({"balance_abs_threshold": 32}, {})).balance_abs_threshold == 32
    with pytest.raises(ConfigError, match="cache_aware"):
        config_from_args(["serve", "--cache-threshold", "2"])
