"""The output text path of one choice: reasoning parser, then tool parser on its content."""

from __future__ import annotations

from shepherd.parsers.events import ReasoningParser, TextDelta, ToolEvent, ToolParser

__all__ = ["OutputParsers"]


class OutputParsers:
    """Either parser may be None (not configured for the model, thinking off, ``tool_choice: none``).

    ``feed(text)`` → ``(reasoning_delta, content_events)``: the reasoning text for
    ``reasoning_content`` and the content as tool-parser events (``TextDelta`` when there is no tool
    parser). ``finish()`` flushes both, the reasoning parser's tail going through the tool parser."""

    __slots__ = ("_reasoning", "_tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> tuple[str, list[ToolEvent]]:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
        return reasoning, self._content(text, final=False)

    def finish(self) -> tuple[str, list[ToolEvent]]:
        reasoning = text = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish()
        return reasoning, self._content(text, final=True)

    def _content(self, text: str, *, final: bool) -> list[ToolEvent]:
        if self._tools is None:
            return [TextDelta(text)] if text else []
        events = self._tools.feed(text) if text else []
        if final:
            events.extend(self._tools.finish())
        return events
