"""FastBPE (tiktoken's core on a tokenizer's own ranks) must give exactly what ``tokenizers`` gives.

Real tokenizers: the golden vectors and generated text through the fast path itself, for the three the
repo keeps (qwen3, llama-3.1, gpt2), which must all get it. Tiny synthetic byte-level tokenizers: the
structural conditions (merge layout and order, whole-word lookup, normalizer, pre-tokenizer, added
tokens), each one on the side of the line it should be.
"""

from __future__ import annotations

import functools
import gc
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from shepherd.tokens.cache import TokenCache
from shepherd.tokens.fast_bpe import _C_SPLIT_DIGITS, FastBPE, _encode_ascii, _ordinary_encoder, fast_bpe_for
from shepherd.tokens.fast_bpe_core import _cached_core, byte_level_decoder
from shepherd.tokens.tokenizer import Tokenizer as ShepherdTokenizer
from tests import helpers_tokenizers
from tests.unit.test_tokenizer_shared import GPT2_DIR, gpt2, llama, qwen3
from tests.unit.test_tokenizer_vectors import cases

FAMILIES: dict[str, Callable[[], ShepherdTokenizer]] = {"qwen3": qwen3, "llama-3.1": llama, "gpt2": gpt2}
VECTORS = {"qwen3": "qwen2", "llama-3.1": "llama-bpe", "gpt2": "gpt-2"}


def fast_of(name: str) -> FastBPE:
    cache = FAMILIES[name]().cache
    assert cache.fast is not None, cache.fast_reason
    return cache.fast


# ---- real tokenizers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layout"),
    [("qwen3", "all splits"), ("llama-3.1", "all splits"), ("gpt2", "one merge per token")],
)
def test_the_repo_byte_level_tokenizers_are_accelerated(name: str, layout: str) -> None:
    fast = fast_of(name)
    assert fast.wraps  # add_special_tokens=True handled too (llama's BOS)
    assert f"merges: {layout}" in fast.description
    assert fast.nfc == (name == "qwen3")
    assert TokenCache(FAMILIES[name]().hf).fast is fast  # built once per loaded tokenizer


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_golden_vectors_through_the_fast_path(name: str) -> None:
    fast = fast_of(name)
    before = (fast.fast_calls, fast.hf_calls)
    got = [(fast.encode(text, add_special_tokens=False), want) for text, want in cases(VECTORS[name])]
    assert [i for i, (ids, want) in enumerate(got) if ids != want] == []
    assert (fast.fast_calls, fast.hf_calls) == (before[0] + len(got), before[1])  # none went to HF
    hf = FAMILIES[name]().hf
    for text, _ in cases(VECTORS[name])[:5]:
        assert fast.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True).ids
    if name == "llama-3.1":
        assert fast.encode("Hello", True)[0] == hf.token_to_id("<|begin_of_text|>")


MARKERS = {
    "qwen3": [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|fim_pad|>",
    ],
    "llama-3.1": [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ],
    "gpt2": ["<|endoftext|>"],
}
PARTIALS = ["<|", "|>", "<|im_", "im_end|>", "<think", "think>", "<|eot_id", "endoftext", "<", ">", "|"]
SPACES = [
    " ",
    "  ",
    "    ",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\t",
    " \n",
    "\r\n\r\n",
    "\u00a0",
    "\u3000",
    "\u2003",
    "\u0085",
]
CONTRACTIONS = ["'s", "'S", "'ll", "'LL", "'ve", "'Re", "'d", "'M", "'t", "'", "\u2019s", "don't", "I'LL"]
# combining marks (two that tokenizers' Unicode tables lack: U+08CA, U+1AC1), and sequences NFC changes
MARKS = ["\u0301", "\u0316", "\u0308", "\u093c", "\u05bc", "\u08ca", "\u1ac1", "\u0334", "\u0345"]
NFC_CHANGING = [
    "e\u0301",
    "a\u0316\u0301",
    "\u1100\u1161\u11a8",
    "\u212b",
    "\u0344",
    "\u00c5\u0323",
    "\u0915\u093c",
]
OTHER = [
    "🤖",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "🇺🇸",
    "❤️",
    "日本語",
    "中文",
    "한국어",
    "Ünïcödé",
    "ｆｕｌｌ",
    "\ufeff",
]
CODE = ["def f(x):", "    return x", "{}", "[1, 2]", "==", "->", "/*", "*/", "#include <a.h>", "\\n", '"s"']


