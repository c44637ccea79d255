"""The lean HTTP/2 transport without sockets: frame codec, HPACK helpers, connection state, gRPC framing."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import grpc
import grpc.aio
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.backoff import Backoff
from shepherd.node.engines.errors import CANCELLED, INTERNAL, OK, UNAVAILABLE, UNIMPLEMENTED, UNKNOWN
from shepherd.node.engines.grpcio import map_rpc_error
from shepherd.node.engines.h2 import parse_target
from shepherd.node.engines.h2_conn import H2Connection, H2Stream
from shepherd.node.engines.h2_stream import GrpcStream, grpc_message, map_status
from shepherd.proto.engine_types import EngineTimeout, EngineUnavailable

# ---------------------------------------------------------------------------------------------- helpers


class Listener:
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_settings(self) -> None:
        self.events.append("settings")

    def on_stream_closed(self) -> None:
        self.events.append("closed")

    def on_goaway(self) -> None:
        self.events.append("goaway")

    def on_ping_ack(self, payload: bytes) -> None:
        self.events.append("ping_ack")

    def on_fatal(self, message: str) -> None:
        self.events.append("fatal")


def parse_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of every frame in ``data`` (after an optional preface)."""
    if data.startswith(h2.PREFACE):
        data = data[len(h2.PREFACE) :]
    out = []
    off = 0
    while off < len(data):
        n = int.from_bytes(data[off : off + 3], "big")
        out.append(
            (data[off + 3], data[off + 4], int.from_bytes(data[off + 5 : off + 9], "big") & 0x7FFFFFFF,
             data[off + 9 : off + 9 + n])
        )  # fmt: skip
        off += 9 + n
    assert off == len(data)
    return out


