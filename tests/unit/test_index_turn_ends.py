"""Sparse index replication (``--mesh-index-replication ends``): turn ends instead of blocks.

A routing decision sends one record (the name of its prompt's last full block, the worker, the blocks);
a receiver keeps it (``turn_ends.TurnEnds``, ``_prefixcore.Turns``) and ``match`` takes, per worker, the
longer of the index's walk and the longest record naming a block of the prompt. Checked: the table
(both layouts, held to each other on random records and chains), the combined match through the real
codec and ``MeshState``, the policy sending a cross-node follow-up to the holder, the wire."""

from __future__ import annotations

import random
from array import array

import msgpack  # type: ignore[import-untyped]
import pytest

from shepherd.mesh.state import MeshState
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.block_names import block_hashes
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.native_index import NATIVE_INDEX
from shepherd.policies.prefix_index import PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig, ReplicatedPrefixIndex
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex, Replica
from shepherd.policies.turn_ends import TurnEnds
from shepherd.proto.engine_types import worker_id
from shepherd.proto.index_wire import TurnBatch, decode_turn_body, encode_turn_bodies
from shepherd.proto.state_decode import StateDecodeError

NOW = 1_790_000_000.0
LAYOUTS: list[type[Replica]] = [ReplicatedPrefixIndex]
if NATIVE_INDEX:
    LAYOUTS.append(NativeReplicatedPrefixIndex)


def replica(layout: type[Replica], **repl: int | float) -> Replica:
    return layout(PrefixIndexConfig(), IndexReplConfig(**repl))  # type: ignore[arg-type]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


# -- the table --------------------------------------------------------------------------------------------


def test_a_record_names_the_prefix_it_ends_and_only_at_its_own_depth() -> None:
    rng = random.Random(1)
    hs = block_hashes(ids(rng, 40 * 16))
    t = TurnEnds(1 << 10, 600.0)
    t.put(hs[24], "w1", 25, NOW)
    t.put(hs[9], "w2", 10, NOW)
    t.put(hs[30], "w3", 7, NOW)  # a name at another depth than it says: never matched
    assert t.best(hs) == {"w1": 25, "w2": 10}
    assert t.best(hs[:20]) == {"w2": 10}  # a prompt that stops before the record's end
    assert t.best(block_hashes(ids(rng, 40 * 16))) == {}
    matched = {"w1": 30 * 16, "w2": 3 * 16}
    assert t.combine(matched, hs, 16) == 1  # w1's walk is longer already; w2's record is longer
    assert matched == {"w1": 30 * 16, "w2": 10 * 16}


def test_generations_bound_the_records_by_count_and_by_time() -> None:
    t = TurnEnds(8, 100.0)
    for i in range(4):
        t.put(i, "w", 1, NOW)
    t.put(100, "w", 1, NOW)  # the newer generation held 4 = max / 2: the older one goes, a new one begins
    assert len(t) == 5 and t.best([0]) == {"w": 1}
    for i in range(101, 105):
        t.put(i, "w", 1, NOW)
    assert t.best([0]) == {} and t.best([100]) == {"w": 1}  # two rotations later
    t2 = TurnEnds(1 << 10, 100.0)
    t2.put(1, "w", 1, NOW)
    t2.put(2, "w", 1, NOW + 60)  # more than span / 2 after the generation's first: rotated
    t2.put(3, "w", 1, NOW + 120)
    assert t2.best([1]) == {} and t2.best([2]) == {"w": 1}
    assert t2.expire(NOW + 61) == 1 and t2.best([2]) == {} and t2.best([3]) == {"w": 1}
    assert t2.clear("w") == 1 and t2.best([3]) == {}


@pytest.mark.skipif(not NATIVE_INDEX, reason="the C extension is not built")
def test_the_c_table_answers_as_the_python_one() -> None:
    rng = random.Random(7)
    py: Replica = replica(ReplicatedPrefixIndex, turn_ends_max=64, turn_ends_span_s=100.0)
    c: Replica = replica(NativeReplicatedPrefixIndex, turn_ends_max=64, turn_ends_span_s=100.0)
    convs = [ids(rng, 16 * rng.randrange(1, 30)) for _ in range(40)]
    workers = [f"w{i}" for i in range(5)]
    t = NOW
    for step in range(400):  # random records of random prefixes (some at the wrong depth), random queries
        t += rng.uniform(0, 2)
        conv = rng.choice(convs)
        hs = block_hashes(conv)
        k = rng.randrange(1, len(hs) + 1)
        depth = k if rng.random() < 0.9 else rng.randrange(1, 40)
        ws = [rng.choice(workers) for _ in range(rng.randrange(1, 4))]
        batch = TurnBatch(
            t,
            sorted(set(ws)),
            bytes(sorted(set(ws)).index(w) for w in ws),
            array("q", [hs[k - 1]] * len(ws)),
            array("H", [depth] * len(ws)),
        )
        assert py.apply_turns(batch, t) == c.apply_turns(batch, t) == len(ws)
        if step % 50 == 49:
            gone = rng.choice(workers)
            py.clear_worker(gone)
            c.clear_worker(gone)
        q = rng.choice(convs) + ids(rng, rng.randrange(0, 64))
        assert py.match(q) == c.match(q), step


