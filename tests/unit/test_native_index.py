"""The compiled parts of the prefix index: built where CI runs, equal to their Python references at
scale (table growth, deletions that shift probe chains), and their edges (64-bit names, 64 workers)."""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import textwrap
from array import array
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.policies.block_names import CHAIN_SEED, NATIVE_NAMES, block_hashes, py_block_hashes
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig
from tests.services import IN_CI

needs_core = pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built")


def test_the_compiled_parts_are_built_in_ci() -> None:
    # an install without a compiler falls back to the Python layouts; CI must not do so silently
    if os.environ.get("CI"):
        from shepherd.proto.engine_requests import _c_packed

        assert NATIVE_NAMES and NATIVE_INDEX and _c_packed is not None


ints = st.one_of(
    st.integers(0, 200_000),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, -2, 0, 2**30 - 1, 2**30, -(2**30), 2**61 - 1, 2**61, 2**63, -(2**63), True, False]),
)


@pytest.mark.skipif(not NATIVE_NAMES, reason="_prefixcore not built")
@settings(max_examples=300, deadline=None)
@given(
    st.lists(ints, max_size=90),
    st.one_of(st.just(CHAIN_SEED), st.integers(-(2**80), 2**80)),
    st.integers(0, 40),
)
def test_c_block_names_equal_the_python_reference(ids: list[int], seed: int, start: int) -> None:
    assert block_hashes(ids, seed, start) == py_block_hashes(ids, seed, start)
    assert block_hashes(tuple(ids)) == py_block_hashes(ids)


WORDS = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 2**30 - 1, 2**30, 2**32 - 1]))


@pytest.mark.skipif(not NATIVE_NAMES, reason="_prefixcore not built")
@settings(max_examples=300, deadline=None)
@given(
    st.lists(WORDS, max_size=90),
    st.one_of(st.just(CHAIN_SEED), st.integers(-(2**80), 2**80)),
    st.integers(0, 120),
)
def test_c_block_names_of_a_word_array_equal_its_values_names(ids: list[int], seed: int, start: int) -> None:
    """An ``array('I')`` (``text_ids``: a relayed request's pseudo ids) is read in place, with the names
    of the same values in a list; other buffers are read as sequences, as before."""
    words = array("I", ids)
    assert block_hashes(words, seed, start) == py_block_hashes(ids, seed, start)
    assert block_hashes(words) == block_hashes(ids)
    small = [i & 0xFF for i in ids]
    assert block_hashes(array("B", small)) == block_hashes(bytes(small)) == py_block_hashes(small)
    assert block_hashes(array("q", ids)) == py_block_hashes(ids)