class Server:
    """Builds the server side's bytes (its own HPACK encoder, which indexes like real servers)."""

    def __init__(self) -> None:
        self.enc = hpack.Encoder()

    def headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool = False) -> bytes:
        flags = h2.FLAG_END_HEADERS | (h2.FLAG_END_STREAM if end_stream else 0)
        return h2.frame(h2.HEADERS, flags, sid, self.enc.encode(headers))

    def ok_headers(self, sid: int) -> bytes:
        return self.headers(sid, [(":status", "200"), ("content-type", "application/grpc")])

    def trailers(self, sid: int, status: int = 0, message: str = "") -> bytes:
        hs = [("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
        return self.headers(sid, hs, end_stream=True)


class Harness:
    def __init__(self, local_window: int = h2.LOCAL_WINDOW) -> None:
        self.out: list[bytes] = []
        self.listener = Listener()
        self.conn = H2Connection(self.out.append, self.listener, local_window=local_window)
        self.conn.start()
        self.server = Server()

    def settings(self, values: dict[int, int] | None = None) -> None:
        self.conn.receive(h2.settings_frame(values or {}))

    def written(self) -> list[tuple[int, int, int, bytes]]:
        frames = parse_frames(b"".join(self.out))
        self.out.clear()
        return frames


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def ready(loop: asyncio.AbstractEventLoop, **kw: int) -> tuple[Harness, GrpcStream]:
    h = Harness(**kw)
    h.settings()
    s = GrpcStream(loop)
    h.conn.open_stream(s, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
    h.written()
    return h, s


# ---------------------------------------------------------------------------------------------- encoding


def test_frame_header_layout() -> None:
    f = h2.frame(h2.DATA, h2.FLAG_END_STREAM, 3, b"abc")
    assert f == b"\x00\x00\x03\x00\x01\x00\x00\x00\x03abc"
    big = h2.frame(h2.DATA, 0, 1, b"x" * 70_000)
    assert int.from_bytes(big[:3], "big") == 70_000


@given(st.integers(0, 2**31), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_hpack_int_matches_the_reference_decoder(value: int, prefix: int) -> None:
    enc = h2.hpack_int(value, prefix)
    assert hpack.hpack.decode_integer(enc, prefix) == (value, len(enc))
    assert h2._skip_int(enc, 0, prefix) == (value, len(enc))


def test_request_headers_decode_to_the_grpc_set() -> None:
    rh = h2.RequestHeaders("127.0.0.1:50051")
    block = rh.block("/sglang.grpc.scheduler.SglangScheduler/Generate", 2.5)
    assert (
        rh.block("/sglang.grpc.scheduler.SglangScheduler/Generate") in block
    )  # the timeout is appended to the path block
    got = [(bytes(k), bytes(v)) for k, v in hpack.Decoder().decode(block, raw=True)]
    assert got == [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/sglang.grpc.scheduler.SglangScheduler/Generate"),
        (b":authority", b"127.0.0.1:50051"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"grpc-accept-encoding", b"identity"),
        (b"user-agent", b"shepherd-h2/0.1"),
        (b"grpc-timeout", b"2500000u"),
    ]
    assert h2.table_neutral(block)  # we never touch the server's dynamic table


_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


@given(st.floats(1e-7, 1e9, allow_nan=False))
@settings(max_examples=200, deadline=None)
def test_grpc_timeout_never_shorter_and_fits_eight_digits(seconds: float) -> None:
    v = h2.grpc_timeout_value(seconds)
    digits, unit = v[:-1], v[-1:]
    assert digits.isdigit() and 1 <= len(digits) <= 8
    value = int(digits) * _UNITS[unit]
    assert value >= seconds * (1 - 1e-12)
    assert value <= max(seconds * 1.0001, seconds + _UNITS[unit])


def test_headers_frames_use_continuation_beyond_the_frame_size() -> None:
    block = bytes(range(256)) * 100  # 25,600 bytes
    frames = parse_frames(b"".join(h2.headers_frames(5, block, True, 16_384)))
    assert [(t, f) for t, f, _, _ in frames] == [
        (h2.HEADERS, h2.FLAG_END_STREAM),
        (h2.CONTINUATION, h2.FLAG_END_HEADERS),
    ]
    assert b"".join(p for *_, p in frames) == block


# ------------------------------------------------------------------------------------- HPACK decoding


header_lists = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(["grpc-status", "grpc-message", "content-type", "x-a", "x-b", ":status"]),
            st.sampled_from(["0", "1", "14", "application/grpc", "hello", "", "200", "x" * 40]),
        ),
        min_size=1,
        max_size=4,
    ),
    min_size=1,
    max_size=12,
)


@given(header_lists, st.lists(st.booleans(), min_size=12, max_size=12), st.sampled_from([4096, 64, 0]))
@settings(max_examples=150, deadline=None)
def test_cached_decoder_agrees_with_a_plain_decoder(
    blocks: list[list[tuple[str, str]]], sensitive: list[bool], table: int
) -> None:
    """Whatever the server's indexing choices, the cache never returns a stale decoding."""
    enc = hpack.Encoder()
    enc.header_table_size = table
    ours = h2.HeaderDecoder()
    ref = hpack.Decoder()
    for i, hs in enumerate(blocks * 2):  # repeats: indexed forms that hit the cache
        if sensitive[i % 12]:
            data = enc.encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in hs])
        else:
            data = enc.encode(hs)
        want = tuple((bytes(k), bytes(v)) for k, v in ref.decode(data, raw=True))
        assert ours.decode(data) == want


def test_table_neutral_classifies_representations() -> None:
    assert h2.table_neutral(b"\x88\xbf")  # indexed fields
    assert h2.table_neutral(h2.hpack_literal(b"grpc-status", b"0"))  # literal without indexing
    assert h2.table_neutral(b"\x10\x01a\x01b")  # never indexed, new name
    assert not h2.table_neutral(b"\x40\x01a\x01b")  # incremental indexing
    assert not h2.table_neutral(b"\x3f\xe1\x1f")  # dynamic table size update
    assert not h2.table_neutral(b"\x00\x05ab")  # truncated


# ---------------------------------------------------------------------------------------------- connection


