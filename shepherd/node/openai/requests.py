"""OpenAI request parsing and validation into typed requests, and the OpenAI error envelope.

Every rejection is an ``ApiError`` carrying the HTTP status and the envelope fields, so no handler ever
answers bad input with a 500.

Bounds on what one request may hold (each a 400 naming the parameter; none is near real use, and each
keeps what a request leaves in the node's caches, and the per-token stop work, small):

- ``stop``: at most ``MAX_STOP`` (16) strings of at most ``MAX_STOP_CHARS`` (1024) characters each
  (OpenAI accepts 4; real stops are a few characters to a line; vLLM and SGLang set no bound);
- ``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS`` (256) ids;
- ``logit_bias``: at most ``MAX_LOGIT_BIAS`` (1024) entries (real uses ban or favour tens of tokens);
- ``chat_template_kwargs``: at most ``MAX_TEMPLATE_KWARGS_BYTES`` (64 KiB) of JSON (real ones are a few
  flags: ``enable_thinking``, ``reasoning_effort``);
- ``tools``: at most ``MAX_TOOLS`` (2048) tools and ``MAX_TOOLS_BYTES`` (1 MiB) of JSON with their
  descriptions (OpenAI accepts 128 tools; a big MCP tool set is ~100 kB);
- JSON schemas (tools' parameters and ``response_format``): see structured.py (512 KiB, 20,000 values).

Schemas: ``parse_chat`` meta-validates them inline, as before; handlers call ``parse_chat_deferred``
(bounds only), then, after the model lookup and admission, ``await check_chat_schemas(req)`` (off the
event loop, with a deadline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import orjson

from shepherd.node.openai.guided import GUIDED_KEYS, parse_guided
from shepherd.node.openai.structured import (
    SCHEMA_MAX_BYTES,
    Constraint,
    PendingSchema,
    SchemaBudget,
    check_schemas,
    check_schemas_now,
    response_format_constraint,
)
from shepherd.node.openai.template_compat import REASONING_EFFORTS
from shepherd.node.openai.tool_choice import NONE as NO_TOOL_CHOICE
from shepherd.node.openai.tool_choice import (
    ToolChoice,
    ToolChoiceError,
    check_tool_name,
    parse_choice_and_tools,
)
from shepherd.proto.openai_errors import bad

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_N = 128
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_TOOLS = 2048
MAX_TOOLS_BYTES = 1024 * 1024
MAX_TOP_LOGPROBS = 20


# ---- typed field readers -------------------------------------------------------------------------


def _num(
    d: dict[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False
) -> float:
    v = d.get(key)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (isinstance(v, float) and not math.isfinite(v))
    ):
        raise bad(f"'{key}' must be a number.", param=key, code="invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        msg = f"'{key}' must be in {left}{lo}, {hi}], got {shown(v)}."
        raise bad(msg, param=key, code="invalid_value")
    return float(v)


def shown(v: float) -> str:
    """A number for an error message: an integer too long to print usefully (or at all: Python refuses
    str() of ints over 4300 digits) is named by its size."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    return str(v)


def shown_id(record_id: str) -> str:
    """An id as an error message quotes it: a client's 60 kB "id" is not echoed whole."""
    return record_id if len(record_id) <= 128 else record_id[:128] + "..."


INT32_MAX = (1 << 31) - 1  # engine protos hold counts and ids in 32-bit fields


def _int(d: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(f"'{key}' must be an integer.", param=key, code="invalid_type")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be {rng}, got {shown(v)}.", param=key, code="invalid_value")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean.", param=key, code="invalid_type")
    return v


def _dict(d: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"'{key}' must be an object.", param=key, code="invalid_type")
    return v


def _stop(d: dict[str, Any]) -> tuple[str, ...]:
    v = d.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > MAX_STOP:
            raise bad(f"'stop' may hold at most {MAX_STOP} sequences.", param="stop", code="invalid_value")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise _long_stop()
        if not all(v):  # (it would match anywhere: vLLM's SamplingParams refuses it so)
            raise bad("'stop' cannot contain an empty string.", param="stop", code="invalid_value")
        return tuple(v)
    raise bad("'stop' must be a string or a list of strings.", param="stop", code="invalid_type")


def _long_stop() -> Exception:
    msg = f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long."
    return bad(msg, param="stop", code="invalid_value")


def _int_list(d: dict[str, Any], key: str, most: int = MAX_STOP_TOKEN_IDS) -> tuple[int, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if isinstance(v, list) and len(v) > most:
        raise bad(f"'{key}' may hold at most {most} token ids.", param=key, code="invalid_value")
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX for x in v
    ):
        msg = f"'{key}' must be a list of token ids (integers in [0, {INT32_MAX}])."
        raise bad(msg, param=key, code="invalid_type")
    return tuple(v)


