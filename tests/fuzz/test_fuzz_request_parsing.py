"""Fuzz targets: request parsing as pure functions (no server). Bodies are built from the real field names
with values of every shape (json_strategies.py) and sent through ``parse_json_body`` as the HTTP path
does, and also handed over as Python values (ints beyond 64 bits, ``-0.0``) to the parser itself.

The contract under test (shepherd/node/openai/requests.py): a parser returns its typed request or raises
``ApiError`` with a 4xx status whose envelope serialises (``{"error": {"message", "type", "param",
"code"}}``); any other exception is a bug (it would be a 500). What the node computes from a parsed request
next (the engine constraint, the output checks, the forced-call schema, the template's tools, the
structural tag) must not raise on anything the parser let through either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shepherd.node.http.body import parse_json_body
from shepherd.node.openai import requests as requests_mod
from shepherd.node.openai.items import items_to_messages, parse_items
from shepherd.node.openai.requests import ChatRequest, parse_chat, parse_completion, parse_sampling
from shepherd.node.openai.structured import OutputChecks, response_format_constraint, schema_error
from shepherd.node.openai.tool_choice import (
    STRUCTURAL_TAG_FAMILIES,
    ToolChoiceError,
    call_array_schema,
    structural_tag,
    template_tools,
)
from shepherd.proto.openai_errors import ApiError
from tests.fuzz import json_strategies as js
from tests.fuzz.contract import accepts, check_error
from tests.fuzz.profiles import Budget, fuzz_settings, run_bounded


def body_of(raw: bytes) -> dict[str, Any] | None:
    return accepts(lambda: parse_json_body(raw))


def after_chat(req: ChatRequest) -> None:
    """What output/chat.py computes from a parsed chat request."""
    tools = req.tools
    choice = req.tool_choice
    assert template_tools(tools, choice) is None or isinstance(template_tools(tools, choice), list)
    if choice.forces_call and tools:
        try:
            schema = call_array_schema(tools, choice, req.parallel_tool_calls)
            orjson.dumps(schema)
        except ToolChoiceError:
            pass  # answered 400 by the handler
    if tools:
        for family in sorted(STRUCTURAL_TAG_FAMILIES):
            accepts(partial(structural_tag, family, tools))
    accepts(lambda: response_format_constraint(req.response_format))
    forced = (
        choice.name or "" if choice.mode == "function" else ("required" if choice.mode == "required" else "")
    )
    checks = accepts(lambda: OutputChecks.build(req.response_format, tools, forced))
    if checks is not None:
        for content in ('{"a": 1}', "[]", "not json", ""):
            checks.check(0, "stop", content, [])
            checks.check(0, "tool_calls", None, [(n, '{"x": 1}') for n in sorted(checks.strict_tools)[:2]])


# ---- targets ----------------------------------------------------------------------------------------------


def test_fuzz_parse_json_body(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=100)
    @given(st.one_of(st.binary(max_size=200), js.json_values().map(js.as_json), js.deep().map(js.as_json)))
    @example(b"")
    @example(b"\xef\xbb\xbf{}")
    @example(b'{"a": 1e400}')
    @example(b'{"a": NaN}')
    @example(b'{"a": "\\ud800"}')
    @example(b"[" * 2000 + b"]" * 2000)
    def check(raw: bytes) -> None:
        d = body_of(raw)
        assert d is None or isinstance(d, dict)

    run_bounded(check, fuzz_budget)


def test_fuzz_parse_chat(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=200)
    @given(js.body(js.CHAT, js.CHAT_CORE))
    @example({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": 2**70})
    @example(
        {
            "model": "qwen3",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"function": {"name": "f", "parameters": {"$defs": []}}}],
            "tool_choice": "required",
        }
    )
    def check(value: Any) -> None:
        d = body_of(js.as_json(value))
        if d is not None:
            req = accepts(lambda: parse_chat(d))
            if req is not None:
                after_chat(req)
        if isinstance(value, dict):  # the Python value itself: big ints stay ints
            req = accepts(lambda: parse_chat(value))
            if req is not None:
                after_chat(req)

    run_bounded(check, fuzz_budget)


def test_fuzz_parse_completion(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=150)
    @given(js.body(js.COMPLETION, js.COMPLETION_CORE))
    @example({"model": "qwen3", "prompt": [[1, 2], []]})
    @example({"model": "qwen3", "prompt": [2**70]})
    def check(value: Any) -> None:
        d = body_of(js.as_json(value))
        if d is not None:
            accepts(lambda: parse_completion(d))
        if isinstance(value, dict):
            accepts(lambda: parse_completion(value))

    run_bounded(check, fuzz_budget)


def test_fuzz_parse_sampling_and_its_memo(fuzz_budget: Budget) -> None:
    """The memoized ``parse_sampling`` gives what a fresh parse gives, for every spelling of a value
    (``1``, ``1.0``, ``true`` are equal in Python, not to the validation)."""

    @fuzz_settings(ci_examples=200)
    @given(
        st.fixed_dictionaries({}, optional=js.SAMPLING),
        st.sampled_from([("max_tokens",), ("max_tokens", "max_completion_tokens")]),
    )
    @example({"n": 1.0}, ("max_tokens",))
    @example({"n": True}, ("max_tokens",))
    @example({"temperature": 1}, ("max_tokens",))
    @example({"stop": ["a", "a"], "seed": 2**63}, ("max_tokens",))
    def check(value: dict[str, Any], keys: tuple[str, ...]) -> None:
        d = body_of(js.as_json(value))
        for obj in (d, value):
            if obj is None:
                continue
            first = accepts(partial(parse_sampling, obj, max_tokens_keys=keys))
            again = accepts(partial(parse_sampling, obj, max_tokens_keys=keys))
            fresh = accepts(partial(requests_mod._parse_sampling, obj, keys))
            assert first == again == fresh, (obj, first, fresh)
            if first is not None:
                for f in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
                    assert math.isfinite(getattr(first, f)), (f, first)

    run_bounded(check, fuzz_budget)


def test_fuzz_schema_error(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=100)
    @given(st.one_of(js.schemas, js.json_values(st.sampled_from(js.SCHEMA_KEYS)), js.deep()))
    @example({"pattern": "["})
    @example({"$ref": "#/nope"})
    @example({"type": "object", "properties": {"a": {"$ref": "#"}}})
    def check(schema: Any) -> None:
        problem = accepts(lambda: schema_error(schema))
        assert problem is None or isinstance(problem, str)

    run_bounded(check, fuzz_budget)


def _ids() -> Callable[[str], str]:
    n = iter(range(1 << 30))
    return lambda prefix: f"{prefix}_{next(n)}"


def test_fuzz_parse_items(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=150)
    @given(js.items)
    @example([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    @example([{"role": "user", "content": "", "status": []}])
    @example(
        [
            {"role": "assistant", "content": "a"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]
    )
    def check(value: Any) -> None:
        raw = js.parsed(js.as_json(value))
        for v in (raw, value):
            got = accepts(partial(parse_items, v, param="input", new_id=_ids(), now=0.0))
            if got is not None:
                usable = [it for it in got if it.type != "item_reference"]
                msgs = accepts(partial(items_to_messages, usable))
                assert msgs is None or all(isinstance(m, dict) and "role" in m for m in msgs)

    run_bounded(check, fuzz_budget)


def _parse_responses() -> Callable[[dict[str, Any]], Any] | None:
    try:
        from shepherd.node.openai.responses import parse_responses
    except ImportError:  # the Responses API parser is not there (yet)
        return None
    fn: Callable[[dict[str, Any]], Any] = parse_responses
    return fn


@pytest.mark.skipif(_parse_responses() is None, reason="shepherd/node/openai/responses.py is not there")
def test_fuzz_parse_responses(fuzz_budget: Budget) -> None:
    parse_responses = _parse_responses()
    assert parse_responses is not None

    @fuzz_settings(ci_examples=150)
    @given(js.body(js.RESPONSES, js.RESPONSES_CORE))
    @example({"model": "qwen3", "input": "hi", "metadata": {"k": 5}})
    @example({"model": "qwen3", "input": "NaN", "reasoning": {"effort": []}})
    @example(
        {
            "model": "qwen3",
            "input": "hi",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        }
    )
    def check(value: Any) -> None:
        d = body_of(js.as_json(value))
        for obj in (d, value if isinstance(value, dict) else None):
            if obj is None:
                continue
            req = accepts(partial(parse_responses, obj))
            if req is not None:
                accepts(partial(parse_items, req.input, param="input", new_id=_ids(), now=0.0))

    run_bounded(check, fuzz_budget)


# Python ints no JSON body can carry (orjson reads an integer beyond 64 bits as a float and refuses 1e400,
# so none of these is reachable over HTTP today): the parsers' contract still says ApiError or a value.
BEYOND_JSON: list[tuple[str, Callable[[], object]]] = [
    (
        "temperature=10**400",
        lambda: parse_sampling({"temperature": 10**400}, max_tokens_keys=("max_tokens",)),
    ),
    (
        "max_tokens=10**5000",
        lambda: parse_sampling({"max_tokens": 10**5000}, max_tokens_keys=("max_tokens",)),
    ),
]


@pytest.mark.parametrize(("case", "call"), BEYOND_JSON, ids=[c for c, _ in BEYOND_JSON])
def test_ints_beyond_json_get_an_api_error(case: str, call: Callable[[], object]) -> None:
    accepts(call)


@pytest.mark.parametrize(
    "raw",
    [
        [{"role": "user", "content": "", "status": []}],
        [{"type": "message", "role": [], "content": "x"}],
        [{"role": {}, "content": "x"}],
    ],
    ids=["status-list", "role-list", "role-object"],
)
def test_items_with_unhashable_values(raw: list[dict[str, Any]]) -> None:
    """Found by the fuzz targets: ``v not in <frozenset>`` with a list or an object raised TypeError in
    items.py (a 500 on ``POST /v1/responses``); fixed there since."""
    with pytest.raises(ApiError) as e:
        parse_items(raw, param="input", new_id=_ids(), now=0.0)
    check_error(e.value)
