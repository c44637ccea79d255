"""vLLM's and SGLang's constrained-decoding request fields -> the one ``Constraint`` the engine generates
under (or a 400 naming the field).

Fields read (beside OpenAI's ``response_format``, handled in structured.py):

- vLLM (``vllm/entrypoints/openai/protocol.py``, ``vllm/sampling_params.py`` StructuredOutputsParams):
  ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice`` (a list of
  strings), ``guided_grammar`` (EBNF), and the newer ``structured_outputs`` object holding exactly one
  of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` (true) or ``structural_tag``;
- SGLang (``sglang/srt/entrypoints/openai/protocol.py``): ``regex``, ``ebnf``, ``json_schema`` (JSON
  text or object).

At most one constraint per request: two fields (or one of them with a ``response_format`` that is not
``text``) are a 400 naming the second. JSON schemas count against the request's schema bounds and are
meta-validated like ``response_format``'s (structured.py). ``structured_outputs`` options the engine
protocols have no field for (``disable_any_whitespace``, ``disable_additional_properties``,
``whitespace_pattern``; vLLM's older ``guided_whitespace_pattern``) are a 400 when set, not silently
dropped; ``disable_fallback`` and backend choices are the engine's own business and are ignored.

The engine gets: json_schema, regex and ebnf as such; a choice as vLLM's ``choice`` constraint, or for
SGLang (which has none) as the EBNF grammar ``root ::= "a" | "b"`` vLLM itself builds for backends
without one (``choice_grammar`` in shepherd/proto/engine_requests.py); ``json_object`` as vLLM's
``json_object``, or for SGLang the schema ``{"type": "object"}`` (as ``response_format: json_object`` is
sent).
"""

from __future__ import annotations

from typing import Any

import orjson

from shepherd.node.openai.structured import (
    SCHEMA_MAX_BYTES,
    Constraint,
    PendingSchema,
    SchemaBudget,
)
from shepherd.proto.openai_errors import bad

__all__ = ["GUIDED_KEYS", "MAX_CHOICES", "parse_guided"]

# the top-level request keys read here, in the order they are looked at
GUIDED_KEYS: tuple[str, ...] = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
    "guided_whitespace_pattern",  # an option, not a constraint: refused when set (no engine field)
)
MAX_CHOICES = 4096  # a guided_choice list (real ones: labels, a few to a few hundred)
_TEXT_MAX = SCHEMA_MAX_BYTES  # a regex, grammar or structural tag, in characters
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_UNSUPPORTED = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_SO_IGNORED = ("disable_fallback", "_backend", "_backend_was_auto", "backend")  # engine-side choices


def parse_guided(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> tuple[Constraint, str] | None:
    """The request's constraint and the field it came from, or None; JSON schemas go to ``pending``
    (meta-validated later, with ``response_format``'s)."""
    if d.get("guided_whitespace_pattern") not in (None, ""):
        msg = "'guided_whitespace_pattern' is not supported: the engine protocols carry no such option."
        raise bad(msg, param="guided_whitespace_pattern", code="unsupported_parameter")
    found: tuple[Constraint, str] | None = None
    for key in GUIDED_KEYS[:-1]:
        v = d.get(key)
        if v is None:
            continue
        if key == "structured_outputs":
            got = _structured_outputs(v, budget, pending)
        else:
            got = _field(key, _KIND[key], v, budget, pending)
        if got is None:
            continue
        if found is not None:
            raise _two(got[1], found[1])
        found = got
    if found is not None:
        rf = d.get("response_format")
        if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
            raise _two(found[1], "response_format")
    return found


_KIND = {
    "guided_json": "json",
    "json_schema": "json",
    "guided_regex": "regex",
    "regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "ebnf": "grammar",
}


def _two(param: str, other: str) -> Exception:
    msg = f"'{param}' and '{other}' both constrain the output; an engine applies one constraint per request."
    return bad(msg, param=param, code="conflicting_constraints")


def _field(
    param: str, kind: str, v: Any, budget: SchemaBudget, pending: list[PendingSchema]
) -> tuple[Constraint, str] | None:
    if kind == "json":
        schema = v
        if isinstance(v, str):
            if len(v) > _TEXT_MAX:
                raise bad(f"'{param}' may hold at most {_TEXT_MAX // 1024} KiB.", param=param)
            try:
                schema = orjson.loads(v)
            except orjson.JSONDecodeError:
                raise bad(f"'{param}' is not valid JSON.", param=param, code="invalid_schema") from None
        if not isinstance(schema, dict | bool):
            raise bad(f"'{param}' must be a JSON schema (an object, or its JSON text).", param=param)
        p = budget.take(schema, param)
        pending.append(p)
        return Constraint("json_schema", p.text.decode()), param
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise bad(f"'{param}' must be a non-empty list of strings.", param=param, code="invalid_type")
        if len(v) > MAX_CHOICES or sum(len(c) for c in v) > _TEXT_MAX:
            msg = f"'{param}' may hold at most {MAX_CHOICES} choices and {_TEXT_MAX // 1024} KiB."
            raise bad(msg, param=param)
        return Constraint("choice", orjson.dumps(v).decode()), param
    if kind == "json_object":
        if not isinstance(v, bool):
            raise bad(f"'{param}' must be a boolean.", param=param, code="invalid_type")
        return (Constraint("json_object", ""), param) if v else None
    if kind == "structural_tag" and isinstance(v, dict):
        v = orjson.dumps(v).decode()
    if not isinstance(v, str) or not v:
        raise bad(f"'{param}' must be a non-empty string.", param=param, code="invalid_type")
    if len(v) > _TEXT_MAX:
        raise bad(f"'{param}' may hold at most {_TEXT_MAX // 1024} KiB.", param=param)
    engine_kind = {"regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}[kind]
    return Constraint(engine_kind, v), param  # type: ignore[arg-type]


def _structured_outputs(
    v: Any, budget: SchemaBudget, pending: list[PendingSchema]
) -> tuple[Constraint, str] | None:
    so = "structured_outputs"
    if not isinstance(v, dict):
        raise bad(f"'{so}' must be an object.", param=so, code="invalid_type")
    for key in v:
        if key not in _SO_KINDS and key not in _SO_UNSUPPORTED and key not in _SO_IGNORED:
            raise bad(f"'{so}.{key}' is not a structured-outputs field.", param=f"{so}.{key}")
    for key in _SO_UNSUPPORTED:
        if v.get(key) not in (None, False, ""):
            msg = f"'{so}.{key}' is not supported: the engine protocols carry no such option."
            raise bad(msg, param=f"{so}.{key}", code="unsupported_parameter")
    found: tuple[Constraint, str] | None = None
    for key in _SO_KINDS:
        if v.get(key) is None:
            continue
        got = _field(f"{so}.{key}", key, v[key], budget, pending)
        if got is None:
            continue
        if found is not None:
            raise _two(got[1], found[1])
        found = got
    return found
