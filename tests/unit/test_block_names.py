"""Naming blocks through the piece memo gives exactly ``block_hashes`` (any pieces, any history)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.policies.block_names import CHAIN_SEED, BlockNamer, block_hashes
from shepherd.proto.prompt_ids import PromptIds

# a small "tokenizer": each piece key always stands for the same ids
PIECES = {
    f"p{i}": [1000 * i + j for j in range(n)] for i, n in enumerate([0, 1, 5, 15, 16, 17, 31, 40, 64, 3])
}
KEYS = sorted(PIECES)


def prompt(keys: list[str]) -> PromptIds:
    ids = [t for k in keys for t in PIECES[k]]
    return PromptIds(ids, tuple((k, len(PIECES[k])) for k in keys))


prompts = st.lists(st.lists(st.sampled_from(KEYS), min_size=0, max_size=8), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(prompts, st.integers(1, 40), st.integers(1, 60))
def test_memo_names_equal_plain_names(seq: list[list[str]], max_entries: int, max_hashes: int) -> None:
    namer = BlockNamer(block_hashes, CHAIN_SEED, max_entries=max_entries, max_hashes=max_hashes)
    for keys in seq:
        ids = prompt(keys)
        assert namer.names(ids) == block_hashes(ids)
        assert len(namer) <= max_entries and namer.kept_hashes <= max_hashes


def test_a_follow_up_turn_is_named_from_the_memo() -> None:
    namer = BlockNamer(block_hashes, CHAIN_SEED)
    first = prompt(["p8", "p7", "p6"])
    assert namer.names(first) == block_hashes(first)
    follow = prompt(["p8", "p7", "p6", "p5", "p2"])
    hits = namer.hits
    assert namer.names(follow) == block_hashes(follow)
    assert namer.hits - hits == 3  # the three pieces of the earlier turn


def test_shapes_that_do_not_describe_the_ids_are_ignored() -> None:
    namer = BlockNamer(block_hashes, CHAIN_SEED)
    ids = prompt(["p8", "p7"])
    assert namer.names(ids) == block_hashes(ids)
    wrong = PromptIds(list(ids) + [7] * 20, ids.shape)  # more ids than the pieces say
    assert namer.names(wrong) == block_hashes(wrong)
    short = PromptIds(list(ids)[:-3], (("p8", 64), ("x", 37)))
    assert namer.names(short) == block_hashes(short)
    assert namer.names(list(ids)) == block_hashes(ids)  # a plain list: no shape


def test_a_full_memo_drops_its_oldest_pieces_in_bulk_and_keeps_the_recent_ones() -> None:
    namer = BlockNamer(block_hashes, CHAIN_SEED, max_entries=64, max_hashes=1 << 20)
    prompts = [PromptIds(list(range(100 * i, 100 * i + 40)), ((f"k{i}", 40),)) for i in range(200)]
    for p in prompts:
        assert namer.names(p) == block_hashes(p)
        assert len(namer) <= 64
    assert len(namer) >= 64 - 64 // 16  # trimmed a sixteenth below the bound at a time, not to nothing
    hits = namer.hits
    for p in prompts[-len(namer) :]:  # the most recent pieces are all still there
        assert namer.names(p) == block_hashes(p)
    assert namer.hits - hits == len(namer)
