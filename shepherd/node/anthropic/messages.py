"""Anthropic Messages API answers: the Message object and its streamed events.

A Message's ``content`` holds its blocks in generation order: a ``thinking`` block, ``text`` blocks and
one ``tool_use`` block per call (``id`` ``toolu_...``, ``input`` the arguments parsed as a JSON object);
text after a call is a text block after it.

``MessageEvents`` is the encoder the generation driver writes one choice to (it implements
``shepherd.node.output.chat.ChoiceEncoder`` and the driver's ``StreamEvents``: ``role``, ``finish``,
``end``, ``failed``); it keeps the blocks it made. A non-streamed answer is built by the same encoder,
``quiet`` (no bytes), from the whole output (``shepherd.node.output.chat.replay``), then ``message``:
both answers have the same blocks. Its bytes are SSE events ``event: <type>\\ndata: <json>\\n\\n`` in
Anthropic's order: ``message_start`` (the Message with empty ``content``), a ``ping``, then per content
block ``content_block_start``, ``content_block_delta``s (``text_delta``, ``thinking_delta``,
``input_json_delta`` with ``partial_json``; a thinking block's ``signature_delta`` right before it
stops), ``content_block_stop``; finally ``message_delta`` (``stop_reason``, ``stop_sequence``, usage)
and ``message_stop``. An in-band failure is an ``event: error`` in the Anthropic envelope. While the
engine is silent the node's keep-alive is a ``ping``; when the engine is slow to answer at all (queue,
long prefill), ``message_start`` goes out with the headers one keep-alive interval after dispatch
(``opening``), pings after it.

Thinking ``signature``: a non-empty opaque string (``smg1.`` + a digest of the thinking text). It is NOT
a cryptographic signature: nothing is keyed, and the node does not check it when a client sends the
thinking block back (it renders the thinking text as the turn's reasoning either way). With
``omit_thinking`` (the request's ``thinking.display: omitted``) a thinking block has an empty ``thinking``
and no ``thinking_delta``, only its ``signature``: the text is not in the signature either, so a block
sent back so carries no reasoning into the next turn.

Usage: ``input_tokens`` counts the prompt's tokens not read from the engine's prefix cache,
``cache_read_input_tokens`` those that were (their sum: the prompt, what ``count_tokens`` answers);
``cache_creation_input_tokens`` is always 0. A stream's ``message_start`` goes out with the first event's
bytes, once the engine's first answer told the cache split (``cache``), so its usage has the split
``message_delta`` has; only when the engine is slow to answer at all does it go out earlier (``opening``),
counting the whole prompt as input.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import Any

import orjson

from shepherd.node.anthropic.requests import tool_use_id
from shepherd.proto.anthropic_errors import failure_kind

__all__ = [
    "MessageEvents",
    "message_object",
    "messages_usage",
    "signature",
    "sse",
    "stop_reason",
    "tool_input",
]

_dumps = orjson.dumps


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    payload["type"] = kind
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), _dumps(payload))


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: opaque, non-empty, not cryptographic (see the module)."""
    digest = hashlib.blake2b(thinking.encode(), digest_size=24).digest()
    return "smg1." + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def stop_reason(
    reason: str | None, matched: str | int | None, stops: Sequence[str]
) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a choice's finish reason (``final_reason``'s: a choice that
    called tools is ``tool_calls``) and matched stop."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def messages_usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    cached = min(cached, prompt)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the ``input`` object (not an object: ``{}``)."""
    try:
        v = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: tuple[str, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    """The Message of a whole (non-streamed) answer; ``content``: its blocks (``MessageEvents.blocks``)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


class MessageEvents:
    """The SSE events of one streamed Message (one choice: ``index`` is ignored).

    Stateful: the open content block (its kind: ``text``, ``thinking``, ``tool_use``; its index; its text,
    thinking or input JSON so far), the blocks made so far and the stop reason once the choice finished.
    The driver calls ``role`` once, the content / reasoning / tool methods as the parsers produce,
    ``finish`` when the choice ends, then ``end`` (or ``failed``). ``quiet``: no bytes, the blocks only
    (a non-streamed answer's: ``message``). ``omit_thinking``: thinking blocks without their text (the
    signature only)."""

    # what the SSE keep-alive ticker writes on an idle stream: Anthropic's ping event, not a comment
    keepalive = sse("ping", {})

    def __init__(
        self,
        message_id: str,
        model: str,
        input_tokens: int,
        stops: Sequence[str] = (),
        quiet: bool = False,
        omit_thinking: bool = False,
        context_bound: bool = False,
    ) -> None:
        self.message_id = message_id
        # ``max_tokens`` was lowered to what the context window leaves: an output cut at that bound
        # stopped at the window (``model_context_window_exceeded``), not at the client's ``max_tokens``
        self.context_bound = context_bound
        self.model = model
        self.input_tokens = input_tokens
        self.stops = tuple(stops)
        self.quiet = quiet
        self.omit_thinking = omit_thinking
        self._open: str | None = None
        self._index = -1
        self._parts: list[str] = []  # the open block's text, thinking or input JSON so far
        self.blocks: list[dict[str, Any]] = []  # the content blocks, in order (the open one last)
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._started = False
        self._due = False  # ``message_start`` owed: it goes out with the first event's bytes
        self.cached_tokens = 0  # the prompt's tokens read from the engine's cache, once an event told

    def _sse(self, kind: str, payload: dict[str, Any]) -> bytes:
        return b"" if self.quiet else sse(kind, payload)

    def _close(self) -> bytes:
        kind = self._open
        if kind is None:
            return b""
        self._open = None
        text = "".join(self._parts)
        self._parts = []
        block = self.blocks[-1]
        head = b""
        if kind == "thinking":
            sig = signature(text)
            block["thinking"] = "" if self.omit_thinking else text
            block["signature"] = sig
            head = self._sse(
                "content_block_delta",
                {"index": self._index, "delta": {"type": "signature_delta", "signature": sig}},
            )
        elif kind == "text":
            block["text"] = text
        else:
            block["input"] = tool_input(text)
        return head + self._sse("content_block_stop", {"index": self._index})

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        head = self._message_start() + self._close()
        self._open = kind
        self._index += 1
        self.blocks.append(dict(block))
        return head + self._sse("content_block_start", {"index": self._index, "content_block": block})

    # ---- the driver's interface ----

    def opening(self) -> bytes:
        """What opens the stream (``message_start``), made once: sent with the headers when the engine is
        slow to answer (the node's keep-alive ticker), so that the stream starts with it."""
        return self._message_start(True)

    def role(self, index: int = 0) -> bytes:
        """Nothing yet: ``message_start`` goes out with the first event's bytes (``_message_start``), once
        the engine's first answer told how much of the prompt its cache held, so that its usage has the
        split ``message_delta`` has (Anthropic's ``message_start`` carries it)."""
        self._due = not self._started
        return b""

    def cache(self, cached: int) -> None:
        self.cached_tokens = cached

    def _message_start(self, now: bool = False) -> bytes:
        """``message_start`` (the Message, empty) and a ``ping``, when owed (``now``: whether or not);
        nothing once made."""
        if self._started or not (self._due or now):
            return b""
        self._started = True
        self._due = False
        cached = min(self.cached_tokens, self.input_tokens)
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": messages_usage(self.input_tokens, 0, cached),
        }
        return self._sse("message_start", {"message": message}) + self._sse("ping", {})

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if not text:
            return b""
        head = b"" if self._open == "text" else self._start("text", {"type": "text", "text": ""})
        self._parts.append(text)
        return head + self._sse(
            "content_block_delta", {"index": self._index, "delta": {"type": "text_delta", "text": text}}
        )

    def reasoning(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if not text:
            return b""
        head = b""
        if self._open != "thinking":
            head = self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self._parts.append(text)
        if self.omit_thinking:
            return head
        return head + self._sse(
            "content_block_delta",
            {"index": self._index, "delta": {"type": "thinking_delta", "thinking": text}},
        )

    def tool_call(
        self, index: int, call: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        block = {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}}
        return self._start("tool_use", block)

    def tool_args(self, index: int, call: int, fragment: str) -> bytes:
        if self._open != "tool_use" or not fragment:
            return b""
        self._parts.append(fragment)
        return self._sse(
            "content_block_delta",
            {"index": self._index, "delta": {"type": "input_json_delta", "partial_json": fragment}},
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        """The choice ended: the open block's closing events (the stop reason goes out with ``end``)."""
        self.stop_reason, self.stop_sequence = stop_reason(reason, matched, self.stops)
        if self.context_bound and self.stop_reason == "max_tokens":
            self.stop_reason = "model_context_window_exceeded"
        return self._message_start() + self._close()

    def message(self, usage: dict[str, int]) -> dict[str, Any]:
        """The Message of the finished choice (its blocks: a non-streamed answer's)."""
        reason = (self.stop_reason or "end_turn", self.stop_sequence)
        return message_object(self.message_id, self.model, self.blocks, reason, usage)

    async def end(self, prompt: int, completion: int, cached: int) -> bytes:
        delta = {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": self.stop_sequence}
        usage = messages_usage(prompt, completion, cached)
        head = self._message_start()
        return head + sse("message_delta", {"delta": delta, "usage": usage}) + sse("message_stop", {})

    def failed(self, message: str, code: str) -> bytes:
        """An in-band failure: ``event: error`` in the Anthropic envelope (the stream ends after it)."""
        head = self._message_start()
        return head + sse("error", {"error": {"type": failure_kind(code), "message": message}})
