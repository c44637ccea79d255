"""The byte-table decoder gives HF's decode, ids from anywhere in the vocabulary, special or not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.tokens.fast_decode import ByteDecoder
from shepherd.tokens.table_cache import Record
from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import QWEN3_DIR, gpt2, llama, qwen3

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


def test_the_byte_table_is_kept_on_disk_per_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process start takes a tokenizer's byte table from the disk cache (no walk over HF's vocabulary)
    and decodes as HF does; its entries are the fast encoder's bytes objects, as when built; a record
    cut short, or of another vocabulary size, is a miss: built again and kept."""
    import tokenizers

    import shepherd.tokens.fast_decode as fd

    monkeypatch.setenv("SHEPHERD_CACHE_DIR", str(tmp_path))
    data = (QWEN3_DIR / "tokenizer.json.xz").read_bytes()
    key = b"test-key-" + data[-16:]
    text = "Hello Ünïcödé ✓ 日本語 🤖<|im_end|> done"

    def load() -> Tokenizer:
        hf = tokenizers.Tokenizer.from_str(qwen3().hf.to_str())
        return Tokenizer(hf, name="q", path=QWEN3_DIR, config=qwen3().config, tokenizer_json_key=key)

    built = load()
    assert built.build_fast_decoder()
    ids = built.encode(text, add_special_tokens=False)
    walks: list[int] = []
    real = fd._table

    def counted(*a: Any, **k: Any) -> Any:
        walks.append(1)
        return real(*a, **k)

    monkeypatch.setattr(fd, "_table", counted)
    kept = load()
    assert kept.build_fast_decoder() and walks == []
    for skip in (True, False):
        want = kept.hf.decode(ids, skip_special_tokens=skip)
        assert kept.decode(ids, skip) == built.decode(ids, skip) == want
    fast = kept.cache.fast
    assert fast is not None
    table = kept._fast_decoder.table(False) if kept._fast_decoder else []
    assert all(table[i] is b for b, i in list(fast.token_ranks.items())[:1000])  # shared, not copies
    assert kept.max_token_chars >= max(len(t) for t in kept.hf.get_vocab(with_added_tokens=True))
    (record,) = (tmp_path / "byte-decoders").iterdir()
    record.write_bytes(record.read_bytes()[:-1])
    again = load()
    assert again.build_fast_decoder() and walks == [1]
    assert again.decode(ids, False) == text
    assert len(Record.parse(record.read_bytes()).blobs[0]) == again.vocab_size  # kept whole again


def test_a_kept_byte_table_that_decodes_otherwise_is_derived_again_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose digest holds but whose table is wrong (a bug, or a hand that rewrote it) fails the
    check against HF's decode: the table is derived again and the record replaced; a record of another
    vocabulary size, or in a directory others may write, is not taken."""
    import tokenizers

    monkeypatch.setenv("SHEPHERD_CACHE_DIR", str(tmp_path))
    key = b"test-key-wrong-table"

    def load() -> Tokenizer:
        hf = tokenizers.Tokenizer.from_str(qwen3().hf.to_str())
        return Tokenizer(hf, name="q", path=QWEN3_DIR, config=qwen3().config, tokenizer_json_key=key)

    assert load().build_fast_decoder()
    (record,) = (tmp_path / "byte-decoders").iterdir()
    size = Record.parse(record.read_bytes()).header["size"]
    record.write_bytes(Record({"size": size}, [[b"?"] * size], []).dump())
    tok = load()
    assert tok.build_fast_decoder()
    text = "Hello Ünïcödé ✓ 日本語 🤖 done"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert Record.parse(record.read_bytes()).blobs[0][:3] != [b"?"] * 3  # replaced by the right table
    record.write_bytes(Record({"size": size + 1}, [[b"?"] * (size + 1)], []).dump())
    tok = load()
    assert tok.build_fast_decoder() and tok.decode(tok.encode(text, add_special_tokens=False)) == text
    good = record.read_bytes()
    assert Record.parse(good).header["size"] == size  # the other size's record replaced
    (tmp_path / "byte-decoders").chmod(0o777)  # anyone may write there: neither read nor written
    record.write_bytes(Record({"size": size}, [[b"?"] * size], []).dump())
    tok = load()
    assert tok.build_fast_decoder() and tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert Record.parse(record.read_bytes()).blobs[0][0] == b"?"  # left alone
