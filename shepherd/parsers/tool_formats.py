"""The delimited tool-call formats: each family's markers and its call-body parser (name and
arguments out of the text between the markers; None when the body is not a valid call).

Plain ``str.find`` rather than lazy regexes: a long argument (a whole file) must not cost
milliseconds to parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shepherd.parsers.partial_json import partial_json
from shepherd.parsers.tool_common import (
    BodyParser,
    CutCalls,
    ParamTypes,
    ParsedCall,
    convert_value,
    cut_call,
    dump_args,
    load_args,
    loads_json,
)
from shepherd.parsers.tool_delimited import DelimitedSpec

__all__ = [
    "COHERE",
    "DEEPSEEK_V3",
    "DEEPSEEK_V31",
    "DEEPSEEK_V32",
    "GLM45",
    "GPT_OSS",
    "HERMES",
    "KIMI_K2",
    "MINIMAX_M2",
    "QWEN3_CODER",
]


def _parse_hermes(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    obj = load_args(body)
    if not obj:
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = load_args(args)
    if not isinstance(args, dict):
        return None
    return [ParsedCall(name, dump_args(args))]


_HERMES_HEAD = re.compile(
    r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\\x00-\x1f]|\\.)*")'
    r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*\{'
)


def _hermes_head(body: str) -> tuple[str, int] | None:
    """A hermes body's name and where its arguments object begins, once both came (``{"name": "f",
    "arguments": {``, the order models write); None before, or for another layout (read at the end)."""
    m = _HERMES_HEAD.match(body)
    if m is None:
        return None
    try:
        name = loads_json(m.group(1))
    except ValueError:
        return None
    return (name, m.end() - 1) if isinstance(name, str) and name else None


def _cut_hermes(body: str, types: ParamTypes) -> CutCalls | None:
    """A hermes call body cut off by the end of the output (``partial_calls``): its JSON as far as it
    goes."""
    found, obj = partial_json(body)
    return cut_call(obj) if found else CutCalls([], None)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _qwen3_coder_value(value: str, types: ParamTypes, name: str, key: str) -> Any:
    """As vLLM's and SGLang's ``Qwen3Coder*._convert_param_value``: ``null`` (any case) is null; a
    parameter the function does not declare, or declares without a ``type``, is a string."""
    if len(value) == 4 and value.lower() == "null":
        return None
    return convert_value(value, _declared(types, name, key) or "string")


def _declared(types: ParamTypes, name: str, key: str) -> str | None:
    """The type the request's tool ``name`` declares for its parameter ``key`` (None: none)."""
    declared = types.get(name, {}).get(key)
    return declared.declared if declared is not None else None


_QWEN3_CODER_HEAD = re.compile(r"[ \t\n\r]*<function=([^>\n]*)>")
_PARAM, _PARAM_END, _FUNCTION_END = "<parameter=", "</parameter>", "</function>"
_MARKERS = (_PARAM, _PARAM_END, _FUNCTION_END)


def _qwen3_coder_head(body: str) -> tuple[str, int] | None:
    """A qwen3_coder body's function name and where its parameters begin, once ``<function=NAME>`` came."""
    m = _QWEN3_CODER_HEAD.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    return (name, m.end()) if name else None


