"""Mistral tool parser: ``[TOOL_CALLS]`` followed by either a JSON list of ``{"name", "arguments"}``
(tokenizer v3-v7) or ``name[ARGS]{json}`` (v11+: Mistral Small 3.2, Devstral, Magistral), the latter
repeated with one ``[TOOL_CALLS]`` per call, optionally ``name[CALL_ID]id[ARGS]{json}``.

There is no end marker: a call ends where its JSON value closes (quote-aware bracket scan). Text
before the first marker is content; so is text after the calls. Malformed or cut-off calls come back
as text, marker included. Call ids default to 9 alphanumeric characters, as Mistral templates require.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Collection

from shepherd.parsers.events import TextDelta, ToolEvent
from shepherd.parsers.text_scan import BracketScanner, text_before
from shepherd.parsers.tool_common import (
    CallEmitter,
    IdFactory,
    ParamTypes,
    ParsedCall,
    dump_args,
    load_args,
    parse_guarded,
)
from shepherd.parsers.tool_leading import parse_json_calls

__all__ = ["MistralToolParser", "mistral_call_id"]

_TAG = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits
_MAX_NAME = 256

_TEXT, _DECIDE, _NAME, _VALUE, _OPEN = 0, 1, 2, 3, 4


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class MistralToolParser:
    __slots__ = ("_after_call", "_buf", "_calls", "_name", "_parts", "_raw", "_scanner", "_state", "_types")

    def __init__(
        self,
        *,
        id_factory: IdFactory | None = None,
        types: ParamTypes | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self._types: ParamTypes = types or {}
        self._calls = CallEmitter(id_factory or mistral_call_id, names)
        self._state = _TEXT
        # held text that is re-read with the next piece: a partial marker (TEXT) or a v11 call's head
        # (NAME, at most _MAX_NAME + len(_ARGS)); white space is never held (decided at once)
        self._buf = ""
        self._parts: list[str] = []  # the JSON value so far (VALUE)
        self._raw: list[str] = []  # the call's text so far before its value, for the fallback
        self._name: ParsedCall | None = None  # name (and id) of a v11 call whose value is being read
        self._scanner = BracketScanner('"')
        self._after_call = False

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == _TEXT and not self._buf and not self._after_call and "[" not in text:
            return [TextDelta(text)] if text else []
        out: list[ToolEvent] = []
        self._run(text, out)
        return out

    def finish(self, cut: bool = True) -> list[ToolEvent]:
        state = self._state
        buf = self._buf
        self._buf = ""
        self._state = _TEXT
        if state != _TEXT:
            buf = "".join(self._raw) + buf + "".join(self._parts)
            self._parts = []
            self._raw = []
        elif self._after_call and not buf.strip():
            buf = ""
        return [TextDelta(buf)] if buf else []

    def _fail(self, raw: str, out: list[ToolEvent]) -> None:
        out.append(TextDelta(raw))
        self._state = _TEXT
        self._buf = ""
        self._raw = []

    def _run(self, text: str, out: list[ToolEvent]) -> None:
        while True:
            state = self._state
            if state == _VALUE:
                end = self._scanner.feed(text)
                if end == -1:
                    self._parts.append(text)
                    return
                self._parts.append(text[:end])
                value = "".join(self._parts)
                self._parts = []
                text = text[end:]
                calls = parse_guarded(self._parse_value, value, self._types)
                if calls and self._calls.accepts(calls):
                    self._calls.emit(calls, out)
                    self._state = _TEXT
                    self._after_call = True
                    self._raw = []
                else:
                    self._fail("".join(self._raw) + value, out)
                continue
            if state in (_DECIDE, _OPEN):
                # white space after [TOOL_CALLS] (DECIDE) or after a v11 head (OPEN): raw text so far
                t = text.lstrip()
                if len(t) != len(text):
                    self._raw.append(text[: len(text) - len(t)])
                if not t:
                    return
                text = t
                if state == _OPEN:
                    if t[0] != "{":
                        self._fail("".join(self._raw), out)
                        continue
                    self._state = _VALUE
                else:
                    self._state = _VALUE if t[0] in "[{" else _NAME
                    self._name = None
                self._scanner = BracketScanner('"')
                continue
            buf = self._buf + text
            text = ""
            if state == _TEXT:
                if self._after_call:  # white space right after a call is dropped
                    t = buf.lstrip()
                    if not t:
                        self._buf = ""
                        return
                    buf = t
                    self._after_call = False
                before, tag, text = text_before(buf, (_TAG,))
                if before:
                    out.append(TextDelta(before))
                if not tag:
                    self._buf = text
                    return
                self._raw = [_TAG]
                self._buf = ""
                self._state = _DECIDE
                continue
            # _NAME: v11 "name[ARGS]" or "name[CALL_ID]id[ARGS]"; every failure consumes a span that
            # does not depend on how the text was chunked, and the rest is parsed again as text
            i = buf.find(_ARGS, 0, _MAX_NAME + len(_ARGS))
            if i == -1:
                if len(buf) >= _MAX_NAME + len(_ARGS):
                    self._fail("".join(self._raw) + buf[:_MAX_NAME], out)
                    text = buf[_MAX_NAME:]
                    continue
                self._buf = buf
                return
            head_end = i + len(_ARGS)
            name, _, call_id = buf[:i].partition(_CALL_ID)
            name = name.strip()
            if not name or any(c in name for c in " \n[]{}"):
                self._fail("".join(self._raw) + buf[:head_end], out)
                text = buf[head_end:]
                continue
            self._raw.append(buf[:head_end])
            self._name = ParsedCall(name, "", call_id.strip() or None)
            self._buf = ""
            self._state = _OPEN
            text = buf[head_end:]

    def _parse_value(self, value: str, types: ParamTypes) -> list[ParsedCall] | None:
        if self._name is None:
            return parse_json_calls(value, types)
        args = load_args(value)
        return None if args is None else [self._name._replace(arguments=dump_args(args))]