def texts(name: str) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(MARKERS[name]),
        st.sampled_from(PARTIALS),
        st.sampled_from(SPACES),
        st.sampled_from(CONTRACTIONS),
        st.sampled_from(MARKS),
        st.sampled_from(NFC_CHANGING),
        st.sampled_from(OTHER),
        st.sampled_from(CODE),
        st.text("0123456789", min_size=1, max_size=9),
        st.text(st.characters(categories=["L", "M", "N", "P", "S", "Z", "Cc", "Cf"]), max_size=10),
        st.text("ab '\n", max_size=8),
    )
    return st.lists(piece, max_size=14).map("".join)


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(name: str, text: str) -> None:
    fast = fast_of(name)
    hf = FAMILIES[name]().hf
    before = fast.hf_calls
    for add in (False, True):
        assert fast.encode(text, add) == hf.encode(text, add_special_tokens=add).ids
    assert fast.hf_calls == before


@SETTINGS
@given(texts("qwen3"))
def test_qwen3_fast_equals_hf(text: str) -> None:
    check("qwen3", text)


@SETTINGS
@given(texts("llama-3.1"))
def test_llama31_fast_equals_hf(text: str) -> None:
    check("llama-3.1", text)


@SETTINGS
@given(texts("gpt2"))
def test_gpt2_fast_equals_hf(text: str) -> None:
    check("gpt2", text)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_long_words_runs_and_mixed_text(name: str) -> None:
    hf = FAMILIES[name]().hf
    fast = fast_of(name)
    for text in [
        "a" * 5000,
        " " * 3000 + "x",
        "\n" * 500,
        "🤖" * 300,
        "0123456789" * 200,
        "xyz" * 700 + "e\u0301" * 50,
        "".join(MARKERS[name]) * 20,
    ]:
        assert fast.encode(text, False) == hf.encode(text, add_special_tokens=False).ids


def test_lone_surrogates_fail_as_in_hf() -> None:
    fast, hf = fast_of("qwen3"), qwen3().hf
    with pytest.raises(Exception) as want:
        hf.encode("a\ud800b")
    with pytest.raises(want.type):
        fast.encode("a\ud800b", False)


def test_cache_misses_go_through_the_fast_path() -> None:
    tok = qwen3()
    fast = fast_of("qwen3")
    before = fast.fast_calls
    text = "<|im_start|>user\nA new question, not seen before: 8411?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text, False) == tok.encode_uncached(text, False)
    assert fast.fast_calls > before
    off = TokenCache(tok.hf, fast_bpe=False)
    assert off.fast is None and off.encode(text, False) == tok.encode_uncached(text, False)


def test_load_can_turn_it_off() -> None:
    assert ShepherdTokenizer.load(GPT2_DIR, fast_bpe=False).cache.fast is None


# ---- structures it must refuse ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "why"), [("llama2", "byte_fallback"), ("t5", "Unigram")])
def test_sentencepiece_style_tokenizers_are_refused(name: str, why: str) -> None:
    hf = helpers_tokenizers.load(name)
    fast, reason = FastBPE.build_with_reason(hf, json.loads(hf.to_str()))
    assert fast is None and why in reason
    assert FastBPE.build(hf, json.loads(hf.to_str())) is None
    assert TokenCache(hf).fast is None


# ---- tiny synthetic byte-level tokenizers -----------------------------------------------------------------

_ENC = {b: ch for ch, b in byte_level_decoder().items()}


def _bl(s: str | bytes) -> str:
    return "".join(_ENC[b] for b in (s.encode() if isinstance(s, str) else s))


