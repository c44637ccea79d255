"""Anthropic Messages API requests -> the chat request (messages, tools, tool choice, sampling) the chat
template and the shared output pipeline want.

``parse_messages`` (``POST /v1/messages``) and ``parse_count_tokens`` (``POST /v1/messages/count_tokens``)
check with bounded work only; the tools' ``input_schema`` go through the request's ``SchemaBudget`` and
wait in ``chat.schemas`` for ``check_schemas`` (off the loop, after the model lookup and admission).

- ``system``: a string or a list of ``text`` blocks -> one ``system`` message (blocks joined by "\\n").
  Claude Code's attribution block (``x-anthropic-billing-header: ...; cch=...;``, a hash that changes with
  every request) is dropped, as vLLM drops it: it carries nothing for the model and, first in the prompt,
  it made every request's prefix new (no prefix-cache hit, no cache-aware routing).
- ``messages`` of role ``system`` (mid-conversation system messages: the SDK's ``SystemMessageParam``,
  sent by Claude Code since 2.1.154; content a string or ``text`` blocks) -> a ``system`` message at
  their place, so the prefix before them stays as cached (a leading one joins the top-level ``system``);
  the beta's ``clear_at: next_user_message`` drops one once a user message follows it. They are no turn
  of the transcript's checks (a ``tool_result`` still answers the assistant turn before).
- ``messages``: ``user`` / ``assistant`` turns, content a string or blocks. ``text`` blocks -> the
  message's text; an assistant's ``tool_use`` -> a ``tool_calls`` entry (``arguments``: its ``input`` as
  JSON) and its ``thinking`` -> ``reasoning_content`` (``redacted_thinking`` dropped: it is opaque); a
  user's ``tool_result`` -> a ``tool`` message (``content`` a string or text blocks, ``is_error``
  prefixes "Error: "), in block order, and it must answer a ``tool_use`` of an earlier assistant turn
  (400 otherwise); ``image`` / ``document`` -> 400 (text models). A last ``assistant`` turn is a prefill:
  the answer continues it (``continue_final_message``); an empty one (``""`` or ``[]``) is no prefill (the
  answer starts a fresh turn, thinking included). Any other message with empty content is a 400, as
  Anthropic answers (it used to vanish, or fail in the template).
- ``tools``: ``{name, description, input_schema}`` (``type`` absent or ``custom``; server tools 400) ->
  OpenAI function tools; ``tool_choice``: ``auto``, ``any`` (-> ``required``), ``tool`` (-> the named
  function), ``none`` (the tools stay in the prompt, as Anthropic keeps its tool-use system prompt; no
  call is parsed); ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``thinking``: ``{type: enabled, budget_tokens}`` (>= 1024 and < ``max_tokens``, but under the
  ``interleaved-thinking-*`` beta of the ``anthropic-beta`` header: the budget spans all the turn's
  thinking blocks and may exceed ``max_tokens``, as Anthropic allows; accepted, not enforced
  on its own: ``max_tokens`` bounds the whole answer) turns the template's ``enable_thinking`` on and the
  reasoning parser with it; absent or ``{type: disabled}``: both off (Anthropic's default). ``display``:
  ``summarized`` (the default here) or ``omitted``: the answer's thinking blocks then have an empty
  ``thinking`` (no ``thinking_delta``) and still their ``signature``.
- ``output_config.format`` (or the beta's ``output_format``): ``{type: json_schema, schema}`` -> the
  answer constrained to the schema (as a chat ``response_format``); ``output_config.effort`` is
  checked and accepted as ``budget_tokens`` is (a hint: ``max_tokens`` bounds the answer); a tool's
  ``strict: true`` constrains its input to its schema.
- ``thinking: {type: adaptive}`` and ``{type: between_tools}`` turn thinking on without a budget.
- ``output_config.effort``: one of the SDK's ``low``, ``medium``, ``high``, ``xhigh``, ``max``.
- ``max_tokens`` is required (create); ``temperature`` in [0, 1], ``top_p``, ``top_k``;
  ``stop_sequences`` (at most ``MAX_STOP`` of at most ``MAX_STOP_CHARS`` characters);
  ``metadata.user_id`` (a string of at most 256 characters, or null).
- ``thread`` (the message-threads beta the SDK's tool runner sends: the server keeps the conversation):
  400 with ``error.details.error_code`` ``thread_unsupported_request``, on which the SDK goes on without a
  thread, sending the whole conversation (it was ignored, and the runner's second turn, the tool results
  alone continuing the first reply's id, was a 400 the SDK cannot recover from).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import orjson

from shepherd.node.openai.requests import (
    INT32_MAX,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
    ChatRequest,
    parse_sampling,
)
from shepherd.node.openai.structured import PendingSchema, SchemaBudget
from shepherd.node.openai.tool_choice import ToolChoiceError, parse_tool_choice
from shepherd.proto.openai_errors import bad

__all__ = [
    "MIN_THINKING_BUDGET",
    "MessagesRequest",
    "parse_count_tokens",
    "parse_messages",
    "tool_use_id",
]

MIN_THINKING_BUDGET = 1024
INTERLEAVED_THINKING = "interleaved-thinking-"  # (the beta's name, before its date)
FINE_GRAINED_TOOLS = "fine-grained-tool-streaming-"
MAX_USER_ID_CHARS = 256
_SERVER_BLOCKS = ("image", "document", "search_result", "container_upload")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's pattern for a custom tool's name


@dataclass(slots=True)
class MessagesRequest:
    """A validated Messages request: the chat request it is (``chat.schemas``: the tools' input schemas
    still to meta-validate) and what only the Messages API has."""

    chat: ChatRequest
    thinking: bool
    thinking_budget: int | None
    stop_sequences: tuple[str, ...]
    user_id: str | None
    stream: bool
    omit_thinking: bool = False  # thinking.display 'omitted': thinking blocks without their text
    # ``max_tokens: 0``: "populate the prompt cache without generating a response" (the SDK's docs): the
    # prompt's prefill alone, an empty Message with ``stop_reason`` max_tokens
    cache_only: bool = False
    # tool inputs streamed as they are generated, not held to each call's end: the fine-grained tool
    # streaming beta or a tool's ``eager_input_streaming`` (Anthropic's opt-in: the input may then end
    # invalid, a call the model left malformed staying a ``tool_use`` block)
    eager_tools: bool = False


# Kimi K2's call ids (``functions.NAME:N``: its parser reads the name from them, and its template renders
# them back) as Anthropic's pattern for ids (``^[a-zA-Z0-9_-]+$``) allows: ``toolu_functions-NAME-N``, and
# back to Kimi's form when a later request's history carries them (a tool name has no "." or ":")
_KIMI_ID = re.compile(r"functions\.([a-zA-Z0-9_-]{1,128}):([0-9]{1,9})")
_KIMI_TOOLU = re.compile(r"toolu_functions-([a-zA-Z0-9_-]{1,128})-([0-9]{1,9})")


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic shapes it (``toolu_...``): the parsers' ``call_...`` ids renamed,
    the same in a streamed and a whole answer; an id already ``toolu_`` kept; Kimi K2's ids in a form
    ``chat_call_id`` turns back."""
    if call_id.startswith("toolu_"):
        return call_id
    m = _KIMI_ID.fullmatch(call_id)
    if m is not None:
        return f"toolu_functions-{m[1]}-{m[2]}"
    return "toolu_" + call_id.removeprefix("call_")