def test_start_and_settings_exchange() -> None:
    h = Harness()
    raw = b"".join(h.out)
    assert raw.startswith(h2.PREFACE)
    frames = h.written()
    assert frames[0][0] == h2.SETTINGS
    settings_payload = frames[0][3]
    pairs = dict(
        struct.unpack(">HI", settings_payload[i : i + 6]) for i in range(0, len(settings_payload), 6)
    )
    # each stream 1 MiB (a held stream buffers little), the connection 16 MiB
    assert pairs == {h2.SETTINGS_ENABLE_PUSH: 0, h2.SETTINGS_INITIAL_WINDOW_SIZE: h2.STREAM_WINDOW}
    assert frames[1][:3] == (h2.WINDOW_UPDATE, 0, 0)
    assert int.from_bytes(frames[1][3], "big") == h2.LOCAL_WINDOW - h2.DEFAULT_WINDOW
    assert not h.conn.settings_received
    h.settings({h2.SETTINGS_MAX_CONCURRENT_STREAMS: 7, h2.SETTINGS_MAX_FRAME_SIZE: 32_768})
    assert h.written() == [(h2.SETTINGS, h2.FLAG_ACK, 0, b"")]
    assert h.listener.events == ["settings"]
    assert (h.conn.peer_max_streams, h.conn.peer_max_frame) == (7, 32_768)
    h.conn.receive(h2.frame(h2.SETTINGS, h2.FLAG_ACK, 0))  # the ack of ours: nothing to answer
    assert h.written() == []


def test_the_server_preface_must_be_settings() -> None:
    h = Harness()
    h.written()
    h.conn.receive(h2.ping_frame(b"12345678"))
    assert h.conn.failed
    assert h.written()[0][0] == h2.GOAWAY
    assert h.listener.events == ["fatal"]


def response_bytes(server: Server, sid: int, messages: list[bytes], per_frame: list[int]) -> bytes:
    """Headers, the messages' bytes cut into DATA frames of the given sizes (one padded), trailers split
    over HEADERS + CONTINUATION."""
    body = b"".join(grpc_message(m) for m in messages)
    out = [server.ok_headers(sid)]
    off = 0
    i = 0
    while off < len(body):
        n = per_frame[i % len(per_frame)]
        part = body[off : off + n]
        off += len(part)
        if i == 1:
            out.append(h2.frame(h2.DATA, h2.FLAG_PADDED, sid, bytes([3]) + part + b"\0\0\0"))
        else:
            out.append(h2.frame(h2.DATA, 0, sid, part))
        i += 1
    block = server.enc.encode([("grpc-status", "0"), ("grpc-message", "fine")])
    out.append(h2.frame(h2.HEADERS, h2.FLAG_END_STREAM, sid, block[:2]))
    out.append(h2.frame(h2.CONTINUATION, h2.FLAG_END_HEADERS, sid, block[2:]))
    return b"".join(out)


def test_every_byte_boundary(loop: asyncio.AbstractEventLoop) -> None:
    messages = [b"first", b"", b"x" * 300, b"two-in-one", b"last"]
    h, s = ready(loop)
    data = response_bytes(h.server, s.stream_id, messages, [9, 20, 400])
    for cut in range(1, len(data)):
        h, s = ready(loop)
        h.conn.receive(data[:cut])
        h.conn.receive(data[cut:])
        assert (list(s.messages), s.done, s.code, s.details) == (messages, True, OK, "fine"), cut
        assert not h.conn.streams


@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=8),
    st.lists(st.integers(1, 700), min_size=1, max_size=5),
    st.lists(st.integers(1, 200), min_size=1, max_size=30),
)
@settings(max_examples=100, deadline=None)
def test_messages_survive_any_framing_and_reads(
    messages: list[bytes], frame_sizes: list[int], reads: list[int]
) -> None:
    lp = asyncio.new_event_loop()
    try:
        h, s = ready(lp)
        data = response_bytes(h.server, s.stream_id, messages, frame_sizes)
        off = 0
        i = 0
        while off < len(data):
            n = reads[i % len(reads)]
            h.conn.receive(data[off : off + n])
            off += n
            i += 1
        assert list(s.messages) == messages
        assert (s.done, s.code) == (True, OK)
    finally:
        lp.close()


