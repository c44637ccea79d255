"""OpenAI response bytes: SSE chunks from pre-built byte templates, final JSON bodies, usage blocks."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
_dumps = orjson.dumps


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class _Chunks:
    """Stream events of one response; the fixed head is encoded once. Subclasses name the object and
    the per-choice delta field (``"delta":{"content":...}`` for chat, ``"text":...`` for completions)."""

    __slots__ = ("_head",)
    OBJECT = ""
    CONTENT = b""  # what precedes the JSON text of a content event
    CONTENT_END = b""  # what follows it
    EMPTY = b""  # the delta of a finish event

    def __init__(self, rid: str, created: int, model: str) -> None:
        head = _dumps({"id": rid, "object": self.OBJECT, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        lp = b"null" if logprobs is None else _dumps(logprobs)
        return b'%s%d,%s%s%s,"logprobs":%s,"finish_reason":null}]}\n\n' % (
            self._head,
            index,
            self.CONTENT,
            _dumps(text),
            self.CONTENT_END,
            lp,
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        return b'%s%d,%s,"logprobs":null,"finish_reason":%s,"matched_stop":%s}]}\n\n' % (
            self._head,
            index,
            self.EMPTY,
            _dumps(reason),
            _dumps(matched),
        )

    def usage(self, u: dict[str, Any]) -> bytes:
        return self._head[: -len(b'[{"index":')] + b'[],"usage":' + _dumps(u) + b"}\n\n"


class ChatChunks(_Chunks):
    """``chat.completion.chunk`` events."""

    __slots__ = ()
    OBJECT = "chat.completion.chunk"
    CONTENT = b'"delta":{"content":'
    CONTENT_END = b"}"
    EMPTY = b'"delta":{}'

    def role(self, index: int) -> bytes:
        return (
            b'%s%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            % (
                self._head,
                index,
            )
        )

    def _delta(self, index: int, delta: bytes, logprobs: dict[str, Any] | None) -> bytes:
        lp = b"null" if logprobs is None else _dumps(logprobs)
        return b'%s%d,"delta":%s,"logprobs":%s,"finish_reason":null}]}\n\n' % (self._head, index, delta, lp)

    def reasoning(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        """A ``delta.reasoning_content`` event."""
        return self._delta(index, b'{"reasoning_content":%s}' % _dumps(text), logprobs)

    def tool_call(
        self, index: int, call: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        """The first delta of tool call ``call``: its id, type and name (arguments follow)."""
        return self._delta(
            index,
            b'{"tool_calls":[{"index":%d,"id":%s,"type":"function","function":{"name":%s,"arguments":""}}]}'
            % (call, _dumps(call_id), _dumps(name)),
            logprobs,
        )

    def tool_args(self, index: int, call: int, fragment: str) -> bytes:
        """A fragment of tool call ``call``'s arguments (the fragments concatenate to its JSON)."""
        return self._delta(
            index,
            b'{"tool_calls":[{"index":%d,"function":{"arguments":%s}}]}' % (call, _dumps(fragment)),
            None,
        )


class CompletionChunks(_Chunks):
    """``text_completion`` stream events (the legacy completions API)."""

    __slots__ = ()
    OBJECT = "text_completion"
    CONTENT = b'"text":'
    EMPTY = b'"text":""'


def error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    return (
        b"data: "
        + _dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
        + b"\n\n"
    )
