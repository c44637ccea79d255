"""A lean HTTP/2 client connection: frame codec, a pure connection state machine, a thin asyncio shell.

Written for one job: gRPC calls to an engine over cleartext HTTP/2 (h2c with prior knowledge) at the
lowest CPU cost per received message. The pieces:

- frame encoders (``frame``, ``settings_frame``, ...) and request-header encoding (``RequestHeaders``:
  the HPACK block of a path is built once; only ``grpc-timeout`` is added per call);
- ``HeaderDecoder``: HPACK decoding with the ``hpack`` package, plus a cache of header blocks that leave
  the dynamic table unchanged (indexed fields and non-indexing literals: what a gRPC server sends for
  its usual response headers and OK trailers once its table is warm); such a decoding holds until a
  block that may change the table;
- ``H2Connection``: the pure protocol core. ``receive(bytes)`` parses frames and calls the methods of
  ``H2Stream`` objects and of a ``ConnectionListener``; bytes to send go to an injected ``write``
  callable. No clock, no asyncio: unit tests drive it with bytes;
- ``H2Protocol``: the ``asyncio.Protocol`` around one ``H2Connection`` (readiness once the server's
  SETTINGS arrive, waiting for a stream slot, keepalive pings, closing a drained connection).

Flow control: we advertise large windows (16 MiB per stream and for the connection) and give credit
back when a quarter has been received, so a server rarely waits for us. Received data is credited as it
arrives (the consumer is the gateway's own pipeline, which keeps up). On the send side the peer's
windows and frame size are respected: a request body that does not fit waits for WINDOW_UPDATE.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
from collections.abc import Callable
from typing import Protocol, cast

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# flags
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

# settings
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

# error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
SETTINGS_TIMEOUT = 0x4
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
CONNECT_ERROR = 0xA
ENHANCE_YOUR_CALM = 0xB
INADEQUATE_SECURITY = 0xC
HTTP_1_1_REQUIRED = 0xD

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
LOCAL_WINDOW = 16 * 1024 * 1024

_HDR = struct.Struct(">HBBBI")  # length as 16 + 8 bits, type, flags, stream id
_HDR_MSG = struct.Struct(">HBBBIBI")  # a frame header and the gRPC message prefix after it (flag, length)
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")

Headers = tuple[tuple[bytes, bytes], ...]


class H2ProtocolError(Exception):
    """The peer broke HTTP/2: the connection is closed with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------- encoding


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HDR.pack(n >> 8, n & 0xFF, ftype, flags, stream_id) + payload


def frame_header(length: int, ftype: int, flags: int, stream_id: int) -> bytes:
    return _HDR.pack(length >> 8, length & 0xFF, ftype, flags, stream_id)


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings.items()))


