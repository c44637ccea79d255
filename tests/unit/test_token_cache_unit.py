"""L0/L1 caches: the known bugs of other gateways, boundaries, safety detection, bounds, counters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

from shepherd.tokens import cache as token_cache
from shepherd.tokens.cache import CacheLimits, EncodePlan, SpecialSplitter, TokenCache
from shepherd.tokens.tokenizer import Tokenizer as ShepherdTokenizer
from tests.unit.test_tokenizer_shared import llama, qwen3

ROOT = Path(__file__).resolve().parents[2]


def fresh(t: ShepherdTokenizer, **limits: int) -> TokenCache:
    return TokenCache(t.hf, CacheLimits(**limits) if limits else None)


def test_key_includes_add_special_tokens() -> None:
    c = fresh(llama())
    bos = llama().hf.token_to_id("<|begin_of_text|>")
    with_bos = c.encode("Hello world", True)
    without = c.encode("Hello world", False)
    assert with_bos[0] == bos and with_bos[1:] == without
    assert c.encode("Hello world", True) == with_bos  # both cached, neither answers for the other
    assert c.encode("Hello world", False) == without


def test_suffix_gets_no_second_bos() -> None:
    t = llama()
    c = fresh(t, exact_entries=0)
    bos = 128000
    assert t.hf.token_to_id("<|begin_of_text|>") == bos
    prefix = "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    c.encode(prefix + "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", True)
    text = prefix + "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    got = c.encode(text, True)
    assert got == t.encode_uncached(text, True)
    assert got.count(bos) == 1 and got[0] == bos
    assert c.stats()["l1_hits"] > 0


def test_literal_bos_in_text_is_kept_as_hf_keeps_it() -> None:
    """A template that writes <|begin_of_text|> itself, encoded with add_special_tokens=True, gets two
    (that is what HF does and what the cache must reproduce); chat prompts use False and get one."""
    t = llama()
    bos = 128000
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert t.encode(text, True)[:2] == [bos, bos] == t.encode_uncached(text, True)[:2]
    assert t.encode(text, False).count(bos) == 1


def test_boundaries_are_leftmost_longest() -> None:
    s = SpecialSplitter(["<|a|>", "<|a|>b", "b<|c|>", "<|c|>"])
    # at offset 0 the longest token wins; the overlapping "b<|c|>" cannot start inside it
    assert s.split("<|a|>b<|c|>x") == ["<|a|>b", "<|c|>", "x"]
    assert s.split("xb<|c|>") == ["xb<|c|>"]
    assert s.split("") == [""]
    assert s.split("plain") == ["plain"]
    # llama's reserved tokens are prefixes of one another
    sp = SpecialSplitter([f"<|reserved_special_token_{i}|>" for i in range(250)])
    assert sp.split("a<|reserved_special_token_10|>b<|reserved_special_token_1|>") == [
        "a<|reserved_special_token_10|>",
        "b<|reserved_special_token_1|>",
    ]


def test_real_overlapping_markers_match_hf() -> None:
    t = llama()
    for text in [
        "<|reserved_special_token_10|>",
        "<|reserved_special_token_1|>0|>",
        "<|reserved_special_token_1<|eot_id|>",
        "<|eot_id|><|eot_id|>x<|eom_id|>",
    ]:
        for add in (False, True):
            assert fresh(t, exact_entries=0).encode(text, add) == t.encode_uncached(text, add)


def test_normalized_tokens_are_boundaries_only_under_an_identity_normalizer() -> None:
    s = SpecialSplitter(["<raw>"], ["<n>"])
    assert s.split("a<n>b<raw>c<n>") == ["a<n>", "b<raw>", "c<n>"]
    # raw matches come first, normalized ones only inside the gaps
    # (one matcher over all tokens would take "<n>x" at offset 0)
    s2 = SpecialSplitter(["x<raw>"], ["<n>x", "<n>"])
    assert s2.split("<n>x<raw>") == ["<n>", "x<raw>"]


def test_two_stage_matching_agrees_with_hf() -> None:
    """tokenizers matches normalized=False tokens on the raw text first, normalized ones in the gaps."""
    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "x": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(
        [
            AddedToken("x<raw>", special=True, normalized=False),
            AddedToken("<n>x", special=True, normalized=True),
            AddedToken("<n>", special=True, normalized=True),
        ]
    )
    c = TokenCache(hf, CacheLimits(exact_entries=0))
    assert c.segmenting
    for text in ["<n>x<raw>", "a<n>xa", "<n>x<raw>x<raw><n><n>x", "x<n>x<raw>"]:
        assert c.encode(text, False) == hf.encode(text, add_special_tokens=False).ids


def _wordlevel(
    added: list[AddedToken], *, normalizer: normalizers.Normalizer | None = None, pre: object = None
) -> Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "hello": 3, "world": 4, "▁a": 5, "▁hello": 6, "▁world": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre if pre is not None else pre_tokenizers.Whitespace()  # type: ignore[assignment]
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.add_special_tokens(added)
    return tok


def test_tokens_that_look_at_neighbours_disable_segmenting() -> None:
    for flag in ("lstrip", "rstrip", "single_word"):
        hf = _wordlevel([AddedToken("<s>", special=True, **{flag: True})])
        c = TokenCache(hf)
        assert not c.segmenting and c.segmenting_disabled_reason
        text = "hello <s> world <s>a"
        assert c.encode(text, True) == hf.encode(text, add_special_tokens=True).ids


def test_metaspace_first_disables_segmenting() -> None:
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf = _wordlevel([AddedToken("<s>", special=True, normalized=False)], pre=pre)
    c = TokenCache(hf)
    assert not c.segmenting
    # why: the piece after a special token is not "first" in the whole text, but is on its own
    pieces = SpecialSplitter(["<s>"]).split("hello<s>world")
    naive = [i for p in pieces for i in hf.encode(p, add_special_tokens=False).ids]
    assert naive != hf.encode("hello<s>world", add_special_tokens=False).ids
    for text in ["hello<s>world", "a <s> a", "<s>hello"]:
        assert c.encode(text, False) == hf.encode(text, add_special_tokens=False).ids


def test_non_identity_normalizer_keeps_raw_boundaries_exact() -> None:
    hf = _wordlevel(
        [AddedToken("<S>", special=True, normalized=False), AddedToken("<N>", special=True, normalized=True)],
        normalizer=normalizers.Lowercase(),
    )
    c = TokenCache(hf, CacheLimits(exact_entries=0))
    assert c.segmenting
    for text in ["HELLO<S>World", "a<N>b<S>c", "<n>A<S><S>", "HELLO <N> WORLD"]:
        for add in (False, True):
            assert c.encode(text, add) == hf.encode(text, add_special_tokens=add).ids


def test_a_wrapping_post_processor_is_learned() -> None:
    hf = _wordlevel([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 8), ("[SEP]", 9)]
    )
    c = TokenCache(hf, CacheLimits(exact_entries=0))
    assert c.segmenting
    for text in ["hello [SEP] world", "a[CLS]b", "", "[SEP]"]:
        for add in (False, True):
            assert c.encode(text, add) == hf.encode(text, add_special_tokens=add).ids


def test_plain_text_uses_l0_only_and_counts() -> None:
    c = fresh(qwen3())
    c.encode("no special tokens here")
    c.encode("no special tokens here")
    s = c.stats()
    assert (s["l0_hits"], s["l0_misses"], s["l1_hits"], s["l1_misses"]) == (1, 1, 0, 0)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    c.encode(text)
    c.encode(text.replace("hi", "yo"))
    s = c.stats()
    assert s["l1_misses"] == 4 + 1 and s["l1_hits"] == 3


def test_returned_ids_are_copies() -> None:
    c = fresh(qwen3())
    a = c.encode("<|im_start|>x<|im_end|>")
    a.append(-1)
    assert c.encode("<|im_start|>x<|im_end|>") == qwen3().encode_uncached("<|im_start|>x<|im_end|>")


def test_memory_is_bounded() -> None:
    c = fresh(qwen3(), exact_entries=1000, exact_ids=300, segment_entries=1000, segment_ids=200)
    for i in range(200):
        c.encode(f"<|im_start|>user\nmessage number {i} with some words<|im_end|>\n")
    s = c.stats()
    assert s["l0_ids"] <= 300 and s["l1_ids"] <= 200
    c.encode("x" * 5000)  # bigger than a whole cache: not kept, still right
    assert c.stats()["l0_ids"] <= 300


def test_plan_and_complete_split_the_work() -> None:
    t = qwen3()
    c = fresh(t)
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    plan = c.plan(text, False)
    assert plan.done is None and plan.segmented
    assert "".join(plan.pieces) == text
    encoded = [t.encode_uncached(p, False) for p in plan.missing_pieces()]
    assert c.complete(plan, encoded) == t.encode_uncached(text, False)
    assert c.plan(text, False).done == t.encode_uncached(text, False)
    with pytest.raises(ValueError):
        c.complete(c.plan(text + "x", False), [])


# ---- the splitter's matcher and the one-pass encode ------------------------------------------------


def _flat(tokens: list[str]) -> re.Pattern[str] | None:
    ordered = sorted({t for t in tokens if t}, key=lambda s: (-len(s), s))
    return re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None


def _reference_cuts(raw: list[str], norm: list[str], text: str) -> list[int]:
    """The matching as first written: flat alternations, longest first; raw tokens on the whole text,
    normalized ones inside the gaps between them."""
    r, n = _flat(raw), _flat(norm)
    if r is None:
        return [m.end() for m in n.finditer(text)] if n is not None else []
    ends: list[int] = []
    gap = 0
    for m in r.finditer(text):
        if n is not None and m.start() > gap:
            ends.extend(x.end() for x in n.finditer(text, gap, m.start()))
        ends.append(m.end())
        gap = m.end()
    if n is not None and gap < len(text):
        ends.extend(x.end() for x in n.finditer(text, gap))
    return ends


_TOKEN = st.text("ab<|>", min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(
    raw=st.lists(_TOKEN, max_size=6),
    norm=st.lists(_TOKEN, max_size=3),
    text=st.text("ab<|>x", max_size=40),
)
def test_trie_matching_is_the_flat_leftmost_longest_matching(
    raw: list[str], norm: list[str], text: str
) -> None:
    """Tokens from a tiny alphabet: prefixes of one another, overlapping, repeated."""
    s = SpecialSplitter(raw, norm)
    assert s.cuts(text) == _reference_cuts(raw, norm, text)
    parts = s.parts(text)
    assert "".join(parts) == text and len(parts) % 2 == 1
    assert all(p in set(raw) | set(norm) for p in parts[1::2])
    pieces = s.split(text)
    assert "".join(pieces) == text and (len(pieces) == 1 or all(pieces))


def test_a_trie_too_deep_for_python_falls_back_to_the_flat_matcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of tokens, each a prefix of the next, nest the trie deeper than the recursion limit."""

    def too_deep(tokens: list[str]) -> str:
        raise RecursionError

    monkeypatch.setattr(token_cache, "_trie", too_deep)
    s = SpecialSplitter(["a", "aa", "aaa", "b"])
    assert s.split("xaaaaby") == ["xaaa", "a", "b", "y"]


