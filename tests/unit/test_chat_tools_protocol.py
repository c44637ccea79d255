"""Tools, tool_choice, reasoning and structured-output fields: request validation, the engine
constraint, the answer checks, stream encoders, the wire mapping and the parser configuration."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.mock_engine.stats import MockStats
from shepherd.node.api.generation import engine_sampling
from shepherd.node.config import ConfigError, ModelConfig, build_config
from shepherd.node.dispatch.gateway import model_parsers
from shepherd.node.openai.requests import parse_chat
from shepherd.node.openai.sse import ChatChunks
from shepherd.node.openai.structured import Constraint, OutputChecks, header_value, schema_error
from shepherd.node.openai.tool_choice import ToolChoice, call_array_schema, structural_tag, template_tools
from shepherd.node.output.chat import shape_chat
from shepherd.proto.engine_requests import sglang_sampling, vllm_sampling
from shepherd.proto.openai_errors import ApiError
from tests.unit.test_chat_tools_cases import TOOLS

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **kw}


# ---- request fields ---------------------------------------------------------------------------------------


def test_tool_fields_parse_with_openai_defaults() -> None:
    r = parse_chat(chat(tools=TOOLS))
    assert r.tool_choice == ToolChoice("auto") and r.parallel_tool_calls and r.separate_reasoning
    assert parse_chat(chat()).tool_choice == ToolChoice("none")
    named = parse_chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.tool_choice == ToolChoice("function", "get_time")
    r = parse_chat(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, separate_reasoning=False)
    )
    assert r.tool_choice.forces_call and not r.parallel_tool_calls and not r.separate_reasoning


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(tool_choice="required"), "tool_choice"),
        (chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (chat(tools=TOOLS, tool_choice={"function": {}}), "tool_choice"),
        (chat(tools=TOOLS, tool_choice=3), "tool_choice"),
        (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
        (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
            "tools.0.function.parameters",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
            "tools.0.function.strict",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "description": ["d"]}}]),
            "tools.0.function.description",
        ),
        (chat(parallel_tool_calls="no"), "parallel_tool_calls"),
        (chat(separate_reasoning=1), "separate_reasoning"),
        (chat(response_format={"type": "xml"}), "response_format"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
            "response_format.json_schema.schema",
        ),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "x"}}),
            "response_format.json_schema.strict",
        ),
    ],
)
def test_bad_tool_and_format_fields_are_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_chat(body)
    assert ei.value.status == 400 and ei.value.param == param


@pytest.mark.parametrize("name", ["a b", "<|im_end|>", "f\n", "a\x00b", "x" * 129, "é"])
def test_tool_names_that_would_carry_markup_into_the_prompt_are_400(name: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_chat(chat(tools=[{"type": "function", "function": {"name": name}}]))
    assert ei.value.status == 400 and ei.value.param == "tools.0" and "pattern" in ei.value.message


def test_namespaced_tool_names_pass() -> None:
    for name in ("get_weather", "mcp.server.tool", "ns:tool-1", "x" * 128):
        assert parse_chat(chat(tools=[{"type": "function", "function": {"name": name}}])).tools


def _history(call: Any) -> dict[str, Any]:
    return chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    )


GOOD_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ("c1", "messages[1].tool_calls[0]"),
        ({k: v for k, v in GOOD_CALL.items() if k != "id"}, "messages[1].tool_calls[0].id"),
        ({**GOOD_CALL, "id": 5}, "messages[1].tool_calls[0].id"),
        ({**GOOD_CALL, "function": "f"}, "messages[1].tool_calls[0].function"),
        ({**GOOD_CALL, "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        (
            {**GOOD_CALL, "function": {"name": 3, "arguments": "{}"}},
            "messages[1].tool_calls[0].function.name",
        ),
        ({**GOOD_CALL, "function": {"name": "f"}}, "messages[1].tool_calls[0].function.arguments"),
        (
            {**GOOD_CALL, "function": {"name": "f", "arguments": 7}},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({**GOOD_CALL, "type": "code"}, "messages[1].tool_calls[0].type"),
        (
            {**GOOD_CALL, "function": {"name": "f<|im_end|>", "arguments": "{}"}},
            "messages[1].tool_calls[0].function.name",
        ),
    ],
)
def test_past_tool_calls_are_checked_as_openai_checks_them(call: Any, param: str) -> None:
    """A malformed call in the history is a 400 naming its field (a missing ``arguments`` was the chat
    template's error, its Jinja text in the message)."""
    with pytest.raises(ApiError) as ei:
        parse_chat(_history(call))
    assert ei.value.status == 400 and ei.value.param == param, ei.value


def test_past_tool_calls_may_carry_arguments_as_an_object() -> None:
    call = {**GOOD_CALL, "function": {"name": "f", "arguments": {"x": 1}}}
    assert parse_chat(_history(call)).messages[1]["tool_calls"] == [call]
    assert parse_chat(_history({k: v for k, v in GOOD_CALL.items() if k != "type"}))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=12,
)
tool_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "x"]),
        "function": st.fixed_dictionaries({"name": st.text(max_size=4)}),
    },
    optional={"parameters": json_values, "strict": json_values},
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["tools", "tool_choice", "parallel_tool_calls", "separate_reasoning", "response_format"]
        ),
        json_values | st.lists(tool_like, max_size=2) | st.sampled_from(["auto", "none", "required"]),
        max_size=5,
    )
)
def test_fuzzed_tool_fields_raise_only_api_errors(fields: dict[str, Any]) -> None:
    try:
        req = parse_chat(chat(**fields))
    except ApiError as e:
        assert e.status == 400
        return
    for families in (("qwen3", "hermes"), (None, None), ("gpt_oss", "gpt_oss")):
        try:
            shape_chat(families, req, "prompt")
        except ApiError as e:
            assert e.status == 400


