"""Tool-call parsers: realistic outputs per family (text around calls, one and several calls),
malformed and truncated calls returned as text, and chunking invariance."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.parsers import (
    CollectedTools,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    get_tool_parser,
    run_tools,
)

Calls = list[tuple[str, dict[str, Any]]]

W = {"location": "Paris, France", "unit": "celsius"}
WS = json.dumps(W)
DS_SEP = "<｜tool▁sep｜>"
DS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_END = "<｜tool▁calls▁end｜>"
DS_CALL = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DSML = "｜DSML｜"
MM, MM_END = "<minimax:tool_call>", "</minimax:tool_call>"

# (family, model output, expected content, expected calls)
CASES: list[tuple[str, str, str, Calls]] = [
    # --- hermes / qwen2.5 / qwen3
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WS}}}\n</tool_call>',
        "",
        [("get_weather", W)],
    ),
    (
        "hermes",
        f'Let me check both.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WS}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check both.\n\n",
        [("get_weather", W), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": '
        '{"q": "a < b </tool and \\"quotes\\" 日本"}}\n</tool_call>\nDone.',
        "Done.",
        [("search", {"q": 'a < b </tool and "quotes" 日本'})],
    ),
    (
        "hermes",
        "<tool_call>\n{not json}\n</tool_call> tail",
        "<tool_call>\n{not json}\n</tool_call> tail",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        'ok <tool_call>\n{"name": "get_weather", "argu',
        'ok <tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    ("hermes", "I use a < sign and <tool", "I use a < sign and <tool", []),
    # --- llama 3.1/3.2/3.3 JSON
    (
        "llama3",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WS}}}',
        "",
        [("get_weather", W)],
    ),
    (
        "llama3",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "}"}}',
        "",
        [("a", {"x": 1}), ("b", {"y": "}"})],
    ),
    ("llama3", "Paris is the capital.", "Paris is the capital.", []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    # --- mistral: old JSON list and v11 name[ARGS]
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WS}}}, {{"name": "noop", "arguments": {{}}}}]',
        "",
        [("get_weather", W), ("noop", {})],
    ),
    (
        "mistral",
        f"Checking.[TOOL_CALLS]get_weather[ARGS]{WS}[TOOL_CALLS]get_time[ARGS]{{}}",
        "Checking.",
        [("get_weather", W), ("get_time", {})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"loc', '[TOOL_CALLS]get_weather[ARGS]{"loc', []),
    ("mistral", "[TOOL_CALLS]bad name here[ARGS]{}", "[TOOL_CALLS]bad name here[ARGS]{}", []),
    ("mistral", "No calls [but brackets].", "No calls [but brackets].", []),
    ("mistral", "[TOOL_CALLS]" + "n" * 300 + "[ARGS]{}", "[TOOL_CALLS]" + "n" * 300 + "[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]f[ARGS]oops[TOOL_CALLS]g[ARGS]{}", "[TOOL_CALLS]f[ARGS]oops", [("g", {})]),
    # --- qwen3-coder XML
    (
        "qwen3_coder",
        "I'll look it up.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=location>\nParis, France\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "I'll look it up.\n",
        # no tools in the request: every parameter is undeclared, a string (vLLM's and SGLang's
        # Qwen3Coder _convert_param_value)
        [("get_weather", {"location": "Paris, France", "days": "3"})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
        "def f():\n    return '<x>'\n\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=run>\n</function>\n</tool_call>",
        "",
        [("write_file", {"path": "a.py", "content": "def f():\n    return '<x>'\n"}), ("run", {})],
    ),
    ("qwen3_coder", "<tool_call>\n<oops>\n</tool_call>", "<tool_call>\n<oops>\n</tool_call>", []),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx y\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("f", {"a": "1", "b": "x y"})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\njunk\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\njunk\n</function>\n</tool_call>",
        [],
    ),
    # --- DeepSeek V3 / R1 and V3.1
    (
        "deepseek_v3",
        f"Let me check.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{WS}\n```{DS_CALL_END}\n"
        f"{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_END}",
        "Let me check.",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "deepseek_v3",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"a"',
        f'{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"a"',
        [],
    ),
    (
        "deepseek_v3",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```\n{{"x": "```"}}\n```{DS_CALL_END}{DS_END}',
        "",
        [("f", {"x": "```"})],
    ),
    (
        "deepseek_v31",
        f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{WS}{DS_CALL_END}{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_END}",
        "",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "deepseek_v31",
        f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{broken{DS_CALL_END}{DS_END}after",
        # a section that closes with no valid call is text, verbatim (SGLang's deepseekv31_detector
        # answers the whole text when a call does not parse)
        f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{broken{DS_CALL_END}{DS_END}after",
        [],
    ),
    # --- Kimi K2
    (
        "kimi_k2",
        "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{WS}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "I'll check.",
        [("get_weather", W), ("get_time", {})],
    ),
    # --- MiniMax-M2 (its template's invoke blocks; values typed by the tool's schema)
    (
        "minimax",
        'Need the weather.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="location">Paris, France</parameter>\n<parameter name="unit">celsius</parameter>\n'
        '</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        "Need the weather.\n",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "minimax",
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="opts">{"a": [1, true]}</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "",
        [("f", {"opts": {"a": [1, True]}})],
    ),
    (
        "minimax",
        '<minimax:tool_call>\nstray<invoke name="f">\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\nstray<invoke name="f">\n</invoke>\n</minimax:tool_call>',
        [],
    ),
    (  # a space before the head's '>' is a head; a parameter head without its closing quote is not
        "minimax",
        f'{MM}\n<invoke name="f" >\n<parameter name="n">1</parameter>\n</invoke>\n{MM_END}',
        "",
        [("f", {"n": 1})],
    ),
    (
        "minimax",
        f'{MM}\n<invoke name="f">\n<parameter name="a>x</parameter>\n</invoke>\n{MM_END}',
        f'{MM}\n<invoke name="f">\n<parameter name="a>x</parameter>\n</invoke>\n{MM_END}',
        [],
    ),
    # --- DeepSeek-V3.2 (DSML; values typed by their string="true|false" attribute)
    (
        "deepseek_v32",
        f'Checking.\n\n<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n'
        f'<{DSML}parameter name="location" string="true">Paris, France</{DSML}parameter>\n'
        f'<{DSML}parameter name="unit" string="true">celsius</{DSML}parameter>\n</{DSML}invoke>\n'
        f'<{DSML}invoke name="f">\n<{DSML}parameter name="n" string="false">[1, 2]</{DSML}parameter>\n'
        f"</{DSML}invoke>\n</{DSML}function_calls>",
        "Checking.\n\n",
        [("get_weather", W), ("f", {"n": [1, 2]})],
    ),
    # --- GLM 4.5 / 4.6
    (
        "glm45",
        "Checking the weather.\n<tool_call>get_weather\n"
        "<arg_key>location</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
        "Checking the weather.\n",
        [("get_weather", {"location": "Beijing", "days": 2}), ("get_time", {})],
    ),
    (
        "glm45",
        '<tool_call>f\n<arg_key>opts</arg_key>\n<arg_value>{"a": [1, true]}</arg_value>\n</tool_call>',
        "",
        [("f", {"opts": {"a": [1, True]}})],
    ),
    (
        "glm45",
        "<tool_call>f\n<arg_key>a</arg_key>\nno value tag\n</tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>\nno value tag\n</tool_call>",
        [],
    ),
    (
        "glm45",
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Bei",
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Bei",
        [],
    ),
    # --- gpt-oss (what the harmony reasoning parser passes on as content)
    (
        "gpt_oss",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f"{WS}<|call|>",
        "",
        [("get_weather", W)],
    ),
    (
        "gpt_oss",
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>',
        "",
        [("lookup", {"q": "x"})],
    ),
    (
        "gpt_oss",
        '<|channel|>commentary to=functions.lookup json<|message|>{"q": "x"}<|call|>',
        "",
        [("lookup", {"q": "x"})],
    ),
    (
        "gpt_oss",
        'Text.<|channel|>commentary to=functions.lookup json<|message|>{"q"',
        'Text.<|channel|>commentary to=functions.lookup json<|message|>{"q"',
        [],
    ),
    # --- Cohere Command A / R7B
    (
        "cohere",
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
        + WS
        + '},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}\n]<|END_ACTION|>',
        "",
        [("get_weather", W), ("get_time", {})],
    ),
    (
        "cohere",
        '<|START_ACTION|>[{"tool_name": 3}]<|END_ACTION|>',
        '<|START_ACTION|>[{"tool_name": 3}]<|END_ACTION|>',
        [],
    ),
    # --- pythonic / llama 4
    (
        "pythonic",
        '[get_weather(location="Paris, France", unit="celsius"), get_time(tz=\'CET\', dst=True, n=None)]',
        "",
        [("get_weather", W), ("get_time", {"tz": "CET", "dst": True, "n": None})],
    ),
    (
        "pythonic",
        "<|python_start|>[search(q=\"a]b\", tags=['x', 'y'], opts={'k': 1})]<|python_end|>",
        "",
        [("search", {"q": "a]b", "tags": ["x", "y"], "opts": {"k": 1}})],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "Hello, world.", "Hello, world.", []),
    ("pythonic", "[f(x=1), g(", "[f(x=1), g(", []),
    # --- json
    ("json", f'{{"name": "get_weather", "arguments": {WS}}}', "", [("get_weather", W)]),
    (
        "json",
        '[{"name": "a", "arguments": {"s": "[{"}}, {"name": "b", "parameters": {}}]',
        "",
        [("a", {"s": "[{"}), ("b", {})],
    ),
    ("json", '{"result": "not a call"}', '{"result": "not a call"}', []),
]

IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _counter_ids() -> Any:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def _check(family: str, chunks: list[str], content: str, calls: Calls) -> None:
    got = run_tools(get_tool_parser(family, id_factory=_counter_ids()), chunks)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert [c.index for c in got.calls] == list(range(len(calls)))
    if family != "kimi_k2":
        assert [c.id for c in got.calls] == [f"id{i}" for i in range(len(calls))]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES, ids=IDS)
def test_one_feed(family: str, text: str, content: str, calls: Calls) -> None:
    _check(family, [text], content, calls)


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES, ids=IDS)
def test_every_single_split_and_char_by_char(family: str, text: str, content: str, calls: Calls) -> None:
    for cut in range(len(text) + 1):
        _check(family, [text[:cut], text[cut:]], content, calls)
    _check(family, list(text), content, calls)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_matches_one_feed(case: tuple[str, str, str, Calls], data: st.DataObject) -> None:
    family, text, content, calls = case
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=15)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _check(family, chunks, content, calls)


_PIECES = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        '{"name": "f", "arguments": {"a": 1}}',
        "{",
        "}",
        "<",
        "x",
        "\n",
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=f>",
        "</function>",
        "<parameter=a>",
        "1",
        "<",
        "\n",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        "functions.f:0<|tool_call_argument_begin|>{}",
        "x",
        "<|",
    ],
    "mistral": ["[TOOL_CALLS]", "f[ARGS]", "{}", '[{"name": "f", "arguments": {}}]', "[", "x", " "],
    "llama3": ["<|python_tag|>", '{"name": "f", "parameters": {}}', ";", "{", "}", "x", " "],
    "pythonic": ["[", "]", "f(a=1)", ", ", "'", '"', "x", "<|python_end|>"],
    "glm45": [
        "<tool_call>",
        "</tool_call>",
        "f\n",
        "<arg_key>a</arg_key>",
        "<arg_value>1</arg_value>",
        "<",
        "x",
    ],
    "deepseek_v31": [DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, f"f{DS_SEP}{{}}", "x", "<｜"],
    "minimax_m2": [
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        '<invoke name="f">',
        "</invoke>",
        '<parameter name="a">',
        "1",
        "</parameter>",
        "\n",
        "<",
        "x",
    ],
    "deepseek_v32": [
        f"<{DSML}function_calls>",
        f"</{DSML}function_calls>",
        f'<{DSML}invoke name="f">',
        f"</{DSML}invoke>",
        f'<{DSML}parameter name="a" string="false">',
        "1",
        f"</{DSML}parameter>",
        "\n",
        "<｜",
    ],
    "gpt_oss": [
        "<|start|>",
        "assistant",
        "<|channel|>",
        "commentary to=functions.f",
        "<|message|>",
        "{}",
        "<|call|>",
    ],
    "json": ["{", "}", "[", "]", '"name": "f"', '"arguments": {}', ", ", '"', "x"],
}


_SECTIONS = {
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    "deepseek_v31": (DS_BEGIN, DS_END),
}


def drawn_alike_in_chunks(
    family: str, data: st.DataObject, pieces: list[str], max_size: int
) -> tuple[str, CollectedTools]:
    """A text drawn from ``pieces``, parsed whole and in drawn chunks: the same result (returned)."""
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=max_size)))
    whole = run_tools(get_tool_parser(family, id_factory=lambda: "id"), [text])
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run_tools(get_tool_parser(family, id_factory=lambda: "id"), chunks) == whole
    return text, whole


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(sorted(_PIECES)), data=st.data())
def test_arbitrary_text_is_chunking_invariant(family: str, data: st.DataObject) -> None:
    text, whole = drawn_alike_in_chunks(family, data, _PIECES[family], 20)
    for call in whole.calls:
        assert isinstance(json.loads(call.arguments), dict)
    if not whole.calls:  # nothing was a call: every character comes back as content
        if family in _SECTIONS:  # (section markers inside a section are dropped, and whitespace there)
            content = whole.content
            for marker in _SECTIONS[family]:
                text = text.replace(marker, "")
                content = content.replace(marker, "")
            assert "".join(content.split()) == "".join(text.split())
        else:
            assert whole.content == text


def test_events_stream_content_early_and_calls_in_order() -> None:
    p = get_tool_parser("hermes", id_factory=_counter_ids())
    assert p.feed("Sure, ") == [TextDelta("Sure, ")]
    assert p.feed("checking <tool") == [TextDelta("checking ")]  # "<tool" held: may be a marker
    assert p.feed('_call>\n{"name": "f", ') == []
    assert p.feed('"arguments": {"x": 1}}\n</tool_call>') == [
        ToolCallStart(0, "id0", "f"),
        ToolCallArgs(0, '{"x": 1}'),
    ]
    assert p.feed("\n") == []
    assert p.finish() == []


def test_parameter_types_from_request_tools() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "set",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}, "n": {"type": "integer"}},
                },
            },
        }
    ]
    text = (
        "<tool_call>\n<function=set>\n<parameter=code>\n007\n</parameter>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    got = run_tools(get_tool_parser("qwen3_coder", tools=tools), [text])
    assert json.loads(got.calls[0].arguments) == {"code": "007", "n": 7}
    glm = "<tool_call>set\n<arg_key>code</arg_key>\n<arg_value>12</arg_value>\n</tool_call>"
    assert json.loads(run_tools(get_tool_parser("glm45", tools=tools), [glm]).calls[0].arguments) == {
        "code": "12"
    }
    assert json.loads(run_tools(get_tool_parser("glm45"), [glm]).calls[0].arguments) == {"code": 12}


def test_default_ids_are_unique_and_mistral_ids_have_nine_alphanumerics() -> None:
    one = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = one + one.replace('"f"', '"g"')
    ids = [c.id for c in run_tools(get_tool_parser("hermes"), [text]).calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    (call,) = run_tools(get_tool_parser("mistral"), ["[TOOL_CALLS]f[ARGS]{}"]).calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_fresh_parser_per_request_shares_nothing() -> None:
    a = get_tool_parser("hermes")
    b = get_tool_parser("hermes")
    assert a.feed("<tool_call>\n{") == []
    assert b.feed("plain") == [TextDelta("plain")]
    assert b.finish() == []
    assert a.finish() == [TextDelta("<tool_call>\n{")]


def test_unknown_family_raises() -> None:
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_tool_parser("nope")
