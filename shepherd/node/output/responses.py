"""Responses API output: the Response object and its streamed events (docs/DESIGN.md §12).

Output items: a ``reasoning`` item (``rs_``, ``content: [{type: reasoning_text, text}]``, ``summary: []``;
``encrypted_content`` when asked for),
a ``message`` item (``msg_``, ``content: [{type: output_text, text, annotations: [], logprobs}]``) and one
``function_call`` item per call (``fc_``, ``call_id``, ``name``, ``arguments``), in generation order (text
after a call is a message item after it). A message item is there when the model produced output text:
an answer of reasoning only, of calls only or empty has none (as OpenAI's answers of reasoning or calls
only; an empty answer is the same case: ``output_text`` is then ""). An item's ``status`` is
``completed``, or ``incomplete`` for the item the answer was cut in (``max_output_tokens``, a failure).
``response_object`` assembles the Response (``object: "response"``) from the request's echo fields.

``ResponseEvents`` is the encoder the generation driver writes one choice's events to (it implements
``shepherd.node.output.chat.ChoiceEncoder`` and the driver's ``role`` / ``finish``); it keeps the items it
made. A non-streamed answer is built by the same encoder, ``quiet`` (no bytes), from the whole output
(``shepherd.node.output.chat.replay``): both answers have the same items. Its bytes are SSE events
``event: <type>\\ndata: <json>\\n\\n`` whose ``sequence_number`` grows by one, in OpenAI's order:
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
(``response.content_part.added``, deltas, ``*.done``, ``response.content_part.done``) or
(``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``; finally
``response.completed`` / ``response.incomplete`` / ``response.failed`` (an in-band failure is an ``error``
event first, after ``response.created`` and ``response.in_progress`` also when it came before them: the
openai SDK refuses a stream that does not begin with ``response.created``). No ``[DONE]`` line: OpenAI's
Responses stream has none.

Logprobs (``include: ["message.output_text.logprobs"]``): the chat logprobs of the output's tokens go to
the message text they come with; those of a step with no message text (reasoning, a call's markup, a
stop token, text held back) go to the open message when there is one (an empty ``output_text.delta``
carries them: the EOS token's, as the chat completions API keeps it), else wait for the next message
text, and are dropped when none comes. A non-streamed answer's whole output is one such step: its
message text, when it has some, gets them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

__all__ = [
    "ResponseEvents",
    "incomplete_reason",
    "response_object",
    "response_status",
    "response_usage",
    "sse_event",
    "text_logprobs",
]

_dumps = orjson.dumps


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), _dumps(payload))


def response_usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def incomplete_reason(finish_reason: str | None) -> str | None:
    """The ``incomplete_details.reason`` of a choice's finish reason (None: the response completed)."""
    if finish_reason == "length":
        return "max_output_tokens"
    if finish_reason == "content_filter":
        return "content_filter"
    return None


def response_status(finish_reason: str | None) -> str:
    return "incomplete" if incomplete_reason(finish_reason) else "completed"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _lp_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    token = str(e.get("token", ""))
    b = e.get("bytes")
    return {
        "token": token,
        # the token's own bytes (a tuple from ``logprobs.chat_logprobs``): a partial UTF-8 token's
        # string is escaped ("\\xe4\\xbd"), its bytes are not
        "bytes": list(b) if isinstance(b, list | tuple) else list(token.encode()),
        "logprob": e.get("logprob", 0.0),
    }