def _logit_bias(d: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    v = d.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad(
            "'logit_bias' must be an object of token id -> bias.", param="logit_bias", code="invalid_type"
        )
    if len(v) > MAX_LOGIT_BIAS:
        msg = f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries."
        raise bad(msg, param="logit_bias", code="invalid_value")
    out = []
    for k, b in v.items():
        if len(k) > 12:  # no token id is written with more digits (int() of a long string is slow)
            raise bad(f"'logit_bias' key {k[:20]!r}... is not a token id.", param="logit_bias")
        try:
            tok = int(k)
        except ValueError:
            raise bad(f"'logit_bias' key {k!r} is not a token id.", param="logit_bias") from None
        if not 0 <= tok <= INT32_MAX:
            raise bad(f"'logit_bias' key {k!r} is not a token id.", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise bad("'logit_bias' values must be numbers in [-100, 100].", param="logit_bias")
        out.append((tok, float(b)))
    return tuple(out)


# ---- common sampling fields ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    max_tokens: int | None
    min_tokens: int
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    seed: int | None
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    logit_bias: tuple[tuple[int, float], ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM)
    # which of the fields a model's sampling defaults stand in for (DEFAULTABLE) the request left unset
    # (absent or null): those get the model's default, when its engine reports one (generation.py)
    unset: frozenset[str] = frozenset()


# the fields a model's sampling defaults fill when a request leaves them unset (as SMG's
# apply_sampling_defaults_to_generate_request)
DEFAULTABLE: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_UNSET_CACHE: dict[tuple[bool, ...], frozenset[str]] = {}


def _unset(d: dict[str, Any]) -> frozenset[str]:
    """The DEFAULTABLE fields ``d`` leaves unset (one frozenset per combination, shared)."""
    key = tuple(d.get(k) is None for k in DEFAULTABLE)
    got = _UNSET_CACHE.get(key)
    if got is None:
        got = _UNSET_CACHE[key] = frozenset(k for k, u in zip(DEFAULTABLE, key, strict=True) if u)
    return got


# every request key parse_sampling reads
_SAMPLING_KEYS: frozenset[str] = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "top_k",
        "stream",
        "stream_options",
        "seed",
        "min_tokens",
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "n",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "no_stop_trim",
        "logit_bias",
    }
)
_SCALARS: frozenset[type] = frozenset({str, int, float, bool, type(None)})
_SAMPLING_MEMO: dict[tuple[Any, ...], Sampling] = {}
SAMPLING_MEMO_MAX = 1024
# the memo's bytes (estimated: what a key and its Sampling hold beyond a plain parameter set); the
# memo is emptied when an entry would take it over, and an entry over an eighth is not kept
SAMPLING_MEMO_BYTES = 4 << 20
_memo_bytes = 0


def _sampling_cost(s: Sampling) -> int:
    """Bytes an entry holds (estimate: the key holds the same strings and ids as the Sampling)."""
    return (
        512
        + sum(2 * (4 * len(x) + 64) for x in s.stop)
        + 2 * 40 * len(s.stop_token_ids)
        + 2 * 120 * len(s.logit_bias)
    )


def _flat(v: Any) -> Any:
    """A hashable stand-in for a JSON value that tells apart what validation tells apart (its type:
    ``1``, ``1.0`` and ``True`` are equal in Python), or None when it is too deep to bother."""
    t = type(v)
    if t in _SCALARS:
        return (t, v)
    if t is list:
        if all(type(x) in _SCALARS for x in v):
            return (t, *[(type(x), x) for x in v])
        return None
    if t is dict:
        if all(type(x) in _SCALARS for x in v.values()):
            return (t, *[(k, type(x), x) for k, x in v.items()])
        return None
    return None


