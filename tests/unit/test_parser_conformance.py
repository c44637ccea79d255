"""Parser conformance with the SGLang / vLLM reference parsers (the sweep's findings F1-F11): deep
nesting falls back to text, hermes' end tag inside an argument string and its missing end tag, llama3's
``<|python_tag|>`` after text, parameter types from ``anyOf``/undeclared parameters, linear work on
white space floods and unclosed qwen3-coder parameters, streamed == whole, strict JSON arguments, and
the chat pipeline's fallback when a parser raises."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.output.chat import ChoiceParsing
from shepherd.parsers import (
    CollectedTools,
    ReasoningParser,
    TextDelta,
    ToolEvent,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
    run_reasoning,
    run_tools,
)
from shepherd.parsers.tool_common import ParamType, infer_type, param_types
from tests.unit.test_parsers_tools import drawn_alike_in_chunks

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # Pydantic's Optional[str]
                    "note": {"type": "string"},
                    "n": {"type": "integer"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]

DS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_END = "<｜tool▁calls▁end｜>"
DS_CALL = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
KIMI_BEGIN = "<|tool_calls_section_begin|>"
KIMI_END = "<|tool_calls_section_end|>"


def _whole(family: str, text: str, **kw: Any) -> CollectedTools:
    return run_tools(get_tool_parser(family, **kw), [text])


def _splits(text: str) -> list[list[str]]:
    """The whole text, one character at a time, and fixed-size pieces."""
    return [[text], list(text)] + [[text[i : i + k] for i in range(0, len(text), k)] for k in (2, 3, 7)]


def _same_streamed(family: str, text: str, **kw: Any) -> CollectedTools:
    whole = run_tools(get_tool_parser(family, id_factory=lambda: "id", **kw), [text])
    for chunks in _splits(text):
        assert run_tools(get_tool_parser(family, id_factory=lambda: "id", **kw), chunks) == whole, chunks
    return whole


def _calls(res: CollectedTools) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in res.calls]


# --- F1: nesting deeper than the recursion limit is text, never an exception ----------------------------

_D = 1200
_DEEP = "[" * _D + "]" * _D


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + _DEEP + "}}</tool_call>"),
        ("json", _DEEP),
        ("json", '{"name": "f", "arguments": {"a": ' + _DEEP + "}}"),
        ("llama3", '{"name": "f", "parameters": {"a": ' + _DEEP + "}}"),
        ("llama3", '<|python_tag|>{"name": "f", "parameters": "{\\"a\\": ' + _DEEP + '}"}'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + _DEEP + "}"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ' + _DEEP + "}}]"),
        (
            "kimi_k2",
            f"{KIMI_BEGIN}<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            '{"a": ' + _DEEP + f"}}<|tool_call_end|>{KIMI_END}",
        ),
        ("deepseek_v31", f'{DS_BEGIN}{DS_CALL}f{DS_SEP}{{"a": {_DEEP}}}{DS_CALL_END}{DS_END}'),
        (
            "deepseek_v3",
            f'{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n{{"a": {_DEEP}}}\n```{DS_CALL_END}{DS_END}',
        ),
        ("cohere", '<|START_ACTION|>[{"tool_name": "f", "parameters": {"a": ' + _DEEP + "}}]<|END_ACTION|>"),
        ("gpt_oss", '<|channel|>commentary to=functions.f<|message|>{"a": ' + _DEEP + "}<|call|>"),
        ("pythonic", "[f(a=" + "-" * 20000 + "1)]"),
        ("pythonic", "[f(a=" + "(" * 5000 + "1" + ")" * 5000 + ")]"),
        ("pythonic", "[f(a=" + _DEEP + ")]"),
    ],
)
def test_deep_nesting_comes_back_as_text(family: str, text: str) -> None:
    res = _whole(family, text)
    assert res.calls == ()
    assert res.content == text


@pytest.mark.parametrize(
    ("family", "text"),
    [
        (
            "qwen3_coder",
            f"<tool_call>\n<function=lookup>\n<parameter=opts>\n{_DEEP}\n</parameter>\n</function>\n",
        ),
        ("glm45", f"<tool_call>lookup\n<arg_key>opts</arg_key><arg_value>{_DEEP}</arg_value>\n"),
    ],
)
def test_deep_xml_object_values_do_not_raise(family: str, text: str) -> None:
    res = _whole(family, text + "</tool_call>", tools=TOOLS)  # the value stays its raw text
    assert _calls(res) == [("lookup", {"opts": _DEEP})]


# --- F2 / F3: hermes decodes the JSON value after <tool_call> (SGLang's raw_decode) ---------------------


def test_hermes_end_tag_inside_a_string_argument_is_argument_text() -> None:
    args = {"text": 'wrap the call in </tool_call> tags, \\"quoted\\" </tool_call>'}
    text = 'Sure.\n<tool_call>\n{"name": "write", "arguments": ' + json.dumps(args) + "}\n</tool_call>\nDone."
    res = _same_streamed("hermes", text)
    assert _calls(res) == [("write", args)]
    assert res.content == "Sure.\nDone."


def test_hermes_end_tag_outside_a_string_still_ends_a_malformed_call() -> None:
    text = '<tool_call>{"name": "f", </tool_call>then <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    res = _same_streamed("hermes", text)
    assert _calls(res) == [("g", {})]
    assert res.content == '<tool_call>{"name": "f", </tool_call>then '


@pytest.mark.parametrize("tail", ["", "\n", "\n\n  "])
def test_hermes_complete_call_without_end_tag_is_a_call(tail: str) -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get", "arguments": {"a": 1}}' + tail
    res = _same_streamed("hermes", text)
    assert [(c.name, c.arguments) for c in res.calls] == [("get", '{"a": 1}')]
    assert res.content == "Let me check.\n"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get", "arguments": {"a": 1}}\nmore text',  # not only the call
        '<tool_call>\n{"name": "get", "arguments": {"a": "</tool_call>',  # cut off inside a string
        '<tool_call>\n{"name": "get", "arguments": {"a": 1}',  # cut off
    ],
)
def test_hermes_unterminated_call_that_is_not_complete_is_text(text: str) -> None:
    res = _same_streamed("hermes", text)
    assert res.calls == ()
    assert res.content == text


# --- F4: llama3's <|python_tag|> after text (SGLang's llama32 detector splits there) ---------------------


def test_llama3_python_tag_after_text() -> None:
    text = 'Let me look that up.<|python_tag|>{"name": "get", "parameters": {"a": 1}}'
    res = _same_streamed("llama3", text)
    assert [(c.name, c.arguments) for c in res.calls] == [("get", '{"a": 1}')]
    assert res.content == "Let me look that up."


def test_llama3_python_tag_after_text_then_more() -> None:
    text = (
        'One.<|python_tag|>{"name": "a", "parameters": {}}; '
        '{"name": "b", "parameters": {"x": "<|python_tag|>"}}'
        ' Two.<|python_tag|>not json <|python_tag|>{"name": "c", "parameters": {}}'
    )
    res = _same_streamed("llama3", text)
    assert _calls(res) == [("a", {}), ("b", {"x": "<|python_tag|>"}), ("c", {})]
    assert res.content == "One.Two.<|python_tag|>not json "


def test_llama3_plain_text_and_partial_tag_come_back() -> None:
    for text in ("Paris is the capital. <|python", "a <|python_tag|>", "x <|python_tag|> \n"):
        res = _same_streamed("llama3", text)
        assert res.calls == () and res.content == text


# --- F5: parameter types (qwen3-coder: declared ``type`` or string; glm45: SGLang's inference) ---------


def test_qwen3_coder_optional_str_and_undeclared_stay_strings() -> None:
    text = (
        "<tool_call>\n<function=lookup>\n<parameter=zip>\n12345\n</parameter>\n<parameter=extra>\n42\n"
        "</parameter>\n<parameter=n>\n7\n</parameter>\n<parameter=note>\nNULL\n</parameter>\n"
        '<parameter=opts>\n{"k": [1]}\n</parameter>\n</function>\n</tool_call>'
    )
    res = _same_streamed("qwen3_coder", text, tools=TOOLS)
    assert _calls(res) == [
        ("lookup", {"zip": "12345", "extra": "42", "n": 7, "note": None, "opts": {"k": [1]}})
    ]


def test_glm45_optional_str_stays_string_and_undeclared_is_parsed() -> None:
    text = (
        "<tool_call>lookup\n<arg_key>zip</arg_key>\n<arg_value>12345</arg_value>\n"
        "<arg_key>extra</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    )
    res = _same_streamed("glm45", text, tools=TOOLS)
    assert _calls(res) == [("lookup", {"zip": "12345", "extra": 42})]


@pytest.mark.parametrize(
    ("schema", "inferred"),
    [
        ({"type": "integer"}, "integer"),
        ({"type": ["null", "number"]}, "number"),
        ({"type": ["null"]}, "string"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "string"),
        ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "integer"),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "string"),
        ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "integer"),
        ({"enum": ["a", "b"]}, "string"),
        ({"enum": [1, 2]}, "integer"),
        ({"enum": [1, "a"]}, "string"),
        ({"allOf": [{"description": "x"}, {"type": "number"}]}, "number"),
        ({"allOf": [{"description": "x"}]}, "string"),
        ({"properties": {}}, "object"),
        ({"items": {}}, "array"),
        ({"description": "anything"}, None),
    ],
)
def test_type_inference_follows_sglang(schema: dict[str, Any], inferred: str | None) -> None:
    assert infer_type(schema) == inferred


def test_param_types_declared_inferred_and_branch_properties() -> None:
    tools = [
        {"name": "f", "parameters": {"anyOf": [{"properties": {"a": {"type": "integer"}}}]}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"b": {"enum": [1]}}}}},
    ]
    assert param_types(tools) == {
        "f": {"a": ParamType("integer", "integer")},
        "g": {"b": ParamType(None, "integer")},
    }
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(5000):  # an untrusted schema: inference stops at a fixed depth
        deep = {"anyOf": [deep]}
    assert infer_type(deep) is None


# --- F6: white space floods: the text a parser re-reads with each piece stays bounded -------------------


def _held(parser: ToolParser | ReasoningParser) -> int:
    held = cast(Any, parser)._buf
    assert isinstance(held, str)
    return len(held)


_FLOODS: list[tuple[str, Callable[[], ToolParser | ReasoningParser], str, str]] = [
    ("llama3 leading", lambda: get_tool_parser("llama3"), "", "\n \t"),
    ("llama3 after tag", lambda: get_tool_parser("llama3"), "<|python_tag|>", "\n "),
    ("llama3 after a call", lambda: get_tool_parser("llama3"), '{"name": "f", "parameters": {}}', " ;\n"),
    ("pythonic after a call", lambda: get_tool_parser("pythonic"), "[f()]<|python_end|>", "\n"),
    ("json leading", lambda: get_tool_parser("json"), "", " \n"),
    (
        "hermes after a call",
        lambda: get_tool_parser("hermes"),
        '<tool_call>{"name":"f","arguments":{}}</tool_call>',
        "\n",
    ),
    ("kimi inside a section", lambda: get_tool_parser("kimi_k2"), KIMI_BEGIN, "\n "),
    ("mistral after a call", lambda: get_tool_parser("mistral"), "[TOOL_CALLS]f[ARGS]{}", "\n"),
    ("mistral after the tag", lambda: get_tool_parser("mistral"), "[TOOL_CALLS]", "\n "),
    ("mistral after [ARGS]", lambda: get_tool_parser("mistral"), "[TOOL_CALLS]f[ARGS]", "\n "),
    ("deepseek_r1 leading", lambda: get_reasoning_parser("deepseek_r1"), "", "\n"),
    ("qwen3 leading", lambda: get_reasoning_parser("qwen3"), "", "\n "),
    ("qwen3 opened by the prompt", lambda: get_reasoning_parser("qwen3", prompt_opened_think=True), "", "\n"),
    ("qwen3 after the block", lambda: get_reasoning_parser("qwen3"), "<think>x</think>", "\n"),
]


@pytest.mark.parametrize(("name", "make", "head", "unit"), _FLOODS, ids=[f[0] for f in _FLOODS])
def test_white_space_flood_is_linear_work(
    name: str, make: Callable[[], ToolParser | ReasoningParser], head: str, unit: str
) -> None:
    """Deterministic, no clock: every ``feed`` re-reads the text held from before plus the new piece, so
    held text bounded by the markers' length (white space is decided at once, never held) means work
    linear in the output; the quadratic version held all the white space and re-read it with every
    character (here 9000 characters, read ~40 million times)."""
    parser = make()
    parser.feed(head)
    most = 0
    for ch in unit * 3000:
        parser.feed(ch)
        most = max(most, _held(parser))
    assert most <= 32, name


def test_white_space_flood_results_are_unchanged() -> None:
    ws = "\n \t" * 100
    assert run_tools(get_tool_parser("llama3"), list(ws)) == CollectedTools(ws, ())
    assert run_tools(get_tool_parser("llama3"), list(ws + 'x {"a"')) == CollectedTools(ws + 'x {"a"', ())
    res = run_tools(
        get_tool_parser("llama3"), list(ws + '<|python_tag|>\n{"name": "f", "parameters": {}}' + ws)
    )
    assert res.content == "" and [c.name for c in res.calls] == ["f"]
    assert run_reasoning(get_reasoning_parser("qwen3"), list(ws + "Hi")) == ("", ws + "Hi")
    assert run_reasoning(get_reasoning_parser("qwen3"), list(ws + "<think>\nr</think>\n\nHi")) == ("r", "Hi")
    assert run_reasoning(get_reasoning_parser("deepseek_r1"), list(ws + "<think>r</think>Hi")) == ("r", "Hi")
    assert run_reasoning(get_reasoning_parser("qwen3"), list(ws)) == ("", ws)
    assert run_tools(get_tool_parser("mistral"), list("[TOOL_CALLS]" + ws)).content == "[TOOL_CALLS]" + ws
    res = run_tools(get_tool_parser("mistral"), list("[TOOL_CALLS]f[ARGS]" + ws + "{}" + ws + "tail"))
    assert res.content == "tail" and [c.name for c in res.calls] == ["f"]
    text = "[TOOL_CALLS]f[ARGS]" + ws + "oops"
    assert run_tools(get_tool_parser("mistral"), list(text)) == CollectedTools(text, ())


# --- F7: unclosed qwen3-coder parameters: linear in the body ---------------------------------------------


def _best_parse_time(text: str) -> float:
    best = float("inf")
    for _ in range(3):
        parser = get_tool_parser("qwen3_coder")
        t0 = time.perf_counter()
        parser.feed(text)
        parser.finish()
        best = min(best, time.perf_counter() - t0)
    return best


def test_qwen3_coder_unclosed_parameters_cost_what_closed_ones_cost() -> None:
    """Against a well-formed body of as many parameters, not a timed bound: linear work measures about
    1x (0.8 here), the quadratic version 60x and more at this size; the bound leaves 20x headroom."""
    n = 30000
    unclosed = "<tool_call><function=f>" + "<parameter=a>x" * n + "</function></tool_call>"
    closed = "<tool_call><function=f>" + "<parameter=a>x</parameter>" * n + "</function></tool_call>"
    assert _best_parse_time(unclosed) < 20 * _best_parse_time(closed)
    res = _whole(
        "qwen3_coder",
        "<tool_call><function=f><parameter=a>x<parameter=b>y</parameter></function></tool_call>",
    )
    assert _calls(res) == [("f", {"a": "x", "b": "y"})]


# --- F8: text inside a tool-call section; a section without a valid call ----------------------------------

_DS_OK = f'{DS_CALL}function{DS_SEP}f\n```json\n{{"a": 1}}\n```{DS_CALL_END}'


def test_section_stray_text_keeps_its_spaces_when_streamed() -> None:
    chunks = [DS_BEGIN, "Let", " me", " call", " it", _DS_OK + DS_END]
    whole = run_tools(get_tool_parser("deepseek_v3", id_factory=lambda: "id"), ["".join(chunks)])
    assert run_tools(get_tool_parser("deepseek_v3", id_factory=lambda: "id"), chunks) == whole
    assert whole.content == "Let me call it" and _calls(whole) == [("f", {"a": 1})]
    _same_streamed("deepseek_v3", f"A{DS_BEGIN}\n Let me  call it {_DS_OK}\n then {DS_END}B")


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("deepseek_v31", f"{DS_BEGIN}\n{DS_CALL}f{DS_SEP}{{bad{DS_CALL_END}\n{DS_END}after"),
        ("deepseek_v31", f"{DS_BEGIN} stray {DS_END}"),
        (
            "kimi_k2",
            f"x{KIMI_BEGIN}<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            f'{{"a": NaN}}<|tool_call_end|>{KIMI_BEGIN}{KIMI_END}',
        ),
    ],
)
def test_section_closed_without_a_valid_call_is_verbatim_text(family: str, text: str) -> None:
    res = _same_streamed(family, text)
    assert res.calls == () and res.content == text


def test_section_with_a_valid_call_drops_its_markers() -> None:
    text = f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{bad{DS_CALL_END} and {DS_CALL}g{DS_SEP}{{}}{DS_CALL_END}{DS_END}"
    res = _same_streamed("deepseek_v31", text)
    assert res.content == f"{DS_CALL}f{DS_SEP}{{bad{DS_CALL_END}and " and _calls(res) == [("g", {})]


# --- F9: pythonic: one closing tag after the calls, whatever the chunking ---------------------------------


def test_pythonic_repeated_end_tag() -> None:
    res = _same_streamed("pythonic", "[f(a=1)]<|python_end|><|python_end|>")
    assert res.content == "<|python_end|>" and _calls(res) == [("f", {"a": 1})]
    res = _same_streamed("pythonic", "<|python_start|>[f()]<|python_end|>\n[g()]<|python_end|> done")
    assert res.content == "done" and _calls(res) == [("f", {}), ("g", {})]


# --- F10: arguments are strict JSON ----------------------------------------------------------------------


def _strict(name: str) -> Any:
    raise ValueError(name)


def test_kimi_arguments_are_the_models_text() -> None:
    args = '{"x": 1e999, "y":[1,2]}'
    text = (
        f"{KIMI_BEGIN}<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|> {args} "
        f"<|tool_call_end|>{KIMI_END}"
    )
    (call,) = _same_streamed("kimi_k2", text).calls
    assert call.arguments == args
    json.loads(call.arguments, parse_constant=_strict)


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>'),  # re-serialised
        ("json", '{"name": "f", "arguments": {"x": -Infinity}}'),
        ("pythonic", "[f(x=1e999)]"),
        (
            "kimi_k2",
            f"{KIMI_BEGIN}<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            f'{{"x": Infinity}}<|tool_call_end|>{KIMI_END}',
        ),
    ],
)
def test_arguments_json_cannot_hold_are_text(family: str, text: str) -> None:
    res = _whole(family, text)
    assert res.calls == () and res.content == text


# --- F11: harmony headers: the same limit whole and streamed ---------------------------------------------


@pytest.mark.parametrize("size", [400, 490, 505, 600])
def test_harmony_long_header_streamed_equals_whole(size: int) -> None:
    text = "<|channel|>final " + "x" * size + "<|message|>hello<|end|><|channel|>final<|message|>bye<|end|>"
    whole = run_reasoning(get_reasoning_parser("gpt_oss"), [text])
    for chunks in _splits(text):
        assert run_reasoning(get_reasoning_parser("gpt_oss"), chunks) == whole
    if size < 490:
        assert whole == ("", "hellobye")
    elif size > 500:  # not a header: its markup is text, and the header after it is read
        assert whole == ("", text.split("<|channel|>final<|message|>")[0] + "bye")


# --- chunking invariance over hostile alphabets ------------------------------------------------------------

_ALPHABETS = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        '{"name": "f", "arguments": {"a": "',
        '"}}',
        '"',
        "\\",
        "\n",
        "x",
    ],
    "llama3": ["<|python_tag|>", "<|py", ";", '{"name": "f", "parameters": {}}', "{", "}", '"', "x ", "\n"],
    "pythonic": ["<|python_start|>", "<|python_end|>", "[f(a=1)]", "[", "]", "'", "x", "\n"],
    "deepseek_v31": [
        DS_BEGIN,
        DS_END,
        DS_CALL,
        DS_CALL_END,
        f"f{DS_SEP}{{}}",
        f"f{DS_SEP}{{",
        "x",
        " ",
        "\n",
    ],
    "mistral": ["[TOOL_CALLS]", "f[ARGS]", "{}", "[", "x", " ", "\n"],
}


@settings(max_examples=150, deadline=None)
@given(family=st.sampled_from(sorted(_ALPHABETS)), data=st.data())
def test_hostile_text_is_chunking_invariant_and_loses_nothing(family: str, data: st.DataObject) -> None:
    text, whole = drawn_alike_in_chunks(family, data, _ALPHABETS[family], 16)
    for call in whole.calls:
        assert isinstance(json.loads(call.arguments, parse_constant=_strict), dict)
    if not whole.calls and family != "deepseek_v31":
        assert whole.content == text


# --- the chat pipeline: a parser that raises does not fail the request --------------------------------------


class _Raising:
    passthrough = False

    def __init__(self, after: int) -> None:
        self._after = after

    def _tick(self) -> None:
        self._after -= 1
        if self._after < 0:
            raise RuntimeError("parser bug")

    def feed(self, text: str) -> Any:
        self._tick()
        return [TextDelta(text)]

    def finish(self) -> Any:
        self._tick()
        return []


class _RaisingReasoning(_Raising):
    def feed(self, text: str) -> Any:
        self._tick()
        return text, ""

    def finish(self) -> Any:
        self._tick()
        return "", ""


def _content(events: list[ToolEvent]) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, TextDelta))


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_raising_tool_parser_leaves_the_text_as_content(after: int) -> None:
    post = ChoiceParsing(None, cast(ToolParser, _Raising(after)))
    parts = [post.feed(t)[1] for t in ("a", "b", "c")]
    assert _content([ev for p in parts for ev in p] + post.finish()[1]) == "abc"


def test_a_raising_reasoning_parser_leaves_the_text_as_content() -> None:
    post = ChoiceParsing(cast(ReasoningParser, _RaisingReasoning(1)), None)
    assert post.feed("think") == ("think", [])
    assert post.feed("answer") == ("", [TextDelta("answer")])
    assert post.feed("!") == ("", [TextDelta("!")])
    assert post.finish() == ("", [])


def test_hermes_a_stray_quote_in_one_call_does_not_swallow_the_next() -> None:
    """A string followed by anything but , : } ] is no JSON: the JSON-string tracking stops there, so an
    unescaped quote (a 5" screen) leaves later end tags as end tags: the malformed call is text, the next
    one a call (SGLang: a failing match skipped), and the content after it streams."""
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"size": "5" screen"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    res = _same_streamed("hermes", text, tools=TOOLS)
    assert _calls(res) == [("get_weather", {"city": "Oslo"})]
    p = get_tool_parser("hermes", tools=TOOLS, id_factory=lambda: "id")
    p.feed('<tool_call>{"name": "get_weather", "arguments": {"q": "x"y"}}</tool_call>')
    assert "".join(getattr(e, "text", "") for e in p.feed("\nLet me explain in prose instead. "))
