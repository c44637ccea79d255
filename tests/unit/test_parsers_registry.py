"""Parser registry: names and aliases, defaults by model name, thinking toggles from request kwargs,
and prompt-opened think blocks detected on prompts rendered by the real chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import pytest

from shepherd.parsers import (
    REASONING_FAMILIES,
    TOOL_FAMILIES,
    OutputParsers,
    TextDelta,
    ToolEvent,
    collect_tool_events,
    default_parsers_for_model,
    get_reasoning_parser,
    get_tool_parser,
    prompt_opens_think,
    run_reasoning,
    thinking_enabled,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"


def _render(template: str, **kwargs: Any) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    tpl = env.from_string((TEMPLATES / template).read_text())
    return tpl.render(
        messages=[{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="",
        raise_exception=raise_exception,
        strftime_now=lambda fmt: "2026-11-22",
        **kwargs,
    )


@pytest.mark.parametrize(
    ("family", "template", "kwargs", "opened"),
    [
        ("qwen3", "Qwen-Qwen3-0.6B.jinja", {}, False),
        ("qwen3", "Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, False),
        ("deepseek_v3", "deepseek-ai-DeepSeek-V3.1.jinja", {"thinking": True}, True),
        ("deepseek_v3", "deepseek-ai-DeepSeek-V3.1.jinja", {"thinking": False}, False),
        ("gpt_oss", "openai-gpt-oss-120b.jinja", {}, False),
    ],
)
def test_prompt_opens_think_on_real_templates(
    family: str, template: str, kwargs: dict[str, Any], opened: bool
) -> None:
    prompt = _render(template, **kwargs)
    assert prompt_opens_think(family, prompt) is opened


def test_deepseek_v31_thinking_round_trip() -> None:
    prompt = _render("deepseek-ai-DeepSeek-V3.1.jinja", thinking=True)
    p = get_reasoning_parser(
        "deepseek-v3",
        thinking_enabled=thinking_enabled("deepseek-v3", {"thinking": True}),
        prompt_opened_think=prompt_opens_think("deepseek-v3", prompt),
    )
    assert run_reasoning(p, ["2+2 is 4.", "</think>", "4"]) == ("2+2 is 4.", "4")


def test_thinking_kwargs_per_family() -> None:
    assert thinking_enabled("qwen3", None) is True
    assert thinking_enabled("qwen3", {"enable_thinking": False}) is False
    assert thinking_enabled("deepseek_v3", {}) is False
    assert thinking_enabled("deepseek_v3", {"thinking": True}) is True
    assert thinking_enabled("deepseek_v3", {"enable_thinking": True}) is True
    assert thinking_enabled("gpt-oss", {"enable_thinking": False}) is True
    assert thinking_enabled("cohere", {"reasoning": False}) is False


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("openai/gpt-oss-120b", ("gpt_oss", "gpt_oss")),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", ("deepseek_r1", "deepseek_v3")),
        ("deepseek-ai/DeepSeek-V3.1", ("deepseek_v3", "deepseek_v31")),
        ("deepseek-ai/DeepSeek-V3-0324", (None, "deepseek_v3")),
        ("Qwen/Qwen3-8B", ("qwen3", "hermes")),
        ("Qwen/Qwen3-235B-A22B-Thinking-2507", ("qwen3_thinking", "hermes")),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", (None, "qwen3_coder")),
        ("Qwen/QwQ-32B", ("qwen3_thinking", "hermes")),
        ("Qwen/Qwen2.5-7B-Instruct", (None, "hermes")),
        ("moonshotai/Kimi-K2-Instruct", (None, "kimi_k2")),
        ("zai-org/GLM-4.6", ("glm45", "glm45")),
        ("meta-llama/Llama-3.1-8B-Instruct", (None, "llama3")),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", (None, "pythonic")),
        ("mistralai/Mistral-Small-3.2-24B-Instruct-2506", (None, "mistral")),
        ("CohereLabs/command-a-reasoning-08-2025", ("cohere", "cohere")),
        ("some/unknown-model", (None, None)),
    ],
)
def test_defaults_by_model_name(model: str, expected: tuple[str | None, str | None]) -> None:
    assert default_parsers_for_model(model) == expected
    reasoning, tool = expected
    if reasoning:
        get_reasoning_parser(reasoning)
    if tool:
        get_tool_parser(tool)


def test_every_family_and_alias_builds_fresh_instances() -> None:
    for name in [*REASONING_FAMILIES, "deepseek-r1", "gpt-oss", "QwQ", "step3p5", "nemotron_3", "GLM-4.5"]:
        assert get_reasoning_parser(name) is not get_reasoning_parser(name)
    for name in [
        *TOOL_FAMILIES,
        "qwen",
        "qwen2.5",
        "llama4",
        "deepseek-v3.1",
        "kimi-k2",
        "harmony",
        "glm-4.6",
    ]:
        assert get_tool_parser(name) is not get_tool_parser(name)


@pytest.mark.parametrize(
    ("reasoning", "tool", "text"),
    [
        (
            "qwen3",
            "hermes",
            '<think>\nNeed the weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        (
            "gpt_oss",
            "gpt_oss",
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        ),
        (
            "cohere",
            "cohere",
            "<|START_THINKING|>Need the weather.<|END_THINKING|><|START_ACTION|>"
            '[{"tool_call_id": "0", "tool_name": "get_weather", '
            '"parameters": {"city": "Paris"}}]<|END_ACTION|>',
        ),
        (
            "kimi_k2",
            "kimi_k2",
            "<think>Need the weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
        ),
    ],
)
def test_reasoning_then_tool_pipeline(reasoning: str, tool: str, text: str) -> None:
    for chunks in ([text], list(text)):
        parsers = OutputParsers(get_reasoning_parser(reasoning), get_tool_parser(tool))
        reasoning_text = ""
        events: list[ToolEvent] = []
        for chunk in [*chunks, None]:
            r, evs = parsers.feed(chunk) if chunk is not None else parsers.finish()
            reasoning_text += r
            events.extend(evs)
        collected = collect_tool_events(events)
        assert reasoning_text.strip() == "Need the weather."
        assert collected.content in ("", "Checking.\n", "Checking.")
        assert [(c.name, json.loads(c.arguments)) for c in collected.calls] == [
            ("get_weather", {"city": "Paris"})
        ]


def test_output_parsers_without_parsers_pass_content_through() -> None:
    parsers = OutputParsers(None, None)
    assert parsers.feed("<think>x</think>") == ("", [TextDelta("<think>x</think>")])
    assert parsers.finish() == ("", [])
    only_reasoning = OutputParsers(get_reasoning_parser("qwen3"), None)
    assert only_reasoning.feed("<think>a</think>b") == ("a", [TextDelta("b")])
