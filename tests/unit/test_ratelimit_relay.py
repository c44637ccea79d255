"""Rate-limit shards on a relaying mesh (``LimiterConfig.relay``, a ``MeshState`` without ``first_hand``):
peers' shards are re-gossiped by whoever learns them, and the broadcast queue holds one delta per shard,
a newer state replacing the older one still queued. Without ``relay`` (the default), a node gossips its
own shard only, one queued delta per change. Real ``MeshState`` + ``RateLimiter``, payloads handed
between them as SWIM would piggyback them. Registry entries (worker adds) go ahead of the rest on a
full channel."""

from __future__ import annotations

from shepherd.mesh.ratelimit import Grant, LimiterConfig, Limits, RateLimiter
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_registry import WorkerRecord
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.state_wire import peek
from shepherd.policies.prefix_replica_native import Replica, make_replica

NOW = 1_790_000_000.0
KEY = ("t", "")
RULES = [(KEY, Limits(rpm=1000))]
BIG = 1 << 20


def _node(name: str, relay: bool, first_hand: bool = False) -> tuple[MeshState[Replica], RateLimiter]:
    st: MeshState[Replica] = MeshState(
        name, lambda: NOW, MeshStateConfig(first_hand=first_hand), new_index=make_replica
    )
    lim = RateLimiter(name, 1, LimiterConfig(relay=relay))
    st.register("ratelimit", lim)
    for m in ("a", "b", "c"):
        st.on_member_up(m)
    lim.set_membership(["a", "b", "c"], 3)
    return st, lim


def _admit(lim: RateLimiter, n: int = 1) -> None:
    for _ in range(n):
        assert isinstance(lim.acquire(NOW, RULES, 10), Grant)


def _deliver(src: MeshState[Replica], dst: MeshState[Replica], name: str) -> int:
    payloads = src.broadcasts(BIG)
    for p in payloads:
        dst.on_user(p, name)
    return len(payloads)


def test_a_relaying_mesh_spreads_a_shard_past_its_owners_neighbours() -> None:
    for relay in (False, True):
        (a, la), (b, lb), (c, lc) = (_node(n, relay) for n in "abc")
        _admit(la, 3)
        _deliver(a, b, "a")  # a reaches b only (c is out of a's piggyback targets this round)
        assert lb.shard_version(KEY, "a") == la.shard_version(KEY, "a") > 0
        _deliver(b, c, "b")
        got = lc.shard_version(KEY, "a")
        assert got == (la.shard_version(KEY, "a") if relay else 0), relay


def test_a_newer_state_of_a_shard_replaces_the_queued_older_one() -> None:
    for relay, expect in ((False, 4), (True, 1)):
        a, la = _node("a", relay)
        for _ in range(4):
            _admit(la)
            a.broadcasts(0)  # nothing fits: the delta stays queued
        assert a.describe()["broadcast_queue"] == expect, relay
        b, lb = _node("b", relay)
        assert _deliver(a, b, "a") == expect
        assert lb.shard_version(KEY, "a") == la.shard_version(KEY, "a")  # the newest state arrived


def test_relay_does_not_repeat_a_shard_it_already_holds() -> None:
    (a, la), (b, lb) = _node("a", True), _node("b", True)
    _admit(la, 2)
    _deliver(a, b, "a")
    assert _deliver(b, a, "b") == 1  # b relays what it learnt once (a ignores its own shard)
    before = lb.shard_version(KEY, "a")
    lb.apply_delta(la.snapshot())  # the same state again (as a retransmit would bring it)
    assert lb.take_keyed_deltas() == []  # nothing new: nothing queued for relay
    _admit(la)
    lb.apply_delta(la.snapshot())  # a newer state: relayed once
    assert [k for k, _ in lb.take_keyed_deltas()] == ["t//a"] and lb.shard_version(KEY, "a") > before
    assert lb.shard_version(KEY, "a") == la.shard_version(KEY, "a")


def test_registry_entries_go_first_on_a_full_channel() -> None:
    a, la = _node("a", True)
    for i in range(200):
        a.observe_health(f"w{i}", True)
    _admit(la, 3)
    a.add_worker(WorkerRecord("new", "http://10.0.0.9:8000", "m"))
    first = a.broadcasts(300)  # room for a few payloads out of ~200 queued
    assert first and peek(first[0])[0] == "r"
    b, _ = _node("b", True)
    for p in first:
        b.on_user(p, "a")
    assert b.worker("new") is not None
