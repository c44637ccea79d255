"""The prompt chat completions renders (``render_chat``: request parsing, the template's compatibility
mapping, the template, its skeleton cache) against what vLLM's server renders for the same request
(vllm/entrypoints/chat_utils.py): text parts joined by the template that iterates over them, tool-call
arguments given to the template as objects, tools given as vLLM's pydantic models dump them, and no 500
from a skeleton of an earlier conversation; gpt-oss's tools as openai-harmony writes them (vLLM's
renderer for it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from shepherd.node.api.openai import render_chat
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.openai.requests import parse_chat
from shepherd.tokens.service import TokenizerService

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"
TEMPLATES = ROOT / "tests" / "assets" / "chat_templates"
FILES = {
    "glm": "GLM-4.6.jinja",
    "cohere": "Cohere2MoE.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "llama": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
}
PARTS = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]


@asynccontextmanager
async def gateway(models: tuple[str, ...]) -> AsyncIterator[Gateway]:
    """A gateway stand-in rendering ``models`` (each a FILES template over the qwen3 tokenizer)."""
    svc = TokenizerService(
        dict.fromkeys(models, QWEN3), workers=0, chat_templates={m: TEMPLATES / FILES[m] for m in models}
    )
    await svc.start()
    try:
        yield cast(
            Gateway,
            SimpleNamespace(tokenizers=svc, tokenizer=svc.get, check_prompt_chars=lambda *a, **k: None),
        )
    finally:
        await svc.close()


@pytest.fixture()
async def gw() -> AsyncIterator[Gateway]:
    async with gateway(("glm", "cohere", "qwen3")) as g:
        yield g


@pytest.fixture()
async def tools_gw() -> AsyncIterator[Gateway]:
    async with gateway(("qwen3", "llama", "gpt-oss")) as g:
        yield g


async def render(gw: Gateway, model: str, messages: list[Any], **kw: Any) -> str:
    text, ids = await render_chat(gw, model, parse_chat({"model": model, "messages": messages, **kw}))
    assert ids == gw.tokenizer(model).hf.encode(text, add_special_tokens=False).ids
    return text


async def test_text_parts_are_joined_by_a_template_that_iterates_over_them(gw: Gateway) -> None:
    """GLM-4.6 loops over a message's content (vLLM's "openai" content format): the parts reach it as a
    list and it writes them one after the other; Qwen3 reads the content as a string (vLLM's "string"
    format): the parts joined by a newline. A tool result's parts are joined for every template."""
    assert "<|user|>\nPart one.Part two.<|assistant|>" in await render(
        gw, "glm", [{"role": "user", "content": PARTS}]
    )
    assert "<|im_start|>user\nPart one.\nPart two.<|im_end|>" in await render(
        gw, "qwen3", [{"role": "user", "content": PARTS}]
    )
    history = [
        {"role": "user", "content": PARTS},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": PARTS},
    ]
    got = await render(gw, "glm", history, tools=TOOLS)
    assert "<|user|>\nPart one.Part two.<|assistant|>" in got
    assert "<tool_response>\nPart one.\nPart two.\n</tool_response>" in got
    # continued from the last part, as vLLM tags it
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PARTS}]
    got = await render(gw, "glm", prefill, add_generation_prompt=False, continue_final_message=True)
    assert got.endswith("Part one.Part two.")


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_string_arguments_are_rendered_as_the_object_they_hold(gw: Gateway) -> None:
    """Qwen3's template prints a string as it is and an object through tojson; vLLM parses the string
    first, so compact JSON from a client renders as tojson spaces it."""
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    got = await render(gw, "qwen3", history, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in got


async def test_an_empty_assistant_text_after_a_skeleton_of_its_shape_renders(gw: Gateway) -> None:
    """Cohere2's ``message.content and message.content[0].type == "thinking"``: the skeleton of a chat with
    an assistant text reads ``content[0]``, which an empty text of the same shape does not have (an
    IndexError: a 500 until the skeleton left the cache)."""
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    first = await render(gw, "cohere", turns)
    turns[1]["content"] = ""
    got = await render(gw, "cohere", turns)
    assert got == first.replace("hello", "") != first


# a tool as a client may send it: keys in its own order, keys no model declares, no description
ODD_TOOL = {
    "function": {
        "parameters": {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"},
        "x-vendor": {"cache": True},
        "name": "get_weather",
    },
    "type": "function",
    "metadata": {"owner": "me"},
}
# what vLLM's template gets for it: ``ChatCompletionToolsParam(**ODD_TOOL).model_dump()`` (the models'
# key order, description and parameters null when absent, undeclared keys dropped, the schema as sent)
VLLM_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": None,
        "parameters": {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"},
    },
}


async def test_tools_reach_the_template_as_vllm_dumps_them(tools_gw: Gateway) -> None:
    """Qwen3 (hermes style) and Llama 3.1 print each tool with ``tojson``: the keys show in the order the
    template got them, so a client's order, its extra keys or a missing description would show too."""
    chat = [{"role": "user", "content": "Weather?"}]
    got = await render(tools_gw, "qwen3", chat, tools=[ODD_TOOL])
    assert "<tools>\n" + json.dumps(VLLM_TOOL, ensure_ascii=False) + "\n</tools>" in got
    got = await render(tools_gw, "llama", chat, tools=[ODD_TOOL])
    assert "\n\n" + json.dumps(VLLM_TOOL, indent=4) + "\n\nWeather?<|eot_id|>" in got
    strict = {"type": "function", "function": {"strict": True, "name": "f", "description": "d"}}
    got = await render(tools_gw, "qwen3", chat, tools=[strict])
    expected = {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": None, "strict": True},
    }
    assert json.dumps(expected) in got


def _functions_namespace(prompt: str) -> str:
    start = prompt.index("## functions")
    return prompt[start : prompt.index("<|end|>", start)]


async def test_gpt_oss_tools_are_written_as_harmony_writes_them(tools_gw: Gateway) -> None:
    """vLLM renders gpt-oss's prompt with openai-harmony (``ToolDescription.new(name, description or "",
    parameters)``): a comment line per line of the description, none without one; no parameters take
    none, an object without properties (a no-argument MCP tool) and an empty schema are a parameter."""
    tools = [
        {"type": "function", "function": {"name": "ping"}},
        {
            "type": "function",
            "function": {"name": "now", "description": "The time.\nIn UTC.\n", "parameters": {}},
        },
        {
            "type": "function",
            "function": {"name": "list", "parameters": {"type": "object", "properties": {}}},
        },
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "A city"}},
                    "required": ["city"],
                },
            },
        },
    ]
    got = await render(tools_gw, "gpt-oss", [{"role": "user", "content": "hi"}], tools=tools)
    assert _functions_namespace(got) == (
        "## functions\n\nnamespace functions {\n\n"
        "type ping = () => any;\n\n"
        "// The time.\n// In UTC.\ntype now = (_: any) => any;\n\n"
        "type list = (_: {\n}) => any;\n\n"
        "// Weather.\ntype get_weather = (_: {\n// A city\ncity: string,\n}) => any;\n\n"
        "} // namespace functions"
    )
