"""Streaming reasoning and tool-call parsers: pure state machines, one fresh instance per request.

Use ``get_reasoning_parser`` then ``get_tool_parser`` (in that order on the text path: the tool
parser is fed the reasoning parser's content; ``OutputParsers`` chains them), and
``default_parsers_for_model`` to pick families.
"""

from shepherd.parsers.collect import (
    CollectedCall,
    CollectedTools,
    collect_tool_events,
    run_reasoning,
    run_tools,
)
from shepherd.parsers.events import (
    ReasoningParser,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    ToolEvent,
    ToolParser,
)
from shepherd.parsers.pipeline import OutputParsers
from shepherd.parsers.registry import (
    OFF,
    REASONING_FAMILIES,
    TOOL_FAMILIES,
    default_parsers_for_model,
    get_reasoning_parser,
    get_tool_parser,
    prompt_closes_think,
    prompt_opens_think,
    reasoning_family_name,
    thinking_enabled,
    tool_family_name,
)

__all__ = [
    "OFF",
    "REASONING_FAMILIES",
    "TOOL_FAMILIES",
    "CollectedCall",
    "CollectedTools",
    "OutputParsers",
    "ReasoningParser",
    "TextDelta",
    "ToolCallArgs",
    "ToolCallStart",
    "ToolEvent",
    "ToolParser",
    "collect_tool_events",
    "default_parsers_for_model",
    "get_reasoning_parser",
    "get_tool_parser",
    "prompt_closes_think",
    "prompt_opens_think",
    "reasoning_family_name",
    "run_reasoning",
    "run_tools",
    "thinking_enabled",
    "tool_family_name",
]