def test_several_messages_in_one_frame_wake_the_consumer_once(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    fut = s.wait()
    data = h.server.ok_headers(s.stream_id) + h2.frame(
        h2.DATA, 0, s.stream_id, grpc_message(b"a") + grpc_message(b"b") + grpc_message(b"c")
    )
    h.conn.receive(data)
    assert fut.done() and list(s.messages) == [b"a", b"b", b"c"]
    assert s._waiter is None  # nothing left to wake until the consumer waits again


def test_trailers_only_response(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    hs = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12"),
          ("grpc-message", "Method not found!")]  # fmt: skip
    h.conn.receive(h.server.headers(s.stream_id, hs, end_stream=True))
    assert (s.done, s.code, s.details, list(s.messages)) == (True, UNIMPLEMENTED, "Method not found!", [])
    assert not h.conn.streams and "closed" in h.listener.events


def test_grpc_message_is_percent_decoded(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.receive(
        h.server.ok_headers(s.stream_id) + h.server.trailers(s.stream_id, 3, "bad %25 input%C3%A9")
    )
    assert (s.code, s.details) == (3, "bad % inputé")


def test_http_error_without_grpc_status(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.receive(h.server.headers(s.stream_id, [(":status", "503"), ("content-type", "text/plain")]))
    assert (s.done, s.code) == (True, UNAVAILABLE)
    assert h.written() == [(h2.RST_STREAM, 0, s.stream_id, struct.pack(">I", h2.CANCEL))]
    assert isinstance(map_status(s.code, s.details), EngineUnavailable)


def test_missing_trailers_and_truncated_message(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.receive(h.server.ok_headers(s.stream_id) + h2.frame(h2.DATA, h2.FLAG_END_STREAM, s.stream_id, b""))
    assert (s.done, s.code) == (True, INTERNAL)
    h, s = ready(loop)
    h.conn.receive(
        h.server.ok_headers(s.stream_id)
        + h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"abcdef")[:7])
        + h.server.trailers(s.stream_id)
    )
    assert (s.done, s.code) == (True, INTERNAL)


def test_compressed_messages_are_refused(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.receive(h.server.ok_headers(s.stream_id) + h2.frame(h2.DATA, 0, s.stream_id, b"\x01\0\0\0\x01z"))
    assert (s.done, s.code) == (True, INTERNAL)
    assert h.written()[-1][0] == h2.RST_STREAM


def test_server_reset_maps_to_status(loop: asyncio.AbstractEventLoop) -> None:
    for code, status in (
        (h2.REFUSED_STREAM, UNAVAILABLE),
        (h2.CANCEL, CANCELLED),
        (h2.PROTOCOL_ERROR, INTERNAL),
    ):
        h, s = ready(loop)
        h.conn.receive(h2.rst_stream_frame(s.stream_id, code))
        assert (s.done, s.code) == (True, status)
        assert not h.conn.streams


def test_cancel_sends_rst_and_ignores_late_frames(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop, local_window=400)
    s.cancel()
    assert h.written() == [(h2.RST_STREAM, 0, s.stream_id, struct.pack(">I", h2.CANCEL))]
    assert (s.done, s.code) == (True, CANCELLED)
    # frames already in flight still count against the connection window (and keep HPACK in step)
    late = h.server.ok_headers(s.stream_id) + h2.frame(h2.DATA, 0, s.stream_id, b"z" * 150)
    h.conn.receive(late)
    assert not s.messages
    assert h.written() == [(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 150))]
    s2 = GrpcStream(loop)
    h.conn.open_stream(s2, b"\x83", None)
    h.written()
    h.conn.receive(h.server.ok_headers(s2.stream_id) + h.server.trailers(s2.stream_id))
    assert (s2.done, s2.code) == (True, OK)


def test_receive_window_credit(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop, local_window=1000)  # credit given back at 250 bytes
    h.conn.receive(h.server.ok_headers(s.stream_id))
    h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"a" * 195)))  # 200 bytes
    assert h.written() == []
    # padding counts too: 1 + 45 + 4 = 50 more -> 250
    h.conn.receive(
        h2.frame(h2.DATA, h2.FLAG_PADDED, s.stream_id, b"\x04" + grpc_message(b"b" * 40) + b"\0" * 4)
    )
    assert sorted(h.written()) == [
        (h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 250)),
        (h2.WINDOW_UPDATE, 0, s.stream_id, struct.pack(">I", 250)),
    ]
    assert list(s.messages) == [b"a" * 195, b"b" * 40]


