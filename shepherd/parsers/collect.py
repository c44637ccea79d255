"""Whole-output helpers over the streaming parsers (non-streaming responses, tests): run a parser
over a sequence of deltas and gather the result."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shepherd.parsers.events import ReasoningParser, TextDelta, ToolCallArgs, ToolEvent, ToolParser

__all__ = ["CollectedCall", "CollectedTools", "collect_tool_events", "run_reasoning", "run_tools"]


@dataclass(frozen=True, slots=True)
class CollectedCall:
    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CollectedTools:
    content: str
    calls: tuple[CollectedCall, ...]


def run_reasoning(parser: ReasoningParser, deltas: Iterable[str]) -> tuple[str, str]:
    """Feed every delta then finish: ``(reasoning, content)``."""
    reasoning: list[str] = []
    content: list[str] = []
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content)


def collect_tool_events(events: Iterable[ToolEvent]) -> CollectedTools:
    """Content concatenated; each call's argument pieces concatenated, in call order."""
    content: list[str] = []
    starts: dict[int, tuple[str, str]] = {}
    args: dict[int, list[str]] = {}
    for ev in events:
        if isinstance(ev, TextDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallArgs):
            args.setdefault(ev.index, []).append(ev.json)
        else:
            starts[ev.index] = (ev.id, ev.name)
            args.setdefault(ev.index, [])
    calls = tuple(CollectedCall(i, starts[i][0], starts[i][1], "".join(args[i])) for i in sorted(starts))
    return CollectedTools("".join(content), calls)


def run_tools(parser: ToolParser, deltas: Iterable[str]) -> CollectedTools:
    """Feed every delta then finish, and collect."""
    events: list[ToolEvent] = []
    for delta in deltas:
        events.extend(parser.feed(delta))
    events.extend(parser.finish())
    return collect_tool_events(events)