def tiny(
    tokens: Sequence[str],
    *,
    merges: Sequence[tuple[str, str]] | None = None,
    ignore_merges: bool = True,
    normalizer: dict[str, Any] | None = None,
    pre_tokenizer: dict[str, Any] | None = None,
    added: Sequence[dict[str, Any]] = (),
) -> tuple[Tokenizer, dict[str, Any]]:
    """A byte-level BPE: the 256 bytes (id = byte), then ``tokens`` (UTF-8) in order; merges default
    to all the splits of each token, in the order tiktoken conversions put them."""
    rank = {bytes((b,)): b for b in range(256)}
    for t in tokens:
        rank[t.encode()] = len(rank)
    vocab = {_bl(t): i for t, i in rank.items()}
    pairs: list[tuple[bytes, bytes]] = []
    if merges is None:
        for tok in (t.encode() for t in tokens):
            local = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in rank and tok[i:] in rank]
            pairs += sorted(local, key=lambda p: (rank[p[0]], rank[p[1]]))
    else:
        pairs = [(a.encode(), b.encode()) for a, b in merges]
    d: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(vocab) + k,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            }
            | a
            for k, a in enumerate(added)
        ],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer
        or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": [[_bl(a), _bl(b)] for a, b in pairs],
        },
    }
    return Tokenizer.from_str(json.dumps(d)), d


DENSE = ["ab", "ba", "aa", "aba", "bab", "abab", "bb", "aab", "baba", "abb", "ababa", "bba", "aaa", "abba"]


@functools.cache
def dense() -> tuple[FastBPE, Tokenizer]:
    hf, d = tiny(DENSE)
    fast = FastBPE.build(hf, d)
    assert fast is not None
    return fast, hf


@settings(max_examples=100, deadline=None)
@given(st.text("ab \n", max_size=40))
def test_all_splits_layout_equals_hf(text: str) -> None:
    fast, hf = dense()
    assert fast.encode(text, False) == hf.encode(text, add_special_tokens=False).ids


def test_merge_layouts_and_order() -> None:
    hf, d = tiny(DENSE)
    assert "all splits" in FastBPE.build_with_reason(hf, d)[1]
    # a split missing while merges tie: tiktoken would merge what HF does not
    d["model"]["merges"] = [m for m in d["model"]["merges"] if m != [_bl("ab"), _bl("a")]]
    hf = Tokenizer.from_str(json.dumps(d))
    fast, why = FastBPE.build_with_reason(hf, d)
    assert fast is None and "not all the splits" in why
    # merge priority that does not follow the result ids
    hf, d = tiny(["ab", "bc"], merges=[("b", "c"), ("a", "b")])
    fast, why = FastBPE.build_with_reason(hf, d)
    assert fast is None and "priority" in why


def test_one_merge_per_token_needs_every_token_to_encode_to_itself() -> None:
    # "abc" comes from (ab, c) but "bc" merges first, so HF's merges never reach it from "abc":
    hf, d = tiny(["bc", "ab", "abc"], merges=[("b", "c"), ("a", "b"), ("ab", "c")], ignore_merges=False)
    assert hf.encode("abc").ids != [hf.token_to_id(_bl("abc"))]  # what a tiktoken rank BPE would give
    fast, why = FastBPE.build_with_reason(hf, d)
    assert fast is None and "do not encode to themselves" in why
    # with whole-word lookup HF returns it for "abc", but not inside "abcc": refused too
    hf, d = tiny(["bc", "ab", "abc"], merges=[("b", "c"), ("a", "b"), ("ab", "c")], ignore_merges=True)
    fast, why = FastBPE.build_with_reason(hf, d)
    assert fast is None and "ignore_merges" in why
    # consistent: accepted, and equal
    hf, d = tiny(["ab", "bc", "abc"], merges=[("a", "b"), ("b", "c"), ("ab", "c")], ignore_merges=False)
    fast = FastBPE.build(hf, d)
    assert fast is not None
    for text in ["abc", "abcc", "aabcbc", "cabc", "bcab c"]:
        assert fast.encode(text, False) == hf.encode(text, add_special_tokens=False).ids


