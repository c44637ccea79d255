"""Model turns of every parser family, in that family's real output format, with the structured
message a client must receive (shared by the pipeline tests and the end-to-end tests); and the real
chat templates rendered with the request's tools, for a first turn and for a history that holds the
structured answer fed back (the round trip a client makes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from shepherd.parsers import (
    default_parsers_for_model,
    get_reasoning_parser,
    get_tool_parser,
    prompt_closes_think,
    prompt_opens_think,
)
from shepherd.tokens.chat_template import ChatTemplate
from tests.unit.test_tokenizer_shared import qwen3

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a time zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]

W = {"city": "Paris", "days": 3}
WJ = json.dumps(W)
T = {"tz": "CET"}
TJ = json.dumps(T)
DS = "<｜tool▁sep｜>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
KIMI_SEC, KIMI_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARG, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

Calls = tuple[tuple[str, dict[str, Any]], ...]


@dataclass(frozen=True)
class Turn:
    label: str
    output: str  # what the model writes
    reasoning: str | None  # the expected reasoning_content
    content: str | None  # the expected content
    calls: Calls = ()

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else "stop"


@dataclass(frozen=True)
class Family:
    model: str  # the served model name in the end-to-end node
    template: str  # file under tests/assets/chat_templates
    reasoning: str | None
    tool: str | None
    turns: tuple[Turn, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs (thinking on)
    history_calls: int = 8  # tool calls the template accepts in one assistant turn of the history


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


DSML = "｜DSML｜"


def _invoke(prefix: str, name: str, args: dict[str, Any]) -> str:
    """One call as MiniMax-M2's template writes it (no prefix; values raw, JSON for non-strings) or
    DeepSeek-V3.2's DSML (``｜DSML｜`` tags, each value's ``string`` attribute)."""
    params = []
    for k, v in args.items():
        text = v if isinstance(v, str) else json.dumps(v)
        attr = f' string="{"true" if isinstance(v, str) else "false"}"' if prefix else ""
        params.append(f'<{prefix}parameter name="{k}"{attr}>{text}</{prefix}parameter>\n')
    return f'<{prefix}invoke name="{name}">\n' + "".join(params) + f"</{prefix}invoke>\n"


def _xml(name: str, args: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3",
        "Qwen-Qwen3-0.6B.jinja",
        "qwen3",
        "hermes",
        (
            Turn("text", "Hello! How can I help?", None, "Hello! How can I help?"),
            Turn(
                "reasoning",
                "<think>\nThe user greets.\n</think>\n\nHello! How can I help?",
                "The user greets.\n",
                "Hello! How can I help?",
            ),
            Turn(
                "one call",
                f"<think>\nNeed the weather.\n</think>\n\n{_hermes('get_weather', WJ)}",
                "Need the weather.\n",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f"Checking both.\n{_hermes('get_weather', WJ)}\n{_hermes('get_time', TJ)}",
                None,
                "Checking both.\n",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "qwq",
        "Qwen-QwQ-32B.jinja",
        "qwen3_thinking",
        "hermes",
        (
            Turn("reasoning", "Greeting.\n</think>\n\nHi!", "Greeting.\n", "Hi!"),
            Turn(
                "one call",
                f"Need the weather.\n</think>\n\n{_hermes('get_weather', WJ)}",
                "Need the weather.\n",
                None,
                (("get_weather", W),),
            ),
        ),
        {"enable_thinking": True},
    ),
    Family(
        "qwen3-coder",
        "Qwen3-Coder.jinja",
        None,
        "qwen3_coder",
        (
            Turn("text", "Sure, here it is.", None, "Sure, here it is."),
            Turn("one call", _xml("get_weather", W), None, None, (("get_weather", W),)),
            Turn(
                "several calls",
                f"Both.\n{_xml('get_weather', W)}\n{_xml('get_time', T)}",
                None,
                "Both.\n",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "llama-3.1",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        None,
        "llama3",
        (
            Turn("text", "Paris is in France.", None, "Paris is in France."),
            Turn(
                "one call",
                f'{{"name": "get_weather", "parameters": {WJ}}}',
                None,
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f'<|python_tag|>{{"name": "get_weather", "parameters": {WJ}}}; '
                f'{{"name": "get_time", "parameters": {TJ}}}',
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        history_calls=1,
    ),
    Family(
        "llama-3.2-pythonic",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        None,
        "pythonic",
        (
            Turn("text", "It is sunny.", None, "It is sunny."),
            Turn("one call", "[get_weather(city='Paris', days=3)]", None, None, (("get_weather", W),)),
            Turn(
                "several calls",
                "[get_weather(city='Paris', days=3), get_time(tz='CET')]",
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        history_calls=1,
    ),
    Family(
        "json-tools",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        None,
        "json",
        (
            Turn("text", "No tools needed.", None, "No tools needed."),
            Turn(
                "one call",
                f'{{"name": "get_weather", "arguments": {WJ}}}',
                None,
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f'[{{"name": "get_weather", "arguments": {WJ}}}, {{"name": "get_time", "arguments": {TJ}}}]',
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        history_calls=1,
    ),
    Family(
        "mistral-nemo",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        None,
        "mistral",
        (
            Turn("text", "Bonjour.", None, "Bonjour."),
            Turn(
                "one call",
                f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WJ}}}]',
                None,
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WJ}}}, '
                f'{{"name": "get_time", "arguments": {TJ}}}]',
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "deepseek-r1",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek_r1",
        "deepseek_v3",
        (
            Turn("reasoning", "A greeting.\n</think>\n\nHello.", "A greeting.\n", "Hello."),
            Turn(
                "one call",
                f"I need the weather.\n</think>\n\n{DS_CALLS}{DS_CALL}function{DS}get_weather\n"
                f"```json\n{WJ}\n```{DS_CALL_END}{DS_CALLS_END}",
                "I need the weather.\n",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f"Two tools.\n</think>\n\nChecking.{DS_CALLS}"
                f"{DS_CALL}function{DS}get_weather\n```json\n{WJ}\n```{DS_CALL_END}\n"
                f"{DS_CALL}function{DS}get_time\n```json\n{TJ}\n```{DS_CALL_END}{DS_CALLS_END}",
                "Two tools.\n",
                "Checking.",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        {"enable_thinking": True},
    ),
    Family(
        "deepseek-v3.2",
        "deepseek-ai-DeepSeek-V3.2.jinja",
        "deepseek_v3",
        "deepseek_v32",
        (
            Turn("reasoning", "Simple.</think>Hello.", "Simple.", "Hello."),
            Turn(
                "one call",
                f"Weather.</think>\n\n<{DSML}function_calls>\n"
                + _invoke(DSML, "get_weather", W)
                + f"</{DSML}function_calls>",
                "Weather.",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f"Both.</think>Let me check.\n\n<{DSML}function_calls>\n"
                + _invoke(DSML, "get_weather", W)
                + _invoke(DSML, "get_time", T)
                + f"</{DSML}function_calls>",
                "Both.",
                "Let me check.\n\n",  # (the text before the block, as vLLM's parser keeps it)
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        {"thinking": True},
    ),
    Family(
        "deepseek-v3.1",
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek_v3",
        "deepseek_v31",
        (
            Turn("reasoning", "Simple.</think>Hello.", "Simple.", "Hello."),
            Turn(
                "one call",
                f"Weather.</think>{DS_CALLS}{DS_CALL}get_weather{DS}{WJ}{DS_CALL_END}{DS_CALLS_END}",
                "Weather.",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f"Both.</think>Let me check.{DS_CALLS}{DS_CALL}get_weather{DS}{WJ}{DS_CALL_END}"
                f"{DS_CALL}get_time{DS}{TJ}{DS_CALL_END}{DS_CALLS_END}",
                "Both.",
                "Let me check.",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
        {"thinking": True},
    ),
    Family(
        "kimi-k2",
        "moonshotai-Kimi-K2.jinja",
        "kimi",
        "kimi_k2",
        (
            Turn("reasoning", "◁think▷Simple.◁/think▷Hello!", "Simple.", "Hello!"),
            Turn(
                "one call",
                f"{KIMI_SEC}{KIMI_CALL}functions.get_weather:0{KIMI_ARG}{WJ}{KIMI_END}{KIMI_SEC_END}",
                None,
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                f"◁think▷Both.◁/think▷Sure.{KIMI_SEC}{KIMI_CALL}functions.get_weather:0{KIMI_ARG}{WJ}"
                f"{KIMI_END}{KIMI_CALL}functions.get_time:1{KIMI_ARG}{TJ}{KIMI_END}{KIMI_SEC_END}",
                "Both.",
                "Sure.",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "glm-4.6",
        "GLM-4.6.jinja",
        "glm45",
        "glm45",
        (
            Turn("reasoning", "<think>Greeting.</think>\nHello.", "Greeting.", "Hello."),
            Turn(
                "one call",
                "<think>Weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
                "Weather.",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                "<think>Both.</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
                "\n<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
                "Both.",
                "Sure.\n",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "gpt-oss",
        "openai-gpt-oss-120b.jinja",
        "gpt_oss",
        "gpt_oss",
        (
            Turn(
                "reasoning",
                "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
                "Hi there.<|return|>",
                "Simple.",
                "Hi there.",
            ),
            Turn(
                "one call",
                "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.get_weather <|constrain|>json<|message|>{WJ}<|call|>",
                "Need weather.",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                f"{WJ}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time "
                f"<|constrain|>json<|message|>{TJ}<|call|>",
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "command-a",
        "Cohere2MoE.jinja",
        "cohere",
        "cohere",
        (
            Turn("reasoning", "Easy.<|END_THINKING|><|START_TEXT|>Hello.<|END_TEXT|>", "Easy.", "Hello."),
            Turn(
                "several calls",
                '<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                f'"parameters": {WJ}}}, {{"tool_call_id": "1", "tool_name": "get_time", "parameters": {TJ}}}]'
                "<|END_ACTION|>",
                None,
                None,
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "minimax-m2",
        "MiniMax-M2.jinja",
        "minimax",
        "minimax_m2",
        (
            Turn("reasoning", "Greeting.\n</think>\n\nHello!", "Greeting.\n", "Hello!"),
            Turn(
                "one call",
                "Weather.\n</think>\n\n<minimax:tool_call>\n"
                + _invoke("", "get_weather", W)
                + "</minimax:tool_call>",
                "Weather.\n",
                None,
                (("get_weather", W),),
            ),
            Turn(
                "several calls",
                "Both.\n</think>\n\nSure.\n<minimax:tool_call>\n"
                + _invoke("", "get_weather", W)
                + _invoke("", "get_time", T)
                + "</minimax:tool_call>",
                "Both.\n",
                "Sure.\n",
                (("get_weather", W), ("get_time", T)),
            ),
        ),
    ),
    Family(
        "step3",
        "StepFun3.5-Flash.jinja",
        "step3",
        None,
        (Turn("reasoning", "Greeting.\n</think>\n\nHello!", "Greeting.\n", "Hello!"),),
    ),
    Family(
        "nemotron-3",
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
        "nemotron",
        "qwen3_coder",
        (
            Turn("reasoning", "Greeting.\n</think>\nHello!", "Greeting.\n", "Hello!"),
            Turn(
                "one call",
                f"Need weather.\n</think>\n{_xml('get_weather', W)}",
                "Need weather.\n",
                None,
                (("get_weather", W),),
            ),
        ),
    ),
)

BY_MODEL = {f.model: f for f in FAMILIES}
CASES = [(f, t) for f in FAMILIES for t in f.turns]


def case_id(case: tuple[Family, Turn]) -> str:
    return f"{case[0].model}:{case[1].label}"


@cache
def template(name: str) -> ChatTemplate:
    return ChatTemplate.from_file(TEMPLATES / name, special_tokens=qwen3().chat_template().special_tokens)


def user_messages(marker: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is the weather in Paris? {marker}".strip()},
    ]


def render(family: Family, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return template(family.template).render(messages, tools=tools, template_kwargs=family.kwargs)


# ---- tests ---------------------------------------------------------------------------------------------


def test_every_family_is_covered() -> None:
    from shepherd.parsers import REASONING_FAMILIES, TOOL_FAMILIES

    tools = {f.tool for f in FAMILIES}
    reasoning = {f.reasoning for f in FAMILIES}
    assert set(TOOL_FAMILIES) <= tools
    assert set(REASONING_FAMILIES) - {"kimi_k2"} <= reasoning  # kimi_k2's think tags are qwen3's
    for f in FAMILIES:
        for t in f.turns:
            assert t.output and (t.content or t.calls or t.reasoning)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model)
def test_template_renders_tools_and_opens_think_as_the_family_expects(family: Family) -> None:
    prompt = render(family, user_messages(), TOOLS)
    assert "What is the weather in Paris?" in prompt
    if family.template not in (
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    ):
        # (those two templates take tool definitions from the system prompt, not from ``tools``)
        assert "get_weather" in prompt and "get_time" in prompt
    if family.reasoning is not None:  # templates that end the prompt inside an open think block
        opens = family.reasoning in ("qwen3_thinking", "deepseek_r1", "deepseek_v3", "cohere", "minimax")
        opens |= family.reasoning in ("step3", "nemotron")
        assert prompt_opens_think(family.reasoning, prompt) == opens
        assert not prompt_closes_think(family.reasoning, prompt)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_structured_answer_round_trips_through_the_template(case: tuple[Family, Turn]) -> None:
    """The message a client receives, sent back as history with a tool result, renders."""
    family, turn = case
    turn_calls = turn.calls[: family.history_calls]
    calls: list[dict[str, Any]] = [
        {
            "id": f"call{i:05d}x" if family.tool != "mistral" else f"abcdefgh{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(turn_calls)
    ]
    answer: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if calls:
        answer["tool_calls"] = calls
    history = [*user_messages(), answer]
    history.extend(
        {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": "42"}
        for c in calls
    )
    if not calls:
        history.append({"role": "user", "content": "Thanks."})
    prompt = render(family, history, TOOLS)
    for name, _ in turn_calls:
        assert name in prompt
    if turn.content:
        assert turn.content.strip() in prompt


def test_model_names_pick_the_families_the_cases_use() -> None:
    assert default_parsers_for_model("Qwen/Qwen3-8B") == ("qwen3", "hermes")
    assert default_parsers_for_model("openai/gpt-oss-20b") == ("gpt_oss", "gpt_oss")
    assert default_parsers_for_model("deepseek-ai/DeepSeek-V3.1") == ("deepseek_v3", "deepseek_v31")
    assert default_parsers_for_model("deepseek-ai/DeepSeek-V3.2-Exp") == ("deepseek_v3", "deepseek_v32")
    assert default_parsers_for_model("MiniMaxAI/MiniMax-M2") == ("minimax", "minimax_m2")
    # Hermes fine-tunes of Llama speak hermes, not Llama's JSON
    assert default_parsers_for_model("NousResearch/Hermes-3-Llama-3.1-8B") == (None, "hermes")
    assert default_parsers_for_model("meta-llama/Llama-3.1-8B-Instruct") == (None, "llama3")
    for f in FAMILIES:  # every family name in the cases is a valid parser name
        if f.reasoning:
            get_reasoning_parser(f.reasoning)
        if f.tool:
            get_tool_parser(f.tool)