def chat_call_id(tool_use: str) -> str:
    """A ``tool_use`` id of the history as the chat template gets it: Kimi K2's form of ``tool_use_id``
    turned back (``functions.NAME:N``, as the model wrote it); any other id as it is."""
    m = _KIMI_TOOLU.fullmatch(tool_use)
    return tool_use if m is None else f"functions.{m[1]}:{m[2]}"


def _model(d: dict[str, Any]) -> str:
    m = d.get("model")
    if not isinstance(m, str) or not m:
        raise bad("model: Field required (a non-empty string).", param="model")
    return m


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of ``text`` blocks (joined by "\\n")."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where}: expected a string or a list of text blocks.", param=where)
    texts: list[str] = []
    for i, b in enumerate(value):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in _SERVER_BLOCKS:
            raise _unsupported_block(kind, f"{where}.{i}")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}.{i}: expected a text block {{'type': 'text', 'text': ...}}.", param=where)
        texts.append(b["text"])
    return "\n".join(texts)


def _unsupported_block(kind: Any, where: str) -> Exception:
    return bad(
        f"{where}: '{kind}' content blocks are not supported: this model reads text only.",
        param=where,
        code="unsupported_content",
    )


def _user_blocks(
    content: list[Any], where: str, calls: set[str], out: list[dict[str, Any]], answered: set[str]
) -> None:
    """A user turn's blocks -> ``user`` and ``tool`` messages, in order."""
    texts: list[str] = []

    def flush() -> None:
        if texts:
            _add_turn(out, {"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, b in enumerate(content):
        w = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(b, dict):
            raise bad(f"{w}: a content block must be an object with a 'type'.", param=w)
        if kind == "text":
            texts.append(_text_of(b, w))
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise bad(f"{w}.tool_use_id: Field required (a string).", param=w)
            cid = chat_call_id(tid)  # (the ids of the calls are the chat's)
            if cid not in calls:
                raise bad(
                    f"{w}: unexpected `tool_use_id` found in `tool_result` blocks: {tid[:100]}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
                    param=w,
                )
            if cid in answered:
                raise bad(f"{w}: the tool_use {tid[:100]} is answered twice.", param=w)
            answered.add(cid)
            c = b.get("content")
            text = "" if c is None else _text_blocks(c, f"{w}.content")
            is_error = b.get("is_error")
            if is_error not in (None, True, False):
                raise bad(f"{w}.is_error: expected a boolean.", param=w)
            flush()
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": cid,
                    "content": f"Error: {text}" if is_error else text,
                }
            )
        elif kind in _SERVER_BLOCKS:
            raise _unsupported_block(kind, w)
        elif kind == "tool_use":
            raise bad(f"{w}: 'tool_use' blocks belong to assistant messages.", param=w)
        else:
            raise bad(
                f"{w}: content block type {str(kind)[:50]!r} is not supported in a user message.", param=w
            )
    flush()