@pytest.mark.parametrize("fast", [True, False])
def test_a_stream_whose_consumer_is_behind_holds_its_credit(
    loop: asyncio.AbstractEventLoop, fast: bool
) -> None:
    """A generation's stream (``credit_hold``) whose messages are not consumed past the bound gets no
    more stream credit (the engine stops sending that answer), the connection's credit goes on (its
    other streams are not held up); once the consumer took its messages the held credit goes out."""
    h, s = ready(loop, local_window=1000)  # credit given back at 250 bytes
    s.credit_hold = 300
    h.conn.receive(h.server.ok_headers(s.stream_id))
    msg = grpc_message(b"a" * 95)  # 100 bytes a frame, each one whole message (the C read's case)
    flags = 0 if fast else h2.FLAG_PADDED
    frame = h2.frame(h2.DATA, flags, s.stream_id, (b"\x00" + msg) if not fast else msg)
    h.conn.receive(frame * 3)  # 300 bytes (301 padded): credit due, backlog 285 (within the bound)
    assert {f[2] for f in h.written() if f[0] == h2.WINDOW_UPDATE} == {0, s.stream_id}
    h.conn.receive(frame * 6)  # nothing consumed: a backlog past the bound, the stream's credit held
    assert {f[2] for f in h.written() if f[0] == h2.WINDOW_UPDATE} == {0}
    assert s.credit_held and s.recv_unacked >= 250
    h.conn.receive(frame * 3)  # still held (the server may use what window it has left)
    assert {f[2] for f in h.written() if f[0] == h2.WINDOW_UPDATE} <= {0}
    held = s.recv_unacked
    s.messages.clear()  # the consumer takes them
    s.consumed()
    assert h.written() == [(h2.WINDOW_UPDATE, 0, s.stream_id, struct.pack(">I", held))]
    assert (s.credit_held, s.recv_unacked) == (False, 0)
    h.conn.receive(frame * 3)  # credited as it comes again
    assert s.stream_id in {f[2] for f in h.written() if f[0] == h2.WINDOW_UPDATE}


def test_one_message_bigger_than_the_window_still_arrives_whole(loop: asyncio.AbstractEventLoop) -> None:
    """A message still arriving is not a backlog: its stream's credit is not held for it (a non-streamed
    answer comes as one message, up to 64 MiB: held, it would never complete, and nobody would take it)."""
    h, s = ready(loop)  # the real windows: 1 MiB a stream, credit at 256 KiB
    s.credit_hold = 1 << 20
    h.conn.receive(h.server.ok_headers(s.stream_id))
    msg = grpc_message(b"x" * (20 << 20))
    sent, window = 0, h2.STREAM_WINDOW
    while sent < len(msg) and window > 0:  # bounded: the message, or the window running out
        n = min(16384, len(msg) - sent, window)
        h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, msg[sent : sent + n]))
        sent += n
        window -= n
        for f in h.written():
            if f[0] == h2.WINDOW_UPDATE and f[2] == s.stream_id:
                window += struct.unpack(">I", f[3])[0]
    assert sent == len(msg) and len(s.messages) == 1 and not s.credit_held


def test_send_flow_control_waits_for_window_updates(loop: asyncio.AbstractEventLoop) -> None:
    h = Harness()
    h.settings({h2.SETTINGS_INITIAL_WINDOW_SIZE: 10})
    h.written()
    s = GrpcStream(loop)
    body = grpc_message(b"y" * 20)  # 25 bytes
    h.conn.open_stream(s, b"\x83", body)
    frames = h.written()
    assert [(t, f, len(p)) for t, f, _, p in frames] == [
        (h2.HEADERS, h2.FLAG_END_HEADERS, 1),
        (h2.DATA, 0, 10),
    ]
    h.conn.receive(h2.window_update_frame(s.stream_id, 5))
    assert [(t, f, len(p)) for t, f, _, p in h.written()] == [(h2.DATA, 0, 5)]
    # a larger initial window applies to open streams too
    h.settings({h2.SETTINGS_INITIAL_WINDOW_SIZE: 100})
    frames = h.written()
    assert [(t, f, len(p)) for t, f, _, p in frames] == [
        (h2.SETTINGS, h2.FLAG_ACK, 0),
        (h2.DATA, h2.FLAG_END_STREAM, 10),
    ]
    assert b"".join(p for t, _, _, p in frames if t == h2.DATA) == body[15:]
    assert s.local_closed