@pytest.mark.skipif(not NATIVE_NAMES, reason="_prefixcore not built")
def test_c_block_names_refuse_what_python_refuses() -> None:
    with pytest.raises(TypeError):
        block_hashes([[1]] * 16)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        block_hashes(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        block_hashes([1] * 32, CHAIN_SEED, -1)


class Mutating(int):
    """An id whose hash changes the list being named (the C code must not read freed items)."""

    victim: ClassVar[list[int]] = []

    def __hash__(self) -> int:
        Mutating.victim.clear()
        return 7


@pytest.mark.skipif(not NATIVE_NAMES, reason="_prefixcore not built")
def test_c_block_names_survive_a_list_changed_while_hashing() -> None:
    ids: list[int] = [Mutating(1), *range(31)]
    Mutating.victim = []
    expect = py_block_hashes(tuple(ids))  # what the C version names: the ids as they were
    Mutating.victim = ids
    assert block_hashes(ids) == expect
    assert ids == []


@needs_core
def test_native_equals_flat_at_scale_through_growth_and_deletions() -> None:
    """Thousands of blocks (the table grows several times), removals and clears (backward-shift
    deletion moves probe chains), no capacity pressure: the state is the flat layout's, entry for entry."""
    rng = random.Random(5)
    flat, native = PrefixIndex(), NativePrefixIndex()
    workers = [f"w{i}" for i in range(5)]
    systems = [rng.choices(range(50_000), k=64) for _ in range(3)]
    names: list[int] = []
    for step in range(400):  # bounded
        w = rng.choice(workers)
        now = float(step)
        if step % 37 == 36:
            for ix in (flat, native):
                ix.clear_worker(w)
            continue
        if step % 5 == 4 and names:
            gone = rng.sample(names, min(len(names), 40))
            for ix in (flat, native):
                ix.remove_blocks(gone, w)
            continue
        ids = rng.choice(systems) + rng.choices(range(50_000), k=rng.randrange(16, 800))
        names += block_hashes(ids)
        for ix in (flat, native):
            ix.insert(ids, w, now)
        if step % 50 == 0:
            assert native.export() == flat.export()
    assert native.export() == flat.export()
    assert native.live_blocks == flat.live_blocks > 2000
    for w in workers:
        assert native.worker_blocks(w) == flat.worker_blocks(w)
    for b in names[::7]:
        assert sorted(native.holders(b)) == sorted(flat.holders(b))
        for w in workers:
            assert native.last_access(b, w) == flat.last_access(b, w)


@needs_core
def test_exact_lru_takes_the_least_recent_chain_and_its_deepest_blocks_first() -> None:
    ix = NativePrefixIndex(PrefixIndexConfig(capacity_blocks=6))
    a, b = list(range(64)), list(range(1000, 1064))
    ix.insert(a, "w", 1.0)
    ix.insert(b[:32], "w", 2.0)
    ix.insert(a[:16], "w", 3.0)  # a's first block is now the most recent
    ix.insert(b, "w", 4.0)  # 4 + 4 = 8 > 6: a's two deepest blocks go
    assert ix.match(a) == {"w": 32}
    assert ix.match(b) == {"w": 64}


@needs_core
def test_names_outside_64_bits_are_never_held() -> None:
    ix = NativePrefixIndex()
    ix.insert(list(range(32)), "w", 1.0)
    with pytest.raises(OverflowError):
        ix.insert_blocks([2**64], "w", 2.0)
    ix.remove_blocks([2**64, -(2**70)], "w")
    ix.merge({(2**64, "w"): 3.0})
    assert ix.holders(2**64) == []
    assert ix.last_access(2**64, "w") is None
    assert ix.worker_blocks("w") == 2
    assert ix.match_blocks([2**64]) == {} or pytest.fail("a name outside 64 bits matched")


@needs_core
def test_more_than_64_workers_drops_the_extra_ones_until_a_slot_frees() -> None:
    ix = NativePrefixIndex()
    p = list(range(32))
    for i in range(65):
        ix.insert(p, f"w{i}", float(i))
    assert ix.dropped_inserts == 1
    assert len(ix.match(p)) == 64 and "w64" not in ix.match(p)
    ix.clear_worker("w3")
    ix.insert(p, "w64", 100.0)
    assert ix.match(p)["w64"] == 32 and "w3" not in ix.match(p)
    assert ix.workers[3] == "w64"  # the freed slot is reused


@needs_core
def test_expire_from_the_lru_tail_and_merge_places_old_entries_behind() -> None:
    ix = NativePrefixIndex(PrefixIndexConfig(capacity_blocks=4, max_age_s=10.0))
    ix.insert(list(range(32)), "w", 20.0)
    old = block_hashes(list(range(500, 532)))
    ix.merge({(old[0], "w"): 1.0, (old[1], "w"): 1.0})  # older than all: the tail
    ix.insert(list(range(900, 916)), "w", 21.0)  # 5 > 4: the oldest merged block goes
    assert ix.worker_blocks("w") == 4
    assert ix.last_access(old[1], "w") is None and ix.last_access(old[0], "w") == 1.0
    assert ix.expire(now=25.0) == 1
    assert ix.export() == {
        (h, "w"): t
        for h, t in [
            *((b, 20.0) for b in block_hashes(list(range(32)))),
            (block_hashes(list(range(900, 916)))[0], 21.0),
        ]
    }


@needs_core
@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 5), max_size=6), st.sampled_from("abc"), st.booleans()), max_size=30
    )
)
def test_a_match_then_an_insert_of_the_same_ids_names_them_once_and_holds_the_same(
    ops: list[tuple[list[int], str, bool]],
) -> None:
    """A routing decision: ``match(ids)`` keeps the names in the core and ``insert(ids)`` of the same
    object reuses them; the state is what the flat layout holds after the same inserts (also when the
    ids between them are other ones, or grew: then they are named again)."""
    flat, native = PrefixIndex(), NativePrefixIndex()
    pieces = [list(range(i * 100, i * 100 + 16)) for i in range(6)]
    for now, (shape, w, other) in enumerate(ops):
        ids = [t for p in shape for t in pieces[p]]
        assert native.match(ids) == flat.match(ids)
        if other:  # another prompt matched in between: the insert must not take its names
            native.match(pieces[0] * 3)
            ids.extend(pieces[5])
        native.insert(ids, w, float(now))
        flat.insert(list(ids), w, float(now))
        assert native.export() == flat.export()