def test_token_no_merge_reaches_is_left_out_without_whole_word_lookup() -> None:
    # "xyz" has no split into tokens: HF without whole-word lookup never produces it; tiktoken would
    # look "xyz" up, so it must not be in the ranks (GPT-2's "<|endoftext|>" is such a token)
    hf, d = tiny(["ab", "xyz"], merges=[("a", "b")], ignore_merges=False)
    fast = FastBPE.build(hf, d)
    assert fast is not None
    assert fast.encode("xyz ab", False) == hf.encode("xyz ab", add_special_tokens=False).ids


SPLIT_PATTERN = r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def split_pre(**split: Any) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False}
            | split,
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"normalizer": {"type": "NFKC"}}, "normalizer"),
        ({"normalizer": {"type": "Lowercase"}}, "normalizer"),
        ({"pre_tokenizer": split_pre(behavior="Removed")}, "Split behavior"),
        ({"pre_tokenizer": split_pre(invert=True)}, "invert"),
        ({"pre_tokenizer": split_pre(pattern={"String": " "})}, "not a regex"),
        (
            {
                "pre_tokenizer": {
                    "type": "ByteLevel",
                    "add_prefix_space": True,
                    "trim_offsets": True,
                    "use_regex": True,
                }
            },
            "add_prefix_space",
        ),
        (
            {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
            "byte-level",
        ),
    ],
)
def test_unsupported_pipelines_are_refused(change: dict[str, Any], why: str) -> None:
    _, d = tiny(["ab", "ba"])
    d |= change
    hf = Tokenizer.from_str(json.dumps(d))
    fast, reason = FastBPE.build_with_reason(hf, d)
    assert fast is None and why in reason


@pytest.mark.parametrize(
    ("model_change", "why"),
    [
        ({"byte_fallback": True}, "byte_fallback"),
        ({"dropout": 0.5}, "dropout"),
        ({"end_of_word_suffix": "</w>"}, ""),
    ],
)
def test_unsupported_models_are_refused(model_change: dict[str, Any], why: str) -> None:
    _, d = tiny(["ab", "ba"])
    d["model"] |= model_change
    hf = Tokenizer.from_str(json.dumps(d))
    fast, reason = FastBPE.build_with_reason(hf, d)
    assert fast is None and why in reason


def test_added_tokens_that_look_around_and_flags_are_refused() -> None:
    hf, d = tiny(["ab"], added=[{"content": "<x>", "special": True, "lstrip": True}])
    assert FastBPE.build_with_reason(hf, d)[0] is None
    hf, d = tiny(["ab"])
    hf.enable_truncation(8)
    assert "truncation" in FastBPE.build_with_reason(hf, d)[1]
    hf, d = tiny(["ab"], added=[{"content": "<x>", "special": True}])
    hf.encode_special_tokens = True
    assert "encode_special_tokens" in FastBPE.build_with_reason(hf, d)[1]


ADDED = [
    {"content": "<x>", "special": True},
    {"content": "<xy>", "special": False},
    {"content": "é", "special": False},  # raw: NFC of "e\u0301" makes one after the raw split
    {"content": "ab\u0301", "special": False, "normalized": True},  # never matches NFC text
    {"content": "ñ", "special": False, "normalized": True},  # matched in the normalized text
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.sampled_from(["<x>", "<xy>", "<x", "y>", "é", "e", "\u0301", "n", "\u0303", "ñ", "ab", " ", "a"])
    )
)
def test_added_tokens_raw_and_normalized_around_nfc(parts: list[str]) -> None:
    fast, hf = _nfc_tiny()
    text = "".join(parts)
    for add in (False, True):
        assert fast.encode(text, add) == hf.encode(text, add_special_tokens=add).ids


