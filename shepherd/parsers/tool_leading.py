"""Tool parsers for formats where the calls ARE the output: a JSON value (llama3, json) or a Python
call list (pythonic, llama4) at the start of the output, possibly after a tag (``<|python_tag|>``,
``<|python_start|>``).

If the output does not start with such a value it streams through as content. A value is buffered
until its closing bracket (quote-aware scan), then parsed: calls are emitted, anything else
(ordinary JSON content, a malformed call) comes back as text, raw. After the calls, separators and
whitespace are dropped; another value starts another round; other text is content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from shepherd.parsers.events import TextDelta, ToolEvent
from shepherd.parsers.text_scan import BracketScanner
from shepherd.parsers.tool_common import CallEmitter, IdFactory, ParamTypes, ParsedCall, dump_args

__all__ = ["JSON", "LLAMA3", "PYTHONIC", "LeadingSpec", "LeadingValueToolParser", "parse_json_calls"]

ValueParser = Callable[[str, ParamTypes], list[ParsedCall] | None]


@dataclass(frozen=True, slots=True)
class LeadingSpec:
    openers: str
    quotes: str
    parse: ValueParser
    prefixes: tuple[str, ...] = ()
    separators: str = ""
    suffixes: tuple[str, ...] = ()


_DETECT, _VALUE, _AFTER, _PASS = 0, 1, 2, 3


class LeadingValueToolParser:
    __slots__ = ("_buf", "_calls", "_parts", "_raw", "_scanner", "_spec", "_state", "_types")

    def __init__(
        self,
        spec: LeadingSpec,
        *,
        id_factory: IdFactory | None = None,
        types: ParamTypes | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self._spec = spec
        self._types: ParamTypes = types or {}
        self._calls = CallEmitter(id_factory, names)
        self._state = _DETECT
        self._buf = ""  # held text (DETECT/AFTER)
        self._parts: list[str] = []  # the value so far (VALUE)
        self._raw = ""  # text consumed before the current value (tag, whitespace), for the fallback
        self._scanner = BracketScanner(spec.quotes)

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == _PASS:
            return [TextDelta(text)] if text else []
        out: list[ToolEvent] = []
        self._run(text, out)
        return out

    def finish(self) -> list[ToolEvent]:
        state = self._state
        buf = self._buf
        self._buf = ""
        self._state = _PASS
        if state == _VALUE:
            buf = self._raw + "".join(self._parts)
            self._parts = []
        elif state == _AFTER and not buf.strip(" \t\r\n" + self._spec.separators):
            buf = ""
        return [TextDelta(buf)] if buf else []

    def _run(self, text: str, out: list[ToolEvent]) -> None:
        spec = self._spec
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
                calls = spec.parse(value, self._types)
                if calls and self._calls.accepts(calls):
                    self._calls.emit(calls, out)
                    self._state = _AFTER
                    self._raw = ""
                    continue
                out.append(TextDelta(self._raw + value))
                self._state = _PASS
                if text:
                    out.append(TextDelta(text))
                return
            if state == _PASS:
                if text:
                    out.append(TextDelta(text))
                return
            # _DETECT or _AFTER: skip whitespace (and tags / separators), then decide
            buf = self._buf + text
            strip = " \t\r\n" if state == _DETECT else " \t\r\n" + spec.separators
            tags = spec.prefixes if state == _DETECT else spec.suffixes
            t = buf.lstrip(strip)
            for tag in tags:
                if t.startswith(tag):
                    t = t[len(tag) :].lstrip(strip)
                    if state == _AFTER:  # a closing tag is consumed for good
                        buf = t
                    break
            if not t or any(len(t) < len(tag) and tag.startswith(t) for tag in tags):
                self._buf = buf
                return
            if t[0] in spec.openers:
                self._raw = buf[: len(buf) - len(t)] if state == _DETECT else ""
                self._state = _VALUE
                self._buf = ""
                self._scanner = BracketScanner(spec.quotes)
                text = t
                continue
            self._state = _PASS
            self._buf = ""
            out.append(TextDelta(buf if state == _DETECT else t))
            return


# --- value parsers ------------------------------------------------------------------------------


def _call_from_obj(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, dump_args(args))


def parse_json_calls(text: str, types: ParamTypes) -> list[ParsedCall] | None:
    """``{"name", "arguments"|"parameters"}`` or a non-empty list of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _call_from_obj(item)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_llama3(text: str, types: ParamTypes) -> list[ParsedCall] | None:
    if not text.startswith("{"):
        return None
    return parse_json_calls(text, types)


_PY_CONSTANTS = {"true": True, "false": False, "null": None, "none": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id.lower() in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id.lower()]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {
            _literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None
        }
    return ast.literal_eval(node)


def _parse_pythonic(text: str, types: ParamTypes) -> list[ParsedCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for el in tree.body.elts:
        if not isinstance(el, ast.Call) or el.args or not isinstance(el.func, ast.Name | ast.Attribute):
            return None
        args: dict[str, Any] = {}
        try:
            for kw in el.keywords:
                if kw.arg is None:
                    return None
                args[kw.arg] = _literal(kw.value)
            arguments = dump_args(args)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(ParsedCall(ast.unparse(el.func), arguments))
    return calls


LLAMA3 = LeadingSpec("{", '"', _parse_llama3, prefixes=("<|python_tag|>",), separators=";")
JSON = LeadingSpec("{[", '"', parse_json_calls)
PYTHONIC = LeadingSpec(
    "[", "\"'", _parse_pythonic, prefixes=("<|python_start|>",), suffixes=("<|python_end|>",)
)
