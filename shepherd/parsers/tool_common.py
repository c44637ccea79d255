"""What every tool parser shares: call ids, argument JSON, parameter types from the request's tools."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from shepherd.parsers.events import ToolCallArgs, ToolCallStart, ToolEvent

__all__ = [
    "CallEmitter",
    "IdFactory",
    "ParamTypes",
    "ParsedCall",
    "convert_value",
    "dump_args",
    "load_args",
    "param_types",
    "random_call_id",
]

IdFactory = Callable[[], str]
ParamTypes = Mapping[str, Mapping[str, str]]  # function name -> parameter name -> JSON schema type


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object text
    id: str | None = None  # None: the parser makes one


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def dump_args(args: Mapping[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def load_args(text: str) -> dict[str, Any] | None:
    """A JSON object (empty text counts as ``{}``), else None."""
    text = text.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, str]]:
    """Parameter types by function from OpenAI-style ``tools`` (``{"type": "function", "function":
    {"name", "parameters": {"properties": {...}}}}``, or the bare function objects)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        types: dict[str, str] = {}
        if isinstance(props, Mapping):
            for key, schema in props.items():
                t = schema.get("type") if isinstance(schema, Mapping) else None
                if isinstance(t, list):  # ["string", "null"]
                    t = next((x for x in t if x != "null"), None)
                if isinstance(t, str):
                    types[str(key)] = t
        out[fn["name"]] = types
    return out


_JSONISH_START = frozenset('{["-0123456789')


def convert_value(raw: str, typ: str | None) -> Any:
    """A parameter value written as raw text (XML-style formats) to its JSON value: kept a string
    when the schema says string (or when it does not parse), else parsed as JSON."""
    if typ == "string":
        return raw
    s = raw.strip()
    if typ == "boolean" and s in ("True", "False"):
        return s == "True"
    if typ is None and not (s[:1] in _JSONISH_START or s in ("true", "false", "null")):
        return raw
    try:
        return json.loads(s)
    except ValueError:
        return raw


class CallEmitter:
    """Numbers calls and builds their events. ``names``: the tool names calls may use (the request's
    tools); a parsed call naming another tool is not a call, and its parser returns it as text."""

    __slots__ = ("_count", "_make_id", "_names")

    def __init__(self, id_factory: IdFactory | None, names: Collection[str] | None = None) -> None:
        self._make_id = id_factory or random_call_id
        self._names = None if names is None else frozenset(names)
        self._count = 0

    def accepts(self, calls: Sequence[ParsedCall] | None) -> bool:
        """Whether ``calls`` is a non-empty list of calls to known tools."""
        if not calls:
            return False
        names = self._names
        return names is None or all(c.name in names for c in calls)

    def emit(self, calls: Sequence[ParsedCall], out: list[ToolEvent]) -> None:
        for call in calls:
            index = self._count
            self._count += 1
            out.append(ToolCallStart(index, call.id or self._make_id(), call.name))
            out.append(ToolCallArgs(index, call.arguments))
