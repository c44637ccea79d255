"""Tool parsers for formats where a call sits between begin and end markers, optionally inside a
section (``<|tool_calls_section_begin|> <call> <call> <|tool_calls_section_end|>``).

One machine (``DelimitedToolParser``) does the streaming: content streams through except a suffix
that could be the start of a marker; a call is buffered until its end marker, then parsed by the
family's body parser; a body that does not parse comes back as text, markers included; so does a
call cut off by the end of the output. Whitespace right after a call is dropped; section markers
are structural and always dropped (text inside a section that is not a call is content).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from shepherd.parsers.events import TextDelta, ToolEvent
from shepherd.parsers.text_scan import find_first, partial_suffix_len
from shepherd.parsers.tool_common import (
    CallEmitter,
    IdFactory,
    ParamTypes,
    ParsedCall,
)

__all__ = ["BodyParser", "DelimitedSpec", "DelimitedToolParser"]

BodyParser = Callable[[str, ParamTypes], list[ParsedCall] | None]


@dataclass(frozen=True, slots=True)
class DelimitedSpec:
    call_begin: tuple[str, ...]
    call_end: tuple[str, ...]
    parse: BodyParser
    section_begin: str = ""
    section_end: str = ""


_TEXT, _SECTION, _CALL = 0, 1, 2


class DelimitedToolParser:
    __slots__ = (
        "_after_call",
        "_begin",
        "_buf",
        "_calls",
        "_end_max",
        "_firsts",
        "_parts",
        "_raw_begin",
        "_section_markers",
        "_spec",
        "_state",
        "_tail",
        "_text_markers",
        "_types",
    )

    def __init__(
        self,
        spec: DelimitedSpec,
        *,
        id_factory: IdFactory | None = None,
        types: ParamTypes | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self._spec = spec
        self._types: ParamTypes = types or {}
        self._calls = CallEmitter(id_factory, names)
        self._text_markers = (spec.section_begin,) if spec.section_begin else spec.call_begin
        self._section_markers = (*spec.call_begin, spec.section_end, spec.section_begin)
        self._firsts = frozenset(m[0] for m in self._text_markers)
        self._end_max = max(len(m) for m in spec.call_end)
        self._state = _TEXT
        self._buf = ""
        self._raw_begin = ""
        self._parts: list[str] = []
        self._tail = ""
        self._after_call = False
        self._begin = spec.call_begin

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == _TEXT and not self._buf and not self._after_call:
            for c in self._firsts:
                if c in text:
                    break
            else:
                return [TextDelta(text)] if text else []
        return self._run(self._buf + text)

    def finish(self) -> list[ToolEvent]:
        buf = self._buf
        self._buf = ""
        if self._state == _CALL:
            buf = self._raw_begin + "".join(self._parts)
            self._parts = []
        elif self._after_call and not buf.strip():
            buf = ""
        self._state = _TEXT
        return [TextDelta(buf)] if buf else []

    def _run(self, buf: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        spec = self._spec
        while True:
            state = self._state
            if state == _TEXT:
                if self._after_call:
                    t = buf.lstrip()
                    if not t:
                        self._buf = buf
                        break
                    buf = t
                    self._after_call = False
                i, marker = find_first(buf, self._text_markers)
                if i == -1:
                    hold = partial_suffix_len(buf, self._text_markers)
                    if len(buf) > hold:
                        out.append(TextDelta(buf[: len(buf) - hold]))
                    self._buf = buf[len(buf) - hold :]
                    break
                if i:
                    out.append(TextDelta(buf[:i]))
                buf = buf[i + len(marker) :]
                if spec.section_begin:
                    self._state = _SECTION
                else:
                    self._state = _CALL
                    self._raw_begin = marker
                continue
            if state == _SECTION:
                t = buf.lstrip()
                if not t:
                    self._buf = ""
                    break
                for m in self._begin:
                    if t.startswith(m):
                        buf = t[len(m) :]
                        self._state = _CALL
                        self._raw_begin = m
                        break
                else:
                    if t.startswith(spec.section_end):
                        buf = t[len(spec.section_end) :]
                        self._state = _TEXT
                        self._after_call = True
                        continue
                    if t.startswith(spec.section_begin):  # a repeated opener: structural, dropped
                        buf = t[len(spec.section_begin) :]
                        continue
                    i, _ = find_first(t, self._section_markers)
                    if i == -1:
                        hold = partial_suffix_len(t, self._section_markers)
                        if hold == len(t):
                            self._buf = t
                            break
                        i = len(t) - hold
                    out.append(TextDelta(t[:i]))  # stray text inside the section
                    buf = t[i:]
                continue
            # _CALL
            rest = self._feed_call(buf, out)
            if rest is None:
                self._buf = ""
                break
            buf = rest
        return out

    def _feed_call(self, text: str, out: list[ToolEvent]) -> str | None:
        """Add ``text`` to the call's body (kept as a list of pieces: no quadratic copying on long
        arguments); at the end marker, parse the call and return the text after it."""
        tail = self._tail
        s = tail + text
        i, marker = find_first(s, self._spec.call_end)
        if i == -1:
            self._parts.append(text)
            k = self._end_max - 1
            self._tail = s[-k:] if k else ""
            return None
        cut = i - len(tail)
        if cut >= 0:
            self._parts.append(text[:cut])
            body = "".join(self._parts)
        else:  # the marker began in an earlier piece
            body = "".join(self._parts)[:cut]
        self._parts = []
        self._tail = ""
        calls = self._spec.parse(body, self._types)
        if not self._calls.accepts(calls):
            calls = None
        if calls:
            self._calls.emit(calls, out)
        else:
            out.append(TextDelta(self._raw_begin + body + marker))
        if self._spec.section_begin:
            self._state = _SECTION
        else:
            self._state = _TEXT
            self._after_call = bool(calls)
        return s[i + len(marker) :]
