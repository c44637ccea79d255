"""Chat templates: hand-checked renders, the transformers context, sandbox, errors, caching, tool calls."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from shepherd.tokens.chat_messages import (
    ChatTemplateError,
    normalize_tool_call_arguments,
    normalize_tool_call_ids,
)
from shepherd.tokens.chat_template import ChatTemplate, ToolCallShape
from shepherd.tokens.tokenizer import load_chat_templates

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "tests" / "assets" / "tokenizers"
QWEN3 = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"
GOLDEN = Path(__file__).with_name("test_chat_template_golden.json")


@cache
def tpl(directory: Path, name: str = "default") -> ChatTemplate:
    return load_chat_templates(directory)[name]


def golden(cid: str) -> str:
    data: list[dict[str, Any]] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return next(str(g["text"]) for g in data if g["id"] == cid)


CONVO = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "I am an assistant."},
    {"role": "user", "content": "What is 2+2? Answer in one word. Ünïcödé ✓ 日本語"},
]


# ---- renders written by hand from the templates --------------------------------------------------


def test_qwen3_by_hand() -> None:
    want = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello! Who are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am an assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2? Answer in one word. Ünïcödé ✓ 日本語<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    t = tpl(QWEN3)
    assert t.render(CONVO) == want
    assert t.render(CONVO, template_kwargs={"enable_thinking": False}) == want + "<think>\n\n</think>\n\n"
    assert t.render(CONVO, template_kwargs={"enable_thinking": True}) == want
    assert t.render(CONVO, add_generation_prompt=False) == want.removesuffix("<|im_start|>assistant\n")


def test_llama31_by_hand() -> None:
    want = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello! Who are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    t = tpl(TOK / "llama-3.1")
    assert t.render([CONVO[1]]) == want
    assert t.render([CONVO[1]], template_kwargs={"date_string": "1 Jan 2026"}) == want.replace(
        "26 Jul 2024", "1 Jan 2026"
    )


def test_mistral_by_hand() -> None:
    want = (
        "<s>[INST]Hello! Who are you?[/INST]I am an assistant.</s>"
        "[INST]You are a helpful assistant.\n\nWhat is 2+2? Answer in one word. Ünïcödé ✓ 日本語[/INST]"
    )
    assert tpl(TOK / "mistral-nemo").render(CONVO) == want


def test_qwen3_tool_call_and_result_by_hand() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    got = tpl(QWEN3).render(messages, tools=tools)
    assert got.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert (
        '\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}\n'
        in got
    )
    assert got.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ---- the transformers context --------------------------------------------------------------------


def test_tojson_keeps_non_ascii_and_takes_transformers_kwargs() -> None:
    t = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}"
        "|{{ x | tojson(ensure_ascii=true) }}"
    )
    x = {"b": "日本 <&>", "a": [1, 2]}
    out = t.render([{"role": "user", "content": ""}], template_kwargs={"x": x})
    assert out.split("|") == [
        json.dumps(x, ensure_ascii=False),
        json.dumps(x, ensure_ascii=False, indent=2),
        '{"a":[1,2],"b":"日本 <&>"}',
        json.dumps(x),
    ]


def test_context_names_and_extensions() -> None:
    t = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|{{ tools }}"
        "|{{ documents }}"
        "|{{ strftime_now('%Y') | length }}|{{ custom }}"
        "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
        "{{ i }}{% endfor %}"
        "{% set ns = namespace(n=2) %}{% do messages | length %}{{ ns.n }}"
        "{% generation %}G{% endgeneration %}",
        special_tokens={"bos_token": "<B>", "eos_token": "<E>", "pad_token": "<P>"},
    )
    out = t.render([{"role": "user", "content": "x"}], template_kwargs={"custom": "K", "eos_token": "<E2>"})
    assert out == "<B>|<E2>|<P>|True|None|None|4|K022G"


def test_trim_and_lstrip_blocks_as_transformers_sets_them() -> None:
    t = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert t.render([{"role": "user", "content": ""}]) == "A\nB"


def test_sandbox_refuses_internals() -> None:
    for source in [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}",
        "{{ dict.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
    ]:
        try:
            out = ChatTemplate(source).render([{"role": "user", "content": "x"}])
        except ChatTemplateError:
            continue
        assert out == "", source  # an unsafe attribute is undefined: nothing leaks


def test_reasoning_fields_are_aliased_and_nulls_dropped() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.thinking }}/{{ m.reasoning_content }}/"
        "{{ m.tool_calls is defined }}/{{ m.content | tojson }};{% endfor %}"
    )
    out = t.render(
        [
            {"role": "user", "content": "q", "tool_calls": None},
            {"role": "assistant", "content": None, "reasoning": "r"},
        ]
    )
    assert out == 'user://False/"q";assistant:r/r/False/"";'


def test_continue_final_message() -> None:
    t = tpl(QWEN3)
    msgs = [CONVO[1], {"role": "assistant", "content": "I am"}]
    assert t.render(msgs, add_generation_prompt=False, continue_final_message=True) == golden(
        "qwen3-continue"
    )
    with pytest.raises(ChatTemplateError, match="not compatible"):
        t.render(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError):
        t.render([CONVO[1], {"role": "assistant"}], add_generation_prompt=False, continue_final_message=True)


# ---- errors --------------------------------------------------------------------------------------


def test_raise_exception_becomes_chat_template_error() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        tpl(TOK / "mistral-nemo").render(bad)


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [1], [{"content": "no role"}], [{"role": 3, "content": "x"}], {"role": "user"}],
)
def test_bad_message_shapes(messages: Any) -> None:
    with pytest.raises(ChatTemplateError):
        tpl(QWEN3).render(messages)


def test_bad_tools_and_broken_templates() -> None:
    with pytest.raises(ChatTemplateError):
        tpl(QWEN3).render(CONVO, tools={"type": "function"})  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")
    for source in [
        "{{ messages[0].content.nope() }}",
        "{{ 1 / 0 }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ]:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render([{"role": "user", "content": "x"}])


# ---- the render cache ----------------------------------------------------------------------------


def test_render_cache_hits_and_key_order_matters() -> None:
    t = ChatTemplate("{{ messages[0] | tojson }}")
    a = [{"role": "user", "content": "x"}]
    b = [{"content": "x", "role": "user"}]
    assert t.render(a) == '{"role": "user", "content": "x"}'
    assert t.render(a) == '{"role": "user", "content": "x"}'
    assert (t.hits, t.misses) == (1, 1)
    assert t.render(b) == '{"content": "x", "role": "user"}'  # same data, other order: other render
    assert t.render(a, template_kwargs={"k": 1}) == t.render(a, template_kwargs={"k": 1.0})  # two keys
    assert (t.hits, t.misses) == (1, 4)


def test_render_cache_is_bounded_and_skips_non_json_inputs() -> None:
    t = ChatTemplate("{{ messages | length }}", cache_size=2)
    for i in range(5):
        t.render([{"role": "user", "content": str(i)}])
    assert t.cached_count == 2
    small = ChatTemplate("{{ messages[0].content }}", cache_bytes=1000)
    for i in range(10):
        small.render([{"role": "user", "content": str(i) * 200}])
    assert 1 <= small.cached_count <= 2  # each entry holds ~450 bytes of key and text
    assert t.render([{"role": "user", "content": object()}]) == "1"  # rendered, not cached
    assert t.serialize([{"role": "user", "content": object()}], None, True, False, None) is None


def test_clock_reads_are_checked_on_a_hit() -> None:
    t = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    assert t.uses_clock
    msgs = [{"role": "user", "content": "x"}]
    today = t.render(msgs)
    assert t.render(msgs) == today and t.hits == 1
    key = t.serialize(msgs, None, True, False, None)
    t.store(key, "stale", (("%Y-%m-%d", "1999-01-01"),))
    assert t.render(msgs) == today  # the stored day is not today's: a miss, rendered again


# ---- tool calls ----------------------------------------------------------------------------------


def openai_tool_turns(call_id: str) -> list[dict[str, Any]]:
    """What an OpenAI client sends: null content, string arguments, long ids."""
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]


def test_tool_call_shapes_are_detected() -> None:
    shapes = {
        "llama": tpl(TOK / "llama-3.1").tool_call_shape(),
        "qwen3": tpl(QWEN3).tool_call_shape(),
        "deepseek-v3": tpl(TOK / "deepseek-v3").tool_call_shape(),
        "deepseek-v3.1": tpl(TOK / "deepseek-v3", "v3_1").tool_call_shape(),
        "mistral": tpl(TOK / "mistral-nemo").tool_call_shape(),
    }
    assert {k: (v.arguments, v.id_length) for k, v in shapes.items()} == {
        "llama": ("object", None),
        "qwen3": ("either", None),
        "deepseek-v3": ("string", None),
        "deepseek-v3.1": ("object", None),
        "mistral": ("object", 9),
    }


def test_openai_style_tool_calls_render_as_transformers_style_ones() -> None:
    """String arguments and long ids are fixed for the templates that need it (as vLLM does)."""
    from tests.unit.test_chat_template_golden import TOOLS

    got = tpl(TOK / "mistral-nemo").render(openai_tool_turns("call_Zabc123XYZ"), tools=TOOLS)
    assert got == golden("mistral-tools")
    sys_msg = {"role": "system", "content": "You are a helpful assistant."}
    got = tpl(TOK / "llama-3.1").render([sys_msg, *openai_tool_turns("call_abc123")], tools=TOOLS)
    assert got == golden("llama31-tools")
    got = tpl(TOK / "deepseek-v3", "v3_1").render([sys_msg, *openai_tool_turns("call_abc123")], tools=TOOLS)
    assert got == golden("deepseek31-tools")


def test_string_arguments_reach_a_template_taking_either_as_objects() -> None:
    """vLLM (``_postprocess_messages``), SGLang and SMG parse every call's ``arguments`` into an object
    before rendering: Qwen3's template, which prints a string as it is and an object through ``tojson``,
    renders the compact JSON an OpenAI client sends back with tojson's spacing; a template laying out an
    object's items (as Gemma 4's ``call:f{k:v}``) lays them out; so does one that renders only with tools
    (Hermes' tool_use template iterates over them)."""
    turns = openai_tool_turns("call_1")
    turns[1]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris","unit":"celsius"}'
    got = tpl(QWEN3).render(turns)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in got
    items = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{% set a = c.function.arguments %}"
        "call:{{ c.function.name }}("
        "{% if a is mapping %}{% for k, v in a | dictsort %}{{ k }}={{ v }};{% endfor %}"
        "{% else %}{{ a }}{% endif %}"
        "){% endfor %}{% endfor %}"
    )
    assert ChatTemplate(items).render(turns) == "call:get_weather(city=Paris;unit=celsius;)"
    with_tools = (
        "{% for t in tools %}<{{ t.function.name }}>{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{% set a = c.function.arguments %}"
        "{% if a is string %}{{ a }}{% else %}{{ a | tojson }}{% endif %}{% endfor %}{% endfor %}"
    )
    needs_tools = ChatTemplate(with_tools)
    assert needs_tools.tool_call_shape() == ToolCallShape("either", None)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert needs_tools.render(turns, tools=tools) == '<get_weather>{"city": "Paris", "unit": "celsius"}'