def _text_of(block: dict[str, Any], where: str, final: bool = False) -> str:
    """A text block's text: Anthropic refuses empty and white-space-only text blocks, but in the final
    assistant message (a prefill), where only trailing white space is refused."""
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text: Field required (a string).", param=where)
    _check_text(text, where, final)
    return text


def _check_text(text: str, where: str, final: bool) -> None:
    if final:
        if text != text.rstrip():
            raise bad("messages: final assistant content cannot end with trailing whitespace", param=where)
    elif not text:
        raise bad("messages: text content blocks must be non-empty", param=where)
    elif text.isspace():
        raise bad("messages: text content blocks must contain non-whitespace text", param=where)


def _assistant_blocks(content: list[Any], where: str, calls: set[str], final: bool) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        w = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(b, dict):
            raise bad(f"{w}: a content block must be an object with a 'type'.", param=w)
        if kind == "text":  # (a prefill's trailing white space: its last block's)
            texts.append(_text_of(b, w, final and j == len(content) - 1))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{w}.thinking: Field required (a string).", param=w)
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            tid, name, args = b.get("id"), b.get("name"), b.get("input")
            if not isinstance(tid, str) or not tid:
                raise bad(f"{w}.id: Field required (a string).", param=w)
            if not isinstance(name, str) or _TOOL_NAME.fullmatch(name) is None:
                raise bad(f"{w}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'", param=w)
            if not isinstance(args, dict):
                raise bad(f"{w}.input: expected an object.", param=w)
            cid = chat_call_id(tid)
            if cid in calls:
                raise bad(f"{w}: the tool_use id {tid[:100]} is used twice.", param=w)
            calls.add(cid)
            tool_calls.append(
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(args).decode()},
                }
            )
        elif kind in _SERVER_BLOCKS:
            raise _unsupported_block(kind, w)
        else:
            raise bad(
                f"{w}: content block type {str(kind)[:50]!r} is not supported in an assistant message.",
                param=w,
            )
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not tool_calls else None,
    }
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


