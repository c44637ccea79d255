"""The check of a finished answer against its schema runs on the event loop: it has a time budget per
request (``ANSWER_CHECK_SECONDS``), whatever the model wrote and the caller's schema asks.

The model writes the answer and the caller writes the schema, and both can make jsonschema's check cost
without bound: a ``pattern`` that backtracks on what the model wrote (in ``pattern``, ``patternProperties``,
``additionalProperties``), ``uniqueItems`` over items that do not sort (compared pairwise), ``anyOf``
nested in ``anyOf``. Each case here takes seconds to hours with plain jsonschema; under the budget it ends
within it, reported as a violation, and the same schemas still judge ordinary answers as jsonschema does.
Bounds on time below are generous multiples of the budget (these machines are shared): they tell a
bounded check from an unbounded one, not how fast it is.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from shepherd.node.openai.structured import ANSWER_CHECK_SECONDS, OutputChecks

BOUND_S = 20 * ANSWER_CHECK_SECONDS  # far below what the unbounded cases take (seconds to hours)


def content_check(schema: dict[str, Any], strict: bool = True) -> OutputChecks:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
    checks = OutputChecks.build(rf, None, "")
    assert checks is not None
    return checks


BACKTRACK = "^(a|aa)+$"  # exponential for a backtracking engine on "aaa...a!" (also for ``regex``)
EVIL = "a" * 64 + "!"

SLOW_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "pattern": (
        {"type": "object", "properties": {"k": {"type": "string", "pattern": BACKTRACK}}},
        {"k": EVIL},
    ),
    "pattern-in-anyOf": (
        {"type": "object", "properties": {"k": {"anyOf": [{"type": "string", "pattern": BACKTRACK}, {}]}}},
        {"k": EVIL},
    ),
    "patternProperties": ({"type": "object", "patternProperties": {BACKTRACK: {}}}, {EVIL: 1}),
    "additionalProperties": (
        {"type": "object", "patternProperties": {BACKTRACK: {}}, "additionalProperties": False},
        {EVIL: 1},
    ),
    "uniqueItems-unsortable": (
        {"type": "array", "uniqueItems": True},
        [{}, *(f"s{i}" for i in range(40_000))],
    ),
}


@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_a_costly_check_ends_within_the_budget_as_a_violation(case: str) -> None:
    schema, value = SLOW_CASES[case]
    checks = content_check(schema)
    t0 = time.monotonic()
    v = checks.check(0, "stop", json.dumps(value), [])
    took = time.monotonic() - t0
    assert took < BOUND_S, (case, took)
    if case == "uniqueItems-unsortable":  # one pass: decided (all distinct), not cut short
        assert v is None, v
    else:
        # flagged, not a strict violation: the clock, not the answer, is why (no 422 for it)
        assert v is not None and "could not be checked" in v.message and not v.strict
        assert v.param == "response_format"


def test_the_budget_is_the_requests_not_each_choices() -> None:
    schema, value = SLOW_CASES["pattern"]
    checks = content_check(schema)
    t0 = time.monotonic()
    got = [checks.check(i, "stop", json.dumps(value), []) for i in range(20)]
    assert time.monotonic() - t0 < BOUND_S
    assert all(v is not None and "could not be checked" in v.message for v in got)
    assert checks.budget[0] <= 0


def test_a_strict_tools_arguments_are_checked_within_the_budget() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "strict": True,
            "parameters": {"type": "object", "properties": {"k": {"type": "string", "pattern": BACKTRACK}}},
        },
    }
    checks = OutputChecks.build(None, [tool], "")
    assert checks is not None
    t0 = time.monotonic()
    v = checks.check(0, "tool_calls", None, [("f", json.dumps({"k": EVIL}))])
    assert time.monotonic() - t0 < BOUND_S
    assert v is not None and v.param == "tools" and "could not be checked" in v.message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, 1.0, 2.5]) | st.sampled_from("ab"),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("xy"), inner, max_size=2),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(JSON, max_size=6))
def test_unique_items_judges_as_jsonschema_does(items: list[Any]) -> None:
    """1 and 1.0 are the same item, 1 and true are not, objects whatever their key order."""
    schema = {"type": "array", "uniqueItems": True}
    ours = content_check(schema).check(0, "stop", json.dumps(items), []) is None
    assert ours == Draft202012Validator(schema).is_valid(items)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["^[a-z]+$", "^a", "b$", "^(ab)*c?$", r"^\d{2,3}$"]),
    st.text(alphabet="abc12", max_size=6),
)
def test_patterns_judge_as_jsonschema_does(pattern: str, text: str) -> None:
    schema = {
        "type": "object",
        "properties": {"k": {"type": "string", "pattern": pattern}},
        "patternProperties": {pattern: {"type": "string"}},
    }
    value = {"k": text, text: text}
    ours = content_check(schema).check(0, "stop", json.dumps(value), []) is None
    assert ours == Draft202012Validator(schema).is_valid(value)


async def test_small_schemas_are_not_held_up_by_big_ones_queued_before_them() -> None:
    """Meta-validation of a request's small schemas has a lane of its own: a caller that queued big
    schemas (here, the big lane kept busy) does not make another's small one miss its deadline."""
    import asyncio  # (this test alone waits on the lanes)
    import threading
    import uuid

    from shepherd.node.openai import structured

    gate = threading.Event()
    busy = structured._executor(False).submit(gate.wait, 30)
    try:
        text = json.dumps({"type": "object", "properties": {uuid.uuid4().hex: {"type": "string"}}}).encode()
        pending = [structured.PendingSchema("response_format.json_schema.schema", text)]
        await asyncio.wait_for(structured.check_schemas(pending, deadline=5.0), 10)  # no schema_too_complex
    finally:
        gate.set()
        busy.result(timeout=10)
