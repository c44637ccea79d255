"""Stop strings and min_tokens: a stop string counts only when its match ends in the text of a token past
the first ``min_tokens`` output tokens (a match may begin in earlier text), as vLLM checks them (its
detokenizer: ``len(output_token_ids) > min_tokens``, the search offset moved past the earlier text). The
engines do not stop before min_tokens (EOS and stop ids are masked), so neither does the gateway."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import shepherd.tokens as tokens_pkg
from shepherd.node.openai.requests import parse_completion
from shepherd.node.output.choice import ChoiceState
from shepherd.node.output.stop import StopMatcher
from shepherd.tokens.tokenizer import Tokenizer

QWEN3 = Path(tokens_pkg.__file__).parent / "assets" / "qwen3"


def test_the_reviews_case_a_stop_within_min_tokens_does_not_end_the_choice() -> None:
    tok = Tokenizer.load(QWEN3)
    r = parse_completion({"model": "m", "prompt": "x", "stop": ["\n"], "min_tokens": 8, "max_tokens": 32})
    st_ = ChoiceState(0, tok, r.sampling, [])
    ids = tok.hf.encode("a\nb c d e f g h i j", add_special_tokens=False).ids
    assert len(ids) > 8 and tok.decode(ids[:2]) == "a\n"  # the stop is in the 2nd token's text
    text = st_.feed(ids, [])
    assert not st_.finished and st_.tokens == len(ids)
    assert text + st_.end("length") == "a\nb c d e f g h i j"
    # the same output without min_tokens stops at the first "\n"
    r = parse_completion({"model": "m", "prompt": "x", "stop": ["\n"], "max_tokens": 32})
    st_ = ChoiceState(0, tok, r.sampling, [])
    assert st_.feed(ids, []) == "a" and st_.finished and st_.matched == "\n" and st_.tokens == 2
    # a stop after min_tokens tokens still ends it
    r = parse_completion({"model": "m", "prompt": "x", "stop": [" i"], "min_tokens": 8, "max_tokens": 32})
    st_ = ChoiceState(0, tok, r.sampling, [])
    assert st_.feed(ids, []) == "a\nb c d e f g h" and st_.matched == " i"


def test_a_match_beginning_within_min_tokens_counts_once_it_ends_past() -> None:
    m = StopMatcher(["ab"], min_tokens=1)
    held = m.feed("a", [1])
    assert held.visible == "" and not held.finished  # held: it may become the stop string
    assert m.feed("b", [2]) == ("", True, "ab")  # ends in token 2: it counts (vLLM finds it too)
    m = StopMatcher(["ab"], min_tokens=2)
    assert m.feed("a", [1]).visible == ""
    assert m.feed("b", [2]).visible == "ab"  # ends in token 2 = min_tokens: not yet
    assert not m.finished and m.feed("ab", [3]) == ("", True, "ab")
    m = StopMatcher(["ab"], min_tokens=2, include_stop_str_in_output=True)
    assert m.feed("ab", [1]).visible == "ab" and m.feed("xab", [2]).visible == "xab"
    assert m.feed("cab", [3]) == ("cab", True, "ab")


def test_text_without_ids_belongs_to_the_tokens_before_it() -> None:
    m = StopMatcher(["z"], min_tokens=1)
    assert m.feed("a", [1]).visible == "a"
    assert m.feed("z").visible == "z"  # (a detokenizer's flush: still token 1's text)
    assert m.feed("z", [2]) == ("", True, "z")


# ---- any text, any split: the reference rule ---------------------------------------------------------------


def reference(pieces: list[str], stops: list[str], min_tokens: int, include: bool) -> tuple[str, str | None]:
    """vLLM's rule, by brute force: the first end position e past the text of the first min_tokens pieces
    at which a stop string ends (ties: the longest); the output up to it, without the stop unless
    ``include``."""
    text = "".join(pieces)
    armed_from = len("".join(pieces[:min_tokens]))
    stops = [s for s in stops if s]
    for e in range(armed_from + 1, len(text) + 1):
        ending = [s for s in stops if e - len(s) >= 0 and text[e - len(s) : e] == s]
        if ending:
            s = max(ending, key=len)
            return (text[:e] if include else text[: e - len(s)]), s
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text("abc", max_size=3), max_size=10),
    st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
    st.integers(0, 6),
    st.booleans(),
)
def test_the_matcher_agrees_with_the_reference(
    pieces: list[str], stops: list[str], min_tokens: int, include: bool
) -> None:
    m = StopMatcher(stops, min_tokens=min_tokens, include_stop_str_in_output=include)
    out = []
    for i, piece in enumerate(pieces):
        res = m.feed(piece, [i])
        out.append(res.visible)
        if res.finished:
            break
    else:
        out.append(m.flush())
    want_text, want_stop = reference(pieces, stops, min_tokens, include)
    assert ("".join(out), m.matched) == (want_text, want_stop)