def test_connection_window_is_shared_and_frames_respect_the_peer_size(
    loop: asyncio.AbstractEventLoop,
) -> None:
    h = Harness()
    h.settings({h2.SETTINGS_INITIAL_WINDOW_SIZE: 1_000_000})
    h.written()
    big = grpc_message(b"q" * 40_000)  # 40,005 bytes: DATA frames of at most 16,384
    s1, s2 = GrpcStream(loop), GrpcStream(loop)
    h.conn.open_stream(s1, b"\x83", big)
    h.conn.open_stream(s2, b"\x83", big)  # the connection window (65,535) runs out inside this one
    data = [(sid, len(p)) for t, _, sid, p in h.written() if t == h2.DATA]
    assert all(n <= 16_384 for _, n in data)
    assert sum(n for _, n in data) == 65_535
    assert not s2.local_closed
    h.conn.receive(h2.window_update_frame(0, 100_000))
    rest = [(t, f, sid, len(p)) for t, f, sid, p in h.written()]
    assert sum(n for *_, n in rest) == 2 * len(big) - 65_535
    assert rest[-1][1] == h2.FLAG_END_STREAM and s2.local_closed


def test_ping_is_acknowledged() -> None:
    h = Harness()
    h.settings()
    h.written()
    h.conn.receive(h2.ping_frame(b"abcdefgh"))
    assert h.written() == [(h2.PING, h2.FLAG_ACK, 0, b"abcdefgh")]
    h.conn.receive(h2.ping_frame(b"12345678", ack=True))
    assert h.listener.events[-1] == "ping_ack"


def test_goaway_lets_processed_streams_finish(loop: asyncio.AbstractEventLoop) -> None:
    h = Harness()
    h.settings()
    s1, s3 = GrpcStream(loop), GrpcStream(loop)
    h.conn.open_stream(s1, b"\x83", None)
    h.conn.open_stream(s3, b"\x83", None)
    h.conn.receive(h2.goaway_frame(1, h2.NO_ERROR, b"draining"))
    assert not h.conn.usable
    assert (s3.done, s3.code) == (True, UNAVAILABLE) and "GOAWAY" in s3.details
    assert not s1.done
    h.conn.receive(
        h.server.ok_headers(1) + h2.frame(h2.DATA, 0, 1, grpc_message(b"ok")) + h.server.trailers(1)
    )
    assert (s1.done, s1.code, list(s1.messages)) == (True, OK, [b"ok"])
    assert "goaway" in h.listener.events


def test_max_concurrent_streams() -> None:
    h = Harness()
    h.settings({h2.SETTINGS_MAX_CONCURRENT_STREAMS: 1})
    before = h.conn.has_slot
    s = H2Stream()
    h.conn.open_stream(s, b"\x83", None)
    during = h.conn.has_slot
    h.conn.receive(h2.rst_stream_frame(s.stream_id, h2.NO_ERROR))
    assert (before, during, h.conn.has_slot) == (True, False, True)


def test_protocol_errors_fail_the_connection(loop: asyncio.AbstractEventLoop) -> None:
    for bad, code in (
        (h2.frame(h2.CONTINUATION, h2.FLAG_END_HEADERS, 1, b"\x88"), h2.PROTOCOL_ERROR),
        (h2.frame(h2.DATA, 0, 1, b"x" * 20_000), h2.FRAME_SIZE_ERROR),
        (h2.frame(h2.PUSH_PROMISE, 0, 1, b"\0\0\0\x02"), h2.PROTOCOL_ERROR),
        (h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, 1, b"\xff\xff\xff\x0f"), h2.COMPRESSION_ERROR),
    ):
        h, s = ready(loop)
        h.conn.receive(bad)
        goaway = [p for t, _, _, p in h.written() if t == h2.GOAWAY]
        assert goaway and int.from_bytes(goaway[0][4:8], "big") == code
        assert (s.done, s.code) == (True, UNAVAILABLE)
        assert h.listener.events[-1] == "fatal" and not h.conn.usable


