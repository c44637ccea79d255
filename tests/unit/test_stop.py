"""StopMatcher / StoppingDecoder: streamed output == non-streamed output == a plain reference."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.output.stop import StopMatcher, StoppingDecoder, StopResult
from shepherd.tokens.detokenizer import IncrementalDetokenizer
from tests.helpers_tokenizers import load, token_id


def reference(text: str, stops: Iterable[str], include: bool) -> tuple[str, str | None]:
    """Cut ``text`` at the stop string that completes first (ties: the one starting earliest)."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        if s and (i := text.find(s)) >= 0:
            cand = (i + len(s), i, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s


def split(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces, last = [], 0
    for p in [*points, len(text)]:
        pieces.append(text[last:p])
        last = p
    return pieces


def run(matcher: StopMatcher, chunks: Sequence[str]) -> tuple[str, StopResult | None]:
    """Stream ``chunks``; check the hold-back invariants after every feed."""
    out = ""
    fed = ""
    last: StopResult | None = None
    for chunk in chunks:
        res = matcher.feed(chunk)
        fed += chunk
        out += res.visible
        if res.finished:
            last = res
            assert matcher.feed("more text") == StopResult("", True, res.matched)
            assert matcher.flush() == ""
            break
        held = matcher.held
        assert fed == out + held  # nothing lost, nothing invented
        if not matcher.include_stop_str_in_output:
            assert not any(s in out for s in matcher.stop_strings)
            # the held text is a possible start of a stop string, and nothing earlier is
            assert held == "" or any(s.startswith(held) for s in matcher.stop_strings)
            for i in range(len(out)):
                assert not any(s.startswith(fed[i:]) for s in matcher.stop_strings)
        else:
            assert held == ""
    else:
        out += matcher.flush()
    return out, last


ALPHABET = "ab c\n"
stop_lists = st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=5)


@settings(max_examples=600, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=stop_lists,
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=12),
)
def test_streamed_equals_reference_for_any_chunking(
    text: str, stops: list[str], include: bool, cuts: list[int]
) -> None:
    want, matched = reference(text, stops, include)
    streamed, last = run(StopMatcher(stops, include_stop_str_in_output=include), split(text, cuts))
    whole, whole_last = run(StopMatcher(stops, include_stop_str_in_output=include), [text])
    assert streamed == whole == want
    assert (last.matched if last else None) == (whole_last.matched if whole_last else None) == matched
    # char-by-char is the hardest chunking
    by_char, _ = run(StopMatcher(stops, include_stop_str_in_output=include), list(text))
    assert by_char == want


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=30),
    stops=st.lists(st.text(min_size=1, max_size=6), max_size=4),
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_equals_reference_any_unicode(
    text: str, stops: list[str], include: bool, cuts: list[int]
) -> None:
    # plant a stop string sometimes so matches happen
    if stops and cuts:
        at = cuts[0] % (len(text) + 1)
        text = text[:at] + stops[-1] + text[at:]
    want, _ = reference(text, stops, include)
    got, _ = run(StopMatcher(stops, include_stop_str_in_output=include), split(text, cuts))
    assert got == want


# -- regressions ---------------------------------------------------------------------------------


def test_stop_string_straddling_chunks_never_leaks() -> None:
    m = StopMatcher(["\n\nUser:"])
    outs = [m.feed(c) for c in ["Sure, here.", "\n", "\nUs", "er", ": ignored", "later"]]
    assert [o.visible for o in outs] == ["Sure, here.", "", "", "", "", ""]
    assert outs[4].finished and outs[4].matched == "\n\nUser:"
    assert outs[5] == StopResult("", True, "\n\nUser:")


def test_held_partial_match_is_released_by_flush_at_the_end() -> None:
    m = StopMatcher(["</answer>"])
    assert m.feed("The result is 42 </ans").visible == "The result is 42 "
    assert m.held == "</ans"
    assert m.flush() == "</ans"  # the stream ended: nothing swallowed
    assert m.flush() == ""


def test_held_text_released_once_it_cannot_match() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("go ST").visible == "go "
    assert m.feed("OMP").visible == "STOMP"
    assert m.held == ""


def test_overlapping_stops_earliest_start_wins_on_a_tie() -> None:
    m = StopMatcher(["b", "ab"])
    assert m.feed("xa").visible == "x"
    res = m.feed("b")
    assert res == StopResult("", True, "ab")


def test_first_completed_stop_wins() -> None:
    # "c" completes before "abcd" could; the engine would already have been stopped there
    assert run(StopMatcher(["abcd", "c"]), ["ab", "cd"])[0] == "ab"
    assert reference("abcd", ["abcd", "c"], False) == ("ab", "c")


def test_prefix_stops_with_include() -> None:
    res = StopMatcher(["abc", "ab"], include_stop_str_in_output=True).feed("xxabcd")
    assert res == StopResult("xxab", True, "ab")
    m = StopMatcher(["abc", "ab"], include_stop_str_in_output=True)
    assert m.feed("xxa").visible == "xxa"  # nothing held when the stop would be output anyway
    assert m.feed("bcd") == StopResult("b", True, "ab")


def test_include_matches_across_chunks_and_truncates_after() -> None:
    m = StopMatcher(["<end>"], include_stop_str_in_output=True)
    assert m.feed("text <e").visible == "text <e"
    assert m.feed("nd> trailing") == StopResult("nd>", True, "<end>")


def test_empty_and_duplicate_stop_strings_are_ignored() -> None:
    m = StopMatcher(["", "x", "x", ""])
    assert m.stop_strings == ("x",)
    assert m.feed("abc").visible == "abc"
    assert StopMatcher([""]).feed("anything") == StopResult("anything")


