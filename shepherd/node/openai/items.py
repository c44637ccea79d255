"""Responses API input items: parsing and validation into ``StoredItem`` records, and the conversion of
stored items to chat-template messages (docs/DESIGN.md §12).

``parse_items`` accepts what OpenAI's ``input`` accepts for a text model: a string (one user message) or
a list of items — ``message`` (also without ``type``: role + content; content a string or a list of
``input_text`` / ``output_text`` / ``input_image`` / ``refusal`` parts), ``function_call``,
``function_call_output``, ``reasoning`` and ``item_reference``. Each item becomes a ``StoredItem``
whose ``data`` is the item as the API shows it (normalised: a message's content is always a list of
parts, ``status`` is set, the ``id`` is the client's when it gave a well-formed one, else a fresh one
with OpenAI's prefix: ``msg``, ``fc``, ``fco``, ``rs``). A reasoning item sent back with only the
``encrypted_content`` this mesh made (``node.openai.reasoning_seal``) gets the text the blob seals.

An ``item_reference`` stays a ``StoredItem`` of type ``item_reference`` whose ``id`` is the item it
names: the caller resolves it against the store (it is not a new item).

Malformed input is an ``ApiError`` 400 whose ``param`` names the item (``input[3].content``), and so
are two items with one id (the store keeps one item per id). Sizes
are bounded (an error, never a truncation): at most ``MAX_ITEMS`` items, ``MAX_PARTS`` content parts
per item and ``MAX_TEXT_CHARS`` characters per text field.

``items_to_messages`` turns stored items into chat messages as chat templates expect them: an
assistant message and the function calls after it become one assistant message with ``tool_calls``;
a ``function_call_output`` a ``tool`` message with ``tool_call_id``; a ``reasoning`` item the
``reasoning_content`` of the next assistant message (the field thinking models' templates read);
``system`` and ``developer`` messages ``system`` ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from shepherd.node.openai.tool_choice import check_tool_name
from shepherd.proto.openai_errors import ApiError, bad
from shepherd.storage.types import StoredItem

__all__ = [
    "ITEM_PREFIXES",
    "MAX_ITEMS",
    "MAX_PARTS",
    "MAX_TEXT_CHARS",
    "items_to_messages",
    "parse_items",
]

MAX_ITEMS = 2048
MAX_PARTS = 256
MAX_TEXT_CHARS = 4 << 20  # per text field (a message part, arguments, an output)
MAX_ID_CHARS = 128
MAX_NAME_CHARS = 128
# what the encrypted_content blobs of one request open into, all together: a blob of a few KB opens
# into up to MAX_TEXT_CHARS, so without a sum a request of many blobs would expand a hundredfold
MAX_OPENED_CHARS = 2 * MAX_TEXT_CHARS

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
ITEM_STATUSES = frozenset({"in_progress", "completed", "incomplete"})

# the id prefix a fresh item of each type gets (OpenAI's), and the prefixes accepted on given ids
ITEM_PREFIXES: dict[str, str] = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
_ACCEPTED_PREFIXES: dict[str, tuple[str, ...]] = {
    "message": ("msg_",),
    "function_call": ("fc_",),
    "function_call_output": ("fco_", "fc_"),
    "reasoning": ("rs_",),
}
_ID_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def _where(param: str, i: int, field: str = "") -> str:
    return f"{param}[{i}]" + (f".{field}" if field else "")


def _text(v: Any, where: str, name: str = "text") -> str:
    if not isinstance(v, str):
        raise bad(f"'{where}' must have a string '{name}'.", param=where, code="invalid_type")
    if len(v) > MAX_TEXT_CHARS:
        raise bad(
            f"'{where}' is too long ({len(v)} characters, at most {MAX_TEXT_CHARS}).",
            param=where,
            code="string_above_max_length",
        )
    return v


def _given_id(v: Any, kind: str, where: str) -> str | None:
    """A client-given item id, checked (None: not given)."""
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS or not _ID_RE.match(v):
        raise bad(f"Invalid '{where}': {v!r} is not a valid item id.", param=where, code="invalid_value")
    prefixes = _ACCEPTED_PREFIXES.get(kind)
    if prefixes is not None and not v.startswith(prefixes):
        raise bad(
            f"Invalid '{where}': '{v}'. Expected an ID that begins with '{prefixes[0][:-1]}'.",
            param=where,
            code="invalid_value",
        )
    return v


def _status(v: Any, where: str) -> str:
    if v is None:
        return "completed"
    if not isinstance(v, str) or v not in ITEM_STATUSES:
        raise bad(f"'{where}' must be one of {sorted(ITEM_STATUSES)}.", param=where, code="invalid_value")
    return str(v)


def _part(p: Any, role: str, where: str) -> dict[str, Any]:
    if not isinstance(p, dict):
        raise bad(f"'{where}' must be an object.", param=where, code="invalid_type")
    kind = p.get("type")
    if kind == "input_text":
        return {"type": "input_text", "text": _text(p.get("text"), where)}
    if kind == "output_text":
        ann = p.get("annotations")
        if ann is not None and not isinstance(ann, list):
            raise bad(f"'{where}.annotations' must be a list.", param=f"{where}.annotations")
        part: dict[str, Any] = {"type": "output_text", "text": _text(p.get("text"), where), "annotations": []}
        if ann:
            part["annotations"] = ann
        lps = p.get("logprobs")
        if isinstance(lps, list) and lps:
            part["logprobs"] = lps
        return part
    if kind == "refusal":
        return {"type": "refusal", "refusal": _text(p.get("refusal"), where, "refusal")}
    if kind == "input_image":
        url, file_id = p.get("image_url"), p.get("file_id")
        if not isinstance(url, str) and not isinstance(file_id, str):
            raise bad(f"'{where}' needs an 'image_url' or a 'file_id'.", param=where)
        detail = p.get("detail") or "auto"
        if detail not in ("low", "high", "auto", "original"):
            raise bad(f"'{where}.detail' must be 'low', 'high' or 'auto'.", param=f"{where}.detail")
        out: dict[str, Any] = {"type": "input_image", "detail": detail}
        if isinstance(url, str):
            out["image_url"] = _text(url, where, "image_url")
        if isinstance(file_id, str):
            out["file_id"] = file_id
        return out
    raise bad(
        f"'{where}.type' {kind!r} is not supported: use 'input_text', 'output_text', 'input_image' or "
        "'refusal'.",
        param=f"{where}.type",
        code="invalid_value",
    )


def _content(v: Any, role: str, where: str) -> list[dict[str, Any]]:
    if isinstance(v, str):
        _text(v, where, "content")
        if role == "assistant":
            return [{"type": "output_text", "text": v, "annotations": []}]
        return [{"type": "input_text", "text": v}]
    if not isinstance(v, list):
        raise bad(f"'{where}' must be a string or a list of content parts.", param=where, code="invalid_type")
    if len(v) > MAX_PARTS:
        raise bad(f"'{where}' has more than {MAX_PARTS} parts.", param=where, code="array_above_max_length")
    return [_part(p, role, f"{where}[{j}]") for j, p in enumerate(v)]


def parse_items(
    raw: Any,
    *,
    param: str,
    new_id: Callable[[str], str],
    now: float,
    response_id: str | None = None,
    unseal: Callable[[str], str | None] | None = None,
) -> list[StoredItem]:
    """``raw`` (a request's ``input``, or a Conversations ``items`` list) -> validated items.

    ``param``: the request field, for error messages (``input``); ``new_id(prefix)`` mints an id for an
    item without one; ``now``: their ``created_at``; ``response_id``: the response they belong to;
    ``unseal``: a reasoning item's ``encrypted_content`` -> its text (``ReasoningSeal.open``; None: not
    one of ours).
    """
    if isinstance(raw, str):
        _text(raw, param, "content")
        mid = new_id("msg")
        data: dict[str, Any] = {
            "type": "message",
            "id": mid,
            "role": "user",
            "content": [{"type": "input_text", "text": raw}],
            "status": "completed",
        }
        return [StoredItem(mid, "message", data, now, response_id, "user", "completed")]
    if not isinstance(raw, list):
        raise bad(f"'{param}' must be a string or a list of items.", param=param, code="invalid_type")
    if len(raw) > MAX_ITEMS:
        raise bad(
            f"'{param}' has {len(raw)} items, more than the {MAX_ITEMS} allowed.",
            param=param,
            code="array_above_max_length",
        )
    if unseal is not None:
        unseal = _within_budget(unseal, param)
    items = [_item(it, param, i, new_id, now, response_id, unseal) for i, it in enumerate(raw)]
    seen: set[str] = set()
    for i, it in enumerate(items):
        if it.id in seen:
            w = _where(param, i, "id")
            raise bad(
                f"Duplicate item found with id '{it.id}' ('{w}'). Remove duplicate items from your input "
                "and try again.",
                param=w,
                code="duplicate_item",
            )
        seen.add(it.id)
    return items


def _within_budget(unseal: Callable[[str], str | None], param: str) -> Callable[[str], str | None]:
    """``unseal`` counting what the request's blobs open into (``MAX_OPENED_CHARS``)."""
    left = MAX_OPENED_CHARS

    def opened(blob: str) -> str | None:
        nonlocal left
        text = unseal(blob)
        if text is not None:
            left -= len(text)
            if left < 0:
                raise bad(
                    f"The reasoning items' encrypted_content in '{param}' open into more than "
                    f"{MAX_OPENED_CHARS} characters.",
                    param=param,
                    code="string_above_max_length",
                )
        return text

    return opened


