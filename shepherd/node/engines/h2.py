"""Engine client over a lean HTTP/2 transport written on asyncio (no threads): SGLang and vLLM services.

Same behaviour and error mapping as ``engine_grpc.GrpcEngineClient`` (statuses go through the same
``map_rpc_error``), at a fraction of the CPU per message: there is no poller thread, frames are parsed
in ``data_received`` and each stream's messages land in a deque; the consumer drains the deque and
awaits a future only when it is empty, so many messages in one read cost one wake-up.

One HTTP/2 connection per worker (``h2_conn.H2Protocol``), multiplexing every call; on loss the next
call reconnects, with exponential back-off between failed attempts (calls during the back-off fail fast
with EngineUnavailable, as grpcio's do in TRANSIENT_FAILURE).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import struct
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto.generated import common_pb2

from shepherd.node.engines import h2_conn as h2
from shepherd.node.engines.backoff import Backoff
from shepherd.node.engines.grpcio import map_rpc_error
from shepherd.proto import engine_codec as codec
from shepherd.proto.engine_types import (
    EngineError,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    KvEventBatch,
    ModelInfo,
    ServerInfo,
)

M = TypeVar("M", bound=Message)

# gRPC status codes (numbers as on the wire)
OK = 0
CANCELLED = 1
UNKNOWN = 2
DEADLINE_EXCEEDED = 4
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
UNAUTHENTICATED = 16

_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}
_PREFIX = struct.Struct(">BI")

# HTTP/2 RST_STREAM code -> gRPC status (gRPC's PROTOCOL-HTTP2 "Errors" table)
_RST_STATUS = {
    h2.REFUSED_STREAM: UNAVAILABLE,
    h2.CANCEL: CANCELLED,
    h2.ENHANCE_YOUR_CALM: RESOURCE_EXHAUSTED,
    h2.INADEQUATE_SECURITY: PERMISSION_DENIED,
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
    """A gRPC status -> EngineError, through engine_grpc.map_rpc_error so both transports agree."""
    status = _STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    err = grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details or None)
    return map_rpc_error(err)


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


_UNPROCESSED_RETRIES = 5  # transparent re-sends of a call the server never processed


def _header_fields(headers: h2.Headers) -> tuple[bytes | None, bytes | None, bytes | None, bytes]:
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
_HEADER_FIELDS: dict[int, tuple[h2.Headers, bytes | None, bytes | None, bytes | None, bytes]] = {}


class GrpcStream(h2.H2Stream):
    """One gRPC call: response messages in ``messages`` (bytes), status when ``done``.

    ``wait()`` returns a future resolved at the next arrival (message, end or error); the consumer awaits
    it only when ``messages`` is empty, so a burst of messages costs a single wake-up.
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
        self._headers_seen = False
        self._partial = bytearray()  # an incomplete message (prefix included)
        self._need = 0  # total bytes of that message once its prefix is known, else 0
        self.grpc_messages = self.messages  # whole messages straight from the frame loop (no partial)

    # consumer side

    def wait(self) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._waiter = fut
        return fut

    def cancel(self, code: int = CANCELLED, details: str = "cancelled by the client") -> None:
        """Give up: RST_STREAM(CANCEL) so the server frees the request."""
        if self.conn is not None:
            self.conn.reset_stream(self, h2.CANCEL)
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
            self.conn.reset_stream(self, h2.CANCEL)

    # connection side (H2Stream)

    def on_headers(self, headers: h2.Headers, end_stream: bool) -> None:
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
        details = urllib.parse.unquote(gmsg.decode("utf-8", "replace")) if gmsg else ""
        if code == OK and self._partial:
            self._finish(INTERNAL, "stream ended inside a message")
            return
        self._finish(code, details)

    def on_grpc_messages(self) -> None:
        if self._waiter is not None:
            self._wake()

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
                self._need = 5 + mlen
                break
            msgs.append(buf[start + 5 : mend])
            start = mend
        if start < end:
            self._partial = bytearray(buf[start:end])
        self.grpc_messages = None if self._partial else msgs
        if msgs and self._waiter is not None:
            self._wake()
        if end_stream:
            self._data_end(end_stream)

    def _data_end(self, end_stream: bool) -> None:
        if end_stream:
            self._finish(INTERNAL, "stream ended without trailers")

    def on_reset(self, code: int) -> None:
        self.unprocessed = code == h2.REFUSED_STREAM and not self._headers_seen and not self.messages
        self._finish(_RST_STATUS.get(code, INTERNAL), f"stream reset by the server (HTTP/2 error {code})")

    def on_connection_error(self, message: str, unprocessed: bool) -> None:
        self.unprocessed = unprocessed and not self._headers_seen and not self.messages
        self._finish(UNAVAILABLE, message)