def test_long_stop_spanning_many_chunks() -> None:
    stop = "<|the end of this very long stop sequence|>"
    text = "before " + stop + " after"
    m = StopMatcher([stop])
    out = ""
    for ch in text:
        res = m.feed(ch)
        out += res.visible
        if res.finished:
            break
    assert out == "before "
    assert m.matched == stop


def test_stop_token_ids_and_eos() -> None:
    m = StopMatcher(stop_token_ids=[7], eos_token_ids=[2])
    assert m.feed("hi", [5]) == StopResult("hi")
    assert m.feed("", [2]) == StopResult("", True, 2)
    m = StopMatcher(stop_token_ids=[7], eos_token_ids=[2], ignore_eos=True)
    assert m.feed("a", [2]) == StopResult("a")
    assert m.feed("b", [7]) == StopResult("b", True, 7)


def test_stop_token_releases_held_text_and_string_match_before_token_wins() -> None:
    m = StopMatcher(["STOP"], eos_token_ids=[0])
    assert m.feed("abc ST", [1, 2]).visible == "abc "
    assert m.feed("", [0]) == StopResult("ST", True, 0)
    m = StopMatcher(["STOP"], eos_token_ids=[0])
    assert m.feed("x STOP", [1, 0]) == StopResult("x ", True, "STOP")


def test_text_ids_cut_at_the_first_stop_token() -> None:
    m = StopMatcher(stop_token_ids=[9], eos_token_ids=[2])
    assert m.text_ids([1, 2, 3, 9]) == [1]
    assert m.stop_token_index([1, 2, 3]) == 1
    assert m.text_ids([1, 3]) == [1, 3]
    inc = StopMatcher(stop_token_ids=[9], include_stop_str_in_output=True)
    assert inc.text_ids([1, 9, 4]) == [1, 9]


# -- with the detokenizer ----------------------------------------------------------------------------


def decoder(name: str, skip: bool = True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(load(name), skip_special_tokens=skip)


def test_eos_text_is_not_emitted_even_when_rendering_special_tokens() -> None:
    tok = load("qwen3")
    eos = token_id(tok, "<|im_end|>")
    ids = tok.encode("Hello there<|im_end|>trailing", add_special_tokens=False).ids
    sd = StoppingDecoder(decoder("qwen3", skip=False), StopMatcher(eos_token_ids=[eos]))
    out = [sd.feed(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    assert "".join(r.visible for r in out) == "Hello there"
    assert any(r.finished and r.matched == eos for r in out)
    inc = StoppingDecoder(
        decoder("qwen3", skip=False), StopMatcher(eos_token_ids=[eos], include_stop_str_in_output=True)
    )
    assert inc.feed(ids).visible == "Hello there<|im_end|>"


def test_stop_string_spanning_tokens_with_real_tokenizer() -> None:
    tok = load("llama-3.1")
    ids = tok.encode("The answer: 42\n\nQuestion: next", add_special_tokens=False).ids
    sd = StoppingDecoder(decoder("llama-3.1"), StopMatcher(["\n\nQuestion:"]))
    visible = ""
    for i in ids:
        res = sd.feed([i])
        visible += res.visible
        if res.finished:
            break
    else:
        visible += sd.finish().visible
    assert visible == "The answer: 42"


def test_natural_end_flushes_held_text_and_incomplete_bytes() -> None:
    tok = load("gpt2")
    ids = (
        tok.encode("tail ##", add_special_tokens=False).ids
        + tok.encode("🦩", add_special_tokens=False).ids[:1]
    )
    sd = StoppingDecoder(decoder("gpt2"), StopMatcher(["###"]))
    visible = "".join(sd.feed([i]).visible for i in ids)
    end = sd.finish()
    assert not end.finished
    assert visible + end.visible == tok.decode(ids)  # "tail ##" then the incomplete byte as U+FFFD


def test_stop_token_flushes_detokenizer_held_bytes() -> None:
    tok = load("gpt2")
    eos = 50256
    partial = tok.encode("🦩", add_special_tokens=False).ids[:2]
    sd = StoppingDecoder(decoder("gpt2"), StopMatcher(eos_token_ids=[eos]))
    assert sd.feed(partial).visible == ""
    res = sd.feed([eos, 100])
    assert res.finished and res.matched == eos
    assert res.visible == tok.decode(partial)
    assert sd.finish() == StopResult("", True, eos)


@pytest.mark.parametrize("name", ["qwen3", "llama2"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_pipeline_equals_reference_on_decoded_text(name: str, data: st.DataObject) -> None:
    tok = load(name)
    words = st.sampled_from(["Hello", " world", "\n\n", "User:", " 你好", "🎉", " end", "END", "e", "nd"])
    text = "".join(data.draw(st.lists(words, max_size=12), label="text"))
    stops = data.draw(st.lists(st.sampled_from(["\n\nUser", "END", "好 ", "o w", "🎉 e", "d"]), max_size=3))
    include = data.draw(st.booleans(), label="include")
    ids = tok.encode(text, add_special_tokens=False).ids
    size = data.draw(st.integers(1, 4), label="chunk size")
    want, matched = reference(tok.decode(ids), stops, include)
    sd = StoppingDecoder(IncrementalDetokenizer(tok), StopMatcher(stops, include_stop_str_in_output=include))
    got = ""
    res = StopResult("")
    for i in range(0, len(ids), size):
        res = sd.feed(ids[i : i + size])
        got += res.visible
        if res.finished:
            break
    else:
        res = sd.finish()
        got += res.visible
    assert got == want
    assert res.matched == matched
