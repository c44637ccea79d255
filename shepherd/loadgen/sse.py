"""Server-sent events and OpenAI chat-completion responses, without I/O.

``SseParser`` turns body bytes (split anywhere) into the ``data`` payloads of complete events.
``StreamCheck`` follows one streamed chat completion: which events carry content (for TTFT and
inter-token latency), errors inside the stream, and whether it ended with ``data: [DONE]``.
``check_completion`` validates a non-streamed chat completion body.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"[DONE]"
MAX_LINE_BYTES = 4 * 1024 * 1024


class SseParser:
    """Incremental SSE parser (lines end in ``\\n`` or ``\\r\\n``; a blank line ends an event).

    Only ``data`` fields matter here; several ``data`` lines of one event are joined with ``\\n``
    as the spec says. Comments, ``event``, ``id`` and ``retry`` fields are ignored, and an event
    without data is not reported.
    """

    __slots__ = ("_data", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume body bytes; return the data payloads of the events they complete, in order."""
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if self._data or b"\r" in chunk:
            return self._feed_lines(chunk)
        # fast path: events are blank-line separated blocks, most of them one "data: " line
        blocks = chunk.split(b"\n\n")
        tail = blocks.pop()
        out: list[bytes] = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:])
            else:
                out.extend(self._feed_lines(block + b"\n\n"))
        if len(tail) > MAX_LINE_BYTES:
            raise ValueError("SSE event too long")
        self._tail = tail
        return out

    def _feed_lines(self, chunk: bytes) -> list[bytes]:
        lines = chunk.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > MAX_LINE_BYTES:
            raise ValueError("SSE line too long")
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                data.append(value)
            elif line == b"data":
                data.append(b"")
            # other fields and comments (":...") are ignored
        return out

    @property
    def pending(self) -> bool:
        """Bytes or data lines of an unfinished event are buffered."""
        return bool(self._tail) or bool(self._data)


class StreamCheck:
    """Follows one streamed chat completion, event by event.

    ``on_event(payload)`` returns True when the event carries generated output (content, reasoning
    or tool-call deltas). ``error`` is set to a short kind ("malformed", "stream_error") at the
    first problem; ``done`` once ``[DONE]`` arrives. The stream is well-formed when it ends with
    ``done``, no ``error`` and at least one content event.
    """

    __slots__ = ("content_events", "done", "error", "usage_completion_tokens")

    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None
        self.content_events = 0
        self.usage_completion_tokens: int | None = None

    def on_event(self, payload: bytes) -> bool:
        if self.error is not None:
            return False
        if self.done:
            self.error = "malformed"  # data after [DONE]
            return False
        if payload == DONE:
            self.done = True
            return False
        try:
            obj = orjson.loads(payload)
            choices = obj["choices"]
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
            self.error = "stream_error" if isinstance(obj_or_none(payload), dict) else "malformed"
            return False
        if "usage" in obj:
            usage = obj["usage"]
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.usage_completion_tokens = usage["completion_tokens"]
        if not choices:
            if isinstance(choices, list):
                return False  # e.g. the final usage chunk
            self.error = "malformed"
            return False
        try:
            delta = choices[0]["delta"]
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                self.content_events += 1
                return True
        except (KeyError, TypeError, IndexError, AttributeError):
            self.error = "malformed"
        return False

    def verdict(self) -> str | None:
        """None when the stream was well-formed, else the kind of error to count."""
        if self.error is not None:
            return self.error
        if not self.done:
            return "no_done"
        if self.content_events == 0:
            return "empty"
        return None


def obj_or_none(payload: bytes) -> Any:
    """The payload as JSON when it has an ``error`` member (an error event), else None."""
    try:
        obj: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if isinstance(obj, dict) and obj.get("error"):
        return obj
    return None


def check_completion(body: bytes) -> tuple[str | None, int | None]:
    """Validate a non-streamed chat completion: (error kind or None, usage completion tokens)."""
    try:
        obj: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "malformed", None
    if not isinstance(obj, dict):
        return "malformed", None
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return "malformed", None
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        return "malformed", None
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return "malformed", None
    tokens: int | None = None
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    return None, tokens
