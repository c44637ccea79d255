"""Prefix-index replication: incremental digest, max-merge semilattice, delta batches, digest repair,
cache affinity across nodes, bounds, wire. ``python tests/unit/test_mesh_state_index.py`` runs a
small benchmark (not a test)."""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.block_names import block_hashes
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.native_index import NATIVE_INDEX
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig, ReplicatedPrefixIndex
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex
from shepherd.proto.index_wire import Group, decode_index_body, encode_index_bodies
from shepherd.proto.state_decode import StateDecodeError

T0 = 1_000_000.0
BIG = PrefixIndexConfig(capacity_blocks=1 << 20, max_age_s=1e9)


Replica = ReplicatedPrefixIndex | NativeReplicatedPrefixIndex
# every test here runs on both replicas: the run layout in Python and the native one (``ix_`` makes the
# replica of the current parameter)
_REPLICA: list[type[Replica]] = [ReplicatedPrefixIndex]


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(ReplicatedPrefixIndex, id="runs"),
        pytest.param(
            NativeReplicatedPrefixIndex,
            id="native",
            marks=pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built"),
        ),
    ],
)
def replica(request: pytest.FixtureRequest) -> Iterator[None]:
    _REPLICA[0] = request.param
    yield
    _REPLICA[0] = ReplicatedPrefixIndex


def ix_(g: float = 0.0, cap: int = 1 << 20, max_age: float = 1e9, **kw: Any) -> Replica:
    return _REPLICA[0](
        PrefixIndexConfig(capacity_blocks=cap, max_age_s=max_age),
        IndexReplConfig(digest_granularity_s=g, **kw),
    )


def wire_round(model: str, groups: list[Group], budget: int = 1200) -> list[tuple[str, list[Group]]]:
    out = []
    for body in encode_index_bodies(model, groups, budget):
        raw = msgpack.packb(body, use_bin_type=True)
        assert len(raw) <= budget
        out.append(decode_index_body(msgpack.unpackb(raw)))
    return out


def prompts(seed: int, n: int, blocks: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(32)]  # a shared system prompt: 2 blocks
    return [shared + [rng.randrange(50_000) for _ in range(16 * blocks)] for _ in range(n)]


# -- the incremental digest -------------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 7), st.sampled_from("abc"), st.integers(0, 30)),
        st.tuples(st.just("merge"), st.integers(0, 7), st.sampled_from("abc"), st.integers(-5, 40)),
        st.tuples(st.just("remove"), st.integers(0, 7), st.sampled_from("abc"), st.integers(1, 4)),
        st.tuples(st.just("expire"), st.integers(0, 0), st.sampled_from("a"), st.integers(0, 40)),
        st.tuples(st.just("clear"), st.integers(0, 0), st.sampled_from("abc"), st.integers(0, 0)),
        st.tuples(st.just("cap"), st.integers(0, 0), st.sampled_from("abc"), st.integers(2, 30)),
    ),
    max_size=25,
)


@settings(max_examples=100, deadline=None)
@given(ops=ops, g=st.sampled_from([0.0, 7.0]))
def test_the_incremental_digest_equals_a_recomputation(
    ops: list[tuple[str, int, str, int]], g: float
) -> None:
    ps = [block_hashes(p) for p in prompts(1, 8, blocks=3)]
    ix = ix_(g, cap=20, max_age=25.0)
    now = T0
    for op, p, w, k in ops:
        now += 1.0
        if op == "insert":
            ix.insert_blocks(ps[p], w, now - k)
        elif op == "merge":
            ix.merge({(h, w): now - k for h in ps[p][: 1 + k % 4]})
        elif op == "remove":
            ix.remove_blocks(ps[p][-k:], w)
        elif op == "expire":
            ix.expire(now + k)
        elif op == "clear":
            ix.clear_worker(w)
        else:
            ix.set_capacity(w, k)
        assert ix.digest() == ix.recompute_digest()


# -- the semilattice ----------------------------------------------------------------------------------------

entry_maps = st.dictionaries(
    st.tuples(st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 20), st.sampled_from(["a", "b", "c"])),
    st.integers(0, 50).map(lambda k: T0 + k / 4),
    max_size=25,
)