_MORE = "_more"  # (a turn's later messages of its role, until ``_join_turns``)


def _add_turn(out: list[dict[str, Any]], msg: dict[str, Any]) -> None:
    """Append a user or assistant message; one of the same role right before it is the same turn
    (Anthropic: "consecutive user or assistant turns in your request will be combined into a single
    turn"): kept aside on that turn and merged by ``_join_turns`` once all are in (merging each as it
    came copied the turn's text so far every time: quadratic, a 10 MB request of short user messages
    held the event loop for minutes)."""
    prev = out[-1] if out else None
    if prev is None or prev["role"] != msg["role"]:
        out.append(msg)
    else:
        prev.setdefault(_MORE, []).append(msg)


def _join_turns(out: list[dict[str, Any]]) -> None:
    """Each turn's messages as one (``_add_turn``'s): its text joined as the turn's own blocks are (user
    and system "\\n", assistant ""), its reasoning and tool calls in order."""
    for m in out:
        more = m.pop(_MORE, None)
        if more is None:
            continue
        parts = [m, *more]
        if m["role"] != "assistant":
            m["content"] = "\n".join(p["content"] for p in parts)
            continue
        texts = [p.get("content") for p in parts]
        m["content"] = None if all(t is None for t in texts) else "".join(t or "" for t in texts)
        reasoning = [p["reasoning_content"] for p in parts if "reasoning_content" in p]
        if reasoning:
            m["reasoning_content"] = "\n".join(reasoning)
        calls = [c for p in parts for c in p.get("tool_calls") or ()]
        if calls:
            m["tool_calls"] = calls