def _item(
    it: Any,
    param: str,
    i: int,
    new_id: Callable[[str], str],
    now: float,
    response_id: str | None,
    unseal: Callable[[str], str | None] | None,
) -> StoredItem:
    w = _where(param, i)
    if not isinstance(it, dict):
        raise bad(f"'{w}' must be an object.", param=w, code="invalid_type")
    kind = it.get("type")
    if kind is None and "role" in it:
        kind = "message"
    elif kind is None and "id" in it and len(it) == (2 if "type" in it else 1):
        kind = "item_reference"  # (the SDK's ItemReference: 'type' optional, the id alone)
    if kind == "message":
        role = it.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise bad(
                f"'{w}.role' must be one of {sorted(MESSAGE_ROLES)}.", param=f"{w}.role", code="invalid_value"
            )
        content = _content(it.get("content"), role, f"{w}.content")
        status = _status(it.get("status"), f"{w}.status")
        iid = _given_id(it.get("id"), kind, f"{w}.id") or new_id("msg")
        data = {"type": "message", "id": iid, "role": role, "content": content, "status": status}
        return StoredItem(iid, kind, data, now, response_id, role, status)
    if kind == "function_call":
        call_id = _short(it.get("call_id"), f"{w}.call_id", MAX_ID_CHARS * 2)
        name = _short(it.get("name"), f"{w}.name", MAX_NAME_CHARS)
        check_tool_name(name, f"{w}.name", f"{w}.name")  # (rendered by the template)
        args = _text(it.get("arguments"), f"{w}.arguments", "arguments")
        status = _status(it.get("status"), f"{w}.status")
        iid = _given_id(it.get("id"), kind, f"{w}.id") or new_id("fc")
        data = {
            "type": "function_call",
            "id": iid,
            "call_id": call_id,
            "name": name,
            "arguments": args,
            "status": status,
        }
        return StoredItem(iid, kind, data, now, response_id, None, status)
    if kind == "function_call_output":
        call_id = _short(it.get("call_id"), f"{w}.call_id", MAX_ID_CHARS * 2)
        out = it.get("output")
        output: str | list[dict[str, Any]]
        if isinstance(out, str):
            output = _text(out, f"{w}.output", "output")
        elif isinstance(out, list):
            output = _content(out, "user", f"{w}.output")
        else:
            raise bad(
                f"'{w}.output' must be a string or a list of content parts.",
                param=f"{w}.output",
                code="invalid_type",
            )
        status = _status(it.get("status"), f"{w}.status")
        iid = _given_id(it.get("id"), kind, f"{w}.id") or new_id("fco")
        data = {
            "type": "function_call_output",
            "id": iid,
            "call_id": call_id,
            "output": output,
            "status": status,
        }
        return StoredItem(iid, kind, data, now, response_id, None, status)
    if kind == "reasoning":
        summary = it.get("summary", [])
        if not isinstance(summary, list):
            raise bad(f"'{w}.summary' must be a list.", param=f"{w}.summary", code="invalid_type")
        summ = []
        for j, s in enumerate(summary):
            sw = f"{w}.summary[{j}]"
            if not isinstance(s, dict) or s.get("type") != "summary_text":
                raise bad(f"'{sw}' must be a 'summary_text' part.", param=sw)
            summ.append({"type": "summary_text", "text": _text(s.get("text"), sw)})
        content_raw = it.get("content")
        parts: list[dict[str, Any]] = []
        if content_raw is not None:
            if not isinstance(content_raw, list):
                raise bad(f"'{w}.content' must be a list.", param=f"{w}.content", code="invalid_type")
            for j, c in enumerate(content_raw):
                cw = f"{w}.content[{j}]"
                if not isinstance(c, dict) or c.get("type") != "reasoning_text":
                    raise bad(f"'{cw}' must be a 'reasoning_text' part.", param=cw)
                parts.append({"type": "reasoning_text", "text": _text(c.get("text"), cw)})
        sealed = it.get("encrypted_content")
        if sealed is not None:
            sealed = _text(sealed, f"{w}.encrypted_content", "encrypted_content")
            # the text a blob of ours seals stands in for a text the client did not keep (the blob alone,
            # with the summary: the Vercel AI SDK, pydantic-ai); a text it sent wins; a foreign blob
            # (OpenAI's) is ignored, as SMG ignores it, rather than refused as vLLM does
            opened = unseal(sealed) if unseal is not None and not parts else None
            if opened:
                parts.append({"type": "reasoning_text", "text": opened})
        if len(summ) + len(parts) > MAX_PARTS:
            raise bad(f"'{w}' has more than {MAX_PARTS} parts.", param=w, code="array_above_max_length")
        status = _status(it.get("status"), f"{w}.status")
        iid = _given_id(it.get("id"), kind, f"{w}.id") or new_id("rs")
        # (the blob itself is not kept: its text, when it opened, is the item's content)
        data = {"type": "reasoning", "id": iid, "summary": summ, "content": parts, "status": status}
        return StoredItem(iid, kind, data, now, response_id, None, status)
    if kind == "item_reference":
        ref = it.get("id")
        if not isinstance(ref, str) or not ref or len(ref) > MAX_ID_CHARS or not _ID_RE.match(ref):
            raise bad(f"'{w}.id' must be an item id.", param=f"{w}.id", code="invalid_value")
        return StoredItem(ref, kind, {"type": "item_reference", "id": ref}, now, response_id)
    if kind is None:
        raise bad(f"'{w}' needs a 'type' (or a 'role' for a message).", param=f"{w}.type")
    raise bad(
        f"'{w}.type' {kind!r} is not supported: use 'message', 'function_call', 'function_call_output', "
        "'reasoning' or 'item_reference'.",
        param=f"{w}.type",
        code="invalid_value",
    )


