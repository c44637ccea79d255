"""A lean gRPC server: HTTP/2 (prior knowledge, cleartext) on an asyncio Protocol, serving the same
servicer objects as grpc.aio (their generated method handlers, collected from the ``add_*_to_server``
functions). It exists for benchmarks: grpc.aio costs the server ~400 µs per call and ~55 µs per
streamed message here, more than the gateway under test; this costs a fraction of that.

A streaming handler may yield ``bytes`` (a pre-encoded message) or a ``list`` of them (several
messages at once) besides protobuf messages.

Scope: unary-request RPCs (unary or server-streaming responses), identity encoding, flow control
both ways, PING, SETTINGS, RST_STREAM (client cancellation cancels the handler), GOAWAY, the
``grpc-timeout`` deadline. Per connection, responses are written in one ``transport.write`` per event
loop iteration, so a zero-latency stream goes out in a single write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, cast

import grpc

from shepherd.mock_engine.hpack import Decoder, HpackError
from shepherd.mock_engine.lean_grpc_calls import Abort, ServicerContext, Stream
from shepherd.mock_engine.lean_grpc_frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_INBOUND_FRAME,
    NO_ERROR,
    OUR_CONN_WINDOW,
    OUR_STREAM_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    TIMEOUT_UNITS,
    WINDOW_UPDATE,
    frame,
    trailers_block,
)


class GrpcH2Protocol(asyncio.Protocol):
    """One HTTP/2 connection carrying gRPC calls."""

    def __init__(self, server: LeanGrpcServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._out = bytearray()
        self._flush_scheduled = False
        self._decoder = Decoder()
        self._streams: dict[int, Stream] = {}
        self._blocked: dict[int, Stream] = {}
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = 16_384
        self._conn_send_window = DEFAULT_WINDOW
        self._recv_since_update = 0
        self._cont: tuple[int, int, bytearray] | None = None  # (stream id, flags, header block so far)
        self._last_stream = 0
        self._closing = False

    # ---- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self._server.connections.add(self)
        settings = (4).to_bytes(2, "big") + OUR_STREAM_WINDOW.to_bytes(4, "big")  # INITIAL_WINDOW_SIZE
        settings += (2).to_bytes(2, "big") + (0).to_bytes(4, "big")  # ENABLE_PUSH 0
        self._out += frame(SETTINGS, 0, 0, settings)
        self._out += frame(WINDOW_UPDATE, 0, 0, (OUR_CONN_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None
        for stream in list(self._streams.values()):
            self._cancel_stream(stream)
        self._streams.clear()
        self._blocked.clear()

    def close(self, error: int = NO_ERROR) -> None:
        """GOAWAY and close (server stop, or a connection error)."""
        if self._transport is None or self._closing:
            return
        self._closing = True
        self._out += frame(GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big") + error.to_bytes(4, "big"))
        self._flush()
        self._transport.close()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None:
            self._transport.write(bytes(self._out))
        self._out.clear()

    # ---- inbound -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._preface:
            if len(buf) < len(PREFACE):
                return
            if buf[: len(PREFACE)] != PREFACE:
                self.close(PROTOCOL_ERROR)
                return
            del buf[: len(PREFACE)]
            self._preface = True
        pos = 0
        n = len(buf)
        try:
            while n - pos >= 9:
                length = int.from_bytes(buf[pos : pos + 3], "big")
                if length > MAX_INBOUND_FRAME:
                    self.close(FRAME_SIZE_ERROR)
                    return
                end = pos + 9 + length
                if end > n:
                    break
                ftype = buf[pos + 3]
                flags = buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : end])
                pos = end
                self._on_frame(ftype, flags, sid, payload)
                if self._transport is None:
                    return
        except HpackError:
            self.close(COMPRESSION_ERROR)
            return
        del buf[:pos]
        self._flush()

    def _on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is not None and ftype != CONTINUATION:
            self.close(PROTOCOL_ERROR)
            return
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if self._cont is None or self._cont[0] != sid:
                self.close(PROTOCOL_ERROR)
                return
            self._cont[2].extend(payload)
            if flags & END_HEADERS:
                cont_sid, cont_flags, block = self._cont
                self._cont = None
                self._on_header_block(cont_sid, cont_flags, bytes(block))
        elif ftype == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif ftype == WINDOW_UPDATE:
            inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self._conn_send_window += inc
                self._resume_blocked()
            else:
                stream = self._streams.get(sid)
                if stream is not None:
                    stream.send_window += inc
                    if stream.pending or stream.trailers is not None:
                        self._resume(stream)
        elif ftype == PING:
            if not flags & ACK:
                self._out += frame(PING, ACK, 0, payload)
        elif ftype == RST_STREAM:
            stream = self._streams.pop(sid, None)
            if stream is not None:
                self._blocked.pop(sid, None)
                self._cancel_stream(stream)
        elif ftype == GOAWAY:
            self._closing = True
        # PRIORITY, PUSH_PROMISE (never from a client) and unknown types are ignored

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            ident = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if ident == 4:  # INITIAL_WINDOW_SIZE
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif ident == 5:  # MAX_FRAME_SIZE
                self._peer_max_frame = value
        self._out += frame(SETTINGS, ACK, 0)
        self._resume_blocked()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        pos = 0
        end = len(payload)
        if flags & PADDED:
            end -= payload[0]
            pos = 1
        if flags & PRIORITY_FLAG:
            pos += 5
        block = payload[pos:end]
        if not flags & END_HEADERS:
            self._cont = (sid, flags, bytearray(block))
            return
        self._on_header_block(sid, flags, block)

    def _on_header_block(self, sid: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)
        if sid in self._streams or sid <= self._last_stream:
            return  # trailers from the client (no client-streaming RPC here): nothing to do
        self._last_stream = sid
        stream = Stream(sid, headers, self._peer_initial_window)
        self._streams[sid] = stream
        if flags & END_STREAM:
            stream.remote_closed = True
            self._dispatch(stream)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        length = len(payload)
        self._recv_since_update += length
        if self._recv_since_update >= OUR_CONN_WINDOW // 4:
            self._out += frame(WINDOW_UPDATE, 0, 0, self._recv_since_update.to_bytes(4, "big"))
            self._recv_since_update = 0
        stream = self._streams.get(sid)
        if stream is None or stream.remote_closed:
            return
        if flags & PADDED and payload:
            payload = payload[1 : length - payload[0]]
        stream.body += payload
        if flags & END_STREAM:
            stream.remote_closed = True
            self._dispatch(stream)
        elif length:
            self._out += frame(WINDOW_UPDATE, 0, sid, length.to_bytes(4, "big"))

    # ---- calls -------------------------------------------------------------------------------------

    def _dispatch(self, stream: Stream) -> None:
        path = b""
        timeout: bytes | None = None
        for name, value in stream.headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = value
        handler = self._server.handlers.get(path)
        if handler is None:
            self._send_trailers(
                stream, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}"
            )
            return
        body = stream.body
        if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            if body[:1] == b"\x01":
                self._send_trailers(
                    stream, grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported"
                )
            else:
                self._send_trailers(stream, grpc.StatusCode.INTERNAL, "malformed request")
            return
        stream.ctx = ServicerContext(stream)
        stream.task = self._loop.create_task(self._serve(stream, handler, bytes(body[5:])))
        if timeout:
            unit = TIMEOUT_UNITS.get(timeout[-1:])
            with contextlib.suppress(ValueError):
                if unit is not None:
                    delay = int(timeout[:-1]) * unit
                    stream.deadline = self._loop.call_later(delay, self._deadline, stream)

    def _deadline(self, stream: Stream) -> None:
        if stream.task is not None and not stream.task.done():
            stream.expired = True
            stream.task.cancel()

    def _cancel_stream(self, stream: Stream) -> None:
        if stream.ctx is not None:
            stream.ctx.cancelled_by_peer = True
        if stream.deadline is not None:
            stream.deadline.cancel()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        if stream.drain is not None and not stream.drain.done():
            stream.drain.cancel()
        stream.pending.clear()
        stream.local_closed = True

    async def _serve(self, stream: Stream, handler: Any, payload: bytes) -> None:
        ctx = stream.ctx
        assert ctx is not None
        code = grpc.StatusCode.OK
        details = ""
        serialize = handler.response_serializer
        try:
            request = handler.request_deserializer(payload)
            if handler.unary_unary is not None:
                result = handler.unary_unary(request, ctx)
                if asyncio.iscoroutine(result):
                    result = await result
                if not self.send_message(stream, serialize(result)):
                    await self._drain(stream)
            elif handler.unary_stream is not None:
                result = handler.unary_stream(request, ctx)
                if hasattr(result, "__aiter__"):
                    try:
                        async for message in result:
                            if type(message) is list:  # several pre-encoded messages at once
                                for data in message:
                                    if not self.send_message(stream, data):
                                        await self._drain(stream)
                                continue
                            data = message if type(message) is bytes else serialize(message)
                            if not self.send_message(stream, data):
                                await self._drain(stream)
                    finally:
                        with contextlib.suppress(BaseException):
                            await result.aclose()
                else:
                    for message in result:
                        if not self.send_message(stream, serialize(message)):
                            await self._drain(stream)
            else:
                code, details = grpc.StatusCode.UNIMPLEMENTED, "streaming requests are not supported"
        except Abort as e:
            code, details = e.code, e.details
        except NotImplementedError:
            code, details = ctx._code or grpc.StatusCode.UNIMPLEMENTED, ctx._details or "not implemented"
        except asyncio.CancelledError:
            if ctx.cancelled_by_peer or self._transport is None:
                ctx.finish()
                return  # the client reset the stream or went away: nothing more to send
            if not stream.expired:
                ctx.finish()
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:
            code, details = grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"
        finally:
            if stream.deadline is not None:
                stream.deadline.cancel()
        if code == grpc.StatusCode.OK and ctx._code not in (None, grpc.StatusCode.OK):
            code, details = ctx._code, ctx._details
        ctx.finish()
        self._send_trailers(stream, code, details)

    async def _drain(self, stream: Stream) -> None:
        while stream.pending and not stream.local_closed:
            fut = self._loop.create_future()
            stream.drain = fut
            self._schedule_flush()
            await fut

    def send_message(self, stream: Stream, payload: bytes) -> bool:
        """Queue one gRPC message; False when it waits for flow-control window (then await drain)."""
        if stream.local_closed:
            raise asyncio.CancelledError()
        if not stream.headers_sent:
            stream.headers_sent = True
            self._out += frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS)
        size = len(payload) + 5
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        if (
            not stream.pending
            and size <= self._peer_max_frame
            and size <= stream.send_window
            and size <= self._conn_send_window
        ):  # the common case: one DATA frame
            stream.send_window -= size
            self._conn_send_window -= size
            self._out += b"".join(
                (
                    size.to_bytes(3, "big"),
                    b"\x00\x00",
                    stream.id_bytes,
                    b"\x00",
                    (size - 5).to_bytes(4, "big"),
                    payload,
                )
            )
            return True
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        if stream.pending:
            stream.pending.append(data)
            return False
        rest = self._send_data(stream, data)
        if rest:
            stream.pending.append(rest)
            self._blocked[stream.id] = stream
            return False
        return True

    def _send_data(self, stream: Stream, data: bytes) -> bytes:
        """Frame as much of ``data`` as the windows allow; returns what is left."""
        while data:
            size = min(len(data), self._peer_max_frame, stream.send_window, self._conn_send_window)
            if size <= 0:
                return data
            self._out += frame(DATA, 0, stream.id, data[:size])
            stream.send_window -= size
            self._conn_send_window -= size
            data = data[size:]
        return b""

    def _send_trailers(self, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        if stream.local_closed:
            return
        block = trailers_block(code, details)
        if not stream.headers_sent:
            stream.headers_sent = True
            block = RESPONSE_HEADERS + block  # trailers-only response
        if stream.pending:
            stream.trailers = block
            return
        self._out += frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block)
        self._close_local(stream)

    def _close_local(self, stream: Stream) -> None:
        stream.local_closed = True
        self._blocked.pop(stream.id, None)
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            if not stream.remote_closed:
                self._out += frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big"))
        self._schedule_flush()

    def _resume(self, stream: Stream) -> None:
        while stream.pending:
            rest = self._send_data(stream, stream.pending.popleft())
            if rest:
                stream.pending.appendleft(rest)
                break
        if not stream.pending:
            self._blocked.pop(stream.id, None)
            if stream.trailers is not None:
                block, stream.trailers = stream.trailers, None
                self._out += frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block)
                self._close_local(stream)
            if stream.drain is not None and not stream.drain.done():
                stream.drain.set_result(None)
        self._schedule_flush()

    def _resume_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._conn_send_window <= 0:
                break
            self._resume(stream)


class _HandlerCollector:
    """Stands in for a grpc server in the generated ``add_*_to_server`` functions."""

    def __init__(self) -> None:
        self.handlers: dict[bytes, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, methods: dict[str, Any]) -> None:
        for name, handler in methods.items():
            self.handlers[f"/{service}/{name}".encode()] = handler


class LeanGrpcServer:
    def __init__(self) -> None:
        self._collector = _HandlerCollector()
        self.handlers = self._collector.handlers
        self.connections: set[GrpcH2Protocol] = set()
        self._server: asyncio.Server | None = None

    def add(self, add_to_server: Callable[[Any, Any], None], servicer: Any) -> None:
        """Register a servicer through its generated ``add_XServicer_to_server`` function."""
        add_to_server(servicer, self._collector)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: GrpcH2Protocol(self), host, port, reuse_address=True)
        sock = self._server.sockets[0]
        bound: int = sock.getsockname()[1]
        return bound

    async def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace or 1.0):
                    await self._server.wait_closed()
