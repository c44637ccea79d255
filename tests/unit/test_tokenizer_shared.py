"""Tokenizers loaded once per test session (a load costs ~1 s), shared by the tokenizer tests.

Their caches are shared too: tests that count hits build a fresh ``TokenCache`` over ``.hf`` or look
at counter deltas.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from shepherd.tokens.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "tests" / "assets" / "tokenizers"
QWEN3_DIR = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"
LLAMA_DIR = TOK / "llama-3.1"
GPT2_DIR = TOK / "gpt2"


@cache
def qwen3() -> Tokenizer:
    return Tokenizer.load(QWEN3_DIR, "qwen3")


@cache
def llama() -> Tokenizer:
    return Tokenizer.load(LLAMA_DIR, "llama")


@cache
def gpt2() -> Tokenizer:
    return Tokenizer.load(GPT2_DIR, "gpt2")


def test_shared_tokenizers_load() -> None:
    assert (qwen3().name, llama().name, gpt2().name) == ("qwen3", "llama", "gpt2")