def exported(ix: Replica) -> dict[tuple[int, str], float]:
    return ix.export()


@settings(max_examples=100, deadline=None)
@given(a=entry_maps, b=entry_maps, c=entry_maps)
def test_merge_is_commutative_associative_idempotent(
    a: dict[tuple[int, str], float], b: dict[tuple[int, str], float], c: dict[tuple[int, str], float]
) -> None:
    x, y, z, bc = ix_(), ix_(), ix_(), ix_()
    for part in (a, b, c):
        x.merge(part)
    for part in (c, b, a, a):
        y.merge(part)
    bc.merge(b)
    bc.merge(c)
    z.merge(a)
    z.merge(bc.export())
    assert exported(x) == exported(y) == exported(z)
    assert x.digest() == y.digest() == z.digest() == x.recompute_digest()
    x.merge(x.export())
    assert exported(x) == exported(y)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 1 << 30), loss=st.floats(0.0, 0.5), g=st.sampled_from([0.0, 60.0]))
def test_replicas_converge_after_lossy_gossip_and_digest_repair(seed: int, loss: float, g: float) -> None:
    rng = random.Random(seed)
    ps = [block_hashes(p) for p in prompts(seed, 6, blocks=4)]
    nodes = [ix_(g) for _ in range(3)]
    now = T0
    inflight: list[tuple[int, str, list[Group]]] = []
    for _ in range(rng.randrange(1, 25)):
        now += rng.random() * 3
        i = rng.randrange(3)
        p = ps[rng.randrange(len(ps))]
        nodes[i].insert_blocks(p[: rng.randrange(1, len(p) + 1)], rng.choice("wxyz"), now)
        if rng.random() < 0.5:
            for model, groups in wire_round("m", nodes[i].take_groups(), 300):
                for j in range(3):
                    if j != i and rng.random() >= loss:
                        inflight.append((j, model, groups))
                        if rng.random() < 0.2:
                            inflight.append((j, model, groups))  # duplicated
        rng.shuffle(inflight)
        while inflight and rng.random() < 0.7:
            j, _, groups = inflight.pop()
            nodes[j].apply_groups(groups, now)
    for a in range(3):  # digest repair, both ways, over every pair
        for b in range(3):
            if a != b:
                sel = nodes[a].diff(nodes[b].digest())
                for _, groups in wire_round("m", nodes[a].entries_in(sel), 400):
                    nodes[b].apply_groups(groups, now)
    digests = [n.digest() for n in nodes]
    assert digests[0] == digests[1] == digests[2]
    keys = [set(n.export()) for n in nodes]
    assert keys[0] == keys[1] == keys[2]
    if g == 0.0:
        assert nodes[0].export() == nodes[1].export() == nodes[2].export()
    assert all(n.diff(nodes[0].digest()) == {} for n in nodes)


# -- deltas -----------------------------------------------------------------------------------------


def test_deltas_carry_new_blocks_and_refreshes_only_when_a_slot_changes() -> None:
    ix = ix_(60.0, refresh_s=0.0)  # refresh 0: every slot change is a refresh
    base = 60.0 * 20_000  # the start of a digest slot
    hs = block_hashes(list(range(16 * 10)))
    ix.insert_blocks(hs[:6], "w", base)
    first = ix.take_groups()
    assert [(w, t, list(h)) for w, t, h in first] == [("w", base, hs[:6])]
    ix.insert_blocks(hs, "w", base + 5)  # 6 re-accessed in the same slot (not sent), 4 new
    assert [(w, t, list(h)) for w, t, h in ix.take_groups()] == [("w", base + 5, hs[6:])]
    ix.insert_blocks(hs, "w", base + 61)  # a new slot: every block is sent again, once
    assert [(t, list(h)) for _, t, h in ix.take_groups()] == [(base + 61, hs)]
    ix.insert_blocks(hs, "w", base + 70)
    assert ix.take_groups() == []
    assert ix.digest() == ix.recompute_digest()


