"""A paced engine's reads in C (``_h2fast.grpc_data``, in ``H2Connection.receive``'s frame loop) against
the Python frame loop alone: the same messages, statuses, wake-ups (and their order over two streams),
receive-window credit, frames written and counters for any mix of frames (whole messages, split, several
in a frame, padded, another stream's, compressed, reserved stream-id bit, PING) and any read boundaries,
frame-aligned ones (a paced engine's reads, which the C read takes) among them, with a window small enough
to send WINDOW_UPDATEs, and stream callbacks that, halfway through a read, cancel the other stream or their
own, fail the connection, feed the connection more bytes (``receive`` re-entered: another stream's message,
a PING, a partial frame) or raise (a protocol error, which fails the connection, or another exception, which
leaves ``receive``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
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

# what a listener does at its wake-up act[0] (see _run)
ACTS = ["cancel", "fail", "close", "reenter", "protocol", "raise"]


def _frames(data: bytes) -> list[bytes]:
    out = []
    off = 0
    while off < len(data):  # bounded by the data
        n = 9 + int.from_bytes(data[off : off + 3], "big")
        out.append(data[off : off + n])
        off += n
    return out


def _run(
    data: bytes, reads: list[int], aligned: bool, window: int, fast: bool, act: tuple[int, str] = (-1, "")
) -> tuple[Any, ...]:
    """``data`` (frames of streams 1 and 3) read in pieces by a connection with two gRPC calls open, each
    with a listener; at wake-up ``act[0]`` the listener cancels the other call (``act[1] == "cancel"``) or
    its own (``"close"``), fails the connection (``"fail"``), feeds the connection another stream's message,
    a PING and the start of a frame of its own (``"reenter"``), raises a protocol error (``"protocol"``) or
    another exception (``"raise"``; the exceptions out of ``receive`` are part of the outcome)."""
    taken = [0]

    def counting(conn: object, chunk: bytes, off: int, max_frame: int) -> int:
        assert _REAL is not None
        r = _REAL(conn, chunk, off, max_frame)
        taken[0] += r > off
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
        wakes: list[tuple[str, int]] = []

        def listener(name: str, me: GrpcStream, other: GrpcStream) -> Callable[[], None]:
            def wake() -> None:
                wakes.append((name, len(me.messages)))
                if len(wakes) - 1 == act[0]:
                    if act[1] == "cancel":
                        other.cancel()
                    elif act[1] == "fail":
                        h.conn.fail("failed by a listener")
                    elif act[1] == "close":
                        me.cancel()
                    elif act[1] == "reenter":
                        mine = h2.frame(h2.DATA, 0, me.stream_id, grpc_message(b"mine"))
                        h.conn.receive(
                            h2.frame(h2.DATA, 0, other.stream_id, grpc_message(b"re-entered"))
                            + h2.frame(h2.PING, 0, 0, b"\1" * 8)
                            + mine[:7]
                        )
                    elif act[1] == "protocol":
                        raise h2.H2ProtocolError(h2.PROTOCOL_ERROR, "raised by a listener")
                    elif act[1] == "raise":
                        raise RuntimeError("raised by a listener")

            return wake

        s.listener, o.listener = listener("s", s, o), listener("o", o, s)
        payload = data.replace(b"\x00\x00\x00\x01", s.stream_id.to_bytes(4, "big"))
        if aligned:  # a read per frame, sometimes two or three frames
            frames = _frames(h.server.ok_headers(o.stream_id) + payload)
            chunks = []
            i = 0
            while i < len(frames):  # bounded by the frames
                k = 1 + (reads[i % len(reads)] % 3)
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
        errors = []
        for c in chunks:
            try:
                h.conn.receive(c)
            except (RuntimeError, h2.H2ProtocolError) as e:  # a listener's (out of a wake-up in fail, too)
                errors.append(repr(e))
        return (
            list(s.messages),
            list(o.messages),
            s.done,
            s.code,
            o.done,
            o.code,
            wakes,
            b"".join(h.out),
            h.conn.conn_recv_unacked,
            s.recv_unacked,
            o.recv_unacked,
            h.conn.failed,
            errors,
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
    st.tuples(st.integers(-1, 8), st.sampled_from(ACTS)),
)
@settings(max_examples=300, deadline=None)
def test_the_c_read_leaves_what_the_python_frame_loop_leaves(
    kinds: list[str], sizes: list[int], reads: list[int], window: int, aligned: bool, act: tuple[int, str]
) -> None:
    from tests.unit.test_engine_h2_frames import Server

    data = _mixed_response(Server(), 1, 3, kinds, sizes)
    (python, _), (c, taken) = (
        _run(data, reads, aligned, window, False, act),
        _run(data, reads, aligned, window, True, act),
    )
    assert c == python
    if aligned and window == h2.LOCAL_WINDOW and kinds.count("whole") >= 3 and set(kinds) == {"whole"}:
        assert taken > 0  # a paced engine's whole-message frames went through the C read


def test_a_paced_engines_reads_go_through_the_c_read() -> None:
    from tests.unit.test_engine_h2_frames import Server

    data = _mixed_response(Server(), 1, 3, ["whole"] * 10, [7])
    (python, _), (c, taken) = (
        _run(data, [0], True, h2.LOCAL_WINDOW, False),
        _run(data, [0], True, h2.LOCAL_WINDOW, True),
    )
    assert c == python and len(c[0]) == 10 and c[2]
    assert taken == 10  # a read a frame: each DATA frame's read went through the C read


def test_a_read_of_many_streams_tokens_is_taken_run_by_run_in_order() -> None:
    """A batching engine's read: a token of each of two streams, twice, then a HEADERS frame and more
    tokens: the C read takes the four runs (a wake-up each, in the frames' order), the loop the HEADERS
    frame, the C read the rest."""
    from tests.unit.test_engine_h2_frames import Server

    server = Server()
    tok = [h2.frame(h2.DATA, 0, sid, grpc_message(bytes([i]))) for i, sid in enumerate((1, 3, 1, 3))]
    data = b"".join(tok) + server.trailers(3) + b"".join(tok[:1] * 2)
    (python, _), (c, taken) = (
        _run(data, [1 << 20], False, h2.LOCAL_WINDOW, False),
        _run(data, [1 << 20], False, h2.LOCAL_WINDOW, True),
    )
    assert c == python and taken == 2  # (the read holds o's response headers first)
    assert c[6] == [("s", 1), ("o", 1), ("s", 2), ("o", 2), ("o", 2), ("s", 4)]  # ("o", 2): its trailers
    assert c[4] and not c[2] and c[0] == [b"\x00", b"\x02", b"\x00", b"\x00"]


def open_grpc_stream(lp: asyncio.AbstractEventLoop) -> tuple[Harness, GrpcStream]:
    """A connection past its SETTINGS with one gRPC call open and its response headers in."""
    h = Harness()
    h.settings()
    s = GrpcStream(lp)
    h.conn.open_stream(s, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
    h.conn.receive(h.server.ok_headers(s.stream_id))
    return h, s


def test_the_c_read_wakes_a_waiter_and_leaves_a_subclass_its_own_on_grpc_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C read calls a GrpcStream's listener itself (not through ``on_grpc_messages``); with a waiter
    set it goes through the method, which wakes the waiter (the listener untouched); a subclass's
    ``on_grpc_messages`` is its own (called, not bypassed)."""
    real = _REAL
    assert real is not None
    taken = [0]

    def counting(conn: object, chunk: bytes, off: int, max_frame: int) -> int:
        r = real(conn, chunk, off, max_frame)
        taken[0] += r > off
        return r

    monkeypatch.setattr(h2_conn, "_grpc_data", counting)
    method = GrpcStream.on_grpc_messages
    through: list[int] = []

    def counted(self: GrpcStream) -> None:
        through.append(len(self.messages))
        method(self)

    monkeypatch.setattr(GrpcStream, "on_grpc_messages", counted)
    lp = asyncio.new_event_loop()
    try:
        h, s = open_grpc_stream(lp)
        calls: list[int] = []
        s.listener = lambda: calls.append(len(s.messages))
        fut = s.wait()
        h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"a")))
        assert fut.done() and calls == [] and list(s.messages) == [b"a"]
        assert through == [1] and taken == [1]  # the waiter: through the method, from the C read
        h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"b")))
        assert calls == [2]  # no waiter now: the listener
        assert through == [1] and taken == [2]  # called by the C read itself

        seen: list[int] = []

        class Own(GrpcStream):
            def on_grpc_messages(self) -> None:
                seen.append(len(self.messages))

        o = Own(lp)
        o.listener = lambda: calls.append(-1)
        h.conn.open_stream(o, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
        h.conn.receive(h.server.ok_headers(o.stream_id))
        h.conn.receive(h2.frame(h2.DATA, 0, o.stream_id, grpc_message(b"c")))
        assert seen == [1] and calls == [2] and taken == [3]
    finally:
        lp.close()


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
            h2.frame(h2.DATA, h2.FLAG_END_STREAM, sid, grpc_message(b"m")),  # flags
            h2.frame(h2.DATA, 0, sid + 2, grpc_message(b"m")),  # no such stream
            h2.frame(h2.DATA, 0, 0, grpc_message(b"m")),  # stream 0
            whole[:5] + bytes([whole[5] | 0x80]) + whole[6:],  # the reserved bit
            h2.frame(h2.DATA, 0, sid, b"\x01" + grpc_message(b"m")[1:]),  # compressed
            h2.frame(h2.DATA, 0, sid, grpc_message(b"m") + b"x"),  # more than the message
            h2.frame(h2.PING, 0, 0, b"\0" * 8),
            b"\x00\x40\x01" + whole[3:],  # above the frame size
        ):
            assert _REAL(h.conn, data, 0, h2.DEFAULT_MAX_FRAME) == 0
            assert (list(s.messages), h.conn.conn_recv_unacked, s.recv_unacked) == before
        for off, max_frame in ((-1, h2.DEFAULT_MAX_FRAME), (len(whole) + 1, h2.DEFAULT_MAX_FRAME), (0, -1)):
            assert _REAL(h.conn, whole, off, max_frame) == 0
        assert _REAL(h.conn, "not bytes", 0, h2.DEFAULT_MAX_FRAME) == 0  # type: ignore[arg-type]
        assert _REAL(h.conn, whole, 0) == 0  # type: ignore[call-arg]
        with pytest.raises(AttributeError):  # not a connection
            _REAL(object(), whole, 0, h2.DEFAULT_MAX_FRAME)
        ping = h2.frame(h2.PING, 0, 0, b"\0" * 8)
        assert _REAL(h.conn, whole + whole[:5], 0, h2.DEFAULT_MAX_FRAME) == len(whole)  # to the partial
        assert _REAL(h.conn, ping + whole, len(ping), h2.DEFAULT_MAX_FRAME) == len(ping + whole)
        assert _REAL(h.conn, whole + ping + whole, 0, h2.DEFAULT_MAX_FRAME) == len(whole)  # up to the PING
        assert list(s.messages) == [b"m"] * 3
        h.conn._rbuf = b"x"  # a partial frame held: receive's
        assert _REAL(h.conn, whole, 0, h2.DEFAULT_MAX_FRAME) == 0
    finally:
        lp.close()