def test_encode_or_plan_encodes_small_remainders_and_plans_big_ones() -> None:
    t = qwen3()
    c = fresh(t)
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    text = head + "word " * 100 + "<|im_end|>\n"
    plan = c.encode_or_plan(text, False, 100)
    assert isinstance(plan, EncodePlan) and plan.missing_chars > 100 and plan.segmented
    ids = c.complete(plan, c.encode_pieces(plan.missing_pieces(), plan.piece_add_special))
    assert ids == t.encode_uncached(text, False)
    assert c.encode_or_plan(text, False, 0) == ids  # L0
    other = head + "more " * 100 + "<|im_end|>\n"
    got = c.encode_or_plan(other, True, 10_000)
    assert not isinstance(got, EncodePlan) and got == t.encode_uncached(other, True)
    whole = "no special tokens at all " * 20
    assert isinstance(c.encode_or_plan(whole, False, 10), EncodePlan)
    assert c.encode_or_plan(whole, False, None) == t.encode_uncached(whole, False)


def test_an_l0_hit_is_a_copy_too() -> None:
    t = qwen3()
    c = fresh(t)
    text = "<|im_start|>user\nmutate me<|im_end|>\n"
    c.encode(text, False)
    hit = c.encode(text, False)
    hit.append(-1)
    hit[0] = -2
    assert c.encode(text, False) == t.encode_uncached(text, False)
    assert c.stats()["l0_hits"] == 2


def test_without_fast_bpe_the_pieces_go_to_tokenizers() -> None:
    t = llama()
    c = TokenCache(t.hf, CacheLimits(exact_entries=0), fast_bpe=False)
    assert c.fast is None and c.segmenting
    turn = "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    for text in [turn.format("one"), turn.format("one") + turn.format("two"), "plain"]:
        for add in (False, True):
            assert c.encode(text, add) == t.encode_uncached(text, add)
