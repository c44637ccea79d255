"""Small string helpers shared by the parsers: partial-marker hold-back and bracket scanning."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["BracketScanner", "JsonStringTracker", "find_first", "partial_suffix_len"]


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (the part to hold back: it may still become a marker)."""
    best = 0
    n = len(text)
    for m in markers:
        first = m[0]
        pos = text.find(first, max(0, n - len(m) + 1))
        while pos != -1:
            if n - pos <= best:
                break
            if m.startswith(text[pos:]):
                best = n - pos
                break
            pos = text.find(first, pos + 1)
    return best


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """Earliest occurrence of any marker at or after ``start``: ``(index, marker)`` or ``(-1, "")``.
    On a tie the longer marker wins."""
    best_i = -1
    best_m = ""
    for m in markers:
        i = text.find(m, start)
        if i != -1 and (best_i == -1 or i < best_i or (i == best_i and len(m) > len(best_m))):
            best_i, best_m = i, m
    return best_i, best_m


def text_before(buf: str, markers: Sequence[str]) -> tuple[str, str, str]:
    """``(text, marker, rest)``: the text before the first of ``markers`` in ``buf``, that marker and what
    follows it; with none, ``marker`` is "" and ``rest`` the tail to hold back (it may become one), the
    text being everything before that tail."""
    i, marker = find_first(buf, markers)
    if i == -1:
        hold = len(buf) - partial_suffix_len(buf, markers)
        return buf[:hold], "", buf[hold:]
    return buf[:i], marker, buf[i + len(marker) :]


class BracketScanner:
    """Finds where one bracketed value (JSON object/array, or a Python list expression) ends, fed
    incrementally: quote- and escape-aware bracket counting, O(total length).

    The value must start with an opening bracket at the first character fed."""

    __slots__ = ("_depth", "_escape", "_quote", "_quotes")

    _OPEN = frozenset("([{")
    _CLOSE = frozenset(")]}")

    def __init__(self, quotes: str = '"') -> None:
        self._quotes = frozenset(quotes)
        self._depth = 0
        self._quote = ""
        self._escape = False

    def feed(self, text: str) -> int:
        """Index just past the end of the value within ``text``, or -1 if it has not ended yet.
        (After an end is reported the scanner must not be fed again.)"""
        quote = self._quote
        escape = self._escape
        depth = self._depth
        quotes = self._quotes
        opens = self._OPEN
        closes = self._CLOSE
        for i, ch in enumerate(text):
            if quote:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == quote:
                    quote = ""
            elif ch in quotes:
                quote = ch
            elif ch in opens:
                depth += 1
            elif ch in closes:
                depth -= 1
                if depth <= 0:
                    self._depth, self._quote, self._escape = 0, "", False
                    return i + 1
        self._quote = quote
        self._escape = escape
        self._depth = depth
        return -1


_NON_SPACE = re.compile(r"[^ \t\r\n]")
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE_STRING = re.compile(r'["{}\[\]]')

_LEAD, _VALUE, _DONE = 0, 1, 2


class JsonStringTracker:
    """Whether a position of a call body lies inside a JSON string of the value the body starts with
    (after white space), fed incrementally: an end marker there is argument text, not the end of the
    call. Regex jumps over string contents and between structural characters, O(total length).

    Once the value has closed, when the body does not start with ``{`` / ``[``, or once it can no longer
    be JSON (a string followed by anything but ``, : } ]``: a stray quote, ``"5" inch"``, would put every
    later end marker inside a string), nothing is inside a string any more: the first end marker ends it."""

    __slots__ = ("_after_string", "_depth", "_escape", "_phase", "in_string")

    def __init__(self) -> None:
        self._phase = _LEAD
        self._depth = 0
        self._escape = False
        self._after_string = False
        self.in_string = False

    def scan(self, text: str, pos: int, end: int) -> None:
        """Advance over ``text[pos:end]`` (the text right after what was scanned before)."""
        phase = self._phase
        depth = self._depth
        in_string = self.in_string
        while pos < end and phase != _DONE:
            if phase == _LEAD:
                m = _NON_SPACE.search(text, pos, end)
                if m is None:
                    break
                pos = m.end()
                if m.group() in "{[":
                    phase = _VALUE
                    depth = 1
                else:
                    phase = _DONE
                continue
            if self._escape:  # the character after a backslash that ended the previous piece
                self._escape = False
                pos += 1
                continue
            if in_string:
                m = _IN_STRING.search(text, pos, end)
                if m is None:
                    break
                pos = m.end()
                if m.group() == '"':
                    in_string = False
                    self._after_string = True
                elif pos < end:
                    pos += 1  # the escaped character
                else:
                    self._escape = True
                continue
            if self._after_string:  # what follows a string: a separator or a close, or no JSON at all
                m = _NON_SPACE.search(text, pos, end)
                if m is None:
                    break
                self._after_string = False
                if m.group() not in ",:}]":
                    phase = _DONE
                    break
            m = _OUTSIDE_STRING.search(text, pos, end)
            if m is None:
                break
            pos = m.end()
            ch = m.group()
            if ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            else:
                depth -= 1
                if depth <= 0:
                    phase = _DONE
        self._phase = phase
        self._depth = depth
        self.in_string = in_string
