"""Stop conditions of one choice: stop strings with a hold-back buffer, stop token ids, EOS.

Pure state machines, no tokenizer: ``StopMatcher`` is fed the detokenizer's text increments and the
token ids they came from; ``StoppingDecoder`` wires a detokenizer (anything with ``step``/``finish``)
to a matcher so that the stop-token/text interplay is done in one place.

Semantics (the same for every chunking of the text, and what a non-streaming call returns):

- Generation stops at the first point where the text contains a stop string: for the shortest prefix
  ``T[:e]`` of the output text that contains one, the match is the one ending at ``e``; when several
  end there (``"ab"`` and ``"b"``), the earliest-starting (longest) one wins. The output is cut before
  the match, or right after it with ``include_stop_str_in_output``. Nothing after it is ever emitted.
  (A longer stop string that would start earlier but complete later does not win: generation stops
  the moment a stop string appears, as in vLLM, SGLang and the OpenAI API.)
- Text that could still become a stop string (a suffix that is a proper prefix of one) is held back,
  never emitted early; it is released as soon as it cannot match, or by ``flush()`` at the natural end.
  With ``include_stop_str_in_output`` nothing needs holding (the text is output either way).
- A stop token id (``stop_token_ids``, and the EOS ids unless ``ignore_eos``) ends the choice; its
  text is not output (unless ``include_stop_str_in_output``, as vLLM does) and ids after it are ignored.
  Any held text is released then: no stop string can complete any more.
- Empty stop strings are ignored; duplicates are merged.
- ``min_tokens`` (the request's): a stop string counts only when its match ends in the text of a token
  past the first ``min_tokens`` output tokens (a match may begin in earlier text), as vLLM checks them
  (its detokenizer: ``len(output) > min_tokens``, the search offset moved past the earlier text); text
  that could still become a stop string is held back meanwhile, as always. The tokens are counted by
  the ids fed with the text (a feed of several ids that reaches past ``min_tokens`` counts as past it:
  ``ChoiceState`` feeds one id at a time when there are stop strings). Stop token ids are not
  affected: the engines do not generate them (nor EOS) before ``min_tokens``.

Cost per feed, whatever the text: O(k x (m + c)) for k stop strings of at most m characters and c new
characters, O(k x c) amortized: one KMP automaton per stop string, advanced over the new text only
(its state, the longest suffix of the output that is a proper prefix of that stop string, carries the
past: no rescan of the held tail), finds both full matches and what to hold back (the longest
state); runs in the start state are skipped with ``str.find`` of the first character (C), so text
without a stop string's first character costs no Python step. (Searching the held tail again per
feed, and checking each candidate start of the last m positions, is O(k x m^2) on repetitive text.)
The request bounds (16 strings of <= 1024 characters, requests.py) keep k x m at 16 Ki.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

__all__ = ["StopMatcher", "StopResult", "StoppingDecoder", "TextDecoder"]


class StopResult(NamedTuple):
    """What one feed produced: ``visible`` text safe to emit now; ``finished`` once a stop condition
    matched, with ``matched`` the stop string (str) or stop token id (int).

    A NamedTuple (immutable) rather than a frozen dataclass: one is built per engine chunk, and a
    frozen dataclass costs 4x more to construct (2 µs vs 0.5 µs here)."""

    visible: str
    finished: bool = False
    matched: str | int | None = None


_new_result = tuple.__new__  # StopResult(...) without the keyword-handling __new__ wrapper
_NOTHING = StopResult("")


_Spec = tuple[
    tuple[str, ...],
    frozenset[str],
    frozenset[int],
    tuple[tuple[int, ...], ...],
]

_SPEC_CACHED_CHARS = 256  # specs up to this many stop characters (and ids) are cached: ~1024 x 3 kB


def _failure(s: str) -> tuple[int, ...]:
    """KMP: for each i, the length of the longest proper prefix of ``s[: i + 1]`` that is also a suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        ch = s[i]
        while k and s[k] != ch:
            k = fail[k - 1]
        if s[k] == ch:
            k += 1
        fail[i] = k
    return tuple(fail)


def _build_spec(
    stop: tuple[str, ...], stop_token_ids: tuple[int, ...], eos_token_ids: tuple[int, ...]
) -> _Spec:
    """The immutable part of a matcher: stop strings (deduplicated, empty ones dropped), their first
    characters, the stop token ids and each string's KMP failure table."""
    stops = tuple(dict.fromkeys(s for s in stop if s))
    return (
        stops,
        frozenset(s[0] for s in stops),
        frozenset((*stop_token_ids, *eos_token_ids)),
        tuple(_failure(s) for s in stops),
    )


_cached_spec = functools.lru_cache(maxsize=1024)(_build_spec)  # a fleet repeats a few configurations


