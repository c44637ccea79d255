"""The Anthropic Messages API's pure parts: request parsing into the chat request
(``node.anthropic.requests``), the Message and its streamed events (``node.anthropic.messages``),
the Anthropic error envelope (``proto.anthropic_errors``, the auth refusal in it), and a property:
for any engine output (think tags, hermes tool-call markup, text) cut anywhere, the Messages stream
and the Chat Completions stream carry the same text, thinking and tool calls (both encoders driven
by the same parser stage, in-process)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
from anthropic.types import RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from shepherd.auth.middleware import AuthFailure
from shepherd.node.anthropic.messages import MessageEvents, message_object, signature, stop_reason
from shepherd.node.anthropic.requests import parse_count_tokens, parse_messages, tool_use_id
from shepherd.node.openai.sse import ChatChunks
from shepherd.node.openai.structured import check_schemas_now
from shepherd.node.output.chat import ChatOutput, ChoiceEncoder, final_reason
from shepherd.proto.anthropic_errors import (
    anthropic_body,
    anthropic_error_response,
    convert_body,
    is_messages_path,
)
from shepherd.proto.openai_errors import ApiError

TOOL = {
    "name": "get_weather",
    "description": "weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENT = TypeAdapter[Any](RawMessageStreamEvent)


def _req(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **kw}


def _bad(d: dict[str, Any], match: str) -> None:
    with pytest.raises(ApiError, match=match) as e:
        parse_messages(d)
    assert e.value.status == 400


# ---- parsing ----


def test_minimal_and_sampling() -> None:
    r = parse_messages(
        _req(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"], metadata={"user_id": "u"})
    )
    c = r.chat
    assert c.messages == [{"role": "user", "content": "hi"}]
    s = c.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop, s.stream) == (
        100,
        0.5,
        0.9,
        5,
        ("END",),
        False,
    )
    assert r.stop_sequences == ("END",) and r.user_id == "u" and not r.thinking
    assert c.template_kwargs == {"enable_thinking": False} and not c.separate_reasoning
    assert c.add_generation_prompt and not c.continue_final_message
    assert c.tools is None and c.tool_choice.mode == "none"


def test_required_and_bounded_fields() -> None:
    d = _req()
    del d["max_tokens"]
    _bad(d, "max_tokens")
    _bad(_req(max_tokens=-1), "max_tokens")
    assert parse_messages(_req(max_tokens=0)).cache_only  # "populate the prompt cache" (the SDK's docs)
    assert not parse_messages(_req(max_tokens=1)).cache_only
    _bad(_req(temperature=1.5), "temperature")
    _bad(_req(top_k=-1), "top_k")
    _bad(_req(stop_sequences="x"), "stop_sequences")
    _bad(_req(stop_sequences=["x"] * 17), "stop_sequences")
    _bad(_req(metadata={"user_id": 5}), "user_id")
    _bad(_req(stream="yes"), "stream")
    _bad({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model")
    _bad(_req(messages=[]), "messages")
    _bad(_req(messages=[{"role": "tool", "content": "x"}]), "role")
    _bad(_req(messages=[{"role": "system", "content": "x"}]), "at least one user or assistant")
    # count_tokens needs no max_tokens
    assert parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "x"}]}).chat.sampling


def test_system_and_blocks() -> None:
    r = parse_messages(
        _req(
            system=[
                {"type": "text", "text": "A"},
                {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                },
                {"role": "assistant", "content": "Sure"},
            ],
        )
    )
    assert r.chat.messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "Sure"},
    ]
    assert r.chat.continue_final_message and not r.chat.add_generation_prompt  # a prefill
    _bad(_req(system=[{"type": "image"}]), "image")
    _bad(_req(system=5), "system")


def test_tool_use_and_results() -> None:
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "down"}],
                    "is_error": True,
                },
                {"type": "text", "text": "and?"},
            ],
        },
    ]
    r = parse_messages(
        _req(messages=msgs, tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    )
    m = r.chat.messages
    assert m[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "hmm",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            },
        ],
    }
    assert m[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "and?"},
    ]
    assert r.chat.tool_choice.mode == "required" and not r.chat.parallel_tool_calls
    assert r.chat.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": TOOL["input_schema"], "description": "weather"},
        }
    ]
    # a tool_result without its tool_use, before it, or answered twice
    orphan = [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
    ]
    _bad(_req(messages=orphan), "tool_use_id")
    _bad(_req(messages=[*msgs, msgs[2]]), "answered twice")
    _bad(_req(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image")
    _bad(_req(messages=[{"role": "user", "content": [{"type": "video"}]}]), "not supported")


def test_tools_and_tool_choice() -> None:
    assert parse_messages(_req(tools=[TOOL])).chat.tool_choice.mode == "auto"
    named = parse_messages(
        _req(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    ).chat.tool_choice
    assert (named.mode, named.name) == ("function", "get_weather")
    assert parse_messages(_req(tools=[TOOL], tool_choice={"type": "none"})).chat.tool_choice.mode == "none"
    _bad(_req(tools=[TOOL], tool_choice={"type": "tool", "name": "other"}), "tool_choice")
    _bad(_req(tool_choice={"type": "any"}), "tool_choice")
    _bad(_req(tools=[TOOL], tool_choice={"type": "sometimes"}), "tool_choice")
    _bad(_req(tools=[{"name": "x"}]), "input_schema")
    _bad(_req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools")
    _bad(_req(tools=[TOOL, TOOL]), "unique")
    # schemas: bounded at parse time, meta-validated later (deferred)
    bad_schema = {**TOOL, "input_schema": {"type": "object", "properties": 5}}
    r = parse_messages(_req(tools=[bad_schema]))
    assert len(r.chat.schemas) == 1
    with pytest.raises(ApiError, match="input_schema"):
        check_schemas_now(r.chat.schemas)
    huge = {**TOOL, "input_schema": {"type": "object", "description": "x" * (600 * 1024)}}
    _bad(_req(tools=[huge]), "KiB")


def test_tool_names_and_schema_types_as_anthropic_checks_them() -> None:
    for name in ("a.b", "a b", "x" * 129, "", "é"):
        _bad(_req(tools=[{**TOOL, "name": name}]), "should match pattern")
    assert parse_messages(_req(tools=[{**TOOL, "name": "mcp__srv__get-x_1" + "y" * 100}])).chat.tools
    for schema in ({}, {"type": "string"}, {"type": ["object"]}):
        _bad(_req(tools=[{**TOOL, "input_schema": schema}]), "Input should be 'object'")


def _call(tid: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": "get_weather", "input": {}}


def _result(tid: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tid, "content": "ok"}


def test_a_tool_use_is_answered_in_the_next_turn() -> None:
    """Anthropic's transcript checks: every tool_use answered by the user turn right after it, every
    tool_result answering the assistant turn right before, tools defined when either is there."""
    user = {"role": "user", "content": "hi"}

    def asst(*blocks: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": list(blocks)}

    def usr(*blocks: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": list(blocks)}

    ok = [
        user,
        asst(_call("t1"), _call("t2")),
        usr(_result("t1"), _result("t2")),
        asst(_call("t3")),
        usr(_result("t3")),
    ]
    assert len(parse_messages(_req(tools=[TOOL], messages=ok)).chat.messages) == 6  # (a tool message each)
    # consecutive user messages are one turn: the results may come in two of them
    split = [user, asst(_call("t1"), _call("t2")), usr(_result("t1")), usr(_result("t2"))]
    assert parse_messages(_req(tools=[TOOL], messages=split))
    unanswered = [user, asst(_call("t1")), {"role": "user", "content": "next"}]
    _bad(_req(tools=[TOOL], messages=unanswered), r"messages.1: `tool_use` ids were found without .* t1")
    partly = [user, asst(_call("t1"), _call("t2")), usr(_result("t1"))]
    _bad(_req(tools=[TOOL], messages=partly), "immediately after: t2")
    late = [
        user,
        asst(_call("t1")),
        usr(_result("t1")),
        asst({"type": "text", "text": "x"}),
        usr(_result("t1")),
    ]
    _bad(_req(tools=[TOOL], messages=late), "unexpected `tool_use_id`")
    skipped = [
        user,
        asst(_call("t1")),
        {"role": "user", "content": "x"},
        asst(_call("t2")),
        usr(_result("t1")),
    ]
    _bad(_req(tools=[TOOL], messages=skipped), "immediately after: t1")
    _bad(_req(messages=ok), "must define tools")
    named = [user, asst({**_call("t1"), "name": "a b"}), usr(_result("t1"))]
    _bad(_req(tools=[TOOL], messages=named), "should match pattern")


def test_text_blocks_must_hold_text_and_a_prefill_no_trailing_space() -> None:
    _bad(_req(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]), "non-empty")
    _bad(_req(messages=[{"role": "user", "content": "  \n"}]), "non-whitespace")
    blank = [{"type": "text", "text": "a"}, {"type": "text", "text": " "}]
    _bad(_req(messages=[{"role": "user", "content": blank}]), "non-whitespace")
    mid = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": " "},
        {"role": "user", "content": "b"},
    ]
    _bad(_req(messages=mid), "non-whitespace")
    prefill: list[dict[str, Any]] = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "Sure, "},
    ]
    _bad(_req(messages=prefill), "trailing whitespace")
    prefill[1]["content"] = [{"type": "text", "text": "Sure,\n"}]
    _bad(_req(messages=prefill), "trailing whitespace")
    prefill[1]["content"] = "Sure,"
    assert parse_messages(_req(messages=prefill)).chat.continue_final_message
    prefill[1]["content"] = [{"type": "text", "text": "Sure, "}, {"type": "text", "text": "here"}]
    assert parse_messages(_req(messages=prefill)).chat.continue_final_message  # (it ends with "here")
    prefill[1]["content"] = ""  # an empty prefill: none
    assert not parse_messages(_req(messages=prefill)).chat.continue_final_message


def test_thinking() -> None:
    r = parse_messages(_req(max_tokens=4000, thinking={"type": "enabled", "budget_tokens": 2000}))
    assert r.thinking and r.thinking_budget == 2000
    assert r.chat.template_kwargs == {"enable_thinking": True} and r.chat.separate_reasoning
    assert not parse_messages(_req(thinking={"type": "disabled"})).thinking
    _bad(_req(max_tokens=4000, thinking={"type": "enabled", "budget_tokens": 100}), "budget_tokens")
    _bad(_req(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 2000}), "max_tokens")
    _bad(_req(thinking={"type": "maybe"}), "thinking")
    # adaptive (the current SDK's first choice): thinking on, no budget
    r = parse_messages(_req(thinking={"type": "adaptive"}))
    assert r.thinking and r.thinking_budget is None and r.chat.separate_reasoning


def test_system_messages_and_claude_codes_billing_header() -> None:
    billing = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;"
    system = [{"type": "text", "text": billing}, {"type": "text", "text": "Be brief."}]
    user = {"role": "user", "content": "a"}
    r = parse_messages(
        _req(
            system=system,
            messages=[
                {"role": "system", "content": "Lead."},  # (leading: joins the top-level system)
                user,
                {"role": "system", "content": [{"type": "text", "text": "One."}]},
                {"role": "system", "content": "Two."},
                {"role": "user", "content": "b"},
                {"role": "system", "content": "Gone.", "clear_at": "next_user_message"},
                {"role": "user", "content": "c"},
                {"role": "system", "content": "Shown.", "clear_at": "next_user_message"},
            ],
        )
    )
    assert r.chat.messages == [
        {"role": "system", "content": "Be brief.\nLead."},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "One.\nTwo."},
        {"role": "user", "content": "b\nc"},
        {"role": "system", "content": "Shown."},
    ]
    assert r.chat.add_generation_prompt and not r.chat.continue_final_message
    # a client that flattened the blocks: the header's line
    flat = parse_messages(_req(system=billing + "\nBe brief.")).chat.messages
    assert flat[0] == {"role": "system", "content": "Be brief."}
    # a system message between a tool_use and its tool_result is no turn of the pairing
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}
    msgs = [
        user,
        {"role": "assistant", "content": [call]},
        {"role": "system", "content": "Note."},
        {"role": "user", "content": [result]},
    ]
    assert [m["role"] for m in parse_messages(_req(messages=msgs, tools=[TOOL])).chat.messages] == [
        "user",
        "assistant",
        "system",
        "tool",
    ]
    _bad(_req(messages=[user, {"role": "system", "content": ""}]), "content")
    _bad(
        _req(messages=[user, {"role": "system", "content": [{"type": "text", "text": " "}]}]),
        "non-whitespace",
    )
    _bad(_req(messages=[user, {"role": "system", "content": [{"type": "image"}]}]), "text blocks only")
    _bad(_req(messages=[user, {"role": "system", "content": "x", "clear_at": "later"}]), "clear_at")


def test_consecutive_turns_of_one_role_are_one_turn() -> None:
    user = {"role": "user", "content": "a"}
    msgs = [user, {"role": "user", "content": [{"type": "text", "text": "b"}]}]
    assert parse_messages(_req(messages=msgs)).chat.messages == [{"role": "user", "content": "a\nb"}]
    # a prefill written as two assistant turns: one continued answer
    r = parse_messages(
        _req(
            messages=[
                user,
                {"role": "assistant", "content": "first"},
                {"role": "assistant", "content": " second"},
            ]
        )
    )
    assert r.chat.messages[1:] == [{"role": "assistant", "content": "first second"}]
    assert r.chat.continue_final_message
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    turns = [
        user,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "x"}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]},
    ]
    m = parse_messages(_req(messages=turns, tools=[TOOL])).chat.messages
    assert [x["role"] for x in m] == ["user", "assistant", "tool"]
    assert (m[1]["content"], m[1]["reasoning_content"], len(m[1]["tool_calls"])) == ("x", "t", 1)


def test_consecutive_turns_are_merged_once_not_per_message() -> None:
    """Each message of a turn is set aside as it comes and the turn joined once at the end: merging each as
    it came copied the turn's text so far every time (quadratic: a 15 MB request of short user messages
    held the event loop for minutes). Checked without a clock: the turn's first text is untouched until
    the join, which gives the same turn."""
    from shepherd.node.anthropic.requests import _add_turn, _join_turns

    text = "x" * 400
    first = {"role": "user", "content": text}
    out: list[dict[str, Any]] = []
    for msg in (first, *({"role": "user", "content": text} for _ in range(999))):
        _add_turn(out, msg)
    assert len(out) == 1 and out[0]["content"] is text  # nothing joined per message
    _join_turns(out)
    assert out == [{"role": "user", "content": "\n".join([text] * 1000)}]
    got = parse_messages(_req(messages=[{"role": "user", "content": text}] * 3)).chat.messages
    assert got == [{"role": "user", "content": "\n".join([text] * 3)}]


def test_structured_outputs_and_strict_tools_reach_the_chat_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for d in (
        _req(output_config={"format": {"type": "json_schema", "schema": schema}}),
        _req(output_format={"type": "json_schema", "schema": schema}),  # the beta's spelling
    ):
        chat = parse_messages(d).chat
        assert chat.response_format == {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True},
        }
        assert len(chat.schemas) == 1  # meta-validated later, as a tool's input_schema
    bad_schema = parse_messages(
        _req(output_config={"format": {"type": "json_schema", "schema": {"type": 5}}})
    )
    with pytest.raises(ApiError, match=r"output_config\.format\.schema"):
        check_schemas_now(bad_schema.chat.schemas)
    _bad(_req(output_config={"format": {"type": "xml"}}), "output_config.format")
    _bad(_req(output_config={"format": {"type": "json_schema"}}), "output_config.format")
    _bad(_req(output_config={"colour": "red"}), "output_config.colour")
    _bad(_req(output_config={"effort": "extreme"}), "output_config.effort")
    _bad(_req(output_config=[]), "output_config")
    # the task-budgets beta's budget: checked, a hint as effort is (it was refused as an extra input)
    budget = {"effort": "high", "task_budget": {"type": "tokens", "total": 100000, "remaining": 5}}
    assert parse_messages(_req(output_config=budget)).chat.response_format is None
    for wrong, where in (
        ({"type": "time", "total": 5}, "output_config.task_budget"),
        ({"type": "tokens", "total": 0}, "output_config.task_budget.total"),
        ({"type": "tokens", "total": 5, "remaining": 6}, "output_config.task_budget.remaining"),
        ({"type": "tokens", "total": 5, "colour": 1}, "output_config.task_budget.colour"),
    ):
        _bad(_req(output_config={"task_budget": wrong}), where)
    # effort: checked, a hint (as budget_tokens): no template switch is asked of the model's template
    on = _req(output_config={"effort": "low"}, thinking={"type": "adaptive"})
    assert parse_messages(on).chat.reasoning_effort is None
    # a strict tool's input is constrained to its schema, as a strict OpenAI function's
    tools = parse_messages(_req(tools=[{**TOOL, "strict": True}, {**TOOL, "name": "other"}])).chat.tools
    assert tools is not None
    assert [t["function"].get("strict") for t in tools] == [True, None]
    _bad(_req(tools=[{**TOOL, "strict": "yes"}]), "strict")


# ---- answers ----


def test_stop_reason_and_ids() -> None:
    assert stop_reason("tool_calls", None, ()) == ("tool_use", None)
    assert stop_reason("length", None, ()) == ("max_tokens", None)
    assert stop_reason("stop", "END", ("END",)) == ("stop_sequence", "END")
    assert stop_reason("stop", 151645, ("END",)) == ("end_turn", None)
    assert tool_use_id("call_abc") == "toolu_abc" and tool_use_id("toolu_x") == "toolu_x"
    assert signature("x") and signature("x") == signature("x") != signature("y")


def test_kimi_k2_call_ids_are_anthropic_ids_that_come_back_as_kimis() -> None:
    """Kimi K2's ids (``functions.NAME:N``) hold "." and ":", which Anthropic's id pattern refuses: the
    tool_use block gets ``toolu_functions-NAME-N``, and a later request's history gives the template the
    id the model wrote (its parser reads the name from it; its template renders it back)."""
    import re

    tid = tool_use_id("functions.get-weather_2:7")
    assert tid == "toolu_functions-get-weather_2-7" and re.fullmatch(r"[a-zA-Z0-9_-]+", tid)
    r = parse_messages(
        _req(
            tools=[{"name": "get-weather_2", "input_schema": {"type": "object"}}],
            messages=[
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": tid, "name": "get-weather_2", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": tid, "content": "sunny"}],
                },
            ],
        )
    )
    call, result = r.chat.messages[1], r.chat.messages[2]
    assert call["tool_calls"][0]["id"] == "functions.get-weather_2:7"
    assert result["tool_call_id"] == "functions.get-weather_2:7"
    # any other id, a client's own included, goes to the template as it came
    assert (
        tool_use_id("call_abc") == "toolu_abc" and tool_use_id("functions.a.b:1") == "toolu_functions.a.b:1"
    )


def test_message_object() -> None:
    # a non-streamed answer's blocks: the stream's encoder, quiet (no bytes), keeps the blocks it made
    enc = MessageEvents("msg_1", "m", 1, quiet=True)
    made = [
        enc.role(0),
        enc.reasoning(0, "thi"),
        enc.reasoning(0, "nk"),
        enc.tool_call(0, 0, "call_1", "f"),
        enc.tool_args(0, 0, '{"a":'),
        enc.tool_args(0, 0, " 1}"),
        enc.content(0, "Done"),
        enc.finish(0, "tool_calls"),
    ]
    assert made == [b""] * len(made)
    usage = {
        "input_tokens": 1,
        "output_tokens": 2,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    m = enc.message(usage)
    assert m["content"] == [
        {"type": "thinking", "thinking": "think", "signature": signature("think")},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": "Done"},
    ]
    assert (m["stop_reason"], m["stop_sequence"], m["usage"]) == ("tool_use", None, usage)
    assert message_object("msg_1", "m", m["content"], ("tool_use", None), usage) == m


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        if ev["type"] not in ("error", "ping"):
            EVENT.validate_python(ev)  # the SDK's own event models
        out.append(ev)
    return out


def test_stream_events() -> None:
    enc = MessageEvents("msg_1", "m", 7, ("END",))
    raw = (
        enc.role(0)
        + enc.reasoning(0, "a")
        + enc.reasoning(0, "b")
        + enc.content(0, "")
        + enc.content(0, "hi")
        + enc.tool_call(0, 0, "call_x", "f")
        + enc.tool_args(0, 0, '{"a":')
        + enc.tool_args(0, 0, " 1}")
        + enc.finish(0, "stop", "END")
        + asyncio.run(enc.end(7, 5, 3))
    )
    evs = _events(raw)
    assert [e["type"] for e in evs] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert evs[0]["message"]["content"] == [] and evs[0]["message"]["usage"]["input_tokens"] == 7
    assert evs[5]["delta"] == {"type": "signature_delta", "signature": signature("ab")}
    assert evs[10]["content_block"] == {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}
    assert [e["index"] for e in evs if "index" in e] == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert evs[-2]["usage"] == {
        "input_tokens": 4,
        "output_tokens": 5,
        "cache_read_input_tokens": 3,
        "cache_creation_input_tokens": 0,
    }


def test_stream_failure_is_an_error_event() -> None:
    enc = MessageEvents("msg_1", "m", 1)
    evs = _events(enc.role(0) + enc.content(0, "x") + enc.failed("the engine failed", "engine_error"))
    assert evs[-1] == {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
    # a timeout is Anthropic's timeout_error (its 504), in band as out of band
    enc = MessageEvents("msg_2", "m", 1)
    evs = _events(enc.role(0) + enc.failed("engine timed out: 8 s", "engine_timeout"))
    assert evs[-1]["error"]["type"] == "timeout_error"
    assert anthropic_body(504, "late")["error"]["type"] == "timeout_error"


# ---- the error envelope ----


def test_a_thread_is_refused_as_the_sdk_recovers_from() -> None:
    """The message-threads beta (the SDK's tool runner sends it): a 400 whose ``details.error_code`` is
    ``thread_unsupported_request``, checked before the messages (a continued thread's start with tool
    results answering the reply it continues)."""
    results = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]
    for thread in ({"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}):
        for parse in (parse_messages, parse_count_tokens):
            with pytest.raises(ApiError) as e:
                parse(_req(thread=thread, messages=[{"role": "user", "content": results}]))
            assert e.value.code == "thread_unsupported_request"
            body = orjson.loads(anthropic_error_response(e.value).body)  # type: ignore[arg-type]
            assert body["error"]["details"] == {"error_code": "thread_unsupported_request"}
            assert body["error"]["type"] == "invalid_request_error"
    assert parse_messages(_req(thread=None)).chat.messages == [{"role": "user", "content": "hi"}]
    assert "details" not in anthropic_body(400, "why", "unsupported_content")["error"]


def test_error_envelope() -> None:
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")
    for status, kind, out in [
        (400, "invalid_request_error", 400),
        (401, "authentication_error", 401),
        (403, "permission_error", 403),
        (404, "not_found_error", 404),
        (429, "rate_limit_error", 429),
        (500, "api_error", 500),
        (502, "api_error", 500),  # an engine's failure: Anthropic's internal error (it documents no 502)
        (503, "overloaded_error", 529),
    ]:
        got = convert_body(status, ApiError(status, "why").body())
        assert got is not None
        assert got[0] == out and orjson.loads(got[1]) == {
            "type": "error",
            "error": {"type": kind, "message": "why"},
        }
    assert (
        convert_body(400, b'{"type":"error","error":{"type":"x","message":"m"}}') is None
    )  # converted already
    assert convert_body(400, b"not json") is None
    resp = AuthFailure(401, "Invalid API key.", "invalid_api_key").response(anthropic=True)
    assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert isinstance(resp.body, bytes)
    assert orjson.loads(resp.body)["error"] == {"type": "authentication_error", "message": "Invalid API key."}


# ---- the property: Messages and Chat Completions streams carry the same output ----

HERMES_TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}},
)
WORDS = st.text(alphabet='ab <>\n{}"/:', min_size=0, max_size=12)


@st.composite
def outputs(draw: st.DrawFn) -> str:
    parts: list[str] = []
    if draw(st.booleans()):
        parts.append("<think>" + draw(WORDS) + "</think>")
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            parts.append(draw(WORDS))
        else:
            city = draw(st.text(alphabet="xyzé ", min_size=0, max_size=6))
            parts.append(
                '<tool_call>\n{"name": "get_weather", "arguments": '
                + json.dumps({"city": city})
                + "}\n</tool_call>"
            )
    return "\n".join(parts)


def _cuts(text: str, points: list[int]) -> list[str]:
    idx = sorted({p % (len(text) + 1) for p in points})
    out, last = [], 0
    for i in [*idx, len(text)]:
        out.append(text[last:i])
        last = i
    return [p for p in out if p]


def _drive(output: ChatOutput, enc: ChoiceEncoder, pieces: list[str]) -> bytes:
    post = output.choice(enc, 0)
    out: list[bytes] = [enc.role(0)]  # type: ignore[attr-defined]
    for p in pieces:
        post.stream(p, None, out)
    post.stream_end(out)
    out.append(enc.finish(0, *final_reason("stop", None, post.has_calls)))  # type: ignore[attr-defined]
    return b"".join(out)


def _chat_view(raw: bytes) -> tuple[str, str, list[tuple[str, str, str]]]:
    text, thinking = [], []
    calls: dict[int, list[str]] = {}
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: {"):
            continue
        for ch in json.loads(block[6:])["choices"]:
            d = ch["delta"]
            text.append(d.get("content") or "")
            thinking.append(d.get("reasoning_content") or "")
            for tc in d.get("tool_calls") or ():
                fn = tc.get("function") or {}
                entry = calls.setdefault(tc["index"], [tool_use_id(tc["id"]) if tc.get("id") else "", "", ""])
                entry[1] += fn.get("name") or ""
                entry[2] += fn.get("arguments") or ""
    return "".join(text), "".join(thinking), [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


def _messages_view(raw: bytes) -> tuple[str, str, list[tuple[str, str, str]]]:
    text, thinking = [], []
    calls: list[list[str]] = []
    for ev in _events(raw):
        if ev["type"] == "content_block_start" and ev["content_block"]["type"] == "tool_use":
            b = ev["content_block"]
            calls.append([b["id"], b["name"], ""])
        elif ev["type"] == "content_block_delta":
            d = ev["delta"]
            if d["type"] == "text_delta":
                text.append(d["text"])
            elif d["type"] == "thinking_delta":
                thinking.append(d["thinking"])
            elif d["type"] == "input_json_delta":
                calls[-1][2] += d["partial_json"]
    return "".join(text), "".join(thinking), [(c[0], c[1], c[2]) for c in calls]


@settings(max_examples=200, deadline=None)
@given(outputs(), st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
def test_messages_and_chat_streams_agree(text: str, points: list[int], thinking: bool) -> None:
    output = ChatOutput("qwen3" if thinking else None, False, "hermes", HERMES_TOOLS, True)
    pieces = _cuts(text, points)
    chat = _chat_view(_drive(output, ChatChunks("id", 0, "m"), pieces))
    enc = MessageEvents("msg_1", "m", 1)
    raw = _drive(output, enc, pieces) + asyncio.run(enc.end(1, 1, 0))
    msgs = _messages_view(raw)
    # the parsers' call ids are fresh per parser instance: compare the Messages ids' shape, then the rest
    assert all(c[0].startswith("toolu_") for c in msgs[2])
    assert (msgs[0], msgs[1], [c[1:] for c in msgs[2]]) == (chat[0], chat[1], [c[1:] for c in chat[2]])
    for _, _, args in msgs[2]:
        json.loads(args)  # every streamed call's input is whole JSON
    # the stop reason follows the calls
    assert _events(raw)[-2]["delta"]["stop_reason"] == ("tool_use" if msgs[2] else "end_turn")