def _sampling_key(d: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> tuple[Any, ...] | None:
    key: list[Any] = [max_tokens_keys]
    keys = _SAMPLING_KEYS
    for k, v in d.items():
        if k in keys:
            f = _flat(v)
            if f is None:
                return None
            key.append((k, f))
    return tuple(key)


def parse_sampling(d: dict[str, Any], *, max_tokens_keys: tuple[str, ...]) -> Sampling:
    """The request's sampling fields, validated. Requests of a fleet repeat a few parameter sets, so the
    result (immutable) is memoized by exactly what it is computed from: the sampling keys present, in
    order, with their values and JSON types (a rejected set raises each time, as it is not stored)."""
    key = _sampling_key(d, max_tokens_keys)
    if key is None:
        return _parse_sampling(d, max_tokens_keys)
    s = _SAMPLING_MEMO.get(key)
    if s is None:
        s = _parse_sampling(d, max_tokens_keys)
        _memoize(key, s)
    return s


def _memoize(key: tuple[Any, ...], s: Sampling) -> None:
    global _memo_bytes
    cost = 512 if not (s.stop or s.stop_token_ids or s.logit_bias) else _sampling_cost(s)
    if cost > SAMPLING_MEMO_BYTES // 8:
        return
    if len(_SAMPLING_MEMO) >= SAMPLING_MEMO_MAX or _memo_bytes + cost > SAMPLING_MEMO_BYTES:
        _SAMPLING_MEMO.clear()
        _memo_bytes = 0
    _SAMPLING_MEMO[key] = s
    _memo_bytes += cost


def sampling_memo_bytes() -> int:
    """The estimated bytes the sampling memo holds (tests: never over ``SAMPLING_MEMO_BYTES``)."""
    return _memo_bytes


def _parse_sampling(d: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> Sampling:
    max_tokens: int | None = None
    for key in max_tokens_keys:
        val = _int(d, key, None, 1, INT32_MAX)
        if val is not None:
            max_tokens = val
    top_k = _int(d, "top_k", -1, -1, INT32_MAX)
    stream = _bool(d, "stream", False)
    opts = _dict(d, "stream_options")
    include_usage = continuous_usage = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        include_usage = _bool(opts, "include_usage", False)
        # vLLM: usage on every chunk when both are set (should_include_usage)
        continuous_usage = include_usage and _bool(opts, "continuous_usage_stats", False)
    seed = d.get("seed")
    if isinstance(seed, float) and seed.is_integer():  # 5.0 (pydantic's lax int, as vLLM reads it), or
        seed = int(seed)  # an integer past 64 bits, which JSON's reader made a float: refused just below
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("'seed' must be an integer.", param="seed", code="invalid_type")
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise bad("'seed' must be a 64-bit integer.", param="seed", code="invalid_value")
    min_tokens = _int(d, "min_tokens", 0, 0, INT32_MAX) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(
            f"'min_tokens' ({min_tokens}) must not exceed the maximum tokens ({max_tokens}).",
            param="min_tokens",
            code="invalid_value",
        )
    return Sampling(
        temperature=_num(d, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k if top_k else -1,
        min_p=_num(d, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=_num(d, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(d, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_num(d, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=_int(d, "n", 1, 1, MAX_N) or 1,
        stop=_stop(d),
        stop_token_ids=_int_list(d, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        seed=seed,
        ignore_eos=_bool(d, "ignore_eos", False),
        skip_special_tokens=_bool(d, "skip_special_tokens", True),
        spaces_between_special_tokens=_bool(d, "spaces_between_special_tokens", True),
        # SGLang's no_stop_trim is vLLM's include_stop_str_in_output
        include_stop_str_in_output=_bool(d, "include_stop_str_in_output", False)
        or _bool(d, "no_stop_trim", False),
        logit_bias=_logit_bias(d),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        unset=_unset(d),
    )


def _model(d: dict[str, Any]) -> str:
    """The requested model; "" when the request names none (vLLM serves its one model then: the
    gateway's ``resolve_model`` does the same, and answers a 400 when it serves several)."""
    m = d.get("model")
    if m is None:
        return ""
    if not isinstance(m, str):
        raise bad("'model' must be a string.", param="model", code="invalid_type")
    return m


def _user(d: dict[str, Any]) -> None:
    """OpenAI's ``user`` (an end-user id; not used): a string, as OpenAI and vLLM require."""
    u = d.get("user")
    if u is not None and type(u) is not str:
        raise bad("'user' must be a string.", param="user", code="invalid_type")


# ---- chat ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    """A validated chat request (read-only by convention: not frozen, as a frozen dataclass of this
    many fields costs ~3 µs to build, on every request)."""

    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    logprobs: bool
    top_logprobs: int
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    response_format: dict[str, Any] | None
    raw: dict[str, Any]
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    # the request's JSON schemas, within bounds, until ``check_chat_schemas`` (``parse_chat_deferred``;
    # empty after ``parse_chat``, which checked them)
    schemas: tuple[PendingSchema, ...] = ()
    # a vLLM / SGLang constrained-decoding field's constraint and that field (guided.py)
    guided: Constraint | None = None
    guided_param: str = ""
    reasoning_effort: str | None = None  # mapped to the template's thinking switch when rendering
    effort_required: bool = True  # a template without a thinking switch refuses it (False: ignored)
    legacy_functions: bool = False  # the request used ``functions``: answers carry ``function_call``
    include_reasoning: bool = True  # vLLM's: false drops the parsed reasoning from the answer
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs (this many alternatives) in the answer
    # the messages whose content came as several text parts, by index: those parts as vLLM gives them to
    # a template that iterates over a message's content (``template_compat.with_text_parts``)
    text_parts: dict[int, list[dict[str, str]]] | None = None


# the content parts that are text, and the key holding it: OpenAI's text, the Responses API's input_text
# and output_text, and an assistant turn's refusal (what the API answered, sent back in the history), as
# vLLM reads them (chat_utils: text, input_text, output_text and refusal parts are their text)
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _content_text(content: Any, idx: int, parts: dict[int, list[dict[str, str]]] | None = None) -> Any:
    """Flatten a list of text parts to one string, as vLLM does for a template that reads a message's
    content as a string ("\n" between the parts); several parts also go to ``parts`` (by message index),
    for a template that iterates over the content (vLLM's "openai" content format: it joins them)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise bad(
                    f"messages[{idx}].content parts must be objects with a 'type'.",
                    param=f"messages.{idx}.content",
                )
            kind = part["type"]
            if type(kind) is str and kind in _TEXT_PARTS:
                key = _TEXT_PARTS[kind]
                t = part.get(key)
                if not isinstance(t, str):
                    raise bad(
                        f"messages[{idx}].content {kind} part needs a string '{key}'.",
                        param=f"messages.{idx}.content",
                    )
                texts.append(t)
            else:
                raise bad(
                    f"messages[{idx}].content part type {part['type']!r} is not supported (text model).",
                    param=f"messages.{idx}.content",
                    code="unsupported_content",
                )
        if parts is not None and len(texts) > 1:
            parts[idx] = [{"type": "text", "text": t} for t in texts]
        return "\n".join(texts)
    raise bad(
        f"messages[{idx}].content must be a string or a list of parts.", param=f"messages.{idx}.content"
    )


def parse_metadata(v: Any, param: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata (chat completions, responses, conversations): at most 16 string pairs, keys up to
    64 and values up to 512 characters."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"Invalid type for '{param}': expected an object.", param=param, code="invalid_type")
    if len(v) > MAX_METADATA_PAIRS:
        raise bad(
            f"Invalid '{param}': too many properties. Expected an object with at most "
            f"{MAX_METADATA_PAIRS} properties, but got {len(v)} instead.",
            param=param,
            code="object_above_max_properties",
        )
    for k, val in v.items():
        if len(k) > MAX_METADATA_KEY:
            raise bad(
                f"Invalid '{param}': key {k[:80]!r} is longer than {MAX_METADATA_KEY} characters.",
                param=param,
                code="string_above_max_length",
            )
        if not isinstance(val, str):
            raise bad(
                f"Invalid type for '{param}.{k}': expected a string.",
                param=f"{param}.{k}",
                code="invalid_type",
            )
        if len(val) > MAX_METADATA_VALUE:
            raise bad(
                f"Invalid '{param}.{k}': string too long. Expected a string with maximum length "
                f"{MAX_METADATA_VALUE}, but got a string with length {len(val)} instead.",
                param=f"{param}.{k}",
                code="string_above_max_length",
            )
    return dict(v)


def _json_kind(v: object) -> str:
    """What a JSON value is, in OpenAI's error words ("a string", "an object", ...)."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "an object"
    return "an array" if isinstance(v, list) else "null"


def _messages(
    d: dict[str, Any], parts: dict[int, list[dict[str, str]]] | None = None
) -> list[dict[str, Any]]:
    """The request's messages, checked, list contents flattened (their text parts into ``parts``: see
    ``_content_text``; a tool message's stay flattened, as vLLM gives them to every template)."""
    msgs = d.get("messages")
    if msgs is None:  # (OpenAI's words and codes for each case)
        absent = "missing_required_parameter"
        raise bad("Missing required parameter: 'messages'.", param="messages", code=absent)
    if not isinstance(msgs, list):
        raise bad(
            f"Invalid type for 'messages': expected an array of objects, but got {_json_kind(msgs)} instead.",
            param="messages",
            code="invalid_type",
        )
    if not msgs:
        raise bad(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
            "array instead.",
            param="messages",
            code="empty_array",
        )
    out: list[dict[str, Any]] = []
    legacy = False  # a legacy function-calling turn: converted whether or not the request has 'functions'
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object.", param=f"messages.{i}", code="invalid_type")
        role = m.get("role")
        if type(role) is not str or role not in ROLES:  # (a list or an object is not hashable)
            raise bad(
                f"messages[{i}].role must be one of {sorted(ROLES)}.",
                param=f"messages.{i}.role",
                code="invalid_value",
            )
        if role == "function" or (role == "assistant" and m.get("function_call") is not None):
            legacy = True
        content = m.get("content")
        msg = m  # as sent when its content is (nothing downstream writes to it): no copy per message
        if type(content) is not str:
            text = _content_text(content, i, parts if role != "tool" else None)
            if role != "assistant" and text is None:
                raise bad(
                    f"messages[{i}].content is required for role {role!r}.", param=f"messages.{i}.content"
                )
            if text is not content or "content" not in m:
                msg = dict(m)
                msg["content"] = text
        tcs = m.get("tool_calls")
        if tcs is not None:
            if not isinstance(tcs, list):
                raise bad(f"messages[{i}].tool_calls must be a list.", param=f"messages.{i}.tool_calls")
            for j, tc in enumerate(tcs):
                _tool_call(tc, f"messages[{i}].tool_calls[{j}]")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):  # as OpenAI: it names its call
            missing = m.get("tool_call_id") is None
            what = "Missing required parameter" if missing else "Invalid type (expected a string) for"
            code = "missing_required_parameter" if missing else "invalid_type"
            raise bad(f"{what}: 'messages[{i}].tool_call_id'.", param=f"messages.{i}.tool_call_id", code=code)
        out.append(msg)
    return _legacy_history(out) if legacy else out


def _tool_call(tc: Any, where: str) -> None:
    """An assistant's past call as OpenAI requires it: an ``id``, ``function.name`` and
    ``function.arguments`` (its JSON text; an object is taken too, as chat templates read it), ``type``
    ``function`` when given (else the template would fail on it, or render a call without its parts)."""
    if not isinstance(tc, dict):
        raise bad(f"Invalid type for '{where}': expected an object.", param=where, code="invalid_type")
    fn = tc.get("function")
    for key, value, kinds in (
        ("id", tc.get("id"), str),
        ("function", fn, dict),
        ("function.name", fn.get("name") if isinstance(fn, dict) else None, str),
        ("function.arguments", fn.get("arguments") if isinstance(fn, dict) else None, str | dict),
    ):
        if value is None:
            name = f"{where}.{key}"
            raise bad(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
        if not isinstance(value, kinds) or (key == "function.name" and not value):
            name = f"{where}.{key}"
            want = {"function": "an object", "function.arguments": "a string"}.get(key, "a non-empty string")
            msg = f"Invalid value for '{name}': expected {want}, got {_json_kind(value)}."
            raise bad(msg, param=name, code="invalid_type")
    assert isinstance(fn, dict)  # (checked above)
    check_tool_name(fn["name"], f"{where}.function.name", f"{where}.function.name")  # (the template's too)
    kind = tc.get("type")
    if kind is not None and kind != "function":
        name = f"{where}.type"
        raise bad(f"Invalid value for '{name}': expected 'function'.", param=name, code="invalid_value")


def _tools(d: dict[str, Any]) -> list[dict[str, Any]] | None:
    pending: list[PendingSchema] = []
    tools = _tools_deferred(d, SchemaBudget(), pending)
    check_schemas_now(pending)
    return tools


def _json_size(v: Any, key: str, most: int) -> int:
    """The bytes of ``v`` as compact JSON (C speed); a 400 naming ``key`` over ``most``."""
    try:
        n = len(orjson.dumps(v))
    except (TypeError, orjson.JSONEncodeError):  # e.g. nested deeper than 254 levels
        raise bad(f"'{key}' cannot be serialised as JSON.", param=key, code="invalid_value") from None
    if n > most:
        raise bad(f"'{key}' may hold at most {most // 1024} KiB of JSON.", param=key, code="invalid_value")
    return n


def _tools_deferred(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> list[dict[str, Any]] | None:
    """``tools`` checked but for the meta-validation of their parameters, which go to ``pending``."""
    tools = d.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list.", param="tools", code="invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' may hold at most {MAX_TOOLS} tools.", param="tools", code="invalid_value")
    if tools:
        _json_size(tools, "tools", MAX_TOOLS_BYTES)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.", param=f"tools.{i}"
            )
        check_tool_name(fn["name"], f"tools[{i}].function.name", f"tools.{i}")
        if t.get("type", "function") != "function":
            raise bad(f"tools[{i}].type must be 'function'.", param=f"tools.{i}.type")
        params = fn.get("parameters")
        if params is not None:
            pending.append(budget.take(params, i))
        if fn.get("strict") not in (None, True, False):
            raise bad(f"tools[{i}].function.strict must be a boolean.", param=f"tools.{i}.function.strict")
        if not isinstance(fn.get("description", ""), str | None):
            where = f"tools.{i}.function.description"
            raise bad(f"tools[{i}].function.description must be a string.", param=where)
    return tools or None


def _response_format(d: dict[str, Any]) -> dict[str, Any] | None:
    pending: list[PendingSchema] = []
    rf = _response_format_deferred(d, SchemaBudget(), pending)
    check_schemas_now(pending)
    return rf


def _response_format_deferred(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> dict[str, Any] | None:
    """``response_format`` checked but for the meta-validation of its schema, which goes to ``pending``."""
    rf = _dict(d, "response_format")
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise bad(
            "'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag'.",
            param="response_format",
        )
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise bad(
                "'response_format.json_schema' must be an object with a 'schema'.",
                param="response_format.json_schema",
            )
        pending.append(budget.take(spec["schema"], "response_format.json_schema.schema"))
        if spec.get("strict") not in (None, True, False):
            raise bad(
                "'response_format.json_schema.strict' must be a boolean.",
                param="response_format.json_schema.strict",
            )
    elif kind == "structural_tag":
        _json_size(rf, "response_format", SCHEMA_MAX_BYTES)
    return None if kind == "text" else rf


def _tool_choice(
    d: dict[str, Any], tools: list[dict[str, Any]] | None
) -> tuple[ToolChoice, list[dict[str, Any]] | None]:
    try:
        return parse_choice_and_tools(d.get("tool_choice"), tools)
    except ToolChoiceError as e:
        raise bad(str(e), param="tool_choice") from None


# the keys parse_chat reads besides the model, the messages and the sampling fields
CHAT_OPTION_KEYS: frozenset[str] = frozenset(
    {
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "chat_template_kwargs",
        "response_format",
        "continue_final_message",
        "tools",
        "tool_choice",
        "add_generation_prompt",
        "parallel_tool_calls",
        "separate_reasoning",
        "include_reasoning",
        "reasoning_effort",
        "metadata",
        "documents",
        "functions",
        "function_call",
        *GUIDED_KEYS,
    }
)
_CHAT_MAX_KEYS = ("max_tokens", "max_completion_tokens")


# vLLM's and SGLang's request fields that no engine field carries: a value asking for something is a 400
# naming the field (README "Request fields": never dropped); their neutral values (null, the default) pass
_NO_ENGINE_FIELD = "no engine field carries it"
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "allowed_token_ids": ((None, []), _NO_ENGINE_FIELD),
    "bad_words": ((None, []), _NO_ENGINE_FIELD),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated (a prompt over the context is a 400)"),
    "priority": ((None, 0), "no priority scheduling"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "lora_request": ((None,), "LoRA adapters are not supported"),
    "return_hidden_states": ((None, False), "hidden states are not returned"),
    "logits_processors": ((None, []), _NO_ENGINE_FIELD),
    "use_beam_search": ((None, False), "no beam search"),
    "length_penalty": ((None, 1), "no beam search"),
    "vllm_xargs": ((None, {}), _NO_ENGINE_FIELD),
    "cache_salt": ((None,), "no engine field carries a prefix-cache salt"),
    # vLLM's token ids beside the text (prompt_token_ids, token_ids): SGLang's /generate returns them
}
# and the chat-only ones (a template from the request: vLLM too refuses it unless told to trust it)
_UNSUPPORTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    **_UNSUPPORTED,
    "chat_template": ((None,), "the model's chat template is used (set it on the node: --chat-template)"),
    "echo": ((None, False), "chat answers do not echo the last message"),
    "add_special_tokens": ((None, False), "chat prompts are encoded as the template writes them"),
    # OpenAI's audio output: the answer would silently be text only
    "audio": ((None,), "the models served here answer text only (no audio output)"),
    "modalities": ((None, [], ["text"]), "the models served here answer text only (no audio output)"),
}
_UNSUPPORTED_KEYS = frozenset(_UNSUPPORTED)
_UNSUPPORTED_CHAT_KEYS = frozenset(_UNSUPPORTED_CHAT)


def _refuse_unsupported(d: dict[str, Any], table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    num = (int, float)
    for k, (neutral, why) in table.items():
        v = d.get(k)
        # the same value of the same JSON type (1 and 1.0 alike; true is not 1)
        if not any(v == x and (type(v) is type(x) or (type(v) in num and type(x) in num)) for x in neutral):
            raise bad(f"'{k}' is not supported: {why}.", param=k, code="unsupported_parameter")


def parse_chat(d: dict[str, Any]) -> ChatRequest:
    """The validated chat request, its JSON schemas meta-validated here, on the calling thread (within
    the bounds: up to ~1 s). Handlers use ``parse_chat_deferred`` and ``check_chat_schemas``."""
    req = parse_chat_deferred(d)
    if req.schemas:
        check_schemas_now(req.schemas)
        req.schemas = ()
    return req


def parse_chat_deferred(d: dict[str, Any]) -> ChatRequest:
    """``parse_chat`` with every check but the meta-validation of its JSON schemas (bounded: cheap):
    those wait in ``schemas`` for ``await check_chat_schemas(req)``, once the model is known and the
    request admitted."""
    model = _model(d)
    parts: dict[int, list[dict[str, str]]] = {}
    messages = _messages(d, parts)
    sampling = parse_sampling(d, max_tokens_keys=_CHAT_MAX_KEYS)
    _user(d)
    if not _UNSUPPORTED_CHAT_KEYS.isdisjoint(d):
        _refuse_unsupported(d, _UNSUPPORTED_CHAT)
    if CHAT_OPTION_KEYS.isdisjoint(d):  # none of the options (most requests): their defaults at once
        req = ChatRequest(model, messages, sampling, False, 0, None, NO_TOOL_CHOICE, {}, True, False, None, d)
    else:
        req = _parse_chat_options(d, model, messages, sampling)
    if parts:
        req.text_parts = parts
    return req


async def check_chat_schemas(req: ChatRequest) -> None:
    """Meta-validate the schemas ``parse_chat_deferred`` left in ``req.schemas`` off the event loop (see
    ``structured.check_schemas``): a 400 naming the first invalid one, or past the deadline."""
    if req.schemas:
        await check_schemas(req.schemas)
        req.schemas = ()


def _parse_chat_options(
    d: dict[str, Any], model: str, messages: list[dict[str, Any]], sampling: Sampling
) -> ChatRequest:
    logprobs = _bool(d, "logprobs", False)
    top_logprobs = _int(d, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise bad("'top_logprobs' requires 'logprobs': true.", param="top_logprobs")
    prompt_logprobs = _prompt_logprobs(d, sampling)
    kwargs = _dict(d, "chat_template_kwargs") or {}
    docs = d.get("documents")  # vLLM's: the template's ``documents`` (RAG templates such as Command R's)
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(x, dict) for x in docs):
            raise bad("'documents' must be a list of objects.", param="documents", code="invalid_type")
        if "documents" not in kwargs:  # (chat_template_kwargs win, as vLLM merges them)
            kwargs = {**kwargs, "documents": docs}
    if kwargs:
        _json_size(kwargs, "chat_template_kwargs", MAX_TEMPLATE_KWARGS_BYTES)
    legacy = d.get("functions") is not None or d.get("function_call") is not None  # (null: absent)
    if legacy:  # (the history's legacy turns were converted by _messages)
        d = _legacy_functions(d)
    budget = SchemaBudget()
    pending: list[PendingSchema] = []
    rf = _response_format_deferred(d, budget, pending)
    guided = parse_guided(d, budget, pending)
    cont = _bool(d, "continue_final_message", False)
    tools = _tools_deferred(d, budget, pending)
    choice, tools = _tool_choice(d, tools)
    parse_metadata(d.get("metadata"))  # (checked as OpenAI does; not used)
    effort = d.get("reasoning_effort")
    if effort is not None and (type(effort) is not str or effort not in REASONING_EFFORTS):
        msg = f"'reasoning_effort' must be one of {sorted(REASONING_EFFORTS)}."
        raise bad(msg, param="reasoning_effort", code="invalid_value")
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        tool_choice=choice,
        template_kwargs=kwargs,
        add_generation_prompt=_bool(d, "add_generation_prompt", not cont),
        continue_final_message=cont,
        response_format=rf,
        raw=d,
        parallel_tool_calls=_bool(d, "parallel_tool_calls", True),
        separate_reasoning=_bool(d, "separate_reasoning", True),
        include_reasoning=_bool(d, "include_reasoning", True),
        schemas=tuple(pending),
        guided=None if guided is None else guided[0],
        guided_param="" if guided is None else guided[1],
        reasoning_effort=effort,
        legacy_functions=legacy,
        prompt_logprobs=prompt_logprobs,
    )


def _legacy_functions(d: dict[str, Any]) -> dict[str, Any]:
    """A request using the legacy ``functions`` / ``function_call`` fields, as ``tools`` /
    ``tool_choice`` (one call at most, as the legacy API answers one ``function_call``)."""
    if d.get("tools") is not None or d.get("tool_choice") is not None:
        msg = "'functions' / 'function_call' cannot be combined with 'tools' / 'tool_choice'."
        raise bad(msg, param="functions")
    fns = d.get("functions")
    if fns is not None and not isinstance(fns, list):
        raise bad("'functions' must be a list.", param="functions", code="invalid_type")
    out = dict(d)
    out.pop("functions", None)
    call = out.pop("function_call", None)
    if fns:
        out["tools"] = [{"type": "function", "function": f} for f in fns]
    if call is not None:
        if isinstance(call, dict):
            if not isinstance(call.get("name"), str):
                raise bad("'function_call' must be 'none', 'auto' or {'name': ...}.", param="function_call")
            out["tool_choice"] = {"type": "function", "function": {"name": call["name"]}}
        elif call in ("none", "auto"):
            out["tool_choice"] = call
        else:
            raise bad("'function_call' must be 'none', 'auto' or {'name': ...}.", param="function_call")
    out["parallel_tool_calls"] = False
    return out


def _legacy_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A legacy conversation's turns as templates read them: an assistant ``function_call`` as a
    ``tool_calls`` entry, a ``function`` message as the ``tool`` answer to the call before it."""
    out: list[dict[str, Any]] = []
    last_id = ""
    for i, m in enumerate(messages):
        call = m.get("function_call")
        if m.get("role") == "assistant" and isinstance(call, dict):
            last_id = f"call_{i}"
            args = call.get("arguments")
            fn = {"name": call.get("name"), "arguments": args if isinstance(args, str) else "{}"}
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [
                *(m.get("tool_calls") or []),
                {"id": last_id, "type": "function", "function": fn},
            ]
        elif m.get("role") == "function":
            m = {**m, "role": "tool", "tool_call_id": m.get("tool_call_id") or last_id}
        out.append(m)
    return out


# ---- completions --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    sampling: Sampling
    logprobs: int | None
    echo: bool
    raw: dict[str, Any]
    constraint: Constraint | None = None  # response_format or a vLLM / SGLang guided field (guided.py)
    add_special_tokens: bool = True  # vLLM's: false encodes a text prompt without BOS (and the like)
    echo_only: bool = False  # echo with max_tokens 0: every choice is its prompt, nothing generated
    prompt_logprobs: int | None = None  # vLLM's: each choice's ``prompt_logprobs`` (this many alternatives)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The alternatives per prompt position to ask the engine for (None: the prompt's logprobs are not
        needed): vLLM's ``prompt_logprobs``, else with ``echo`` the ``logprobs`` number (the echoed
        prompt's logprobs, as vLLM's ``to_sampling_params``); both: the larger, each answer its own."""
        echo = self.logprobs if self.echo else None
        if self.prompt_logprobs is None:
            return echo
        return self.prompt_logprobs if echo is None else max(echo, self.prompt_logprobs)


def _prompts(d: dict[str, Any]) -> list[str | list[int]]:
    p = d.get("prompt")
    if isinstance(p, str):
        if not p:  # (vLLM's CompletionRequest validator: whatever the tokenizer would make of it, a BOS)
            raise bad("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
            return [list(p)]
        if all(
            isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            for x in p
        ):
            return [list(x) for x in p]
    raise bad(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists.",
        param="prompt",
        code="invalid_type",
    )


def parse_completion(d: dict[str, Any]) -> CompletionRequest:
    model = _model(d)
    _user(d)
    prompts = _prompts(d)
    echo = _bool(d, "echo", False)
    # vLLM's echo_without_generation (CompletionRequest.to_sampling_params): echo with max_tokens 0 answers
    # the prompt alone; without echo, 0 stays a 400 (vLLM: SamplingParams' "max_tokens must be at least 1")
    max_tokens = d.get("max_tokens")
    echo_only = echo and max_tokens == 0 and type(max_tokens) in (int, float)
    if echo_only:
        sampling = _replace_max(parse_sampling({**d, "max_tokens": None}, max_tokens_keys=("max_tokens",)), 0)
    else:
        sampling = parse_sampling(d, max_tokens_keys=("max_tokens",))
    if not _UNSUPPORTED_KEYS.isdisjoint(d):
        _refuse_unsupported(d, _UNSUPPORTED)
    if d.get("max_tokens") is None:
        sampling = _replace_max(sampling, 16)  # the completions API default
    if d.get("suffix"):
        raise bad("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    best_of = _int(d, "best_of", None, 1)
    if best_of is not None and best_of != sampling.n:
        raise bad(
            "'best_of' different from 'n' is not supported.", param="best_of", code="unsupported_parameter"
        )
    if len(prompts) * sampling.n > MAX_N:
        raise bad(f"prompts x n may not exceed {MAX_N}.", param="n")
    constraint: Constraint | None = None
    if "response_format" in d or not _NO_GUIDED.isdisjoint(d):
        budget = SchemaBudget()
        pending: list[PendingSchema] = []
        rf = _response_format_deferred(d, budget, pending)
        guided = parse_guided(d, budget, pending)
        check_schemas_now(pending)
        constraint = guided[0] if guided is not None else response_format_constraint(rf)
    # with echo, the logprobs cover the prompt too (the engine's prompt logprobs, as vLLM answers: how
    # evaluations score a text)
    logprobs = _int(d, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        logprobs=logprobs,
        echo=echo,
        raw=d,
        constraint=constraint,
        add_special_tokens=_bool(d, "add_special_tokens", True),
        echo_only=echo_only,
        prompt_logprobs=_prompt_logprobs(d, sampling),
    )


def _prompt_logprobs(d: dict[str, Any], sampling: Sampling) -> int | None:
    """vLLM's ``prompt_logprobs``: the alternatives per prompt position, at most ``MAX_TOP_LOGPROBS`` (as
    ``logprobs``: vLLM's ``max_logprobs`` default; its -1, the whole vocabulary, is over it); not with
    ``stream`` unless 0 (vLLM's check_logprobs: streamed chunks carry no prompt logprobs)."""
    k = _int(d, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if k is None or (sampling.stream and k == 0):
        return None
    if sampling.stream:
        raise bad(
            "'prompt_logprobs' is not available when 'stream' is true.",
            param="prompt_logprobs",
            code="invalid_value",
        )
    return k


_NO_GUIDED = frozenset(GUIDED_KEYS)


def _replace_max(s: Sampling, max_tokens: int) -> Sampling:
    return replace(s, max_tokens=max_tokens)
