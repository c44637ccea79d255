"""The check of a finished answer against its schema runs on the event loop: it has a time budget per
request (``ANSWER_CHECK_SECONDS``), whatever the model wrote and the caller's schema asks.

The model writes the answer and the caller writes the schema, and both can make jsonschema's check cost
without bound: a ``pattern`` that backtracks on what the model wrote (in ``pattern``, ``patternProperties``,
``additionalProperties``), ``uniqueItems`` over items that do not sort (compared pairwise), ``anyOf``
nested in ``anyOf``. Each case here takes seconds to hours with plain jsonschema (the test's timeout
would end it); under the budget it ends flagged "could not be checked" (the budget's verdict, not a
timing), and the same schemas still judge ordinary answers as jsonschema does.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from shepherd.node.openai.structured import OutputChecks


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
}


@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_a_costly_check_ends_at_the_budget_flagged(case: str) -> None:
    schema, value = SLOW_CASES[case]
    checks = content_check(schema)
    v = checks.check(0, "stop", json.dumps(value), [])
    # flagged, not a strict violation: the clock, not the answer, is why (no 422 for it)
    assert v is not None and "could not be checked" in v.message and not v.strict
    assert v.param == "response_format"


def test_unique_items_over_unsortable_items_is_decided_in_one_pass() -> None:
    """40,000 distinct items behind one that does not sort: jsonschema's pairwise comparison (8 x 10^8, ~35 s)
    runs out of a budget of seconds; one pass over canonical forms decides them (all distinct, and one
    repeated at the end is found)."""
    items: list[Any] = [{}, *(f"s{i}" for i in range(40_000))]
    checks = content_check({"type": "array", "uniqueItems": True})
    checks.budget[0] = 5.0
    assert checks.check(0, "stop", json.dumps(items), []) is None
    repeated = content_check({"type": "array", "uniqueItems": True})
    repeated.budget[0] = 5.0
    v = repeated.check(0, "stop", json.dumps([*items, "s7"]), [])
    assert v is not None and "non-unique" in v.message


def test_the_budget_is_the_requests_not_each_choices() -> None:
    schema, value = SLOW_CASES["pattern"]
    checks = content_check(schema)
    got = [checks.check(i, "stop", json.dumps(value), []) for i in range(20)]
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
    v = checks.check(0, "tool_calls", None, [("f", json.dumps({"k": EVIL}))])
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
