"""The native replica (``Core.replicate`` in ``_prefixcore.c``, ``NativeReplicatedPrefixIndex``): its
digest buckets against a dict model, time slots against Python's floor division, the delta buffer against
a model (through compactions, within its bound), memory sized by what is held, re-entrancy while a batch
is cut, and agreement with the Python replica (whose digest bug found on the way is pinned here too)."""

from __future__ import annotations

import gc
import math
import random
import struct
import tracemalloc
from array import array
from typing import Any

import pytest

from shepherd.policies.native_index import NATIVE_INDEX
from shepherd.policies.prefix_index import PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig, ReplicatedPrefixIndex
from shepherd.policies.prefix_replica_native import NativeReplicatedPrefixIndex
from shepherd.proto.index_wire import Group

pytestmark = pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built")
if NATIVE_INDEX:
    from shepherd.policies._prefixcore import Core

M64 = (1 << 64) - 1
BIG = PrefixIndexConfig(capacity_blocks=1 << 20, max_age_s=1e9)


def _unpack(code: str, b: bytes) -> list[Any]:
    return list(struct.unpack(f"{len(b) // 8}{code}", b))


def _model_digest(c: Any, g: float, workers: int) -> dict[int, dict[float, tuple[int, int]]]:
    """(worker, slot) -> (count, sum mod 2**64) from the entries the core holds, slots by Python."""
    out: dict[int, dict[float, tuple[int, int]]] = {}
    for w in range(workers):
        kb, tb = c.entries(w)
        d: dict[float, tuple[int, int]] = {}
        for k, t in zip(_unpack("q", kb), _unpack("d", tb), strict=True):
            sl = int(t // g) if g > 0 else t
            n, s = d.get(sl, (0, 0))
            d[sl] = (n + 1, (s + k) & M64)
        if d:
            out[w] = d
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_bucket_maps_equal_a_dict_model_after_any_operations(seed: int) -> None:
    """Open addressing with backward-shift deletion: many slots per worker (resizes, deletions that wrap),
    colliding names, -0.0, every operation that changes an entry."""
    rnd = random.Random(seed)
    g = rnd.choice([0.0, 1.0, 0.5, 7.0, 60.0, 0.1])
    c = Core(rnd.choice([4, 16, 64, 1000]))
    c.replicate(g, rnd.choice([0, 5, 50, 10**6]), rnd.random() < 0.5)
    pool = [rnd.choice([rnd.randrange(-(2**63), 2**63), rnd.randrange(-50, 50)]) for _ in range(300)]
    for _ in range(300):  # bounded
        w, op = rnd.randrange(8), rnd.random()
        t = rnd.choice([rnd.uniform(-50, 300), float(rnd.randrange(-20, 200)), -0.0, 0.0])
        if op < 0.35:
            c.insert(rnd.sample(pool, rnd.randrange(0, 40)), w, t)
        elif op < 0.6:
            n = rnd.randrange(0, 40)
            c.merge(
                w,
                [rnd.choice(pool) for _ in range(n)],
                [rnd.choice([t, rnd.uniform(-50, 300)]) for _ in range(n)],
            )
        elif op < 0.7:
            c.remove(rnd.sample(pool, rnd.randrange(0, 30)), w)
        elif op < 0.74:
            c.clear(w)
        elif op < 0.82:
            c.expire(w, rnd.uniform(-50, 300), rnd.randrange(0, 50))
        elif op < 0.88:
            c.set_capacity(w, rnd.choice([1, 3, 10, 50, 1000]))
        elif op < 0.94:
            c.take(rnd.choice([-1, 0, 1, 5, 30]))
        else:
            c.queue(w, rnd.sample(pool, rnd.randrange(0, 20)))
    assert c.digest(False) == c.digest(True) == _model_digest(c, g, 8)


def _rand_double(rnd: random.Random) -> float:
    r = rnd.random()
    if r < 0.3:
        x: float = struct.unpack("d", struct.pack("Q", rnd.getrandbits(64)))[0]
        return x if math.isfinite(x) else 1.0
    if r < 0.7:
        return rnd.uniform(-1e10, 1e10)
    return rnd.randrange(-(10**6), 10**6) * rnd.choice([0.1, 0.5, 1 / 3, 60.0, 0.01])


def test_time_slots_are_pythons_int_of_floor_division_and_exact_floats_for_granularity_0() -> None:
    rnd = random.Random(5)
    cores: dict[float, Any] = {}
    checked = 0
    for _ in range(6000):  # bounded
        g = rnd.choice([60.0, 1.0, 0.1, 0.001, 7.3, 1 / 3, 0.0, abs(_rand_double(rnd)) or 1.0])
        t = _rand_double(rnd)
        if g > 0:
            q = t // g
            if not (math.isfinite(q) and abs(q) < 2.0**63):
                continue  # beyond int64: no clock's time (the core files those under slot 0)
        c = cores.get(g)
        if c is None:
            c = cores[g] = Core(10)
            c.replicate(g, 10, False)
        c.merge(0, [1], [t])
        ((sl,),) = [d.keys() for d in c.digest(False).values()]
        c.clear(0)
        if g > 0:
            assert type(sl) is int and sl == int(t // g), (t, g, sl)
        else:
            assert type(sl) is float and sl == t, (t, sl)
        checked += 1
    assert checked > 3000
    c = Core(10)
    c.replicate(0.0, 10, False)
    c.merge(0, [1], [-0.0])
    c.insert([2], 0, 0.0)
    assert c.digest(False) == {0: {0.0: (2, 3)}}  # -0.0 and 0.0: one bucket, as one dict key in Python


def _buffer_run(seed: int, steps: int, limits: list[int]) -> None:
    """take() and pending() against a model of the delta buffer: groups per insert (blocks made or moved
    into another slot, chain order), queue, relayed merges, max_pending drops (whole, the newest too),
    partial takes, a clear skipping its worker's groups, blocks gone left out."""
    rnd = random.Random(seed)
    g = rnd.choice([1.0, 0.0])
    maxp = rnd.choice([50, 400, 5000, 10**9])
    relay = rnd.random() < 0.5
    c = Core(rnd.choice([30, 200]))
    c.replicate(g, maxp, relay)
    groups: list[list[Any]] = []  # [slot, time or None, keys, gen]
    gen = [0] * 4
    pend = [0, 0]

    def sl(t: float) -> float:
        return int(t // g) if g else t

    def close(grp: list[Any]) -> None:
        if not grp[2]:
            return
        groups.append(grp)
        pend[0] += len(grp[2])
        while pend[0] > maxp and groups:  # bounded
            old = groups.pop(0)
            pend[0] -= len(old[2])
            pend[1] += len(old[2])

    t = 0.0
    for _ in range(steps):  # bounded
        t += rnd.choice([0.0, 0.25, 0.5, 1.0])
        w, op = rnd.randrange(4), rnd.random()
        if op < 0.5:
            hs = list(dict.fromkeys(rnd.randrange(1, 400) for _ in range(rnd.randrange(1, 12))))
            rec = [k for k in hs if (o := c.last_access(k, w)) is None or sl(o) != sl(t)]
            c.insert(hs, w, t)
            close([w, t, rec, gen[w]])
        elif op < 0.65:
            n = rnd.randrange(0, 8)
            ks = [rnd.randrange(1, 400) for _ in range(n)]
            ts = [t - rnd.choice([0.0, 0.5, 3.0]) for _ in range(n)]
            rec = []
            cur: dict[int, float] = {}
            for k, x in zip(ks, ts, strict=True):
                o = cur.get(k, c.last_access(k, w))
                if o is None or x > o:
                    rec.append(k)
                    cur[k] = x
            c.merge(w, ks, ts)
            if relay:
                close([w, None, rec, gen[w]])
        elif op < 0.7:
            ks = [rnd.randrange(1, 400) for _ in range(rnd.randrange(0, 30))]
            c.queue(w, ks)
            close([w, None, ks, gen[w]])
        elif op < 0.72:
            c.clear(w)
            gen[w] += 1
        elif op < 0.8:
            lim = rnd.choice(limits)
            budget = math.inf if lim < 0 else lim
            want = []
            while budget > 0 and groups:  # bounded
                gw, gt, ks, gg = groups[0]
                if len(ks) <= budget:
                    groups.pop(0)
                    part = ks
                else:
                    part = ks[: int(budget)]
                    groups[0] = [gw, gt, ks[int(budget) :], gg]
                pend[0] -= len(part)
                budget -= len(part)
                if gg != gen[gw]:
                    continue
                sel = [(k, y) for k in part if (y := c.last_access(k, gw)) is not None]
                if sel:
                    want.append((gw, gt, [k for k, _ in sel], [x for _, x in sel] if gt is None else None))
            got = [
                (gw, gt, _unpack("q", kb), None if tb is None else _unpack("d", tb))
                for gw, gt, kb, tb in c.take(lim)
            ]
            assert got == want
        else:
            c.expire(w, t - 5, 10)
        assert c.pending() == tuple(pend)


@pytest.mark.parametrize("seed", range(3))
def test_the_delta_buffer_equals_its_model(seed: int) -> None:
    _buffer_run(seed, 3000, [-1, 1, 2, 5, 17, 100])


@pytest.mark.parametrize("seed", range(2))
def test_the_delta_buffer_equals_its_model_through_compactions(seed: int) -> None:
    """Small takes only: the buffer is never all taken, so its taken front is compacted (partially taken
    groups at the front, groups dropped by the bound) rather than started over."""
    _buffer_run(seed, 9000, [1, 2, 5, 17])


def _traced(f: Any) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        a = tracemalloc.get_traced_memory()[0]
        keep = f()
        return tracemalloc.get_traced_memory()[0] - a, keep
    finally:
        tracemalloc.stop()


def test_the_delta_buffer_stays_near_its_bound_when_nothing_takes_it() -> None:
    """without takes (a runtime not running), max_pending bounds the pending keys but the key
    array was compacted only after 1024 dropped groups: 1100 inserts of 2,000 re-sent blocks kept ~17 MB
    for a bound of 40,000 keys (320 kB)."""

    def run() -> Any:
        c = Core(1 << 20)
        c.replicate(60.0, 40_000, False)
        chain = list(range(1, 2001))
        for i in range(1100):  # a new time slot each turn: every block is sent again
            c.insert(chain, 0, 1000.0 + 61.0 * i)
        return c

    grown, c = _traced(run)
    assert c.pending()[0] <= 40_000
    index = 2000 * 200  # the index's own arrays for 2,000 blocks, generously
    assert grown < index + 4 * 8 * (40_000 + 2000), grown


def test_digest_maps_are_sized_by_the_slots_they_hold() -> None:
    """an insert, a merge of one time or a repair queue of n blocks reserved room for n new
    buckets (and a merge without relay n delta keys), kept for good: ~18 MB here, against ~2 MB of
    delta keys the insert and the queue need."""

    def run(replicated: bool) -> Any:
        c = Core(1 << 20)
        if replicated:
            c.replicate(60.0, 1 << 30, False)
        c.insert(list(range(1, 100_001)), 0, 1000.0)  # one slot
        c.merge(1, list(range(1, 100_001)), [1000.0] * 100_000)  # one slot
        c.queue(2, list(range(1, 50_001))) if replicated else None
        c.take(-1) if replicated else None
        return c

    plain, _ = _traced(lambda: run(False))
    repl, c = _traced(lambda: run(True))
    assert sum(len(d) for d in c.digest(False).values()) == 2
    assert repl - plain < 4 * 8 * 100_000, (repl, plain)  # the delta keys (doubling), and a little


def test_digest_reads_its_flag_once_and_raises_its_error() -> None:
    """the flag was read for each of the 64 slots, an error in it came out as SystemError."""
    c = Core(10)
    c.replicate(1.0, 100, False)
    c.insert([1, 2], 0, 5.0)
    calls: list[int] = []

    class Flag:
        def __bool__(self) -> bool:
            calls.append(1)
            return True

    assert c.digest(Flag()) == {0: {5: (2, 3)}} and len(calls) == 1  # type: ignore[arg-type]

    class Bad:
        def __bool__(self) -> bool:
            raise ValueError("no truth")

    with pytest.raises(ValueError, match="no truth"):
        c.digest(Bad())  # type: ignore[arg-type]


def test_finalizers_that_change_the_core_while_a_batch_is_cut_leave_it_consistent() -> None:
    """A collection inside take()/digest()/entries() runs finalizers that insert, merge, clear and take."""
    rnd = random.Random(3)
    c = Core(50)
    c.replicate(1.0, 300, True)

    def mutate() -> None:
        w, t = rnd.randrange(4), rnd.uniform(0, 100)
        op = rnd.randrange(5)
        if op == 0:
            c.insert([rnd.randrange(1, 3000) for _ in range(rnd.randrange(1, 200))], w, t)
        elif op == 1:
            c.merge(w, [rnd.randrange(1, 3000) for _ in range(40)], [rnd.uniform(0, 100) for _ in range(40)])
        elif op == 2:
            c.clear(w)
        elif op == 3:
            c.take(rnd.choice([-1, 3, 50]))
        else:
            c.queue(w, [rnd.randrange(1, 3000) for _ in range(rnd.randrange(0, 300))])

    class Bomb:
        def __init__(self) -> None:
            self.me = self  # a cycle: freed by the collector

        def __del__(self) -> None:
            mutate()

    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(800):  # bounded
            for _ in range(3):
                Bomb()
            op = rnd.randrange(4)
            if op == 0:
                c.take(rnd.choice([-1, 1, 7, 100]))
            elif op == 1:
                c.digest(rnd.random() < 0.5)
            elif op == 2:
                c.entries(rnd.randrange(4))
            else:
                c.insert(
                    [rnd.randrange(1, 3000) for _ in range(rnd.randrange(1, 300))], rnd.randrange(4), 50.0
                )
    finally:
        gc.set_threshold(*old)
    gc.collect()
    assert c.digest(False) == c.digest(True)
    p, d = c.pending()
    assert p >= 0 and d >= 0


# -- the native replica against the Python one, where their semantics agree ---------------------------


def _flat(groups: list[Group]) -> list[tuple[str, int, float]]:
    return sorted(
        (w, h, t if isinstance(t, float) else t[i]) for w, t, hs in groups for i, h in enumerate(hs)
    )


@pytest.mark.parametrize("seed", range(25))
def test_the_native_replica_agrees_with_the_python_one(seed: int) -> None:
    """Local inserts (no eviction), merges of groups without repeated blocks, repair queues: the same
    batches (the local inserts' groups exactly, chain order), entries, digests, diffs, counts."""
    rnd = random.Random(seed)
    g = rnd.choice([0.0, 1.0, 10.0, 60.0])
    rc = IndexReplConfig(digest_granularity_s=g, relay=rnd.random() < 0.5, max_future_s=1e9)
    a, b = ReplicatedPrefixIndex(BIG, rc), NativeReplicatedPrefixIndex(BIG, rc)
    workers = [f"w{i}" for i in range(4)]
    chains = [[rnd.randrange(-(2**63), 2**63) for _ in range(rnd.randrange(1, 12))] for _ in range(12)]
    now = 1000.0
    merged = False  # after merges the Python replica sends a chain's moved blocks before its new ones
    for _ in range(120):  # bounded
        now += rnd.choice([0.0, 0.3, 1.0, 5.0, 30.0, 61.0])
        op, w = rnd.random(), rnd.choice(workers)
        if op < 0.4:
            ch = rnd.choice(chains)
            ch = ch[: rnd.randrange(1, len(ch) + 1)]
            a.insert_blocks(ch, w, now)
            b.insert_blocks(ch, w, now)
        elif op < 0.6:
            hs = array(
                "q", dict.fromkeys(rnd.choice(rnd.choice(chains)) for _ in range(rnd.randrange(0, 10)))
            )
            t: float | array[float] = (
                now - rnd.choice([0.0, 1.0, 100.0])
                if rnd.random() < 0.5
                else array("d", [now - rnd.choice([0.0, 1.0, 100.0, 500.0]) for _ in hs])
            )
            assert a.apply_groups([(w, t, hs)], now) == b.apply_groups([(w, t, hs)], now)
            merged = merged or len(hs) > 0
        elif op < 0.7:
            d = a.digest()
            sel = {ww: set(rnd.sample(sorted(x), min(len(x), 2))) for ww, x in d.items()}
            assert a.queue_repair(sel) == b.queue_repair(sel)
        elif op < 0.85:
            ta, tb = a.take_groups(), b.take_groups()
            assert _flat(ta) == _flat(tb)
            if not merged:  # one group per request, in chain order (repair groups: in either's order)
                sa = [(w, t, list(hs)) for w, t, hs in ta if isinstance(t, float)]
                assert sa == [(w, t, list(hs)) for w, t, hs in tb if isinstance(t, float)]
        assert (a.pending, a.pending_dropped) == (b.pending, b.pending_dropped)
        assert a.export() == b.export()
        da = a.digest()
        assert da == b.digest() == a.recompute_digest() == b.recompute_digest()
        sel = {ww: set(list(x)[:2]) for ww, x in da.items()}
        assert _flat(a.entries_in(sel)) == _flat(b.entries_in(sel))
        remote = {ww: {s: (n + 1, v) for s, (n, v) in x.items()} for ww, x in da.items()}
        assert a.diff(remote, now) == b.diff(remote, now)
    assert _flat(a.take_groups()) == _flat(b.take_groups())
    assert _flat(a.entries_in()) == _flat(b.entries_in())


def test_a_negative_limit_takes_nothing_as_in_the_python_replica() -> None:
    """the wrapper passed a negative limit on to the core, where -1 means everything."""
    for cls in (ReplicatedPrefixIndex, NativeReplicatedPrefixIndex):
        ix = cls(BIG, IndexReplConfig())
        ix.insert_blocks([1, 2, 3], "w", 100.0)
        assert ix.take_groups(-1) == [] and ix.take_groups(0) == []
        assert ix.pending == 3


def test_python_replica_digest_survives_a_repeated_held_block() -> None:
    """a group naming a held block twice, at rising times, removed its term
    from a bucket it had not reached yet; the emptied bucket was deleted with the sum of the others."""
    for cls in (ReplicatedPrefixIndex, NativeReplicatedPrefixIndex):
        ix = cls(BIG, IndexReplConfig(digest_granularity_s=60.0, max_future_s=1e9))
        ix.apply_groups([("w0", 1550.1, array("q", [107]))], 1550.1)
        ix.insert_blocks([110], "w0", 2225.9)  # slot 37
        ix.apply_groups([("w0", array("d", [2252.5, 2351.5]), array("q", [107, 107]))], 2352.5)
        assert ix.digest() == ix.recompute_digest(), cls.__name__