def test_dict_arguments_work_for_a_template_that_concatenates_strings() -> None:
    turns = openai_tool_turns("call_1")
    turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    got = tpl(TOK / "deepseek-v3").render(turns)
    assert '```json\n{"city": "Paris"}\n```' in got
    raw = ChatTemplate(tpl(TOK / "deepseek-v3").source, fix_tool_calls=False)
    with pytest.raises(ChatTemplateError):
        raw.render(turns)


def test_normalize_helpers() -> None:
    msgs = openai_tool_turns("call_0123456789abcdef")
    as_obj = normalize_tool_call_arguments(msgs, as_string=False)
    assert as_obj[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # input untouched
    back = normalize_tool_call_arguments(as_obj, as_string=True)
    assert back[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'
    bad = normalize_tool_call_arguments(
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
        as_string=False,
    )
    assert bad[0]["tool_calls"][0]["function"]["arguments"] == "{oops"
    ids = normalize_tool_call_ids(msgs)
    assert ids[1]["tool_calls"][0]["id"] == "456789abcdef"[-9:] == ids[2]["tool_call_id"]
    odd = normalize_tool_call_ids(
        [{"role": "tool", "tool_call_id": "x-y"}, {"role": "tool", "tool_call_id": "x-y"}]
    )
    assert len(odd[0]["tool_call_id"]) == 9 and odd[0]["tool_call_id"].isalnum()
    assert odd[0]["tool_call_id"] == odd[1]["tool_call_id"]