def test_one_request_leaves_as_one_group_without_the_blocks_gone_before_the_flush() -> None:
    ix = ix_(60.0, refresh_s=0.0)
    base = 60.0 * 20_000
    hs = block_hashes(list(range(16 * 10)))
    ix.insert_blocks(hs[:4], "w", base)
    ix.take_groups()
    ix.insert_blocks(hs, "w", base + 61)  # the held run re-sent (a new slot) and a new run: one group
    assert [(w, t, list(h)) for w, t, h in ix.take_groups()] == [("w", base + 61, hs)]
    other = block_hashes(list(range(1000, 1000 + 16 * 6)))
    ix.insert_blocks(other, "w", base + 62)
    ix.remove_blocks(other[3:], "w")  # KV "removed" before the flush: those are not sent
    assert [(t, list(h)) for _, t, h in ix.take_groups()] == [(base + 62, other[:3])]
    assert ix.digest() == ix.recompute_digest()


def test_a_follow_up_sends_only_its_new_blocks_until_its_prefix_is_refresh_old() -> None:
    """No slot-move re-sends: a held prefix re-accessed in a later time slot stays in its slot (its time
    the slot's last instant) and is not sent; the follow-up's new blocks are. Once ``refresh_s`` old, a
    re-access moves it and sends it again. A peer that got every delta has our digest."""
    a, b = ix_(60.0, refresh_s=600.0), ix_(60.0, refresh_s=600.0)
    base = 60.0 * 20_000
    hs = block_hashes(list(range(16 * 10)))

    def flush(now: float) -> list[tuple[float | list[float], list[int]]]:
        groups = a.take_groups()
        b.apply_groups(groups, now)
        return [(t if isinstance(t, float) else list(t), list(h)) for _, t, h in groups]

    a.insert_blocks(hs[:6], "w", base)
    assert flush(base) == [(base, hs[:6])]
    a.insert_blocks(hs, "w", base + 61)  # turn 2, a slot later: only the 4 new blocks
    assert flush(base + 61) == [(base + 61, hs[6:])]
    assert a.last_access(hs[0], "w") == pytest.approx(base + 60, abs=1e-6)  # its slot's end
    assert a.slot(a.last_access(hs[0], "w") or 0) == a.slot(base)
    assert a.digest() == a.recompute_digest() == b.digest()
    a.insert_blocks(hs, "w", base + 500)  # still not refresh_s old: nothing
    assert flush(base + 500) == []
    a.insert_blocks(hs, "w", base + 700)  # turn 1's blocks are refresh_s old (their slot's end): re-sent
    assert flush(base + 700) == [(base + 700, hs[:6])]
    a.insert_blocks(hs, "w", base + 710)
    assert flush(base + 710) == []
    a.insert_blocks(hs, "w", base + 800)  # and turn 2's, once they are
    assert flush(base + 800) == [(base + 800, hs[6:])]
    assert a.digest() == a.recompute_digest() == b.digest()


def test_kv_event_inserts_are_never_sent_and_quiet_workers_send_nothing() -> None:
    """What an engine's KV events tell every node is not gossiped; a quiet worker's routing decisions
    neither (its entries move with their access times, and digest repair leaves it alone)."""
    ix = ix_(60.0)
    base = 60.0 * 20_000
    ids = list(range(16 * 8))
    hs = ix.store_token_blocks("w", ids, base)
    assert hs == block_hashes(ids) and ix.take_groups() == []
    assert ix.match_blocks(hs) == {"w": 8}
    ix.store_token_blocks("w", ids, base + 90)  # a later slot: moved (every node saw the same event)
    assert ix.slot(ix.last_access(hs[0], "w") or 0) == ix.slot(base + 90)
    assert ix.take_groups() == [] and ix.digest() == ix.recompute_digest()
    ix.insert(ids + list(range(500, 532)), "w", base + 91)  # a routing decision: its 2 new blocks
    assert [len(h) for _, _, h in ix.take_groups()] == [2]
    ix.set_quiet("q", True)
    assert ix.quiet_workers == frozenset({"q"})
    ix.insert(ids, "q", base + 92)
    ix.insert(ids, "q", base + 200)  # moves, sends nothing
    assert ix.take_groups() == [] and ix.worker_blocks("q") == 8
    assert ix.slot(ix.last_access(hs[0], "q") or 0) == ix.slot(base + 200)
    assert "q" not in ix.diff({})  # repair leaves it alone (the engine's events are its source)
    assert "w" in ix.diff({})
    ix.set_quiet("q", False)
    ix.insert(list(range(1000, 1032)), "q", base + 201)
    assert [(w, len(h)) for w, _, h in ix.take_groups()] == [("q", 2)]
    assert ix.digest() == ix.recompute_digest()


