"""Structured outputs: the constraint an engine generates under, and the check of a finished answer.

- ``response_format``: ``json_object`` → the JSON schema ``{"type": "object"}`` (as SGLang sends it);
  ``json_schema`` → its ``schema``; ``structural_tag`` passed through; ``text`` → nothing.
- The engine gets one ``Constraint`` (SGLang's and vLLM's ``oneof constraint``: json_schema, regex,
  ebnf, structural_tag). A forced tool call (``tool_choice`` required / named) takes precedence over
  ``response_format``, then a strict tools' structural tag (see tool_choice.py).
- ``OutputChecks`` validates a finished NON-streamed choice: its content against the response
  format; its tool calls against ``tool_choice`` (a forced call must be there) and against the
  parameters of ``strict`` tools. A stream is not held back for a check.

How a violation is reported (OpenAI has no field for it): the answer is returned as generated, the
choice carries a ``schema_violation`` message and the response an ``x-smg-schema-violation`` header;
never a retryable status (SDKs retry 5xx: one ``parse()`` would run the generation three times). With
``--reject-schema-violations`` a violation of what the request asked to be strict (``json_schema.strict``
or a ``strict`` tool) is a 422 ``schema_violation`` (``Generation.rejected``, ``strict_violation``).
A choice cut by ``max_tokens`` (``finish_reason: length``) is not checked: it is incomplete by request.

Schema validation uses ``jsonschema`` (Draft 2020-12). Its meta-validation (is this a schema at all?)
costs ~40 µs per JSON node (~5-9 µs per byte), so a request's schemas are bounded and checked off the
event loop:

- Bounds (``SchemaBudget``), over all the schemas of one request (``tools[].function.parameters`` and
  ``response_format.json_schema.schema``) together: at most ``SCHEMA_MAX_BYTES`` (512 KiB) of JSON
  and ``SCHEMA_MAX_NODES`` (20,000 JSON values: objects, arrays, strings, numbers, ...). A real tool
  schema is 0.3-5 kB and 20-300 nodes; a big MCP tool set (~100 tools) ~100 kB; OpenAI's own limit
  for structured outputs is 5,000 properties (~20,000 nodes at 3-4 per property). Over a bound: 400
  naming the parameter, before any validation. Checking a bound costs one ``orjson.dumps`` (C) and,
  only above 40 kB, a node count that stops at the bound.
- Meta-validation (``check_schemas``) runs in a dedicated thread (``schema-check``; a request's schemas of
  at most ``SMALL_LANE_BYTES`` in all in a second one, so that big ones queued by one caller do not hold
  up everyone's small ones) with a deadline
  (``SCHEMA_CHECK_SECONDS``, queueing included): past it the request gets a 400 (``schema_too_complex``)
  and a job not yet started is cancelled; one already running ends on its own, within the bounds
  (~1 s at 20,000 nodes). Handlers call it after the model lookup and admission. ``schema_error``
  (inline) stays for callers that need a synchronous answer.
- Results are cached in ``ByteLRU``s bounded in bytes: meta-validation answers by schema text (a
  16-byte digest of it above 1 KiB; the answer is "" or a short message), validators by schema text
  (counted with an estimate of the parsed schema they hold).
- The check of a finished answer runs on the event loop, so it has a time budget
  (``ANSWER_CHECK_SECONDS``, all the choices of a request together): the answer is the model's and the
  schema the caller's, and both can make a check cost without bound (a ``pattern`` that backtracks, as
  ``^(a+)+$`` on a string the model wrote, in ``pattern``, ``patternProperties`` or
  ``additionalProperties``; ``uniqueItems`` over thousands of items that do not sort, which jsonschema
  compares pairwise; ``anyOf`` nested in ``anyOf``). Every keyword looks at the clock before it runs,
  patterns are matched by ``regex`` with the budget left as its timeout, and ``uniqueItems`` is one pass
  over the items' canonical forms. An answer whose check runs out of budget is flagged as not checked (a
  violation that is never strict: ``--reject-schema-violations`` does not refuse an answer for the
  clock), never a stalled loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import re
import reprlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import orjson
import regex  # type: ignore[import-untyped]  # (no stubs: its search and timeout only)

from shepherd.proto.openai_errors import ApiError, bad
from shepherd.tokens.cache import ByteLRU

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

__all__ = [
    "ANSWER_CHECK_SECONDS",
    "SCHEMA_CHECK_SECONDS",
    "SCHEMA_MAX_BYTES",
    "SCHEMA_MAX_NODES",
    "Constraint",
    "OutputChecks",
    "PendingSchema",
    "SchemaBudget",
    "Violation",
    "check_schemas",
    "check_schemas_now",
    "response_format_constraint",
    "schema_error",
]

# "choice": a JSON list of strings (vLLM's choice constraint; SGLang gets it as a grammar), "json_object":
# any JSON object (vLLM's json_object; SGLang gets the schema {"type": "object"}); see guided.py
ConstraintKind = Literal["json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"]


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

SCHEMA_MAX_BYTES = 512 * 1024  # all the schemas of one request, as compact JSON
SCHEMA_MAX_NODES = 20_000  # all the schemas of one request, JSON values counted
SCHEMA_CHECK_SECONDS = 10.0  # meta-validation off the loop, waiting for the thread included
_NODE_COUNT_FROM = 2 * SCHEMA_MAX_NODES  # below this many bytes a JSON text cannot hold more nodes

_META_CACHE_ENTRIES = 8192  # schema text (<= 1 KiB) or digest -> "" | message (<= 300 chars)
_META_CACHE_BYTES = 4 << 20
_VALIDATOR_CACHE_BYTES = 32 << 20  # schema text + ~8x for the parsed schema a validator holds
_PARSED_FACTOR = 8


def _node_count(value: Any, limit: int) -> int:
    """The JSON values in ``value`` (containers and scalars), counting stops once past ``limit``."""
    n = 0
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        v = pop()
        n += 1
        if n > limit:
            return n
        t = type(v)
        if t is dict:
            push(v.values())
        elif t is list:
            push(v)
    return n


class PendingSchema(NamedTuple):
    """A request's schema, within bounds, waiting for meta-validation (``check_schemas``). (A
    NamedTuple: one is built per schema per request, ~4x cheaper than a frozen dataclass.)"""

    where: str | int  # the request field, dotted ("response_format.json_schema.schema"), or a tool's index
    text: bytes  # the schema as compact JSON

    @property
    def param(self) -> str:
        """The request field, dotted (``tools.0.function.parameters``)."""
        w = self.where
        return f"tools.{w}.function.parameters" if isinstance(w, int) else w

    @property
    def label(self) -> str:
        """The field as messages name it (``tools[0].function.parameters``)."""
        w = self.where
        return f"tools[{w}].function.parameters" if isinstance(w, int) else f"'{w}'"


class SchemaBudget:
    """The bounds of one request's schemas, taken schema by schema (``take``): bytes always; JSON values
    once the request's schemas pass 40 kB (below, they cannot hold more than the bound), then counted
    exactly, each count stopping at the bound."""

    __slots__ = ("_uncounted", "bytes", "nodes")

    def __init__(self) -> None:
        self.bytes = 0
        self.nodes = 0
        self._uncounted: list[Any] = []

    def take(self, schema: Any, where: str | int) -> PendingSchema:
        """``schema`` (an object or a boolean) measured against what is left; raises a 400 naming the
        field (``where``: a dotted request field, or the index of a tool whose parameters these are)
        when the request's schemas go over a bound (nothing validated yet)."""
        if not isinstance(schema, dict | bool):
            p = _pending(PendingSchema, (where, b""))
            raise bad(f"{p.label} is not a valid JSON schema: a schema must be an object", param=p.param)
        try:
            text = orjson.dumps(schema)
        except (TypeError, orjson.JSONEncodeError) as e:  # e.g. nested deeper than 254 levels
            p = _pending(PendingSchema, (where, b""))
            msg = f"{p.label} cannot be serialised: {e}."
            raise ApiError(400, msg, param=p.param, code="invalid_schema") from None
        self.bytes += len(text)
        if self.bytes > SCHEMA_MAX_BYTES:
            raise _too_large(where, f"exceed {SCHEMA_MAX_BYTES // 1024} KiB")
        if self.bytes <= _NODE_COUNT_FROM:
            self._uncounted.append(schema)
        else:
            for earlier in self._uncounted:
                self.nodes += _node_count(earlier, SCHEMA_MAX_NODES)
            self._uncounted.clear()
            self.nodes += _node_count(schema, SCHEMA_MAX_NODES - self.nodes)
            if self.nodes > SCHEMA_MAX_NODES:
                raise _too_large(where, f"hold more than {SCHEMA_MAX_NODES} values")
        return _pending(PendingSchema, (where, text))


