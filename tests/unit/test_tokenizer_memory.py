"""What keeps a node's memory down (README "Memory"): the decoder's table built before the pool forks and
over the fast encoder's own bytes objects, ranks that keep none of the parsed JSON alive, no cache of the
NFC probes, and no redis (nor the OpenTelemetry SDK it imports) without the Redis rate-limit backend."""

from __future__ import annotations

import lzma
import subprocess
import sys
from typing import Any

import orjson
import pytest

from shepherd.node.api.admission import Admission
from shepherd.node.config import RateLimitRule
from shepherd.tokens import fast_bpe_core
from shepherd.tokens.fast_decode import ByteDecoder
from shepherd.tokens.pool import TokenizerPool
from shepherd.tokens.service import TokenizerService
from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import GPT2_DIR, QWEN3_DIR, gpt2


def test_the_decoder_table_holds_the_encoders_bytes_objects() -> None:
    # a tokenizer of its own: the shared one's decoder may have been built, without the encoder's bytes,
    # by another test (``ByteDecoder.build(hf)``: once per tokenizer object); the node builds only here
    tok = Tokenizer.load(QWEN3_DIR, "qwen3")
    assert tok.build_fast_decoder()
    fast = tok.cache.fast
    assert fast is not None
    shared = tok._fast_decoder
    assert shared is not None
    table = shared.table(False)
    held = {i: b for b, i in fast.token_ranks.items()}
    assert len(held) > 150_000
    assert all(table[i] is b for i, b in held.items())
    # the same values as a table built from HF's vocabulary alone (another seed: not the cached one)
    alone = ByteDecoder.build(tok.hf, seed=1)
    assert alone is not None
    assert alone.table(False) == table and alone.table(True) == shared.table(True)
    assert sum(alone.table(False)[i] is b for i, b in held.items()) < len(held) // 2


def test_a_decoder_ignores_held_bytes_that_differ() -> None:
    tok = gpt2()
    wrong = {b"not this token": 300, b"nor this": tok.vocab_size + 7}
    fast = ByteDecoder.build(tok.hf, seed=2, token_bytes=wrong)
    assert fast is not None
    assert fast.table(False)[300] == tok.hf.decode([300], skip_special_tokens=False).encode()
    ids = tok.encode("a decoder over the wrong bytes still decodes", add_special_tokens=False)
    assert fast.decode(ids) == tok.hf.decode(ids)


def test_ranks_keep_no_object_of_the_parsed_json() -> None:
    with lzma.open(QWEN3_DIR / "tokenizer.json.xz") as f:
        vocab = orjson.loads(f.read())["model"]["vocab"]
    ranks = fast_bpe_core._ranks(vocab)
    parsed = {id(i) for i in vocab.values()}
    assert sorted(ranks.values()) == sorted(vocab.values())
    assert not any(id(i) in parsed for i in ranks.values() if i > 256)  # (0-256 are CPython's own)


def test_ranks_of_ids_outside_a_range_are_kept_as_given() -> None:
    byte_chars = list(fast_bpe_core.byte_level_decoder())
    vocab: dict[str, Any] = {ch: i for i, ch in enumerate(byte_chars)}
    vocab["ab"] = 10_000
    ranks = fast_bpe_core._ranks(vocab)
    assert ranks[b"ab"] == 10_000 and ranks[b"a"] == vocab["a"] and len(ranks) == 257


def test_nfc_probes_are_generated_not_cached() -> None:
    probes = fast_bpe_core._nfc_probes()
    first = next(probes)
    assert first == next(fast_bpe_core._nfc_probes())
    assert not hasattr(fast_bpe_core._nfc_probes, "cache_info")
    assert fast_bpe_core._nfc_agrees(lambda s: s) is None
    why = fast_bpe_core._nfc_agrees(lambda s: s.replace("\u0316", "?"))
    assert why is not None and "\u0316" in why


async def test_the_decoder_is_built_before_the_pool_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = Tokenizer.load(GPT2_DIR, "gpt2")  # a tokenizer of its own: no decoder built for it yet
    seen: list[bool] = []
    spawn = TokenizerPool._spawn

    def spawn_and_look(pool: TokenizerPool, slot: int) -> None:
        seen.append(ByteDecoder.built_for(tok.hf) is not None and tok._fast_decoder is not None)
        spawn(pool, slot)

    monkeypatch.setattr(TokenizerPool, "_spawn", spawn_and_look)
    svc = TokenizerService({"gpt2": tok}, workers=2)
    await svc.start()
    try:
        assert seen == [True, True]
        ids = tok.encode("decoded in the parent", add_special_tokens=False)
        assert tok.decode(ids) == "decoded in the parent"
    finally:
        await svc.close()


def test_the_node_imports_no_redis_without_the_redis_backend() -> None:
    code = (
        "import sys, shepherd.node.app; print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_redis_backend_is_built_when_configured() -> None:
    adm = Admission([RateLimitRule(tenant="*", rpm=10)], node="n1", redis={"url": "redis://127.0.0.1:1/0"})
    assert adm.backend is not None and not adm.admitting
    assert type(adm.backend).__name__ == "RedisCounters"