def text_logprobs(chat: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Chat logprobs (``{"content": [{token, logprob, bytes, top_logprobs}]}``) -> an ``output_text``
    part's (``[{token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}]``)."""
    out: list[dict[str, Any]] = []
    for e in (chat or {}).get("content") or ():
        entry = _lp_entry(e)
        entry["top_logprobs"] = [_lp_entry(t) for t in e.get("top_logprobs") or ()]
        out.append(entry)
    return out


def response_object(
    base: Mapping[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None = None,
    error: dict[str, Any] | None = None,
    completed_at: float | None = None,
) -> dict[str, Any]:
    """The Response: ``base`` holds the fields fixed at creation (``id``, ``object``, ``created_at``,
    ``model`` and the request's echo: instructions, tools, tool_choice, temperature, ...)."""
    reason = incomplete_reason(finish_reason) if status == "incomplete" else None
    r = dict(base)
    r["status"] = status
    r["output"] = output
    r["usage"] = usage
    r["error"] = error
    r["incomplete_details"] = {"reason": reason or "max_output_tokens"} if status == "incomplete" else None
    if status == "completed":
        r["completed_at"] = completed_at if completed_at is not None else int(time.time())
    return r


class ResponseEvents:
    """The SSE events of one streamed Response (one choice: ``index`` is ignored).

    Stateful: it tracks the open output item (a reasoning item, a message, a function call), its text
    so far and the next sequence number, and keeps every finished item for the final Response. The
    driver calls ``role`` once (the opening events), the content / reasoning / tool methods as the
    parsers produce text, ``finish`` when the choice ends; ``end`` / ``failed`` make the last events.
    ``quiet``: no bytes, the items only (a non-streamed answer's: ``shepherd.node.output.chat.replay``).
    ``seal``: a finished reasoning item gets ``encrypted_content``, its text sealed (in its
    ``response.output_item.done`` and the Response), for a ``store: false`` client to send back.
    """

    def __init__(
        self,
        base: Mapping[str, Any],
        new_id: Callable[[str], str],
        quiet: bool = False,
        seal: Callable[[str], str] | None = None,
    ) -> None:
        self.base = base
        self._new_id = new_id
        self.quiet = quiet
        # a reasoning item's text -> its ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``)
        self._seal = seal
        self._seq = 0
        self._opened = False  # response.created and response.in_progress are out
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._parts: list[str] = []  # its text (or arguments) so far
        self._lps: list[dict[str, Any]] = []  # its text's logprobs so far (a message's)
        self._waiting: list[dict[str, Any]] = []  # logprobs with no message text yet (module doc)
        self.finish_reason: str | None = None

    # ---- low level ----

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        self._seq += 1
        if self.quiet:
            return b""
        payload["type"] = kind
        payload["sequence_number"] = self._seq - 1
        return sse_event(kind, payload)

    @property
    def sequence_number(self) -> int:
        return self._seq

    def snapshot(self, status: str) -> dict[str, Any]:
        """The Response as it stands (``in_progress``: the items finished so far)."""
        return response_object(self.base, status=status, output=list(self.items), usage=None)

    def _index(self) -> int:
        return len(self.items)

    def _close(self, status: str = "completed") -> bytes:
        """The open item's closing events, the item ``status`` (``incomplete``: the answer was cut in it)."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(self._parts)
        lps = self._lps
        self._parts = []
        self._lps = []
        idx = self._index()
        iid = item["id"]
        kind = item["type"]
        out: list[bytes] = []
        if kind == "message":
            part = _text_part(text, lps)
            out.append(
                self.event(
                    "response.output_text.done",
                    {"item_id": iid, "output_index": idx, "content_index": 0, "text": text, "logprobs": lps},
                )
            )
            out.append(
                self.event(
                    "response.content_part.done",
                    {"item_id": iid, "output_index": idx, "content_index": 0, "part": part},
                )
            )
            item["content"] = [part]
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(
                self.event(
                    "response.reasoning_text.done",
                    {"item_id": iid, "output_index": idx, "content_index": 0, "text": text},
                )
            )
            out.append(
                self.event(
                    "response.content_part.done",
                    {"item_id": iid, "output_index": idx, "content_index": 0, "part": part},
                )
            )
            item["content"] = [part]
            if self._seal is not None:
                item["encrypted_content"] = self._seal(text)
        else:
            item["arguments"] = text
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    {"item_id": iid, "output_index": idx, "name": item["name"], "arguments": text},
                )
            )
        item["status"] = status
        out.append(self.event("response.output_item.done", {"output_index": idx, "item": item}))
        self.items.append(item)
        return b"".join(out)

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        head = self._close()
        self._open = item
        self._parts = []
        self._lps = []
        idx = self._index()
        out = [head, self.event("response.output_item.added", {"output_index": idx, "item": dict(item)})]
        if part is not None:
            out.append(
                self.event(
                    "response.content_part.added",
                    {"item_id": item["id"], "output_index": idx, "content_index": 0, "part": part},
                )
            )
        return b"".join(out)

    def _wait(self, logprobs: dict[str, Any] | None) -> None:
        """Logprobs that came with no message text: for the next message text."""
        if logprobs is not None:
            self._waiting.extend(text_logprobs(logprobs))

    # ---- the driver's interface ----

    def cache(self, cached: int) -> None:
        """(The Responses API's usage comes with ``response.completed`` only.)"""

    def opening(self) -> bytes:
        """What opens the stream (``role``'s), made once: sent with the headers when the engine is slow to
        answer (the node's keep-alive ticker), so that a long queue or prefill does not keep
        ``response.created`` from the client (OpenAI and vLLM send it before the first token)."""
        return self.role()

    def role(self, index: int = 0) -> bytes:
        """The opening events: ``response.created`` and ``response.in_progress``; nothing once made."""
        if self._opened:
            return b""
        self._opened = True
        if self.quiet:
            return b""
        snap = self.snapshot("in_progress")
        return self.event("response.created", {"response": snap}) + self.event(
            "response.in_progress", {"response": snap}
        )

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        item = self._open
        is_message = item is not None and item["type"] == "message"
        if not text and not is_message:
            self._wait(logprobs)
            return b""
        lps = text_logprobs(logprobs) if logprobs is not None else []
        if not text and not lps:
            return b""
        head = b""
        if item is None or not is_message:
            item = {
                "id": self._new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
            }
            item["content"] = []
            head = self._start(item, _text_part(""))
        if self._waiting:
            lps = self._waiting + lps
            self._waiting = []
        self._parts.append(text)
        self._lps.extend(lps)
        return head + self.event(
            "response.output_text.delta",
            {
                "item_id": item["id"],
                "output_index": self._index(),
                "content_index": 0,
                "delta": text,
                "logprobs": lps,
            },
        )

    def reasoning(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        self._wait(logprobs)
        if not text:
            return b""
        head = b""
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {"id": self._new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            item["content"] = []
            head = self._start(item, {"type": "reasoning_text", "text": ""})
        self._parts.append(text)
        return head + self.event(
            "response.reasoning_text.delta",
            {"item_id": item["id"], "output_index": self._index(), "content_index": 0, "delta": text},
        )

    def tool_call(
        self, index: int, call: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        self._wait(logprobs)
        item = {
            "id": self._new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        return self._start(item, None)

    def tool_args(self, index: int, call: int, fragment: str) -> bytes:
        item = self._open
        if item is None or item["type"] != "function_call" or not fragment:
            return b""
        self._parts.append(fragment)
        return self.event(
            "response.function_call_arguments.delta",
            {"item_id": item["id"], "output_index": self._index(), "delta": fragment},
        )

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes:
        """The choice ended: the open item's closing events (the terminal event comes with ``end``); the
        item is ``incomplete`` when the answer was cut (``max_output_tokens``)."""
        self.finish_reason = reason
        self._waiting = []
        return self._close(response_status(reason))

    def status(self) -> str:
        return response_status(self.finish_reason)

    def partial(self) -> list[dict[str, Any]]:
        """The output so far (an answer cut short): finished items and the open one, ``incomplete``."""
        out = list(self.items)
        item = self._open
        if item is not None:
            text = "".join(self._parts)
            item = dict(item, status="incomplete")
            if item["type"] == "message":
                item["content"] = [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": list(self._lps)}
                ]
            elif item["type"] == "reasoning":
                item["content"] = [{"type": "reasoning_text", "text": text}]
                if self._seal is not None:
                    item["encrypted_content"] = self._seal(text)
            else:
                item["arguments"] = text
            out.append(item)
        return out

    def final(self, usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
        """The finished Response (``status`` by the finish reason unless given)."""
        st = status or self.status()
        return response_object(
            self.base, status=st, output=list(self.items), usage=usage, finish_reason=self.finish_reason
        )

    def terminal(self, response: dict[str, Any]) -> bytes:
        """``response.completed`` / ``response.incomplete`` / ``response.failed`` with the Response."""
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        return self.event(kind, {"response": response})

    def failure_usage(self) -> dict[str, Any] | None:
        """The usage a failed Response reports (the items are closed by then); None: not known here."""
        return None

    def failed(self, message: str, code: str, usage: dict[str, Any] | None = None) -> bytes:
        """An in-band failure: the opening events if they are not out yet (a failure before the first
        token), the open item's closing events (``incomplete``: cut by the failure), an ``error`` event
        and ``response.failed`` (the Response with ``status: failed``, its ``error`` and the usage)."""
        head = b"" if self._opened else self.role(0)
        head += self._close("incomplete")
        if usage is None:
            usage = self.failure_usage()
        err = self.event("error", {"code": code, "message": message, "param": None})
        resp = response_object(
            self.base,
            status="failed",
            output=list(self.items),
            usage=usage,
            error={"code": _error_code(code), "message": message},
        )
        return head + err + self.event("response.failed", {"response": resp})


def _error_code(code: str) -> str:
    # ResponseError.code is an enum in OpenAI's schema; "server_error" is the member for ours
    return "server_error" if code not in ("rate_limit_exceeded", "invalid_prompt") else code