class Qwen3CoderArgs:
    """A qwen3_coder call's ``<parameter=K>V</parameter>``s as the JSON object text ``_parse_qwen3_coder``
    makes of them (``dump_args``), made as they arrive (``DelimitedSpec.args``): a string parameter's
    characters as they come (one leading and one trailing newline dropped, ``null`` in any case null),
    another type's value once it closed. What is not certain yet is held; what the whole parse alone can
    tell (``</function>`` inside a value, stray text) stops it (``broken``): the call's end then sends
    the rest."""

    __slots__ = ("_emitted", "_first", "_key", "_kind", "_name", "_state", "_types", "_val", "broken", "done")

    def __init__(self, name: str, types: ParamTypes) -> None:
        self._name = name
        self._types = types
        self._state = 0  # 0: before "{", 1: between parameters, 2: in a key, 3: in a value
        self._val = ""  # the text since the state began (a key's, a value's, between parameters)
        self._emitted = 0  # of a string value's characters, those written
        self._first = True
        self._key = ""
        self._kind = "string"
        self.done = False
        self.broken = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        if self._state == 0:
            out.append("{")
            self._state = 1
        self._val += text
        while not (self.done or self.broken) and self._step(out):
            pass
        return "".join(out)

    def _step(self, out: list[str]) -> bool:
        """One move (True: more may follow at once)."""
        v = self._val
        if self._state == 1:
            t = v.lstrip()
            if t.startswith(_PARAM):
                self._val, self._state = t[len(_PARAM) :], 2
                return True
            if t and not t.startswith(_FUNCTION_END) and not any(m.startswith(t) for m in _MARKERS):
                self.broken = True  # stray text between parameters: the whole parse refuses the call
            return False  # (``</function>``: the call's end marker sends the closing brace)
        if self._state == 2:
            close = v.find(">")
            if close == -1:
                if "\n" in v:
                    self.broken = True
                return False
            key = v[:close].strip()
            if not key or "\n" in key:
                self.broken = True
                return False
            out.append(("" if self._first else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            self._first = False
            self._key = key
            self._kind = _declared(self._types, self._name, key) or "string"
            self._val, self._state, self._emitted = v[close + 1 :], 3, 0
            return True
        # a value: its end is the first "</parameter>" or "<parameter=" (an unclosed parameter's)
        start = max(0, self._emitted - len(_PARAM_END))
        ends = [(i, m) for m in (_PARAM_END, _PARAM, _FUNCTION_END) if (i := v.find(m, start)) != -1]
        if ends:
            i, m = min(ends)
            if m == _FUNCTION_END:
                self.broken = True  # (the body's end, or text of the value: the whole parse tells)
                return False
            value = v[:i]
            self._end_value(value, out)
            self._val = v[i + len(m) :]
            self._state = 1 if m == _PARAM_END else 2
            return True
        if self._kind == "string":
            self._stream_string(v, out)
        return False

    def _end_value(self, raw: str, out: list[str]) -> None:
        value = _strip_one_newline(raw)
        if self._emitted:  # a string begun: its rest (a string begun is no null: see ``_stream_string``)
            written = raw[1 if raw.startswith("\n") else 0 : self._emitted]
            if not value.startswith(written):
                self.broken = True
                return
            out.append(_json_chars(value[len(written) :]) + '"')
            return
        try:
            v = _qwen3_coder_value(value, self._types, self._name, self._key)
            out.append(json.dumps(v, ensure_ascii=False, allow_nan=False))
        except ValueError:
            self.broken = True

    def _stream_string(self, v: str, out: list[str]) -> None:
        """A string value's characters that are certain (``v``: the value's raw text so far): not the
        newline it starts with, nor one it may end on, nor the start of a marker, nor anything while it
        may still be ``null``."""
        safe = len(v)
        lt = v.rfind("<", max(0, safe - len(_PARAM_END)))
        if lt != -1 and any(m.startswith(v[lt:]) for m in _MARKERS):
            safe = lt
        if safe and v[safe - 1] == "\n":
            safe -= 1
        lead = 1 if v.startswith("\n") else 0
        if safe <= lead:
            return
        if not self._emitted and safe - lead <= 4 and "null".startswith(v[lead:safe].lower()):
            return  # (it may still be null)
        start = max(self._emitted, lead)
        if safe > start:
            out.append(("" if self._emitted else '"') + _json_chars(v[start:safe]))
            self._emitted = safe


def _json_chars(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _parse_qwen3_coder(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    body = body.strip()
    if not body.startswith("<function="):
        return None
    close = body.find(">")
    name = body[len("<function=") : close].strip() if close != -1 else ""
    if not name or "\n" in name:
        return None
    inner = body[close + 1 :]
    if inner.endswith("</function>"):
        inner = inner[: -len("</function>")]
    args: dict[str, Any] = {}
    pos = 0
    n = len(inner)
    end = -2  # the first "</parameter>" at or after the current value (-2: not looked for yet); it is
    # looked for again only once passed, so the body is scanned once (unclosed parameters: linear)
    while True:
        start = inner.find("<parameter=", pos)
        if inner[pos : n if start == -1 else start].strip():
            return None  # stray text between parameters
        if start == -1:
            break
        close = inner.find(">", start)
        key = inner[start + len("<parameter=") : close].strip() if close != -1 else ""
        if not key or "\n" in key:
            return None
        vstart = close + 1
        if end == -2 or -1 < end < vstart:
            end = inner.find("</parameter>", vstart)
        nxt = inner.find("<parameter=", vstart)
        if end != -1 and (nxt == -1 or end < nxt):
            value, pos = inner[vstart:end], end + len("</parameter>")
        else:  # an unclosed parameter runs to the next one
            stop = n if nxt == -1 else nxt
            value, pos = inner[vstart:stop], stop
        args[key] = _qwen3_coder_value(_strip_one_newline(value), types, name, key)
    return [ParsedCall(name, dump_args(args))]


def _invokes(prefix: str, typed_by_attr: bool) -> BodyParser:
    """The ``<invoke name="F"><parameter name="K">V</parameter>...</invoke>`` blocks of a call section
    (MiniMax-M2: no prefix; DeepSeek-V3.2's DSML: ``｜DSML｜`` before each tag name), one call each,
    white space between them. A value is typed by its ``string="true|false"`` attribute where the format
    has it (DSML: true, the text as it is; false, JSON), else by the tool's schema (MiniMax: strings as
    they are, the rest JSON), as vLLM's and SGLang's parsers read them."""
    inv_open, inv_close = f'<{prefix}invoke name="', f"</{prefix}invoke>"
    par_open, par_close = f'<{prefix}parameter name="', f"</{prefix}parameter>"

    def parse(body: str, types: ParamTypes) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        pos, n = 0, len(body)
        while True:  # bounded: each turn moves past an invoke's end
            start = body.find(inv_open, pos)
            if body[pos : n if start == -1 else start].strip():
                return None  # stray text between invokes
            if start == -1:
                break
            q = body.find('"', start + len(inv_open))  # the name's closing quote, then '>' (spaces between)
            gt = body.find(">", q + 1) if q != -1 else -1
            end = body.find(inv_close, start)
            if gt == -1 or end == -1 or end < gt or body[q + 1 : gt].strip():
                return None
            name = body[start + len(inv_open) : q]
            if not name or "\n" in name:
                return None
            args: dict[str, Any] = {}
            at = gt + 1
            while True:  # bounded: each turn moves past a parameter's end
                ps = body.find(par_open, at, end)
                if body[at : end if ps == -1 else ps].strip():
                    return None  # stray text between parameters
                if ps == -1:
                    break
                head_end = body.find(">", ps + len(par_open), end)
                pe = body.find(par_close, ps, end)
                if head_end == -1 or pe == -1 or pe < head_end:
                    return None
                head = body[ps + len(par_open) : head_end]  # 'K"' or 'K" string="true"'
                key, quote, attrs = head.partition('"')
                if not key or not quote:
                    return None
                raw = _strip_one_newline(body[head_end + 1 : pe])
                if typed_by_attr and 'string="true"' in attrs:
                    args[key] = raw
                elif typed_by_attr and 'string="false"' in attrs:
                    try:
                        args[key] = loads_json(raw)
                    except (ValueError, RecursionError):
                        args[key] = raw
                else:  # by the schema; a parameter it does not declare: JSON if it reads as JSON
                    args[key] = convert_value(raw, _declared(types, name, key))
                at = pe + len(par_close)
            calls.append(ParsedCall(name, dump_args(args)))
            pos = end + len(inv_close)
        return calls or None

    return parse


def _parse_glm45(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    i = body.find("<arg_key>")
    name = (body if i == -1 else body[:i]).strip()
    if not name or "<" in name or "\n" in name:
        return None
    ptypes = types.get(name, {})
    args: dict[str, Any] = {}
    pos = 0 if i == -1 else i
    n = len(body) if i != -1 else 0
    while pos < n:
        if not body.startswith("<arg_key>", pos):
            if body[pos:].strip():
                return None
            break
        kend = body.find("</arg_key>", pos)
        if kend == -1:
            return None
        key = body[pos + len("<arg_key>") : kend].strip()
        vstart = kend + len("</arg_key>")
        while vstart < n and body[vstart].isspace():
            vstart += 1
        if not body.startswith("<arg_value>", vstart):
            return None
        vstart += len("<arg_value>")
        vend = body.find("</arg_value>", vstart)
        if vend == -1 or not key:
            return None
        # SGLang's glm4_moe_detector: the type inferred from the schema (anyOf/oneOf/enum/...); an
        # undeclared parameter's value is parsed as JSON when it is JSON
        declared = ptypes.get(key)
        args[key] = convert_value(body[vstart:vend], declared.inferred if declared is not None else None)
        pos = vend + len("</arg_value>")
        while pos < n and body[pos].isspace():
            pos += 1
    return [ParsedCall(name, dump_args(args))]


_DS_SEP = "<｜tool▁sep｜>"


def _parse_deepseek_v3(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    head, sep, rest = body.partition(_DS_SEP)
    if not sep or head.strip() not in ("", "function"):
        return None
    name, nl, rest = rest.partition("\n")
    name = name.strip()
    rest = rest.strip()
    if not nl or not name or not rest.startswith("```") or not rest.endswith("```") or len(rest) < 6:
        return None
    rest = rest[3:-3]
    if rest.startswith("json"):
        rest = rest[4:]
    args = load_args(rest)
    if args is None:
        return None
    return [ParsedCall(name, dump_args(args))]


def _parse_deepseek_v31(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    name, sep, raw = body.partition(_DS_SEP)
    name = name.strip()
    if not sep or not name or "<" in name:
        return None
    args = load_args(raw)
    if args is None:
        return None
    return [ParsedCall(name, dump_args(args))]


_KIMI_ARG = "<|tool_call_argument_begin|>"


def _parse_kimi_k2(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    call_id, sep, raw = body.partition(_KIMI_ARG)
    call_id = call_id.strip()
    if not sep or not call_id or "<" in call_id:
        return None
    name = call_id.removeprefix("functions.")
    head, colon, tail = name.rpartition(":")
    if colon and tail.isdigit():
        name = head
    args = load_args(raw)
    if args is None or not name:
        return None
    # the model's arguments text verbatim (vLLM's and SGLang's kimi_k2 parsers): re-serialising could
    # only change it (checked above to be a strict JSON object)
    return [ParsedCall(name, raw.strip() or "{}", call_id)]


_HARMONY_TO = re.compile(r"\bto=functions\.([^\s<]+)")


def _parse_gpt_oss(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    header, sep, raw = body.partition("<|message|>")
    m = _HARMONY_TO.search(header)
    if not sep or m is None:
        return None
    args = load_args(raw)
    if args is None:
        return None
    return [ParsedCall(m.group(1), dump_args(args))]


def _parse_cohere(body: str, types: ParamTypes) -> list[ParsedCall] | None:
    try:
        value = loads_json(body)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("tool_name")
        args = item.get("parameters", {})
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        calls.append(ParsedCall(name, dump_args(args)))
    return calls or None


# SGLang's hermes_detector decodes the JSON value after <tool_call> (raw_decode): the end tag inside an
# argument string is text, and a complete call needs no end tag (vLLM: ``<tool_call>(.*)`` to the end)
HERMES = DelimitedSpec(
    ("<tool_call>",),
    ("</tool_call>",),
    _parse_hermes,
    json_body=True,
    open_end=True,
    cut=_cut_hermes,
    head=_hermes_head,
)
QWEN3_CODER = DelimitedSpec(
    ("<tool_call>",), ("</tool_call>",), _parse_qwen3_coder, head=_qwen3_coder_head, args=Qwen3CoderArgs
)
GLM45 = DelimitedSpec(("<tool_call>",), ("</tool_call>",), _parse_glm45)
DEEPSEEK_V3 = DelimitedSpec(
    ("<｜tool▁call▁begin｜>",),
    ("<｜tool▁call▁end｜>",),
    _parse_deepseek_v3,
    section_begin="<｜tool▁calls▁begin｜>",
    section_end="<｜tool▁calls▁end｜>",
)
DEEPSEEK_V31 = DelimitedSpec(
    ("<｜tool▁call▁begin｜>",),
    ("<｜tool▁call▁end｜>",),
    _parse_deepseek_v31,
    section_begin="<｜tool▁calls▁begin｜>",
    section_end="<｜tool▁calls▁end｜>",
)
KIMI_K2 = DelimitedSpec(
    ("<|tool_call_begin|>",),
    ("<|tool_call_end|>",),
    _parse_kimi_k2,
    section_begin="<|tool_calls_section_begin|>",
    section_end="<|tool_calls_section_end|>",
)
COHERE = DelimitedSpec(("<|START_ACTION|>",), ("<|END_ACTION|>",), _parse_cohere)
MINIMAX_M2 = DelimitedSpec(("<minimax:tool_call>",), ("</minimax:tool_call>",), _invokes("", False))
_DSML = "｜DSML｜"
DEEPSEEK_V32 = DelimitedSpec(
    (f"<{_DSML}function_calls>",), (f"</{_DSML}function_calls>",), _invokes(_DSML, True)
)
GPT_OSS = DelimitedSpec(("<|start|>", "<|channel|>"), ("<|call|>", "<|end|>", "<|return|>"), _parse_gpt_oss)
