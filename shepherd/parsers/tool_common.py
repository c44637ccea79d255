"""What every tool parser shares: call ids, argument JSON, parameter types from the request's tools."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from shepherd.parsers.events import ToolCallArgs, ToolCallStart, ToolEvent

__all__ = [
    "BodyParser",
    "CallEmitter",
    "CutCalls",
    "IdFactory",
    "ParamType",
    "ParamTypes",
    "ParsedCall",
    "convert_value",
    "cut_call",
    "dump_args",
    "infer_type",
    "load_args",
    "loads_json",
    "param_types",
    "parse_cut_guarded",
    "parse_guarded",
    "random_call_id",
    "scrub",
]

IdFactory = Callable[[], str]


class ParamType(NamedTuple):
    """A declared parameter's type. ``declared``: the schema's own ``type`` (of a list, its first
    non-null member), None when it has none; ``inferred``: SGLang's ``infer_type_from_json_schema``
    (``type``, else ``anyOf``/``oneOf``, ``enum``, ``allOf``, ``properties``, ``items``), None when the
    schema gives no hint."""

    declared: str | None
    inferred: str | None


ParamTypes = Mapping[str, Mapping[str, ParamType]]  # function name -> parameter name -> its type


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object text
    id: str | None = None  # None: the parser makes one


BodyParser = Callable[[str, ParamTypes], list[ParsedCall] | None]


class CutCalls(NamedTuple):
    """What a text cut off inside a call's JSON holds: the whole calls before the cut, and the call the
    cut is in (its arguments as far as they went; None: the cut left no whole name yet)."""

    calls: list[ParsedCall]
    cut: ParsedCall | None


# a cut-off call text -> its ``CutCalls``; None: it is not the beginning of calls (text, as it came)
CutParser = Callable[[str, ParamTypes], CutCalls | None]


def cut_call(obj: Any) -> CutCalls | None:
    """A call object read from a cut-off text (``partial_json``): ``{"name", "arguments"|"parameters"}``,
    its name whole (a cut string is not read) and its arguments an object as far as they went (a string
    of JSON: read when whole, else ``{}``); no name yet: ``CutCalls([], None)``; not a call: None."""
    if not isinstance(obj, dict):
        return None
    if "name" not in obj:
        return CutCalls([], None)
    name = obj["name"]
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = load_args(args) or {}
    if not isinstance(args, dict):
        return None
    return CutCalls([], ParsedCall(name, dump_args(args)))


def parse_cut_guarded(parse: CutParser, text: str, types: ParamTypes) -> CutCalls | None:
    """``parse(text, types)``, None when it raises (as ``parse_guarded``)."""
    try:
        return parse(text, types)
    except Exception:
        return None


def parse_guarded(parse: BodyParser, body: str, types: ParamTypes) -> list[ParsedCall] | None:
    """``parse(body, types)``, None when it raises: a body the parser cannot handle (nesting deeper
    than the recursion limit, a value JSON cannot write, ...) is not a call and comes back as text,
    as the references' ``except Exception`` fallbacks do."""
    try:
        return parse(body, types)
    except Exception:
        return None


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def dump_args(args: Mapping[str, Any]) -> str:
    """Arguments as JSON text. Raises ValueError for a value JSON cannot write (NaN, infinity)."""
    return json.dumps(args, ensure_ascii=False, allow_nan=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> Any:
    """``json.loads`` of strict JSON: ``NaN`` / ``Infinity`` are rejected (ValueError), as is nesting
    deeper than the recursion limit (RecursionError)."""
    return json.loads(text, parse_constant=_reject_constant)


def load_args(text: str) -> dict[str, Any] | None:
    """A JSON object (empty text counts as ``{}``), else None."""
    text = text.strip()
    if not text:
        return {}
    try:
        value = loads_json(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


_MAX_SCHEMA_DEPTH = 16  # how deep type inference follows anyOf/oneOf/allOf (a request's schema is untrusted)


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def _declared_type(schema: Mapping[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):  # ["string", "null"]
        t = next((x for x in t if x != "null"), None)
    return t if isinstance(t, str) else None


def infer_type(schema: Any, depth: int = 0) -> str | None:
    """SGLang's ``function_call/utils.py::infer_type_from_json_schema``: the primary type of a
    parameter schema, None when it gives no hint."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return t
    if isinstance(t, list) and t:
        return next((x for x in t if x != "null"), "string") if all(isinstance(x, str) for x in t) else None
    variants = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(variants, list):
        types = [x for x in (infer_type(v, depth + 1) for v in variants) if x]
        if types:
            if len(set(types)) == 1 or "string" not in types:
                return types[0]
            return "string"
    enum = schema.get("enum")
    if isinstance(enum, list):
        kinds = {_enum_type(v) for v in enum}
        return kinds.pop() if len(kinds) == 1 else "string"
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        for v in all_of:
            x = infer_type(v, depth + 1)
            if x and x != "string":
                return x
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _properties(schema: Any, depth: int = 0) -> Mapping[str, Any]:
    """The top-level ``properties`` of a ``parameters`` schema; without them, those of its
    ``anyOf``/``oneOf``/``allOf`` branches (SGLang's ``get_schema_properties``)."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return {}
    props = schema.get("properties")
    if isinstance(props, Mapping):
        return props
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in _properties(branch, depth + 1).items():
                    merged.setdefault(key, value)
    return merged


def param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, ParamType]]:
    """Parameter types by function from OpenAI-style ``tools`` (``{"type": "function", "function":
    {"name", "parameters": {"properties": {...}}}}``, or the bare function objects). Every function
    is listed, and every declared parameter (a parameter missing from its function is undeclared)."""
    out: dict[str, dict[str, ParamType]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        types: dict[str, ParamType] = {}
        for key, schema in _properties(fn.get("parameters")).items():
            if isinstance(schema, Mapping):
                types[str(key)] = ParamType(_declared_type(schema), infer_type(schema))
            else:
                types[str(key)] = ParamType(None, None)
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
        return loads_json(s)
    except (ValueError, RecursionError):
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

    def start(self, name: str) -> tuple[int, str]:
        """The index and id of a call that starts before it is whole (a streamed one)."""
        index = self._count
        self._count += 1
        return index, self._make_id()

    def emit(self, calls: Sequence[ParsedCall], out: list[ToolEvent], partial: bool = False) -> None:
        """The calls' events; ``partial``: the (last) call is one the output was cut off inside."""
        last = len(calls) - 1
        for k, call in enumerate(calls):
            index = self._count
            self._count += 1
            call_id = scrub(call.id) if call.id else self._make_id()
            out.append(ToolCallStart(index, call_id, scrub(call.name), partial and k == last))
            out.append(ToolCallArgs(index, scrub(call.arguments)))


_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD. A call's JSON decodes ``"\\ud83d"`` (half an emoji, a
    model's escape) to a surrogate no UTF-8 can hold: the answer's encoders (orjson), storage and the
    socket would all refuse it. Text from the detokenizer never holds one."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub("\ufffd", text)
