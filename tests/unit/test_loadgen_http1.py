"""The load generator's incremental HTTP/1.1 response parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.loadgen.http1 import ProtocolError, RequestTemplate, ResponseParser


class Collect:
    def __init__(self) -> None:
        self.parser = ResponseParser(self.on_body)
        self.pieces: list[bytes] = []

    def on_body(self, data: bytes) -> None:
        self.pieces.append(data)

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)


def chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return out + b"0\r\n" + trailer + b"\r\n"


def is_complete(c: Collect) -> bool:
    return c.parser.complete


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_content_length_response() -> None:
    c = Collect()
    rest = c.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello")
    assert rest == b""
    assert c.parser.complete
    assert c.parser.status == 200
    assert c.parser.keep_alive
    assert c.body == b"hello"


def test_chunked_response_with_extension_and_trailer() -> None:
    c = Collect()
    body = b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n"
    c.parser.feed(HEAD_CHUNKED + body)
    assert c.parser.complete
    assert c.body == b"abcde"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=0, max_size=6),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_chunked_split_anywhere_gives_the_same_body(chunks: list[bytes], cuts: list[int]) -> None:
    wire = HEAD_CHUNKED + chunked(*chunks)
    points = sorted({min(c, len(wire)) for c in cuts})
    c = Collect()
    prev = 0
    for p in [*points, len(wire)]:
        assert c.parser.feed(wire[prev:p]) == b""
        prev = p
    assert c.parser.complete
    assert c.body == b"".join(chunks)


def test_one_feed_delivers_body_in_one_call() -> None:
    c = Collect()
    c.parser.feed(HEAD_CHUNKED + chunked(b"a", b"b", b"c"))
    assert c.pieces == [b"abc"]


def test_bytes_after_the_response_are_returned() -> None:
    c = Collect()
    rest = c.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert c.parser.complete
    assert rest == b"EXTRA"


def test_connection_close_and_http10() -> None:
    c = Collect()
    c.parser.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert c.parser.complete and not c.parser.keep_alive
    c.parser.reset()
    c.parser.feed(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert c.parser.complete and not c.parser.keep_alive


def test_close_delimited_body() -> None:
    c = Collect()
    c.parser.feed(b"HTTP/1.1 200 OK\r\n\r\npart1")
    c.parser.feed(b"part2")
    assert not is_complete(c)
    c.parser.feed_eof()
    assert c.parser.complete
    assert not c.parser.keep_alive
    assert c.body == b"part1part2"


def test_truncated_response_raises_on_eof() -> None:
    c = Collect()
    c.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ProtocolError):
        c.parser.feed_eof()


def test_no_body_statuses_and_interim_responses() -> None:
    c = Collect()
    c.parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    assert c.parser.complete
    assert c.parser.status == 204


def test_error_status_is_parsed_not_raised() -> None:
    c = Collect()
    c.parser.feed(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
    assert c.parser.complete
    assert c.parser.status == 503
    assert c.parser.reason == "Service Unavailable"


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTX/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        HEAD_CHUNKED + b"zz\r\n",
        HEAD_CHUNKED + b"2\r\nabXY",
    ],
)
def test_malformed_responses_raise(wire: bytes) -> None:
    with pytest.raises(ProtocolError):
        Collect().parser.feed(wire)


def test_reset_reuses_the_parser() -> None:
    c = Collect()
    for i in range(3):
        c.parser.reset()
        c.parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + str(i).encode())
        assert c.parser.complete
    assert c.body == b"012"


def test_request_template_renders_length_and_body() -> None:
    t = RequestTemplate("127.0.0.1", 8080, "/v1/chat/completions", [("Authorization", "Bearer k")])
    req = t.render(b'{"a":1}')
    head, _, body = req.partition(b"\r\n\r\n")
    assert body == b'{"a":1}'
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert b"Host: 127.0.0.1:8080" in lines
    assert b"Content-Length: 7" in lines
    assert b"Authorization: Bearer k" in lines
