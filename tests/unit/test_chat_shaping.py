"""shape_chat's short path (no tools, no response format) gives what the general path gives."""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.node.chat_output import _shape_tools, shape_chat
from shepherd.node.openai_protocol import parse_chat
from shepherd.node.parsers.registry import prompt_closes_think, prompt_opens_think, thinking_enabled

PROMPTS = (
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)


@pytest.mark.parametrize(
    "families", [(None, None), ("qwen3", "qwen25"), ("deepseek_r1", None), ("gpt_oss", "gpt_oss")]
)
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"thinking": True}])
@pytest.mark.parametrize(
    "extra", [{}, {"separate_reasoning": False}, {"parallel_tool_calls": False}, {"tools": []}]
)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_short_path_equals_general(
    families: tuple[str | None, str | None], kwargs: dict[str, Any] | None, extra: dict[str, Any], prompt: str
) -> None:
    d: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    if kwargs is not None:
        d["chat_template_kwargs"] = kwargs
    req = parse_chat(d)
    family = families[0]
    reasoning = None
    opened = False
    if (
        family
        and req.separate_reasoning
        and thinking_enabled(family, req.template_kwargs)
        and not prompt_closes_think(family, prompt)
    ):
        reasoning, opened = family, prompt_opens_think(family, prompt)
    assert shape_chat(families, req, prompt) == _shape_tools(families[1], req, reasoning, opened)