def _messages(d: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages (``system`` first) and whether the last turn is an assistant's prefill.

    As Anthropic checks a transcript: every ``tool_use`` of an assistant turn is answered by a
    ``tool_result`` in the user turn right after it, and a ``tool_result`` answers a ``tool_use`` of the
    assistant turn right before (consecutive messages of one role are one turn)."""
    out: list[dict[str, Any]] = []
    system = d.get("system")
    if system is not None:
        text = _text_blocks(_without_billing_header(system), "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: Field required (a non-empty list).", param="messages")
    seen: set[str] = set()  # every tool_use id (ids are unique in a transcript)
    turn: set[str] = set()  # the tool_use ids of the latest assistant turn
    unanswered: dict[str, int] = {}  # of those, the ones no tool_result answered yet: their message
    answered: set[str] = set()
    prefill = False
    last = len(msgs) - 1
    prev_role: str | None = None
    last_user = max(
        (k for k, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), default=-1
    )
    for i, m in enumerate(msgs):
        w = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(f"{w}: expected an object.", param=w)
        role = m.get("role")
        if role == "system":
            _system_message(m, w, i < last_user, out)
            prefill = False
            continue
        if role not in ("user", "assistant"):
            raise bad(f"{w}.role: expected 'user', 'assistant' or 'system'.", param=f"{w}.role")
        content = m.get("content")
        if content == "" or content == []:
            if i == last and role == "assistant" and i > 0:  # an empty prefill: none (or the turn before)
                break
            raise bad(
                f"{w}: all messages must have non-empty content except for the optional final assistant "
                "message",
                param=f"{w}.content",
            )
        if role != prev_role:
            if role == "assistant":  # a new assistant turn: the last one's calls must all be answered
                _unanswered(unanswered)
                turn = set()
            prev_role = role
        final = i == last and role == "assistant"
        if isinstance(content, str):
            _check_text(content, f"{w}.content", final)
            _add_turn(out, {"role": role, "content": content})
        elif isinstance(content, list):
            if role == "user":
                _user_blocks(content, w, turn, out, answered)
                for tid in answered.intersection(unanswered):
                    del unanswered[tid]
            else:
                msg = _assistant_blocks(content, w, seen, final)
                for call in msg.get("tool_calls") or ():
                    turn.add(call["id"])
                    unanswered[call["id"]] = i
                _add_turn(out, msg)
        else:
            raise bad(f"{w}.content: expected a string or a list of content blocks.", param=f"{w}.content")
        prefill = role == "assistant"
    if prev_role is None:  # (system messages alone: no conversation to answer)
        raise bad("messages: at least one user or assistant message is required.", param="messages")
    _join_turns(out)
    if prefill and out[-1].get("tool_calls"):
        raise bad("The final assistant message may not end with a tool_use block.", param="messages")
    _unanswered(unanswered)
    if seen and not d.get("tools"):
        why = "Requests which include `tool_use` or `tool_result` blocks must define tools."
        raise bad(why, param="tools")
    return out, prefill


_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(system: Any) -> Any:
    """``system`` without Claude Code's attribution line (see the module): a text block that is that
    line, or (a client that flattened the blocks) a string's first line."""
    if isinstance(system, str):
        if system.startswith(_BILLING_HEADER):
            return system.partition("\n")[2]
        return system
    if isinstance(system, list):
        return [
            b
            for b in system
            if not (
                isinstance(b, dict)
                and b.get("type") == "text"
                and str(b.get("text")).startswith(_BILLING_HEADER)
            )
        ]
    return system


_CLEAR_AT = ("never", "next_user_message")


def _system_message(m: dict[str, Any], w: str, cleared: bool, out: list[dict[str, Any]]) -> None:
    """A ``role: system`` message (see the module) -> a ``system`` message in ``out``, or none
    (``cleared``: a user message follows it)."""
    clear_at = m.get("clear_at")
    if clear_at is not None and clear_at not in _CLEAR_AT:
        raise bad(f"{w}.clear_at: expected one of {list(_CLEAR_AT)}.", param=f"{w}.clear_at")
    content = m.get("content")
    if content is None and isinstance(m.get("output_config"), dict):
        return  # (the beta's per-turn output_config alone: nothing to show the model)
    if isinstance(content, str):
        _check_text(content, f"{w}.content", False)
        text = content
    elif isinstance(content, list) and content:
        texts: list[str] = []
        for j, b in enumerate(content):
            bw = f"{w}.content.{j}"
            if not isinstance(b, dict) or b.get("type") != "text":
                raise bad(f"{bw}: a system message holds text blocks only.", param=bw)
            texts.append(_text_of(b, bw))
        text = "\n".join(texts)
    else:
        raise bad(f"{w}.content: expected a non-empty string or list of text blocks.", param=f"{w}.content")
    if clear_at == "next_user_message" and cleared:
        return  # (kept in the array by the client, no longer shown to the model)
    _add_turn(out, {"role": "system", "content": text})


def _unanswered(unanswered: dict[str, int]) -> None:
    if unanswered:
        at = min(unanswered.values())
        ids = ", ".join(t[:100] for t, i in unanswered.items() if i == at)
        raise bad(
            f"messages.{at}: `tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{ids}. Each `tool_use` block must have a corresponding `tool_result` block in the next "
            "message.",
            param=f"messages.{at}",
        )


def _tools(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> list[dict[str, Any]] | None:
    tools = d.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools: expected a list.", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools: at most {MAX_TOOLS} tools.", param="tools")
    try:
        size = len(orjson.dumps(tools))
    except (TypeError, orjson.JSONEncodeError):
        raise bad("tools: cannot be serialised as JSON.", param="tools") from None
    if size > MAX_TOOLS_BYTES:
        raise bad(f"tools: at most {MAX_TOOLS_BYTES // 1024} KiB of JSON.", param="tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, t in enumerate(tools):
        w = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad(f"{w}: expected an object.", param=w)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"{w}.type: {str(kind)[:50]!r}: server tools are not supported, only custom tools.",
                param=f"{w}.type",
                code="unsupported_tool",
            )
        name = t.get("name")
        if not isinstance(name, str) or _TOOL_NAME.fullmatch(name) is None:
            raise bad(
                f"{w}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'", param=f"{w}.name"
            )
        if name in names:
            raise bad(f"{w}.name: tool names must be unique ({name!r} is repeated).", param=f"{w}.name")
        names.add(name)
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{w}.description: expected a string.", param=f"{w}.description")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{w}.input_schema: Field required (a JSON schema object).", param=f"{w}.input_schema")
        if schema.get("type") != "object":
            raise bad(f"{w}.custom.input_schema.type: Input should be 'object'", param=f"{w}.input_schema")
        pending.append(budget.take(schema, f"{w}.input_schema"))
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if desc:
            fn["description"] = desc
        strict = t.get("strict")
        if strict not in (None, True, False):
            raise bad(f"{w}.strict: expected a boolean.", param=f"{w}.strict")
        if strict:  # the call's input is constrained to its schema, as a strict OpenAI function's
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(d: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[Any, bool]:
    """(the OpenAI ``tool_choice`` value, parallel tool calls allowed)."""
    tc = d.get("tool_choice")
    if tc is None:
        return None, True
    if not isinstance(tc, dict):
        raise bad("tool_choice: expected an object with a 'type'.", param="tool_choice")
    par = tc.get("disable_parallel_tool_use")
    if par not in (None, True, False):
        raise bad("tool_choice.disable_parallel_tool_use: expected a boolean.", param="tool_choice")
    parallel = not par
    kind = tc.get("type")
    if kind in ("any", "tool") and not tools:  # (Anthropic's words, not the chat path's 'required')
        raise bad(f"tool_choice: type '{kind}' requires a non-empty `tools` list.", param="tool_choice")
    if kind == "auto":
        return ("auto" if tools else None), parallel
    if kind == "none":
        return "none", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = tc.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.name: Field required for type 'tool'.", param="tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad("tool_choice.type: expected 'auto', 'any', 'tool' or 'none'.", param="tool_choice")


_THINKING_KINDS = ("enabled", "adaptive", "between_tools", "disabled")
_DISPLAYS = ("summarized", "omitted")


def _thinking(d: dict[str, Any], max_tokens: int | None, interleaved: bool) -> tuple[bool, int | None, bool]:
    """(thinking on, its budget, its text omitted from the answer: ``display`` 'omitted'); ``interleaved``:
    the interleaved-thinking beta, where the budget spans the turn's thinking blocks and may exceed
    ``max_tokens`` (Anthropic's docs; Claude Code sends the beta)."""
    t = d.get("thinking")
    if t is None:
        return False, None, False
    if not isinstance(t, dict):
        raise bad("thinking: expected an object with a 'type'.", param="thinking")
    kind = t.get("type")
    if kind not in _THINKING_KINDS:
        raise bad(f"thinking.type: expected one of {list(_THINKING_KINDS)}.", param="thinking.type")
    if kind == "disabled":
        return False, None, False
    display = t.get("display")
    if display is not None and display not in _DISPLAYS:
        raise bad(f"thinking.display: expected one of {list(_DISPLAYS)}.", param="thinking.display")
    omit = display == "omitted"
    if kind != "enabled":  # adaptive, between_tools: the model decides how much, no budget of its own
        return True, None, omit
    budget = t.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise bad("thinking.budget_tokens: Field required (an integer).", param="thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise bad(
            f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}.", param="thinking.budget_tokens"
        )
    if max_tokens and budget >= max_tokens and not interleaved:  # (0: nothing is generated, nothing to bound)
        raise bad(
            "`max_tokens` must be greater than `thinking.budget_tokens`.", param="thinking.budget_tokens"
        )
    return True, budget, omit


_EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_config(
    d: dict[str, Any], budget: SchemaBudget, pending: list[PendingSchema]
) -> dict[str, Any] | None:
    """``output_config`` (``format``: a JSON schema the answer must follow, as the SDK's ``parse`` sends;
    ``effort`` and the task-budgets beta's ``task_budget``: checked, hints on how much to spend, accepted
    as ``budget_tokens`` is: ``max_tokens`` bounds the answer) or the beta's top-level
    ``output_format``: the chat ``response_format``."""
    cfg = d.get("output_config")
    if cfg is not None and not isinstance(cfg, dict):
        raise bad("output_config: expected an object.", param="output_config")
    cfg = cfg or {}
    unknown = sorted(set(cfg) - {"format", "effort", "task_budget"})
    if unknown:
        raise bad(f"output_config.{unknown[0][:50]}: Extra inputs are not permitted.", param="output_config")
    effort = cfg.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad(f"output_config.effort: expected one of {list(_EFFORTS)}.", param="output_config.effort")
    _task_budget(cfg.get("task_budget"))
    fmt, where = cfg.get("format"), "output_config.format"
    if fmt is None and d.get("output_format") is not None:
        fmt, where = d["output_format"], "output_format"
    if fmt is None:
        return None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        raise bad(f"{where}: expected {{'type': 'json_schema', 'schema': {{...}}}}.", param=where)
    pending.append(budget.take(schema, f"{where}.schema"))
    spec = {"name": "output", "schema": schema, "strict": True}
    return {"type": "json_schema", "json_schema": spec}


