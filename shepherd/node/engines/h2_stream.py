"""One gRPC call on the lean HTTP/2 transport: ``GrpcStream``, its deadlines and its status.

``GrpcStream`` is an ``H2Stream`` (h2_conn.py) that parses a gRPC response: messages land in a deque
(whole ones straight from the connection's frame loop), the status comes from the trailers (or from a
reset, an HTTP status, a lost connection), and ``wait()`` gives the consumer a future only when the
deque is empty. ``Deadlines`` puts the calls sharing one timeout behind one timer. gRPC status codes map
to ``EngineError`` through errors.py's table (``map_status``, ``RpcStatus``);
``grpc_message`` frames a request body.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import urllib.parse
from collections.abc import Callable

from shepherd.node.engines.errors import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    MAX_DETAILS,
    OK,
    PERMISSION_DENIED,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    UNKNOWN,
    engine_error,
)
from shepherd.node.engines.h2_conn import H2Stream
from shepherd.node.engines.h2_frames import (
    CANCEL,
    ENHANCE_YOUR_CALM,
    INADEQUATE_SECURITY,
    REFUSED_STREAM,
    Headers,
)
from shepherd.proto.engine_types import EngineError

_PREFIX = struct.Struct(">BI")

# the largest response message taken (its length prefix says more: the call fails at once, nothing is
# buffered); grpc's own default is 4 MiB, GetTokenizer's zip may come as one message of several
MAX_MESSAGE = 64 * 1024 * 1024

# HTTP/2 RST_STREAM code -> gRPC status (gRPC's PROTOCOL-HTTP2 "Errors" table)
_RST_STATUS = {
    REFUSED_STREAM: UNAVAILABLE,
    CANCEL: CANCELLED,
    ENHANCE_YOUR_CALM: RESOURCE_EXHAUSTED,
    INADEQUATE_SECURITY: PERMISSION_DENIED,
}
# HTTP status of a non-gRPC answer -> gRPC status (gRPC's http-grpc-status-mapping)
_HTTP_STATUS = {
    b"400": INTERNAL,
    b"401": UNAUTHENTICATED,
    b"403": PERMISSION_DENIED,
    b"404": UNIMPLEMENTED,
    b"429": UNAVAILABLE,
    b"502": UNAVAILABLE,
    b"503": UNAVAILABLE,
    b"504": UNAVAILABLE,
}


def map_status(code: int, details: str) -> EngineError:
    """A gRPC status -> EngineError, through the transports' one table (``errors.engine_error``)."""
    return engine_error(code, details)