# ---- tool choice and constraints ------------------------------------------------------------------------


def test_template_tools_follow_tool_choice() -> None:
    assert template_tools(TOOLS, ToolChoice("none")) == TOOLS  # vLLM's default: the model sees them
    assert template_tools(TOOLS, ToolChoice("auto")) == TOOLS
    assert [
        t["function"]["name"] for t in template_tools(TOOLS, ToolChoice("function", "get_time")) or []
    ] == ["get_time"]


def test_call_array_schema_lifts_defs_and_refuses_conflicts() -> None:
    a = {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"X": {"type": "string"}}}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"X": {"type": "integer"}}}}}
    s = call_array_schema([a], ToolChoice("required"))
    assert s["$defs"] == {"X": {"type": "string"}} and s["items"]["required"] == ["name", "parameters"]
    two = call_array_schema(TOOLS, ToolChoice("required"), parallel=False)
    assert len(two["items"]["anyOf"]) == 2 and two["maxItems"] == 1
    with pytest.raises(ApiError):
        shape_chat((None, None), parse_chat(chat(tools=[a, b], tool_choice="required")), "")


def test_structural_tags_per_family() -> None:
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    assert structural_tag("hermes", TOOLS) is None  # nothing strict: nothing to enforce
    for family, trigger in (
        ("hermes", "<tool_call>"),
        ("llama3", "<|python_tag|>"),
        ("mistral", "[TOOL_CALLS]"),
        ("deepseek_v3", "<｜tool▁call▁begin｜>"),
        ("deepseek_v31", "<｜tool▁call▁begin｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|>"),
        ("gpt_oss", "<|channel|>commentary to="),
    ):
        tag = json.loads(structural_tag(family, strict) or "")
        assert tag["type"] == "structural_tag" and tag["triggers"] == [trigger]
        assert all(s["begin"].startswith(trigger) for s in tag["structures"])
        assert "get_weather" in tag["structures"][0]["begin"] and tag["structures"][0]["schema"]["required"]
    for family in ("qwen3_coder", "glm45", "pythonic", "json", "cohere"):
        assert structural_tag(family, strict) is None


