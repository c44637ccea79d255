"""The wired chat output path, function level: request → real template → prompt ids; the model turn's
tokens (qwen3 tokenizer) as engine events, split anywhere → the node's ``Generation._drive``
(detokenizer → stop matcher → reasoning parser → tool parser → SSE bytes) → parsed back with the
openai SDK's types. Streamed and non-streamed answers must be the structured message of the case."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from shepherd.node.api.generation import Generation, Job
from shepherd.node.config import NodeConfig
from shepherd.node.metrics import NodeMetrics
from shepherd.node.openai.requests import parse_chat
from shepherd.node.openai.structured import Violation
from shepherd.node.openai.tool_choice import template_tools
from shepherd.node.output.chat import shape_chat
from shepherd.node.output.choice import ChoiceState
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent, TokenLogprob
from tests.unit.test_chat_tools_cases import (
    BY_MODEL,
    CASES,
    TOOLS,
    Family,
    Turn,
    case_id,
    user_messages,
)
from tests.unit.test_tokenizer_shared import qwen3

EOS = 151645  # <|im_end|>


class _Gateway:
    def __init__(self) -> None:
        self.metrics = NodeMetrics()
        self.cfg = NodeConfig()

    def context_length(self, model: str) -> int:
        return 32768


@dataclass
class _Stream:
    events: list[list[EngineEvent]]
    yield_between: bool = False
    completed: bool = False
    trace: None = None  # no CLIENT span: tracing off

    async def batches(self) -> AsyncIterator[list[EngineEvent]]:
        for b in self.events:
            if self.yield_between:
                await asyncio.sleep(0)
            yield b


@dataclass
class Answer:
    """One choice as the client assembles it."""

    content: str | None = None
    reasoning: str | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    finish_reason: str | None = None
    matched_stop: Any = None
    logprob_tokens: int = 0
    violation: str | None = None

    def structured(self) -> tuple[str | None, str | None, list[tuple[str, Any]], str | None]:
        return (
            self.reasoning or None,
            self.content or None,
            [(name, json.loads(args)) for _, name, args in self.calls],
            self.finish_reason,
        )


def setup(
    family: Family, n: int = 1, logprobs: bool = False, **body: Any
) -> tuple[Generation, Job, list[int]]:
    req = parse_chat(
        {
            "model": family.model,
            "messages": user_messages(),
            "tools": TOOLS,
            "chat_template_kwargs": family.kwargs,
            "n": n,
            "logprobs": logprobs,
            **body,
        }
    )
    tok = qwen3()
    prompt = render_req(family, req.messages, template_tools(req.tools, req.tool_choice), req.template_kwargs)
    ids = tok.encode(prompt, add_special_tokens=False)
    shaping = shape_chat((family.reasoning, family.tool), req, prompt)
    states = [ChoiceState(i, tok, shaping.sampling, ids) for i in range(n)]
    g = Generation(
        {},  # type: ignore[arg-type]  # only the request's metric labels are set on it (a dict here)
        _Gateway(),  # type: ignore[arg-type]
        family.model,
        tok,
        shaping.sampling,
        chat=True,
        rid="chatcmpl-test",
        t0=0.0,
        logprobs=0 if logprobs else None,
        shaping=shaping,
    )
    return g, Job(ids, prompt, states, 0), ids


def render_req(
    family: Family, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> str:
    from tests.unit.test_chat_tools_cases import template

    return template(family.template).render(messages, tools=tools, template_kwargs=kwargs)


def output_ids(text: str, eos: bool = True) -> list[int]:
    return qwen3().encode(text, add_special_tokens=False) + ([EOS] if eos else [])


def _lps(ids: Sequence[int], with_lp: bool) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5) for t in ids] if with_lp else []


def chunked(
    outputs: Sequence[list[int]], cuts: Sequence[Sequence[int]], reason: str = "stop", lp: bool = False
) -> list[list[EngineEvent]]:
    """Engine batches: choice i's ids cut at ``cuts[i]``, choices interleaved, then each completes."""
    pieces: list[list[EngineChunk]] = []
    for i, ids in enumerate(outputs):
        bounds = [0, *sorted({c for c in cuts[i] if 0 < c < len(ids)}), len(ids)]
        pieces.append(
            [EngineChunk(i, ids[a:b], logprobs=_lps(ids[a:b], lp)) for a, b in itertools.pairwise(bounds)]
        )
    batches: list[list[EngineEvent]] = []
    for k in range(max(len(p) for p in pieces)):
        batch: list[EngineEvent] = [p[k] for p in pieces if k < len(p)]
        batches.append(batch)
    batches.append([EngineComplete(i, reason) for i in range(len(outputs))])
    return batches


