"""shape_chat's short path (no tools, no response format) gives what the general path gives."""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.node.openai.requests import parse_chat
from shepherd.node.output.chat import _shape_tools, reasoning_side, shape_chat

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
    reasoning, opened = reasoning_side(families[0], req, prompt)
    assert shape_chat(families, req, prompt) == _shape_tools(families[1], req, reasoning, opened)


def test_reasoning_side() -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reasoning_side("qwen3", req, PROMPTS[0]) == ("qwen3", False)
    assert reasoning_side("qwen3", req, PROMPTS[1]) == ("qwen3", True)
    assert reasoning_side("qwen3", req, PROMPTS[2]) == (None, False)  # the template closed it
    assert reasoning_side(None, req, PROMPTS[1]) == (None, False)
    off = parse_chat({**req.raw, "separate_reasoning": False})
    assert reasoning_side("qwen3", off, PROMPTS[1]) == (None, False)
