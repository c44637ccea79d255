"""Reasoning parsers for the think-tag families (``<think>...</think>`` and its variants).

One machine, configured per family by a ``ThinkSpec``:

- the block may be opened by the prompt (``prompt_opened_think``: the chat template ended the prompt
  with the start marker, as DeepSeek-R1, QwQ, Qwen3-Thinking, Qwen3.5, Nemotron 3, Step 3.5, GLM 4.7
  and MiniMax M2 do) or be ``forced`` by the family (the model never writes the start marker);
  a start marker the model writes anyway at the very beginning is dropped;
- otherwise the output is reasoning only if it begins (after whitespace) with the start marker;
- reasoning ends at the end marker, at an ``implicit_end`` marker (one that opens the answer, Cohere's
  text block), or, when the request's tool calls are parsed (``tool_calls``), at a ``tool_end`` marker
  (a tool-call opener the model sometimes writes without closing the block first); either marker stays
  in the content (for the tool parser, or ``content_drop``), and the end marker the model may still
  write after it is dropped from the content. Without tool parsing, a tool-call opener inside the block
  is reasoning like any other text (vLLM's think parsers split on the end marker alone);
- ``content_drop`` markers (Cohere's text-block markers) are removed from the content;
- whitespace right after the start marker and right after the end marker is dropped
  (``<think>\\n...</think>\\n\\nAnswer`` gives content ``Answer``);
- output cut off inside the block stays reasoning; held partial markers are released by ``finish``.

With ``thinking_enabled=False`` the parser passes everything through as content.
"""

from __future__ import annotations

from dataclasses import dataclass

from shepherd.parsers.text_scan import find_first, partial_suffix_len

__all__ = ["ThinkSpec", "ThinkTagReasoningParser"]

_START, _REASONING, _CONTENT, _PASS = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class ThinkSpec:
    start: str = "<think>"
    end: str = "</think>"
    forced: bool = False
    implicit_end: tuple[str, ...] = ()
    tool_end: tuple[str, ...] = ()
    # a ``tool_end`` marker ends the block only when the text after it (white space skipped) begins with
    # one of these (a call's body); otherwise it is reasoning text, a mention of the marker (vLLM's
    # Qwen3ReasoningParser looks ahead for ``<function=`` the same way). Empty: any ``tool_end`` ends it.
    tool_next: tuple[str, ...] = ()
    content_drop: tuple[str, ...] = ()


_TOOL_NEXT_SPACE = 64  # white space after a tool_end marker, at most, before what follows decides it