def _spec(stop: tuple[str, ...], stop_token_ids: tuple[int, ...], eos_token_ids: tuple[int, ...]) -> _Spec:
    """``_build_spec``, cached when small (bounded in bytes: entries x ``_SPEC_CACHED_CHARS``)."""
    if len(stop_token_ids) + len(eos_token_ids) <= _SPEC_CACHED_CHARS and (
        not stop or sum(map(len, stop)) <= _SPEC_CACHED_CHARS
    ):
        return _cached_spec(stop, stop_token_ids, eos_token_ids)
    return _build_spec(stop, stop_token_ids, eos_token_ids)


def _advance_past(s: str, fail: tuple[int, ...], state: int, text: str) -> int:
    """KMP over ``text`` from ``state`` without stopping at a match (one that may not count yet: see
    ``min_tokens``): the state after it, a full match going on as its failure state."""
    last = fail[len(s) - 1]
    i = 0
    while True:
        state, end = _advance(s, fail, state, text, i)
        if end < 0:
            return state
        state, i = last, end


def _advance(s: str, fail: tuple[int, ...], state: int, text: str, i: int = 0) -> tuple[int, int]:
    """KMP over ``text[i:]`` from ``state`` (the longest suffix of what was fed that is a proper prefix
    of ``s``): ``(the new state, -1)``, or ``(len(s), the index in text just past the first occurrence
    of s)``. Start-state runs are skipped with ``str.find``; O(len(text) - i + state) steps."""
    first = s[0]
    m = len(s)
    if m == 1:
        j = text.find(first, i)
        return (0, -1) if j < 0 else (1, j + 1)
    n = len(text)
    while i < n:
        if state == 0:
            j = text.find(first, i)
            if j < 0:
                return 0, -1
            state = 1
            i = j + 1
            continue
        ch = text[i]
        while state and s[state] != ch:
            state = fail[state - 1]
        if s[state] == ch:
            state += 1
            if state == m:
                return m, i + 1
        i += 1
    return state, -1


