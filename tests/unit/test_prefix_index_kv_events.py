"""KV events (stored / removed / cleared) with opaque engine hashes, applied to the prefix index."""

from __future__ import annotations

import pytest

from shepherd.policies.block_names import block_hashes
from shepherd.policies.kv_events import KvEventApplier
from shepherd.policies.prefix_index import PrefixIndex
from tests.unit.index_layouts import LAYOUTS

IDS = list(range(500, 596))  # 6 blocks of 16
Index = type[PrefixIndex]


@pytest.fixture(params=LAYOUTS)
def Ix(request: pytest.FixtureRequest) -> Index:
    cls: Index = request.param
    return cls


def test_stored_events_chain_through_engine_parents(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w")
    assert kv.stored([901, 902], None, IDS[:32], now=1.0)
    assert kv.stored([903, 904, 905], 902, IDS[32:80], now=2.0)
    assert ix.match(IDS) == {"w": 80}
    # the names are the ones routing decisions use: a routed insert of the same prompt is the same entry
    assert set(ix.export()) == {(h, "w") for h in block_hashes(IDS[:80])}


def test_unknown_parent_is_not_applied(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w")
    assert not kv.stored([7], 12345, IDS[:16], now=1.0)
    assert ix.live_blocks == 0


def test_removed_and_cleared(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w")
    kv.stored([1, 2, 3], None, IDS[:48], now=1.0)
    kv.removed([3, 99])  # 99: never stored
    assert ix.match(IDS) == {"w": 32}
    assert len(kv) == 2
    kv.cleared()
    assert ix.match(IDS) == {}
    assert len(kv) == 0


def test_engine_blocks_of_32_tokens(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w", block_size=32)
    kv.stored([1, 2], None, IDS[:64], now=1.0)
    kv.stored([3], 2, IDS[64:96], now=1.0)
    assert ix.match(IDS) == {"w": 96}
    kv.removed([3])
    assert ix.match(IDS) == {"w": 64}
    with pytest.raises(ValueError):
        KvEventApplier(ix, "w", block_size=24)


def test_short_event_and_bounded_map(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w", max_blocks=3)
    kv.stored([1, 2], None, IDS[:20], now=1.0)  # tokens for one block only: block 2 is not mapped
    assert len(kv) == 1
    kv.stored([3, 4, 5], 1, IDS[16:64], now=2.0)
    assert len(kv) == 3  # the oldest (1) dropped from the map
    assert not kv.stored([6], 1, IDS[64:80], now=3.0)
    assert kv.stored([6], 5, IDS[64:80], now=3.0)
    assert ix.match(IDS) == {"w": 80}


def test_the_index_does_not_depend_on_the_engines_hash_function(Ix: Index) -> None:
    # two engines naming the same blocks differently (vLLM salts per process): the same index entries,
    # the same ones a routing decision makes
    a, b, routed = Ix(), Ix(), Ix()
    kv_a, kv_b = KvEventApplier(a, "w"), KvEventApplier(b, "w")
    kv_a.stored([11, 12], None, IDS[:32], now=1.0)
    kv_a.stored([13, 14, 15, 16], 12, IDS[32:], now=1.0)
    kv_b.stored([-7, 2**63 - 1], None, IDS[:32], now=1.0)
    kv_b.stored([0, 5, 9, 1], 2**63 - 1, IDS[32:], now=1.0)
    routed.insert(IDS, "w", 1.0)
    assert a.export() == b.export() == routed.export()
    kv_a.removed([16])
    kv_b.removed([1])
    assert a.export() == b.export()


def test_a_full_map_drops_its_oldest_entries_in_bulk(Ix: Index) -> None:
    ix = Ix()
    kv = KvEventApplier(ix, "w", max_blocks=64)
    ids = list(range(16 * 200))
    parent = None
    for i in range(200):  # one block per event, each after the previous one
        assert kv.stored([1000 + i], parent, ids[16 * i : 16 * i + 16], now=float(i))
        parent = 1000 + i
        assert len(kv) <= 64
    assert len(kv) >= 64 - 64 // 16
    assert not kv.stored([5000], 1000, ids[:16], now=300.0)  # an old parent: forgotten
    assert kv.stored([5001], 1199, ids[:16], now=300.0)  # a recent one: known
    assert ix.match(ids) == {"w": 16 * 200}  # the index itself is not bounded by the map