def test_constraint_precedence_and_sampling_overrides() -> None:
    rf = {"type": "json_object"}
    sh = shape_chat(("qwen3", "hermes"), parse_chat(chat(tools=TOOLS, response_format=rf)), "")
    assert sh.constraint == Constraint("json_schema", '{"type":"object"}')
    assert not sh.sampling.skip_special_tokens  # tool markers may be special tokens
    sh = shape_chat(
        ("qwen3", "hermes"), parse_chat(chat(tools=TOOLS, tool_choice="required", response_format=rf)), ""
    )
    assert sh.constraint is not None and json.loads(sh.constraint.value)["type"] == "array"
    plain = shape_chat(("qwen3", "hermes"), parse_chat(chat()), "")
    assert plain.sampling.skip_special_tokens and plain.constraint is None and plain.checks is None
    assert plain.output is not None and plain.output.tool_parser is None and plain.output.reasoning == "qwen3"
    assert shape_chat((None, "hermes"), parse_chat(chat()), "").output is None
    harmony = shape_chat(("gpt_oss", "gpt_oss"), parse_chat(chat()), "")
    assert not harmony.sampling.skip_special_tokens


def test_thinking_toggles() -> None:
    off = parse_chat(chat(chat_template_kwargs={"enable_thinking": False}))
    assert shape_chat(("qwen3", None), off, "").output is None
    assert shape_chat(("deepseek_v3", None), parse_chat(chat()), "").output is None
    on = parse_chat(chat(chat_template_kwargs={"thinking": True}))
    out = shape_chat(("deepseek_v3", None), on, "<｜Assistant｜><think>").output
    assert out is not None and out.prompt_opened_think
    # a template that closed the think block itself (enable_thinking off inside it): no reasoning
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert shape_chat(("qwen3_thinking", None), parse_chat(chat()), closed).output is None


def test_engine_sampling_carries_each_constraint_to_both_wires() -> None:
    s = parse_chat(chat()).sampling
    for kind, sg_field, vl_field in (
        ("json_schema", "json_schema", "json_schema"),
        ("regex", "regex", "regex"),
        ("ebnf", "ebnf_grammar", "grammar"),
        ("structural_tag", "structural_tag", "structural_tag"),
    ):
        p = engine_sampling(s, 10, None, Constraint(kind, "V"))  # type: ignore[arg-type]
        a = sglang_sampling(p)
        b = vllm_sampling(p, False, 0)
        assert a.WhichOneof("constraint") == sg_field and getattr(a, sg_field) == "V"
        assert b.WhichOneof("constraint") == vl_field and getattr(b, vl_field) == "V"
    assert sglang_sampling(engine_sampling(s, 10, None)).WhichOneof("constraint") is None


def test_mock_records_the_constraint_it_received() -> None:
    stats = MockStats()
    stats.record_constraint("r1", sg.SamplingParams(json_schema='{"type":"object"}'))
    stats.record_constraint("r2", sg.SamplingParams())
    stats.record_constraint("r3", vl.SamplingParams(choice=vl.ChoiceConstraint(choices=["a", "b"])))
    assert stats.to_json()["constraints"] == [
        {"request_id": "r1", "kind": "json_schema", "value": '{"type":"object"}'},
        {"request_id": "r3", "kind": "choice", "value": ["a", "b"]},
    ]


# ---- answer checks ---------------------------------------------------------------------------------------


