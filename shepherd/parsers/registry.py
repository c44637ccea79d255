"""Parser families by name, and the default families for a model name.

``get_reasoning_parser`` / ``get_tool_parser`` build a FRESH parser each call: call them once per
request (per choice). Names ignore case and punctuation (``deepseek-r1`` == ``deepseek_r1``,
``glm-4.5`` == ``glm45``); common aliases (``qwen``, ``qwen2.5``, ``llama4``, ``harmony`` ...) are
accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shepherd.parsers.events import ReasoningParser, ToolParser
from shepherd.parsers.harmony import HarmonyReasoningParser
from shepherd.parsers.reasoning import ThinkSpec, ThinkTagReasoningParser
from shepherd.parsers.tool_common import IdFactory, ParamTypes, param_types
from shepherd.parsers.tool_delimited import DelimitedSpec, DelimitedToolParser
from shepherd.parsers.tool_formats import (
    COHERE,
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    DEEPSEEK_V32,
    GLM45,
    GPT_OSS,
    HERMES,
    KIMI_K2,
    MINIMAX_M2,
    QWEN3_CODER,
)
from shepherd.parsers.tool_leading import JSON, LLAMA3, PYTHONIC, LeadingSpec, LeadingValueToolParser
from shepherd.parsers.tool_mistral import MistralToolParser

__all__ = [
    "OFF",
    "REASONING_FAMILIES",
    "TOOL_FAMILIES",
    "ReasoningFamily",
    "default_parsers_for_model",
    "get_reasoning_parser",
    "get_tool_parser",
    "prompt_closes_think",
    "prompt_opens_think",
    "reasoning_family_name",
    "thinking_enabled",
    "tool_family_name",
]


@dataclass(frozen=True, slots=True)
class ReasoningFamily:
    """``spec`` None: the harmony (gpt-oss) parser. ``thinking_kwarg``: the chat-template kwarg that
    toggles thinking, and ``thinking_default`` its value when the request does not set it."""

    spec: ThinkSpec | None
    thinking_kwarg: str = "enable_thinking"
    thinking_default: bool = True


_THINK = ThinkSpec()
_QWEN_TOOL = ("<tool_call>",)
# what follows a Qwen-style ``<tool_call>`` opener in a call: hermes' JSON object, qwen3_coder's function
_QWEN_CALL = ("{", "<function=")

REASONING_FAMILIES: Mapping[str, ReasoningFamily] = {
    "deepseek_r1": ReasoningFamily(ThinkSpec(forced=True)),
    "qwen3": ReasoningFamily(ThinkSpec(tool_end=_QWEN_TOOL, tool_next=_QWEN_CALL)),
    "qwen3_thinking": ReasoningFamily(ThinkSpec(forced=True, tool_end=_QWEN_TOOL, tool_next=_QWEN_CALL)),
    "kimi": ReasoningFamily(ThinkSpec(start="◁think▷", end="◁/think▷")),
    "kimi_k2": ReasoningFamily(ThinkSpec(tool_end=("<|tool_calls_section_begin|>",))),
    "glm45": ReasoningFamily(ThinkSpec(tool_end=_QWEN_TOOL)),
    "gpt_oss": ReasoningFamily(None, thinking_kwarg=""),
    "deepseek_v3": ReasoningFamily(_THINK, thinking_kwarg="thinking", thinking_default=False),
    "minimax": ReasoningFamily(ThinkSpec(forced=True)),
    "step3": ReasoningFamily(ThinkSpec(forced=True)),
    "cohere": ReasoningFamily(
        ThinkSpec(
            start="<|START_THINKING|>",
            end="<|END_THINKING|>",
            implicit_end=("<|START_TEXT|>",),
            tool_end=("<|START_ACTION|>",),
            content_drop=("<|START_TEXT|>", "<|END_TEXT|>"),
        ),
        thinking_kwarg="reasoning",
    ),
    "nemotron": ReasoningFamily(ThinkSpec(tool_end=_QWEN_TOOL, tool_next=_QWEN_CALL)),
}

_REASONING_ALIASES = {
    "qwq": "qwen3_thinking",
    "deepseek_v31": "deepseek_v3",
    "deepseek_v32": "deepseek_v3",
    "minimax_m2": "minimax",
    "step3p5": "step3",
    "cohere_command4": "cohere",
    "command_a": "cohere",
    "nemotron_3": "nemotron",
    "nemotron_nano": "nemotron",
    # SMG's names (its --reasoning-parser)
    "glm": "glm45",
    "glm4": "glm45",
    "kimi_thinking": "kimi_k2",
    "kimi_k25": "kimi_k2",
}

# (id factory, parameter types, known names, partial calls) -> a fresh parser
_ToolFactory = Callable[[IdFactory | None, ParamTypes, Collection[str] | None, bool], ToolParser]


def _delimited(spec: DelimitedSpec) -> _ToolFactory:
    return lambda ids, types, names, partial: DelimitedToolParser(
        spec, id_factory=ids, types=types, names=names, partial_calls=partial
    )


def _leading(spec: LeadingSpec) -> _ToolFactory:
    return lambda ids, types, names, partial: LeadingValueToolParser(
        spec, id_factory=ids, types=types, names=names, partial_calls=partial
    )


TOOL_FAMILIES: Mapping[str, _ToolFactory] = {
    "hermes": _delimited(HERMES),
    "llama3": _leading(LLAMA3),
    "mistral": lambda ids, types, names, _: MistralToolParser(id_factory=ids, types=types, names=names),
    "qwen3_coder": _delimited(QWEN3_CODER),
    "deepseek_v3": _delimited(DEEPSEEK_V3),
    "deepseek_v31": _delimited(DEEPSEEK_V31),
    "deepseek_v32": _delimited(DEEPSEEK_V32),
    "minimax_m2": _delimited(MINIMAX_M2),
    "kimi_k2": _delimited(KIMI_K2),
    "glm45": _delimited(GLM45),
    "gpt_oss": _delimited(GPT_OSS),
    "pythonic": _leading(PYTHONIC),
    "json": _leading(JSON),
    "cohere": _delimited(COHERE),
}

_TOOL_ALIASES = {
    "qwen": "hermes",
    "qwen25": "hermes",
    "qwen3": "hermes",
    "llama": "llama3",
    "llama31": "llama3",
    "llama32": "llama3",
    "llama4": "pythonic",
    "deepseek_r1": "deepseek_v3",
    "minimax": "minimax_m2",
    "glm": "glm45",
    "glm46": "glm45",
    "glm47": "glm45",
    "harmony": "gpt_oss",
    "kimi": "kimi_k2",
    "command_a": "cohere",
    "cohere_command4": "cohere",
    # SMG's names (its --tool-call-parser)
    "deepseek": "deepseek_v3",
    "deepseek31": "deepseek_v31",
    "deepseek32": "deepseek_v32",
    "glm4": "glm45",
    "glm45_moe": "glm45",
    "glm47_moe": "glm45",
    "qwen_coder": "qwen3_coder",
    "qwen_xml": "qwen3_coder",
}

# names that turn a parser off: ours, and SMG's parsers that pass the text through
OFF = frozenset({"none", "passthrough", "plain"})


@functools.lru_cache(maxsize=256)
def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _index(families: Mapping[str, object], aliases: Mapping[str, str]) -> dict[str, str]:
    index = {_norm(k): k for k in families}
    index.update({_norm(k): v for k, v in aliases.items()})
    return index


_REASONING_INDEX = _index(REASONING_FAMILIES, _REASONING_ALIASES)
_TOOL_INDEX = _index(TOOL_FAMILIES, _TOOL_ALIASES)


@functools.lru_cache(maxsize=256)  # a request names its model's family: a handful of distinct names
def _reasoning_family(name: str) -> tuple[str, ReasoningFamily]:
    key = _REASONING_INDEX.get(_norm(name), "")
    family = REASONING_FAMILIES.get(key)
    if family is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_FAMILIES))}")
    return key, family


def get_reasoning_parser(
    name: str, *, thinking_enabled: bool = True, prompt_opened_think: bool = False, tool_calls: bool = True
) -> ReasoningParser:
    """A fresh reasoning parser. ``thinking_enabled=False`` passes all text through as content;
    ``prompt_opened_think``: the rendered prompt ends inside an open think block
    (see ``prompt_opens_think``); ``tool_calls``: the request's tool calls are parsed (a tool-call
    opener may then end the think block, see ``ThinkSpec.tool_end``). Raises ValueError for an unknown
    name."""
    _, family = _reasoning_family(name)
    if family.spec is None:
        return HarmonyReasoningParser(
            thinking_enabled=thinking_enabled, prompt_opened_think=prompt_opened_think, tool_calls=tool_calls
        )
    return ThinkTagReasoningParser(
        family.spec,
        thinking_enabled=thinking_enabled,
        prompt_opened_think=prompt_opened_think,
        tool_calls=tool_calls,
    )


def thinking_enabled(name: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request thinks, from its ``chat_template_kwargs`` (``enable_thinking`` for Qwen3,
    GLM, Nemotron; ``thinking`` for DeepSeek V3.x, off unless asked; ``reasoning`` for Cohere)."""
    _, family = _reasoning_family(name)
    if not family.thinking_kwarg:
        return True
    value = (chat_template_kwargs or {}).get(family.thinking_kwarg)
    if value is None and family.thinking_kwarg == "thinking":
        value = (chat_template_kwargs or {}).get("enable_thinking")
    return family.thinking_default if value is None else bool(value)


