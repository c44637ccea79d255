"""IncrementalDetokenizer against one-shot ``Tokenizer.decode`` on real tokenizers."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from shepherd.tokens.detokenizer import IncrementalDetokenizer
from shepherd.tokens.fast_decode import ByteDecoder
from tests.helpers_tokenizers import ALL, BYTE_LEVEL, load, piece, special_ids, token_id

FFFD = "\ufffd"

FRAGMENTS = [
    "Hello",
    " world",
    "  ",
    "   spaced   out ",
    "\n\n",
    "\t",
    "\r\n",
    "你好",
    "世界",
    "，",
    "🎉",
    "👩\u200d👩\u200d👧",
    "👍🏽",
    "e\u0301",
    "a\u0308\u0323",
    "ﬁ",
    "café",
    "naïve",
    "Ω≈ç√",
    "𝔘𝔫𝔦",
    "مرحبا",
    "한국어",
    "12345",
    ".",
    "!?",
    "\u200b",
    "ok",
    " the",
]
SPECIAL_TEXT = {
    "qwen3": ["<|im_end|>", "<|im_start|>", "<think>", "</think>", "<|endoftext|>"],
    "llama-3.1": ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>"],
    "gpt2": ["<|endoftext|>"],
    "llama2": ["<s>", "</s>", "<think>"],
    "t5": ["<s>", "</s>"],
}


def texts(name: str | None = None) -> st.SearchStrategy[str]:
    piece = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6))
    if name is not None:
        piece = st.one_of(piece, st.sampled_from(SPECIAL_TEXT[name]))
    return st.lists(piece, max_size=14).map("".join)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    chunks: list[list[int]] = []
    i = 0
    for size in itertools.cycle(sizes or [1]):
        if i >= len(ids):
            break
        chunks.append(list(ids[i : i + size]))
        i += size
    return chunks


def stream(
    tok: Tokenizer,
    chunks: Sequence[Sequence[int]],
    *,
    skip: bool = True,
    prompt_ids: Sequence[int] | None = None,
) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt_ids)
    out = [detok.step(c) for c in chunks]
    out.append(detok.finish())
    assert detok.text == "".join(out)
    return out


def check_stream(tok: Tokenizer, ids: Sequence[int], sizes: Sequence[int], skip: bool) -> None:
    full = tok.decode(list(ids), skip_special_tokens=skip)
    chunks = chunked(ids, sizes)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    emitted = ""
    fed: list[int] = []
    for chunk in chunks:
        piece = detok.step(chunk)
        fed.extend(chunk)
        # never emits a replacement char the full decode does not have at that position
        for j, ch in enumerate(piece):
            if ch == FFFD:
                assert full[len(emitted) + j] == FFFD
        emitted += piece
        assert full.startswith(emitted)
        # prompt: whenever the ids so far decode to clean text, all of it is out
        so_far = tok.decode(fed, skip_special_tokens=skip)
        if not so_far.endswith(FFFD):
            assert emitted == so_far
    emitted += detok.finish()
    assert emitted == full
    assert detok.text == full


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_text_any_chunking_matches_decode(name: str, data: st.DataObject) -> None:
    tok = load(name)
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    text = data.draw(texts(None if skip and name == "t5" else name), label="text")
    ids = tok.encode(text, add_special_tokens=False).ids
    sizes = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=8), label="chunk sizes")
    check_stream(tok, ids, sizes, skip)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_with_prompt_context_matches_decode_of_whole(name: str, data: st.DataObject) -> None:
    tok = load(name)
    prompt = tok.encode(data.draw(texts(), label="prompt"), add_special_tokens=False).ids
    out_ids = tok.encode(data.draw(texts(), label="output"), add_special_tokens=False).ids
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=5), label="chunk sizes")
    before = tok.decode(prompt)
    whole = tok.decode(prompt + out_ids)
    got = "".join(stream(tok, chunked(out_ids, sizes), prompt_ids=prompt))
    if whole.startswith(before) and not before.endswith(FFFD):
        assert got == whole[len(before) :]
    else:  # the prompt ends mid-character: no usable context, the output decodes on its own
        assert got == tok.decode(out_ids)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("gpt2", "a 🎉你👍🏽 é"),
        ("llama-3.1", "a 🎉你👍🏽 é"),
        ("qwen3", "a 🎉你👍🏽 é"),
        ("llama2", "a🎉 é你 x"),
    ],
)
def test_every_split_of_a_multibyte_sequence(name: str, text: str) -> None:
    tok = load(name)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert 6 <= len(ids) <= 13
    full = tok.decode(ids)
    for mask in range(2 ** (len(ids) - 1)):
        chunks: list[list[int]] = [[ids[0]]]
        for k, t in enumerate(ids[1:]):
            if mask >> k & 1:
                chunks.append([t])
            else:
                chunks[-1].append(t)
        out = stream(tok, chunks)
        assert "".join(out) == full


# -- regressions and specific behaviour --------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "llama-3.1", "llama2"])
def test_multibyte_char_split_across_tokens_is_held_until_complete(name: str) -> None:
    tok = load(name)
    ids = tok.encode("🦩", add_special_tokens=False).ids
    assert len(ids) >= 2, "the emoji must span several tokens for this test"
    detok = IncrementalDetokenizer(tok)
    outs = [detok.step([i]) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "🦩"
    assert detok.finish() == ""


@pytest.mark.parametrize("name", ["gpt2", "llama2"])
def test_incomplete_sequence_at_the_end_is_flushed_on_finish(name: str) -> None:
    tok = load(name)
    ids = tok.encode("ok 🎉", add_special_tokens=False).ids
    cut = ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.step([i]) for i in cut)
    assert FFFD not in text
    tail = detok.finish()
    assert text + tail == tok.decode(cut)
    assert tail.endswith(FFFD)
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.step([ids[-1]])


def test_metaspace_leading_space_comes_from_prompt_context() -> None:
    tok = load("llama2")
    prompt = tok.encode("The quick brown fox", add_special_tokens=False).ids
    out = tok.encode("The quick brown fox jumps over", add_special_tokens=False).ids[len(prompt) :]
    assert piece(tok, out[0]).startswith("▁")
    with_ctx = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(with_ctx.step([i]) for i in out) == " jumps over"
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.step([i]) for i in out) == "jumps over"  # what decode(out) gives


@pytest.mark.parametrize("name", ["llama2", "t5"])
def test_metaspace_spaces_between_words(name: str) -> None:
    tok = load(name)
    text = "Hello world  the   fox"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert "".join(stream(tok, [[i] for i in ids])) == tok.decode(ids)


def test_skip_special_tokens_drops_special_ids_but_keeps_plain_added_tokens() -> None:
    tok = load("qwen3")
    text = "<|im_start|>assistant\n<think>hmm</think>Hi 👋<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    skipped = "".join(stream(tok, [[i] for i in ids], skip=True))
    assert skipped == "assistant\n<think>hmm</think>Hi 👋"
    rendered = "".join(stream(tok, [[i] for i in ids], skip=False))
    assert rendered == text
    # passing the tokenizer's own special ids changes nothing
    same = IncrementalDetokenizer(tok, special_ids=special_ids(tok))
    assert "".join(same.step([i]) for i in ids) + same.finish() == skipped


def test_extra_special_ids_are_dropped_only_when_skipping() -> None:
    tok = load("qwen3")
    think = token_id(tok, "<think>")
    ids = tok.encode("<think>x", add_special_tokens=False).ids
    extra = special_ids(tok) | {think}
    drop = IncrementalDetokenizer(tok, special_ids=extra)
    assert drop.step(ids) + drop.finish() == "x"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False, special_ids=extra)
    assert keep.step(ids) + keep.finish() == "<think>x"


def test_spaces_between_special_tokens_for_a_decoderless_tokenizer() -> None:
    from tests.helpers_tokenizers import _build_t5_style

    tok = _build_t5_style()
    tok.decoder = None  # decode() then joins tokens with spaces
    ids = tok.encode("<s></s>", add_special_tokens=False).ids
    assert len(ids) == 2
    spaced = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert spaced.step(ids[:1]) + spaced.step(ids[1:]) == "<s> </s>"
    tight = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert tight.step(ids[:1]) + tight.step(ids[1:]) == "<s></s>"


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_long_run_of_skipped_special_tokens_stays_bounded(name: str) -> None:
    tok = load(name)
    eos = min(special_ids(tok))
    tail = tok.encode(" then 你好", add_special_tokens=False).ids
    ids = tok.encode("start", add_special_tokens=False).ids + [eos] * 200 + tail
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(detok.step([i]))
        assert detok.pending <= 33
    out.append(detok.finish())
    assert "".join(out) == tok.decode(ids) == "start then 你好"


@pytest.mark.parametrize("sizes", [[5, 2], [3], [2], [7, 6], [4]])
def test_long_byte_fallback_run_with_chunks_ending_mid_character(sizes: list[int]) -> None:
    # Byte fallback renders a whole run of byte pieces as U+FFFD while its last character is
    # incomplete: chunks that keep ending mid-character hold the run until the forced flush, which
    # must cut at a character boundary instead of emitting the replacement characters.
    tok = load("llama2")
    text = "000\x80\x80\x800𐀀0👩\u200d👩\u200d👧" * 3 + "🦩" * 12
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > 100 and sum(piece(tok, i).startswith("<0x") for i in ids) > 90
    check_stream(tok, ids, sizes, skip=True)
    pieces = stream(tok, chunked(ids, sizes))
    assert not any(FFFD in p for p in pieces)


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_out_of_vocabulary_ids_are_ignored(name: str) -> None:
    tok = load(name)
    vocab = tok.get_vocab_size()
    ids = [*tok.encode("a", add_special_tokens=False).ids, *range(vocab, vocab + 100), 10**9]
    ids += tok.encode(" 🦩 b", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(detok.step([i]))
        assert detok.pending <= 4
    assert "".join(out) + detok.finish() == tok.decode(ids) == "a 🦩 b"


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "llama2"])
def test_long_run_of_replacement_characters_is_flushed_in_bounded_steps(name: str) -> None:
    tok = load(name)
    ids = tok.encode("x" + "\ufffd" * 80 + " 🦩", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(detok.step([i]))
        assert detok.pending <= 33
    assert "".join(out) + detok.finish() == tok.decode(ids)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_arbitrary_ids_never_crash_and_stay_bounded(name: str, data: st.DataObject) -> None:
    tok = load(name)
    vocab = tok.get_vocab_size()
    low = st.integers(0, min(vocab, 400) - 1)  # byte tokens and short pieces: most garbage-prone
    ids = data.draw(st.lists(st.one_of(low, st.integers(0, vocab - 1)), max_size=60), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="chunk sizes")
    skip = data.draw(st.booleans(), label="skip")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = []
    for chunk in chunked(ids, sizes):
        pieces.append(detok.step(chunk))
        assert detok.pending <= 36
    pieces.append(detok.finish())
    if name in BYTE_LEVEL:  # lossy UTF-8 of the bytes is stable under streaming
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_tuple_input_and_empty_steps() -> None:
    tok = load("gpt2")
    ids = tuple(tok.encode("Hi there", add_special_tokens=False).ids)
    detok = IncrementalDetokenizer(tok)
    assert detok.step(()) == ""
    assert detok.step(ids) == "Hi there"
    assert detok.token_ids == list(ids)
    assert detok.pending == 0


# -- the byte-table path (byte-level tokenizers with fast_decode.ByteDecoder built) -------------------


def _byte_pair(name: str, skip: bool) -> tuple[IncrementalDetokenizer, IncrementalDetokenizer]:
    tok = load(name)
    assert ByteDecoder.build(tok) is not None
    fast = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    ref = IncrementalDetokenizer(tok, skip_special_tokens=skip, use_byte_table=False)
    assert fast._table is not None and ref._table is None
    return fast, ref


@pytest.mark.parametrize("name", BYTE_LEVEL)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_byte_table_steps_exactly_as_decode_stream(name: str, data: st.DataObject) -> None:
    """Every step returns what the DecodeStream path returns, for any ids (garbage bytes, literal U+FFFD,
    special and out-of-vocabulary ids among them) in any chunking, through finish()."""
    tok = load(name)
    vocab = tok.get_vocab_size()
    skip = data.draw(st.booleans(), label="skip")
    if data.draw(st.booleans(), label="from text"):
        text = data.draw(texts(name), label="text")
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        low = st.integers(0, min(vocab, 400) - 1)  # byte tokens: most garbage-prone
        any_id = st.integers(0, vocab + 5)
        ids = data.draw(
            st.lists(st.one_of(low, any_id, st.sampled_from(sorted(special_ids(tok)))), max_size=80)
        )
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=6), label="chunk sizes")
    fast, ref = _byte_pair(name, skip)
    for chunk in chunked(ids, sizes):
        assert fast.step(chunk) == ref.step(chunk)
        assert fast.pending == ref.pending
    assert fast.finish() == ref.finish()
    assert fast.text == ref.text
    assert list(fast.token_ids) == list(ref.token_ids)


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_byte_table_hands_a_long_hold_to_decode_stream(name: str) -> None:
    tok = load(name)
    ids = tok.encode("x" + "\ufffd" * 300 + " 🦩 done", add_special_tokens=False).ids
    fast, ref = _byte_pair(name, True)
    for i in ids:
        assert fast.step([i]) == ref.step([i])
    assert fast._table is None  # handed over after _MAX_PENDING held ids
    assert fast.finish() == ref.finish()
    assert fast.text == tok.decode(ids)


def test_byte_table_is_used_only_when_built() -> None:
    tok = Tokenizer.from_str(load("gpt2").to_str())  # a fresh object: nothing built for it
    assert ByteDecoder.built_for(tok) is None
    assert IncrementalDetokenizer(tok)._table is None
    assert ByteDecoder.build(tok) is ByteDecoder.build(tok) is ByteDecoder.built_for(tok)
    assert IncrementalDetokenizer(tok)._table is not None