_MAX_DEADLINE_GROUPS = 8


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
        self._due.pop(stream, None)

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


def parse_target(target: str) -> tuple[str, int, str | None]:
    """A gRPC target -> (host, port, unix socket path or None). Accepts host:port, [v6]:port, dns:///,
    ipv4:, ipv6:, unix:path."""
    t = target.strip()
    if t.startswith("unix:"):
        path = t[5:]
        if path.startswith("//"):
            path = path[2:]
        return "localhost", 0, path
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(prefix):
            t = t[len(prefix) :]
            break
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif t.count(":") == 1:
        host, _, port = t.partition(":")
    else:
        host, port = t, ""
    return host, int(port) if port else 443, None


def _path(kind: str, method: str) -> str:
    return f"/{codec.VLLM_SERVICE if kind == 'vllm' else codec.SGLANG_SERVICE}/{method}"


_SG_GENERATE = _path("sglang", "Generate")
_VL_GENERATE = _path("vllm", "Generate")
_SG_PARSE = sg.GenerateResponse.FromString
_VL_PARSE = vl.GenerateResponse.FromString

_MAX_WAITS = 10_000  # bound on the wake-ups one call waits for (a slot, a connection, its end)


class H2EngineClient:
    """EngineClient for ``grpc://``, ``sglang://`` and ``vllm://`` workers over the lean HTTP/2 transport."""

    def __init__(
        self,
        url: str,
        target: str,
        kind: str | None = None,
        *,
        connect_timeout: float = 5.0,
        keepalive_s: float = 60.0,
        keepalive_timeout_s: float = 20.0,
        window: int = h2.LOCAL_WINDOW,
        backoff: Backoff | None = None,
        coalesce_writes: bool = True,
        tls: ssl.SSLContext | None = None,  # TLS (ALPN h2) to the engine; None: cleartext h2c
    ) -> None:
        self.url = url
        self.target = target
        self.kind = kind or "unknown"
        self._host, self._port, self._unix = parse_target(target)
        authority = "localhost" if self._unix else f"{self._host}:{self._port}"
        if ":" in self._host and not self._unix:
            authority = f"[{self._host}]:{self._port}"
        self._tls = tls
        self._headers = h2.RequestHeaders(authority, scheme="https" if tls else "http")
        self._connect_timeout = connect_timeout
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._window = window
        self._coalesce = coalesce_writes
        self._backoff = backoff or Backoff()
        self._proto: h2.H2Protocol | None = None
        self._protos: set[h2.H2Protocol] = set()
        self._connecting: asyncio.Task[h2.H2Protocol] | None = None
        self._deadlines: dict[float, Deadlines] = {}  # by timeout
        self._last_error = ""
        self._closed = False
        self.connects = 0  # successful connections made (observability and tests)

    # ------------------------------------------------------------------------------------------ connection

    async def _protocol(self, deadline: float | None) -> h2.H2Protocol:
        p = self._proto
        if p is not None and p.conn.usable:
            return p
        if self._closed:
            raise RpcStatus(UNAVAILABLE, "client closed")
        self._proto = None
        loop = asyncio.get_running_loop()
        task = self._connecting
        if task is None:
            now = loop.time()
            if not self._backoff.ready(now):
                raise RpcStatus(
                    UNAVAILABLE,
                    f"{self._last_error} (next connection attempt in {self._backoff.until - now:.2f}s)",
                )
            task = self._connecting = loop.create_task(self._connect())
            task.add_done_callback(_retrieve)
        if deadline is None:
            return await asyncio.shield(task)
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise RpcStatus(DEADLINE_EXCEEDED, "deadline exceeded while connecting") from None

    async def _connect(self) -> h2.H2Protocol:
        loop = asyncio.get_running_loop()

        def factory() -> h2.H2Protocol:
            return h2.H2Protocol(
                loop,
                local_window=self._window,
                keepalive_s=self._keepalive_s,
                keepalive_timeout_s=self._keepalive_timeout_s,
                coalesce_writes=self._coalesce,
            )

        proto: h2.H2Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._unix is not None:
                    host = "localhost" if self._tls else None
                    _, proto = await loop.create_unix_connection(
                        factory, self._unix, ssl=self._tls, server_hostname=host
                    )
                else:
                    _, proto = await loop.create_connection(factory, self._host, self._port, ssl=self._tls)
                await proto.ready
        except (OSError, TimeoutError) as e:
            if proto is not None:
                proto.abort()
            why = "connect timeout" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
            self._last_error = f"cannot connect to {self.target}: {why}"
            self._backoff.failed(loop.time())
            raise RpcStatus(UNAVAILABLE, self._last_error) from None
        finally:
            self._connecting = None
        self._backoff.succeeded()
        self.connects += 1
        if self._closed:
            proto.close()
            raise RpcStatus(UNAVAILABLE, "client closed")
        self._proto = proto
        self._protos.add(proto)
        proto.closed.add_done_callback(lambda _f: self._protos.discard(proto))
        return proto

    def _start_now(self, path: str, body: bytes, timeout: float | None) -> GrpcStream | None:
        """Open a call and send its request at once when a connection and a slot are ready, else None."""
        p = self._proto
        if p is None or not p.can_open:
            return None
        loop = p.loop
        stream = GrpcStream(loop)
        p.conn.open_stream(stream, self._headers.block(path, timeout), grpc_message(body))
        if timeout is not None:
            dl = self._deadlines.get(timeout)
            if dl is None or dl.loop is not loop:
                if len(self._deadlines) >= _MAX_DEADLINE_GROUPS:  # timeouts that vary: a timer each
                    stream.timer = loop.call_later(timeout, stream.expire)
                    return stream
                # a timeout seen before shares a timer with its calls (generation, health checks, loads)
                dl = self._deadlines[timeout] = Deadlines(loop, timeout)
            dl.add(stream)
        return stream

    async def _start(self, path: str, body: bytes, timeout: float | None) -> GrpcStream:
        """Open a call and send its request; no suspension when a connection and a slot are ready."""
        ready = self._start_now(path, body, timeout)
        if ready is not None:
            return ready
        loop = asyncio.get_running_loop()
        stream = GrpcStream(loop)
        deadline = None if timeout is None else loop.time() + timeout
        waited = False  # once woken in FIFO order it is our turn, whoever else waits
        for _ in range(_MAX_WAITS):
            p = await self._protocol(deadline)
            c = p.conn
            if c.has_slot and (waited or not p.has_waiters):
                remaining = None if deadline is None else max(0.001, deadline - loop.time())
                c.open_stream(stream, self._headers.block(path, remaining), grpc_message(body))
                if deadline is not None:
                    stream.timer = loop.call_at(deadline, stream.expire)
                return stream
            waited = True
            if deadline is None:
                await p.wait_slot()
            else:
                try:
                    await asyncio.wait_for(p.wait_slot(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise RpcStatus(DEADLINE_EXCEEDED, "deadline exceeded waiting for a stream") from None
        raise RpcStatus(UNAVAILABLE, "no stream could be opened")

    # ------------------------------------------------------------------------------------------ calls

    async def call_unary(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> M:
        """One unary call; raises RpcStatus (internal error type) on a non-OK status."""
        stream = await self._start(path, request.SerializeToString(), timeout)
        try:
            for _ in range(_MAX_WAITS):
                if stream.done:
                    break
                await stream.wait()
        finally:
            if not stream.done:
                stream.cancel()
        if stream.code != OK:
            raise RpcStatus(stream.code, stream.details)
        if len(stream.messages) != 1:
            raise RpcStatus(INTERNAL, f"unary call got {len(stream.messages)} messages")
        try:
            return response_type.FromString(stream.messages[0])
        except DecodeError as e:
            raise RpcStatus(INTERNAL, f"cannot parse the response: {e}") from None

    async def call_stream(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> AsyncIterator[M]:
        """A server-streaming call; closing the iterator early cancels the call (RST_STREAM)."""
        stream = await self._start(path, request.SerializeToString(), timeout)
        parse = response_type.FromString
        msgs = stream.messages
        try:
            while True:
                while msgs:
                    yield parse(msgs.popleft())
                if stream.done:
                    break
                await stream.wait()
        except DecodeError as e:
            raise RpcStatus(INTERNAL, f"cannot parse a response: {e}") from None
        finally:
            if not stream.done:
                stream.cancel()
        if stream.code != OK:
            raise RpcStatus(stream.code, stream.details)

    async def _unary(self, method: str, request: Message, response_type: type[M], timeout: float) -> M:
        try:
            return await self.call_unary(_path(self.kind, method), request, response_type, timeout)
        except RpcStatus as e:
            raise e.engine_error() from None

    # ------------------------------------------------------------------------------------------ EngineClient

    async def detect(self, timeout: float = 5.0) -> str:
        """Settle ``kind`` by asking GetServerInfo of each service (SGLang first)."""
        if self.kind in ("sglang", "vllm"):
            return self.kind
        try:
            await self.call_unary(
                _path("sglang", "GetServerInfo"), sg.GetServerInfoRequest(), sg.GetServerInfoResponse, timeout
            )
            self.kind = "sglang"
        except RpcStatus as e:
            if e.code != UNIMPLEMENTED:
                raise e.engine_error() from None
            try:
                await self.call_unary(
                    _path("vllm", "GetServerInfo"),
                    vl.GetServerInfoRequest(),
                    vl.GetServerInfoResponse,
                    timeout,
                )
            except RpcStatus as e2:
                raise e2.engine_error() from None
            self.kind = "vllm"
        return self.kind

    async def generate(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[EngineEvent]:
        call = GenerateCall(self, req, timeout)
        try:
            async for batch in call:
                for ev in batch:
                    yield ev
        finally:
            call.close()

    def generate_batches(self, req: GenerateRequest, timeout: float | None = None) -> GenerateCall:
        """Like ``generate``, but yields every event that is already here at once: a network read that
        carried many messages costs the consumer one wake-up and one downstream write."""
        return GenerateCall(self, req, timeout)

    async def abort(self, request_id: str, reason: str = "") -> None:
        with contextlib.suppress(RpcStatus):
            if self.kind == "vllm":
                await self.call_unary(
                    _path("vllm", "Abort"), vl.AbortRequest(request_ids=[request_id]), vl.AbortResponse, 5.0
                )
            else:
                await self.call_unary(
                    _path("sglang", "Abort"),
                    sg.AbortRequest(request_id=request_id, reason=reason),
                    sg.AbortResponse,
                    5.0,
                )
        # best effort: the stream cancellation also frees the request

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            if self.kind == "unknown":
                await self.detect(timeout)
            if self.kind == "vllm":
                r: Any = await self.call_unary(
                    _path("vllm", "HealthCheck"), vl.HealthCheckRequest(), vl.HealthCheckResponse, timeout
                )
            else:
                r = await self.call_unary(
                    _path("sglang", "HealthCheck"), sg.HealthCheckRequest(), sg.HealthCheckResponse, timeout
                )
        except (RpcStatus, EngineError):
            return False
        return bool(r.healthy)

    async def model_info(self) -> ModelInfo:
        if self.kind == "vllm":
            r: Any = await self._unary("GetModelInfo", vl.GetModelInfoRequest(), vl.GetModelInfoResponse, 5.0)
        else:
            r = await self._unary("GetModelInfo", sg.GetModelInfoRequest(), sg.GetModelInfoResponse, 5.0)
        return codec.decode_model_info(r)

    async def server_info(self) -> ServerInfo:
        if self.kind == "vllm":
            r: Any = await self._unary(
                "GetServerInfo", vl.GetServerInfoRequest(), vl.GetServerInfoResponse, 5.0
            )
        else:
            r = await self._unary("GetServerInfo", sg.GetServerInfoRequest(), sg.GetServerInfoResponse, 5.0)
        return codec.decode_server_info(r, self.kind)

    async def loads(self) -> EngineLoad:
        if self.kind == "vllm":
            r: Any = await self._unary(
                "GetLoads", vl.GetLoadsRequest(include=["core"]), vl.GetLoadsResponse, 5.0
            )
        else:
            r = await self._unary("GetLoads", sg.GetLoadsRequest(include=["core"]), sg.GetLoadsResponse, 5.0)
        return codec.decode_loads(r)

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        """SubscribeKvEvents (server stream, no deadline); closing the iterator cancels the call."""
        from shepherd.node.dispatch.kv_feed import decode_kv_batch

        if self.kind == "unknown":
            await self.detect()
        req = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start_seq, load_records_before_first_batch=True
        )
        stream = cast(
            AsyncGenerator[Any, None],
            self.call_stream(_path(self.kind, "SubscribeKvEvents"), req, common_pb2.KvEventBatch, None),
        )
        try:
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    yield decode_kv_batch(msg)
        except RpcStatus as e:
            raise e.engine_error() from None

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        protos = list(self._protos)
        self._proto = None
        for p in protos:
            p.close()
        if protos:
            await asyncio.wait([p.closed for p in protos], timeout=2.0)


class GenerateCall:
    """One Generate call as an async iterator of event batches (``H2EngineClient.generate_batches``).

    An object rather than an async generator: every request creates, steps and closes one, and this
    costs less to do all three (no generator frame, no loop hooks). Closing it early (``aclose``, or an
    exception or a cancellation while it waits) cancels the call (RST_STREAM). The request is encoded
    and sent at the first ``__anext__``, which returns once the first messages arrived."""

    __slots__ = ("_client", "_closed", "_parse", "_req", "_single", "_stream", "_timeout")

    def __init__(self, client: H2EngineClient, req: GenerateRequest, timeout: float | None) -> None:
        self._client = client
        self._req = req
        self._timeout = timeout
        self._stream: GrpcStream | None = None
        self._parse: Callable[[bytes], Any] = _SG_PARSE
        self._single: str | None = None  # the engine kind when the request has one choice (decode_batch)
        self._closed = False

    def __aiter__(self) -> GenerateCall:
        return self

    async def __anext__(self) -> list[EngineEvent]:
        if self._closed:
            raise StopAsyncIteration
        try:
            stream = self._stream
            if stream is None:
                stream = await self._open()
            msgs = stream.messages
            while True:  # bounded by the messages and the end of the stream
                if msgs:
                    raws = list(msgs)
                    msgs.clear()
                    batch = codec.decode_batch(raws, self._parse, single=self._single)
                    if batch:
                        return batch
                    continue
                if stream.done:
                    break
                await stream.wait()
        except DecodeError as e:
            self.close()
            raise map_status(INTERNAL, f"cannot parse a response: {e}") from None
        except BaseException:
            self.close()
            raise
        self._closed = True
        if stream.code != OK:
            raise map_status(stream.code, stream.details)
        raise StopAsyncIteration

    async def _open(self) -> GrpcStream:
        client = self._client
        if client.kind == "unknown":
            await client.detect()
        req = self._req
        if client.kind == "vllm":
            body = codec.vllm_generate_bytes(req)
            self._parse = _VL_PARSE
            path = _VL_GENERATE
        else:
            body = codec.sglang_generate_bytes(req)
            path = _SG_GENERATE
        if req.sampling.n == 1:
            self._single = client.kind
        timeout = self._timeout
        stream: GrpcStream | None = None
        for _attempt in range(_UNPROCESSED_RETRIES + 1):
            stream = client._start_now(path, body, timeout)
            if stream is None:
                try:
                    stream = await client._start(path, body, timeout)
                except RpcStatus as e:
                    raise e.engine_error() from None
            self._stream = stream
            while not stream.done and not stream.messages:
                await stream.wait()
            # a call the server refused before processing it (REFUSED_STREAM, or above a GOAWAY's
            # last stream id: e.g. opened before its SETTINGS limit arrived) is sent again, as gRPC does
            if not (stream.done and stream.unprocessed):
                break
        assert stream is not None
        return stream

    def close(self) -> None:
        """End the call: cancelled (RST_STREAM) unless the server already ended it."""
        self._closed = True
        s = self._stream
        if s is not None and not s.done:
            s.cancel()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        s = self._stream
        if s is not None and not s.done:  # dropped unclosed: free the engine's request all the same
            with contextlib.suppress(Exception):
                s.cancel()


def _retrieve(task: asyncio.Task[h2.H2Protocol]) -> None:
    if not task.cancelled():
        task.exception()  # the callers that waited got it; don't warn when none did
