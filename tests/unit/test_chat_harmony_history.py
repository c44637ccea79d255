"""A tool-calling history fed back through the real templates, as agent loops send it.

- gpt-oss: what the node's own answer holds (a preamble in ``content``, the analysis in
  ``reasoning_content``, several calls) renders as openai-harmony writes a conversation, as vLLM, SGLang
  and SMG render gpt-oss's prompt: one message per call, its arguments as written, each tool output as
  it is, named after its call; the preamble as the commentary message it came from, after the analysis
  (before: a 400 for content beside thinking, every call after the first lost, every output named after
  the last call and quoted, a preamble alone written as analysis);
- any template: a call's empty, blank or ``null`` arguments are ``{}`` (vLLM's
  ``_postprocess_messages``), never a broken ``"arguments": }`` in the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shepherd.tokens.chat_template import ChatTemplate
from shepherd.tokens.tokenizer import load_chat_templates

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def gpt_oss() -> ChatTemplate:
    return load_chat_templates(ASSETS / "tokenizers" / "gpt-oss")["default"]


def call(ident: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(answer: dict[str, Any], *outputs: tuple[str, str]) -> list[dict[str, Any]]:
    tools = [{"role": "tool", "tool_call_id": ident, "content": text} for ident, text in outputs]
    return [{"role": "user", "content": "Weather and time in Paris?"}, answer, *tools]


def after_user(text: str) -> str:
    return text[text.index("<|start|>user") :]


def test_gpt_oss_preamble_analysis_and_parallel_calls_render_as_harmony() -> None:
    answer = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Need weather and time.",
        "tool_calls": [call("c1", "get_weather", '{"city":"Paris"}'), call("c2", "get_time", '{"tz":"CET"}')],
    }
    text = gpt_oss().render(conversation(answer, ("c1", "sunny"), ("c2", '{"time": "10:00"}')))
    assert after_user(text) == (
        "<|start|>user<|message|>Weather and time in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need weather and time.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city":"Paris"}<|call|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz":"CET"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>{"time": "10:00"}<|end|>'
        "<|start|>assistant"
    )


def test_gpt_oss_outputs_answered_out_of_order_keep_their_calls_names() -> None:
    answer = {"role": "assistant", "tool_calls": [call("c1", "get_weather", {}), call("c2", "get_time", {})]}
    text = gpt_oss().render(conversation(answer, ("c2", "10:00"), ("c1", "sunny")))
    assert "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>10:00" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny" in text


def test_gpt_oss_analysis_of_a_finished_turn_is_dropped_and_its_preamble_kept() -> None:
    """As harmony drops a turn's analysis once a final answer followed it (the template's own rule)."""
    answer = {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "secret plan",
        "tool_calls": [call("c1", "get_weather", '{"city":"Paris"}')],
    }
    chat = [*conversation(answer, ("c1", "sunny")), {"role": "assistant", "content": "It is sunny."}]
    chat.append({"role": "user", "content": "Thanks"})
    text = gpt_oss().render(chat)
    assert "secret plan" not in text
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>It is sunny.<|end|>" in text


def test_gpt_oss_a_preamble_alone_is_commentary_kept_after_the_final_answer() -> None:
    answer = {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "get_weather", "{}")]}
    chat = [*conversation(answer, ("c1", "sunny")), {"role": "assistant", "content": "Sunny."}]
    text = gpt_oss().render([*chat, {"role": "user", "content": "ok"}])
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" in text
    assert "<|channel|>analysis<|message|>Checking." not in text


def test_gpt_oss_object_arguments_are_written_as_json_text() -> None:
    answer = {"role": "assistant", "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]}
    text = gpt_oss().render(conversation(answer, ("c1", "sunny")))
    assert 'commentary json<|message|>{"city": "Paris"}<|call|>' in text


@pytest.mark.parametrize("arguments", ["", "  ", None, "null"])
@pytest.mark.parametrize(
    ("template", "want"),
    [
        ("Qwen-Qwen3-0.6B.jinja", '"arguments": {}'),
        ("openai-gpt-oss-120b.jinja", "json<|message|>{}<|call|>"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "get_time<｜tool▁sep｜>{}"),
    ],
)
def test_empty_or_null_arguments_render_as_an_empty_object(arguments: Any, template: str, want: str) -> None:
    tpl = ChatTemplate.from_file(ASSETS / "chat_templates" / template)
    answer = {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_time", arguments)]}
    text = tpl.render(conversation(answer, ("c1", "10:00")))
    assert want in text, text


def test_a_tool_output_whose_call_id_is_no_string_renders_or_is_a_template_error() -> None:
    """(A legacy ``function`` message's id is not checked as a tool message's: it must not crash.)"""
    answer = {"role": "assistant", "tool_calls": [call("c1", "get_weather", {})]}
    chat = [*conversation(answer), {"role": "tool", "tool_call_id": {"a": 1}, "content": "x"}]
    assert "to=assistant<|channel|>commentary<|message|>x" in gpt_oss().render(chat)