def per_entry(groups: list[Group]) -> list[tuple[str, int, float]]:
    out = []
    for w, t, hs in groups:
        ts = [t] * len(hs) if isinstance(t, float) else list(t)
        out += [(w, h, x) for h, x in zip(hs, ts, strict=True)]
    return out


def test_relay_re_gossips_what_changed_this_index_only() -> None:
    ix = ix_(relay=True)
    hs = block_hashes(list(range(16 * 4)))
    groups: list[Group] = [("w", T0, array("q", hs[:3]))]
    assert ix.apply_groups(groups, T0) == 3
    assert per_entry(ix.take_groups()) == [("w", h, T0) for h in hs[:3]]
    assert ix.apply_groups(groups, T0) == 0 and ix.take_groups() == []  # nothing changed: nothing relayed
    assert ix.apply_groups([("w", T0 + 1, array("q", hs[1:]))], T0) == 3
    assert per_entry(ix.take_groups()) == [("w", h, T0 + 1) for h in hs[1:]]


def test_repair_leaves_slots_still_open_to_the_deltas_in_flight() -> None:
    a, b = ix_(60.0), ix_(60.0)
    base = 60.0 * 20_000
    a.insert_blocks([1, 2, 3], "w", base + 1)
    assert a.diff(b.digest(), now=base + 30) == {}  # its slot is still open
    assert a.diff(b.digest(), now=base + 66) == {"w": {20_000}}  # closed over 5 s ago
    assert a.diff(b.digest()) == {"w": {20_000}} == b.diff(a.digest())


def test_the_delta_buffer_is_bounded() -> None:
    ix = ix_(max_pending=100)
    for i in range(50):
        ix.insert_blocks(block_hashes([i] * 16 * 5), "w", T0 + i)
    assert ix.pending == 100 and ix.pending_dropped == 150


def test_entries_too_old_or_from_the_future_are_dropped() -> None:
    ix = ix_(max_age=100.0, max_future_s=10.0)
    groups: list[Group] = [
        ("w", T0 - 200, array("q", [1, 2])),
        ("w", T0 + 20, array("q", [3])),
        ("w", array("d", [T0, T0 - 500, T0 + 5]), array("q", [4, 5, 6])),
    ]
    assert ix.apply_groups(groups, T0) == 2
    assert set(ix.export()) == {(4, "w"), (6, "w")} and ix.rejected == 4


# -- cache affinity across nodes --------------------------------------------------------------------


