"""vLLM / SGLang request fields parsed (guided.py, requests.py) and mapped to a template
(template_compat.py); the end-to-end view is tests/e2e/test_node_vllm_fields.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shepherd.node.openai.requests import parse_chat, parse_completion
from shepherd.node.openai.structured import Constraint
from shepherd.node.openai.template_compat import effort_kwargs, map_developer, template_names
from shepherd.proto.openai_errors import ApiError

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **kw}


def test_guided_fields_become_one_constraint() -> None:
    assert parse_chat(chat(guided_regex="a+")).guided == Constraint("regex", "a+")
    r = parse_chat(chat(guided_json='{"type": "object"}'))
    assert (r.guided, r.guided_param) == (Constraint("json_schema", '{"type":"object"}'), "guided_json")
    assert parse_chat(chat(structured_outputs={"choice": ["a"]})).guided == Constraint("choice", '["a"]')
    assert parse_chat(chat(structured_outputs={"json_object": False})).guided is None
    assert parse_chat(chat(ebnf="root ::= 'a'")).guided == Constraint("ebnf", "root ::= 'a'")
    # a response_format of type text constrains nothing: no conflict
    assert parse_chat(chat(regex="a", response_format={"type": "text"})).guided == Constraint("regex", "a")
    assert parse_completion({"model": "m", "prompt": "x", "guided_grammar": "g"}).constraint == Constraint(
        "ebnf", "g"
    )
    rf = {"type": "json_object"}
    assert parse_completion({"model": "m", "prompt": "x", "response_format": rf}).constraint == Constraint(
        "json_schema", '{"type":"object"}'
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(guided_regex="a", ebnf="b"), "ebnf"),
        (chat(guided_choice=[]), "guided_choice"),
        (chat(guided_choice=["a", 1]), "guided_choice"),
        (chat(guided_regex=""), "guided_regex"),
        (chat(guided_json=[1]), "guided_json"),
        (chat(guided_json={"type": "nope"}), "guided_json"),
        (chat(structured_outputs="regex"), "structured_outputs"),
        (chat(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
        (chat(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
        (chat(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
        (chat(json_schema="{}", response_format={"type": "json_object"}), "json_schema"),
        (chat(reasoning_effort="max"), "reasoning_effort"),
        (chat(functions={"name": "f"}), "functions"),
        (chat(functions=[{"name": "f"}], function_call="f"), "function_call"),
        (chat(functions=[{"name": "f"}], tools=[]), "functions"),
        (chat(model=3), "model"),
        ({"model": "m", "prompt": "x", "guided_choice": "a"}, "guided_choice"),
    ],
)
def test_bad_fields_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    parse = parse_completion if "prompt" in body else parse_chat
    with pytest.raises(ApiError) as ei:
        parse(body)
    assert ei.value.status == 400 and ei.value.param == param


def test_legacy_functions_become_tools() -> None:
    fn = {"name": "f", "parameters": {"type": "object"}}
    r = parse_chat(chat(functions=[fn], function_call={"name": "f"}))
    assert r.tools == [{"type": "function", "function": fn}] and r.legacy_functions
    assert r.tool_choice.name == "f" and r.parallel_tool_calls is False
    assert parse_chat(chat(functions=[fn], function_call="none")).tool_choice.mode == "none"
    assert not parse_chat(chat(tools=[{"type": "function", "function": fn}])).legacy_functions
    history = [
        *MSG,
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "42"},
    ]
    msgs = parse_chat({"model": "m", "messages": history, "functions": [fn]}).messages
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert msgs[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert msgs[2] == {"role": "tool", "name": "f", "content": "42", "tool_call_id": "call_1"}
    # a legacy history in a request without 'functions' (no request options at all) converts alike
    assert parse_chat({"model": "m", "messages": history}).messages == msgs


def test_model_may_be_left_out() -> None:
    assert parse_chat({"messages": MSG}).model == ""
    assert parse_completion({"prompt": "x"}).model == ""


def test_continuous_usage_needs_include_usage() -> None:
    on = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_chat(chat(stream=True, stream_options=on)).sampling.continuous_usage
    off = {"continuous_usage_stats": True}
    assert not parse_chat(chat(stream=True, stream_options=off)).sampling.continuous_usage


def names(template: str) -> frozenset[str]:
    return template_names((TEMPLATES / template).read_text())


def test_template_switches_are_read_off_the_source() -> None:
    assert names("openai-gpt-oss-120b.jinja") >= {"developer", "reasoning_effort"}
    assert names("Qwen-Qwen3-0.6B.jinja") == {"enable_thinking"}
    assert names("deepseek-ai-DeepSeek-V3.1.jinja") >= {"enable_thinking", "thinking"}
    assert names("meta-llama-Llama-3.1-8B-Instruct.jinja") == frozenset()
    # Cohere's template has a developer_instruction variable but no developer role (it would drop
    # such a message): the word alone is not the role
    assert "developer" in (TEMPLATES / "Cohere2MoE.jinja").read_text()
    assert "developer" not in names("Cohere2MoE.jinja")


def test_developer_mapped_only_without_the_role() -> None:
    msgs = [{"role": "developer", "content": "d"}, *MSG]
    assert map_developer(msgs, frozenset())[0] == {"role": "system", "content": "d"}
    assert map_developer(msgs, frozenset({"developer"})) is msgs
    assert map_developer(list(MSG), frozenset()) == MSG


def test_reasoning_effort_maps_to_the_switch() -> None:
    assert effort_kwargs("high", frozenset({"reasoning_effort"}), {}) == {"reasoning_effort": "high"}
    assert effort_kwargs("none", frozenset({"enable_thinking"}), {}) == {"enable_thinking": False}
    both = frozenset({"enable_thinking", "thinking"})
    assert effort_kwargs("low", both, {}) == {"enable_thinking": True, "thinking": True}
    # the request's own template kwargs win
    assert effort_kwargs("none", both, {"thinking": True}) == {"enable_thinking": False, "thinking": True}
    with pytest.raises(ApiError) as ei:
        effort_kwargs("high", frozenset({"developer"}), {})
    assert ei.value.param == "reasoning_effort"
