"""The final-delta rule of a streamed choice's Complete (``generation.final_delta_is_new``): the
servicers' two styles (tests/contract/ replays them through a node; these are the edge cases)."""

from __future__ import annotations

from shepherd.node.api.generation import final_delta_is_new


def test_smg_repeat_with_a_cumulative_count_is_not_new() -> None:
    # SMG's SGLang servicer: chunk [7, 8] then Complete [7, 8], completion_tokens the running total
    assert not final_delta_is_new([7, 8], count=5, got=5, last=[7, 8])


def test_smg_vllm_repeat_with_a_delta_count_is_not_new() -> None:
    # SMG's vLLM servicer: completion_tokens is the delta's length; the chunks were merged in one batch
    assert not final_delta_is_new([9], count=1, got=6, last=[1, 2, 9])


def test_inproc_last_delta_in_the_complete_only_is_new() -> None:
    # SGLang's in-tree server: the Complete carries a delta no chunk had
    assert final_delta_is_new([4, 5], count=2, got=3, last=[3])


def test_a_cumulative_count_tells_a_new_delta_that_looks_like_a_repeat() -> None:
    # the final delta equals the end of the last chunk ("..." then "."), the count says it is new
    assert final_delta_is_new([46], count=4, got=3, last=[46])
    assert not final_delta_is_new([46], count=3, got=3, last=[46])
