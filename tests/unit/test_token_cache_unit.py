"""L0/L1 caches: the known bugs of other gateways, boundaries, safety detection, bounds, counters."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

from shepherd.node.token_cache import CacheLimits, SpecialSplitter, TokenCache
from shepherd.node.tokenizer import Tokenizer as ShepherdTokenizer
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