@pytest.mark.timeout(30)
def test_a_read_that_is_not_bytes_is_the_frame_loops() -> None:
    """A read handed over as a bytearray or memoryview, not ``bytes``: the C read takes none of it and says
    so with the offset it was given, from the middle of the read too (the frame loop then reads it; an
    answer of 0 there sent the loop back to the read's start, for ever)."""
    assert _REAL is not None
    lp = asyncio.new_event_loop()
    try:
        h, s = open_grpc_stream(lp)
        whole = h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"m"))  # a payload of 6 bytes
        ping = h2.frame(h2.PING, 0, 0, b"\0" * 8)
        for kind in (bytearray, memoryview):
            read: Any = kind(ping + whole)
            assert _REAL(h.conn, read, len(ping), h2.DEFAULT_MAX_FRAME) == len(ping)
        h.out.clear()
        h.conn.receive(bytearray(ping + whole + whole))  # type: ignore[arg-type]
        assert list(s.messages) == [b"m", b"m"]
        assert (h.conn.conn_recv_unacked, s.recv_unacked, h.conn.failed) == (12, 12, None)
        assert h.out == [h2.ping_frame(b"\0" * 8, ack=True)]
    finally:
        lp.close()


@pytest.mark.timeout(30)
def test_the_frame_loop_only_moves_forward_whatever_the_c_read_answers() -> None:
    """A C read that answers an offset behind the one it was given (0, from the middle of a read): the
    frame loop reads the frame itself and goes on, rather than starting the read again for ever."""
    lp = asyncio.new_event_loop()
    try:
        h, s = open_grpc_stream(lp)
        whole = h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"m"))
        ping = h2.frame(h2.PING, 0, 0, b"\0" * 8)
        h2_conn._grpc_data = lambda conn, data, off, max_frame: 0
        h.out.clear()
        h.conn.receive(ping + whole + whole)
        assert list(s.messages) == [b"m", b"m"] and h.conn.failed is None
        assert h.out == [h2.ping_frame(b"\0" * 8, ack=True)]
    finally:
        h2_conn._grpc_data = _REAL
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
            assert _REAL(h.conn, whole, 0, h2.DEFAULT_MAX_FRAME) == 0
            assert (h.conn.conn_recv_unacked, s.recv_unacked, list(s.messages)) == (
                conn_unacked,
                stream_unacked,
                [],
            )
        h.conn.conn_recv_unacked = s.recv_unacked = top - 7  # the sums stay below the threshold
        assert _REAL(h.conn, whole, 0, h2.DEFAULT_MAX_FRAME) == len(whole)
        assert (h.conn.conn_recv_unacked, s.recv_unacked, list(s.messages)) == (top - 1, top - 1, [b"m"])
    finally:
        lp.close()


