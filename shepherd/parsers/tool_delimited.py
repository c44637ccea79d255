"""Tool parsers for formats where a call sits between begin and end markers, optionally inside a
section (``<|tool_calls_section_begin|> <call> <call> <|tool_calls_section_end|>``).

One machine (``DelimitedToolParser``) does the streaming: content streams through except a suffix
that could be the start of a marker; a call is buffered until its end marker, then parsed by the
family's body parser; a body that does not parse (or that the body parser cannot handle: it raises)
comes back as text, markers included; so does a call cut off by the end of the output, except in an
``open_end`` family (hermes), where a complete body is a call without its end marker, and, with
``partial_calls`` (the Messages API), in a family with a ``cut`` parser (hermes): a cut body is then
a partial call as far as its JSON goes, or nothing when it has no whole name yet. In a
``json_body`` family (hermes) an end marker inside a JSON string of the body is argument text.

Streamed (``stream_args``, set for a streamed answer) in a family with a ``head`` reader (hermes,
qwen3_coder), a call is not held to its end: once its name (a known tool's) and the start of its
arguments came, the call starts and its arguments follow as they are generated, written as the whole
call's are (``json_canon``, ``tool_formats.Qwen3CoderArgs``: the pieces add up to them), the rest at
the end marker, as vLLM's and SGLang's
streaming parsers send a call. Such a call is a call from then on: cut off (a ``length`` finish) it
keeps the arguments as far as they went, and a body that turns out malformed keeps what was sent (the
whole answer has it as text, as before).
Whitespace right after a call is dropped. Section markers, and white space between them, are
structural and dropped once a call in the section is accepted (text inside a section that is not a
call is content); a section that closes without an accepted call is text, verbatim.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from shepherd.parsers.events import TextDelta, ToolCallArgs, ToolCallStart, ToolEvent
from shepherd.parsers.json_canon import CanonicalJson
from shepherd.parsers.text_scan import JsonStringTracker, find_first, partial_suffix_len, text_before
from shepherd.parsers.tool_common import (
    BodyParser,
    CallEmitter,
    CutParser,
    IdFactory,
    ParamTypes,
    ParsedCall,
    parse_cut_guarded,
    parse_guarded,
    scrub,
)

__all__ = ["DelimitedSpec", "DelimitedToolParser"]


@dataclass(frozen=True, slots=True)
class DelimitedSpec:
    """``json_body``: the body is a JSON value, and an end marker inside one of its strings is argument
    text, not the end of the call (the end markers must hold no quote, backslash or bracket);
    ``open_end``: a call whose end marker never came (the output ended, or a stop string cut it) is a
    call when its body parses; ``cut``: reads a body cut off by the end of the output as far as it goes
    (for parsers made with ``partial_calls``); ``head``: reads the start of a body, (the call's name,
    where its arguments object begins) once both came, else None (a streamed call then starts early)."""

    call_begin: tuple[str, ...]
    call_end: tuple[str, ...]
    parse: BodyParser
    section_begin: str = ""
    section_end: str = ""
    json_body: bool = False
    open_end: bool = False
    cut: CutParser | None = None
    head: Callable[[str], tuple[str, int] | None] | None = None
    # the arguments' stream after the head (by call name and the tools' parameter types): a JSON body's
    # arguments object (None: ``CanonicalJson``), or a format of its own (qwen3_coder's parameters)
    args: Callable[[str, ParamTypes], ArgsStream] | None = None


class ArgsStream(Protocol):
    """Text of a call's arguments in, the JSON text of the whole call's arguments out as it settles
    (always a prefix of it); ``done``: nothing more of it to make; ``broken``: nothing more to make here
    (the whole call tells the rest)."""

    done: bool
    broken: bool

    def feed(self, text: str) -> str: ...


HEAD_MAX = 1024  # the body characters a call's head (name, arguments' start) is looked for in


@dataclass(slots=True)
class _Live:
    """A call under way whose start and arguments so far were sent (``stream_args``)."""

    index: int
    name: str
    args: ArgsStream
    sent: list[str]


_TEXT, _SECTION, _CALL = 0, 1, 2


class DelimitedToolParser:
    __slots__ = (
        "_after_call",
        "_begin",
        "_buf",
        "_calls",
        "_end_max",
        "_firsts",
        "_json",
        "_live",
        "_no_head",
        "_partial",
        "_parts",
        "_raw_begin",
        "_section_markers",
        "_section_ok",
        "_section_raw",
        "_section_run",
        "_section_text",
        "_spec",
        "_state",
        "_tail",
        "_text_markers",
        "_types",
        "stream_args",
    )

    def __init__(
        self,
        spec: DelimitedSpec,
        *,
        id_factory: IdFactory | None = None,
        types: ParamTypes | None = None,
        names: Collection[str] | None = None,
        partial_calls: bool = False,
    ) -> None:
        self._spec = spec
        self._partial = partial_calls and spec.cut is not None
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
        self._json: JsonStringTracker | None = None  # the call body's string state (``json_body``)
        self._after_call = False
        # inside a section: stray text has begun since the last marker (its white space is then text)
        self._section_run = False
        # a section is undecided until a call in it is accepted (``_section_ok``: its markers and white
        # space are then structural, dropped) or it closes without one (then it is text, verbatim, as
        # SGLang's detectors answer the whole text when a call fails); meanwhile its text is held twice:
        self._section_ok = False
        self._section_raw: list[str] = []  # verbatim
        self._section_text: list[str] = []  # as content once a call is accepted (stray text, failed calls)
        self._begin = spec.call_begin
        self.stream_args = False  # a streamed answer: calls start before their end (``head``)
        self._live: _Live | None = None  # the call under way whose start was sent
        self._no_head = False  # the call under way has no head to stream from (looked for; none)

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == _TEXT and not self._buf and not self._after_call:
            for c in self._firsts:
                if c in text:
                    break
            else:
                return [TextDelta(text)] if text else []
        return self._run(self._buf + text)

    def finish(self, cut: bool = True) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        buf = self._buf
        self._buf = ""
        state = self._state
        self._state = _TEXT
        if state == _CALL and self._live is not None:
            body = "".join(self._parts)
            self._parts = []
            calls = self._parse(body) if self._spec.open_end else None
            self._end_live(calls, out)
            buf = ""
        elif state == _CALL:
            body = "".join(self._parts)
            self._parts = []
            calls = self._parse(body) if self._spec.open_end else None
            if calls:
                self._accept(calls, out)
                buf = ""
            elif self._partial and cut and self._cut(body, out):
                buf = ""
            else:
                buf = self._raw_begin + body
        elif self._after_call and not buf.strip():
            buf = ""
        if self._section_text:  # (cut off inside an undecided section: as when a call was accepted)
            buf = "".join(self._section_text) + buf
        self._section_text = []
        self._section_raw = []
        if buf:
            out.append(TextDelta(buf))
        return out

    def _accept(self, calls: list[ParsedCall], out: list[ToolEvent], partial: bool = False) -> None:
        if self._section_text:
            out.append(TextDelta("".join(self._section_text)))
        self._section_text = []
        self._section_raw = []
        self._section_ok = True
        self._calls.emit(calls, out, partial)

    def _section_content(self, text: str, out: list[ToolEvent]) -> None:
        """Text inside a section that is content once the section has an accepted call."""
        if self._section_ok:
            out.append(TextDelta(text))
        else:
            self._section_text.append(text)
            self._section_raw.append(text)

    def _cut(self, body: str, out: list[ToolEvent]) -> bool:
        """A body cut off by the end of the output, as a partial call (nothing when it has no whole name
        yet); False when it is not the beginning of a call of a known tool (it is then text)."""
        assert self._spec.cut is not None
        held = partial_suffix_len(body, self._spec.call_end)  # cut inside the end marker: the call is whole
        calls = self._parse(body[: len(body) - held]) if held else None
        if calls:
            self._accept(calls, out)
            return True
        got = parse_cut_guarded(self._spec.cut, body, self._types)
        if got is None:
            return False
        calls = got.calls if got.cut is None else [*got.calls, got.cut]
        if not calls:
            return True
        if not self._calls.accepts(calls):
            return False
        self._accept(calls, out, partial=got.cut is not None)
        return True

    def _parse(self, body: str) -> list[ParsedCall] | None:
        calls = parse_guarded(self._spec.parse, body, self._types)
        return calls if self._calls.accepts(calls) else None

    def _begin_call(self, marker: str) -> None:
        self._state = _CALL
        self._raw_begin = marker
        self._tail = ""
        self._json = JsonStringTracker() if self._spec.json_body else None
        self._live = None
        self._no_head = not self.stream_args or self._spec.head is None

    def _stream_call(self, text: str, out: list[ToolEvent]) -> None:
        """A streamed call's progress (``text``: the body's newest piece, no end marker in it): its start
        once its head came, then its arguments as they settle."""
        live = self._live
        if live is None:
            body = "".join(self._parts)
            assert self._spec.head is not None
            head = self._spec.head(body)
            if head is None:
                self._no_head = len(body) > HEAD_MAX
                return
            name, at = head
            if self._section_text or not self._calls.accepts([ParsedCall(name, "")]):
                self._no_head = True  # (text held in a section, an unknown tool: decided at the end)
                return
            index, call_id = self._calls.start(name)
            self._section_ok = True
            out.append(ToolCallStart(index, call_id, scrub(name)))
            make = self._spec.args
            live = self._live = _Live(
                index, name, CanonicalJson() if make is None else make(name, self._types), []
            )
            text = body[at:]
        if live.args.done or live.args.broken:
            return
        piece = live.args.feed(text)
        if piece:
            live.sent.append(piece)
            out.append(ToolCallArgs(live.index, scrub(piece)))

    def _end_live(self, calls: list[ParsedCall] | None, out: list[ToolEvent]) -> None:
        """The streamed call ended: the rest of its arguments, when its body parsed to that call (else it
        keeps what was sent)."""
        live = self._live
        assert live is not None
        self._live = None
        if calls and len(calls) == 1 and calls[0].name == live.name:
            sent = "".join(live.sent)
            whole = calls[0].arguments
            if whole.startswith(sent) and len(whole) > len(sent):
                out.append(ToolCallArgs(live.index, scrub(whole[len(sent) :])))

    def _run(self, buf: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        spec = self._spec
        while True:
            state = self._state
            if state == _TEXT:
                if self._after_call:  # white space right after a call is dropped (at once: no hold-back)
                    t = buf.lstrip()
                    if not t:
                        self._buf = ""
                        break
                    buf = t
                    self._after_call = False
                before, marker, buf = text_before(buf, self._text_markers)
                if before:
                    out.append(TextDelta(before))
                if not marker:
                    self._buf = buf
                    break
                if spec.section_begin:
                    self._state = _SECTION
                    self._section_run = False
                    self._section_ok = False
                    self._section_raw = [marker]
                    self._section_text = []
                else:
                    self._begin_call(marker)
                continue
            if state == _SECTION:
                # white space between the section's markers is structural; stray text there is content,
                # its white space included once it has begun (so that the chunking does not matter)
                t = buf if self._section_run else buf.lstrip()
                if len(t) != len(buf) and not self._section_ok:
                    self._section_raw.append(buf[: len(buf) - len(t)])
                if not t:
                    self._buf = ""
                    break
                for m in self._begin:
                    if t.startswith(m):
                        buf = t[len(m) :]
                        self._begin_call(m)
                        self._section_run = False
                        break
                else:
                    if t.startswith(spec.section_end):
                        buf = t[len(spec.section_end) :]
                        self._state = _TEXT
                        self._section_run = False
                        if not self._section_ok:  # no call in it: the section is text, verbatim
                            self._section_raw.append(spec.section_end)
                            out.append(TextDelta("".join(self._section_raw)))
                        self._after_call = self._section_ok
                        self._section_raw = []
                        self._section_text = []
                        continue
                    if t.startswith(spec.section_begin):  # a repeated opener: structural
                        buf = t[len(spec.section_begin) :]
                        self._section_run = False
                        if not self._section_ok:
                            self._section_raw.append(spec.section_begin)
                        continue
                    i, _ = find_first(t, self._section_markers)
                    if i == -1:
                        hold = partial_suffix_len(t, self._section_markers)
                        if hold == len(t):
                            self._buf = t
                            break
                        i = len(t) - hold
                    self._section_content(t[:i], out)  # stray text inside the section
                    self._section_run = True
                    buf = t[i:]
                continue
            # _CALL
            rest = self._feed_call(buf, out)
            if rest is None:
                self._buf = ""
                break
            buf = rest
        return out

    def _find_end(self, s: str, scanned: int) -> tuple[int, str]:
        """The first end marker in ``s`` that ends the call: with ``json_body``, one inside a JSON
        string of the body is skipped. ``s[:scanned]`` has been scanned for the string state already
        (a marker starting there lies within the previous piece's tail: it holds no quote, so the state
        there is the state at ``scanned``)."""
        ends = self._spec.call_end
        tracker = self._json
        pos = 0
        while True:
            i, marker = find_first(s, ends, pos)
            if tracker is None:
                return i, marker
            if i == -1:
                tracker.scan(s, scanned, len(s))
                return i, marker
            if i > scanned:
                tracker.scan(s, scanned, i)
                scanned = i
            if not tracker.in_string:
                return i, marker
            pos = i + 1

    def _feed_call(self, text: str, out: list[ToolEvent]) -> str | None:
        """Add ``text`` to the call's body (kept as a list of pieces: no quadratic copying on long
        arguments); at the end marker, parse the call and return the text after it."""
        tail = self._tail
        s = tail + text
        i, marker = self._find_end(s, len(tail))
        if i == -1:
            self._parts.append(text)
            k = self._end_max - 1
            self._tail = s[-k:] if k else ""
            if not self._no_head:
                self._stream_call(text, out)
            return None
        cut = i - len(tail)
        if cut >= 0:
            self._parts.append(text[:cut])
            body = "".join(self._parts)
        else:  # the marker began in an earlier piece
            body = "".join(self._parts)[:cut]
        self._parts = []
        self._tail = ""
        self._json = None
        calls = self._parse(body)
        made = bool(calls)
        if self._live is not None:
            self._end_live(calls, out)
            made = True  # (a call all the same: its start was sent)
        elif calls:
            self._accept(calls, out)
        elif self._spec.section_begin:
            self._section_content(self._raw_begin + body + marker, out)
        else:
            out.append(TextDelta(self._raw_begin + body + marker))
        if self._spec.section_begin:
            self._state = _SECTION
            self._section_run = False
        else:
            self._state = _TEXT
            self._after_call = made
        return s[i + len(marker) :]
