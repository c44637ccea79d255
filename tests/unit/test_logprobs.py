"""Logprobs formatting: token strings and bytes from real tokenizers, OpenAI chat and legacy shapes."""

from __future__ import annotations

import json
import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.openai.logprobs import (
    TokenTextCache,
    chat_logprob_entries,
    chat_logprobs,
    completion_logprobs,
    json_logprob,
)
from shepherd.proto.engine_types import TokenLogprob
from tests.helpers_tokenizers import ALL, BYTE_LEVEL, load, token_id

TEXT_PIECES = [
    "Hello",
    " world",
    "  ",
    "\n\n",
    "你好",
    "🎉",
    "👍🏽",
    "e\u0301",
    "café",
    " naïve",
    "12345",
    "!?",
]


@pytest.mark.parametrize("name", [*BYTE_LEVEL, "llama2"])
@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.one_of(st.sampled_from(TEXT_PIECES), st.text(max_size=4)), max_size=10).map("".join))
def test_token_bytes_concatenate_to_the_text(name: str, text: str) -> None:
    tok = load(name)
    cache = TokenTextCache.for_tokenizer(tok)
    ids = tok.encode(text, add_special_tokens=False).ids
    raw = b"".join(cache.get(i).raw for i in ids)
    decoded = tok.decode(ids)
    if name == "llama2":  # SentencePiece: the leading "▁" the decoder strips is a real space byte
        assert raw.decode() in (decoded, " " + decoded)
    else:
        assert raw.decode("utf-8", errors="replace") == decoded
    # widths add up to the decoded length (a character counts once, at its first byte)
    assert sum(cache.get(i).width for i in ids) == len(raw.decode("utf-8", errors="replace"))


def test_partial_utf8_token_keeps_exact_bytes_and_an_escaped_string() -> None:
    tok = load("gpt2")
    cache = TokenTextCache.for_tokenizer(tok)
    first, *_ = tok.encode("你", add_special_tokens=False).ids
    t = cache.get(first)
    assert t.raw == "你".encode()[:2]
    assert t.byte_list == (0xE4, 0xBD)
    assert t.text == "\\xe4\\xbd"
    assert "\ufffd" not in t.text


def test_byte_fallback_and_metaspace_pieces() -> None:
    tok = load("llama2")
    cache = TokenTextCache.for_tokenizer(tok)
    byte = token_id(tok, "<0xF0>")
    assert cache.get(byte).raw == b"\xf0"
    assert cache.get(byte).text == "\\xf0"
    enc = tok.encode("Hello world", add_special_tokens=False)
    word = next(i for i, t in zip(enc.ids, enc.tokens, strict=True) if t.startswith("▁") and len(t) > 1)
    assert cache.get(word).text.startswith(" ")


def test_metaspace_decoder_unigram() -> None:
    tok = load("t5")
    cache = TokenTextCache.for_tokenizer(tok)
    ids = tok.encode("Hello world", add_special_tokens=False).ids
    assert "".join(cache.get(i).text for i in ids).strip() == "Hello world"


def test_special_and_added_tokens() -> None:
    tok = load("qwen3")
    cache = TokenTextCache.for_tokenizer(tok)
    im_end = cache.get(token_id(tok, "<|im_end|>"))
    assert (im_end.text, im_end.special) == ("<|im_end|>", True)
    think = cache.get(token_id(tok, "<think>"))
    assert (think.text, think.special) == ("<think>", False)
    assert cache.get(10**9).raw == b""  # unknown id: empty, no crash


def test_cache_is_shared_per_tokenizer_and_lazy() -> None:
    tok = load("gpt2")
    cache = TokenTextCache.for_tokenizer(tok)
    assert TokenTextCache.for_tokenizer(tok) is cache
    assert TokenTextCache.for_tokenizer(load("qwen3")) is not cache
    before = len(cache)
    cache.get(31337)
    cache.get(31337)
    assert len(cache) <= before + 1


def lps(tok_name: str, text: str) -> tuple[list[int], list[TokenLogprob]]:
    tok = load(tok_name)
    ids = tok.encode(text, add_special_tokens=False).ids
    out = []
    for k, i in enumerate(ids):
        top = ((i, -0.1 * k), ((i + 1) % 1000, -1.5), ((i + 2) % 1000, -float("inf")))
        out.append(TokenLogprob(token_id=i, logprob=-0.1 * k, top=top))
    return ids, out