class ThinkTagReasoningParser:
    """See the module docstring. One instance per request (choice)."""

    __slots__ = (
        "_buf",
        "_content_lstrip",
        "_drop",
        "_drop_firsts",
        "_end",
        "_lead",
        "_may_open",
        "_reason_lstrip",
        "_reason_markers",
        "_start",
        "_state",
        "_tool_end",
        "_tool_next",
        "passthrough",
    )

    def __init__(
        self,
        spec: ThinkSpec,
        *,
        thinking_enabled: bool = True,
        prompt_opened_think: bool = False,
        tool_calls: bool = True,
    ) -> None:
        self._start = spec.start
        self._end = spec.end
        self._tool_end = spec.tool_end if tool_calls else ()
        self._tool_next = spec.tool_next if self._tool_end else ()
        self._reason_markers = (spec.end, *spec.implicit_end, *self._tool_end)
        self._drop = spec.content_drop
        self._drop_firsts = frozenset(m[0] for m in spec.content_drop)
        self._buf = ""  # a partial marker, held until decided (never white space: decided at once)
        self._lead: list[str] = []  # _START: the leading white space (content unless a block opens)
        self._may_open = False
        self._reason_lstrip = False
        self._content_lstrip = False
        # True once every later ``feed`` returns ``("", text)`` and ``finish`` nothing: a caller may skip them
        self.passthrough = not thinking_enabled
        if not thinking_enabled:
            self._state = _PASS
        elif spec.forced or prompt_opened_think:
            self._state = _REASONING
            self._may_open = True
            self._reason_lstrip = True
        else:
            self._state = _START

    def feed(self, text: str) -> tuple[str, str]:
        state = self._state
        if state == _PASS or (state == _CONTENT and not self._drop and not self._content_lstrip):
            return "", text
        return self._run(self._buf + text)

    def finish(self) -> tuple[str, str]:
        buf = self._buf
        self._buf = ""
        if self._lead:
            buf = "".join(self._lead) + buf
            self._lead = []
        if not buf:
            return "", ""
        if self._state == _REASONING:
            return buf, ""
        if self._state == _CONTENT and self._content_lstrip:
            return "", buf.lstrip()
        return "", buf

    def _run(self, buf: str) -> tuple[str, str]:
        reasoning = ""
        content = ""
        start = self._start
        while True:
            state = self._state
            if state == _START:
                t = buf.lstrip()
                if len(t) != len(buf):
                    self._lead.append(buf[: len(buf) - len(t)])
                if not t or (len(t) < len(start) and start.startswith(t)):
                    self._buf = t
                    break
                if t.startswith(start):
                    buf = t[len(start) :]
                    self._state = _REASONING
                    self._reason_lstrip = True
                else:
                    buf = "".join(self._lead) + t
                    self._state = _CONTENT
                self._lead = []
                continue
            if state == _REASONING:
                if self._may_open:
                    # (white space before the start marker is dropped either way: reason_lstrip)
                    t = buf.lstrip()
                    if not t or (len(t) < len(start) and start.startswith(t)):
                        self._buf = t
                        break
                    self._may_open = False
                    if t.startswith(start):
                        buf = t[len(start) :]
                if self._reason_lstrip:
                    buf = buf.lstrip()
                    if not buf:
                        self._buf = ""
                        break
                    self._reason_lstrip = False
                i, marker = find_first(buf, self._reason_markers)
                opens: bool | None = True
                while i != -1 and self._tool_next and marker in self._tool_end:
                    opens = self._opens_call(buf, i + len(marker))
                    if opens is not False:
                        break
                    i, marker = find_first(buf, self._reason_markers, i + len(marker))  # a mention: reasoning
                if i != -1 and opens is None:  # what follows the tool-call opener is not known yet: held
                    reasoning += buf[:i]
                    self._buf = buf[i:]
                    break
                if i != -1:
                    reasoning += buf[:i]
                    self._state = _CONTENT
                    if marker == self._end:
                        buf = buf[i + len(marker) :]
                        self._content_lstrip = True
                    else:
                        buf = buf[i:]
                        # the block was not closed: its end marker, if the model writes it after the
                        # call, is no content
                        self._drop = (*self._drop, self._end)
                        self._drop_firsts = self._drop_firsts | {self._end[0]}
                    continue
                hold = partial_suffix_len(buf, self._reason_markers)
                if hold:
                    reasoning += buf[:-hold]
                    self._buf = buf[-hold:]
                else:
                    reasoning += buf
                    self._buf = ""
                break
            if state == _PASS:  # pragma: no cover - feed() never gets here
                content += buf
                self._buf = ""
                break
            # _CONTENT
            if self._content_lstrip:
                buf = buf.lstrip()
                if not buf:
                    self._buf = ""
                    break
                self._content_lstrip = False
            if self._drop:
                content += self._drop_markers(buf)
            else:
                content += buf
                self._buf = ""
            break
        self.passthrough = self._state == _CONTENT and not self._drop and not self._content_lstrip
        return reasoning, content

    def _opens_call(self, buf: str, at: int) -> bool | None:
        """Whether the ``tool_end`` marker ending at ``at`` opens a call (``tool_next`` follows it); None
        while the text after it is too short to tell."""
        rest = buf[at:]
        t = rest.lstrip()
        if len(rest) - len(t) > _TOOL_NEXT_SPACE:
            return False
        if not t:
            return None
        for n in self._tool_next:
            if t.startswith(n):
                return True
            if n.startswith(t):
                return None
        return False

    def _drop_markers(self, buf: str) -> str:
        for c in self._drop_firsts:
            if c in buf:
                break
        else:
            self._buf = ""
            return buf
        out = []
        drop = self._drop
        while True:
            i, marker = find_first(buf, drop)
            if i == -1:
                break
            out.append(buf[:i])
            buf = buf[i + len(marker) :]
        hold = partial_suffix_len(buf, drop)
        if hold:
            out.append(buf[:-hold])
            self._buf = buf[-hold:]
        else:
            out.append(buf)
            self._buf = ""
        return "".join(out)