class _Stream:
    """What the C read reads of a stream: a message sink, a receive count and the wake-up (``on``)."""

    def __init__(self, on: Callable[[], object] | None = None, sink: Any = None) -> None:
        self.grpc_messages: Any = collections.deque() if sink is None else sink
        self.recv_unacked: Any = 0
        self.on = on

    def on_grpc_messages(self) -> None:
        if self.on is not None:
            self.on()


class _Conn:
    """What the C read reads of a connection (past its SETTINGS, nothing buffered)."""

    def __init__(self, streams: Any) -> None:
        self.failed: Any = None
        self._rbuf: Any = b""
        self._cont: Any = None
        self.settings_received: Any = True
        self.streams: Any = streams
        self.conn_recv_unacked: Any = 0
        self._credit_threshold: Any = 1 << 20


class _FailsLater(_Conn):
    """A connection whose ``failed`` raises from its second read on (after the first run was taken)."""

    reads = 0

    @property
    def failed(self) -> Any:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("failed unreadable")
        return None

    @failed.setter
    def failed(self, value: Any) -> None:
        pass


class _RaisingSink:
    def append(self, msg: bytes) -> None:
        raise ValueError("no room")


def _tok(sid: int, msg: bytes = b"m") -> bytes:
    return h2.frame(h2.DATA, 0, sid, grpc_message(msg))  # a payload of 5 + len(msg) bytes


