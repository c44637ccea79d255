"""KV events applied from their wire bytes in C (``kv_codec.decode_kv_wire`` -> ``WireEvents``,
``kv_events.NativeKvApplier`` / ``_prefixcore.KvMap.apply``) against the Python path (protobuf's parse,
``decode_kv_batch``, ``KvEventApplier``): the same index state, map (entries and order) and feed counts
on random event streams; and ``_kvwire.kv_scan`` against protobuf's parse on random and mutated bytes."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2

from shepherd.node.dispatch.kv_feed import SmallPageApplier, WorkerKvState
from shepherd.policies.kv_events import KvEventApplier, NativeKvApplier
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex, make_replica
from shepherd.proto.engine_types import EngineLoad
from shepherd.proto.kv_codec import WireEvents, decode_kv_batch, decode_kv_wire, decode_load, kv_scan
from tests.colliding_keys import colliding_keys
from tests.mutate import mutated

pytestmark = pytest.mark.skipif(not NATIVE_INDEX or kv_scan is None, reason="the C extensions are not built")

INT64 = (-(1 << 63), (1 << 63) - 1)


def _stream(rng: random.Random, batches: int) -> list[bytes]:
    """A random stream of one engine's KvEventBatch messages: chains stored after known, unknown or no
    parents (hashes reused now and then), partial blocks, removals of known and unknown hashes, remote
    pools' events, "cleared", events without data, block sizes that change, load records."""
    known: list[int] = []
    size = rng.choice([16, 16, 32, 48])
    out: list[bytes] = []
    for seq in range(1, batches + 1):  # bounded
        events: list[Any] = []
        for _ in range(rng.randint(1, 4)):  # bounded
            r = rng.random()
            if r < 0.03:
                size = rng.choice([16, 32, 8, 48])  # another page size: another applier
            ev = common_pb2.KvCacheEvent(event_id=rng.randrange(1 << 20))
            if r < 0.6:
                blocks = []
                for i in range(rng.randint(0 if rng.random() < 0.03 else 1, 4)):  # bounded
                    # now and then a hash stored again: mapped anew, in place
                    h = rng.choice(known) if known and rng.random() < 0.1 else rng.randint(*INT64)
                    known.append(h)
                    n = size if rng.random() < 0.9 else rng.randrange(size)  # a partial last block
                    big = rng.random() < 0.05
                    toks = [rng.randrange(1 << 32) if big else rng.randrange(40) for _ in range(n)]
                    bs = 0 if rng.random() < 0.1 else size  # 0: the size is the first block's token count
                    blocks.append(common_pb2.KvBlock(block_hash=h, token_ids=toks, block_size=bs))
                    if i and n != size:
                        break
                stored = common_pb2.KvBlocksStored(blocks=blocks)
                p = rng.random()
                if p < 0.6 and known:
                    stored.parent_block_hash = rng.choice(known)
                elif p < 0.7:
                    stored.parent_block_hash = rng.randint(*INT64)
                if rng.random() < 0.05:
                    stored.locality = rng.choice([1, 2])
                if rng.random() < 0.05:
                    stored.medium = "GPU"
                ev.stored.CopyFrom(stored)
            elif r < 0.92:
                hs = [
                    rng.choice(known) if known and rng.random() < 0.8 else rng.randint(*INT64)
                    for _ in range(rng.randint(0, 6))
                ]
                removed = common_pb2.KvBlocksRemoved(block_hashes=hs)
                if rng.random() < 0.05:
                    removed.locality = rng.choice([1, 2])
                ev.removed.CopyFrom(removed)
            elif r < 0.97:
                ev.cleared.CopyFrom(common_pb2.KvCacheCleared())
            events.append(ev)  # (r >= 0.97: an event without data)
        msg = common_pb2.KvEventBatch(sequence_number=seq, timestamp=float(seq), events=events)
        if rng.random() < 0.5:
            msg.load.CopyFrom(
                common_pb2.EngineLoad(
                    running_requests=rng.randrange(9),
                    waiting_requests=rng.randrange(1 << 32),
                    token_usage=rng.random(),
                    gen_throughput=rng.random() * 100,
                    max_running_requests=rng.randrange(300),
                    sample=seq,
                    load_only=rng.random() < 0.3,
                )
            )
            if rng.random() < 0.5:  # the telemetry
                msg.load.max_total_num_tokens = rng.randrange(1 << 31)
                msg.load.num_used_tokens = rng.randint(-(1 << 31), (1 << 31) - 1)
                msg.load.cache_hit_rate = rng.random()
                msg.load.waiting_uncached_tokens = rng.randrange(1 << 32)
            if rng.random() < 0.1:  # nested telemetry: protobuf parses the record
                msg.load.memory.SetInParent()
        out.append(msg.SerializeToString())
    return out


def _map_of(state: WorkerKvState) -> tuple[str, list[int]]:
    a = state._applier
    if a is None:
        return ("none", [])
    if isinstance(a, NativeKvApplier):
        return (f"blocks{a.per_block}", a.engine_hashes())
    if isinstance(a, KvEventApplier):
        return (f"blocks{a.per_block}", list(a._names))
    assert isinstance(a, SmallPageApplier)
    return (f"pages{a.block_size}", list(a._pages))


