"""Tool parsers for formats where the calls ARE the output: a JSON value (llama3, json) or a Python
call list (pythonic, llama4) at the start of the output, possibly after a tag (``<|python_tag|>``,
``<|python_start|>``); for llama3 also after the tag anywhere in the output (``prefix_anywhere``).

If the output does not start with such a value it streams through as content. A value is buffered
until its closing bracket (quote-aware scan), then parsed: calls are emitted, anything else
(ordinary JSON content, a malformed call, one the value parser cannot handle) comes back as text, raw.
After the calls, separators and whitespace are dropped, and one closing tag (``<|python_end|>``);
another value starts another round; other text is content. With ``partial_calls`` (the Messages API), a
JSON value (json, llama3) cut off by the end of the output gives its whole calls and the one it was cut
inside as a partial call (nothing when that one has no whole name yet), instead of text.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from shepherd.parsers.events import TextDelta, ToolEvent
from shepherd.parsers.partial_json import partial_array, partial_json
from shepherd.parsers.text_scan import BracketScanner, text_before
from shepherd.parsers.tool_common import (
    CallEmitter,
    CutCalls,
    CutParser,
    IdFactory,
    ParamTypes,
    ParsedCall,
    cut_call,
    dump_args,
    loads_json,
    parse_cut_guarded,
    parse_guarded,
)

__all__ = [
    "JSON",
    "LLAMA3",
    "PYTHONIC",
    "LeadingSpec",
    "LeadingValueToolParser",
    "cut_json_calls",
    "parse_json_calls",
]

ValueParser = Callable[[str, ParamTypes], list[ParsedCall] | None]


@dataclass(frozen=True, slots=True)
class LeadingSpec:
    """``prefix_anywhere``: a prefix tag after other text also starts calls (SGLang's llama32 detector
    splits the output at ``<|python_tag|>``); without it, only at the start of the output."""

    openers: str
    quotes: str
    parse: ValueParser
    prefixes: tuple[str, ...] = ()
    separators: str = ""
    suffixes: tuple[str, ...] = ()
    prefix_anywhere: bool = False
    cut: CutParser | None = None  # a value cut off by the end of the output, read as far as it goes


_DETECT, _VALUE, _AFTER, _PASS = 0, 1, 2, 3
_WS = " \t\r\n"


class LeadingValueToolParser:
    __slots__ = (
        "_after_strip",
        "_buf",
        "_calls",
        "_firsts",
        "_partial",
        "_parts",
        "_pre",
        "_raw",
        "_scanner",
        "_spec",
        "_state",
        "_suffixed",
        "_tagged",
        "_types",
    )

    def __init__(
        self,
        spec: LeadingSpec,
        *,
        id_factory: IdFactory | None = None,
        types: ParamTypes | None = None,
        names: Collection[str] | None = None,
        partial_calls: bool = False,
    ) -> None:
        self._spec = spec
        self._partial = partial_calls and spec.cut is not None
        self._types: ParamTypes = types or {}
        self._calls = CallEmitter(id_factory, names)
        self._state = _DETECT
        # held text that may still become a tag: a partial prefix (DETECT, PASS with ``prefix_anywhere``)
        # or suffix (AFTER) tag, never white space (white space is decided at once: no quadratic re-scan)
        self._buf = ""
        self._pre: list[str] = []  # DETECT: the white space and tag consumed so far (for the fallback)
        self._tagged = False  # DETECT: a prefix tag has been consumed
        self._suffixed = False  # AFTER: the closing tag has been consumed
        self._parts: list[str] = []  # the value so far (VALUE)
        self._raw = ""  # text consumed before the current value (tag, whitespace), for the fallback
        self._scanner = BracketScanner(spec.quotes)
        self._after_strip = _WS + spec.separators
        self._firsts = frozenset(t[0] for t in spec.prefixes) if spec.prefix_anywhere else frozenset()

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == _PASS and not self._buf:
            for c in self._firsts:
                if c in text:
                    break
            else:
                return [TextDelta(text)] if text else []
        out: list[ToolEvent] = []
        self._run(text, out)
        return out

    def finish(self, cut: bool = True) -> list[ToolEvent]:
        state = self._state
        buf = self._buf
        self._buf = ""
        self._state = _PASS
        if state == _VALUE:
            value = "".join(self._parts)
            self._parts = []
            out: list[ToolEvent] = []
            if self._partial and cut and self._cut(value, out):
                return out
            buf = self._raw + value
        elif state == _DETECT:
            buf = "".join(self._pre) + buf
            self._pre = []
        return [TextDelta(buf)] if buf else []

    def _cut(self, value: str, out: list[ToolEvent]) -> bool:
        """A value cut off by the end of the output: its whole calls and the partial one (nothing when
        the cut left no call with a whole name); False when it is not the beginning of calls of known
        tools (it is then text)."""
        assert self._spec.cut is not None
        got = parse_cut_guarded(self._spec.cut, value, self._types)
        if got is None:
            return False
        calls = got.calls if got.cut is None else [*got.calls, got.cut]
        if calls and not self._calls.accepts(calls):
            return False
        self._calls.emit(calls, out, partial=got.cut is not None)
        return True

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
                calls = parse_guarded(spec.parse, value, self._types)
                if calls and self._calls.accepts(calls):
                    self._calls.emit(calls, out)
                    self._state = _AFTER
                    self._suffixed = False
                    self._raw = ""
                    continue
                out.append(TextDelta(self._raw + value))
                self._raw = ""
                self._state = _PASS
                continue
            if state == _PASS:
                if not self._firsts:
                    if text:
                        out.append(TextDelta(text))
                    return
                # a prefix tag after text starts calls again
                before, tag, text = text_before(self._buf + text, spec.prefixes)
                if before:
                    out.append(TextDelta(before))
                if not tag:
                    self._buf = text
                    return
                self._buf = ""
                self._state = _DETECT
                self._pre = [tag]
                self._tagged = True
                continue
            if state == _AFTER:
                # after the calls: white space and separators are dropped, and one closing tag
                t = (self._buf + text).lstrip(self._after_strip)
                self._buf = ""
                if not self._suffixed:
                    for tag in spec.suffixes:
                        if t.startswith(tag):
                            t = t[len(tag) :].lstrip(self._after_strip)
                            self._suffixed = True
                            break
                        if t and len(t) < len(tag) and tag.startswith(t):
                            self._buf = t
                            return
                if not t:
                    return
                text = t
                if t[0] in spec.openers:
                    self._state = _VALUE
                    self._scanner = BracketScanner(spec.quotes)
                else:
                    self._state = _PASS
                continue
            # _DETECT: skip white space and one prefix tag, then decide
            buf = self._buf + text
            self._buf = ""
            while True:
                t = buf.lstrip(_WS)
                if len(t) != len(buf):
                    self._pre.append(buf[: len(buf) - len(t)])
                if not t:
                    return
                if self._tagged:
                    break
                for tag in spec.prefixes:
                    if t.startswith(tag):
                        self._pre.append(tag)
                        self._tagged = True
                        buf = t[len(tag) :]
                        break
                    if len(t) < len(tag) and tag.startswith(t):
                        self._buf = t
                        return
                else:
                    break
            pre = "".join(self._pre)
            self._pre = []
            text = t
            if t[0] in spec.openers:
                self._raw = pre
                self._state = _VALUE
                self._scanner = BracketScanner(spec.quotes)
            else:
                if pre:
                    out.append(TextDelta(pre))
                self._state = _PASS
            continue


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
            args = loads_json(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, dump_args(args))


def parse_json_calls(text: str, types: ParamTypes) -> list[ParsedCall] | None:
    """``{"name", "arguments"|"parameters"}`` or a non-empty list of them."""
    try:
        value = loads_json(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _call_from_obj(item)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def cut_json_calls(text: str, types: ParamTypes) -> CutCalls | None:
    """``parse_json_calls`` of a value cut off at its end: the whole calls of a list and the one it was
    cut inside (``cut_call``), or the one object's."""
    if text.lstrip().startswith("["):
        items, last_cut = partial_array(text)
        whole = items[:-1] if last_cut else items
        calls = [_call_from_obj(item) for item in whole]
        if any(c is None for c in calls):
            return None
        done = [c for c in calls if c is not None]
        if not last_cut:
            return CutCalls(done, None)
        got = cut_call(items[-1])
        return None if got is None else CutCalls(done, got.cut)
    found, obj = partial_json(text)
    return cut_call(obj) if found else CutCalls([], None)


def _cut_llama3(text: str, types: ParamTypes) -> CutCalls | None:
    return cut_json_calls(text, types) if text.startswith("{") else None


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
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (deep nesting: the last two)
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
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        try:
            name = ast.unparse(el.func)
        except (ValueError, RecursionError):
            return None
        calls.append(ParsedCall(name, arguments))
    return calls


LLAMA3 = LeadingSpec(
    "{",
    '"',
    _parse_llama3,
    prefixes=("<|python_tag|>",),
    separators=";",
    prefix_anywhere=True,
    cut=_cut_llama3,
)
JSON = LeadingSpec("{[", '"', parse_json_calls, cut=cut_json_calls)
PYTHONIC = LeadingSpec(
    "[", "\"'", _parse_pythonic, prefixes=("<|python_start|>",), suffixes=("<|python_end|>",)
)
