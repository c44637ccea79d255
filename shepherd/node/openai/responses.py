"""Responses API requests (``POST /v1/responses``): parsing and validation into ``ResponsesRequest``.

Field names and defaults are OpenAI's (openai-python ``types/responses/response_create_params.py``):
``store`` defaults to true, ``parallel_tool_calls`` to true, ``truncation`` to ``disabled``. Function
tools arrive flat (``{"type": "function", "name", "description", "parameters", "strict"}``) and are
turned into chat tools for the template and the tool-call parsers; ``text.format`` (``text`` /
``json_object`` / ``json_schema {name, schema, strict}``) becomes a chat ``response_format``.

The ``input`` is kept raw: its items are parsed by ``items.parse_items`` once the handler knows which
ids to mint (the owner of a conversation keeps the response's items).

Refused as OpenAI refuses them: ``previous_response_id`` with ``conversation``, ``background`` without
``store``; metadata beyond 16 pairs, keys over 64 or values over 512 characters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shepherd.node.openai.requests import (
    Sampling,
    parse_metadata,
    parse_sampling,
    shown,
    shown_id,
)
from shepherd.node.openai.structured import PendingSchema, SchemaBudget
from shepherd.node.openai.tool_choice import (
    ToolChoice,
    ToolChoiceError,
    allowed_tools,
    check_tool_name,
    parse_tool_choice,
)
from shepherd.proto.openai_errors import ApiError, bad

__all__ = [
    "ResponsesRequest",
    "conversation_not_found",
    "parse_responses",
    "previous_not_found",
    "response_not_found",
]

MAX_TOP_LOGPROBS = 20
MAX_INSTRUCTIONS_CHARS = 4 << 20
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
SUMMARIES = frozenset({"auto", "concise", "detailed"})
INCLUDABLE = frozenset(
    {
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
        "message.input_image.image_url",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
    }
)


@dataclass(slots=True)
class ResponsesRequest:
    """A validated ``POST /v1/responses`` body (read-only by convention)."""

    model: str
    input: Any  # a string or a list of items, validated by items.parse_items
    instructions: str | None
    sampling: Sampling
    tools: list[dict[str, Any]] | None  # chat tools ({"type": "function", "function": {...}})
    tools_echo: list[dict[str, Any]]  # the tools as the response object shows them
    tool_choice: ToolChoice
    tool_choice_echo: Any  # "auto" / "none" / "required" / {"type": "function", "name": ...} / allowed_tools
    parallel_tool_calls: bool
    reasoning: dict[str, Any] | None  # {"effort", "summary"}
    store: bool
    previous_response_id: str | None
    conversation_id: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    text: dict[str, Any]  # {"format": {...}} as the response object shows it
    response_format: dict[str, Any] | None  # the chat-style response_format (None: plain text)
    metadata: dict[str, str]
    stream: bool
    background: bool
    truncation: str
    user: str | None
    safety_identifier: str | None
    include: list[str]
    top_logprobs: int | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    # the request's JSON schemas, bounded, for ``structured.check_schemas`` after the model lookup and
    # admission (meta-validation is off the event loop, with a deadline)
    schemas: tuple[PendingSchema, ...] = ()


def _str(d: dict[str, Any], key: str, limit: int = 512) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(f"Invalid type for '{key}': expected a string.", param=key, code="invalid_type")
    if len(v) > limit:
        raise bad(
            f"Invalid '{key}': string too long ({len(v)} characters, at most {limit}).",
            param=key,
            code="string_above_max_length",
        )
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"Invalid type for '{key}': expected a boolean.", param=key, code="invalid_type")
    return v


def _tools(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    raw = d.get("tools")
    if raw is None:
        return None, []
    if not isinstance(raw, list):
        raise bad("Invalid type for 'tools': expected an array.", param="tools", code="invalid_type")
    chat: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    for i, t in enumerate(raw):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"Invalid type for '{w}': expected an object.", param=w, code="invalid_type")
        if t.get("type") != "function":
            raise bad(
                f"Invalid '{w}.type': {t.get('type')!r}. Only function tools are supported by this gateway.",
                param=f"{w}.type",
                code="unsupported_value",
            )
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"'{w}.name' is required and must be a non-empty string.", param=f"{w}.name")
        check_tool_name(name, f"{w}.name", f"{w}.name")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"Invalid type for '{w}.description': expected a string.", param=f"{w}.description")
        params = t.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"Invalid type for '{w}.parameters': expected an object.", param=f"{w}.parameters")
            pending.append(budget.take(params, f"{w}.parameters"))
        strict = t.get("strict", True)
        if strict is None:
            strict = True
        if not isinstance(strict, bool):
            raise bad(f"Invalid type for '{w}.strict': expected a boolean.", param=f"{w}.strict")
        fn: dict[str, Any] = {"name": name}
        if desc is not None:
            fn["description"] = desc
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        fn["strict"] = strict
        chat.append({"type": "function", "function": fn})
        echo.append(
            {"type": "function", "name": name, "description": desc, "parameters": params, "strict": strict}
        )
    return chat or None, echo


def _tool_choice(
    d: dict[str, Any], tools: list[dict[str, Any]] | None
) -> tuple[ToolChoice, Any, list[dict[str, Any]] | None]:
    """The request's choice, its echo in the response object, and the tools the request goes on with
    (an ``allowed_tools`` choice keeps only those it lists: ``tool_choice.allowed_tools``)."""
    v = d.get("tool_choice")
    try:
        if isinstance(v, dict) and v.get("type") == "allowed_tools":
            choice, kept = allowed_tools(v.get("mode"), v.get("tools"), tools, "tool_choice", nested=False)
            return choice, {"type": "allowed_tools", "mode": v["mode"], "tools": v["tools"]}, kept
        chat_value: Any = v
        if isinstance(v, dict):
            if v.get("type") != "function" or not isinstance(v.get("name"), str):
                raise bad(
                    "Invalid 'tool_choice': expected 'none', 'auto', 'required', {'type': 'function', "
                    "'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}.",
                    param="tool_choice",
                )
            chat_value = {"type": "function", "function": {"name": v["name"]}}
        choice = parse_tool_choice(chat_value, tools)
    except ToolChoiceError as e:
        text = str(e).replace("'tool_choice' as an object must be", "'tool_choice' must be")
        raise bad(text, param="tool_choice") from None
    echo: Any = v if v is not None else "auto"
    if isinstance(v, dict):
        echo = {"type": "function", "name": v["name"]}
    return choice, echo, tools


def _text_format(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    text = d.get("text")
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise bad("Invalid type for 'text': expected an object.", param="text", code="invalid_type")
    fmt = text.get("format")
    echo: dict[str, Any] = {k: v for k, v in text.items() if k == "verbosity"}
    if fmt is None:
        echo["format"] = {"type": "text"}
        return echo, None
    if not isinstance(fmt, dict):
        raise bad("Invalid type for 'text.format': expected an object.", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        echo["format"] = {"type": "text"}
        return echo, None
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return echo, {"type": "json_object"}
    if kind == "json_schema":
        name = fmt.get("name")
        schema = fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise bad("Missing required parameter: 'text.format.name'.", param="text.format.name")
        if not isinstance(schema, dict):
            raise bad("Missing required parameter: 'text.format.schema'.", param="text.format.schema")
        pending.append(budget.take(schema, "text.format.schema"))
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(
                "Invalid type for 'text.format.strict': expected a boolean.", param="text.format.strict"
            )
        desc = fmt.get("description")
        out: dict[str, Any] = {"type": "json_schema", "name": name, "schema": schema, "strict": strict}
        if isinstance(desc, str):
            out["description"] = desc
        echo["format"] = out
        spec = {"name": name, "schema": schema, "strict": strict is True}
        return echo, {"type": "json_schema", "json_schema": spec}
    raise bad(
        f"Invalid 'text.format.type': {kind!r}. Expected 'text', 'json_object' or 'json_schema'.",
        param="text.format.type",
    )


def _reasoning(d: dict[str, Any]) -> dict[str, Any] | None:
    r = d.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise bad("Invalid type for 'reasoning': expected an object.", param="reasoning", code="invalid_type")
    effort = r.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise bad(f"Invalid 'reasoning.effort': {effort!r}.", param="reasoning.effort")
    summary = r.get("summary", r.get("generate_summary"))
    if summary is not None and (not isinstance(summary, str) or summary not in SUMMARIES):
        raise bad(f"Invalid 'reasoning.summary': {summary!r}.", param="reasoning.summary")
    return {"effort": effort, "summary": summary}


def _conversation(d: dict[str, Any]) -> str | None:
    c = d.get("conversation")
    if c is None:
        return None
    if isinstance(c, dict):
        c = c.get("id")
    if not isinstance(c, str) or not c or len(c) > 128:
        raise bad(
            "Invalid 'conversation': expected a conversation id or {'id': ...}.",
            param="conversation",
            code="invalid_type",
        )
    return c


def _num(d: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"Invalid type for '{key}': expected a number.", param=key, code="invalid_type")
    if not lo <= v <= hi:
        raise bad(f"Invalid '{key}': {shown(v)} is not in [{lo}, {hi}].", param=key, code="invalid_value")
    return float(v)


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"Invalid type for '{key}': expected an integer.", param=key, code="invalid_type")
    if not lo <= v <= hi:
        raise bad(f"Invalid '{key}': {shown(v)} is not in [{lo}, {hi}].", param=key, code="invalid_value")
    return v


_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # accepted (one tier here), checked
_VERBOSITY = ("low", "medium", "high")  # a hint the models here do not read: accepted, checked, echoed


def _one_of(value: Any, key: str, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        msg = f"Invalid '{key}': {str(value)[:40]!r}. Expected one of {list(allowed)}."
        raise bad(msg, param=key, code="invalid_value")


def parse_responses(d: dict[str, Any]) -> ResponsesRequest:
    """A ``POST /v1/responses`` body -> ``ResponsesRequest`` (``ApiError`` 400 on anything malformed)."""
    model = d.get("model")
    if not isinstance(model, str) or not model:
        raise bad("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    inp = d.get("input")
    if inp is None:
        inp = []
    if not isinstance(inp, str | list):
        raise bad(
            "Invalid type for 'input': expected a string or an array.", param="input", code="invalid_type"
        )
    instructions = _str(d, "instructions", MAX_INSTRUCTIONS_CHARS)
    previous = _str(d, "previous_response_id", 128)
    conversation = _conversation(d)
    if previous is not None and conversation is not None:
        raise bad(
            "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' "
            "or 'conversation'.",
            param="conversation",
            code="mutually_exclusive_parameters",
        )
    if not inp and previous is None and conversation is None:
        raise bad("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    store = _bool(d, "store", True)
    background = _bool(d, "background", False)
    if background and not store:
        raise bad("Background mode requires 'store' to be true.", param="background")
    stream = _bool(d, "stream", False)
    max_output = _int(d, "max_output_tokens", 1, (1 << 31) - 1)
    temperature = _num(d, "temperature", 0.0, 2.0)
    top_p = _num(d, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad("Invalid 'top_p': must be greater than 0.", param="top_p", code="invalid_value")
    budget = SchemaBudget()
    schemas: list[PendingSchema] = []
    tools, tools_echo = _tools(d, budget, schemas)
    tool_choice, tool_choice_echo, tools = _tool_choice(d, tools)
    text, response_format = _text_format(d, budget, schemas)
    reasoning = _reasoning(d)
    truncation = d.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise bad("Invalid 'truncation': expected 'auto' or 'disabled'.", param="truncation")
    include = d.get("include") or []
    if not isinstance(include, list) or any(not isinstance(x, str) or x not in INCLUDABLE for x in include):
        raise bad(f"Invalid 'include': expected values among {sorted(INCLUDABLE)}.", param="include")
    top_logprobs = _int(d, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if d.get("prompt") is not None:  # (a stored prompt template of OpenAI's dashboard: none here)
        raise bad(
            "'prompt' (a stored prompt template) is not supported: send its text as 'instructions'.",
            param="prompt",
            code="unsupported_parameter",
        )
    _one_of(d.get("service_tier"), "service_tier", _SERVICE_TIERS)
    _one_of((d.get("text") or {}).get("verbosity"), "text.verbosity", _VERBOSITY)  # (text: checked above)
    sd: dict[str, Any] = {"stream": stream}
    if temperature is not None:
        sd["temperature"] = temperature
    if top_p is not None:
        sd["top_p"] = top_p
    if max_output is not None:
        sd["max_tokens"] = max_output
    for k in ("top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed"):
        if d.get(k) is not None:
            sd[k] = d[k]
    sampling = parse_sampling(sd, max_tokens_keys=("max_tokens",))
    kwargs: dict[str, Any] = {}
    if reasoning is not None and reasoning.get("effort") == "none":
        kwargs["enable_thinking"] = False  # the templates of hybrid thinking models read this switch
    return ResponsesRequest(
        model=model,
        input=inp,
        instructions=instructions,
        sampling=sampling,
        tools=tools,
        tools_echo=tools_echo,
        tool_choice=tool_choice,
        tool_choice_echo=tool_choice_echo,
        parallel_tool_calls=_bool(d, "parallel_tool_calls", True),
        reasoning=reasoning,
        store=store,
        previous_response_id=previous,
        conversation_id=conversation,
        max_output_tokens=max_output,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        text=text,
        response_format=response_format,
        metadata=parse_metadata(d.get("metadata")),
        stream=stream,
        background=background,
        truncation=truncation,
        user=_str(d, "user"),
        safety_identifier=_str(d, "safety_identifier"),
        include=list(include),
        top_logprobs=top_logprobs,
        template_kwargs=kwargs,
        raw=d,
        schemas=tuple(schemas),
    )


# ---- the not-founds, worded as OpenAI words them ---------------------------------------------------------


def _not_found(message: str, param: str, code: str) -> ApiError:
    return ApiError(404, message, type="invalid_request_error", param=param, code=code)


def response_not_found(response_id: str) -> ApiError:
    return _not_found(
        f"Response with id '{shown_id(response_id)}' not found.", "response_id", "response_not_found"
    )


def previous_not_found(response_id: str) -> ApiError:
    """A 400, not a 404: the request names it as an input (OpenAI's status and words, as SMG answers)."""
    return ApiError(
        400,
        f"Previous response with id '{shown_id(response_id)}' not found.",
        type="invalid_request_error",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def conversation_not_found(conversation_id: str) -> ApiError:
    return _not_found(
        f"Conversation with id '{shown_id(conversation_id)}' not found.",
        "conversation",
        "conversation_not_found",
    )