class RpcStatus(Exception):
    """A call ended with a non-OK gRPC status (internal; public methods raise ``map_status`` of it)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    def engine_error(self) -> EngineError:
        return map_status(self.code, self.details)


def grpc_message(body: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return _PREFIX.pack(0, len(body)) + body


def _header_fields(headers: Headers) -> tuple[bytes | None, bytes | None, bytes | None, bytes]:
    """(:status, content-type, grpc-status, grpc-message) of a header block."""
    status = ctype = gstatus = None
    gmsg = b""
    for k, v in headers:
        if k == b":status":
            status = v
        elif k == b"grpc-status":
            gstatus = v
        elif k == b"grpc-message":
            gmsg = v
        elif k == b"content-type":
            ctype = v
    return status, ctype, gstatus, gmsg


# id(headers) -> (headers, its fields): the tuple is held, so its id is not reused while it is here
_HEADER_FIELDS: dict[int, tuple[Headers, bytes | None, bytes | None, bytes | None, bytes]] = {}


class GrpcStream(H2Stream):
    """One gRPC call: response messages in ``messages`` (bytes), status when ``done``.

    ``wait()`` returns a future resolved at the next arrival (message, end or error); the consumer awaits
    it only when ``messages`` is empty, so a burst of messages costs a single wake-up. Or the consumer
    sets ``listener``: then each arrival calls it at once, from the connection's frame loop (no future,
    no task wake-up per message), until it is cleared.
    """

    __slots__ = (
        "_headers_seen",
        "_loop",
        "_need",
        "_partial",
        "_waiter",
        "code",
        "deadlines",
        "details",
        "done",
        "listener",
        "messages",
        "timer",
        "unprocessed",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.unprocessed = False  # the server says it never processed the call: safe to send again
        self._loop = loop
        self.messages: collections.deque[bytes] = collections.deque()
        self.done = False
        self.code = UNKNOWN
        self.details = ""
        self.timer: asyncio.TimerHandle | None = None
        self.deadlines: Deadlines | None = None  # or ``timer``: what ends the call at its deadline
        self._waiter: asyncio.Future[None] | None = None
        self.listener: Callable[[], None] | None = None  # called at each arrival instead of a wake-up
        self._headers_seen = False
        self._partial = bytearray()  # an incomplete message (prefix included)
        self._need = 0  # total bytes of that message once its prefix is known, else 0
        self.grpc_messages = self.messages  # whole messages straight from the frame loop (no partial)

    # consumer side

    def backlog(self) -> int:
        """Whole messages not taken yet (a message still arriving is not held back: it must arrive for
        the consumer to take anything, however large)."""
        return sum(map(len, self.messages))

    def consumed(self) -> None:
        """The consumer has taken every message there was: credit held back (``credit_hold``) goes out."""
        if self.credit_held and self.conn is not None:
            self.conn.release_credit(self)

    def wait(self) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._waiter = fut
        return fut

    def cancel(self, code: int = CANCELLED, details: str = "cancelled by the client") -> None:
        """Give up: RST_STREAM(CANCEL) so the server frees the request."""
        if self.conn is not None:
            self.conn.reset_stream(self, CANCEL)
        self._finish(code, details)

    def expire(self) -> None:
        self.timer = None
        if not self.done:
            self.cancel(DEADLINE_EXCEEDED, "deadline exceeded")

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)
        elif self.listener is not None:
            self.listener()

    def _finish(self, code: int, details: str) -> None:
        if self.done:
            return
        self.done = True
        self.grpc_messages = None
        self.code = code
        self.details = details
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        dl = self.deadlines
        if dl is not None:
            self.deadlines = None
            dl.discard(self)
        self._wake()

    def _fail_and_reset(self, code: int, details: str) -> None:
        self._finish(code, details)
        if self.conn is not None:
            self.conn.reset_stream(self, CANCEL)

    # connection side (H2Stream)

    def on_headers(self, headers: Headers, end_stream: bool) -> None:
        if self.done:
            return
        # a warm connection hands the same header tuples over and over (HeaderDecoder's cache)
        hit = _HEADER_FIELDS.get(id(headers))
        if hit is not None and hit[0] is headers:
            _, status, ctype, gstatus, gmsg = hit
        else:
            status, ctype, gstatus, gmsg = _header_fields(headers)
            if len(_HEADER_FIELDS) >= 64:
                _HEADER_FIELDS.clear()
            _HEADER_FIELDS[id(headers)] = (headers, status, ctype, gstatus, gmsg)
        if not self._headers_seen:
            self._headers_seen = True
            if gstatus is None:
                if status != b"200":
                    code = _HTTP_STATUS.get(status or b"", UNKNOWN)
                    self._fail_and_reset(code, f"HTTP status {(status or b'?').decode(errors='replace')}")
                    return
                if ctype is not None and not ctype.startswith(b"application/grpc"):
                    self._fail_and_reset(UNKNOWN, f"unexpected content-type {ctype.decode(errors='replace')}")
                    return
        if end_stream:
            self._trailers(gstatus, gmsg)

    def _trailers(self, gstatus: bytes | None, gmsg: bytes) -> None:
        if gstatus is None:
            self._finish(UNKNOWN, "response trailers without grpc-status")
            return
        try:
            code = int(gstatus)
        except ValueError:
            code = UNKNOWN
        # (a huge grpc-message is cut before it is unquoted; engine_error bounds what is left)
        details = urllib.parse.unquote(gmsg[: 4 * MAX_DETAILS].decode("utf-8", "replace")) if gmsg else ""
        if code == OK and self._partial:
            self._finish(INTERNAL, "stream ended inside a message")
            return
        self._finish(code, details)

    def on_grpc_messages(self) -> None:
        # (_h2fast.grpc_data does this itself for a GrpcStream, registered below: keep the two alike)
        if self._waiter is not None:
            self._wake()
        elif self.listener is not None:
            self.listener()

    def on_data(self, buf: bytes, start: int, end: int, end_stream: bool) -> None:
        if self.done:
            return
        msgs = self.messages
        if self._partial:
            p = self._partial
            if not self._need:
                take = min(5 - len(p), end - start)
                p += buf[start : start + take]
                start += take
                if len(p) < 5:
                    self._data_end(end_stream)
                    return
                flag, mlen = _PREFIX.unpack_from(p)
                if flag:
                    self._fail_and_reset(INTERNAL, "compressed message (compression not negotiated)")
                    return
                if mlen > MAX_MESSAGE:
                    self._too_large(mlen)
                    return
                self._need = 5 + mlen
            take = min(self._need - len(p), end - start)
            p += buf[start : start + take]
            start += take
            if len(p) < self._need:
                self._data_end(end_stream)
                return
            msgs.append(bytes(p[5:]))
            self._partial = bytearray()
            self._need = 0
        unpack = _PREFIX.unpack_from
        while end - start >= 5:
            flag, mlen = unpack(buf, start)
            if flag:
                self._fail_and_reset(INTERNAL, "compressed message (compression not negotiated)")
                return
            mend = start + 5 + mlen
            if mend > end:
                if mlen > MAX_MESSAGE:
                    self._too_large(mlen)
                    return
                self._need = 5 + mlen
                break
            msgs.append(buf[start + 5 : mend])
            start = mend
        if start < end:
            self._partial = bytearray(buf[start:end])
        self.grpc_messages = None if self._partial else msgs
        if msgs and (self._waiter is not None or self.listener is not None):
            self._wake()
        if end_stream:
            self._data_end(end_stream)

    def _too_large(self, mlen: int) -> None:
        self._partial = bytearray()
        self._fail_and_reset(
            INTERNAL, f"response message of {mlen} bytes, more than the {MAX_MESSAGE} the node takes"
        )

    def _data_end(self, end_stream: bool) -> None:
        if end_stream:
            self._finish(INTERNAL, "stream ended without trailers")

    def on_reset(self, code: int) -> None:
        self.unprocessed = code == REFUSED_STREAM and not self._headers_seen and not self.messages
        self._finish(_RST_STATUS.get(code, INTERNAL), f"stream reset by the server (HTTP/2 error {code})")

    def on_connection_error(self, message: str, unprocessed: bool) -> None:
        self.unprocessed = unprocessed and not self._headers_seen and not self.messages
        self._finish(UNAVAILABLE, message)


class Deadlines:
    """The deadlines of calls that share one timeout, behind one timer (arming and cancelling a timer
    per call costs ~1.7 µs; a dict insertion and deletion, ~0.2 µs). With one timeout, deadlines come
    in the order the calls start, so the earliest is the oldest entry; calls that end early leave."""

    __slots__ = ("_due", "_timer", "loop", "timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self._due: dict[GrpcStream, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._due)

    def add(self, stream: GrpcStream) -> None:
        due = self.loop.time() + self.timeout
        self._due[stream] = due
        stream.deadlines = self
        if self._timer is None:
            self._timer = self.loop.call_at(due, self._fire)

    def discard(self, stream: GrpcStream) -> None:
        due = self._due
        due.pop(stream, None)
        if not due and self._timer is not None:  # the last call ended: no wake-up for nothing
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        due = self._due
        now = self.loop.time() + 0.001  # timers fire with a millisecond's precision
        for _ in range(len(due)):  # bounded: each turn expires one call or stops
            stream, when = next(iter(due.items()))
            if when > now:
                self._timer = self.loop.call_at(when, self._fire)
                return
            del due[stream]
            stream.deadlines = None
            stream.expire()


try:  # the C read calls a GrpcStream's listener itself (no Python frame per paced token)
    from shepherd.node.engines import _h2fast
except ImportError:  # pragma: no cover - without a C compiler
    pass
else:
    _direct = getattr(_h2fast, "direct_stream", None)  # (None: a build from before it: the method)
    if _direct is not None:
        _direct(GrpcStream)
