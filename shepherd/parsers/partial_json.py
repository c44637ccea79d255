"""JSON cut off at its end, read as far as it goes: what a tool call cut off by ``max_tokens`` made of its
arguments (the Messages API answers such a call as a ``tool_use`` block with this partial ``input``).

``partial_json`` reads as the ``anthropic`` SDK reads a streamed ``tool_use`` input
(``jiter.from_json(buf, partial_mode=True)``): open objects and arrays are closed, a string, literal or
number the cut left unfinished is dropped with its key (a number that is whole so far, ``12``, stays),
so that a streamed answer and a whole one agree. Text that is not the beginning of a JSON value is a
``ValueError``.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["PartialValue", "partial_array", "partial_json"]

_WS = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LITERALS = (("true", True), ("false", False), ("null", None))


class _Cut(Exception):
    """The text ended inside a value that cannot be kept (a string, a literal, a number unfinished)."""


class PartialValue:
    """A reader over one text: ``value(i)`` reads the value at ``i``; ``cut`` tells, after a read,
    whether the text ended inside it (the value is then partial)."""

    __slots__ = ("cut", "n", "s")

    def __init__(self, text: str) -> None:
        self.s = text
        self.n = len(text)
        self.cut = False

    def ws(self, i: int) -> int:
        s, n = self.s, self.n
        while i < n and s[i] in _WS:
            i += 1
        return i

    def at_end(self, i: int) -> bool:
        """Whether only white space is left from ``i`` (the text was cut there)."""
        if self.ws(i) >= self.n:
            self.cut = True
            return True
        return False

    def value(self, i: int) -> tuple[Any, int]:
        """(the value at ``i``, where it ends); raises ``_Cut`` when the text ended before anything of
        it could be kept, ``ValueError`` when it is not JSON."""
        i = self.ws(i)
        if i >= self.n:
            self.cut = True
            raise _Cut
        c = self.s[i]
        if c == "{":
            return self._object(i + 1)
        if c == "[":
            return self._array(i + 1)
        if c == '"':
            return self._string(i)
        if c == "-" or c.isdigit():
            return self._number(i)
        rest = self.s[i : i + 5]
        for word, v in _LITERALS:
            if rest.startswith(word):
                return v, i + len(word)
            if i + len(rest) == self.n and word.startswith(rest):
                self.cut = True
                raise _Cut
        raise ValueError(f"not JSON at {i}")

    def _string(self, i: int) -> tuple[str, int]:
        m = _STRING.match(self.s, i)
        if m is None:  # no closing quote: cut inside the string
            self.cut = True
            raise _Cut
        return json.loads(m.group()), m.end()

    def _number(self, i: int) -> tuple[int | float, int]:
        s, n = self.s, self.n
        j = i
        while j < n and s[j] in _NUMBER_CHARS:
            j += 1
        text = s[i:j]
        whole = _NUMBER.fullmatch(text) is not None
        if j >= n:
            self.cut = True
            if not whole:  # "12.", "-", "1e": unfinished
                raise _Cut
        elif not whole:
            raise ValueError(f"not a JSON number at {i}")
        if "." in text or "e" in text or "E" in text:
            return float(text), j
        return int(text), j

    def _object(self, i: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        if self.at_end(i):
            return out, self.n
        i = self.ws(i)
        if self.s[i] == "}":
            return out, i + 1
        while True:
            if self.at_end(i):
                return out, self.n
            i = self.ws(i)
            if self.s[i] != '"':
                raise ValueError(f"expected a key at {i}")
            try:
                key, i = self._string(i)
            except _Cut:
                return out, self.n
            if self.at_end(i):
                return out, self.n
            i = self.ws(i)
            if self.s[i] != ":":
                raise ValueError(f"expected ':' at {i}")
            try:
                v, i = self.value(i + 1)
            except _Cut:
                return out, self.n
            out[key] = v
            if self.cut or self.at_end(i):
                return out, self.n
            i = self.ws(i)
            c = self.s[i]
            if c == "}":
                return out, i + 1
            if c != ",":
                raise ValueError(f"expected ',' or '}}' at {i}")
            i += 1

    def _array(self, i: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        if self.at_end(i):
            return out, self.n
        i = self.ws(i)
        if self.s[i] == "]":
            return out, i + 1
        while True:
            try:
                v, i = self.value(i)
            except _Cut:
                return out, self.n
            out.append(v)
            if self.cut or self.at_end(i):
                return out, self.n
            i = self.ws(i)
            c = self.s[i]
            if c == "]":
                return out, i + 1
            if c != ",":
                raise ValueError(f"expected ',' or ']' at {i}")
            i += 1


def partial_json(text: str) -> tuple[bool, Any]:
    """(whether anything could be read, the value read) of ``text``, a JSON value possibly cut off at its
    end (see the module). Raises ValueError when ``text`` is not the beginning of one JSON value (text
    after a whole value included), or nests deeper than the recursion limit."""
    r = PartialValue(text)
    try:
        v, end = r.value(0)
    except _Cut:
        return False, None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not r.cut and r.ws(end) != r.n:
        raise ValueError("text after the value")
    return True, v


def partial_array(text: str) -> tuple[list[Any], bool]:
    """The items of a JSON array cut off at its end (``text`` begins with ``[``), and whether its last
    item is itself cut (partial; an item the cut left nothing of is not listed). Raises ValueError as
    ``partial_json``."""
    r = PartialValue(text)
    i = r.ws(0)
    if i >= r.n or text[i] != "[":
        raise ValueError("not an array")
    items: list[Any] = []
    if r.at_end(i + 1):
        return items, False
    i = r.ws(i + 1)
    if text[i] == "]":
        return items, False
    try:
        while True:
            try:
                v, i = r.value(i)
            except _Cut:
                return items, False
            items.append(v)
            if r.cut:
                return items, True
            if r.at_end(i):
                return items, False
            i = r.ws(i)
            if text[i] == "]":
                return items, False
            if text[i] != ",":
                raise ValueError(f"expected ',' or ']' at {i}")
            i += 1
    except RecursionError:
        raise ValueError("nested too deeply") from None
