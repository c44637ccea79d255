"""Tool calls cut off by the end of the output (``max_tokens``): the parsers' ``partial_calls`` mode (the
Messages API's: Anthropic answers such a call as a ``tool_use`` block, its input as far as it goes, with
``stop_reason: max_tokens``), its JSON reader against the SDK's own (jiter's partial mode), and the chat
completions path, which keeps vLLM's answer (the cut call is text)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.anthropic.messages import MessageEvents, messages_usage
from shepherd.node.output.chat import ChatOutput, final_reason, replay
from shepherd.parsers import TextDelta, ToolCallArgs, ToolCallStart, ToolEvent, get_tool_parser
from shepherd.parsers.partial_json import partial_array, partial_json

jiter = pytest.importorskip("jiter")  # (the anthropic SDK's partial JSON reader)

TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
DOCS = [
    '{"city": "Paris", "n": 12.5e3, "ok": true, "x": null, "l": [1, {"a": "b\\u00e9\\"q"}], "z": -3, '
    '"e": {}, "f": [], "g": false}',
    '[{"name": "a", "parameters": {"x": [1, 2, 3]}}, {"name": "b", "parameters": {"y": "\\n"}}]',
    ' { "a" : [ 0 , -0.5 , 1E+2 , "" ] , "b" : { "c" : { } } } ',
]
CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "cel'
WHOLE = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'


def _jiter(text: str) -> tuple[bool, Any]:
    try:
        return True, jiter.from_json(text.encode(), partial_mode=True)
    except ValueError:
        return False, None


@pytest.mark.parametrize("doc", DOCS)
def test_partial_json_reads_every_cut_as_the_sdk_does(doc: str) -> None:
    for i in range(len(doc) + 1):
        ok, want = _jiter(doc[:i])
        got = partial_json(doc[:i])
        if ok:
            assert got == (True, want), doc[:i]
        else:  # jiter refuses a text with nothing in it; partial_json says so
            assert got == (False, None), doc[:i]


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
        max_leaves=8,
    ),
    st.data(),
)
def test_partial_json_agrees_with_jiter_on_any_value(value: Any, data: st.DataObject) -> None:
    import json

    doc = json.dumps(value)
    i = data.draw(st.integers(1, len(doc)))
    assert partial_json(doc[:i]) == _jiter(doc[:i])


@pytest.mark.parametrize("bad", ['{"a" 1', "[1 2", "{1: 2}", "nul1", '{"a": 1} x', "tx"])
def test_partial_json_refuses_what_is_not_the_beginning_of_json(bad: str) -> None:
    with pytest.raises(ValueError):
        partial_json(bad)


def test_partial_array_says_whether_its_last_item_is_cut() -> None:
    assert partial_array('[{"a": 1}, {"b": 2') == ([{"a": 1}, {"b": 2}], True)
    assert partial_array('[{"a": 1},') == ([{"a": 1}], False)
    assert partial_array('[{"a": 1}, "x') == ([{"a": 1}], False)  # a cut string: not an item
    assert partial_array("[") == ([], False)


def _run(family: str, text: str, partial: bool, step: int = 0) -> list[ToolEvent]:
    p = get_tool_parser(family, tools=TOOLS, known_names_only=True, partial_calls=partial)
    out: list[ToolEvent] = []
    for i in range(0, len(text), step or len(text) or 1):
        out += p.feed(text[i : i + (step or len(text))])
    return out + p.finish()


def _calls(events: list[ToolEvent]) -> list[tuple[str, str, bool]]:
    heads = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgs):
            args[e.index] = args.get(e.index, "") + e.json
    return [(h.name, args[i], h.partial) for i, h in sorted(heads.items())]


def _text(events: list[ToolEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_hermes_call_cut_off_is_a_partial_call_with_its_input_so_far() -> None:
    for step in (0, 1, 7):  # whole, and fed a character at a time, and in pieces: the same
        ev = _run("hermes", "Checking.\n" + WHOLE + CUT, partial=True, step=step)
        assert _text(ev) == "Checking.\n"
        assert _calls(ev) == [
            ("get_time", "{}", False),
            ("get_weather", '{"city": "Paris", "days": 3}', True),  # the cut string is not read
        ]


def test_hermes_cut_inside_the_end_marker_is_a_whole_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_'
    assert _calls(_run("hermes", text, partial=True)) == [("get_weather", '{"city": "Paris"}', False)]
    assert _text(_run("hermes", text, partial=False)) == text  # (chat: vLLM's text)


def test_hermes_chat_keeps_the_cut_call_as_text_as_vllm_does() -> None:
    """Chat completions (no ``partial_calls``): vLLM's hermes parser answers a call whose JSON does not
    parse as content, the text as it came (SGLang's drops it): unchanged."""
    ev = _run("hermes", "Checking.\n" + CUT, partial=False)
    assert _calls(ev) == [] and _text(ev) == "Checking.\n" + CUT


@pytest.mark.parametrize(
    "tail",
    [
        "<tool_call>",
        "<tool_call>\n",
        '<tool_call>\n{"na',
        '<tool_call>\n{"name": "get_wea',
        '<tool_call>\n{"',
    ],
)
def test_hermes_cut_before_a_whole_name_drops_the_call(tail: str) -> None:
    ev = _run("hermes", "Hi. " + tail, partial=True)
    assert _calls(ev) == [] and _text(ev) == "Hi. "


@pytest.mark.parametrize(
    "tail",
    [
        '<tool_call>\n{"name": "nope", "arguments": {"a": 1',  # not a tool of the request
        "<tool_call>\nnot json at all",
        '<tool_call>\n{"name": 5, "arguments": {',
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2',
    ],
)
def test_hermes_cut_text_that_is_no_call_stays_text(tail: str) -> None:
    ev = _run("hermes", tail, partial=True)
    assert _calls(ev) == [] and _text(ev) == tail


def test_json_family_forced_calls_cut_off() -> None:
    """``tool_choice`` any / tool (the engine held to a JSON array of calls), cut off."""
    whole = '{"name": "get_time", "parameters": {}}'
    ev = _run("json", f'[{whole}, {{"name": "get_weather", "parameters": {{"city": "Ro', partial=True)
    assert _calls(ev) == [("get_time", "{}", False), ("get_weather", "{}", True)]
    ev = _run("json", f"[{whole}, ", partial=True)
    assert _calls(ev) == [("get_time", "{}", False)]
    ev = _run("json", '[{"name": "get_weather", "para', partial=True)
    assert _calls(ev) == [("get_weather", "{}", True)]
    ev = _run("json", '{"name": "get_weather", "parameters": {"city": "Rome"', partial=True)
    assert _calls(ev) == [("get_weather", '{"city": "Rome"}', True)]
    ev = _run("json", '[{"na', partial=True)
    assert ev == []
    cut = f'[{whole}, {{"name": "get_weather", "parameters": {{"city": "Ro'
    assert _text(_run("json", cut, partial=False)) == cut  # chat: text, as before


def test_llama3_cut_off() -> None:
    ev = _run(
        "llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "d', partial=True
    )
    assert _calls(ev) == [("get_weather", '{"city": "Rome"}', True)]


def _message(text: str, reason: str, parallel: bool = True) -> dict[str, Any]:
    """The Messages answer of an output (as ``messages._respond`` builds it)."""
    out = ChatOutput(None, False, "hermes", tuple(TOOLS), parallel, partial_calls=True)
    enc = MessageEvents("msg_1", "qwen3", 10, quiet=True)
    made_calls = replay(out, enc, text, cut=reason == "length")
    enc.finish(0, *final_reason(reason, None, made_calls))
    return enc.message(messages_usage(10, 5, 0))


def test_messages_answer_a_cut_call_as_a_tool_use_block_with_max_tokens() -> None:
    msg = _message("Checking.\n" + CUT, "length")
    assert msg["stop_reason"] == "max_tokens"
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][0]["text"] == "Checking.\n"
    block = msg["content"][1]
    assert block["name"] == "get_weather" and block["input"] == {"city": "Paris", "days": 3}
    assert block["id"].startswith("toolu_")
    # a whole call before it keeps it; the stop reason is still max_tokens
    msg = _message(WHOLE + CUT, "length")
    assert [b.get("name") for b in msg["content"]] == ["get_time", "get_weather"]
    assert msg["stop_reason"] == "max_tokens"
    # cut before the name: no block, no text
    msg = _message('Hi.\n<tool_call>\n{"na', "length")
    assert msg["content"] == [{"type": "text", "text": "Hi.\n"}] and msg["stop_reason"] == "max_tokens"


def test_a_cut_call_is_no_call_made() -> None:
    """An output that ended on its own inside a call (EOS, a stop string: the model wrote a malformed
    call, e.g. its JSON unterminated) has the call as text under ``end_turn``, as chat completions have
    it: never a ``tool_use`` block the client was told not to run (its next turn, without a
    ``tool_result`` for it, would be refused)."""
    bad = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    for text in (CUT, bad):
        msg = _message(text, "stop")
        assert msg["stop_reason"] == "end_turn"
        assert msg["content"] == [{"type": "text", "text": text}]
    msg = _message(WHOLE + CUT, "stop")  # a whole call before it is a call: tool_use, the cut one text
    assert msg["stop_reason"] == "tool_use"
    assert [b["type"] for b in msg["content"]] == ["tool_use", "text"]
    assert msg["content"][1]["text"] == CUT
    out = ChatOutput(None, False, "hermes", tuple(TOOLS), True, partial_calls=True)
    parsed = out.choice().whole(WHOLE + CUT)
    assert [c[1] for c in parsed.calls] == ["get_time"]  # (the chat view: the cut call is not a call)