_pending = tuple.__new__  # PendingSchema(...) without the keyword-handling __new__ wrapper


def _too_large(where: str | int, what: str) -> ApiError:
    p = _pending(PendingSchema, (where, b""))
    msg = f"{p.label}: the request's JSON schemas {what} in total."
    return bad(msg, param=p.param, code="schema_too_large")


def _meta_key(text: bytes) -> bytes:
    """The meta-validation cache key: a schema text itself up to 1 KiB (most), else a 16-byte digest."""
    return text if len(text) <= _META_KEY_TEXT else hashlib.blake2b(text, digest_size=16).digest()


_META_KEY_TEXT = 1024
_VALID = ""  # the cached answer of a valid schema (None: not cached)
_META: ByteLRU[bytes, str] = ByteLRU(_META_CACHE_BYTES, _META_CACHE_ENTRIES, max_item_bytes=2048)
_VALIDATORS: ByteLRU[bytes, Validator] = ByteLRU(_VALIDATOR_CACHE_BYTES)


def _meta_error(text: bytes) -> str | None:
    """Why the JSON text is not a Draft 2020-12 schema, or None: the slow part (any thread)."""
    # here, not at the top: jsonschema costs ~40 ms of start-up and most requests carry no schema
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(orjson.loads(text))
    except SchemaError as e:
        return e.message[:300]
    except Exception as e:  # whatever the checker trips on, the schema is unusable
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _remember_meta(key: bytes, problem: str | None) -> None:
    _META.put(key, problem or _VALID, 160 + len(key) + (len(problem) if problem else 0))