@functools.cache
def _nfc_tiny() -> tuple[FastBPE, Tokenizer]:
    hf, d = tiny(["ab", "é", "ñ"], normalizer={"type": "NFC"}, added=ADDED)
    fast = FastBPE.build(hf, d)
    assert fast is not None and fast.nfc
    return fast, hf


def test_fast_bpe_for_rebuilds_when_added_tokens_change() -> None:
    hf, d = tiny(["ab"])
    first, _ = fast_bpe_for(hf, d)
    assert first is not None and fast_bpe_for(hf)[0] is first
    hf.add_tokens([AddedToken("<new>", special=False, normalized=False)])
    again, _ = fast_bpe_for(hf, d)
    assert again is not None and again is not first
    assert again.encode("ab<new>ab", False) == hf.encode("ab<new>ab", add_special_tokens=False).ids


# ---- the split of ASCII text in C (_pretok) ----------------------------------------------------------

_ASCII_PIECES = st.one_of(
    st.text(st.characters(max_codepoint=127), max_size=8),  # any ASCII: controls, 0x1C-0x1F, DEL
    st.sampled_from(["'s", "'T", "'re", "'VE", "'m", "'Ll", "'d", "'x", "''", "'", "'r", "'l"]),
    st.text(" \t\n\r\x0b\x0c", min_size=1, max_size=6),  # white-space runs, line breaks inside
    st.text("0123456789", min_size=1, max_size=7),
    st.text("abcXYZ", min_size=1, max_size=6),
    st.text('!?.,-_"\\/()', min_size=1, max_size=4),
)


@functools.cache
def _c_and_tiktoken(name: str) -> tuple[Callable[[str], list[int]], Callable[[str], list[int]]]:
    """The ordinary encoder of a tokenizer's core (the C split, checked in use) and tiktoken's."""
    fast = fast_of(name)
    assert fast.pattern in _C_SPLIT_DIGITS
    core = _cached_core(fast.hf, lambda: json.loads(fast.hf.to_str()), None)
    encode = _ordinary_encoder(core, lambda t: fast.hf.encode(t, add_special_tokens=False).ids)
    assert encode != core.encoding.encode_ordinary  # the C split is in use
    return encode, core.encoding.encode_ordinary


@pytest.mark.skipif(_encode_ascii is None, reason="_pretok not built")
@pytest.mark.parametrize("name", ["qwen3", "llama-3.1"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ASCII_PIECES, max_size=12).map("".join))
def test_the_c_split_of_ascii_text_gives_tiktokens_ids(name: str, text: str) -> None:
    """Qwen2's and cl100k's patterns decided in C for ASCII text: the ids are tiktoken's own
    ``encode_ordinary`` (its regex split and BPE), for any ASCII (contractions in any case, white-space
    runs with and without line breaks before text or at the end, digit runs, punctuation runs)."""
    encode, tiktoken_encode = _c_and_tiktoken(name)
    assert encode(text) == tiktoken_encode(text)
    assert encode(text + "é") == tiktoken_encode(text + "é")  # not ASCII: tiktoken's


@pytest.mark.skipif(_encode_ascii is None, reason="_pretok not built")
def test_the_rank_table_keeps_its_ids_when_the_ranks_dict_changes_or_goes() -> None:
    """The table holds its own references to the ids: the dict emptied and dropped after the table is
    built (its id objects freed with it, their memory reused) leaves the table's answers as they were."""
    from shepherd.tokens import _pretok

    base = 10**12  # ids that are not cached small ints: the dict's references are their only ones
    ranks = {tok.encode(): base + i for i, tok in enumerate(["hello", " world", "!", " x"])}
    table = _pretok.rank_table(ranks)
    ranks.clear()
    del ranks
    gc.collect()
    churn = [base * 3 + i for i in range(10_000)]  # new ints where the freed ones were
    pieces: list[bytes] = []

    def piece(b: bytes) -> list[int]:
        pieces.append(b)
        return [-1]

    for _ in range(3):  # bounded
        assert _pretok.encode_ascii("hello world! x", table, piece, 1) == [base, base + 1, base + 2, base + 3]
    assert pieces == [] and len(churn) == 10_000