def test_chat_format() -> None:
    tok = load("qwen3")
    cache = TokenTextCache.for_tokenizer(tok)
    ids, logprobs = lps("qwen3", "Hi 🦩")
    body = chat_logprobs(logprobs, cache, top_logprobs=2)
    content = body["content"]
    assert isinstance(content, list) and len(content) == len(ids)
    first = content[0]
    assert first == {
        "token": "Hi",
        "logprob": 0.0,
        "bytes": (72, 105),
        "top_logprobs": [
            {"token": "Hi", "logprob": 0.0, "bytes": (72, 105)},
            {
                "token": cache.get((ids[0] + 1) % 1000).text,
                "logprob": -1.5,
                "bytes": cache.get((ids[0] + 1) % 1000).byte_list,
            },
        ],
    }
    assert b"".join(bytes(e["bytes"]) for e in content) == "Hi 🦩".encode()
    # -inf is carried as -9999.0 and the whole thing serializes as JSON
    three = chat_logprob_entries(logprobs, cache, top_logprobs=3)
    assert three[0]["top_logprobs"][2]["logprob"] == -9999.0  # type: ignore[index]
    assert json.loads(json.dumps(body)) == json.loads(orjson.dumps(body))
    assert chat_logprob_entries(logprobs, cache)[0]["top_logprobs"] == []


def test_chat_tokens_as_ids() -> None:
    cache = TokenTextCache.for_tokenizer(load("gpt2"))
    _, logprobs = lps("gpt2", "ok")
    entry = chat_logprob_entries(logprobs, cache, 1, tokens_as_ids=True)[0]
    assert entry["token"] == f"token_id:{logprobs[0].token_id}"


def test_completion_format_and_offsets_across_chunks() -> None:
    tok = load("gpt2")
    cache = TokenTextCache.for_tokenizer(tok)
    text = "Hi 你好 there"
    ids, logprobs = lps("gpt2", text)
    whole, end = completion_logprobs(logprobs, cache, top_logprobs=1, text_offset=10)
    assert end == 10 + len(text)
    assert whole["text_offset"][0] == 10  # type: ignore[index]
    assert whole["tokens"] == [cache.get(i).text for i in ids]
    assert whole["token_logprobs"] == [json_logprob(lp.logprob) for lp in logprobs]
    tops = whole["top_logprobs"]
    assert isinstance(tops, list)
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in tops)
    assert tops[0] == {"Hi": 0.0}  # the sampled token is the top one: n+1 collapses to 1
    # streaming: chunk by chunk, carrying the offset, gives the same lists
    offset, parts = 10, []
    for k in range(0, len(logprobs), 3):
        part, offset = completion_logprobs(logprobs[k : k + 3], cache, top_logprobs=1, text_offset=offset)
        parts.append(part)
    assert offset == end
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined: list[object] = []
        for part in parts:
            value = part[key]
            assert isinstance(value, list)
            joined.extend(value)
        assert joined == whole[key]
    # offsets point at each token's first character in the text
    offsets = whole["text_offset"]
    assert isinstance(offsets, list)
    assert [text[o - 10 : o - 10 + 1] for o in offsets][:2] == ["H", " "]


def test_completion_without_top_and_special_width() -> None:
    tok = load("qwen3")
    cache = TokenTextCache.for_tokenizer(tok)
    eos = token_id(tok, "<|im_end|>")
    logprobs = [
        TokenLogprob(token_id=token_id(tok, "ok"), logprob=-0.5, top=((token_id(tok, "no"), -0.2),)),
        TokenLogprob(token_id=eos, logprob=-0.1),
    ]
    body, end = completion_logprobs(logprobs, cache)
    # logprobs 0: the sampled token alone at each position (logprobs + 1 entries, as OpenAI documents and
    # vLLM's _create_completion_logprobs answers), never null
    assert body["top_logprobs"] == [{"ok": -0.5}, {"<|im_end|>": -0.1}]
    assert body["tokens"] == ["ok", "<|im_end|>"]
    assert end == 2  # the skipped special token adds nothing to the text
    _, end_rendered = completion_logprobs(logprobs, cache, skip_special_tokens=False)
    assert end_rendered == 2 + len("<|im_end|>")


def test_json_logprob_clamps_what_json_cannot_carry() -> None:
    assert json_logprob(-0.25) == -0.25
    assert json_logprob(-math.inf) == -9999.0
    assert json_logprob(math.nan) == -9999.0
    assert json_logprob(-1e6) == -9999.0


@pytest.mark.parametrize("name", ALL)
def test_every_vocab_entry_in_a_sample_maps(name: str) -> None:
    tok = load(name)
    cache = TokenTextCache.for_tokenizer(tok)
    for i in range(0, tok.get_vocab_size(), max(1, tok.get_vocab_size() // 3000)):
        t = cache.get(i)
        assert t.byte_list == tuple(t.raw)
        assert "\ufffd" not in t.text or "\ufffd".encode() in t.raw
