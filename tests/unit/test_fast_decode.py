"""The byte-table decoder gives HF's decode, ids from anywhere in the vocabulary, special or not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.tokens.fast_decode import ByteDecoder
from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import gpt2, llama, qwen3

LOADERS: dict[str, Callable[[], Tokenizer]] = {"qwen3": qwen3, "llama": llama, "gpt2": gpt2}


@pytest.mark.parametrize("name", sorted(LOADERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_fast_decode_equals_hf(name: str, data: st.DataObject, skip: bool) -> None:
    tok = LOADERS[name]()
    assert tok.build_fast_decoder()
    size = tok.vocab_size
    special = sorted(tok.special_token_ids)
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(0, size - 1), st.sampled_from(special or [0]), st.integers(0, 300)),
            max_size=40,
        )
    )
    assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_text_round_trips_and_out_of_vocabulary_ids_fall_back() -> None:
    tok = qwen3()
    assert tok.build_fast_decoder()
    text = "Hello Ünïcödé ✓ 日本語 🤖<|im_end|> done"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == tok.hf.decode(ids, skip_special_tokens=True)
    odd = [*ids[:3], tok.vocab_size + 5]
    assert tok.decode(odd) == tok.hf.decode(odd)


def test_split_multibyte_characters_are_replaced_like_hf() -> None:
    tok = gpt2()
    assert tok.build_fast_decoder()
    ids = tok.encode("日本語 🤖", add_special_tokens=False)
    for cut in range(len(ids) + 1):
        assert tok.decode(ids[:cut]) == tok.hf.decode(ids[:cut])


def test_non_byte_level_decoders_are_refused() -> None:
    import tokenizers

    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.decoder = tokenizers.decoders.WordPiece()
    assert ByteDecoder.build(hf) is None