def prompt_opens_think(name: str, prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open think block: its last start marker is not
    followed by an end marker (templates that append ``<think>`` to the generation prompt).
    Pass the result as ``prompt_opened_think``."""
    _, family = _reasoning_family(name)
    spec = family.spec
    if spec is None:
        return False
    tail = prompt[-4096:]
    start = tail.rfind(spec.start)
    return start != -1 and tail.find(spec.end, start) == -1


def prompt_closes_think(name: str, prompt: str) -> bool:
    """Whether the rendered prompt ends with an empty, closed think block (``<think>\n\n</think>``):
    the template turned thinking off (``enable_thinking: false``), so the output is all content."""
    _, family = _reasoning_family(name)
    spec = family.spec
    if spec is None:
        return False
    tail = prompt[-256:].rstrip()
    if not tail.endswith(spec.end):
        return False
    start = tail.rfind(spec.start)
    return start != -1 and not tail[start + len(spec.start) : -len(spec.end)].strip()


def get_tool_parser(
    name: str,
    *,
    id_factory: IdFactory | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    known_names_only: bool = False,
    partial_calls: bool = False,
) -> ToolParser:
    """A fresh tool parser. ``tools``: the request's tool definitions (OpenAI shape), used by the
    XML-style families (qwen3_coder, glm45) to type parameter values. ``known_names_only``: a call
    to a tool that is not in ``tools`` is not a call (returned as text, raw). ``id_factory`` makes
    call ids (default: ``call_`` + 24 hex digits; 9 alphanumerics for mistral). ``partial_calls``: a
    call of a JSON family (hermes, json, llama3) cut off by the end of the output is a partial call
    (``ToolParser``), not text. Raises ValueError."""
    factory = TOOL_FAMILIES.get(_TOOL_INDEX.get(_norm(name), ""))
    if factory is None:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_FAMILIES))}")
    types = param_types(tools)
    return factory(id_factory, types, frozenset(types) if known_names_only else None, partial_calls)


def reasoning_family_name(name: str) -> str:
    """The canonical reasoning family for a name or alias. Raises ValueError."""
    return _reasoning_family(name)[0]


def tool_family_name(name: str) -> str:
    """The canonical tool-call family for a name or alias. Raises ValueError."""
    key = _TOOL_INDEX.get(_norm(name), "")
    if key not in TOOL_FAMILIES:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_FAMILIES))}")
    return key


# (substring of the lowercased model name, reasoning family, tool family); first match wins
_MODEL_DEFAULTS: tuple[tuple[str, str | None, str | None], ...] = (
    ("gpt-oss", "gpt_oss", "gpt_oss"),
    ("deepseek-r1", "deepseek_r1", "deepseek_v3"),
    ("deepseek-v3.1", "deepseek_v3", "deepseek_v31"),
    ("deepseek-v3.2", "deepseek_v3", "deepseek_v32"),
    ("deepseek-v3", None, "deepseek_v3"),
    ("qwen3-coder", None, "qwen3_coder"),
    ("qwen3.5", "qwen3", "qwen3_coder"),
    ("qwen3-next", "qwen3", "hermes"),
    ("thinking-2507", "qwen3_thinking", "hermes"),
    ("qwq", "qwen3_thinking", "hermes"),
    ("qwen3", "qwen3", "hermes"),
    ("qwen", None, "hermes"),
    ("kimi-k2-thinking", "kimi_k2", "kimi_k2"),
    ("kimi-k2", None, "kimi_k2"),
    ("kimi", "kimi", None),
    ("glm-4.5", "glm45", "glm45"),
    ("glm-4.6", "glm45", "glm45"),
    ("glm-4.7", "glm45", "glm45"),
    ("minimax-m2", "minimax", "minimax_m2"),
    ("minimax", "minimax", None),
    ("step3", "step3", None),
    ("step-3", "step3", None),
    ("command-a-reasoning", "cohere", "cohere"),
    ("command-a", None, "cohere"),
    ("command-r7b", None, "cohere"),
    ("nemotron-3", "nemotron", "qwen3_coder"),
    ("nemotron", "nemotron", None),
    ("hermes", None, "hermes"),  # (before llama: Hermes-3-Llama-3.1 speaks hermes)
    ("llama-4", None, "pythonic"),
    ("llama4", None, "pythonic"),
    ("llama-3", None, "llama3"),
    ("llama3", None, "llama3"),
    ("devstral", None, "mistral"),
    ("magistral", None, "mistral"),
    ("mistral", None, "mistral"),
    ("ministral", None, "mistral"),
)


def default_parsers_for_model(model: str) -> tuple[str | None, str | None]:
    """``(reasoning family, tool family)`` for a model name or path (``None``: no parser)."""
    lowered = model.lower()
    for needle, reasoning, tool in _MODEL_DEFAULTS:
        if needle in lowered:
            return reasoning, tool
    return None, None