def test_connection_lost_fails_every_stream(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.lost("connection reset")
    assert (s.done, s.code, s.details) == (True, UNAVAILABLE, "connection reset")
    assert not h.conn.usable


# ---------------------------------------------------------------------------------------------- helpers


def test_status_mapping_matches_the_grpcio_client() -> None:
    for status in grpc.StatusCode:
        if status == grpc.StatusCode.OK:
            continue
        ref = map_rpc_error(grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), "why"))
        got = map_status(status.value[0], "why")
        assert (type(got), got.code, got.retryable, str(got)) == (
            type(ref),
            ref.code,
            ref.retryable,
            str(ref),
        )
    assert isinstance(map_status(4, "late"), EngineTimeout)
    assert type(map_status(99, "?")) is type(map_status(UNKNOWN, "?"))


def test_backoff_grows_caps_and_resets() -> None:
    b = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.0)
    assert b.ready(0.0)
    assert b.failed(10.0) == pytest.approx(10.1)
    assert not b.ready(10.05) and b.ready(10.1)
    delays = [b.failed(0.0) for _ in range(6)]
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    b.succeeded()
    assert b.ready(0.0) and b.failed(0.0) == pytest.approx(0.1)
    jittery = Backoff(initial=1.0, jitter=0.2, rand=lambda: 1.0)
    assert jittery.failed(0.0) == pytest.approx(1.2)


def test_parse_target() -> None:
    assert parse_target("127.0.0.1:50051") == ("127.0.0.1", 50051, None)
    assert parse_target("dns:///engine.local:9000") == ("engine.local", 9000, None)
    assert parse_target("ipv4:10.0.0.1:1") == ("10.0.0.1", 1, None)
    assert parse_target("[::1]:7") == ("::1", 7, None)
    assert parse_target("ipv6:[::1]:7") == ("::1", 7, None)
    assert parse_target("unix:/tmp/e.sock") == ("localhost", 0, "/tmp/e.sock")
    assert parse_target("unix:///tmp/e.sock") == ("localhost", 0, "/tmp/e.sock")
    assert parse_target("host") == ("host", 443, None)


def test_refused_stream_is_marked_unprocessed_only_before_any_answer() -> None:
    from shepherd.node.engines import h2_frames
    from shepherd.node.engines.h2_stream import GrpcStream

    loop = asyncio.new_event_loop()
    try:
        refused = GrpcStream(loop)
        refused.on_reset(h2_frames.REFUSED_STREAM)
        assert refused.done and refused.unprocessed
        cancelled = GrpcStream(loop)
        cancelled.on_reset(h2_frames.CANCEL)
        assert cancelled.done and not cancelled.unprocessed
        lost = GrpcStream(loop)
        lost.on_connection_error("GOAWAY above last stream id", True)
        assert lost.unprocessed
    finally:
        loop.close()


# ------------------------------------------------------------------------------- whole-message frames


class PlainGrpcStream(GrpcStream):
    """The frame loop's whole-message path off: every DATA frame goes through ``on_data``."""

    __slots__ = ()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.grpc_messages = None

    def on_data(self, buf: bytes, start: int, end: int, end_stream: bool) -> None:
        super().on_data(buf, start, end, end_stream)
        self.grpc_messages = None


_frame_kinds = st.sampled_from(["whole", "whole", "whole", "split", "multi", "padded", "other", "compressed"])


def _mixed_response(server: Server, sid: int, other: int, kinds: list[str], sizes: list[int]) -> bytes:
    """Frames of stream ``sid``: whole messages one per frame (the fast path), messages split over frames,
    several in one frame, padded, a frame of stream ``other`` between, trailers."""
    out = [server.ok_headers(sid)]
    for i, kind in enumerate(kinds):
        m = bytes([i % 251]) * sizes[i % len(sizes)]
        if kind == "whole":
            out.append(h2.frame(h2.DATA, 0, sid, grpc_message(m)))
        elif kind == "split":
            g = grpc_message(m)
            cut = min(len(g) - 1, 1 + i % 7)
            out += [h2.frame(h2.DATA, 0, sid, g[:cut]), h2.frame(h2.DATA, 0, sid, g[cut:])]
        elif kind == "multi":
            out.append(h2.frame(h2.DATA, 0, sid, grpc_message(m) + grpc_message(m[:3])))
        elif kind == "padded":
            out.append(h2.frame(h2.DATA, h2.FLAG_PADDED, sid, b"\x02" + grpc_message(m) + b"\0\0"))
        elif kind == "other":
            out.append(h2.frame(h2.DATA, 0, other, grpc_message(m)))
        else:  # compressed: fails the call (the fast path must not take it)
            out.append(h2.frame(h2.DATA, 0, sid, b"\x01" + grpc_message(m)[1:]))
    out.append(server.trailers(sid))
    return b"".join(out)