def _index_state(ix: PrefixIndex) -> tuple[Any, ...]:
    out: tuple[Any, ...] = (
        ix.export(),
        ix.workers,
        ix.live_blocks,
        [ix.worker_blocks(w) for w in ix.workers],
    )
    if isinstance(ix, NativeReplicatedPrefixIndex):
        out += (ix.digest(), ix.pending)
    return out


def _run(seed: int, replica: bool) -> None:
    rng = random.Random(seed)
    config = PrefixIndexConfig(capacity_blocks=rng.choice([8, 64, 1 << 16]))
    max_blocks = rng.choice([3, 16, 64, 1 << 18])
    indexes = [make_replica(config) if replica else NativePrefixIndex(config) for _ in range(2)]
    streams = {w: _stream(rng, rng.randint(1, 40)) for w in ("w0", "w1")}
    states = [
        {w: WorkerKvState(ix, w, clock=lambda: 100.0, max_blocks=max_blocks) for w in streams}
        for ix in indexes
    ]
    order = [w for w, msgs in streams.items() for _ in msgs]
    rng.shuffle(order)
    pos = dict.fromkeys(streams, 0)
    wired = 0
    for w in order:  # the two workers' batches interleaved
        raw = streams[w][pos[w]]
        pos[w] += 1
        ref = decode_kv_batch(common_pb2.KvEventBatch.FromString(raw))
        fast = decode_kv_wire(raw)
        wired += isinstance(fast.events, WireEvents)
        assert (fast.sequence_number, fast.load, fast.load_only, len(fast.events)) == (
            ref.sequence_number,
            ref.load,
            ref.load_only,
            len(ref.events),
        )
        assert tuple(fast.events) == ref.events
        assert states[0][w].apply(ref) == states[1][w].apply(fast)
        for sw in streams:
            assert _map_of(states[0][sw]) == _map_of(states[1][sw])
            assert states[0][sw].stats == states[1][sw].stats
        assert _index_state(indexes[0]) == _index_state(indexes[1])
    assert wired > 0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 32))
def test_wire_path_holds_the_python_path_state(seed: int) -> None:
    _run(seed, replica=False)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1 << 32))
def test_wire_path_holds_the_python_path_state_on_the_mesh_replica(seed: int) -> None:
    _run(seed, replica=True)


def test_the_wire_path_is_taken() -> None:
    """A plain stream is applied by the native applier, the events never decoded as Python objects."""
    ix = NativePrefixIndex()
    state = WorkerKvState(ix, "w", clock=lambda: 1.0)
    toks = list(range(64))
    first = common_pb2.KvEventBatch(
        sequence_number=1,
        events=[
            common_pb2.KvCacheEvent(
                stored=common_pb2.KvBlocksStored(
                    blocks=[
                        common_pb2.KvBlock(block_hash=h, token_ids=toks[i * 16 : i * 16 + 16], block_size=16)
                        for i, h in enumerate((11, 12))
                    ]
                )
            )
        ],
    )
    second = common_pb2.KvEventBatch(
        sequence_number=2,
        events=[
            common_pb2.KvCacheEvent(
                stored=common_pb2.KvBlocksStored(
                    blocks=[common_pb2.KvBlock(block_hash=13, token_ids=toks[32:48], block_size=16)],
                    parent_block_hash=12,
                )
            ),
            common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=[13])),
            common_pb2.KvCacheEvent(
                stored=common_pb2.KvBlocksStored(
                    blocks=[common_pb2.KvBlock(block_hash=14, token_ids=toks[32:48], block_size=16)],
                    parent_block_hash=12,
                )
            ),
        ],
    )
    b1 = decode_kv_wire(first.SerializeToString())
    assert isinstance(b1.events, WireEvents)
    ref = decode_kv_batch(first)  # read as a sequence, the same batch as protobuf's path
    assert b1 == ref and hash(b1) == hash(ref) and b1.events[0] == ref.events[0]
    b1 = decode_kv_wire(first.SerializeToString())
    state.apply(b1)
    assert isinstance(state._applier, NativeKvApplier)
    b2 = decode_kv_wire(second.SerializeToString())
    assert isinstance(b2.events, WireEvents)
    state.apply(b2)
    assert b2.events._decoded is None  # applied from the bytes
    assert ix.match(toks) == {"w": 48}
    assert state._applier.engine_hashes() == [11, 12, 14]
    assert (state.stats.events, state.stats.stored_blocks, state.stats.removed_blocks) == (4, 4, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 32), st.integers(1, 6))