def _short(v: Any, where: str, limit: int) -> str:
    if not isinstance(v, str) or not v:
        raise bad(f"'{where}' is required and must be a non-empty string.", param=where, code="invalid_type")
    if len(v) > limit:
        raise bad(
            f"'{where}' is longer than {limit} characters.", param=where, code="string_above_max_length"
        )
    return v


# ---- stored items -> chat messages -------------------------------------------------------------------


def _parts_text(parts: Any) -> str:
    """The text of content parts (images are refused: the models behind this gateway read text)."""
    if isinstance(parts, str):
        return parts
    out: list[str] = []
    for p in parts or ():
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text"):
            out.append(p.get("text", ""))
        elif kind == "refusal":
            out.append(p.get("refusal", ""))
        elif kind in ("input_image", "input_file"):
            raise ApiError(
                400,
                f"Content of type '{kind}' is not supported by this model (text only).",
                param="input",
                code="unsupported_content",
            )
    return "\n".join(out) if len(out) > 1 else (out[0] if out else "")


def items_to_messages(items: Sequence[StoredItem]) -> list[dict[str, Any]]:
    """Stored items (in order) -> chat messages for the chat template. ``item_reference`` items must
    have been resolved before (they are skipped here)."""
    msgs: list[dict[str, Any]] = []
    reasoning: list[str] = []
    # the assistant message the next function calls join (the last message, if it is an assistant's)
    open_assistant: dict[str, Any] | None = None
    for it in items:
        d = it.data
        kind = it.type
        if kind == "message":
            role = d.get("role") or it.role or "user"
            text = _parts_text(d.get("content"))
            if role == "assistant":
                if open_assistant is not None and "tool_calls" not in open_assistant and not reasoning:
                    # consecutive assistant text items (one turn's several messages): one message
                    open_assistant["content"] = (open_assistant["content"] or "") + text
                    continue
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning:
                    msg["reasoning_content"] = "\n".join(reasoning)
                    reasoning = []
                msgs.append(msg)
                open_assistant = msg
                continue
            reasoning = []  # reasoning not followed by an answer (an interrupted turn) is dropped
            msgs.append({"role": "system" if role in ("system", "developer") else role, "content": text})
            open_assistant = None
        elif kind == "function_call":
            call = {
                "id": d.get("call_id", ""),
                "type": "function",
                "function": {"name": d.get("name", ""), "arguments": d.get("arguments", "")},
            }
            if open_assistant is None or reasoning:
                open_assistant = {"role": "assistant", "content": None, "tool_calls": []}
                if reasoning:
                    open_assistant["reasoning_content"] = "\n".join(reasoning)
                    reasoning = []
                msgs.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": d.get("call_id", ""),
                    "content": _parts_text(d.get("output")),
                }
            )
            open_assistant = None
        elif kind == "reasoning":
            parts = d.get("content") or ()
            text = "".join(p.get("text", "") for p in parts)
            if not text:  # only a summary: the closest thing to the thoughts we have
                text = "\n".join(p.get("text", "") for p in d.get("summary") or ())
            if text:
                reasoning.append(text)
            open_assistant = None
    return msgs