@given(
    st.lists(_frame_kinds, max_size=14),
    st.lists(st.integers(0, 120), min_size=1, max_size=4),
    st.lists(st.integers(1, 300), min_size=1, max_size=6),
    st.sampled_from([h2.LOCAL_WINDOW, 600]),
)
@settings(max_examples=150, deadline=None)
def test_whole_message_frames_take_the_fast_path_with_the_same_results(
    kinds: list[str], sizes: list[int], reads: list[int], window: int
) -> None:
    """Messages, statuses and receive-window credit as when every frame goes through ``on_data``, for
    any mix of frames and any read boundaries."""
    lp = asyncio.new_event_loop()
    try:
        results = []
        for cls in (GrpcStream, PlainGrpcStream):
            h = Harness(local_window=window)
            h.settings()
            s, o = cls(lp), cls(lp)
            for st_ in (s, o):
                h.conn.open_stream(st_, h2.RequestHeaders("a:1").block("/svc/M"), grpc_message(b"req"))
            h.written()
            waiter = s.wait()
            data = h.server.ok_headers(o.stream_id) + _mixed_response(
                h.server, s.stream_id, o.stream_id, kinds, sizes
            )
            off = i = 0
            while off < len(data):
                n = reads[i % len(reads)]
                h.conn.receive(data[off : off + n])
                off += n
                i += 1
            credit: dict[int, int] = {}
            for ftype, _, sid, payload in h.written():
                if ftype == h2.WINDOW_UPDATE:
                    credit[sid] = credit.get(sid, 0) + struct.unpack(">I", payload)[0]
            results.append(
                (
                    list(s.messages),
                    list(o.messages),
                    s.done,
                    s.code,
                    waiter.done() == bool(s.messages or s.done),
                    credit.get(0, 0) + h.conn.conn_recv_unacked,
                    credit.get(o.stream_id, 0) + o.recv_unacked,
                )
            )
        assert results[0] == results[1]
        assert results[0][4]
    finally:
        lp.close()


def test_a_run_of_whole_message_frames_wakes_the_consumer_once(loop: asyncio.AbstractEventLoop) -> None:
    h, s = ready(loop)
    h.conn.receive(h.server.ok_headers(s.stream_id))
    fut = s.wait()
    run = b"".join(h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"m%d" % i)) for i in range(5))
    h.conn.receive(run)
    assert fut.done() and list(s.messages) == [b"m%d" % i for i in range(5)]
    assert s._waiter is None
    # a message split over frames (the partial path) and whole ones after it
    g = grpc_message(b"split")
    h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, g[:3]))
    assert _sink(s) is None
    h.conn.receive(h2.frame(h2.DATA, 0, s.stream_id, g[3:]) + run)
    assert _sink(s) is s.messages and list(s.messages)[5:7] == [b"split", b"m0"]
    h.conn.receive(h.server.trailers(s.stream_id))
    assert (s.done, s.code, _sink(s)) == (True, OK, None)


def _sink(s: GrpcStream) -> object:
    return s.grpc_messages


def test_a_run_stops_at_any_frame_that_is_not_one_whole_message(loop: asyncio.AbstractEventLoop) -> None:
    one = grpc_message(b"one")
    for odd, fails in (
        (b"\x01" + one[1:], True),  # compressed
        (one + one, False),  # two messages in one frame
        (one[:4], False),  # a partial message
    ):
        h, s = ready(loop)
        whole = h2.frame(h2.DATA, 0, s.stream_id, one)
        h.conn.receive(
            h.server.ok_headers(s.stream_id) + whole + whole + h2.frame(h2.DATA, 0, s.stream_id, odd)
        )
        assert s.done is fails
        assert list(s.messages) == [b"one"] * (2 if fails or odd == one[:4] else 4)
        assert (_sink(s) is None) is (fails or odd == one[:4])
