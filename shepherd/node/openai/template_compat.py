"""What a chat template is told about request fields it does not name itself: the ``developer`` role
and ``reasoning_effort``, read off the template's source.

- ``developer`` messages (OpenAI's newer name for system instructions) are given to the template as
  ``system`` messages when its source never names the role ``"developer"`` as a string (most open
  models' templates: they would drop the message or render an unknown role); a template that names the
  role gets them as sent.
- a message's content sent as several text parts goes to a template that iterates over a message's
  content (vLLM's "openai" content format, found as vLLM finds it: a ``for`` over ``message.content``
  of a ``for`` over ``messages``) as those parts, ``{"type": "text", "text": ...}``: the template joins
  them (most with nothing between), where others get them joined by "\n" (vLLM's "string" format).
- ``reasoning_effort`` (``none``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``) goes to the
  template's thinking switch: as ``reasoning_effort`` when the template reads that variable (gpt-oss,
  Cohere); else ``enable_thinking`` (Qwen3, GLM, DeepSeek V3.1, Nemotron) and/or ``thinking`` (DeepSeek
  V3.1), true unless the effort is ``none``. A template with no switch: a 400 naming the field.
  ``chat_template_kwargs`` the request sets itself win over what the effort maps to.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jinja2
import jinja2.nodes as jn

from shepherd.proto.openai_errors import bad
from shepherd.tokens.chat_env import make_environment

__all__ = ["REASONING_EFFORTS", "effort_kwargs", "map_developer", "template_names", "with_text_parts"]

REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
_THINKING_VAR = re.compile(r"(?<![\w.])thinking\s+is\s+(?:not\s+)?defined")
# the role as a string literal (``message.role == "developer"``), not a variable that merely contains
# the word (Cohere's ``developer_instruction`` template has no developer role: it drops such messages)
_DEVELOPER_ROLE = re.compile(r"""["']developer["']""")


@functools.lru_cache(maxsize=64)
def template_names(source: str) -> frozenset[str]:
    """Which of the names this module cares about the template's source mentions (cached per source:
    a str caches its hash, so a hit costs an identity check)."""
    out = set()
    if _DEVELOPER_ROLE.search(source):
        out.add("developer")
    if "reasoning_effort" in source:
        out.add("reasoning_effort")
    if "enable_thinking" in source:
        out.add("enable_thinking")
    if _THINKING_VAR.search(source):
        out.add("thinking")
    if "content" in source and _iterates_content(source):
        out.add("content_parts")
    return frozenset(out)


def _reads(node: jn.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads variable ``name`` (``name[key]`` / ``name.key`` with a key), through filters,
    tests and slices (vLLM's ``_is_var_or_elems_access``)."""
    if isinstance(node, jn.Filter | jn.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jn.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jn.Getitem):
        return _reads(node.node, name) and isinstance(node.arg, jn.Const) and node.arg.value == key
    return isinstance(node, jn.Getattr) and _reads(node.node, name) and node.attr == key


def _aliases(root: jn.Template, name: str) -> Iterator[str]:
    """``name`` and the variables ``{% set %}`` from it, transitively."""
    yield name
    todo, seen = [name], {name}
    while todo:
        current = todo.pop()
        for assign in root.find_all(jn.Assign):
            target = assign.target
            if isinstance(target, jn.Name) and target.name not in seen and _reads(assign.node, current):
                seen.add(target.name)
                todo.append(target.name)
                yield target.name


def _loop_targets(root: jn.Template, names: list[str], key: str | None = None) -> Iterator[jn.For]:
    for loop in root.find_all(jn.For):
        if any(_reads(loop.iter, n, key) for n in names):
            yield loop


def _iterates_content(source: str) -> bool:
    """vLLM's detection of the "openai" content format (``_detect_content_format``): a ``for`` over a
    message's ``content`` inside a template's ``for`` over its messages."""
    try:
        root = make_environment().parse(source)
    except jinja2.TemplateError:
        return False
    messages = list(_aliases(root, "messages"))
    items = [t.name for loop in _loop_targets(root, messages) if isinstance(t := loop.target, jn.Name)]
    return next(_loop_targets(root, items, "content"), None) is not None


def with_text_parts(
    messages: list[dict[str, Any]], parts: Mapping[int, list[dict[str, str]]], names: frozenset[str]
) -> list[dict[str, Any]]:
    """``messages`` with the contents that came as several text parts given as those parts when the
    template iterates over a message's content (the list itself when nothing changes)."""
    if "content_parts" not in names or not parts:
        return messages
    return [{**m, "content": parts[i]} if i in parts else m for i, m in enumerate(messages)]


def map_developer(messages: list[dict[str, Any]], names: frozenset[str]) -> list[dict[str, Any]]:
    """``messages`` with ``developer`` turned into ``system`` unless the template knows the role (the
    list itself when nothing changes)."""
    if "developer" in names or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def effort_kwargs(
    effort: str, names: frozenset[str], kwargs: Mapping[str, Any], required: bool = True
) -> dict[str, Any]:
    """The template kwargs with ``reasoning_effort`` mapped to the template's switch (``kwargs`` the
    request gave win); a 400 naming the field when the template has none (``required``; else the effort
    is a hint the model cannot take: ignored)."""
    mapped: dict[str, Any] = {}
    if "reasoning_effort" in names:
        mapped["reasoning_effort"] = effort
    else:
        if "enable_thinking" in names:
            mapped["enable_thinking"] = effort != "none"
        if "thinking" in names:
            mapped["thinking"] = effort != "none"
    if not mapped and not required:
        return dict(kwargs)
    if not mapped:
        msg = (
            "'reasoning_effort' cannot be honoured: this model's chat template has no thinking switch "
            "(reasoning_effort, enable_thinking or thinking)."
        )
        raise bad(msg, param="reasoning_effort", code="unsupported_parameter")
    mapped.update(kwargs)
    return mapped
