"""vLLM's ``truncate_prompt_tokens`` on a text: cut as the tokenizer's own truncation cuts it (vLLM's
tokenizer call with ``truncation=True, max_length``): the special tokens around the text kept (a BERT's
``[CLS]``/``[SEP]``, the end token a last-token-pooling model reads its vector from), the content cut on
the tokenizer's ``truncation_side``."""

from __future__ import annotations

from shepherd.node.api.embeddings import _truncated

CLS, SEP = 101, 102


def test_the_specials_around_the_text_are_kept() -> None:
    ids, content = [CLS, 1, 2, 3, 4, SEP], [1, 2, 3, 4]
    assert _truncated(ids, content, 4, left=False) == [CLS, 1, 2, SEP]
    assert _truncated(ids, content, 4, left=True) == [CLS, 3, 4, SEP]
    assert _truncated([1, 2, 3, 4, SEP], content, 3, left=False) == [1, 2, SEP]  # an end token only


def test_without_specials_or_room_for_them_it_is_a_plain_cut() -> None:
    assert _truncated([1, 2, 3, 4], [1, 2, 3, 4], 2, left=False) == [1, 2]
    assert _truncated([1, 2, 3, 4], [1, 2, 3, 4], 2, left=True) == [3, 4]
    assert _truncated([CLS, 1, 2, SEP], [1, 2], 2, left=False) == [CLS, SEP]
    assert _truncated([CLS, 9, 9, SEP], [1, 2], 2, left=False) == [CLS, 9]  # (content not found in it)