def _task_budget(v: object) -> None:
    """The task-budgets beta's ``{"type": "tokens", "total": N, "remaining": M}`` (the SDK's
    ``BetaTokenTaskBudgetParam``), checked: a positive ``total``, ``remaining`` from 0 to it."""
    if v is None:
        return
    where = "output_config.task_budget"
    if not isinstance(v, dict) or v.get("type") != "tokens":
        raise bad(f"{where}: expected {{'type': 'tokens', 'total': N}}.", param=where)
    unknown = sorted(set(v) - {"type", "total", "remaining"})
    if unknown:
        raise bad(f"{where}.{unknown[0][:50]}: Extra inputs are not permitted.", param=where)
    total, remaining = v.get("total"), v.get("remaining")
    if type(total) is not int or total < 1:
        raise bad(f"{where}.total: expected a positive integer.", param=f"{where}.total")
    if remaining is not None and (type(remaining) is not int or not 0 <= remaining <= total):
        raise bad(f"{where}.remaining: expected an integer from 0 to total.", param=f"{where}.remaining")


def _stop_sequences(d: dict[str, Any]) -> tuple[str, ...]:
    v = d.get("stop_sequences")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop_sequences: expected a list of strings.", param="stop_sequences")
    if len(v) > MAX_STOP:
        raise bad(f"stop_sequences: at most {MAX_STOP} sequences.", param="stop_sequences")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad(f"stop_sequences: each at most {MAX_STOP_CHARS} characters.", param="stop_sequences")
    if any(not s.strip() for s in v):
        raise bad("stop_sequences: each must contain non-whitespace.", param="stop_sequences")
    return tuple(v)


def _user_id(d: dict[str, Any]) -> str | None:
    meta = d.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise bad("metadata: expected an object.", param="metadata")
    uid = meta.get("user_id")
    if uid is None:
        return None
    if not isinstance(uid, str) or len(uid) > MAX_USER_ID_CHARS:
        raise bad(
            f"metadata.user_id: expected a string of at most {MAX_USER_ID_CHARS} characters.",
            param="metadata.user_id",
        )
    return uid


