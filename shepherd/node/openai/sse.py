"""OpenAI response bytes: SSE chunks from pre-built byte templates, final JSON bodies, usage blocks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar

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


def vllm_stop_reason(matched: str | int | None, stop_ids: Collection[int]) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice that stopped on ``matched`` (SGLang's ``matched_stop``): the stop
    string, or the stop token id when the request named it; null for EOS and any other end."""
    if isinstance(matched, str) or (matched is not None and matched in stop_ids):
        return matched
    return None


def with_usage(chunk: bytes, prompt: int, completion: int) -> bytes:
    """``chunk`` (one ``data: {...}`` chunk event) carrying the usage so far (vLLM's
    ``continuous_usage_stats``: prompt, completion and total tokens, on every chunk)."""
    return b'%s,"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
        chunk[:-3],
        prompt,
        completion,
        prompt + completion,
    )


def with_choice_ids(chunk: bytes, ids: Sequence[int], prompt_ids: Sequence[int] | None = None) -> bytes:
    """A choice chunk (``...}]}`` and the event's end) with vLLM's ``return_token_ids`` fields in its
    choice: ``token_ids`` (the ids this chunk's text came from) and, on a completion choice's first chunk,
    ``prompt_token_ids``."""
    extra = b',"token_ids":' + orjson.dumps(list(ids))
    if prompt_ids is not None:
        extra += b',"prompt_token_ids":' + orjson.dumps(list(prompt_ids))
    return chunk[:-5] + extra + b"}]}\n\n"


def with_prompt_ids(chunk: bytes, prompt_ids: Sequence[int]) -> bytes:
    """A chat chunk with vLLM's top-level ``prompt_token_ids`` (``return_token_ids``: on the role chunks)."""
    return b'%s,"prompt_token_ids":%s}\n\n' % (chunk[:-3], orjson.dumps(list(prompt_ids)))