def _cached_meta(text: bytes) -> tuple[bytes, str | None]:
    """(cache key, the cached answer: "" valid, a message, or None when not cached)."""
    key = _meta_key(text)
    return key, _META.get(key)


ANSWER_CHECK_SECONDS = 0.2  # a request's answer checks (on the event loop), all its choices together

# while an answer is checked: the time its check must end by (None: no check under way, patterns as
# jsonschema matches them, e.g. in the schema-check thread's meta-validation)
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "answer_check_deadline", default=None
)


class CheckTimeout(Exception):
    """An answer's check ran out of its time budget."""


class _TimedRe:
    """What jsonschema's keyword modules call ``re``: while an answer is checked, a pattern is matched by
    ``regex`` (the same syntax) with the budget left as its timeout; else as ``re`` does."""

    def search(self, pattern: str, string: str, flags: int = 0) -> Any:
        deadline = _DEADLINE.get()
        if deadline is None:
            return re.search(pattern, string, flags)
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckTimeout
        try:
            return regex.search(pattern, string, flags, timeout=left)
        except TimeoutError:
            raise CheckTimeout from None

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)


def _timed(keyword: Callable[..., Any]) -> Callable[..., Any]:
    def run(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        deadline = _DEADLINE.get()
        if deadline is not None and time.monotonic() > deadline:
            raise CheckTimeout
        return keyword(validator, value, instance, schema)

    return run


def _canon(v: Any) -> Any:
    """A hashable form of a JSON value, equal for values JSON Schema holds equal (1 and 1.0; not 1 and
    true; objects whatever their key order)."""
    if v is True or v is False:
        return ("b", v)
    if isinstance(v, int | float):
        return ("n", v)
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, list):
        return ("l", tuple(_canon(x) for x in v))
    if isinstance(v, dict):
        return ("o", frozenset((k, _canon(x)) for k, x in v.items()))
    return ("z", None) if v is None else ("?", id(v))


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``uniqueItems`` in one pass (jsonschema compares items pairwise when they do not sort)."""
    from jsonschema.exceptions import ValidationError  # not at the top: jsonschema's start-up cost

    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        try:
            key = _canon(item)
        except RecursionError:  # (deeper than the interpreter recurses: jsonschema could not either)
            return
        if key in seen:
            yield ValidationError(f"{reprlib.repr(instance)} has non-unique elements")
            return
        seen.add(key)


_CHECKER: Any = None


def _checker_class() -> Any:
    """Draft 2020-12 with every keyword on the clock and ``uniqueItems`` in one pass (made once)."""
    global _CHECKER
    if _CHECKER is None:
        # here, not at the top: jsonschema costs ~40 ms of start-up and most requests carry no schema
        from jsonschema import Draft202012Validator, _keywords, _legacy_keywords, _utils
        from jsonschema.validators import extend  # not at the top: as above

        timed_re = _TimedRe()
        for module in (_keywords, _utils, _legacy_keywords):  # their pattern matches (module ``re``)
            module.re = timed_re  # type: ignore[attr-defined]
        keywords = {k: _timed(fn) for k, fn in Draft202012Validator.VALIDATORS.items()}
        keywords["uniqueItems"] = _timed(_unique_items)
        _CHECKER = extend(Draft202012Validator, validators=keywords)  # type: ignore[no-untyped-call]
    return _CHECKER


_REFS: Any = None  # the registry the answer checks resolve ``$ref`` in: nothing beyond the schema


def _validator(schema_json: str | bytes) -> Validator:
    """A validator for a schema that passed meta-validation (building one is cheap; checking the
    schema is what costs), cached by text within ``_VALIDATOR_CACHE_BYTES``.

    Its ``$ref``s resolve within the schema only (its ``$defs``, its embedded ``$id`` resources): an empty
    ``referencing.Registry``, which retrieves nothing. jsonschema's default registry fetches any other
    URI itself (``http://``, ``file://``), synchronously on the event loop: a client's schema would make
    the node read its files into the answer's violation message and stall on slow URLs."""
    global _REFS
    key = schema_json.encode() if isinstance(schema_json, str) else schema_json
    v = _VALIDATORS.get(key)
    if v is None:
        if _REFS is None:
            from referencing import Registry  # not at the top: with jsonschema (see _checker_class)

            _REFS = Registry()
        v = _checker_class()(orjson.loads(key), registry=_REFS)
        _VALIDATORS.put(key, v, len(key) * (1 + _PARSED_FACTOR) + 256)
    return v


def schema_error(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON schema (Draft 2020-12), or None. Synchronous, on the calling
    thread; bounded by the per-request bounds (a schema over them gets a message saying so). Handlers
    prefer ``SchemaBudget.take`` + ``check_schemas`` (off the loop, with a deadline)."""
    if not isinstance(schema, dict | bool):
        return "a schema must be an object"
    text = _dumps(schema).encode()
    if len(text) > SCHEMA_MAX_BYTES:
        return f"it exceeds {SCHEMA_MAX_BYTES // 1024} KiB"
    if len(text) > _NODE_COUNT_FROM and _node_count(schema, SCHEMA_MAX_NODES) > SCHEMA_MAX_NODES:
        return f"it holds more than {SCHEMA_MAX_NODES} values"
    key, problem = _cached_meta(text)
    if problem is None:
        problem = _meta_error(text)
        _remember_meta(key, problem)
    return problem or None


def _invalid(p: PendingSchema, problem: str) -> ApiError:
    """The 400 of an invalid schema."""
    return bad(f"{p.label} is not a valid JSON schema: {problem}", param=p.param)


def check_schemas_now(pending: Sequence[PendingSchema]) -> None:
    """Meta-validate on the calling thread (bounded by ``SchemaBudget``): raises the 400 of the first
    invalid schema. For callers that cannot await; handlers use ``check_schemas``."""
    get = _META.get
    for p in pending:
        t = p.text
        key = t if len(t) <= _META_KEY_TEXT else _meta_key(t)
        problem = get(key)
        if problem is None:
            problem = _meta_error(p.text)
            _remember_meta(key, problem)
        if problem:
            raise _invalid(p, problem)


# a request whose schemas to check hold at most this many bytes goes to a lane of its own: a caller that
# queues big schemas (~1 s each at the bounds) does not make everyone else's small ones wait past the
# deadline (the two threads share the interpreter, so a small job runs at half speed at worst: ms)
SMALL_LANE_BYTES = 16 * 1024
_EXECUTORS: dict[bool, ThreadPoolExecutor] = {}


def _executor(small: bool = False) -> ThreadPoolExecutor:
    ex = _EXECUTORS.get(small)
    if ex is None:
        name = "schema-check-small" if small else "schema-check"
        ex = _EXECUTORS[small] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return ex


def _meta_errors(texts: list[bytes]) -> list[str | None]:
    return [_meta_error(t) for t in texts]


async def check_schemas(pending: Sequence[PendingSchema], deadline: float = SCHEMA_CHECK_SECONDS) -> None:
    """Meta-validate a request's schemas off the event loop: cached answers at once, the rest in the
    ``schema-check`` thread within ``deadline`` seconds (waiting included). Raises the 400 of the first
    invalid schema, or a 400 ``schema_too_complex`` past the deadline (a job not started is cancelled;
    a running one ends within the bounds). Call it after the model lookup and admission."""
    if not pending:
        return
    todo: list[tuple[PendingSchema, bytes]] = []
    first: tuple[int, str] | None = None
    for i, p in enumerate(pending):
        key, problem = _cached_meta(p.text)
        if problem is None:
            todo.append((p, key))
        elif problem and first is None:
            first = (i, problem)
    if todo:
        texts = [p.text for p, _ in todo]
        small = sum(map(len, texts)) <= SMALL_LANE_BYTES
        fut: Future[list[str | None]] = _executor(small).submit(_meta_errors, texts)
        try:
            async with asyncio.timeout(deadline):
                answers = await asyncio.wrap_future(fut)
        except TimeoutError:
            fut.cancel()
            p = todo[0][0]
            raise bad(
                f"{p.label}: the request's JSON schemas could not be validated within {deadline:g} s.",
                param=p.param,
                code="schema_too_complex",
            ) from None
        index = {id(p): i for i, p in enumerate(pending)}
        for (p, key), problem in zip(todo, answers, strict=True):
            _remember_meta(key, problem)
            if problem is not None and (first is None or index[id(p)] < first[0]):
                first = (index[id(p)], problem)
    if first is not None:
        raise _invalid(pending[first[0]], first[1])


def _violation(schema_json: str, value: Any) -> str | None:
    try:
        v = _validator(schema_json)
    except Exception:  # not a schema after all (a caller that skipped meta-validation): nothing to report
        return None
    try:
        err = next(iter(v.iter_errors(value)), None)
    except CheckTimeout:
        raise
    except Exception:  # e.g. a $ref to nowhere (or outside the schema): it cannot be applied, no report
        return None
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    text = f"{err.message}" + (f" (at /{where})" if where else "")
    # (the answer's values are in it: a lone surrogate the answer's JSON escaped would break its encoding)
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Unreadable(Exception):
    """Valid JSON the answer check cannot read (a number past Python's digit limit, nesting past the
    recursion limit)."""


def _answer_json(text: str) -> Any:
    """The answer's JSON value. orjson first; what it refuses that is still JSON (RFC 8259) goes to the
    standard library: escaped lone surrogates, integers past 64 bits, nesting past orjson's 1,024 levels.
    Raises ValueError when it is not JSON, ``_Unreadable`` when it cannot be read here."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as e:
        raise _Unreadable(str(e)[:100]) from None


def _not_json(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


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
    # the time the request's answer checks may still take (``ANSWER_CHECK_SECONDS`` at first)
    budget: list[float] = field(default_factory=lambda: [ANSWER_CHECK_SECONDS], compare=False)

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
        """The first problem of one finished choice (``calls``: (name, arguments JSON) pairs), within
        what is left of the request's time budget (past it: a violation saying it was not checked)."""
        if finish_reason not in ("stop", "tool_calls"):
            return None
        left = self.budget[0]
        t0 = time.monotonic()
        token = _DEADLINE.set(t0 + left)
        try:
            if left <= 0:
                raise CheckTimeout
            return self._check(index, content, calls)
        except CheckTimeout:  # not known to be broken: flagged, never a strict violation (no 422 for it)
            strict = False
            param = "tools" if self.strict_tools and calls else _RF if self.content_kind else "tool_choice"
            budget_ms = ANSWER_CHECK_SECONDS * 1000
            msg = f"the answer could not be checked within the time budget ({budget_ms:.0f} ms)"
            return Violation(index, msg, strict, param)
        finally:
            _DEADLINE.reset(token)
            self.budget[0] = left - (time.monotonic() - t0)

    def _check(self, index: int, content: str | None, calls: Sequence[tuple[str, str]]) -> Violation | None:
        for name, arguments in calls:
            schema = self.strict_tools.get(name)
            if schema is None:
                continue
            try:
                args = _answer_json(arguments)
            except _Unreadable as e:
                return Violation(
                    index, f"tool call {name!r}: arguments could not be checked ({e})", False, "tools"
                )
            except ValueError:
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
            value = _answer_json(text)
        except _Unreadable as e:
            return Violation(index, f"the content could not be checked ({e})", False, _RF)
        except ValueError:
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