# -- review findings: Python code run from inside the C module (conversions, hashes) and allocation failures.
# The memory-safety cases run in a child process, so that a crash fails the test instead of the run.


def run_child(code: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


@needs_core
def test_block_names_whose_index_changes_the_list_are_read_from_a_copy() -> None:
    out = run_child(
        """
        from shepherd.policies._prefixcore import Core
        class ClearsOnIndex:
            def __init__(self, victim): self.victim = victim
            def __index__(self): self.victim.clear(); return 5
        c = Core(100); c.set_name(0, "w")
        for call in (lambda hs: c.insert(hs, 0, 1.0), lambda hs: c.match(hs), lambda hs: c.remove(hs, 0)):
            hs = []
            hs += [ClearsOnIndex(hs), *range(100, 140)]
            call(hs)
        ts = []
        class ClearsOnFloat:
            def __float__(self): ts.clear(); return 1.0
        ts += [ClearsOnFloat(), *[2.0] * 40]
        c.merge(0, list(range(41)), ts)
        print(c.count(0))
        """
    )
    assert out == "41"


@needs_core
def test_a_hash_that_names_another_prompt_does_not_free_the_names_being_made() -> None:
    run_child(
        """
        from shepherd.policies._prefixcore import Core, block_hashes
        c = Core(100); c.set_name(0, "w")
        class H(int):
            def __hash__(self):
                c.match_ids(list(range(16 * 5000)))
                return 7
        ids = [H(1)] + list(range(63))
        c.match_ids(ids)
        """
    )


@needs_core
def test_export_survives_a_worker_name_whose_hash_changes_the_index() -> None:
    run_child(
        """
        from shepherd.policies._prefixcore import Core
        c = Core(100)
        done = []
        class N(str):
            def __hash__(self):
                if not done:
                    done.append(1)
                    c.remove([0, 1], 0)
                return 1
        c.set_name(0, N("w"))
        c.insert(list(range(50)), 0, 1.0)
        c.export(None)
        """
    )


@needs_core
def test_a_match_survives_a_worker_name_whose_hash_renames_its_slot() -> None:
    """A worker's name is any object: the match's answer is a dict keyed by it, whose hash may run code
    that sets the slot's name again (dropping the index's reference to the name being stored): the name is
    held while it is used (was read after it was freed), in ``match`` and in ``Turns.combine``."""
    out = run_child(
        """
        import gc
        from shepherd.policies._prefixcore import Core, Turns
        c = Core(100)
        class N(str):
            def __hash__(self):
                c.set_name(0, "other")
                return 7
        def fresh():
            c.set_name(0, N("w" * 40))
            gc.collect()
        fresh()
        c.insert(list(range(50)), 0, 1.0)
        got = []
        for _ in range(20):
            fresh()
            m = c.match(list(range(50)))
            junk = [str(i) * 40 for i in range(200)]  # where the freed name was
            got.append([str(k) for k in m])
        t = Turns(100, 60.0, 100)
        t.put((5).to_bytes(8, "little"), (1).to_bytes(2, "little"), bytes([0]), 1.0)
        for _ in range(20):
            fresh()
            m = {}
            t.combine(c, m, [5])
            junk = [str(i) * 40 for i in range(200)]
            got.append([str(k) for k in m])
        print(sorted(set(map(tuple, got))))
        """
    )
    assert out == "[('" + "w" * 40 + "',)]"


@needs_core
def test_an_uninitialised_core_raises_instead_of_crashing() -> None:
    run_child(
        """
        from shepherd.policies._prefixcore import Core
        c = Core.__new__(Core)
        calls = (lambda: c.holders(1), lambda: c.match([1]), lambda: c.export(None))
        calls += (lambda: c.insert([1], 0, 1.0),)
        for call in calls:
            try:
                call()
            except (RuntimeError, ValueError):
                pass
        """
    )


@needs_core
def test_a_failed_match_does_not_leave_its_names_for_the_next_insert() -> None:
    flat, native = PrefixIndex(), NativePrefixIndex()
    a = list(range(64))
    for ix in (flat, native):
        ix.match(a)
        with pytest.raises(TypeError):
            ix.match([[1]] * 16)  # type: ignore[list-item]
        ix.insert(a, "w", 1.0)
    assert native.export() == flat.export() != {}


@needs_core
def test_the_names_of_a_match_are_not_reused_after_an_insert_of_other_ids() -> None:
    """The flat layout's one-slot cache is replaced by the insert of other ids; so must the core's."""
    exports = []
    for ix in (PrefixIndex(), NativePrefixIndex()):
        a, b = list(range(32)), list(range(100, 132))
        ix.match(a)
        ix.insert(b, "w", 1.0)
        a[:] = range(500, 532)  # the same object, the same length, other ids
        ix.insert(a, "w", 2.0)
        exports.append(ix.export())
    assert exports[0] == exports[1]


@needs_core
def test_a_prompt_without_a_full_block_does_not_take_a_worker_slot() -> None:
    flat, native = PrefixIndex(), NativePrefixIndex()
    for ix in (flat, native):
        ix.match([1, 2, 3])
        ix.insert([1, 2, 3], "w", 1.0)
        ix.insert_blocks([], "v", 1.0)
    assert native.workers == flat.workers == []


@needs_core
def test_an_insert_that_runs_out_of_memory_leaves_no_hole_and_no_excess() -> None:
    try:  # CPython's test hooks (set_nomemory); some distributions leave them out
        _testcapi = importlib.import_module("_testcapi")
    except ImportError:
        if IN_CI:
            pytest.fail("CI=true but _testcapi (CPython's allocation-failure hooks) is missing")
        pytest.skip("_testcapi missing: the allocation-failure test cannot run (required under CI=true)")
    from shepherd.policies._prefixcore import Core

    chain = list(range(7000, 7300))
    for start in range(6):  # bounded: the first allocations of the insert
        c = Core(500)
        c.set_name(0, "w")
        c.insert(list(range(10_000, 10_700)), 0, 0.5)
        c.clear(0)
        c.insert(list(range(462)), 0, 1.0)
        c.set_name(1, "v")
        c.insert(list(range(462)), 1, 1.0)  # 924 entries: the entry array fills during the next insert
        f = c.insert
        _testcapi.set_nomemory(start, start + 1)
        try:
            f(chain, 0, 2.0)
        except MemoryError:
            pass
        finally:
            _testcapi.remove_mem_hooks()
        assert c.count(0) <= 500
        held = [k for k in chain if c.holders(k) & 1]
        assert not held or c.holders(chain[0]) & 1, f"a hole after a failure at allocation {start}"