def _num(d: dict[str, Any], key: str, lo: float, hi: float) -> None:
    v = d.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise bad(f"{key}: expected a number in [{lo}, {hi}].", param=key)


def parse_messages(d: dict[str, Any], betas: str = "") -> MessagesRequest:
    """A create request (``max_tokens`` required), bounded checks only (see the module's docstring);
    ``betas``: the request's ``anthropic-beta`` header."""
    req = _parse(d, count=False, interleaved=INTERLEAVED_THINKING in betas)
    tools = d.get("tools")
    eager = FINE_GRAINED_TOOLS in betas or (
        isinstance(tools, list)
        and any(isinstance(t, dict) and t.get("eager_input_streaming") is True for t in tools)
    )
    return dataclasses.replace(req, eager_tools=True) if eager else req


def parse_count_tokens(d: dict[str, Any]) -> MessagesRequest:
    """A ``count_tokens`` request: the prompt's fields (no ``max_tokens``, no sampling)."""
    return _parse(d, count=True)


def _parse(d: dict[str, Any], *, count: bool, interleaved: bool = False) -> MessagesRequest:
    model = _model(d)
    if d.get("thread") is not None:  # (before the messages: a continued thread's do not start the chat)
        raise bad(
            "thread: message threads (conversation state kept by the server) are not supported; send the "
            "whole conversation without `thread`.",
            param="thread",
            code="thread_unsupported_request",
        )
    messages, prefill = _messages(d)
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    stream = False
    s: dict[str, Any] = {}
    if not count:
        mt = d.get("max_tokens")
        if mt is None:
            raise bad("max_tokens: Field required", param="max_tokens")
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 <= mt <= INT32_MAX:
            raise bad(f"max_tokens: expected an integer in [0, {INT32_MAX}].", param="max_tokens")
        max_tokens = mt
        stops = _stop_sequences(d)
        _num(d, "temperature", 0.0, 1.0)
        _num(d, "top_p", 0.0, 1.0)
        top_k = d.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise bad("top_k: expected an integer >= 0.", param="top_k")
        stream_v = d.get("stream")
        if stream_v not in (None, True, False):
            raise bad("stream: expected a boolean.", param="stream")
        stream = bool(stream_v)
        s = {"max_tokens": max_tokens or 1, "stream": stream}  # (0: the prefill alone, see cache_only)
        for key in ("temperature", "top_p", "top_k"):
            if d.get(key) is not None:
                s[key] = d[key]
        if s.get("top_p") == 0:
            s["top_p"] = 1e-9  # Anthropic accepts 0 (greedy); the engines' top_p is (0, 1]
        if stops:
            s["stop"] = list(stops)
    sampling = parse_sampling(s, max_tokens_keys=("max_tokens",))
    thinking, budget, omit_thinking = _thinking(d, max_tokens, interleaved)
    budget_s = SchemaBudget()
    pending: list[PendingSchema] = []
    tools = _tools(d, budget_s, pending)
    response_format = _output_config(d, budget_s, pending)
    choice_value, parallel = _tool_choice(d, tools)
    try:
        choice = parse_tool_choice(choice_value, tools)
    except ToolChoiceError as e:
        raise bad(f"tool_choice: {e}", param="tool_choice") from None
    chat = ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        logprobs=False,
        top_logprobs=0,
        tools=tools,
        tool_choice=choice,
        template_kwargs={"enable_thinking": thinking},
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        response_format=response_format,
        raw=d,
        parallel_tool_calls=parallel,
        separate_reasoning=thinking,
        schemas=tuple(pending),
    )
    return MessagesRequest(
        chat, thinking, budget, stops, _user_id(d), stream, omit_thinking, cache_only=max_tokens == 0
    )