@pytest.mark.parametrize("space", ["\u3000", "\u00a0"])
def test_a_run_that_overflows_tiktokens_regex_is_encoded_by_hf_not_a_crash(space: str) -> None:
    """tiktoken's regex overflows its stack on about a million non-ASCII spaces in a row; pyo3 raises that
    panic as a BaseException, which ended a tokenizer worker (and failed the other calls in flight). The
    encoder gives HF's ids for such a text instead, as for any other."""
    fast = fast_of("qwen3")
    text = "ab" + space * 1_000_000 + "cd"
    assert fast.encode(text, False) == fast.hf.encode(text, add_special_tokens=False).ids


def test_the_checks_verdict_is_kept_on_disk_per_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process start takes the expensive checks' verdict from the disk cache (keyed by the file's
    digest, the tokenizers version and the Unicode tables): accepted, refused, or with the tokens left
    out of the ranks; a damaged entry is checked again."""
    import shepherd.tokens.fast_bpe_core as core_mod

    monkeypatch.setenv("SHEPHERD_CACHE_DIR", str(tmp_path))
    cases = [
        (tiny(["ab", "xyz"], merges=[("a", "b")], ignore_merges=False), b"left-out", None),
        (tiny(["ab", "bc"], merges=[("b", "c"), ("a", "b")]), b"refused", "priority"),
        (tiny(DENSE), b"accepted", None),
    ]
    first = {}
    for (hf, d), key, why in cases:
        core_mod._CORES.clear()
        fast, reason = FastBPE.build_with_reason(hf, d, content_key=key)
        assert (fast is None) == (why is not None) and (why is None or why in reason)
        first[key] = (reason, None if fast is None else fast.encode("xyz ab aba", False))
    assert len(list((tmp_path / "bpe-checks").iterdir())) == 3
    real = core_mod._checks

    def no_checks(*a: Any, **k: Any) -> Any:
        raise AssertionError("checked again")

    monkeypatch.setattr(core_mod, "_checks", no_checks)
    for (hf, d), key, _ in cases:
        core_mod._CORES.clear()
        fast, reason = FastBPE.build_with_reason(hf, d, content_key=key)
        assert (reason, None if fast is None else fast.encode("xyz ab aba", False)) == first[key]
    for f in (tmp_path / "bpe-checks").iterdir():
        f.write_text('{"all_splits": "yes"}')
    for f in (tmp_path / "bpe-cores").iterdir():
        f.unlink()  # (else the accepted ones' cores are taken whole, below)
    calls: list[int] = []

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(core_mod, "_checks", counted)
    for (hf, d), key, _ in cases:
        core_mod._CORES.clear()
        assert FastBPE.build_with_reason(hf, d, content_key=key)[1] == first[key][0]
    assert len(calls) == 3


def test_no_verdict_is_kept_without_an_absolute_cache_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No HOME (expanduser leaves "~"), or a relative SHEPHERD_CACHE_DIR: nothing is written under the
    working directory; the checks simply run."""
    import shepherd.tokens.fast_bpe_core as core_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHEPHERD_CACHE_DIR", "relative-cache")
    hf, d = tiny(DENSE)
    core_mod._CORES.clear()
    assert FastBPE.build_with_reason(hf, d, content_key=b"no-home")[0] is not None
    assert list(tmp_path.iterdir()) == []