class _Chunks:
    """Stream events of one response; the fixed head is encoded once. Subclasses name the object and
    the per-choice delta field (``"delta":{"content":...}`` for chat, ``"text":...`` for completions).

    Choice 0 without logprobs (the usual stream) takes prefixes built with the head: one concatenation
    per event instead of a formatting pass (the same bytes)."""

    __slots__ = ("_content0", "_head", "content0", "stop_ids")
    OBJECT = ""
    CONTENT = b""  # what precedes the JSON text of a content event
    CONTENT_END = b""  # what follows it
    EMPTY = b""  # the delta of a finish event
    _OBJECT_CREATED = b""  # the JSON between the id and the created time (set per subclass)
    _CONTENT_TAIL = b""  # what follows a content event's text without logprobs
    _FINISH_HEAD = b""  # what follows a finish event's index
    _FINISH_TAILS: ClassVar[dict[str, bytes]] = {}  # reason -> a finish event's rest, no matched stop
    # a finish event names what stopped the choice twice: SGLang's ``matched_stop`` (a stop string, a stop
    # token id or EOS) and vLLM's ``stop_reason`` (a stop string or one of the request's stop token ids;
    # null for EOS); ``stop_ids``: the request's stop token ids

    def __init_subclass__(cls) -> None:
        cls._OBJECT_CREATED = b',"object":' + _dumps(cls.OBJECT) + b',"created":'
        cls._CONTENT_TAIL = cls.CONTENT_END + b',"logprobs":null,"finish_reason":null}]}\n\n'
        cls._FINISH_HEAD = b"," + cls.EMPTY + b',"logprobs":null,"finish_reason":'
        cls._FINISH_TAILS = {}

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.stop_ids: frozenset[int] | tuple[int, ...] = ()
        # the JSON object {"id","object","created","model"} without its closing brace, as orjson writes it
        self._head = b"".join(
            (
                b'data: {"id":',
                _dumps(rid),
                self._OBJECT_CREATED,
                _dumps(created),
                b',"model":',
                _dumps(model),
                b',"choices":[{"index":',
            )
        )
        self._content0 = self._head + b"0," + self.CONTENT
        # ``content(0, text)`` is content0[0] + the JSON string of text + content0[1] (a caller's inline path)
        self.content0 = (self._content0, self._CONTENT_TAIL)

    def index_of(self, chunk: bytes) -> int:
        """The choice index of one of this response's choice chunks (the digits right after the head)."""
        start = len(self._head)
        return int(chunk[start : chunk.index(b",", start)])

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if logprobs is None:
            if index == 0:
                return self._content0 + _dumps(text) + self._CONTENT_TAIL
            lp = b"null"
        else:
            lp = _dumps(logprobs)
        return b'%s%d,%s%s%s,"logprobs":%s,"finish_reason":null}]}\n\n' % (
            self._head,
            index,
            self.CONTENT,
            _dumps(text),
            self.CONTENT_END,
            lp,
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        if matched is None:
            tail = self._FINISH_TAILS.get(reason)
            if tail is None:
                tail = _dumps(reason) + b',"matched_stop":null,"stop_reason":null}]}\n\n'
                if len(self._FINISH_TAILS) < 32:  # a handful of reasons
                    self._FINISH_TAILS[reason] = tail
            return b"%s%d%s%s" % (self._head, index, self._FINISH_HEAD, tail)
        return b'%s%d,%s,"logprobs":null,"finish_reason":%s,"matched_stop":%s,"stop_reason":%s}]}\n\n' % (
            self._head,
            index,
            self.EMPTY,
            _dumps(reason),
            _dumps(matched),
            _dumps(vllm_stop_reason(matched, self.stop_ids)),
        )

    def usage(self, u: dict[str, Any]) -> bytes:
        return self._head[: -len(b'[{"index":')] + b'[],"usage":' + _dumps(u) + b"}\n\n"

    def usage_of(self, prompt: int, completion: int, cached: int) -> bytes:
        """``usage(usage(prompt, completion, cached))`` for int counts, without the dicts."""
        return b'%s[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,%s%d}}}\n\n' % (
            self._head[: -len(b'[{"index":')],
            prompt,
            completion,
            prompt + completion,
            b'"prompt_tokens_details":{"cached_tokens":',
            cached,
        )


# the reasoning delta per ``--reasoning-field``: vLLM now answers ``reasoning`` (it dropped
# ``reasoning_content``, which DeepSeek's API and older clients read); "both" serves either reader
_REASONING_DELTAS = {
    "both": b'{"reasoning":%s,"reasoning_content":%s}',
    "reasoning": b'{"reasoning":%s}',
    "reasoning_content": b'{"reasoning_content":%s}',
}


class ChatChunks(_Chunks):
    """``chat.completion.chunk`` events. ``reasoning_field``: which delta field(s) carry reasoning;
    ``legacy_functions``: tool calls as the legacy ``delta.function_call`` (a request that sent
    ``functions``); ``calls_finish``: the finish reason of a choice that called tools (``tool_calls``,
    ``function_call`` for legacy ``functions``, ``stop`` when ``tool_choice`` named the function)."""

    __slots__ = ("_calls_finish", "_legacy", "_reasoning_both", "_reasoning_delta")
    OBJECT = "chat.completion.chunk"
    CONTENT = b'"delta":{"content":'
    CONTENT_END = b"}"
    EMPTY = b'"delta":{}'

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        reasoning_field: str = "both",
        legacy_functions: bool = False,
        calls_finish: str | None = None,
    ) -> None:
        super().__init__(rid, created, model)
        self._reasoning_delta = _REASONING_DELTAS[reasoning_field]
        self._reasoning_both = reasoning_field == "both"
        self._legacy = legacy_functions
        self._calls_finish = calls_finish or ("function_call" if legacy_functions else "tool_calls")

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        if reason == "tool_calls":
            reason = self._calls_finish
        return super().finish(index, reason, matched)

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
        """A ``delta.reasoning`` / ``delta.reasoning_content`` event (per ``reasoning_field``)."""
        t = _dumps(text)
        delta = self._reasoning_delta % ((t, t) if self._reasoning_both else (t,))
        return self._delta(index, delta, logprobs)

    def tool_call(
        self, index: int, call: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        """The first delta of tool call ``call``: its id, type and name (arguments follow)."""
        if self._legacy:
            return self._delta(
                index, b'{"function_call":{"name":%s,"arguments":""}}' % _dumps(name), logprobs
            )
        return self._delta(
            index,
            b'{"tool_calls":[{"index":%d,"id":%s,"type":"function","function":{"name":%s,"arguments":""}}]}'
            % (call, _dumps(call_id), _dumps(name)),
            logprobs,
        )

    def tool_args(self, index: int, call: int, fragment: str) -> bytes:
        """A fragment of tool call ``call``'s arguments (the fragments concatenate to its JSON)."""
        if self._legacy:
            return self._delta(index, b'{"function_call":{"arguments":%s}}' % _dumps(fragment), None)
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
