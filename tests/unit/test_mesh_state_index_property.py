"""The mesh's prefix index, both replicas (the run layout in Python, the native one in C; hypothesis):
replicas converge to the flat reference map (block, worker) -> last access under any delivery order, loss
and duplication; locally each holds exactly what the local index of its layout holds, with an incremental
digest equal to a recomputation."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.policies.block_names import block_hashes
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig, merge_entries
from shepherd.policies.prefix_replica import IndexReplConfig, ReplicatedPrefixIndex
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex
from shepherd.policies.run_index import RunPrefixIndex
from shepherd.proto.index_wire import Group, decode_index_body, encode_index_bodies

T0 = 1_000_000.0
NATIVE = pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built")
# each replica with the local index of the same layout (the same eviction order)
REPLICAS = pytest.mark.parametrize(
    ("Rep", "Local"),
    [
        pytest.param(ReplicatedPrefixIndex, RunPrefixIndex, id="runs"),
        pytest.param(NativeReplicatedPrefixIndex, NativePrefixIndex, id="native", marks=NATIVE),
    ],
)
Replica = type[ReplicatedPrefixIndex] | type[NativeReplicatedPrefixIndex]
WORKERS = ["a", "b", "c"]
NODES = 3

# prompts from a few shared pieces (prefixes overlap often); a cut keeps a prefix of the blocks
pieces = st.lists(st.sampled_from([tuple(range(i * 10, i * 10 + 16)) for i in range(5)]), max_size=6)
prompts = pieces.map(lambda ps: [t for p in ps for t in p])

node = st.integers(0, NODES - 1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), node, prompts, st.sampled_from(WORKERS), st.integers(1, 6)),
        st.tuples(st.just("kv"), node, prompts, st.sampled_from(WORKERS), st.integers(1, 6)),
        # deltas of a node: taken, then sent to some nodes (bits 0-2), some twice (bits 3-5: duplicates)
        st.tuples(st.just("gossip"), node, st.just([]), st.just(""), st.integers(0, 63)),
        # a replica's whole state (a join's snapshot) or a direct merge of another's export
        st.tuples(st.just("snapshot"), node, st.just([]), st.sampled_from(WORKERS), node),
        st.tuples(st.just("merge"), node, st.just([]), st.sampled_from(WORKERS), node),
        st.tuples(st.just("deliver"), node, st.just([]), st.just(""), st.integers(0, 99)),
    ),
    max_size=30,
)


def wire(groups: list[Group], budget: int = 300) -> list[list[Group]]:
    """Groups through encode, msgpack and decode, as UDP-sized bodies."""
    out = []
    for body in encode_index_bodies("m", groups, budget):
        _, decoded = decode_index_body(msgpack.unpackb(msgpack.packb(body, use_bin_type=True)))
        out.append(decoded)
    return out


def slots(entries: dict[tuple[int, str], float], g: float) -> dict[tuple[int, str], float]:
    return {k: (t // g if g > 0 else t) for k, t in entries.items()}


@REPLICAS
@settings(max_examples=120, deadline=None)
@given(ops=ops, g=st.sampled_from([0.0, 7.0]), seed=st.integers(0, 1 << 16))
def test_replicas_converge_to_the_flat_reference(
    Rep: Replica,
    Local: type[PrefixIndex],
    ops: list[tuple[str, int, list[int], str, int]],
    g: float,
    seed: int,
) -> None:
    """Each node's local updates also go to a flat ``PrefixIndex`` of its own; whatever was delivered
    in whatever order (duplicated, lost, snapshots, direct merges), after digest repair every replica
    holds the max-merge of the flat references (exactly with granularity 0, up to the time slot
    otherwise), with equal digests."""
    big = PrefixIndexConfig(capacity_blocks=1 << 20, max_age_s=1e9)
    # refresh_s=0: every slot change re-sent (the exact times of the flat reference); refresh below
    reps = [Rep(big, IndexReplConfig(digest_granularity_s=g, refresh_s=0.0)) for _ in range(NODES)]
    flats = [PrefixIndex(big) for _ in range(NODES)]
    inflight: list[tuple[int, list[Group]]] = []
    now = T0
    for kind, i, prompt, w, x in ops:
        now += 1.0
        if kind == "insert":
            cut = prompt[: 16 * x]
            reps[i].insert(list(cut), w, now)
            flats[i].insert(list(cut), w, now)
        elif kind == "kv":  # a KV "stored" event: blocks after the first one, chained from its name
            hs = block_hashes(prompt)
            if hs:
                reps[i].store_token_blocks(w, prompt[16 : 16 * x], now, parent=hs[0])
                flats[i].store_token_blocks(w, prompt[16 : 16 * x], now, parent=hs[0])
        elif kind == "gossip":
            for body in wire(reps[i].take_groups()):
                for j in range(NODES):
                    if j != i and (x >> j) & 1:
                        inflight.append((j, body))
                        if (x >> (j + 3)) & 1:
                            inflight.append((j, body))
        elif kind == "snapshot":
            for body in wire(reps[x].entries_in()):
                reps[i].apply_groups(body, now)
        elif kind == "merge":
            reps[i].merge(reps[x].export())
        elif inflight:  # deliver one in-flight body, picked anywhere in the queue
            j, body = inflight.pop(x % len(inflight))
            reps[j].apply_groups(body, now)
        for r in reps:  # every replica's digest, after every step (a delivery changes another one)
            assert r.digest() == r.recompute_digest()
    # the rest of the deltas are lost; digest repair, both ways, over every pair (twice: a repair
    # can bring an entry that a third replica then needs)
    for _ in range(2):
        for a in range(NODES):
            for b in range(NODES):
                if a != b:
                    for body in wire(reps[a].entries_in(reps[a].diff(reps[b].digest())), 400):
                        reps[b].apply_groups(body, now)
    want: dict[tuple[int, str], float] = {}
    for f in flats:
        want = merge_entries(want, f.export())
    for r in reps:
        assert r.digest() == r.recompute_digest() == reps[0].digest()
        if g == 0.0:
            assert r.export() == want
        else:
            assert slots(r.export(), g) == slots(want, g)


local_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), prompts, st.sampled_from(WORKERS), st.integers(0, 3)),
        st.tuples(st.just("kv"), prompts, st.sampled_from(WORKERS), st.integers(0, 3)),
        st.tuples(
            st.just("remove"), st.lists(st.integers(0, 40), max_size=4), st.sampled_from(WORKERS), st.just(0)
        ),
        st.tuples(st.just("clear"), st.just([]), st.sampled_from(WORKERS), st.just(0)),
        st.tuples(st.just("expire"), st.just([]), st.just(""), st.integers(0, 3)),
        st.tuples(st.just("capacity"), st.just([]), st.sampled_from(WORKERS), st.integers(1, 12)),
        st.tuples(st.just("merge"), prompts, st.sampled_from(WORKERS), st.integers(-3, 3)),
    ),
    max_size=40,
)


@REPLICAS
@settings(max_examples=150, deadline=None)
@given(local_ops, st.integers(1, 12), st.sampled_from([0.0, 3.0]))
def test_the_mesh_index_holds_what_its_local_layout_holds(
    Rep: Replica, Local: type[PrefixIndex], acts: list[tuple[str, list[int], str, int]], cap: int, g: float
) -> None:
    """Same updates (with eviction, expiry, removals, merges): the same entries as the local index of the
    same layout, and the incremental digest equals a recomputation after every step."""
    cfg = PrefixIndexConfig(capacity_blocks=cap, max_age_s=6.0)
    runs, mesh = Local(cfg), Rep(cfg, IndexReplConfig(digest_granularity_s=g, refresh_s=0.0))
    seen: list[int] = []
    now = 0.0
    for kind, arg, w, x in acts:
        now += 1.0
        for ix in (runs, mesh):
            if kind == "insert":
                ix.insert(list(arg), w, now - x)
            elif kind == "kv":
                hs = block_hashes(arg)
                if hs:
                    ix.store_token_blocks(w, arg[16:], now - x, parent=hs[0])
            elif kind == "remove":
                ix.remove_blocks([seen[i % len(seen)] for i in arg] if seen else [], w)
            elif kind == "clear":
                ix.clear_worker(w)
            elif kind == "expire":
                ix.expire(now + x, budget=3)
            elif kind == "capacity":
                ix.set_capacity(w, x)
            else:
                ix.merge({(b, w): now + x for b in block_hashes(arg)})
        if kind in ("insert", "kv", "merge"):
            seen += block_hashes(arg)
        assert mesh.export() == runs.export()
        assert mesh.live_blocks == runs.live_blocks
        assert mesh.digest() == mesh.recompute_digest()


refresh_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), node, prompts, st.sampled_from(WORKERS), st.integers(0, 2)),
        # a KV "stored" event: the engine's stream reaches every node (at the same time here)
        st.tuples(st.just("kv"), node, prompts, st.sampled_from(WORKERS), st.integers(0, 2)),
        st.tuples(st.just("gossip"), node, st.just([]), st.just(""), st.integers(0, 2)),
        st.tuples(st.just("deliver"), node, st.just([]), st.just(""), st.integers(0, 99)),
    ),
    max_size=40,
)


@REPLICAS
@settings(max_examples=150, deadline=None)
@given(refresh_ops, st.sampled_from([3.0, 7.0]), st.sampled_from([0.0, 4.0, 20.0]))
def test_without_slot_move_re_sends_replicas_agree_once_every_delta_arrived(
    Rep: Replica,
    Local: type[PrefixIndex],
    acts: list[tuple[str, int, list[int], str, int]],
    g: float,
    refresh: float,
) -> None:
    """Routing decisions send only their new blocks and the held ones ``refresh_s`` old (a re-access of
    a younger one in a later slot leaves it in its slot); KV events are sent by nobody (every node gets
    them). Once every delta arrived (in any order, some twice), every replica has the same digest and
    the same entries (times equal up to the slot), without any repair."""
    big = PrefixIndexConfig(capacity_blocks=1 << 20, max_age_s=1e9)
    reps = [Rep(big, IndexReplConfig(digest_granularity_s=g, refresh_s=refresh)) for _ in range(NODES)]
    inflight: list[tuple[int, list[Group]]] = []
    now = T0
    for kind, i, prompt, w, x in acts:
        now += 1.0 + x
        if kind == "insert":
            reps[i].insert(list(prompt), w, now)
        elif kind == "kv":
            for r in reps:
                r.store_token_blocks(w, prompt, now)
        elif kind == "gossip":
            for body in wire(reps[i].take_groups()):
                for j in range(NODES):
                    if j != i:
                        inflight += [(j, body)] * (1 + x % 2)
        elif inflight:
            j, body = inflight.pop(x % len(inflight))
            reps[j].apply_groups(body, now)
        for r in reps:
            assert r.digest() == r.recompute_digest()
    for i in range(NODES):  # the last deltas, then everything in flight, in order
        for body in wire(reps[i].take_groups()):
            inflight += [(j, body) for j in range(NODES) if j != i]
    for j, body in inflight:
        reps[j].apply_groups(body, now)
    for r in reps:
        assert r.digest() == reps[0].digest()
        assert r.diff(reps[0].digest()) == {}
        assert slots(r.export(), g) == slots(reps[0].export(), g)
