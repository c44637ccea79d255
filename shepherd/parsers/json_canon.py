"""A JSON value's text as ``json.dumps(json.loads(text), ensure_ascii=False)`` writes it, made as the text
arrives: what a streamed tool call's arguments are sent as, piece by piece, so that the pieces add up to
the arguments the whole call has (``tool_common.dump_args``) without waiting for its end.

``CanonicalJson.feed`` takes the next raw characters and returns the canonical text they settle: a
string's characters as they come (escapes decoded, then written as ``json.dumps`` writes them), a number
or literal once it ends, the separators ``", "`` and ``": "``. What it returns is always a prefix of the
canonical text of any valid completion of the input: nothing is taken back. It stops (``broken``) at the
first character that cannot continue a JSON value, and ``done`` once the value has closed (later text is
not its own). A duplicate key is the one case where ``json.loads`` (last value wins, first place kept)
and the stream part ways.
"""

from __future__ import annotations

import json

__all__ = ["CanonicalJson"]

_WS = " \t\n\r"
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")

# the states of the value under way
_VALUE, _STRING, _NUMBER, _LITERAL, _AFTER, _KEY, _COLON = range(7)


def _encoded(text: str) -> str:
    """``text`` as ``json.dumps(..., ensure_ascii=False)`` writes a string's characters (no quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class CanonicalJson:
    """See the module doc. Frames: ``{`` or ``[`` with whether an item has been written in it."""

    __slots__ = ("_escape", "_frames", "_is_key", "_raw", "_state", "broken", "done")

    def __init__(self) -> None:
        self._frames: list[list[object]] = []  # [bracket, items written]
        self._state = _VALUE
        self._raw: list[str] = []  # a number's or literal's characters, or a string's pending escape
        self._escape = ""  # a string's escape under way (``\``, ``\u12``...; a high surrogate's ``\ud83d``)
        self._is_key = False
        self.broken = False
        self.done = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        while i < n and not (self.done or self.broken):
            i = self._step(text, i, n, out)
        return "".join(out)

    def _fail(self) -> int:
        self.broken = True
        return 0

    def _step(self, text: str, i: int, n: int, out: list[str]) -> int:
        state = self._state
        if state == _STRING:
            return self._string(text, i, n, out)
        c = text[i]
        if state in (_NUMBER, _LITERAL):
            if (state == _NUMBER and c in _NUMBER_CHARS) or (state == _LITERAL and c.isalpha()):
                self._raw.append(c)
                return i + 1
            if not self._end_scalar(out):
                return n
            return i  # the delimiter is read in the state after the value
        if c in _WS:
            return i + 1
        if state == _VALUE:
            return self._value(c, i, out)
        if state == _KEY:
            if c == '"':
                frame = self._frames[-1]
                out.append(", " if frame[1] else "")
                frame[1] = True
                out.append('"')
                self._state, self._is_key = _STRING, True
                return i + 1
            if c == "}" and not self._frames[-1][1]:
                return self._close(c, i, out)
            self._fail()
            return n
        if state == _COLON:
            if c != ":":
                self._fail()
                return n
            out.append(": ")
            self._state = _VALUE
            return i + 1
        # _AFTER: a value ended inside a container
        frame = self._frames[-1]
        if c == ",":
            self._state = _KEY if frame[0] == "{" else _VALUE
            if frame[0] == "[":
                out.append(", ")
            return i + 1
        if c in "}]":
            return self._close(c, i, out)
        self._fail()
        return n

    def _value(self, c: str, i: int, out: list[str]) -> int:
        frames = self._frames
        in_array = bool(frames) and frames[-1][0] == "["
        if c in "{[":
            if in_array:
                frames[-1][1] = True
            frames.append([c, False])
            out.append(c)
            self._state = _KEY if c == "{" else _VALUE
            return i + 1
        if c == "]" and in_array and not frames[-1][1]:
            return self._close(c, i, out)
        if in_array:
            frames[-1][1] = True
        if c == '"':
            out.append('"')
            self._state, self._is_key = _STRING, False
            return i + 1
        if c in _NUMBER_CHARS:
            self._state, self._raw = _NUMBER, [c]
            return i + 1
        if c in "tfn":
            self._state, self._raw = _LITERAL, [c]
            return i + 1
        return self._fail()

    def _close(self, c: str, i: int, out: list[str]) -> int:
        frames = self._frames
        if not frames or "{[".index(frames[-1][0]) != "}]".index(c):  # type: ignore[arg-type]
            return self._fail()
        frames.pop()
        out.append(c)
        self._value_ended()
        return i + 1

    def _value_ended(self) -> None:
        if self._frames:
            self._state = _AFTER
        else:
            self.done = True

    def _end_scalar(self, out: list[str]) -> bool:
        raw = "".join(self._raw)
        self._raw = []
        if self._state == _LITERAL:
            if raw not in _LITERALS:
                self.broken = True
                return False
            out.append(raw)
        else:
            try:
                value = json.loads(raw)
                written = json.dumps(value, allow_nan=False)
            except ValueError:
                self.broken = True
                return False
            if not isinstance(value, int | float) or isinstance(value, bool):
                self.broken = True
                return False
            out.append(written)
        self._value_ended()
        return True

    def _string(self, text: str, i: int, n: int, out: list[str]) -> int:
        if self._escape:
            return self._escaped(text, i, n, out)
        j = i
        while j < n:
            c = text[j]
            if c == '"' or c == "\\" or c < " ":
                break
            j += 1
        if j > i:
            out.append(_encoded(text[i:j]))
        if j == n:
            return n
        c = text[j]
        if c < " ":  # a raw control character: json.loads refuses it in a string
            self._fail()
            return n
        if c == '"':
            out.append('"')
            if self._is_key:
                self._state = _COLON
            else:
                self._value_ended()
            return j + 1
        self._escape = "\\"
        return j + 1

    def _escaped(self, text: str, i: int, n: int, out: list[str]) -> int:
        esc = self._escape
        while i < n:
            esc += text[i]
            i += 1
            if len(esc) == 2:
                kind = esc[1]
                if kind in _SIMPLE_ESCAPES:
                    out.append(_encoded(_SIMPLE_ESCAPES[kind]))
                    self._escape = ""
                    return i
                if kind != "u":
                    self._escape = ""
                    self._fail()
                    return n
                continue
            if len(esc) == 6:
                code = _hex(esc[2:])
                if code is None:
                    self._escape = ""
                    self._fail()
                    return n
                if 0xD800 <= code <= 0xDBFF:
                    continue  # a high surrogate: its low half may follow (``\udXXX``)
                self._escape = ""
                out.append(_encoded(chr(code)))
                return i
            if (len(esc) == 7 and esc[6] != "\\") or (len(esc) == 8 and esc[7] != "u"):
                # a lone high surrogate, then something else: written alone, the rest read again
                self._escape = ""
                out.append(_encoded(chr(_hex(esc[2:6]) or 0)))
                self._reread(esc[6:], out)
                return i
            if len(esc) == 12:
                high, low = _hex(esc[2:6]) or 0, _hex(esc[8:12])
                self._escape = ""
                if low is None:
                    self._fail()
                    return n
                if 0xDC00 <= low <= 0xDFFF:
                    out.append(_encoded(chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))))
                    return i
                out.append(_encoded(chr(high)))
                self._reread(esc[6:], out)  # the second escape on its own
                return i
        self._escape = esc
        return n

    def _reread(self, extra: str, out: list[str]) -> None:
        """Characters taken while looking for a low surrogate that were none: read as the string's next
        (at most six, maybe across earlier pieces)."""
        j = 0
        while j < len(extra) and not (self.done or self.broken):
            j = self._step(extra, j, len(extra), out)


def _hex(digits: str) -> int | None:
    if len(digits) != 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return None
    return int(digits, 16)
