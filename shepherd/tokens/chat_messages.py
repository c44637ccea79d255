"""What a chat template is given: messages prepared as transformers 5.x prepares them, tool calls
normalized to what a template accepts, and ``ChatTemplateError``.

``_prepare_messages`` drops None-valued keys and aliases reasoning fields; ``continue_final_message``
tags the final message before a render and cuts the render at the tag after it; tool-call arguments
(JSON strings or objects) and ids (Mistral's 9 alphanumerics) are rewritten in copies of the messages.
``ChatTemplateError`` is raised for input that cannot be rendered, here and by ``ChatTemplate``.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "ChatTemplateError",
    "name_tool_outputs",
    "normalize_tool_call_arguments",
    "normalize_tool_call_ids",
]

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The prompt could not be rendered: no template, the template refused the input, or bad input."""


_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "


def _prepare_messages(messages: object) -> list[dict[str, Any]]:
    """Fresh shallow copies: None-valued keys dropped but a null ``content`` made "", reasoning
    aliased (transformers 5.x)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, not {type(m).__name__}")
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" in m and m["content"] is None:
            # OpenAI clients send null content beside tool_calls; templates index it as text (vLLM
            # renders it as "", transformers drops the key and Qwen3's template then fails)
            msg["content"] = ""
        if not isinstance(msg.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _tag_final_message(chat: list[dict[str, Any]], field: bool | str, source: str) -> None:
    name = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(name)
    if final is None:
        raise ChatTemplateError(f"continue_final_message is set but the final message has no {name!r}")
    fields = [name]
    if name in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message: the chat template does not read {name!r}")
    if isinstance(final, list | tuple):
        blocks = list(final)
        for j in range(len(blocks) - 1, -1, -1):
            block = blocks[j]
            if isinstance(block, Mapping) and isinstance(block.get("text"), str):
                blocks[j] = {**block, "text": block["text"] + _CONTINUE_TAG}
                last[name] = blocks
                return
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    if not isinstance(final, str):
        raise ChatTemplateError(f"continue_final_message: the final message's {name!r} is not text")
    for f in fields:
        last[f] = last[f] + _CONTINUE_TAG


def _cut_at_tag(rendered: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


def normalize_tool_call_arguments(messages: Sequence[Message], as_string: bool) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool-call ``arguments`` are JSON strings (``as_string``) or objects.

    DeepSeek and Mistral templates concatenate ``arguments`` as a string; Qwen and Llama templates
    take either, and get objects (as vLLM gives them: Llama's ``tojson`` of a string double-encodes,
    Qwen's prints a string as it is spaced instead of as ``tojson`` writes the object).
    Arguments that are a string but not valid JSON are left as they are when objects are wanted.
    Messages without tool calls are shallow-copied unchanged.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        new_calls: list[Any] = []
        for call in calls:
            if not isinstance(call, Mapping):
                new_calls.append(call)
                continue
            call = dict(call)
            fn = call.get("function")
            if isinstance(fn, Mapping):
                fn = dict(fn)
                fn["arguments"] = _convert_arguments(fn.get("arguments"), as_string)
                call["function"] = fn
            elif "arguments" in call:
                call["arguments"] = _convert_arguments(call["arguments"], as_string)
            new_calls.append(call)
        copy = dict(m)
        copy["tool_calls"] = new_calls
        out.append(copy)
    return out


def _convert_arguments(args: Any, as_string: bool) -> Any:
    """A call's arguments as a JSON string or an object; none, blank or ``null`` arguments (a tool that
    takes none, as some clients send it) are ``{}``, as vLLM's ``_postprocess_messages`` makes them."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return "{}" if as_string else {}
    if as_string:
        if isinstance(args, str):
            return "{}" if args.strip() == "null" else args
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return {} if parsed is None else parsed
    return args


def name_tool_outputs(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool outputs without a ``name`` are named after the call their
    ``tool_call_id`` answers (an assistant message's ``tool_calls`` before them): for a template that
    names each output (gpt-oss's, as openai-harmony writes ``functions.NAME to=assistant``)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        copy = dict(m)
        for call in m.get("tool_calls") or ():
            if isinstance(call, Mapping):
                fn = call.get("function")
                name = fn.get("name") if isinstance(fn, Mapping) else call.get("name")
                if isinstance(call.get("id"), str) and isinstance(name, str):
                    names[call["id"]] = name
        ident = m.get("tool_call_id")
        if m.get("role") == "tool" and not m.get("name") and isinstance(ident, str):
            name = names.get(ident)
            if name is not None:
                copy["name"] = name
        out.append(copy)
    return out


_ID_ALPHABET: Final = string.ascii_letters + string.digits


def normalize_tool_call_ids(messages: Sequence[Message], length: int = 9) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool-call ids (and the tool results' ``tool_call_id``) are
    ``length`` alphanumeric characters, as Mistral templates demand. An id that already fits is kept,
    a longer one ending in ``length`` alphanumerics is cut to them (as vLLM does), others are mapped
    to a deterministic replacement (same id in → same id out, in any process)."""
    mapping: dict[str, str] = {}

    def fix(ident: Any) -> Any:
        if not isinstance(ident, str):
            return ident
        if len(ident) == length and ident.isalnum():
            return ident
        if len(ident) > length and ident[-length:].isalnum():
            return ident[-length:]  # what vLLM does for Mistral
        if ident not in mapping:
            rng = random.Random(ident)
            mapping[ident] = "".join(rng.choice(_ID_ALPHABET) for _ in range(length))
        return mapping[ident]

    out: list[dict[str, Any]] = []
    for m in messages:
        copy = dict(m)
        calls = m.get("tool_calls")
        if calls:
            copy["tool_calls"] = [
                {**c, "id": fix(c["id"])} if isinstance(c, Mapping) and "id" in c else c for c in calls
            ]
        if "tool_call_id" in m:
            copy["tool_call_id"] = fix(m["tool_call_id"])
        out.append(copy)
    return out
