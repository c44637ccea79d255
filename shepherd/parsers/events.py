"""The parsers' vocabulary: output events and the two parser protocols.

Every parser is a pure state machine for ONE choice of ONE request: create a fresh instance per
request (``get_reasoning_parser`` / ``get_tool_parser`` do), ``feed`` it the detokenized text deltas
in order, then call ``finish`` once at the end of the output. Nothing is shared between instances.

Tool-call events are frozen dataclasses; ``TextDelta`` is a NamedTuple (as immutable, and ~4x cheaper
to build: one is built per text delta on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = [
    "ReasoningParser",
    "TextDelta",
    "ToolCallArgs",
    "ToolCallStart",
    "ToolEvent",
    "ToolParser",
]


class TextDelta(NamedTuple):
    """Plain content for the client (``delta.content``)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """Tool call ``index`` (0-based, in order of appearance within the choice) begins. ``partial``: a call
    the output was cut off inside, its arguments read as far as they went (a parser made with
    ``partial_calls`` only: see ``ToolParser``)."""

    index: int
    id: str
    name: str
    partial: bool = False


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    """A piece of tool call ``index``'s arguments. The pieces of one call, concatenated, are a JSON
    object text (``function.arguments``)."""

    index: int
    json: str


ToolEvent = TextDelta | ToolCallStart | ToolCallArgs


class ReasoningParser(Protocol):
    """Splits output text into reasoning (``reasoning_content``) and content.

    ``feed`` returns ``(reasoning_delta, content_delta)`` (either may be empty); text that could be
    the start of a marker is held back until it is decided. ``finish`` releases what is held.
    For every split of an output into deltas, the concatenated results are the same.

    ``passthrough`` is True once every later ``feed(text)`` would return ``("", text)`` and ``finish``
    ``("", "")`` (a caller may then skip both)."""

    passthrough: bool

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


class ToolParser(Protocol):
    """Turns content text into content deltas and tool calls.

    A call is reported only once it is complete and valid (``ToolCallStart`` then ``ToolCallArgs``);
    a malformed call, or one cut off by the end of the output, comes back as ``TextDelta`` with its
    raw text, so nothing is lost. For every split of an output into deltas, the concatenated content
    and the calls are the same.

    A parser made with ``partial_calls`` (the Messages API's: Anthropic answers a call cut off by
    ``max_tokens`` as a ``tool_use`` block) reports, at ``finish``, a call of a JSON format (hermes,
    json, llama3) the output was cut off inside as a ``ToolCallStart`` with ``partial`` set and its
    arguments read as far as they go (``partial_json``), when its name is whole and a tool's; a cut
    that leaves no name yet is dropped; what is not the beginning of a call stays text. Only when the
    token limit cut it (``finish(cut=True)``, the default): an output that ended on its own (EOS, a stop
    string) inside a call (``cut=False``) gives that call back as text, as without ``partial_calls``."""

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self, cut: bool = True) -> list[ToolEvent]: ...
