"""gpt-oss (harmony format) reasoning parser.

The output is a series of messages ``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>T]
<|message|>BODY<|end|>`` (``<|return|>`` ends the final message, ``<|call|>`` a tool call); the prompt
usually ends with ``<|start|>assistant`` so the first message has no ``<|start|>``. The engine must
not skip special tokens for this family.

- channel ``analysis`` → reasoning;
- a message with a recipient (``to=functions.NAME``, a tool call) → passed through verbatim as
  content, markers included, for the gpt_oss tool parser, when the request's tool calls are parsed
  (``tool_calls``); a message to any other recipient (a built-in tool: ``browser.search``,
  ``python``), or any call when they are not (``tool_choice: none``, no tools), is neither reasoning
  nor content, as vLLM's ``parse_chat_output`` and ``OpenAIToolParser`` leave it (its markup is no
  text for the client);
- any other channel (``final``, ``commentary`` preambles) → content;
- text outside any message (a model that writes no harmony markers) → content.

``thinking_enabled`` / ``prompt_opened_think`` are accepted for interface symmetry and ignored:
gpt-oss always writes its channels.
"""

from __future__ import annotations

from shepherd.parsers.text_scan import find_first, partial_suffix_len

__all__ = ["HarmonyReasoningParser"]

_START = "<|start|>"
_CHANNEL = "<|channel|>"
_MESSAGE = "<|message|>"
_HEAD_MARKERS = (_START, _CHANNEL)
_BODY_END = ("<|end|>", "<|return|>", "<|call|>")
_BODY_MARKERS = (*_BODY_END, _START, _CHANNEL)
_MAX_HEADER = 512
_FUNCTIONS = "functions."  # the recipient prefix of a call to one of the request's tools

_OUTSIDE, _HEADER, _BODY = 0, 1, 2
_REASONING, _CONTENT, _TOOL, _HIDDEN = 0, 1, 2, 3


def _recipient(header: str) -> str | None:
    """The recipient a message header names (``to=R``, after white space), None when it names none."""
    i = header.find(" to=")
    if i == -1:
        i = header.find("\tto=")
    if i == -1:
        return None
    rest = header[i + 4 :]
    end = len(rest)
    for stop in (" ", "\t", "\n", "<|"):
        j = rest.find(stop)
        if j != -1 and j < end:
            end = j
    return rest[:end]


class HarmonyReasoningParser:
    __slots__ = ("_buf", "_kind", "_state", "_tool_calls", "passthrough")

    def __init__(
        self, *, thinking_enabled: bool = True, prompt_opened_think: bool = False, tool_calls: bool = True
    ) -> None:
        del thinking_enabled, prompt_opened_think
        self.passthrough = False  # (the channel may change at any point)
        self._tool_calls = tool_calls
        self._buf = ""
        self._state = _OUTSIDE
        self._kind = _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == _BODY and not self._buf and "<" not in text:
            kind = self._kind
            return (text, "") if kind == _REASONING else ("", "") if kind == _HIDDEN else ("", text)
        return self._run(self._buf + text)

    def finish(self) -> tuple[str, str]:
        buf = self._buf
        self._buf = ""
        if not buf:
            return "", ""
        if self._state == _HEADER:
            # a cut-off header: keep it only if it was a function call (raw, for the tool parser)
            recipient = _recipient(buf) if self._tool_calls else None
            if recipient is not None and (
                recipient.startswith(_FUNCTIONS) or _FUNCTIONS.startswith(recipient)
            ):
                return "", buf
            return "", ""
        if self._state == _BODY and self._kind == _REASONING:
            return buf, ""
        if self._state == _BODY and self._kind == _HIDDEN:
            return "", ""
        return "", buf

    def _run(self, buf: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            state = self._state
            if state == _OUTSIDE:
                i, _ = find_first(buf, _HEAD_MARKERS)
                if i == -1:
                    hold = partial_suffix_len(buf, _HEAD_MARKERS)
                    content.append(buf[: len(buf) - hold])
                    self._buf = buf[len(buf) - hold :]
                    break
                content.append(buf[:i])
                buf = buf[i:]
                self._state = _HEADER
                continue
            if state == _HEADER:
                # a header is one whose <|message|> starts within _MAX_HEADER characters: decided on
                # the text alone, whether it came whole or in pieces
                i = buf.find(_MESSAGE, 0, _MAX_HEADER + len(_MESSAGE))
                if i == -1:
                    if len(buf) >= _MAX_HEADER + len(_MESSAGE):  # not a header after all: its marker is
                        # plain text, and the text after it is read again (it may hold a real header)
                        head = _START if buf.startswith(_START) else _CHANNEL
                        content.append(head)
                        buf = buf[len(head) :]
                        self._state = _OUTSIDE
                        continue
                    self._buf = buf
                    break
                header = buf[:i]
                head_end = i + len(_MESSAGE)
                recipient = _recipient(header)
                if recipient is not None:
                    if self._tool_calls and recipient.startswith(_FUNCTIONS):
                        self._kind = _TOOL
                        content.append(buf[:head_end])
                    else:
                        self._kind = _HIDDEN
                else:
                    j = header.find(_CHANNEL)
                    channel = header[j + len(_CHANNEL) :].split("<|", 1)[0].strip() if j != -1 else ""
                    self._kind = _REASONING if channel == "analysis" else _CONTENT
                buf = buf[head_end:]
                self._state = _BODY
                continue
            # _BODY
            i, marker = find_first(buf, _BODY_MARKERS)
            out = reasoning if self._kind == _REASONING else content if self._kind != _HIDDEN else []
            if i == -1:
                hold = partial_suffix_len(buf, _BODY_MARKERS)
                out.append(buf[: len(buf) - hold])
                self._buf = buf[len(buf) - hold :]
                break
            out.append(buf[:i])
            if marker in _BODY_END:
                if self._kind == _TOOL:
                    content.append(marker)
                buf = buf[i + len(marker) :]
            else:  # a new message began without the previous one ending
                buf = buf[i:]
            self._state = _OUTSIDE
        return "".join(reasoning), "".join(content)