def test_kv_scan_reads_what_protobuf_parses_and_the_wire_path_fails_where_it_fails(
    seed: int, flips: int
) -> None:
    rng = random.Random(seed)
    data = mutated(rng, _stream(rng, 1)[0], flips)
    try:
        msg = common_pb2.KvEventBatch.FromString(data)
    except DecodeError:  # refused by the scan, or its load record is (which protobuf parses alone)
        with pytest.raises(DecodeError):
            decode_kv_wire(data)
        return
    assert kv_scan is not None
    head = kv_scan(data)
    if head is None:
        return
    ref = decode_kv_batch(msg)
    seq, n, lo, hi, fields = head
    assert seq == msg.sequence_number
    assert n == len(ref.events)
    assert (lo >= 0) == msg.HasField("load")
    if lo >= 0:
        assert common_pb2.EngineLoad.FromString(data[lo:hi]) == msg.load
    if fields is not None:
        assert EngineLoad(*fields[:8]) == decode_load(msg.load) and fields[8] == msg.load.load_only
    # and the C path applies it as the Python path does
    a, b = NativePrefixIndex(), NativePrefixIndex()
    sa, sb = WorkerKvState(a, "w", clock=lambda: 1.0), WorkerKvState(b, "w", clock=lambda: 1.0)
    prime = _stream(random.Random(seed + 1), 3)
    for p in prime:
        sa.apply(decode_kv_batch(common_pb2.KvEventBatch.FromString(p)))
        sb.apply(decode_kv_wire(p))
    sa.apply(ref)
    sb.apply(decode_kv_wire(data))
    assert _index_state(a) == _index_state(b)
    assert sa.stats == sb.stats


def test_empty_packed_fields_apply_as_protobuf_reads_them() -> None:
    """Protobuf takes a packed field of length 0 (another encoder may write one): a removal naming no
    block and a block whose token ids come unpacked after an empty packed run apply on the wire path as
    on protobuf's (they raised in C, after applying the batch's earlier events)."""
    toks = list(range(16))
    block = b"\x08\x07\x12\x00" + b"".join(b"\x10" + bytes([t]) for t in toks) + b"\x18\x10"  # hash 7
    stored = b"\x0a" + bytes([len(block)]) + block
    events = [
        b"\x12" + bytes([len(stored)]) + stored,  # KvCacheEvent.stored
        b"\x1a\x02\x0a\x00",  # KvCacheEvent.removed, block_hashes packed and empty
    ]
    raw = b"\x08\x01" + b"".join(b"\x1a" + bytes([len(e)]) + e for e in events)
    ref = decode_kv_batch(common_pb2.KvEventBatch.FromString(raw))
    assert len(ref.events) == 2
    ixs = [NativePrefixIndex(), NativePrefixIndex()]
    states = [WorkerKvState(ix, "w", clock=lambda: 1.0) for ix in ixs]
    fast = decode_kv_wire(raw)
    assert isinstance(fast.events, WireEvents)  # kv_scan takes it: the C path applies it
    assert states[0].apply(ref) == states[1].apply(fast)
    assert ixs[0].match(toks) == ixs[1].match(toks) == {"w": 16}
    assert states[0].stats == states[1].stats


def test_a_kv_map_made_without_init_is_empty_not_a_zero_divisor() -> None:
    kv_map = pytest.importorskip("shepherd.policies._prefixcore").KvMap
    m = kv_map.__new__(kv_map)
    assert len(m) == 0
    m.put([1], [1])
    assert m.keys() == [1]


def test_engine_hashes_chosen_to_collide_do_not_flood_the_kv_map() -> None:
    """An engine's block hashes are the map's keys: hashes whose fixed-hash values share their low 20 bits
    (every one in one probe run at any table size up to 2**20) made each put scan the run (~n**2 / 2 cells
    stepped past). Hashed under a per-process key, they take a few cells each, and the map is the same."""
    kv_map = pytest.importorskip("shepherd.policies._prefixcore").KvMap
    n = 3000
    keys = colliding_keys(n, 7)
    assert len(set(keys)) == n
    m = kv_map(1, 1 << 20)
    m.put(keys, list(range(n)))
    assert m.keys() == keys
    assert all(m.seed(k) == i for i, k in enumerate(keys[:50]))
    assert m.pop(keys[::2]) == list(range(0, n, 2))
    assert m.keys() == keys[1::2]
    assert m.probes() < 8 * n  # (a flooded run: ~4.5M)


def test_block_names_chosen_to_collide_get_keyed_places_in_the_index() -> None:
    """Block names come from token ids a client chooses: names ground to share the low 20 bits of the
    fixed mixer (one probe run in the index's table and in ``Turns``) are placed under a per-process key
    instead, so they spread; the index still finds every one of them."""
    core = pytest.importorskip("shepherd.policies._prefixcore")
    n = 3000
    names = colliding_keys(n, 11)
    places = {core.place_of(k) & ((1 << 20) - 1) for k in names}
    assert len(places) > 0.99 * n - 10  # (under the fixed mixer: 1)
    c = core.Core(1 << 16)
    c.set_name(0, "w0")
    assert c.insert(names, 0, 1.0) == 0  # (nothing evicted)
    assert c.match(names) == {"w0": n}
    assert c.count(0) == n


def test_the_index_places_are_keyed_per_process() -> None:
    """Two processes place the same name differently (the key is drawn from os.urandom at import)."""
    pytest.importorskip("shepherd.policies._prefixcore")
    code = "from shepherd.policies._prefixcore import place_of; print(place_of(12345), place_of(-7))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        for _ in range(2)
    }
    assert len(runs) == 2
