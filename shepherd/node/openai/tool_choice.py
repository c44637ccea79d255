"""Tools and ``tool_choice`` of a chat request: validation, what the template sees, and the engine
constraint that forces a call.

Semantics follow SGLang (which follows OpenAI), but for ``none``, which follows vLLM:

- ``none``: the tools stay in the prompt (the model sees them; vLLM's default, without
  ``--exclude-tools-when-tool-choice-none``; Anthropic's ``tool_choice: {"type": "none"}`` keeps its
  tool-use system prompt too) and the output is not parsed for calls;
- ``auto`` (the default when tools are given): the model decides; the model's tool-call parser reads
  its output; tools marked ``strict`` get their parameters enforced by a structural tag where the
  family's call format allows one (``structural_tag``);
- ``required`` / a named function (``{"type": "function", "function": {"name": ...}}``): the engine is
  constrained to a JSON array of ``{"name", "parameters"}`` objects (``call_array_schema``; a named
  function puts only that tool in the prompt and in the schema), which the ``json`` parser reads;
  ``parallel_tool_calls: false`` caps the array at one item;
- ``allowed_tools`` (``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``): ``auto`` or
  ``required`` over the tools it lists only (``parse_choice_and_tools``: the others leave the request).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from shepherd.proto.openai_errors import bad

__all__ = [
    "STRUCTURAL_TAG_FAMILIES",
    "ToolChoice",
    "allowed_tools",
    "call_array_schema",
    "check_tool_name",
    "parse_choice_and_tools",
    "parse_tool_choice",
    "structural_tag",
    "template_tools",
    "tool_names",
]

Tool = Mapping[str, Any]


class ToolChoiceError(ValueError):
    """The request's ``tool_choice`` or ``tools`` do not fit together; the message says why."""


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None  # the forced function (mode "function")

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


AUTO = ToolChoice("auto")
NONE = ToolChoice("none")


def _fn(tool: Tool) -> Mapping[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, Mapping) else {}


def tool_names(tools: Sequence[Tool] | None) -> list[str]:
    return [str(_fn(t).get("name")) for t in tools or ()]


def parse_tool_choice(value: Any, tools: Sequence[Tool] | None) -> ToolChoice:
    """The typed ``tool_choice``; raises ToolChoiceError when it is malformed or names no given tool.
    Absent: ``auto`` with tools, ``none`` without (OpenAI's defaults)."""
    if value is None:
        return AUTO if tools else NONE
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolChoiceError("'tool_choice' must be 'none', 'auto', 'required' or a function object.")
        if value == "required" and not tools:
            raise ToolChoiceError("'tool_choice' is 'required' but no 'tools' were given.")
        return ToolChoice(value)  # type: ignore[arg-type]
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolChoiceError(
                "'tool_choice' as an object must be {'type': 'function', 'function': {'name': ...}}."
            )
        if name not in tool_names(tools):
            raise ToolChoiceError(f"'tool_choice' names the function {name!r}, which is not in 'tools'.")
        return ToolChoice("function", name)
    raise ToolChoiceError("'tool_choice' must be a string or a function object.")


def parse_choice_and_tools(
    value: Any, tools: list[dict[str, Any]] | None
) -> tuple[ToolChoice, list[dict[str, Any]] | None]:
    """``parse_tool_choice``, and OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" |
    "required", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}`` (``allowed_tools``):
    the choice and the tools the request goes on with."""
    if not (isinstance(value, dict) and value.get("type") == "allowed_tools"):
        return parse_tool_choice(value, tools), tools
    spec = value.get("allowed_tools")
    if not isinstance(spec, dict):
        raise ToolChoiceError(
            "'tool_choice' of type 'allowed_tools' needs 'allowed_tools': {'mode': 'auto' or 'required', "
            "'tools': [...]}."
        )
    return allowed_tools(spec.get("mode"), spec.get("tools"), tools, "tool_choice.allowed_tools", nested=True)


def allowed_tools(
    mode: Any, listed: Any, tools: list[dict[str, Any]] | None, where: str, *, nested: bool
) -> tuple[ToolChoice, list[dict[str, Any]]]:
    """An ``allowed_tools`` choice (``where``: its place in the request, for the errors): the model may
    call only the function tools ``listed`` names (each ``{"type": "function", "function": {"name"}}``
    when ``nested``, as Chat Completions writes them, else ``{"type": "function", "name"}``, as the
    Responses API does), under ``mode`` (``auto`` or ``required``). The request's tools are cut down to
    those: the prompt then shows the model only what it may call, as a named choice does, and
    ``required`` constrains the call array to them."""
    if mode not in ("auto", "required"):
        raise ToolChoiceError(f"'{where}.mode' must be 'auto' or 'required'.")
    if not isinstance(listed, list) or not listed:
        raise ToolChoiceError(f"'{where}.tools' must be a non-empty list of tools.")
    given = set(tool_names(tools))
    names: set[str] = set()
    for entry in listed:
        holder = entry.get("function") if nested and isinstance(entry, dict) else entry
        name = holder.get("name") if isinstance(holder, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("type", "function") != "function"
            or not isinstance(name, str)
        ):
            shape = (
                "{'type': 'function', 'function': {'name': ...}}"
                if nested
                else "{'type': 'function', 'name': ...}"
            )
            raise ToolChoiceError(
                f"each of '{where}.tools' must be {shape} (only function tools are served here)."
            )
        if name not in given:
            raise ToolChoiceError(f"'{where}' names the function {name!r}, which is not in 'tools'.")
        names.add(name)
    return ToolChoice(mode), [t for t in tools or () if _fn(t).get("name") in names]


