"""Small string helpers shared by the parsers: partial-marker hold-back and bracket scanning."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BracketScanner", "find_first", "partial_suffix_len"]


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
