"""A paced engine's read in C (``_h2fast.grpc_data``, at the top of ``H2Connection.receive``) against
``receive``'s Python frame loop: the same messages, statuses, wake-ups, receive-window credit, frames
written and counters for any mix of frames (whole messages, split, several in a frame, padded, another
stream's, compressed, reserved stream-id bit, PING) and any read boundaries, frame-aligned ones (a paced
engine's reads, which the C read takes) among them, with a window small enough to send WINDOW_UPDATEs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.engines import h2_conn
from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.h2_stream import GrpcStream, grpc_message
from tests.unit.test_engine_h2_frames import Harness, _mixed_response

pytestmark = pytest.mark.skipif(h2_conn._grpc_data is None, reason="the C extension is not built")

_REAL = h2_conn._grpc_data


def _frames(data: bytes) -> list[bytes]:
    out = []
    off = 0
    while off < len(data):  # bounded by the data
        n = 9 + int.from_bytes(data[off : off + 3], "big")
        out.append(data[off : off + n])
        off += n
    return out


def _run(data: bytes, reads: list[int], aligned: bool, window: int, fast: bool) -> tuple[Any, ...]:
    taken = [0]

    def counting(conn: object, chunk: bytes, max_frame: int) -> bool:
        assert _REAL is not None
        r = _REAL(conn, chunk, max_frame)
        taken[0] += r
        return r

    h2_conn._grpc_data = counting if fast else None
    lp = asyncio.new_event_loop()
    try:
        h = Harness(local_window=window)
        h.settings()
        s, o = GrpcStream(lp), GrpcStream(lp)
        for st_ in (s, o):
            h.conn.open_stream(st_, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
        h.out.clear()
        wakes = [0]
        s.listener = lambda: wakes.__setitem__(0, wakes[0] + 1)
        payload = data.replace(b"\x00\x00\x00\x01", s.stream_id.to_bytes(4, "big"))
        if aligned:  # a read per frame, sometimes two frames
            frames = _frames(h.server.ok_headers(o.stream_id) + payload)
            chunks = []
            i = 0
            while i < len(frames):  # bounded by the frames
                k = 1 + (reads[i % len(reads)] % 2)
                chunks.append(b"".join(frames[i : i + k]))
                i += k
        else:
            whole = h.server.ok_headers(o.stream_id) + payload
            chunks = []
            off = i = 0
            while off < len(whole):  # bounded by the data
                n = reads[i % len(reads)]
                chunks.append(whole[off : off + n])
                off += n
                i += 1
        for c in chunks:
            h.conn.receive(c)
        return (
            list(s.messages),
            list(o.messages),
            s.done,
            s.code,
            wakes[0],
            b"".join(h.out),
            h.conn.conn_recv_unacked,
            s.recv_unacked,
            o.recv_unacked,
            h.conn.failed,
        ), taken[0]
    finally:
        h2_conn._grpc_data = _REAL
        lp.close()


_kinds = st.sampled_from(
    ["whole", "whole", "whole", "whole", "split", "multi", "padded", "other", "compressed"]
)


@given(
    st.lists(_kinds, max_size=16),
    st.lists(st.integers(0, 120), min_size=1, max_size=4),
    st.lists(st.integers(1, 300), min_size=1, max_size=6),
    st.sampled_from([h2.LOCAL_WINDOW, 600, 200]),
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_the_c_read_leaves_what_the_python_frame_loop_leaves(
    kinds: list[str], sizes: list[int], reads: list[int], window: int, aligned: bool
) -> None:
    from tests.unit.test_engine_h2_frames import Server

    data = _mixed_response(Server(), 1, 3, kinds, sizes)
    (python, _), (c, taken) = (
        _run(data, reads, aligned, window, False),
        _run(data, reads, aligned, window, True),
    )
    assert c == python
    if aligned and window == h2.LOCAL_WINDOW and kinds.count("whole") >= 3 and set(kinds) == {"whole"}:
        assert taken > 0  # a paced engine's whole-message frames went through the C read


def test_a_paced_engines_reads_go_through_the_c_read() -> None:
    from tests.unit.test_engine_h2_frames import Server

    data = _mixed_response(Server(), 1, 3, ["whole"] * 10, [7])
    (python, _), (c, taken) = (
        _run(data, [2], True, h2.LOCAL_WINDOW, False),
        _run(data, [2], True, h2.LOCAL_WINDOW, True),
    )
    assert c == python and len(c[0]) == 10 and c[2]
    assert taken == 10  # a read a frame: each DATA frame's read went through the C read


def open_grpc_stream(lp: asyncio.AbstractEventLoop) -> tuple[Harness, GrpcStream]:
    """A connection past its SETTINGS with one gRPC call open and its response headers in."""
    h = Harness()
    h.settings()
    s = GrpcStream(lp)
    h.conn.open_stream(s, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
    h.conn.receive(h.server.ok_headers(s.stream_id))
    return h, s


def test_the_c_read_refuses_what_it_does_not_take() -> None:
    assert _REAL is not None
    lp = asyncio.new_event_loop()
    try:
        h, s = open_grpc_stream(lp)
        sid = s.stream_id
        whole = h2.frame(h2.DATA, 0, sid, grpc_message(b"m"))
        before = (list(s.messages), h.conn.conn_recv_unacked, s.recv_unacked)
        for data in (
            b"",
            whole[:-1],  # a partial frame
            whole + whole[:5],  # bytes after the frames
            h2.frame(h2.DATA, h2.FLAG_END_STREAM, sid, grpc_message(b"m")),  # flags
            h2.frame(h2.DATA, 0, sid + 2, grpc_message(b"m")),  # no such stream
            h2.frame(h2.DATA, 0, 0, grpc_message(b"m")),  # stream 0
            whole[:5] + bytes([whole[5] | 0x80]) + whole[6:],  # the reserved bit
            h2.frame(h2.DATA, 0, sid, b"\x01" + grpc_message(b"m")[1:]),  # compressed
            h2.frame(h2.DATA, 0, sid, grpc_message(b"m") + b"x"),  # more than the message
            h2.frame(h2.PING, 0, 0, b"\0" * 8),
            b"\x00\x40\x01" + whole[3:],  # above the frame size
        ):
            assert _REAL(h.conn, data, h2.DEFAULT_MAX_FRAME) is False
            assert (list(s.messages), h.conn.conn_recv_unacked, s.recv_unacked) == before
        assert _REAL(h.conn, "not bytes", h2.DEFAULT_MAX_FRAME) is False  # type: ignore[arg-type]
        with pytest.raises(AttributeError):  # not a connection
            _REAL(object(), whole, h2.DEFAULT_MAX_FRAME)
        assert _REAL(h.conn, whole, h2.DEFAULT_MAX_FRAME) is True
        assert list(s.messages) == [b"m"]
        h.conn._rbuf = b"x"  # a partial frame held: receive's
        assert _REAL(h.conn, whole, h2.DEFAULT_MAX_FRAME) is False
    finally:
        lp.close()


def test_counts_a_read_would_carry_past_the_int64_range_are_the_python_loops() -> None:
    """Receive-window counts that the read's payload added to would overflow an int64: the C read
    leaves the read to the frame loop (whose WINDOW_UPDATE is due) and changes nothing."""
    assert _REAL is not None
    lp = asyncio.new_event_loop()
    try:
        h, s = open_grpc_stream(lp)
        whole = h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"m"))  # a payload of 6 bytes
        top = 2**63 - 1
        h.conn._credit_threshold = top
        for conn_unacked, stream_unacked in ((top, 0), (top - 3, 0), (0, top), (0, top - 3)):
            h.conn.conn_recv_unacked, s.recv_unacked = conn_unacked, stream_unacked
            assert _REAL(h.conn, whole, h2.DEFAULT_MAX_FRAME) is False
            assert (h.conn.conn_recv_unacked, s.recv_unacked, list(s.messages)) == (
                conn_unacked,
                stream_unacked,
                [],
            )
        h.conn.conn_recv_unacked = s.recv_unacked = top - 7  # the sums stay below the threshold
        assert _REAL(h.conn, whole, h2.DEFAULT_MAX_FRAME) is True
        assert (h.conn.conn_recv_unacked, s.recv_unacked, list(s.messages)) == (top - 1, top - 1, [b"m"])
    finally:
        lp.close()