def test_output_checks() -> None:
    assert OutputChecks.build(None, TOOLS, "") is None
    obj = OutputChecks.build({"type": "json_object"}, None, "")
    assert obj is not None
    assert obj.check(0, "stop", '{"a": 1}', []) is None
    assert obj.check(0, "stop", "[1]", []) is not None
    assert obj.check(0, "length", '{"a": ', []) is None  # cut by max_tokens: not checked
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    strict = OutputChecks.build(rf, None, "")
    assert strict is not None
    v = strict.check(1, "stop", '{"n": "x"}', [])
    assert v is not None and v.strict and v.index == 1 and v.param == "response_format"
    assert strict.check(0, "stop", '{"n": 2}', []) is None
    forced = OutputChecks.build(None, TOOLS, "required")
    assert forced is not None
    v = forced.check(0, "stop", "text", [])
    assert v is not None and not v.strict and v.param == "tool_choice"
    assert forced.check(0, "tool_calls", None, [("get_time", '{"tz": "x"}')]) is None
    strict_tools = [{**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": True}}]
    st_check = OutputChecks.build(None, strict_tools, "")
    assert st_check is not None
    v = st_check.check(0, "tool_calls", None, [("get_time", '{"zone": "x"}')])
    assert v is not None and v.strict and "'tz' is a required property" in v.message
    assert "\n" not in header_value([v, v]) and header_value([v]).isascii()


def test_answers_that_are_json_are_read_as_json() -> None:
    """What orjson refuses but RFC 8259 allows is read, not called "not valid JSON": an escaped lone
    surrogate, an integer past 64 bits; what cannot be read here (past Python's digit limit, nesting past
    the recursion limit) is flagged as not checked, never a strict violation."""

    def check(schema: dict[str, Any], text: str) -> Any:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        checks = OutputChecks.build(rf, None, "")
        assert checks is not None
        return checks.check(0, "stop", text, [])

    assert check({"type": "string"}, '"\\ud800"') is None
    v = check({"type": "string", "enum": ["a"]}, '"\\ud800"')
    assert v is not None and v.strict and "not one of" in v.message and orjson.dumps(v.message)
    assert check({"type": "integer", "minimum": 0}, "1" + "0" * 30) is None
    v = check({"type": "integer", "maximum": 10}, "1" + "0" * 30)
    assert v is not None and v.strict and "maximum" in v.message
    for text in ("1" + "0" * 5000, "[" * 2000 + "]" * 2000):
        v = check({"type": "integer", "maximum": 10}, text)
        assert v is not None and not v.strict and "could not be checked" in v.message, v
    v = check({"type": "object"}, "{nope")
    assert v is not None and v.strict and v.message == "the content is not valid JSON"
    v = check({"type": "number"}, "NaN")
    assert v is not None and v.message == "the content is not valid JSON"
    tools = [{**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": True}}]
    checks = OutputChecks.build(None, tools, "")
    assert (
        checks is not None
        and checks.check(0, "tool_calls", None, [("get_time", '{"tz": "\\udc00"}')]) is None
    )


def test_schema_error() -> None:
    assert schema_error({"type": "object"}) is None
    assert schema_error({"type": 3}) is not None
    assert schema_error("no") is not None
    # a schema that cannot be applied (a $ref to nowhere) never turns an answer into a 500
    rf = {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}, "strict": True}}
    checks = OutputChecks.build(rf, None, "")
    assert checks is not None and checks.check(0, "stop", "{}", []) is None


# ---- stream encoders -------------------------------------------------------------------------------------


def _event(b: bytes) -> dict[str, Any]:
    assert b.startswith(b"data: ") and b.endswith(b"\n\n")
    out: dict[str, Any] = orjson.loads(b[6:-2])
    return out


def test_reasoning_and_tool_call_chunks() -> None:
    c = ChatChunks("id", 1, "m")
    e = _event(c.reasoning(1, 'th"ink', {"content": []}))
    assert e["choices"] == [
        {
            "index": 1,
            "delta": {"reasoning": 'th"ink', "reasoning_content": 'th"ink'},  # --reasoning-field both
            "logprobs": {"content": []},
            "finish_reason": None,
        }
    ]
    for field in ("reasoning", "reasoning_content"):
        one = ChatChunks("id", 1, "m", reasoning_field=field)
        assert _event(one.reasoning(0, "x"))["choices"][0]["delta"] == {field: "x"}
    legacy = ChatChunks("id", 1, "m", legacy_functions=True)
    assert _event(legacy.tool_call(0, 0, "call_1", "f"))["choices"][0]["delta"] == {
        "function_call": {"name": "f", "arguments": ""}
    }
    assert _event(legacy.tool_args(0, 0, "{}"))["choices"][0]["delta"] == {
        "function_call": {"arguments": "{}"}
    }
    assert _event(legacy.finish(0, "tool_calls"))["choices"][0]["finish_reason"] == "function_call"
    start = _event(c.tool_call(0, 2, "call_1", "get_weather"))["choices"][0]["delta"]
    assert start == {
        "tool_calls": [
            {
                "index": 2,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    args = _event(c.tool_args(0, 2, '{"a": "é"}'))["choices"][0]["delta"]
    assert args == {"tool_calls": [{"index": 2, "function": {"arguments": '{"a": "é"}'}}]}


# ---- parser configuration --------------------------------------------------------------------------------


def test_parser_families_per_model() -> None:
    assert model_parsers(ModelConfig("Qwen3-8B", "/m"), None, None) == ("qwen3", "hermes")
    assert model_parsers(ModelConfig("x", "/models/gpt-oss-20b"), None, None) == ("gpt_oss", "gpt_oss")
    assert model_parsers(ModelConfig("x", "/m"), "deepseek-r1", "llama3.1") == ("deepseek_r1", "llama3")
    mc = ModelConfig("qwen3", "/m", reasoning_parser="none", tool_call_parser="Qwen25")
    assert model_parsers(mc, "glm45", "glm45") == (None, "hermes")
    assert model_parsers(ModelConfig("mystery", "/m"), None, None) == (None, None)


def test_config_validates_parser_names() -> None:
    cfg = build_config({}, {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"})
    assert (cfg.reasoning_parser, cfg.tool_call_parser) == ("qwen3", "hermes")
    models = [{"name": "a", "model_path": "/m", "reasoning_parser": "none", "tool_call_parser": "kimi_k2"}]
    assert build_config({"models": models}, {}).models[0].tool_call_parser == "kimi_k2"
    with pytest.raises(ConfigError, match="reasoning parser"):
        build_config({}, {"reasoning_parser": "nonsense"})
    with pytest.raises(ConfigError, match="model 'a'"):
        build_config({"models": [{**models[0], "tool_call_parser": "bogus"}]}, {})


def test_cli_flags() -> None:
    from shepherd.node.cli import config_from_args

    cfg = config_from_args(
        ["serve", "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "deepseek_v3"]
    )
    assert (cfg.reasoning_parser, cfg.tool_call_parser) == ("deepseek_r1", "deepseek_v3")


_ALLOWED_TOOLS: Any = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
    for n in ("get_weather", "get_time")
]


def _allowed(mode: Any, tools: Any) -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_keeps_the_listed_tools_under_its_mode() -> None:
    named = [{"type": "function", "function": {"name": "get_time"}}]
    for mode in ("auto", "required"):
        req = parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": _ALLOWED_TOOLS,
             "tool_choice": _allowed(mode, named)}
        )  # fmt: skip
        assert req.tool_choice == ToolChoice(mode) and [t["function"]["name"] for t in req.tools or ()] == [
            "get_time"
        ]


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=5),
        st.lists(
            st.one_of(
                st.none(),
                st.integers(),
                st.text(max_size=3),
                st.dictionaries(
                    st.text(max_size=8),
                    st.one_of(
                        st.none(),
                        st.text(max_size=8),
                        st.dictionaries(st.text(max_size=5), st.text(max_size=9), max_size=2),
                    ),
                    max_size=3,
                ),
            ),
            max_size=3,
        ),
    ),
    st.one_of(st.none(), st.sampled_from(["auto", "required", "none", "x"]), st.integers()),
)
@settings(max_examples=200, deadline=None)
def test_a_malformed_allowed_tools_choice_is_a_400_on_tool_choice(tools: Any, mode: Any) -> None:
    """Whatever the ``allowed_tools`` object holds: either a choice over tools the request gave, or a 400
    naming ``tool_choice`` (never another error)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": _ALLOWED_TOOLS,
            "tool_choice": _allowed(mode, tools)}  # fmt: skip
    try:
        req = parse_chat(body)
    except ApiError as e:
        assert e.status == 400 and e.param == "tool_choice", (e.status, e.param)
        return
    assert (
        mode in ("auto", "required")
        and req.tools
        and {t["function"]["name"] for t in req.tools}
        <= {
            "get_weather",
            "get_time",
        }
    )