def hostile_reads() -> list[tuple[Callable[[], object], type[Exception]]]:
    """C reads whose connection or stream objects raise after a run or more was taken (the error path with
    every reference held), each with the exception it ends with."""
    assert _REAL is not None
    read = _REAL
    data = _tok(1) + _tok(3) + _tok(1)

    def raising_wake() -> int:
        conn = _Conn({1: _Stream(), 3: _Stream(on=lambda: 1 // 0)})
        return read(conn, data, 0, h2.DEFAULT_MAX_FRAME)

    def raising_sink() -> int:
        conn = _Conn({1: _Stream(), 3: _Stream(sink=_RaisingSink())})
        return read(conn, data, 0, h2.DEFAULT_MAX_FRAME)

    def unreadable_failed() -> int:
        return read(_FailsLater({1: _Stream(), 3: _Stream()}), data, 0, h2.DEFAULT_MAX_FRAME)

    def no_count() -> int:
        s = _Stream()
        del s.recv_unacked
        return read(_Conn({1: _Stream(), 3: s}), data, 0, h2.DEFAULT_MAX_FRAME)

    return [
        (raising_wake, ZeroDivisionError),
        (raising_sink, ValueError),
        (unreadable_failed, RuntimeError),
        (no_count, AttributeError),
    ]


def test_a_stream_or_connection_that_raises_mid_read_ends_the_read_with_its_error() -> None:
    for call, error in hostile_reads():
        with pytest.raises(error):
            call()
    assert _REAL is not None
    s1, s3 = _Stream(), _Stream(on=lambda: 1 // 0)
    conn = _Conn({1: s1, 3: s3})
    with pytest.raises(ZeroDivisionError):
        _REAL(conn, _tok(1) + _tok(3) + _tok(1), 0, h2.DEFAULT_MAX_FRAME)
    # the runs before the error taken, the raising stream's messages and counts in, nothing after it
    assert (list(s1.grpc_messages), list(s3.grpc_messages)) == ([b"m"], [b"m"])
    assert (conn.conn_recv_unacked, s1.recv_unacked, s3.recv_unacked) == (12, 6, 6)


def test_odd_connection_and_stream_values_leave_the_run_to_the_frame_loop() -> None:
    """Counts that are not ints (or too large), a stream table that is not a dict, no SETTINGS yet, a
    threshold below 0, a stream without a sink: the C read takes nothing from that run on."""
    assert _REAL is not None
    data = _tok(1) + _tok(3)
    for attr, value, taken in (
        ("conn_recv_unacked", "0", 0),
        ("conn_recv_unacked", 2**70, 0),
        ("conn_recv_unacked", True, 0),  # (an int subclass)
        ("_credit_threshold", -1, 0),
        ("_credit_threshold", 2.0**20, 0),
        ("settings_received", 1, 0),
        ("_rbuf", bytearray(), 0),
        ("_cont", (), 0),
        ("streams", [], 0),
        ("s3.recv_unacked", -1, len(_tok(1))),
        ("s3.recv_unacked", 2**64, len(_tok(1))),
        ("s3.grpc_messages", None, len(_tok(1))),
    ):
        s1, s3 = _Stream(), _Stream()
        conn = _Conn({1: s1, 3: s3})
        setattr(s3 if attr.startswith("s3.") else conn, attr.removeprefix("s3."), value)
        assert _REAL(conn, data, 0, h2.DEFAULT_MAX_FRAME) == taken, attr
        assert list(s1.grpc_messages) == [b"m"] * (taken > 0)


def test_wake_ups_that_close_streams_fail_or_re_enter_are_seen_by_the_next_run() -> None:
    """A wake-up that closes the next run's stream, fails the connection, raises the count to the
    threshold, buffers bytes or reads again itself (re-entering the C read): the C read checks the
    next run after it and stops there; what the inner read took stays taken."""
    assert _REAL is not None
    read = _REAL
    data = _tok(1) + _tok(3) + _tok(1, b"x")
    for act, taken in (
        ("close", len(_tok(1))),
        ("fail", len(_tok(1))),
        ("credit", len(_tok(1))),
        ("buffer", len(_tok(1))),
        ("nothing", len(data)),
    ):
        conn = _Conn({})

        def wake(act: str = act, conn: _Conn = conn) -> None:
            if act == "close":
                del conn.streams[3]
            elif act == "fail":
                conn.failed = "failed by a wake-up"
            elif act == "credit":
                conn.conn_recv_unacked = conn._credit_threshold - 6
            elif act == "buffer":
                conn._rbuf = b"\0"

        s1, s3 = _Stream(on=wake), _Stream()
        conn.streams.update({1: s1, 3: s3})
        assert read(conn, data, 0, h2.DEFAULT_MAX_FRAME) == taken, act
        assert list(s1.grpc_messages) == ([b"m"] if taken < len(data) else [b"m", b"x"])
    # re-entered: stream 1's first wake-up reads stream 3's token, which wakes stream 3; the outer read
    # goes on with its own stream 3 and stream 1 runs
    order: list[str] = []
    conn = _Conn({})
    inner = _tok(3, b"inner")

    def wake1() -> None:
        order.append("s1")
        if len(order) == 1:
            assert read(conn, inner, 0, h2.DEFAULT_MAX_FRAME) == len(inner)

    s1, s3 = _Stream(on=wake1), _Stream(on=lambda: order.append("s3"))
    conn.streams.update({1: s1, 3: s3})
    assert read(conn, data, 0, h2.DEFAULT_MAX_FRAME) == len(data)
    assert order == ["s1", "s3", "s3", "s1"]
    assert (list(s1.grpc_messages), list(s3.grpc_messages)) == ([b"m", b"x"], [b"inner", b"m"])
    assert (conn.conn_recv_unacked, s1.recv_unacked, s3.recv_unacked) == (6 + 10 + 6 + 6, 12, 16)


def test_a_stream_table_whose_key_compares_by_changing_the_table_is_read_safely() -> None:
    """A key of the stream table equal in hash to the stream id whose ``__eq__`` empties the table (Python
    code inside the C read's lookup): the lookup starts again and finds nothing; the run is not taken."""
    assert _REAL is not None
    conn = _Conn({})

    class Evil:
        def __hash__(self) -> int:
            return 1

        def __eq__(self, other: object) -> bool:
            conn.streams.clear()
            return False

    s1 = _Stream()
    conn.streams.update({Evil(): _Stream(), 1: s1})
    assert _REAL(conn, _tok(1), 0, h2.DEFAULT_MAX_FRAME) == 0
    assert list(s1.grpc_messages) == [] and conn.streams == {}