def window_update_frame(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream_frame(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def ping_frame(payload: bytes, ack: bool = False) -> bytes:
    return frame(PING, FLAG_ACK if ack else 0, 0, payload)


def goaway_frame(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def headers_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> list[bytes]:
    """HEADERS (+ CONTINUATION when the block exceeds the peer's frame size)."""
    es = FLAG_END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return [frame_header(len(block), HEADERS, es | FLAG_END_HEADERS, stream_id), block]
    out = [frame_header(max_frame, HEADERS, es, stream_id), block[:max_frame]]
    off = max_frame
    while off < len(block):
        part = block[off : off + max_frame]
        off += len(part)
        last = off >= len(block)
        out += [frame_header(len(part), CONTINUATION, FLAG_END_HEADERS if last else 0, stream_id), part]
    return out


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK integer (RFC 7541 §5.1); ``first`` holds the representation's flag bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name: int | bytes, value: bytes) -> bytes:
    """Literal header field without indexing, name by static-table index or as a plain string."""
    head = hpack_int(name, 4) if isinstance(name, int) else b"\x00" + hpack_int(len(name), 7) + name
    return head + hpack_int(len(value), 7) + value


# static-table indices (RFC 7541 appendix A)
_IDX_AUTHORITY = 1
_IDX_METHOD_POST = 3
_IDX_PATH = 4
_IDX_SCHEME_HTTP = 6
_IDX_SCHEME_HTTPS = 7
_IDX_CONTENT_TYPE = 31
_IDX_USER_AGENT = 58


def grpc_timeout_value(seconds: float) -> bytes:
    """``grpc-timeout`` value: at most 8 digits and a unit, rounded up so the server never cuts early."""
    us = max(1, int(-(-seconds * 1_000_000 // 1)))
    for unit, scale in (
        (b"u", 1),
        (b"m", 1_000),
        (b"S", 1_000_000),
        (b"M", 60_000_000),
        (b"H", 3_600_000_000),
    ):
        v = -(-us // scale)
        if v < 100_000_000:
            return str(v).encode() + unit
    return b"99999999H"


class RequestHeaders:
    """Pre-encoded HPACK blocks of gRPC request headers, one per path (the headers never change)."""

    def __init__(self, authority: str, scheme: str = "http", user_agent: str = "shepherd-h2/0.1") -> None:
        self._common_tail = (
            hpack_literal(_IDX_AUTHORITY, authority.encode())
            + hpack_literal(_IDX_CONTENT_TYPE, b"application/grpc")
            + hpack_literal(b"te", b"trailers")
            + hpack_literal(b"grpc-accept-encoding", b"identity")
            + hpack_literal(_IDX_USER_AGENT, user_agent.encode())
        )
        self._head = bytes(
            [0x80 | _IDX_METHOD_POST, 0x80 | (_IDX_SCHEME_HTTPS if scheme == "https" else _IDX_SCHEME_HTTP)]
        )
        self._blocks: dict[tuple[str, float | None], bytes] = {}

    def block(self, path: str, timeout: float | None = None) -> bytes:
        """The header block of a call; cached per (path, timeout): callers mostly reuse a few timeouts."""
        key = (path, timeout)
        b = self._blocks.get(key)
        if b is None:
            b = self._head + hpack_literal(_IDX_PATH, path.encode()) + self._common_tail
            if timeout is not None:
                b += hpack_literal(b"grpc-timeout", grpc_timeout_value(timeout))
            if len(self._blocks) >= 256:  # remaining-time timeouts vary: stay bounded
                self._blocks.clear()
            self._blocks[key] = b
        return b


# ---------------------------------------------------------------------------------------------- decoding


def _skip_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """Read an HPACK integer at ``block[i]``: (value, index after it)."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value == limit:
        shift = 0
        while i < len(block):
            b = block[i]
            i += 1
            value += (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
    return value, i


def table_neutral(block: bytes) -> bool:
    """True when the block holds only indexed fields and literals without (or never) indexing: decoding
    it leaves the HPACK dynamic table unchanged, so its result holds while the table does."""
    i = 0
    n = len(block)
    while i < n:
        b = block[i]
        if b & 0x80:  # indexed field
            _, i = _skip_int(block, i, 7)
            continue
        if b & 0xE0:  # 01xxxxxx incremental indexing, 001xxxxx table size update
            return False
        idx, i = _skip_int(block, i, 4)  # literal without indexing / never indexed
        if idx == 0 and i < n:
            length, i = _skip_int(block, i, 7)
            i += length
        if i >= n:
            return False  # truncated: let the decoder report it, don't cache
        length, i = _skip_int(block, i, 7)
        i += length
    return i == n


class HeaderDecoder:
    """HPACK decoding (``hpack``), caching table-neutral blocks while the dynamic table stands."""

    def __init__(self, max_cached: int = 64) -> None:
        self._dec = hpack.Decoder()
        self._cache: dict[bytes, Headers] = {}
        self._max = max_cached

    def decode(self, block: bytes) -> Headers:
        hit = self._cache.get(block)
        if hit is not None:
            return hit
        try:
            headers: Headers = tuple((bytes(k), bytes(v)) for k, v in self._dec.decode(block, raw=True))
        except hpack.HPACKError as e:
            raise H2ProtocolError(COMPRESSION_ERROR, f"header block: {e}") from None
        if table_neutral(block):
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[block] = headers
        else:
            self._cache.clear()  # the block may have inserted into (or resized) the dynamic table
        return headers


# ---------------------------------------------------------------------------------------------- state machine


class H2Stream:
    """One client stream; subclass and override the ``on_*`` methods (they must not raise).

    The connection sets ``stream_id`` and the flow-control fields; subclasses hold what they parse.
    """

    __slots__ = (
        "_pending",
        "_pending_off",
        "conn",
        "grpc_messages",
        "local_closed",
        "recv_unacked",
        "remote_closed",
        "send_window",
        "stream_id",
    )

    def __init__(self) -> None:
        self.conn: H2Connection | None = None
        self.stream_id = 0
        self.send_window = 0
        self.recv_unacked = 0
        self.local_closed = False
        self.remote_closed = False
        self._pending = b""
        self._pending_off = 0
        # A stream that takes whole gRPC messages sets this while it holds no partial one: DATA frames
        # (no flags) that carry exactly one uncompressed message then skip ``on_data``, their messages
        # (prefix stripped) are appended here, and ``on_grpc_messages`` follows each run of them.
        self.grpc_messages: collections.deque[bytes] | None = None

    def on_grpc_messages(self) -> None:
        """Messages were appended to ``grpc_messages``."""

    def on_headers(self, headers: Headers, end_stream: bool) -> None:
        """A complete header block (response headers, or trailers when ``end_stream``)."""

    def on_data(self, buf: bytes, start: int, end: int, end_stream: bool) -> None:
        """DATA payload ``buf[start:end]`` (padding removed)."""

    def on_reset(self, code: int) -> None:
        """The peer reset the stream (RST_STREAM with ``code``)."""

    def on_connection_error(self, message: str, unprocessed: bool) -> None:
        """The connection failed or went away; ``unprocessed`` when GOAWAY says the peer never saw it."""


class ConnectionListener(Protocol):
    def on_settings(self) -> None:
        """The peer's SETTINGS were applied (the first call means the connection is ready)."""

    def on_stream_closed(self) -> None:
        """A stream left the table (a concurrency slot is free)."""

    def on_goaway(self) -> None:
        """GOAWAY received: no new streams on this connection."""

    def on_ping_ack(self, payload: bytes) -> None: ...

    def on_fatal(self, message: str) -> None:
        """A connection error was detected (GOAWAY already written): close the transport."""


class H2Connection:
    """Pure client-side HTTP/2 connection state: bytes in via ``receive``, bytes out via ``write``."""

    def __init__(
        self,
        write: Callable[[bytes], None],
        listener: ConnectionListener,
        *,
        local_window: int = LOCAL_WINDOW,
    ) -> None:
        self._write = write
        self._listener = listener
        self._decoder = HeaderDecoder()
        self.streams: dict[int, H2Stream] = {}
        self.next_stream_id = 1
        self.local_window = local_window
        self._credit_threshold = max(1, local_window // 4)
        self.conn_recv_unacked = 0
        self.conn_send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.peer_max_streams = 2**31
        self.settings_received = False
        self.goaway_received = False
        self.goaway_last_stream_id = MAX_STREAM_ID
        self.failed: str | None = None
        self._rbuf = b""
        self._blocked: dict[int, H2Stream] = {}  # streams waiting for send window, in order
        # a header block split over CONTINUATION frames: (stream id, end_stream, fragments)
        self._cont: tuple[int, bool, list[bytes]] | None = None

    # -- output

    def start(self) -> None:
        """Write the connection preface, our SETTINGS and the connection window increase."""
        out = PREFACE + settings_frame(
            {SETTINGS_ENABLE_PUSH: 0, SETTINGS_INITIAL_WINDOW_SIZE: self.local_window}
        )
        if self.local_window > DEFAULT_WINDOW:
            out += window_update_frame(0, self.local_window - DEFAULT_WINDOW)
        self._write(out)

    @property
    def usable(self) -> bool:
        """New streams may be opened here (not failed, no GOAWAY, stream ids left)."""
        return self.failed is None and not self.goaway_received and self.next_stream_id < MAX_STREAM_ID - 2

    @property
    def has_slot(self) -> bool:
        return len(self.streams) < self.peer_max_streams

    def open_stream(self, stream: H2Stream, block: bytes, body: bytes | None) -> None:
        """Send HEADERS (+ the whole body as DATA, flow control permitting) and end our side."""
        sid = self.next_stream_id
        self.next_stream_id += 2
        stream.stream_id = sid
        stream.conn = self
        stream.send_window = self.peer_initial_window
        self.streams[sid] = stream
        if not body:
            self._write(b"".join(headers_frames(sid, block, True, self.peer_max_frame)))
            stream.local_closed = True
            return
        n = len(body)
        max_frame = self.peer_max_frame
        out = headers_frames(sid, block, False, max_frame)
        if n <= max_frame and n <= stream.send_window and n <= self.conn_send_window:
            stream.send_window -= n
            self.conn_send_window -= n
            out.append(frame_header(n, DATA, FLAG_END_STREAM, sid))
            out.append(body)
            stream.local_closed = True
        else:
            stream._pending = body
            stream._pending_off = 0
            self._send_pending(stream, out)
        self._write(b"".join(out))

    def _send_pending(self, s: H2Stream, out: list[bytes]) -> None:
        body = s._pending
        off = s._pending_off
        total = len(body)
        while off < total:
            n = min(total - off, self.peer_max_frame, s.send_window, self.conn_send_window)
            if n <= 0:
                s._pending_off = off
                self._blocked[s.stream_id] = s
                return
            s.send_window -= n
            self.conn_send_window -= n
            last = off + n >= total
            out.append(frame_header(n, DATA, FLAG_END_STREAM if last else 0, s.stream_id))
            out.append(body[off : off + n])
            off += n
        s._pending = b""
        s._pending_off = 0
        s.local_closed = True

    def _flush_blocked(self) -> None:
        if not self._blocked:
            return
        out: list[bytes] = []
        blocked = self._blocked
        self._blocked = {}
        for s in blocked.values():
            if self.streams.get(s.stream_id) is s and not s.local_closed:
                self._send_pending(s, out)  # re-enters self._blocked if still short of window
        if out:
            self._write(b"".join(out))

    def reset_stream(self, stream: H2Stream, code: int = CANCEL) -> None:
        """Cancel a stream: RST_STREAM and forget it (later frames for it are ignored)."""
        if self.streams.get(stream.stream_id) is stream:
            if self.failed is None:
                self._write(rst_stream_frame(stream.stream_id, code))
            self._close(stream)

    def ping(self, payload: bytes = b"\0" * 8) -> None:
        self._write(ping_frame(payload))

    def close(self, code: int = NO_ERROR) -> None:
        """Say GOAWAY (we open no more streams) when still healthy."""
        if self.failed is None:
            self._write(goaway_frame(0, code))

    def _close(self, s: H2Stream) -> None:
        del self.streams[s.stream_id]
        if s._pending:
            self._blocked.pop(s.stream_id, None)
            s._pending = b""
        self._listener.on_stream_closed()

    # -- input

    def receive(self, data: bytes) -> None:
        """Feed bytes from the transport; calls stream and listener methods as frames complete."""
        if self.failed is not None:
            return
        if self._rbuf:
            data = self._rbuf + data
            self._rbuf = b""
        try:
            off = self._parse(data)
        except H2ProtocolError as e:
            self.fail(str(e), e.code)
            return
        if off < len(data):
            self._rbuf = data[off:]

    def _parse(self, data: bytes) -> int:
        n = len(data)
        off = 0
        unpack = _HDR.unpack_from
        streams = self.streams
        while n - off >= 9:
            hi, lo, ftype, flags, sid = unpack(data, off)
            length = (hi << 8) | lo
            if length > DEFAULT_MAX_FRAME:  # we never raise SETTINGS_MAX_FRAME_SIZE
                raise H2ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            start = off + 9
            end = start + length
            if end > n:
                break
            off = end
            sid &= 0x7FFFFFFF
            if self._cont is not None and ftype != CONTINUATION:
                raise H2ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
            if not self.settings_received and ftype != SETTINGS:
                raise H2ProtocolError(PROTOCOL_ERROR, "the server preface must be SETTINGS")
            if ftype == DATA:
                if sid == 0:
                    raise H2ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
                self.conn_recv_unacked += length
                if flags & FLAG_PADDED:
                    if length < 1 or data[start] >= length:
                        raise H2ProtocolError(PROTOCOL_ERROR, "bad DATA padding")
                    end -= data[start]
                    start += 1
                s = streams.get(sid)
                if s is not None:
                    sink = s.grpc_messages
                    if sink is not None and not flags:
                        taken = self._grpc_run(s, sink, data, start - 9, length, sid)
                        if taken != start - 9:
                            off = taken
                            continue
                    es = bool(flags & FLAG_END_STREAM)
                    if not es:
                        s.recv_unacked += length
                        if s.recv_unacked >= self._credit_threshold:
                            self._write(window_update_frame(sid, s.recv_unacked))
                            s.recv_unacked = 0
                    s.on_data(data, start, end, es)
                    if es:
                        self._remote_end(s)
                if self.conn_recv_unacked >= self._credit_threshold:
                    self._write(window_update_frame(0, self.conn_recv_unacked))
                    self.conn_recv_unacked = 0
            elif ftype == HEADERS:
                if sid == 0:
                    raise H2ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
                if flags & FLAG_PADDED:
                    if length < 1 or data[start] >= length:
                        raise H2ProtocolError(PROTOCOL_ERROR, "bad HEADERS padding")
                    end -= data[start]
                    start += 1
                if flags & FLAG_PRIORITY:
                    start += 5
                    if start > end:
                        raise H2ProtocolError(FRAME_SIZE_ERROR, "short HEADERS")
                es = bool(flags & FLAG_END_STREAM)
                if flags & FLAG_END_HEADERS:
                    self._headers(sid, data[start:end], es)
                else:
                    self._cont = (sid, es, [data[start:end]])
            elif ftype == CONTINUATION:
                if self._cont is None or self._cont[0] != sid:
                    raise H2ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
                self._cont[2].append(data[start:end])
                if flags & FLAG_END_HEADERS:
                    csid, es, parts = self._cont
                    self._cont = None
                    self._headers(csid, b"".join(parts), es)
            else:
                self._control(ftype, flags, sid, data[start:end])
        return off

    def _grpc_run(
        self, s: H2Stream, sink: collections.deque[bytes], data: bytes, off: int, counted: int, sid: int
    ) -> int:
        """The DATA frames of stream ``sid`` from ``data[off]`` on (the first one without flags, its
        ``counted`` bytes already counted against the connection window) that each hold exactly one
        whole uncompressed gRPC message: their messages go to ``sink`` in one loop. Returns the offset
        of the first frame not taken, ``off`` if none (such a frame is parsed as usual)."""
        taken = len(sink)
        start = off
        n = len(data)
        unpack = _HDR_MSG.unpack_from
        while n - off >= 14:  # bounded by the data
            hi, lo, ftype, flags, fsid, compressed, mlen = unpack(data, off)
            length = (hi << 8) | lo
            # the same stream (reserved bit clear), no flags, exactly one uncompressed message, whole
            if (
                ftype
                or flags
                or fsid != sid
                or compressed
                or mlen + 5 != length
                or length > DEFAULT_MAX_FRAME
            ):
                break
            end = off + 9 + length
            if end > n:
                break
            sink.append(data[off + 14 : end])
            off = end
        if off == start:
            return off
        flowed = off - start - 9 * (len(sink) - taken)  # the frames' payload bytes
        self.conn_recv_unacked += flowed - counted
        s.recv_unacked += flowed
        if s.recv_unacked >= self._credit_threshold:
            self._write(window_update_frame(sid, s.recv_unacked))
            s.recv_unacked = 0
        if self.conn_recv_unacked >= self._credit_threshold:
            self._write(window_update_frame(0, self.conn_recv_unacked))
            self.conn_recv_unacked = 0
        s.on_grpc_messages()
        return off

    def _headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        headers = self._decoder.decode(block)  # always: keeps the HPACK table in step
        s = self.streams.get(sid)
        if s is not None:
            s.on_headers(headers, end_stream)
            if end_stream:
                self._remote_end(s)

    def _remote_end(self, s: H2Stream) -> None:
        s.remote_closed = True
        if self.streams.get(s.stream_id) is not s:
            return  # the stream's own callback already reset it
        if not s.local_closed and self.failed is None:
            # the server answered before reading our whole request: stop sending it
            self._write(rst_stream_frame(s.stream_id, NO_ERROR))
        self._close(s)

    def _control(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == SETTINGS:
            if sid != 0:
                raise H2ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & FLAG_ACK:
                if payload:
                    raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ack with payload")
                return
            if len(payload) % 6:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS length")
            self._apply_settings(payload)
            self._write(frame(SETTINGS, FLAG_ACK, 0))
            self.settings_received = True
            self._flush_blocked()
            self._listener.on_settings()
        elif ftype == WINDOW_UPDATE:
            if len(payload) != 4:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "WINDOW_UPDATE length")
            inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                if inc == 0:
                    raise H2ProtocolError(PROTOCOL_ERROR, "zero WINDOW_UPDATE")
                self.conn_send_window += inc
                if self.conn_send_window > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "connection window overflow")
                self._flush_blocked()
            else:
                s = self.streams.get(sid)
                if s is not None:
                    if inc == 0 or s.send_window + inc > MAX_WINDOW:
                        self.reset_stream(s, PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR)
                        s.on_reset(INTERNAL_ERROR)
                        return
                    s.send_window += inc
                    self._flush_blocked()
        elif ftype == PING:
            if len(payload) != 8 or sid != 0:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "PING")
            if flags & FLAG_ACK:
                self._listener.on_ping_ack(payload)
            else:
                self._write(ping_frame(payload, ack=True))
        elif ftype == RST_STREAM:
            if len(payload) != 4 or sid == 0:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "RST_STREAM")
            s = self.streams.get(sid)
            if s is not None:
                s.remote_closed = True
                self._close(s)
                s.on_reset(_U32.unpack(payload)[0])
        elif ftype == GOAWAY:
            if len(payload) < 8 or sid != 0:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "GOAWAY")
            last, code = _GOAWAY.unpack_from(payload)
            last &= 0x7FFFFFFF
            debug = payload[8:].decode("utf-8", "replace")
            self.goaway_received = True
            self.goaway_last_stream_id = min(self.goaway_last_stream_id, last)
            why = f"server sent GOAWAY (code {code}{': ' + debug if debug else ''})"
            for s in [s for s in self.streams.values() if s.stream_id > last]:
                self._close(s)
                s.on_connection_error(why, True)
            self._listener.on_goaway()
        elif ftype == PUSH_PROMISE:
            raise H2ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE with push disabled")
        # PRIORITY and unknown frame types are ignored

    def _apply_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise H2ProtocolError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise H2ProtocolError(PROTOCOL_ERROR, "ENABLE_PUSH")

    # -- failure

    def fail(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        """A connection error on our side: GOAWAY(code), then every stream fails; the shell closes."""
        if self.failed is not None:
            return
        self._write(goaway_frame(0, code, message.encode()[:256]))
        self.lost(message)
        self._listener.on_fatal(message)

    def lost(self, message: str) -> None:
        """The transport is gone: fail every stream (idempotent)."""
        if self.failed is None:
            self.failed = message
        streams = list(self.streams.values())
        self.streams.clear()
        self._blocked.clear()
        for s in streams:
            s.on_connection_error(message, False)
        if streams:
            self._listener.on_stream_closed()


# ---------------------------------------------------------------------------------------------- asyncio shell


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection on an asyncio transport; all protocol logic lives in ``H2Connection``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        local_window: int = LOCAL_WINDOW,
        keepalive_s: float = 60.0,
        keepalive_timeout_s: float = 20.0,
        coalesce_writes: bool = True,
    ) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.conn = H2Connection(self._write, self, local_window=local_window)
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._keepalive: asyncio.TimerHandle | None = None
        self._rx = False
        self._ping_sent: float | None = None
        self._coalesce = coalesce_writes
        self._wbuf: list[bytes] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports don't subclass it
        self.conn.start()
        if self._keepalive_s > 0:
            self._keepalive = self.loop.call_later(self._keepalive_s, self._on_keepalive)

    def data_received(self, data: bytes) -> None:
        self._rx = True
        self.conn.receive(data)

    def eof_received(self) -> bool | None:
        return False  # close the transport: HTTP/2 has no half-closed connections

    def connection_lost(self, exc: Exception | None) -> None:
        msg = f"connection lost: {exc}" if exc else "connection closed by the server"
        self.transport = None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        self.conn.lost(self.conn.failed or msg)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(msg))
            self.ready.exception()  # mark retrieved: the opener may have given up already
        if not self.closed.done():
            self.closed.set_result(None)
        self._wake_all()

    # ConnectionListener

    def on_settings(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
        self._wake_one()

    def on_stream_closed(self) -> None:
        if self._slot_waiters:
            self._wake_one()
        if not self.conn.streams and not self.conn.usable:
            self.close()

    def on_goaway(self) -> None:
        self._wake_all()
        if not self.conn.streams:
            self.close()

    def on_ping_ack(self, payload: bytes) -> None:
        self._ping_sent = None

    def on_fatal(self, message: str) -> None:
        self._wake_all()
        self._flush()  # the GOAWAY saying why
        self.abort()

    # used by the client

    def _write(self, data: bytes) -> None:
        """Frames written during one loop iteration leave in one ``transport.write`` (one syscall)."""
        if self.transport is None:
            return
        if not self._coalesce:
            self.transport.write(data)
        elif self._wbuf is None:
            self._wbuf = [data]
            self.loop.call_soon(self._flush)
        else:
            self._wbuf.append(data)

    def _flush(self) -> None:
        buf = self._wbuf
        self._wbuf = None
        if buf and self.transport is not None:
            self.transport.write(buf[0] if len(buf) == 1 else b"".join(buf))

    async def wait_slot(self) -> None:
        """Wait (FIFO) until a stream slot frees, the connection becomes unusable or settings change."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self._slot_waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._wake_one()  # we were handed a turn we won't use: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(fut)
            raise

    @property
    def has_waiters(self) -> bool:
        return bool(self._slot_waiters)

    @property
    def can_open(self) -> bool:
        """A stream can be opened now, ahead of no waiting caller (``conn.usable``, ``conn.has_slot``
        and not ``has_waiters``, in one call)."""
        c = self.conn
        return not self._slot_waiters and c.usable and c.has_slot

    def _wake_one(self) -> None:
        while self._slot_waiters:
            f = self._slot_waiters.popleft()
            if not f.done():
                f.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._slot_waiters:
            f = self._slot_waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _on_keepalive(self) -> None:
        self._keepalive = None
        if self.transport is None:
            return
        now = self.loop.time()
        if self._ping_sent is not None:
            if now - self._ping_sent > self._keepalive_timeout_s:
                self.conn.fail("keepalive ping not answered", NO_ERROR)
                return
        elif self.conn.streams and not self._rx:
            # streams are waiting and the server has been silent for a whole period: is it alive?
            self._ping_sent = now
            self.conn.ping()
        self._rx = False
        delay = self._keepalive_timeout_s if self._ping_sent is not None else self._keepalive_s
        self._keepalive = self.loop.call_later(delay, self._on_keepalive)

    def close(self) -> None:
        """Graceful: GOAWAY then close the transport (streams still open fail as connection lost)."""
        if self.transport is not None:
            self.conn.close()
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
