"""SSE parsing and chat-completion validation in the load generator."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.loadgen.sse import SseParser, StreamCheck, check_completion


def chunk(content: str) -> bytes:
    return orjson.dumps(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    )


STREAM = (
    b"data: " + chunk("Hel") + b"\n\n"
    b": keep-alive comment\n\n"
    b"data: " + chunk("lo") + b"\n\n"
    b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def events_of(parts: list[bytes]) -> list[bytes]:
    p = SseParser()
    out: list[bytes] = []
    for part in parts:
        out.extend(p.feed(part))
    assert not p.pending
    return out


def test_whole_stream() -> None:
    events = events_of([STREAM])
    assert events[0] == chunk("Hel")
    assert events[-1] == b"[DONE]"
    assert len(events) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=10), st.booleans())
def test_split_anywhere_gives_the_same_events(cuts: list[int], crlf: bool) -> None:
    wire = STREAM.replace(b"\n", b"\r\n") if crlf else STREAM
    points = sorted({min(c, len(wire)) for c in cuts})
    parts = []
    prev = 0
    for p in [*points, len(wire)]:
        parts.append(wire[prev:p])
        prev = p
    assert events_of(parts) == events_of([STREAM])


def test_every_single_byte_split() -> None:
    assert events_of([STREAM[i : i + 1] for i in range(len(STREAM))]) == events_of([STREAM])


def test_multiline_data_and_other_fields() -> None:
    wire = b"event: message\nid: 7\ndata: line1\ndata:line2\nretry: 10\n\ndata\n\n"
    assert events_of([wire]) == [b"line1\nline2", b""]


def test_event_without_data_is_not_reported() -> None:
    assert events_of([b"event: ping\n\n:comment\n\n"]) == []


def test_unfinished_event_is_pending() -> None:
    p = SseParser()
    assert p.feed(b"data: [DONE]\n") == []
    assert p.pending
    assert p.feed(b"\n") == [b"[DONE]"]


def run_check(events: list[bytes]) -> StreamCheck:
    c = StreamCheck()
    for e in events:
        c.on_event(e)
    return c


def test_well_formed_stream() -> None:
    c = run_check(events_of([STREAM]))
    assert c.verdict() is None
    assert c.content_events == 2
    assert c.usage_completion_tokens == 2


def test_content_events_flagged() -> None:
    c = StreamCheck()
    assert c.on_event(chunk("x")) is True
    assert c.on_event(chunk("")) is False
    assert c.on_event(orjson.dumps({"choices": [{"delta": {"reasoning_content": "hm"}}]})) is True
    assert c.on_event(orjson.dumps({"choices": [{"delta": {"role": "assistant"}}]})) is False


def test_stream_without_done() -> None:
    assert run_check([chunk("a")]).verdict() == "no_done"


def test_stream_without_content() -> None:
    assert run_check([b"[DONE]"]).verdict() == "empty"


def test_error_event_in_stream() -> None:
    c = run_check([chunk("a"), b'{"error": {"message": "engine died"}}', b"[DONE]"])
    assert c.verdict() == "stream_error"


def test_malformed_events() -> None:
    assert run_check([b"{not json", b"[DONE]"]).verdict() == "malformed"
    assert run_check([b"[1, 2]", b"[DONE]"]).verdict() == "malformed"
    assert run_check([b'{"choices": [{"nodelta": 1}]}', b"[DONE]"]).verdict() == "malformed"
    assert run_check([chunk("a"), b"[DONE]", chunk("late")]).verdict() == "malformed"


def test_check_completion() -> None:
    good = orjson.dumps(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"completion_tokens": 3},
        }
    )
    assert check_completion(good) == (None, 3)
    assert check_completion(b"nope")[0] == "malformed"
    assert check_completion(b'{"choices": []}')[0] == "malformed"
    assert check_completion(b'{"choices": [{"message": {"content": 5}}]}')[0] == "malformed"
    assert check_completion(b'{"choices": [{"message": {"content": null, "tool_calls": []}}]}')[0] is None