def test_a_conversation_routed_on_one_node_keeps_its_worker_on_another() -> None:
    clock = [T0]
    a_ix, b_ix = ix_(), ix_()
    a, b = CacheAware(clock=lambda: clock[0]), CacheAware(clock=lambda: clock[0])
    a.indexes["m"], b.indexes["m"] = a_ix, b_ix
    workers = [WorkerView(id=f"w{i}", url=f"u{i}") for i in range(4)]
    convo = prompts(5, 1, blocks=20)[0]
    first = a.pick(workers, RouteRequest("m", convo))
    assert first is not None
    for _, groups in wire_round("m", a_ix.take_groups()):  # A's delta reaches B
        b_ix.apply_groups(groups, clock[0])
    assert b_ix.match(convo) == {first.id: len(convo) // 16 * 16}
    clock[0] += 10
    follow_up = convo + list(range(300, 400))
    second = b.pick(workers, RouteRequest("m", follow_up))
    assert second is not None and second.id == first.id and b.last is not None and b.last.reason == "hit"


# -- bounds -----------------------------------------------------------------------------------------


def test_memory_stays_bounded_under_200k_index_updates() -> None:
    cfg = PrefixIndexConfig(capacity_blocks=2000, max_age_s=60.0)
    repl = IndexReplConfig(digest_granularity_s=10.0, max_pending=5000)
    a, b = _REPLICA[0](cfg, repl), _REPLICA[0](cfg, repl)
    rng = random.Random(11)
    now = T0
    updates = 0
    peak_live = peak_pending = peak_slots = 0
    bits = rng.getrandbits
    chain = [bits(63) for _ in range(8)]  # block names (random stand-ins for chained hashes)
    while updates < 200_000:
        now += 0.01
        # a new conversation, else a follow-up turn that extends one
        chain = [bits(63) for _ in range(8)] if rng.random() < 0.3 else [*chain[-39:], bits(63)]
        (a if rng.random() < 0.5 else b).insert_blocks(chain, f"w{rng.randrange(4)}", now)
        updates += len(chain)
        if rng.random() < 0.05:
            for src, dst in ((a, b), (b, a)):
                dst.apply_groups([g for g in src.take_groups() if rng.random() > 0.02], now)
            for x in (a, b):
                x.expire(now)
                peak_live = max(peak_live, sum(x.worker_blocks(w) for w in x.workers))
                peak_pending = max(peak_pending, x.pending)
                peak_slots = max(peak_slots, sum(len(s) for s in x.digest().values()))
    assert peak_live <= 4 * 2000
    assert peak_pending <= 5000
    assert peak_slots <= 4 * (60 // 10 + 3)
    assert a.digest() == a.recompute_digest() and b.digest() == b.recompute_digest()


# -- wire -------------------------------------------------------------------------------------------

groups_st = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=40),
        st.one_of(st.floats(0, 1e10), st.just(None)),
        st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=300),
    ),
    max_size=6,
)


@settings(max_examples=100, deadline=None)
@given(groups=groups_st, budget=st.integers(120, 3000))
def test_batches_fit_the_budget_and_round_trip(
    groups: list[tuple[str, float | None, list[int]]], budget: int
) -> None:
    gs: list[Group] = []
    want: dict[tuple[int, str], float] = {}
    for i, (w, t, hs) in enumerate(groups):
        if t is None:
            ts = array("d", [float(i + j) for j in range(len(hs))])
            gs.append((w, ts, array("q", hs)))
            want.update({(h, w): x for h, x in zip(hs, ts, strict=True)})
        else:
            gs.append((w, t, array("q", hs)))
            want.update({(h, w): t for h in hs})
    got: dict[tuple[int, str], float] = {}
    # a group needs its worker's name and one block beside the body's own bytes (a name of n UTF-8 bytes:
    # n + 52 at the most); a budget below what the longest name needs is refused, never cut short
    longest = max((len(w.encode()) for w, _, _ in groups), default=0)
    if budget < longest + 64:
        try:
            rounds = wire_round("model-x", gs, budget)
        except ValueError as e:
            assert "too small" in str(e)
            return
    else:
        rounds = wire_round("model-x", gs, budget)
    for model, decoded in rounds:
        assert model == "model-x"
        for dw, dt, dhs in decoded:
            if isinstance(dt, float):
                got.update({(h, dw): dt for h in dhs})
            else:
                got.update({(h, dw): x for h, x in zip(dhs, dt, strict=True)})
    assert got == want


def test_a_budget_too_small_is_an_error() -> None:
    with pytest.raises(ValueError):
        list(encode_index_bodies("m", [("w", 1.0, array("q", [1]))], 20))


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=4)
        | st.binary(max_size=24),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=14,
    )
)
def test_malformed_bodies_raise_one_error_type_and_change_nothing(v: Any) -> None:
    ix = ix_()
    ix.insert_blocks([1, 2, 3], "w", T0)
    before = ix.export()
    try:
        model, groups = decode_index_body(v)
    except StateDecodeError:
        assert ix.export() == before
        return
    # it decoded: a valid body, the one its own encoding gives back
    (again,) = list(encode_index_bodies(model, groups, 1 << 20)) or [[model, []]]
    assert _canon(decode_index_body(msgpack.unpackb(msgpack.packb(again)))) == _canon((model, groups))
    ix.apply_groups(groups, T0)