def template_tools(tools: Sequence[Tool] | None, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools the chat template renders: all of them (``none`` included: vLLM's default), only the
    named one for a named choice; each as vLLM gives it (``_as_vllm_gives``)."""
    if not tools:
        return None
    if choice.mode == "function":
        return [_as_vllm_gives(t) for t in tools if _fn(t).get("name") == choice.name]
    return [_as_vllm_gives(t) for t in tools]


def _as_vllm_gives(tool: Tool) -> dict[str, Any]:
    """A tool as vLLM's server gives it to the template: its pydantic model dumped (``tojson`` and
    ``items()`` show key order). The keys in the model's order whatever the client's, ``description``
    and ``parameters`` null when absent, ``strict`` only when given, keys the model does not declare
    dropped; the ``parameters`` schema as sent (a plain dict there)."""
    fn = _fn(tool)
    out = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
    if fn.get("strict") is not None:
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def _parameters(tool: Tool) -> dict[str, Any]:
    params = _fn(tool).get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object", "properties": {}}


def _call_item_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [_fn(tool).get("name")]},
            "parameters": _parameters(tool),
        },
        "required": ["name", "parameters"],
    }


def _collect_defs(tools: Sequence[Tool]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for tool in tools:
        for key, schema in (_parameters(tool).get("$defs") or {}).items():
            if key in defs and defs[key] != schema:
                raise ToolChoiceError(f"tools define '$defs/{key}' differently; this cannot be constrained.")
            defs[key] = schema
    return defs


def call_array_schema(tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema a forced call is generated under (``required`` / named): an array of at least
    one ``{"name", "parameters"}`` object; at most one when ``parallel`` is false. ``$defs`` of the
    tools are lifted to the top so references resolve."""
    chosen = [t for t in tools if choice.mode != "function" or _fn(t).get("name") == choice.name]
    if not chosen:
        raise ToolChoiceError("no tool matches 'tool_choice'.")
    items = (
        _call_item_schema(chosen[0])
        if len(chosen) == 1
        else {"type": "object", "anyOf": [_call_item_schema(t) for t in chosen]}
    )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    defs = _collect_defs(chosen)
    if defs:
        schema["$defs"] = defs
    return schema


# ---- structural tags (tool_choice auto with strict tools) ----------------------------------------------

# family -> (begin, end, trigger) with NAME standing for the function name: the fixed text around a
# call's JSON arguments in that family's format (SGLang's detectors' ``structure_info``)
_STRUCTURE: Mapping[str, tuple[str, str, str]] = {
    "hermes": ('<tool_call>\n{"name": "NAME", "arguments": ', "}\n</tool_call>", "<tool_call>"),
    "llama3": ('<|python_tag|>{"name": "NAME", "arguments": ', "}", "<|python_tag|>"),
    "mistral": ('[TOOL_CALLS] [{"name": "NAME", "arguments": ', "}]", "[TOOL_CALLS]"),
    "deepseek_v3": (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n",
        "\n```<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>",
    ),
    "deepseek_v31": (
        "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>",
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>",
        "<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|>",
    ),
    "gpt_oss": (
        "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>",
        "<|call|>",
        "<|channel|>commentary to=",
    ),
}

STRUCTURAL_TAG_FAMILIES = frozenset(_STRUCTURE)


def is_strict(tool: Tool) -> bool:
    return _fn(tool).get("strict") is True


def structural_tag(family: str, tools: Sequence[Tool]) -> str | None:
    """The structural-tag constraint (JSON text) that holds every call's arguments of a ``strict``
    tool to its schema while leaving the model free to answer in text (``tool_choice: auto``); None
    when no tool is strict or the family's format has no fixed text around its arguments (the XML
    and Python-call formats)."""
    shape = _STRUCTURE.get(family)
    if shape is None or not any(is_strict(t) for t in tools):
        return None
    begin, end, trigger = shape
    structures = []
    for tool in tools:
        name = str(_fn(tool).get("name"))
        structures.append(
            {
                "begin": begin.replace("NAME", name),
                "schema": _parameters(tool) if is_strict(tool) else {},
                "end": end,
            }
        )
    tag = {"type": "structural_tag", "structures": structures, "triggers": [trigger]}
    return orjson.dumps(tag).decode()


# a tool's name: OpenAI's pattern (letters, digits, '_', '-'), with '.' and ':' too (namespaced MCP tools,
# which engines behind vLLM take) and Anthropic's 128 characters: never white space, quotes or the
# template's markers, which the name would carry into the prompt
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_.:-]{1,128}")


def check_tool_name(name: str, where: str, param: str) -> None:
    if _TOOL_NAME.fullmatch(name) is None:
        raise bad(
            f"Invalid '{where}': {name[:80]!r} does not match the pattern '^[a-zA-Z0-9_.:-]{{1,128}}$'.",
            param=param,
            code="invalid_value",
        )