class StopMatcher:
    """Streaming matcher for one choice. Feed ``(new_text, new_token_ids)``; call ``flush()`` at the
    natural end of the output (length limit, engine-side stop) to release held text."""

    __slots__ = (
        "_fails",
        "_finished",
        "_firsts",
        "_include",
        "_left",
        "_matched",
        "_states",
        "_stop_ids",
        "_stops",
        "_tail",
    )

    def __init__(
        self,
        stop: Iterable[str] = (),
        *,
        include_stop_str_in_output: bool = False,
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> None:
        stops = stop if type(stop) is tuple else tuple(stop)
        ids = stop_token_ids if type(stop_token_ids) is tuple else tuple(stop_token_ids)
        eos = () if ignore_eos else eos_token_ids if type(eos_token_ids) is tuple else tuple(eos_token_ids)
        if stops or len(ids) + len(eos) > _SPEC_CACHED_CHARS:
            spec = _spec(stops, ids, eos)  # (sized first: big ones are not cached)
        else:  # the common case: no stop strings, a few ids
            spec = _cached_spec(stops, ids, eos)
        self._stops, self._firsts, self._stop_ids, self._fails = spec
        self._states: list[int] | None = None  # each stop's KMP state; None: all 0 (no tail)
        self._include = include_stop_str_in_output
        # The live partial match: the shortest suffix of the text so far that is a proper prefix of a
        # stop string (a match can only start there). Held back, unless include_stop_str_in_output.
        self._tail = ""
        self._finished = False
        self._matched: str | int | None = None
        # min_tokens less the tokens fed so far while that is >= 0 (the text fed is within the first
        # min_tokens tokens: no stop string may end in it), else -1 (from the first token: min_tokens 0)
        self._left = min_tokens if min_tokens > 0 and stops else -1

    # -- configuration and state ------------------------------------------------------------------

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def include_stop_str_in_output(self) -> bool:
        return self._include

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def matched(self) -> str | int | None:
        return self._matched

    @property
    def held(self) -> str:
        """Text fed but not yet emitted (a possible start of a stop string)."""
        return "" if self._include else self._tail

    def stop_token_index(self, token_ids: Sequence[int]) -> int:
        """Index of the first stop token in ``token_ids``, or -1."""
        stop_ids = self._stop_ids
        if stop_ids and not stop_ids.isdisjoint(token_ids):
            for i, t in enumerate(token_ids):
                if t in stop_ids:
                    return i
        return -1

    def text_ids(self, token_ids: Sequence[int]) -> Sequence[int]:
        """The ids whose text belongs in the output: those before the first stop token (and the stop
        token itself with ``include_stop_str_in_output``). Detokenize these, then ``feed`` the text
        with the full ``token_ids``."""
        i = self.stop_token_index(token_ids)
        if i < 0:
            return token_ids
        return token_ids[: i + 1] if self._include else token_ids[:i]

    # -- feeding ----------------------------------------------------------------------------------

    def feed(self, new_text: str, new_token_ids: Sequence[int] = ()) -> StopResult:
        """Feed the text of the next ids (as ``text_ids`` selects them) and the ids themselves."""
        if self._finished:
            return _new_result(StopResult, ("", True, self._matched))
        armed = True
        left = self._left
        if left >= 0:  # up to min_tokens tokens so far: does this text (of its ids) reach past them?
            left -= len(new_token_ids)
            armed = left < 0
            self._left = -1 if armed else left
        visible = new_text
        if new_text and self._stops and (self._states is not None or not self._firsts.isdisjoint(new_text)):
            # (fast path above: no partial match pending and no stop string can start in the new
            # text, so nothing can match or need holding)
            visible = self._match(new_text, armed)
            if self.finished:  # (the property: mypy keeps the narrowing of the attribute)
                return _new_result(StopResult, (visible, True, self._matched))
        stop_ids = self._stop_ids
        if stop_ids and new_token_ids and not stop_ids.isdisjoint(new_token_ids):
            self._finished = True
            self._matched = new_token_ids[self.stop_token_index(new_token_ids)]
            if self._tail and not self._include:  # no stop string can complete any more
                visible += self._tail
            self._tail = ""
            self._states = None
            return _new_result(StopResult, (visible, True, self._matched))
        if not visible:
            return _NOTHING
        return _new_result(StopResult, (visible, False, None))

    def flush(self) -> str:
        """Natural end of the output: release the held text (``""`` once a stop matched)."""
        tail, self._tail = self._tail, ""
        self._states = None
        return "" if (self._finished or self._include) else tail

    # -- internals --------------------------------------------------------------------------------

    def _match(self, text: str, armed: bool = True) -> str:
        """Advance every stop string's KMP state over ``text``; return what becomes visible, update
        the held tail, or finish at the first-completed stop (ties: the earliest start). Not ``armed``
        (within ``min_tokens``): no match counts, the states go on past them."""
        states = self._states
        if states is None:
            states = [0] * len(self._stops)
        fails = self._fails
        hit = -1  # the stop's index
        hit_end = 0  # in ``text``
        longest = 0
        for k, s in enumerate(self._stops):
            if not armed:
                st = states[k] = _advance_past(s, fails[k], states[k], text)
                if st > longest:
                    longest = st
                continue
            st, end = _advance(s, fails[k], states[k], text)
            if end >= 0:
                if hit < 0 or end < hit_end or (end == hit_end and len(s) > len(self._stops[hit])):
                    hit, hit_end = k, end
            else:
                states[k] = st
                if st > longest:
                    longest = st
        tail = self._tail
        if hit >= 0:
            self._finished, self._matched, self._tail, self._states = True, self._stops[hit], "", None
            if self._include:
                return text[:hit_end]  # the tail was already emitted
            return (tail + text)[: len(tail) + hit_end - len(self._stops[hit])]
        self._states = states if longest else None
        if self._include:
            return text
        buf = tail + text if tail else text
        cut = len(buf) - longest
        self._tail = buf[cut:] if longest else ""
        return buf[:cut] if longest else buf


class TextDecoder(Protocol):
    """What ``StoppingDecoder`` needs of a detokenizer (``IncrementalDetokenizer`` fits)."""

    def step(self, ids: Sequence[int]) -> str: ...

    def finish(self) -> str: ...


class StoppingDecoder:
    """One choice's output text: detokenize, then apply stop conditions.

    ``feed(ids)`` per engine chunk, ``finish()`` at the natural end (length, engine-side stop); both
    return a ``StopResult`` whose ``visible`` text is ready for the reasoning/tool parsers. Once
    ``finished``, ignore further engine output (and abort the engine request).
    """

    __slots__ = ("decoder", "matcher")

    def __init__(self, decoder: TextDecoder, matcher: StopMatcher) -> None:
        self.decoder = decoder
        self.matcher = matcher

    def feed(self, token_ids: Sequence[int]) -> StopResult:
        matcher = self.matcher
        if matcher._finished:
            return StopResult("", True, matcher.matched)
        stop_ids = matcher._stop_ids  # (stop_token_index's test, inlined: this runs once per engine chunk)
        i = matcher.stop_token_index(token_ids) if stop_ids and not stop_ids.isdisjoint(token_ids) else -1
        if i < 0:
            text = self.decoder.step(token_ids)
            if not matcher._stops:  # no stop string, no stop token here: matcher.feed's answer, at once
                return _new_result(StopResult, (text, False, None)) if text else _NOTHING
            return matcher.feed(text, token_ids)
        # a stop token ends the output: render the ids before it (and it, when included), flush
        text = self.decoder.step(token_ids[: i + 1] if matcher.include_stop_str_in_output else token_ids[:i])
        return matcher.feed(text + self.decoder.finish(), token_ids)

    def finish(self) -> StopResult:
        """Natural end: flush the detokenizer through the matcher, then release held text."""
        matcher = self.matcher
        if matcher.finished:
            return StopResult("", True, matcher.matched)
        result = matcher.feed(self.decoder.finish())
        if result.finished:
            return result
        return StopResult(result.visible + matcher.flush())
