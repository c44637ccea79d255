"""Structured outputs: the constraint an engine generates under, and the check of a finished answer.

- ``response_format``: ``json_object`` → the JSON schema ``{"type": "object"}`` (as SGLang sends it);
  ``json_schema`` → its ``schema``; ``structural_tag`` passed through; ``text`` → nothing.
- The engine gets one ``Constraint`` (SGLang's and vLLM's ``oneof constraint``: json_schema, regex,
  ebnf, structural_tag). A forced tool call (``tool_choice`` required / named) takes precedence over
  ``response_format``, then a strict tools' structural tag (see tool_choice.py).
- ``OutputChecks`` validates a finished NON-streamed choice: its content against the response
  format; its tool calls against ``tool_choice`` (a forced call must be there) and against the
  parameters of ``strict`` tools. A stream is not held back for a check.

How a violation is reported (OpenAI has no field for it): when the request asked for strictness
(``json_schema.strict`` or a ``strict`` tool) it is a 502 ``schema_violation`` error — the client
was promised conforming output; otherwise the answer is returned as generated, the choice carries a
``schema_violation`` message and the response an ``x-smg-schema-violation`` header. A choice cut by
``max_tokens`` (``finish_reason: length``) is not checked: it is incomplete by request.

Schema validation uses ``jsonschema`` (Draft 2020-12); validators are cached per schema text.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from shepherd.proto.openai_errors import ApiError

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

__all__ = [
    "Constraint",
    "OutputChecks",
    "Violation",
    "response_format_constraint",
    "schema_error",
]

ConstraintKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    value: str


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError) as e:  # e.g. nested deeper than 254 levels
        msg = f"A schema in the request cannot be serialised: {e}."
        raise ApiError(400, msg, code="invalid_schema") from None


def response_format_constraint(rf: Mapping[str, Any] | None) -> Constraint | None:
    if not rf:
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return Constraint("json_schema", '{"type":"object"}')
    if kind == "json_schema":
        spec = rf.get("json_schema") or {}
        return Constraint("json_schema", _dumps(spec.get("schema", {})))
    if kind == "structural_tag":
        return Constraint("structural_tag", _dumps(dict(rf)))
    return None


# ---- schemas ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _validator(schema_json: str) -> Validator | str:
    """A validator for the schema, or the reason the schema is not one."""
    # here, not at the top: jsonschema costs ~40 ms of start-up and most requests carry no schema
    from jsonschema import Draft202012Validator, SchemaError

    schema = orjson.loads(schema_json)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        return e.message
    except Exception as e:  # whatever the checker trips on, the schema is unusable
        return f"{type(e).__name__}: {e}"
    return Draft202012Validator(schema)


def schema_error(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON schema (Draft 2020-12), or None."""
    if not isinstance(schema, dict | bool):
        return "a schema must be an object"
    v = _validator(_dumps(schema))
    return v if isinstance(v, str) else None


def _violation(schema_json: str, value: Any) -> str | None:
    v = _validator(schema_json)
    if isinstance(v, str):
        return f"invalid schema: {v}"
    try:
        err = next(iter(v.iter_errors(value)), None)
    except Exception:  # e.g. a $ref to nowhere: the schema cannot be applied; nothing to report
        return None
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    return f"{err.message}" + (f" (at /{where})" if where else "")


# ---- checking a finished answer ---------------------------------------------------------------------------


_RF = "response_format"


@dataclass(frozen=True, slots=True)
class Violation:
    index: int  # the choice
    message: str
    strict: bool
    param: str  # the request field whose promise was broken


@dataclass(frozen=True, slots=True)
class OutputChecks:
    """What a request asks of its answers. Build with ``OutputChecks.build`` (None: nothing to check)."""

    content_kind: Literal["", "json_object", "json_schema"]
    content_schema: str  # JSON text (json_schema)
    content_strict: bool
    forced_call: str  # "" | "required" | the named function
    strict_tools: Mapping[str, str]  # tool name -> parameters schema JSON text

    @classmethod
    def build(
        cls,
        response_format: Mapping[str, Any] | None,
        tools: Sequence[Mapping[str, Any]] | None,
        forced_call: str,
    ) -> OutputChecks | None:
        kind = (response_format or {}).get("type")
        content_kind: Literal["", "json_object", "json_schema"] = ""
        schema = ""
        strict = False
        if kind == "json_object":
            content_kind = "json_object"
        elif kind == "json_schema" and response_format is not None:
            spec = response_format.get("json_schema") or {}
            content_kind = "json_schema"
            schema = _dumps(spec.get("schema", {}))
            strict = spec.get("strict") is True
        strict_tools = {}
        for tool in tools or ():
            fn = tool.get("function", tool)
            if isinstance(fn, Mapping) and fn.get("strict") is True:
                strict_tools[str(fn.get("name"))] = _dumps(fn.get("parameters") or {"type": "object"})
        if not content_kind and not forced_call and not strict_tools:
            return None
        return cls(content_kind, schema, strict, forced_call, strict_tools)

    def check(
        self,
        index: int,
        finish_reason: str | None,
        content: str | None,
        calls: Sequence[tuple[str, str]],
    ) -> Violation | None:
        """The first problem of one finished choice (``calls``: (name, arguments JSON) pairs)."""
        if finish_reason not in ("stop", "tool_calls"):
            return None
        for name, arguments in calls:
            schema = self.strict_tools.get(name)
            if schema is None:
                continue
            try:
                args = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return Violation(index, f"tool call {name!r}: arguments are not JSON", True, "tools")
            problem = _violation(schema, args)
            if problem:
                return Violation(index, f"tool call {name!r}: {problem}", True, "tools")
        if self.forced_call and not calls:
            want = "a tool call" if self.forced_call == "required" else f"a call to {self.forced_call!r}"
            return Violation(
                index, f"'tool_choice' asked for {want}; the output holds none", False, "tool_choice"
            )
        if calls or not self.content_kind:
            return None
        text = content or ""
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return Violation(index, "the content is not valid JSON", self.content_strict, _RF)
        if self.content_kind == "json_object":
            if not isinstance(value, dict):
                return Violation(index, "the content is JSON but not an object", False, _RF)
            return None
        problem = _violation(self.content_schema, value)
        if problem:
            return Violation(
                index, f"the content does not match the schema: {problem}", self.content_strict, _RF
            )
        return None


def header_value(violations: Sequence[Violation]) -> str:
    """One line of ASCII for the ``x-smg-schema-violation`` header."""
    text = "; ".join(f"choice {v.index}: {v.message}" for v in violations)
    text = text.encode("ascii", "backslashreplace").decode().replace("\r", " ").replace("\n", " ")
    return text[:512]