def test_a_core_is_kept_on_disk_and_taken_without_parsing_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process start takes an accepted tokenizer's core (pattern, flags, post-processor, ranks with the
    left-out tokens gone) from the disk cache without parsing tokenizer.json; a record cut short, or
    bytes that are no record, is a miss: the file is parsed and the core built and kept again."""
    import shepherd.tokens.fast_bpe_core as core_mod

    monkeypatch.setenv("SHEPHERD_CACHE_DIR", str(tmp_path))
    cases = [
        (tiny(["ab", "xyz"], merges=[("a", "b")], ignore_merges=False), b"left-out"),
        (tiny(DENSE), b"accepted"),
    ]
    texts = ["xyz ab aba", "", "abba xyzzy", "ab" * 40]
    first = {}
    for (hf, d), key in cases:
        core_mod._CORES.clear()
        fast, _ = FastBPE.build_with_reason(hf, d, content_key=key)
        assert fast is not None
        first[key] = ([fast.encode(t, True) for t in texts], dict(fast.token_ranks), fast.wraps)
    assert len(list((tmp_path / "bpe-cores").iterdir())) == 2
    parsed: list[bytes] = []

    def source(d: Any, key: bytes) -> Any:
        def give() -> Any:
            parsed.append(key)
            return d

        return give

    for (hf, d), key in cases:
        core_mod._CORES.clear()
        fast, _ = FastBPE.build_with_reason(hf, source(d, key), content_key=key)
        assert fast is not None
        assert ([fast.encode(t, True) for t in texts], dict(fast.token_ranks), fast.wraps) == first[key]
    assert parsed == []
    records = sorted((tmp_path / "bpe-cores").iterdir())
    records[0].write_bytes(records[0].read_bytes()[:-3])
    records[1].write_bytes(b"not a record at all")
    for (hf, d), key in cases:
        core_mod._CORES.clear()
        fast, _ = FastBPE.build_with_reason(hf, source(d, key), content_key=key)
        assert fast is not None
        assert [fast.encode(t, True) for t in texts] == first[key][0]
    assert sorted(parsed) == sorted(k for _, k in cases)
    for (hf, d), key in cases:  # kept whole again
        core_mod._CORES.clear()
        assert FastBPE.build_with_reason(hf, source(d, key), content_key=key)[0] is not None
    assert len(parsed) == 2


def test_a_kept_core_damaged_or_wrong_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A core record with one byte changed (its lengths kept) fails its digest: a miss, the file parsed
    again; one whose digest holds but whose ranks are wrong fails the encoder's self-check against HF:
    built again from the file and kept in its place."""
    import shepherd.tokens.fast_bpe_core as core_mod
    from shepherd.tokens.table_cache import Record

    monkeypatch.setenv("SHEPHERD_CACHE_DIR", str(tmp_path))
    hf, d = tiny(DENSE)
    key = b"damaged"
    core_mod._CORES.clear()
    fast, _ = FastBPE.build_with_reason(hf, d, content_key=key)
    assert fast is not None
    want = fast.encode("xyz ab aba", False)
    (record,) = (tmp_path / "bpe-cores").iterdir()
    raw = bytearray(record.read_bytes())
    raw[-2] ^= 0x01  # one rank's id
    record.write_bytes(bytes(raw))
    parsed: list[int] = []

    def source() -> Any:
        parsed.append(1)
        return d

    core_mod._CORES.clear()
    fast, _ = FastBPE.build_with_reason(hf, source, content_key=key)
    assert fast is not None and fast.encode("xyz ab aba", False) == want and parsed == [1]
    rec = Record.parse(record.read_bytes())  # kept whole again
    ids = list(rec.ints[0])
    rec.ints[0] = type(rec.ints[0])("I", ids[1:] + ids[:1])  # every rank moved: a valid record, wrong
    record.write_bytes(rec.dump())
    core_mod._CORES.clear()
    fast, _ = FastBPE.build_with_reason(hf, source, content_key=key)
    assert fast is not None and fast.encode("xyz ab aba", False) == want and parsed == [1, 1]
    assert list(Record.parse(record.read_bytes()).ints[0]) == ids  # the right core kept in its place


def test_a_record_with_any_byte_changed_is_refused() -> None:
    from shepherd.tokens.table_cache import Record

    data = Record({"a": 1}, [[b"ab", b"", b"c"]], [[1, 2, 3]]).dump()
    back = Record.parse(data)
    assert back.header == {"a": 1} and back.blobs == [[b"ab", b"", b"c"]] and list(back.ints[0]) == [1, 2, 3]
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(ValueError):
            Record.parse(bytes(bad))
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            Record.parse(data[:cut])