async def run_stream(
    g: Generation, job: Job, events: list[list[EngineEvent]], yield_between: bool = False
) -> bytes:
    out: list[bytes] = []

    async def emit(chunks: list[bytes], last: bool = False) -> None:
        out.extend(chunks)

    await g._drive(_Stream(events, yield_between), job, emit)  # type: ignore[arg-type]
    return b"".join(out)


async def run_whole(
    g: Generation, job: Job, outputs: Sequence[list[int]], reason: str = "stop"
) -> list[Answer]:
    """The non-streamed path: one complete event per choice with all ids (no stop strings)."""
    events: list[EngineEvent] = [
        EngineComplete(i, reason, output_ids=ids, logprobs=_lps(ids, g.logprobs is not None))
        for i, ids in enumerate(outputs)
    ]
    await g._drive(_Stream([events]), job, None)  # type: ignore[arg-type]
    return final(g, job)


def final(g: Generation, job: Job) -> list[Answer]:
    violations: list[Violation] = []
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": g._final_choices(job, violations),
    }
    resp = ChatCompletion.model_validate(body)
    answers = []
    for c in resp.choices:
        m = c.message
        extra = m.model_extra or {}
        answers.append(
            Answer(
                content=m.content,
                reasoning=extra.get("reasoning_content"),
                calls=[(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls or []],  # type: ignore[union-attr]
                finish_reason=c.finish_reason,
                matched_stop=(c.model_extra or {}).get("matched_stop"),
                logprob_tokens=len(c.logprobs.content or []) if c.logprobs else 0,
                violation=(c.model_extra or {}).get("schema_violation"),
            )
        )
    return answers


def parse_sse(data: bytes, n: int = 1) -> list[Answer]:
    """Client side of a stream: every event validated as a ChatCompletionChunk and accumulated;
    checks the OpenAI streaming shape of tool calls on the way."""
    answers = [Answer() for _ in range(n)]
    blocks = data.split(b"\n\n")
    assert blocks[-1] == b""
    started: dict[tuple[int, int], bool] = {}
    for block in blocks[:-1]:
        assert block.startswith(b"data: "), block
        chunk = ChatCompletionChunk.model_validate_json(block[6:])
        for c in chunk.choices:
            a = answers[c.index]
            assert a.finish_reason is None, "nothing after a choice's finish"
            d = c.delta
            if c.logprobs is not None and c.logprobs.content:
                a.logprob_tokens += len(c.logprobs.content)
            if d.content:
                a.content = (a.content or "") + d.content
            r = (d.model_extra or {}).get("reasoning_content")
            if r:
                a.reasoning = (a.reasoning or "") + r
            for tc in d.tool_calls or []:
                key = (c.index, tc.index)
                if key not in started:
                    assert tc.id and tc.type == "function" and tc.function and tc.function.name
                    assert tc.index == len(a.calls), "calls are numbered in order from 0"
                    started[key] = True
                    a.calls.append((tc.id, tc.function.name, tc.function.arguments or ""))
                else:
                    assert tc.id is None and tc.function is not None and tc.function.name is None
                    cid, name, args = a.calls[tc.index]
                    a.calls[tc.index] = (cid, name, args + (tc.function.arguments or ""))
            if c.finish_reason is not None:
                a.finish_reason = c.finish_reason
                a.matched_stop = (c.model_extra or {}).get("matched_stop")
    return answers


def expected(turn: Turn) -> tuple[str | None, str | None, list[tuple[str, Any]], str]:
    return turn.reasoning, turn.content, [(n, a) for n, a in turn.calls], turn.finish_reason


def check_ids(family: Family, answer: Answer) -> None:
    for cid, name, _ in answer.calls:
        if family.tool == "kimi_k2":
            assert cid.startswith(f"functions.{name}:")
        elif family.tool == "mistral":
            assert len(cid) == 9 and cid.isalnum()
        else:
            assert cid.startswith("call_") and len(cid) > 10


# ---- every case, every split point ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_case_streamed_at_every_split_point_and_whole(case: tuple[Family, Turn]) -> None:
    family, turn = case
    ids = output_ids(turn.output)
    want = expected(turn)
    g, job, _ = setup(family)
    whole = (await run_whole(g, job, [ids]))[0]
    assert whole.structured() == want
    check_ids(family, whole)
    for k in range(len(ids) + 1):  # two chunks, split after every token (0 and len: one chunk)
        g, job, _ = setup(family)
        got = parse_sse(await run_stream(g, job, chunked([ids], [[k]])))[0]
        assert got.structured() == want, f"split at token {k}"
    g, job, _ = setup(family)  # one token per engine message
    got = parse_sse(await run_stream(g, job, chunked([ids], [range(len(ids))])))[0]
    assert got.structured() == want
    check_ids(family, got)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_any_chunking_gives_the_same_answer(case: tuple[Family, Turn], cuts: list[int]) -> None:
    family, turn = case
    ids = output_ids(turn.output)
    g, job, _ = setup(family)
    got = parse_sse(asyncio.run(run_stream(g, job, chunked([ids], [cuts]))))[0]
    assert got.structured() == expected(turn)


# ---- request options -------------------------------------------------------------------------------------


QWEN = BY_MODEL["qwen3"]
TWO_CALLS = next(t for t in QWEN.turns if t.label == "several calls")
REASONED_CALL = next(t for t in QWEN.turns if t.label == "one call")


async def both(family: Family, text: str, eos: bool = True, **body: Any) -> tuple[Answer, Answer]:
    ids = output_ids(text, eos)
    g, job, _ = setup(family, **body)
    reason = "stop" if eos else "length"
    whole = (await run_whole(g, job, [ids], reason))[0]
    g, job, _ = setup(family, **body)
    streamed = parse_sse(await run_stream(g, job, chunked([ids], [range(0, len(ids), 3)], reason)))[0]
    return whole, streamed


async def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    for a in await both(QWEN, TWO_CALLS.output, parallel_tool_calls=False):
        assert [c[1] for c in a.calls] == ["get_weather"] and a.content == "Checking both.\n"
        assert a.finish_reason == "tool_calls"


async def test_tool_choice_none_keeps_tools_in_the_prompt_and_parses_nothing() -> None:
    g, job, _ = setup(QWEN, tool_choice="none")  # (vLLM's default: the tools stay in the prompt)
    assert "get_weather" in job.text and g.output is not None and g.output.tool_parser is None
    for a in await both(QWEN, TWO_CALLS.output, tool_choice="none"):
        assert a.calls == [] and a.content == TWO_CALLS.output and a.finish_reason == "stop"
    g, job, _ = setup(QWEN, tool_choice="none", separate_reasoning=False)
    assert g.output is None  # nothing to parse: the plain token path


async def test_separate_reasoning_false_and_thinking_off_leave_the_think_block_in_content() -> None:
    for body in ({"separate_reasoning": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        for a in await both(QWEN, REASONED_CALL.output, **body):
            assert a.reasoning is None and a.content is not None and a.content.startswith("<think>")
            assert [c[1] for c in a.calls] == ["get_weather"]


async def test_deepseek_v31_thinks_only_when_asked() -> None:
    ds = BY_MODEL["deepseek-v3.1"]
    for a in await both(ds, "Hello.", chat_template_kwargs={}):
        assert (a.reasoning, a.content) == (None, "Hello.")
    for a in await both(ds, "Simple.</think>Hello."):
        assert (a.reasoning, a.content) == ("Simple.", "Hello.")


async def test_unknown_tools_malformed_and_truncated_calls_come_back_as_text() -> None:
    texts = [
        'Sure. <tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        "<tool_call>\n{not json}\n</tool_call> tail",
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        "<tool_call>\n<tool_call>\n</tool_call></tool_call>",
    ]
    for text in texts:
        for a in await both(QWEN, text):
            assert a.calls == [] and a.content == text and a.finish_reason == "stop"
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    whole, streamed = await both(QWEN, cut, eos=False, max_tokens=len(output_ids(cut, False)))
    assert whole.calls == [] and whole.content == cut and whole.finish_reason == "length"
    # streamed, the call started once its name came and keeps its arguments as far as they went (as
    # vLLM's and SGLang's streaming parsers send it); the finish stays the cut's
    assert [c[1:] for c in streamed.calls] == [("get_weather", '{"city": "Par')]
    assert not streamed.content and streamed.finish_reason == "length"


async def test_known_and_unknown_calls_mixed_keep_order_and_text() -> None:
    text = f"{TWO_CALLS.output}\n" + '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    for a in await both(QWEN, text):
        assert [c[1] for c in a.calls] == ["get_weather", "get_time"]
        assert a.content == 'Checking both.\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'


async def test_stop_strings_apply_before_the_parsers_and_never_leak() -> None:
    text = f"Hello STOP {TWO_CALLS.output}"
    for a in await both_with_stop(text, ["STOP"]):
        assert (a.content, a.calls, a.finish_reason, a.matched_stop) == ("Hello ", [], "stop", "STOP")
    # a stop string inside a call's arguments cuts the call: a whole answer has it as text, the stop word
    # hidden; a stream had started the call (its name came): its arguments end before the stop word
    whole_a, streamed_a, whole_b, streamed_b = await both_with_stop(REASONED_CALL.output, ["Paris"])
    for a in (whole_a, whole_b):
        assert a.calls == [] and a.content is not None and "Paris" not in a.content
        assert a.content.endswith('"city": "') and a.reasoning == "Need the weather.\n"
    for a in (streamed_a, streamed_b):
        assert [c[1:] for c in a.calls] == [("get_weather", '{"city": "')] and not a.content
        assert a.reasoning == "Need the weather.\n"
    # after the calls: they stand, the tail is cut
    for a in await both_with_stop(TWO_CALLS.output + "\nDONE and more", ["DONE"]):
        assert [c[1] for c in a.calls] == ["get_weather", "get_time"] and a.finish_reason == "tool_calls"
        assert a.content == "Checking both.\n"


async def both_with_stop(text: str, stop: list[str]) -> list[Answer]:
    """Stop strings: the engine streams (also for non-streamed answers) so the gateway can cut."""
    ids = output_ids(text)
    out = []
    for split in ([], list(range(len(ids)))):
        g, job, _ = setup(QWEN, stop=stop)
        await g._drive(_Stream(chunked([ids], [split])), job, None)  # type: ignore[arg-type]
        out.append(final(g, job)[0])
        g, job, _ = setup(QWEN, stop=stop)
        out.append(parse_sse(await run_stream(g, job, chunked([ids], [split])))[0])
    return out


async def test_n_choices_have_their_own_parsers_and_logprobs_survive() -> None:
    a_ids, b_ids = output_ids(TWO_CALLS.output), output_ids(REASONED_CALL.output)
    g, job, _ = setup(QWEN, n=2, logprobs=True)
    events = chunked([a_ids, b_ids], [range(0, len(a_ids), 2), range(0, len(b_ids), 5)], lp=True)
    got = parse_sse(await run_stream(g, job, events), n=2)
    assert got[0].structured() == expected(TWO_CALLS)
    assert got[1].structured() == expected(REASONED_CALL)
    assert [a.logprob_tokens for a in got] == [len(a_ids), len(b_ids)]
    g, job, _ = setup(QWEN, n=2, logprobs=True)
    whole = await run_whole(g, job, [a_ids, b_ids])
    assert [w.structured() for w in whole] == [expected(TWO_CALLS), expected(REASONED_CALL)]
    assert [w.logprob_tokens for w in whole] == [len(a_ids), len(b_ids)]


async def test_concurrent_requests_never_share_parser_state() -> None:
    gpt = BY_MODEL["gpt-oss"]
    turns = [(QWEN, TWO_CALLS), (gpt, gpt.turns[1]), (QWEN, REASONED_CALL), (gpt, gpt.turns[0])]
    runs = []
    for family, turn in turns:
        ids = output_ids(turn.output)
        g, job, _ = setup(family)
        runs.append(run_stream(g, job, chunked([ids], [range(len(ids))]), yield_between=True))
    results = await asyncio.gather(*runs)
    for (_, turn), data in zip(turns, results, strict=True):
        assert parse_sse(data)[0].structured() == expected(turn)


# ---- forced calls and structured output --------------------------------------------------------------


async def test_required_and_named_tool_choice_constrain_and_parse_a_json_array() -> None:
    family = BY_MODEL["llama-3.1"]
    g, job, _ = setup(family, tool_choice="required")
    assert g.constraint is not None and g.constraint.kind == "json_schema"
    schema = json.loads(g.constraint.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    for a in await both(family, answer, tool_choice="required"):
        assert [(c[1], json.loads(c[2])) for c in a.calls] == [("get_weather", {"city": "Paris", "days": 3})]
        assert a.finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    g, job, _ = setup(family, tool_choice=named, parallel_tool_calls=False)
    assert "get_weather" not in job.text and "get_time" in job.text
    schema = json.loads(g.constraint.value)  # type: ignore[union-attr]
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_time"]
    # an engine that ignored the constraint: the other tool's call is text, and the check reports it
    whole = (await run_whole(*setup(family, tool_choice=named)[:2], [output_ids(answer)]))[0]
    assert whole.calls == [] and whole.content == answer and whole.violation is not None


async def test_strict_tools_with_auto_send_a_structural_tag() -> None:
    strict_tools = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS[:1]] + TOOLS[1:]
    g, _, _ = setup(QWEN, tools=strict_tools)
    assert g.constraint is not None and g.constraint.kind == "structural_tag"
    tag = json.loads(g.constraint.value)
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["schema"] != {} for s in tag["structures"]] == [True, False]
    assert tag["structures"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    g, _, _ = setup(BY_MODEL["qwen3-coder"], tools=strict_tools)  # an XML format: nothing to send
    assert g.constraint is None
    # the request's own response_format wins over the tag, as SGLang's and vLLM's servers apply it (the
    # SDK's parse() with pydantic_function_tool: strict tools, a JSON schema for the answer)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True}}
    g, _, _ = setup(QWEN, tools=strict_tools, response_format=rf)
    assert g.constraint is not None and g.constraint.kind == "json_schema"
    assert json.loads(g.constraint.value) == {"type": "object"}
    g, _, _ = setup(QWEN, tools=strict_tools, response_format={"type": "text"})
    assert g.constraint is not None and g.constraint.kind == "structural_tag"


async def test_response_format_constraint_and_check() -> None:
    rf: dict[str, Any] = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object", "required": ["t"]}},
    }
    g, job, _ = setup(QWEN, response_format=rf, tools=None)
    assert g.constraint is not None and json.loads(g.constraint.value) == rf["json_schema"]["schema"]
    ok = (await run_whole(g, job, [output_ids('{"t": 1}')]))[0]
    assert ok.violation is None and ok.content == '{"t": 1}'
    g, job, _ = setup(QWEN, response_format=rf, tools=None)
    bad = (await run_whole(g, job, [output_ids('{"x": 1}')]))[0]
    assert bad.violation is not None and "'t' is a required property" in bad.violation
    g, job, _ = setup(QWEN, response_format={"type": "json_object"}, tools=None)
    assert g.constraint is not None and json.loads(g.constraint.value) == {"type": "object"}
    assert (await run_whole(g, job, [output_ids("[1]")]))[0].violation is not None


async def test_a_lone_surrogate_escape_in_a_call_is_replaced_not_fatal() -> None:
    """A model's call whose JSON holds half a surrogate pair (``"\\ud83d"``, half an emoji): its value
    decodes to a surrogate no UTF-8 can hold (orjson refused the chunk: a cut stream, a 500). The
    call comes through with U+FFFD in its place, streamed and whole alike, and every answer encodes."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris \\ud83d", "days": 1}}'
    answer = f"Sure. <tool_call>\n{call}\n</tool_call>"
    whole, streamed = await both(QWEN, answer)
    for a in (whole, streamed):
        assert [(c[1], json.loads(c[2])) for c in a.calls] == [
            ("get_weather", {"city": "Paris \ufffd", "days": 1})
        ]
        assert a.finish_reason == "tool_calls"
    g, job, _ = setup(QWEN)
    await run_whole(g, job, [output_ids(answer)])
    assert b"Paris \xef\xbf\xbd" in orjson.dumps(g._final_choices(job, []))


async def test_harmony_is_parsed_even_when_reasoning_is_not_separated() -> None:
    """gpt-oss's channels are markup: with ``separate_reasoning`` off (the Messages API without
    ``thinking``) the output is still parsed, the analysis channel dropped, the final channel the content
    (it came back raw, channel tokens and all)."""
    text = "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    for a in await both(BY_MODEL["gpt-oss"], text, tools=None, separate_reasoning=False):
        assert (a.content, a.reasoning, a.finish_reason) == ("Hello!", None, "stop"), a
    for a in await both(BY_MODEL["gpt-oss"], text, tools=None):
        assert (a.content, a.reasoning) == ("Hello!", "Say hi."), a


async def test_an_answer_of_reasoning_only_has_null_content_streamed_and_whole() -> None:
    """DeepSeek-R1 opens the think block in the prompt; an output that never closes it is all reasoning:
    ``content`` null in the whole answer as in the stream (it was "" whole, null streamed)."""
    for a in await both(BY_MODEL["deepseek-r1"], "Just an answer.", tools=None):
        assert (a.reasoning, a.content) == ("Just an answer.", None), a


async def test_content_is_null_alike_when_the_reasoning_is_dropped() -> None:
    """An output the reasoning parser took whole, its reasoning dropped (gpt-oss without separated
    reasoning, ``include_reasoning`` false): content null whole as streamed."""
    text = "<|channel|>analysis<|message|>thinking only"
    for a in await both(BY_MODEL["gpt-oss"], text, eos=False, tools=None, separate_reasoning=False):
        assert (a.content, a.reasoning) == (None, None), a
    for a in await both(BY_MODEL["deepseek-r1"], "Just thinking.", tools=None, include_reasoning=False):
        assert (a.content, a.reasoning) == (None, None), a
