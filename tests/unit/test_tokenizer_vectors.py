"""llama.cpp's golden tokenizations (produced by the real HF tokenizers), through the cached path.

``*.inp`` holds strings each followed by ``\\n__ggml_vocab_test__\\n`` (so splitting leaves one empty
string at the end, whose expected line is empty too: 47 pairs, 46 distinct cases); ``*.out`` one line
of ids per string, without BOS: llama.cpp encodes them with add_special=false.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import gpt2, llama, qwen3

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "assets" / "tokenizer_vectors"
PAIRS: dict[str, Callable[[], Tokenizer]] = {"llama-bpe": llama, "qwen2": qwen3, "gpt-2": gpt2}


def tokenizer(vocab: str) -> Tokenizer:
    return PAIRS[vocab]()


def cases(vocab: str) -> list[tuple[str, list[int]]]:
    inp = (VECTORS / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8")
    out = (VECTORS / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    lines = out.split("\n")
    assert len(texts) == len(lines) == 47
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


@pytest.mark.parametrize("vocab", sorted(PAIRS))
def test_golden_vectors_through_the_cache(vocab: str) -> None:
    tok = tokenizer(vocab)
    got = [(text, tok.encode(text, add_special_tokens=False)) for text, _ in cases(vocab)]
    again = [tok.encode(text, add_special_tokens=False) for text, _ in cases(vocab)]  # L0 hits
    mismatches = [text for (text, ids), (_, want) in zip(got, cases(vocab), strict=True) if ids != want]
    assert mismatches == []
    assert again == [ids for _, ids in got]
    assert tok.cache.stats()["l0_hits"] >= 46


def test_llama_vectors_have_no_bos_and_hf_would_add_one() -> None:
    tok = tokenizer("llama-bpe")
    bos = tok.token_to_id("<|begin_of_text|>")
    text, want = cases("llama-bpe")[0]
    assert bos not in want
    assert tok.encode(text, add_special_tokens=True) == [bos, *want]