# -- the combined match, through the codec and the mesh state ---------------------------------------------


def mesh(layout: type[Replica], name: str) -> MeshState[Replica]:
    return MeshState(name, lambda: NOW, MeshStateConfig(), new_index=lambda: replica(layout))


def deliver(src: MeshState[Replica], dst: MeshState[Replica]) -> list[str]:
    tags = []
    for p in src.index_batches():
        tags.append(msgpack.unpackb(p, raw=False)[1])
        dst.apply(p, src.node)
    return tags


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_follow_up_on_another_node_matches_the_previous_turn(layout: type[Replica]) -> None:
    rng = random.Random(3)
    a, b = mesh(layout, "a"), mesh(layout, "b")
    ia, ib = a.index("m"), b.index("m")
    for w in ("w0", "w1", "w2"):
        ia.set_quiet(w, True)  # what the node does for "ends": no blocks ...
        ia.set_turns(w, True)  # ... one turn end per decision
    system = ids(rng, 400)
    prompt = system + ids(rng, 300)  # 43 full blocks (700 tokens)
    ia.match(prompt)
    ia.insert(prompt, "w1", NOW)
    assert ia.pending == 1
    assert deliver(a, b) == ["t"] and ia.pending == 0  # one payload, no "i" (no blocks)
    assert ib.live_blocks == 0 and ib.turn_ends == 1
    follow_up = prompt + ids(rng, 250) + ids(rng, 200)  # the answer and the next user turn
    assert ib.match(follow_up) == {"w1": 43 * 16}
    assert ib.match(prompt) == {"w1": 43 * 16}
    assert ib.match(system + ids(rng, 300)) == {}  # another conversation on the same system prompt
    # the receiver's own walk still counts: the longer of the two wins per worker
    ib.insert(follow_up[: 50 * 16], "w1", NOW)
    ib.insert(system, "w2", NOW)
    assert ib.match(follow_up) == {"w1": 50 * 16, "w2": 25 * 16}
    ib.clear_worker("w1")  # the worker left: its records go with it
    assert ib.match(follow_up) == {"w2": 25 * 16}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_turn_ends_a_quiet_decision_leaves_the_other_node_blind(layout: type[Replica]) -> None:
    rng = random.Random(4)
    a, b = mesh(layout, "a"), mesh(layout, "b")
    ia = a.index("m")
    ia.set_quiet("w1", True)  # "none": no blocks, no turn ends
    prompt = ids(rng, 700)
    ia.match(prompt)
    ia.insert(prompt, "w1", NOW)
    assert deliver(a, b) == [] and b.index("m").match(prompt + ids(rng, 100)) == {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_turn_end_respects_the_workers_capacity_and_an_unnamed_insert(layout: type[Replica]) -> None:
    rng = random.Random(5)
    a, b = mesh(layout, "a"), mesh(layout, "b")
    ia, ib = a.index("m"), b.index("m")
    ia.set_turns("w1", True)
    ia.set_capacity("w1", 20)  # the worker keeps the first 20 blocks of a longer prompt
    prompt = ids(rng, 40 * 16)
    ia.insert(prompt, "w1", NOW)  # not matched first: named on the insert's own path
    ia.take_groups()
    deliver(a, b)
    assert ib.match(prompt + ids(rng, 50)) == {"w1": 20 * 16}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_old_and_future_batches_are_refused(layout: type[Replica]) -> None:
    ix = replica(layout)
    hs = block_hashes(list(range(64)))
    batch = TurnBatch(NOW - 10_000, ["w"], b"\x00", array("q", [hs[3]]), array("H", [4]))
    assert ix.apply_turns(batch, NOW) == 0 and ix.rejected == 1
    future = TurnBatch(NOW + 3600, ["w"], b"\x00", array("q", [hs[3]]), array("H", [4]))
    assert ix.apply_turns(future, NOW) == 0 and ix.match(list(range(64))) == {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_listing_workers_no_record_names_takes_no_slot(layout: type[Replica]) -> None:
    """A peer's batch may list up to 256 worker names; only those its records name get one of the
    index's 64 slots (a listed name alone would crowd the real workers out until the orphan grace)."""
    ix = replica(layout)
    hs = block_hashes(list(range(64)))
    fake = [f"fake{i}" for i in range(64)]
    batch = TurnBatch(NOW, [*fake, "w"], bytes([64]), array("q", [hs[3]]), array("H", [4]))
    assert ix.apply_turns(batch, NOW) == 1
    ix.insert(list(range(1000, 1064)), "real", NOW)
    assert ix.match(list(range(1000, 1064))) == {"real": 64}
    assert getattr(ix, "dropped_inserts", 0) == 0


# -- the policy ---------------------------------------------------------------------------------------------


def view(wid: str) -> WorkerView:
    return WorkerView(id=wid, url=f"http://{wid}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_aware_sends_the_cross_node_follow_up_to_the_holder(layout: type[Replica]) -> None:
    rng = random.Random(6)
    a, b = mesh(layout, "a"), mesh(layout, "b")
    workers = [view(f"w{i}") for i in range(4)]
    pa, pb = CacheAware(clock=lambda: NOW), CacheAware(clock=lambda: NOW)
    pa.indexes["m"], pb.indexes["m"] = a.index("m"), b.index("m")
    for w in workers:
        a.index("m").set_quiet(w.id, True)
        a.index("m").set_turns(w.id, True)
    prompt = ids(rng, 1200)
    busy = [WorkerView(id=w.id, url=w.url, in_flight=0 if w.id == "w2" else 1) for w in workers]
    first = pa.pick(busy, RouteRequest(model="m", input_ids=prompt))  # a new conversation: the idle w2
    assert first is not None and first.id == "w2"
    deliver(a, b)  # (on equal loads, a miss would take w0)
    follow_up = prompt + ids(rng, 300) + ids(rng, 200)
    got = pb.pick(workers, RouteRequest(model="m", input_ids=follow_up))
    assert got is not None and got.id == first.id
    assert pb.last is not None and pb.last.reason == "hit" and pb.last.matched_tokens == 1200 // 16 * 16


# -- the wire -----------------------------------------------------------------------------------------------


def test_turn_bodies_round_trip_within_the_budget() -> None:
    rng = random.Random(8)
    n = 500
    workers = [worker_id(f"http://engine-{i}:30000") for i in range(64)]  # 12 hex digits each
    batch = TurnBatch(
        NOW,
        workers,
        bytes(rng.randrange(64) for _ in range(n)),
        array("q", [rng.randrange(-(1 << 63), 1 << 63) for _ in range(n)]),
        array("H", [rng.randrange(1, 65_536) for _ in range(n)]),
    )
    bodies = list(encode_turn_bodies("m", batch, 1092))
    assert all(len(msgpack.packb(b, use_bin_type=True)) <= 1092 for b in bodies)
    assert 6 < len(bodies) < 12  # 11 bytes a record, and each worker's name once per body
    got = []
    for body in bodies:
        model, tb = decode_turn_body(msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False))
        assert model == "m" and tb.time == NOW
        got += [(tb.workers[i], k, x) for i, k, x in zip(tb.widx, tb.keys, tb.blocks, strict=True)]
    want = [(workers[i], k, x) for i, k, x in zip(batch.widx, batch.keys, batch.blocks, strict=True)]
    assert got == want


@pytest.mark.parametrize(
    "body",
    [
        ["m", NOW, ["w"], b"\x01", b"\x00" * 8, b"\x01\x00"],  # names a worker it does not list
        ["m", NOW, ["w"], b"\x00", b"\x00" * 7, b"\x01\x00"],  # keys of another length
        ["m", NOW, ["w"], b"\x00", b"\x00" * 8, b"\x00\x00"],  # zero blocks
        ["m", float("nan"), ["w"], b"\x00", b"\x00" * 8, b"\x01\x00"],
        ["m", NOW, ["w"], "x", b"\x00" * 8, b"\x01\x00"],
        ["m", NOW, ["w"]],
    ],
)
def test_malformed_turn_bodies_are_refused(body: list[object]) -> None:
    with pytest.raises(StateDecodeError):
        decode_turn_body(body)
