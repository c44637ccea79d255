"""A lean HTTP/2 client connection: the pure connection state machine.

Written for one job: gRPC calls to an engine over cleartext HTTP/2 (h2c with prior knowledge) at the
lowest CPU cost per received message. ``H2Connection`` is the pure protocol core: ``receive(bytes)``
parses frames and calls the methods of ``H2Stream`` objects and of a ``ConnectionListener``; bytes to
send go to an injected ``write`` callable. No clock, no asyncio: unit tests drive it with bytes. The
frame codec is in h2_frames.py, the asyncio shell around a connection (``H2Protocol``) in h2_protocol.py.

Flow control: we advertise a large window for the connection (16 MiB) and 1 MiB per stream, and give
credit back when a quarter of a stream's has been received, so a server rarely waits for us. Received
data is credited as it arrives, on the connection always; on a stream that holds its credit
(``credit_hold``: a generation's, whose consumer writes to a client that may stop reading) only while
what it has not consumed yet
(``backlog``) is within that bound: past it the stream's credit waits until the consumer catches up
(``release_credit``), so the engine stops sending that answer rather than the node buffering all of it
(at most the stream window and the bound are held: ~2 MiB, where a 16 MiB stream window let a slow
reader's answer be buffered whole), and the connection's other streams go on. On the
send side the peer's windows and frame size are respected: a request body that does not fit waits for
WINDOW_UPDATE.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

from shepherd.node.engines.h2_frames import (
    _GOAWAY,
    _HDR,
    _HDR_MSG,
    _SETTING,
    _U32,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    ENHANCE_YOUR_CALM,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    LOCAL_WINDOW,
    MAX_STREAM_ID,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    H2ProtocolError,
    HeaderDecoder,
    Headers,
    frame,
    frame_header,
    goaway_frame,
    headers_frames,
    ping_frame,
    rst_stream_frame,
    settings_frame,
    window_update_frame,
)

# grpc_data(conn, data, off, max_frame): the runs of whole plain gRPC DATA frames from data[off] on taken in
# C, the offset of the first frame not taken (the frame loop's); None without the extension (setup.py)
_grpc_data: Callable[[object, bytes, int, int], int] | None = None
try:
    from shepherd.node.engines import _h2fast

    _grpc_data = _h2fast.grpc_data
except ImportError:  # pragma: no cover - without a C compiler
    pass


# the most bytes of one header block (HEADERS + CONTINUATION) we gather before decoding it: the decoder
# refuses a header list over 64 KiB anyway; a server sending CONTINUATION frames without END_HEADERS for
# ever would otherwise grow the block without bound
MAX_HEADER_BLOCK = 256 * 1024


class H2Stream:
    """One client stream; subclass and override the ``on_*`` methods (they must not raise).

    The connection sets ``stream_id`` and the flow-control fields; subclasses hold what they parse.
    """

    __slots__ = (
        "_pending",
        "_pending_off",
        "conn",
        "credit_held",
        "credit_hold",
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
        self.credit_hold = 0  # bytes not consumed past which the stream's credit waits (0: never)
        self.credit_held = False  # its credit is waiting for the consumer (``H2Connection.release_credit``)

    def backlog(self) -> int:
        """Bytes received and not consumed yet (what ``credit_hold`` bounds)."""
        return 0

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
        stream_window: int = STREAM_WINDOW,
    ) -> None:
        self._write = write
        self._listener = listener
        self._decoder = HeaderDecoder()
        self.streams: dict[int, H2Stream] = {}
        self.next_stream_id = 1
        self.local_window = local_window  # the connection's
        self.stream_window = min(stream_window, local_window)  # each stream's
        self._credit_threshold = max(1, self.stream_window // 4)  # (the connection's credit too)
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
        self._cont_size = 0  # its bytes so far, frame headers included (bounded: MAX_HEADER_BLOCK)

    # -- output

    def start(self) -> None:
        """Write the connection preface, our SETTINGS and the connection window increase."""
        out = PREFACE + settings_frame(
            {SETTINGS_ENABLE_PUSH: 0, SETTINGS_INITIAL_WINDOW_SIZE: self.stream_window}
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

    def _stream_credit(self, s: H2Stream, sid: int) -> None:
        """Credit a stream for what it received, unless its consumer is behind (then later)."""
        if s.credit_held:  # (its backlog is not summed again for every frame while it waits)
            return
        if s.credit_hold and s.backlog() > s.credit_hold:
            s.credit_held = True
            return
        self._write(window_update_frame(sid, s.recv_unacked))
        s.recv_unacked = 0

    def release_credit(self, s: H2Stream) -> None:
        """The stream's consumer caught up: the credit it held back goes to the server."""
        if not s.credit_held:
            return
        s.credit_held = False
        live = not s.remote_closed and self.failed is None and self.streams.get(s.stream_id) is s
        if s.recv_unacked and live:
            self._write(window_update_frame(s.stream_id, s.recv_unacked))
            s.recv_unacked = 0

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
        n = len(data)
        off = 0
        fast = _grpc_data
        try:  # (the frame loop inline: this runs once per engine message of a paced stream)
            if fast is not None:  # whole plain gRPC DATA frames (a paced engine's tokens): read in C
                off = fast(self, data, 0, DEFAULT_MAX_FRAME)  # (its stream callbacks' errors: as below)
                if off == n:
                    return
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
                    if fast is not None and not flags:  # the runs from here on in C, as above
                        taken = fast(self, data, start - 9, DEFAULT_MAX_FRAME)
                        if taken > start - 9:  # (only ever forward: the loop stays bounded by the data)
                            off = taken
                            continue
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
                                self._stream_credit(s, sid)
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
                        self._cont_size = end - start
                elif ftype == CONTINUATION:
                    if self._cont is None or self._cont[0] != sid:
                        raise H2ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
                    parts = self._cont[2]
                    parts.append(data[start:end])
                    self._cont_size += 9 + end - start  # (a frame's header counts: empty frames add up too)
                    if self._cont_size > MAX_HEADER_BLOCK:
                        raise H2ProtocolError(
                            ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_BLOCK} bytes"
                        )
                    if flags & FLAG_END_HEADERS:
                        csid, es, parts = self._cont
                        self._cont = None
                        self._headers(csid, b"".join(parts), es)
                else:
                    self._control(ftype, flags, sid, data[start:end])
        except H2ProtocolError as e:
            self.fail(str(e), e.code)
            return
        if off < n:
            self._rbuf = data[off:]

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
            self._stream_credit(s, sid)
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
