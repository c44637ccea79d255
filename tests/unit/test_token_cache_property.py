"""The cache invariant: cached encode == plain encode, whatever the text and the cache state."""

from __future__ import annotations

from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.proto.prompt_ids import PromptIds
from shepherd.tokens.cache import HEAD_KEY, SPECIALS_KEY, TAIL_KEY, CacheLimits, TokenCache
from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import llama, qwen3


def tok(name: str) -> Tokenizer:
    return qwen3() if name == "qwen3" else llama()


@cache
def l1_only(name: str) -> TokenCache:
    """A cache without L0, so every call goes through the segment cache."""
    return TokenCache(tok(name).hf, CacheLimits(exact_entries=0))


@cache
def tiny(name: str) -> TokenCache:
    """A cache small enough to evict all the time."""
    return TokenCache(
        tok(name).hf, CacheLimits(exact_entries=3, exact_ids=200, segment_entries=5, segment_ids=60)
    )


MARKERS = {
    "qwen3": [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|vision_start|>",
    ],
    "llama-3.1": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_10|>",
        "<|reserved_special_token_100|>",
    ],
}
PARTIALS = [
    "<|",
    "|>",
    "<|im_",
    "im_end|>",
    "<|end",
    "_of_text|>",
    "<think",
    "think>",
    "<|eot_id",
    "|",
    "<",
    ">",
]
SPACES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", " \n "]
UNICODE = [
    "é",
    "e\u0301",
    "\u0301",
    "日本語",
    "🦙",
    "👩‍💻",
    "Ünïcödé",
    "ｆｕｌｌ",
    "\ufeff",
    "Äpfel",
    "1234567",
    "'s",
    "'RE",
]


def pieces(name: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(MARKERS[name]),
        st.sampled_from(PARTIALS),
        st.sampled_from(SPACES),
        st.sampled_from(UNICODE),
        st.text(max_size=12),
        st.text(alphabet="ab <|>_\n", max_size=8),
    )


def texts(name: str) -> st.SearchStrategy[str]:
    return st.lists(pieces(name), max_size=14).map("".join)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(name: str, text: str) -> None:
    t = tok(name)
    for add in (False, True):
        want = t.encode_uncached(text, add)
        for got in (
            t.encode(text, add),
            t.encode(text, add),  # again: an L0 hit
            l1_only(name).encode(text, add),  # segments, some cached by earlier examples
            l1_only(name).encode(text, add),  # every segment cached now
            tiny(name).encode(text, add),
        ):
            assert got == want
            check_shape(t, got)


def check_shape(t: Tokenizer, ids: list[int]) -> None:
    """The pieces a result says it is made of (the block-naming memo trusts them) are its ids."""
    assert isinstance(ids, PromptIds) and sum(n for _, n in ids.shape) == len(ids)
    pos = 0
    whole_with_specials = False
    for key, n in ids.shape:
        part, pos = ids[pos : pos + n], pos + n
        if key == SPECIALS_KEY:
            assert n == 0
            whole_with_specials = True
        elif key not in (HEAD_KEY, TAIL_KEY):
            assert part == t.encode_uncached(key, whole_with_specials)


@SETTINGS
@given(texts("qwen3"))
def test_qwen3_cached_equals_plain(text: str) -> None:
    check("qwen3", text)


@SETTINGS
@given(texts("llama-3.1"))
def test_llama31_cached_equals_plain(text: str) -> None:
    check("llama-3.1", text)


@settings(max_examples=60, deadline=None)
@given(st.lists(texts("qwen3"), min_size=2, max_size=5))
def test_shared_prefixes_hit_and_stay_exact(turns: list[str]) -> None:
    """Growing conversations (each text extends the previous one) hit L1 for the old part."""
    name = "qwen3"
    convo = ""
    for turn in turns:
        convo += "<|im_start|>user\n" + turn + "<|im_end|>\n"
        prompt = convo + "<|im_start|>assistant\n"
        assert l1_only(name).encode(prompt, False) == tok(name).encode_uncached(prompt, False)