def _canon(decoded: tuple[str, list[Group]]) -> tuple[str, list[tuple[str, Any, list[int]]]]:
    model, groups = decoded
    return model, [(w, t if isinstance(t, float) else list(t), list(hs)) for w, t, hs in groups if len(hs)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_valid_body_with_bytes_changed_is_refused_or_round_trips(data: st.DataObject) -> None:
    groups: list[Group] = [
        ("w1", T0, array("q", [1, 2, 3])),
        ("w2", array("d", [T0, T0 + 1]), array("q", [4, 5])),
    ]
    (body,) = list(encode_index_bodies("m", groups, 1 << 20))
    raw = bytearray(msgpack.packb(body))
    assert _canon(decode_index_body(msgpack.unpackb(bytes(raw)))) == _canon(("m", groups))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[i]))
    try:  # msgpack's own layer (the node's state_wire turns any of its errors into StateDecodeError)
        value = msgpack.unpackb(bytes(raw))
    except Exception:
        return
    try:
        decoded = decode_index_body(value)
    except StateDecodeError:
        return
    model, got = decoded
    (again,) = list(encode_index_bodies(model, got, 1 << 20)) or [[model, []]]
    assert _canon(decode_index_body(msgpack.unpackb(msgpack.packb(again)))) == _canon(decoded)


@pytest.mark.parametrize(
    "body",
    [
        ["m", [["w", 1.0, b"1234567"]]],  # not a multiple of 8 bytes
        ["m", [["w", b"12345678", b"1234567812345678"]]],  # times and hashes differ in length
        ["m", [["w", float("nan"), b"12345678"]]],
        ["m", [["w", "1.0", b"12345678"]]],
        ["m", [["", 1.0, b"12345678"]]],
        ["m", [["w", 1.0]]],
        ["m"],
    ],
)
def test_specific_malformed_bodies(body: Any) -> None:
    with pytest.raises(StateDecodeError):
        decode_index_body(msgpack.unpackb(msgpack.packb(body)))


# -- benchmark (not a test) -------------------------------------------------------------------------


def bench(rounds: int = 200) -> dict[str, float]:
    """Microseconds to decode + apply one UDP batch of ~100 new entries, and the local insert cost."""
    ps = [block_hashes(p) for p in prompts(3, rounds, blocks=98)]  # 100 blocks per prompt
    src = ix_(60.0)
    payloads: list[bytes] = []
    for i, hs in enumerate(ps):
        src.insert_blocks(hs, f"w{i % 8}", T0 + i * 0.01)
        payloads.append(msgpack.packb([1, "i", ["m", [[w, t, bytes(h)] for w, t, h in src.take_groups()]]]))
    dst = ix_(60.0)
    t0 = time.perf_counter()
    for p in payloads:
        _, groups = decode_index_body(msgpack.unpackb(p)[2])
        dst.apply_groups(groups, T0 + 10)
    apply_us = (time.perf_counter() - t0) / len(payloads) * 1e6
    plain = PrefixIndex()  # the parent, for comparison
    t0 = time.perf_counter()
    for i, hs in enumerate(ps):
        plain.insert_blocks(hs, f"w{i % 8}", T0)
    base_us = (time.perf_counter() - t0) / len(ps) * 1e6
    fresh = ix_(60.0)
    t0 = time.perf_counter()
    for i, hs in enumerate(ps):
        fresh.insert_blocks(hs, f"w{i % 8}", T0)
    repl_us = (time.perf_counter() - t0) / len(ps) * 1e6
    return {
        "apply_100_entries_us": round(apply_us, 1),
        "payload_bytes": round(sum(map(len, payloads)) / len(payloads)),
        "insert_100_new_blocks_us_plain": round(base_us, 1),
        "insert_100_new_blocks_us_replicated": round(repl_us, 1),
    }


if __name__ == "__main__":
    print(bench())
