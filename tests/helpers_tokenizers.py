"""Real tokenizers for tests (raw ``tokenizers.Tokenizer``), loaded once per process.

Byte-level BPE: qwen3 (the package's embedded copy), llama-3.1 and gpt2 (tests/assets copies).
SentencePiece-style: no real one is kept in the repo, so two small ones are trained here on a fixed
corpus with the exact pipeline real models ship: ``llama2`` (BPE with byte fallback, Metaspace
pre-tokenizer, the Llama-2/Mistral decoder Replace("▁"," ") + ByteFallback + Fuse + Strip) and
``t5`` (Unigram with Metaspace pre-tokenizer and decoder, unknown characters become ``<unk>``).
"""

from __future__ import annotations

import functools
import json
import lzma
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
_PATHS = {
    "qwen3": ROOT / "shepherd" / "tokens" / "assets" / "qwen3" / "tokenizer.json.xz",
    "llama-3.1": ROOT / "tests" / "assets" / "tokenizers" / "llama-3.1" / "tokenizer.json.xz",
    "gpt2": ROOT / "tests" / "assets" / "tokenizers" / "gpt2" / "tokenizer.json.xz",
}
BYTE_LEVEL = ("qwen3", "llama-3.1", "gpt2")
SENTENCEPIECE = ("llama2", "t5")
ALL = BYTE_LEVEL + SENTENCEPIECE

_CORPUS = [
    "Hello world, this is a small corpus for a sentencepiece style tokenizer.",
    "The quick brown fox jumps over the lazy dog. 你好世界 café naïve résumé",
    "Streaming detokenization must hold partial characters until they are complete.",
    "Numbers 12345 and symbols: (a + b) * c = d; <tags> and 'quotes' \"double\".",
]


@functools.cache
def load(name: str) -> Tokenizer:
    """A raw HF tokenizer by family name (see ``ALL``)."""
    if name == "llama2":
        return _build_llama2_style()
    if name == "t5":
        return _build_t5_style()
    with lzma.open(_PATHS[name]) as f:
        return Tokenizer.from_str(f.read().decode())


def special_ids(tok: Tokenizer) -> frozenset[int]:
    return frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)


def _build_llama2_style() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 8, trainer)
    spec = json.loads(tok.to_str())
    # Llama-2 layout: <unk> <s> </s>, then the 256 byte-fallback pieces <0x00>..<0xFF>, then the rest.
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    spec["decoder"] = json.loads(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ).__getstate__()
    )
    built = Tokenizer.from_str(json.dumps(spec))
    built.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return built


def _build_t5_style() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 8, trainer)
    return tok


def token_id(tok: Tokenizer, token: str) -> int:
    """The id of a vocabulary entry (fails loudly if absent)."""
    i = tok.token_to_id(token)
    assert i is not None, token
    return i


def piece(tok: Tokenizer, i: int) -> str:
    """The vocabulary entry of an id (fails loudly if absent)."""
    p = tok.id_to_token(i)
    assert p is not None, i
    return p
