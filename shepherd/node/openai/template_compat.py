"""What a chat template is told about request fields it does not name itself: the ``developer`` role
and ``reasoning_effort``, read off the template's source.

- ``developer`` messages (OpenAI's newer name for system instructions) are given to the template as
  ``system`` messages when its source never names the role ``"developer"`` as a string (most open
  models' templates: they would drop the message or render an unknown role); a template that names the
  role gets them as sent.
- ``reasoning_effort`` (``none``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``) goes to the
  template's thinking switch: as ``reasoning_effort`` when the template reads that variable (gpt-oss,
  Cohere); else ``enable_thinking`` (Qwen3, GLM, DeepSeek V3.1, Nemotron) and/or ``thinking`` (DeepSeek
  V3.1), true unless the effort is ``none``. A template with no switch: a 400 naming the field.
  ``chat_template_kwargs`` the request sets itself win over what the effort maps to.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from shepherd.proto.openai_errors import bad

__all__ = ["REASONING_EFFORTS", "effort_kwargs", "map_developer", "template_names"]

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
    return frozenset(out)


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
