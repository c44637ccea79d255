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


class ChatChunks:
    """``chat.completion.chunk`` events for one response; the fixed head is encoded once."""

    __slots__ = ("_head",)

    def __init__(self, rid: str, created: int, model: str) -> None:
        head = _dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'

    def role(self, index: int) -> bytes:
        return (
            b'%s%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            % (
                self._head,
                index,
            )
        )

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        lp = b"null" if logprobs is None else _dumps(logprobs)
        return b'%s%d,"delta":{"content":%s},"logprobs":%s,"finish_reason":null}]}\n\n' % (
            self._head,
            index,
            _dumps(text),
            lp,
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        return b'%s%d,"delta":{},"logprobs":null,"finish_reason":%s,"matched_stop":%s}]}\n\n' % (
            self._head,
            index,
            _dumps(reason),
            _dumps(matched),
        )

    def usage(self, u: dict[str, Any]) -> bytes:
        return self._head[: -len(b'[{"index":')] + b'[],"usage":' + _dumps(u) + b"}\n\n"


class CompletionChunks:
    """``text_completion`` stream events (the legacy completions API)."""

    __slots__ = ("_head",)

    def __init__(self, rid: str, created: int, model: str) -> None:
        head = _dumps({"id": rid, "object": "text_completion", "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        lp = b"null" if logprobs is None else _dumps(logprobs)
        return b'%s%d,"text":%s,"logprobs":%s,"finish_reason":null}]}\n\n' % (
            self._head,
            index,
            _dumps(text),
            lp,
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        return b'%s%d,"text":"","logprobs":null,"finish_reason":%s,"matched_stop":%s}]}\n\n' % (
            self._head,
            index,
            _dumps(reason),
            _dumps(matched),
        )

    def usage(self, u: dict[str, Any]) -> bytes:
        return self._head[: -len(b'[{"index":')] + b'[],"usage":' + _dumps(u) + b"}\n\n"


def error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    return (
        b"data: "
        + _dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
        + b"\n\n"
    )
