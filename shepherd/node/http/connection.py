"""One client connection of the lean HTTP/1.1 server (server.py): parser callbacks in, requests queued,
one handler task at a time, with only the work a gateway needs per request:

- **Parsing** by httptools: Content-Length and chunked bodies, keep-alive, HTTP/1.0 and
  ``Connection: close``, pipelined requests answered in order, one at a time per connection (reading
  pauses while more than ``Limits.max_pipeline`` wait, or their bodies hold more than ``max_body``).
  ``Expect: 100-continue`` is answered when the request is next in line and its declared body fits.
- **Limits**, answered in the OpenAI error envelope: a body over ``max_body`` (declared or received,
  after decoding) → 413 through the handler (``request.read()`` raises ``web.HTTPRequestEntityTooLarge``
  as aiohttp's does); a header field over ``max_field``, more than ``max_headers`` fields or a head over
  ``max_head`` bytes → 431; a request target over ``max_line`` → 414; anything the parser refuses → 400.
  Protocol errors close the connection after the answer; a refused body still being sent (or, after a
  protocol error, anything the client still sends, the server's side being shut after the answer) is read
  and discarded for up to ``linger_secs`` first, so the client sees the answer rather than a reset.
- **Request bodies**: a ``Content-Encoding`` is decoded as the body arrives (limits.py).
- **Slow clients**: a request head must arrive whole within ``head_secs`` of its first byte, the whole
  request within ``body_secs`` (→ 408, checked by the keep-alive sweep; one silent partway for
  ``keepalive_secs`` → 408 then too); a connection that sends nothing
  is closed after ``head_secs`` (not the ``keepalive_secs`` of one between requests); chunk framing that
  carries no body (extensions, trailers: ignored) may not exceed ``max_head`` plus the body's size (→ 400).
- **Routing**: static paths in a dict, dynamic resources (``/workers/{worker_id}``) matched once per
  request with aiohttp's own patterns; no match → the middlewares see ``web.HTTPNotFound``, a path
  without the method ``web.HTTPMethodNotAllowed`` (with ``Allow``). The middleware chain of each route is
  built once, in app order, called as aiohttp calls it (``await mw(request, handler=...)``).
- **Responses**: a ``web.Response`` is read (status, headers, body) and written with one
  ``transport.write``; streamed answers use ``LeanStreamResponse`` (``types.stream_response``).
- **Client disconnect** cancels the in-flight handler (aiohttp's ``handler_cancellation=True``).

The limits themselves and the answers to what breaks them are in limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import zlib
from collections import deque
from collections.abc import Callable
from typing import Protocol, cast

import httptools
from aiohttp import HttpVersion10, HttpVersion11, web
from multidict import CIMultiDict, CIMultiDictProxy

from shepherd.node.http.limits import (
    _INTERNAL,
    Limits,
    _corrupt,
    _Decoder,
    _Fault,
    _internal_error,
    _Limit,
    _refused_caller,
    _too_large,
    _unsupported,
    fault_body,
)
from shepherd.node.http.types import (
    Handler,
    LeanRequest,
    MatchInfo,
    Routes,
    add_head_extra,
    decode_path,
    encode_head,
    status_line,
)
from shepherd.proto.anthropic_errors import is_messages_path

log = logging.getLogger("shepherd.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# (method, request target) bytes -> what they decode and resolve to, for the static routes' own targets
_Resolved = tuple[str, str, str, str, Handler, MatchInfo]
_TARGETS_MAX = 256


class _Server(Protocol):
    """What a connection uses of its ``LeanServer`` (server.py)."""

    app: web.Application
    loop: asyncio.AbstractEventLoop
    clock: Callable[[], float]
    limits: Limits
    max_body: int
    routes: Routes
    targets: dict[tuple[bytes, bytes], _Resolved]
    conns: set[_Conn]
    body_gate: Callable[[LeanRequest], bool] | None
    draining: bool  # the node drains: answers end their connections (``Connection: close``)
    stopping: bool  # its grace is over: a request cancelled now is answered 503, not dropped

    def arm_sweep(self) -> None: ...


def _absolute_form(raw_path: str) -> tuple[str, str] | None:
    """An absolute-form request target's (without its query) authority and path (RFC 9112 §3.2.2:
    ``http://host:port/path``); None for the origin form (``/path``)."""
    if raw_path.startswith("/") or "://" not in raw_path:
        return None
    authority, _, rest = raw_path.split("://", 1)[1].partition("/")
    return authority, "/" + rest


class _Conn(asyncio.Protocol):
    """One client connection: parser callbacks in, requests queued, one handler task at a time."""

    def __init__(self, srv: _Server) -> None:
        self.srv = srv
        self.loop = srv.loop
        self.limits = srv.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[LeanRequest | _Fault] = deque()
        self.queued_bytes = 0  # the bodies of the queued requests: reading pauses past max_body
        self.task: asyncio.Task[None] | None = None  # the serving task while it answers (None: idle)
        self._runner: asyncio.Task[None] | None = None  # the serving task, kept between requests
        self._idle: asyncio.Future[LeanRequest | _Fault] | None = None  # what it waits on when idle
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.read_paused = False
        self.lost = False
        self.closing = False  # no further request on this connection
        self.stopped = False  # the parser met an error (or an upgrade): data is ignored
        self.clock = srv.clock
        self.last = self.clock()
        self.spoke = False  # a byte has come: until then the connection may stay silent head_secs only
        self.started: float | None = None  # when the first byte of the request being received came
        self.remote: str | None = None  # the client's address (its balancer's PROXY header's, if any)
        self.on_lost: Callable[[], None] | None = None  # the server's gate: a counted connection closed
        self.secure = False
        self._linger: asyncio.TimerHandle | None = None
        self._continue = False  # a 100 Continue owed to the request being received
        # the message being received
        self.in_head = True
        self.head_method = False  # its request line named HEAD (known once its head is in)
        self.head_bytes = 0
        self.url: list[bytes] = []
        self.url_len = 0
        self.fields: list[tuple[bytes, bytes]] = []
        self.cur: LeanRequest | None = None
        self.parts: list[bytes | bytearray] = []  # one part, or one growing buffer (not one per chunk)
        self.size = 0
        self.received = 0  # body bytes received (refused ones included)
        self.framing = 0  # bytes after the head that are not body: chunk sizes, extensions, trailers
        self.decoder: _Decoder | None = None
        self.dropping = False  # the body is refused (too large, unknown coding): bytes are discarded
        self.early = False  # the current request was dispatched before its body ended
        # an ``Upgrade`` request with a body (``curl --http2`` POSTs so): the upgrade is declined and the
        # body read by a fresh parser fed this head first (``_resume_body``); what follows it is not parsed
        self.upgrade_body: bytes | None = None
        self.resuming = False  # that parser is being fed the head: its callbacks are not a new request
        self.declined = False  # that parser reads the body of the declined upgrade request

    # ---- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        elif isinstance(peer, str):
            self.remote = peer
        self.secure = transport.get_extra_info("sslcontext") is not None
        self.srv.conns.add(self)
        self.srv.arm_sweep()  # (armed already but for the first connection)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.srv.conns.discard(self)
        if self.on_lost is not None:
            self.on_lost()
            self.on_lost = None
        runner = self._runner
        if runner is not None and not runner.done():
            runner.cancel()  # the client is gone: so is its request (the engine request is aborted)
        if self._linger is not None:
            self._linger.cancel()
        self._wake_drain()
        # What was being received, and what waited its turn, go now: the connection sits in reference
        # cycles (its parser, its transport) that only the collector's oldest generation frees, tens of
        # thousands of requests later with the node's thresholds (gc_tuning), and a body cut off
        # mid-upload held up to max_body (16 MiB) each until then.
        self.parts = []
        self.decoder = None
        self.upgrade_body = None
        self.url = []
        self.fields = []
        self.queue.clear()
        self.queued_bytes = 0

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        d = self._drain
        if d is not None:
            self._drain = None
            if not d.done():
                d.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.last = self.clock()
        self.spoke = True
        while data and not self.stopped:  # (more than once only past an upgrade request's head)
            data = self._feed(data)

    def _feed(self, data: bytes) -> bytes:
        """Parse ``data``; what is left of it to parse with a new parser (past an upgrade request's head,
        its body) or nothing."""
        if self.in_head:
            self.head_bytes += len(data)
        else:
            self.framing += len(data)  # the body's bytes are taken off as they are parsed
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            if self.upgrade_body is not None:  # declined: its body follows, in HTTP/1.1
                return self._resume_body(data[e.args[0] :])
            self.stopped = True  # answered as plain HTTP; what follows is another protocol: close after
        except httptools.HttpParserCallbackError as e:
            ctx = e.__context__
            if isinstance(ctx, _Limit):
                self._fault(ctx.fault)
            else:
                log.exception("lean HTTP server: parser callback failed")
                self._fault(_Fault(500, "Internal error in the gateway.", "internal"))
        except httptools.HttpParserError as e:
            if not self.stopped:  # (stopped: bytes after a declined upgrade's body, ignored)
                self._fault(_Fault(400, f"Malformed HTTP request: {e}.", "bad_http_request"))
        else:
            if self.in_head:
                if self.head_bytes > self.limits.max_head:
                    self._fault(_Fault(431, "The request head is too large.", "headers_too_large"))
            elif self.framing > self.limits.max_head + self.received:
                msg = "Too many bytes of chunk framing (extensions, trailers) for the body they carry."
                self._fault(_Fault(400, msg, "bad_http_request"))
        return b""

    def _resume_body(self, rest: bytes) -> bytes:
        """llhttp ends an upgrade request at its head (httptools asks it to skip the body), but the server
        declines every upgrade (RFC 9110 §7.8): the body is read by a new parser told its framing by a head
        of its own, ``Connection: close`` (nothing after the body is parsed; the answer closes)."""
        head, self.upgrade_body = self.upgrade_body, None
        assert head is not None
        self.parser = httptools.HttpRequestParser(self)
        self.declined = self.resuming = True
        try:
            self.parser.feed_data(head)
        finally:
            self.resuming = False
        return rest

    def eof_received(self) -> bool | None:
        return None  # as aiohttp: the peer's FIN ends the connection (and cancels its request)

    # ---- wire (for LeanStreamResponse) -------------------------------------------------------------

    def send(self, data: bytes) -> None:
        t = self.transport
        if self.lost or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(data)

    def send_chunk(self, data: bytes | bytearray | memoryview) -> bool:
        t = self.transport
        if self.lost or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(b"%x\r\n%s\r\n" % (len(data), data))
        return self.write_paused

    def send_framed(self, chunk: bytes) -> bool:
        t = self.transport
        if self.lost or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(chunk)
        return self.write_paused

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if not self.write_paused:
            return
        if self._drain is None:
            self._drain = self.loop.create_future()
        stall = self.limits.write_stall_secs
        try:
            async with asyncio.timeout(stall):
                await asyncio.shield(self._drain)
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()  # (a close would wait for the unread buffer to drain)
            raise ConnectionResetError(f"the client read nothing for {stall:g} s") from None
        if self.lost:
            raise ConnectionResetError("the client closed the connection")

    def keep_alive_for(self, request: LeanRequest) -> bool:
        """Another request may follow this one's response: the client wants it, the body has been read,
        the server is not stopping, and the parser can go on (after a refused request, its 400 follows)."""
        return (
            request.keep_alive
            and request.complete
            and not self.closing
            and not self.srv.draining
            and not (self.stopped and not self.queue)
        )

    def _transport(self) -> asyncio.Transport | None:
        return None if self.lost else self.transport

    # ---- parser callbacks --------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.resuming:
            return
        self.started = self.last
        self.in_head = True
        self.head_method = False
        self.url = []
        self.url_len = 0
        self.fields = []
        self.parts = []
        self.size = 0
        self.received = 0
        self.framing = 0
        self.decoder = None
        self.dropping = False
        self.early = False

    def on_url(self, url: bytes) -> None:
        self.url.append(url)
        self.url_len += len(url)
        if self.url_len > self.limits.max_line:
            raise _Limit(_Fault(414, "The request URL is too long.", "uri_too_long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # a chunked body's trailer: ignored (data_received bounds its size as framing)
        self.fields.append((name, value))  # sizes are checked once the head is in (data_received bounds it)

    def on_headers_complete(self) -> None:
        if self.resuming:
            return
        self.in_head = False
        self.head_bytes = 0
        srv = self.srv
        p = self.parser
        url = self.url[0] if len(self.url) == 1 else b"".join(self.url)
        key = (p.get_method(), url)
        self.head_method = key[0] == b"HEAD"  # a fault answered from here on answers a HEAD request
        hit = srv.targets.get(key)
        if hit is not None:  # a route's own target, seen before: decoded and resolved then
            method, target, path, qs, handler, mi = hit
        else:
            target = url.decode("utf-8", "surrogateescape")
            raw_path, _, qs = target.partition("?")
            absolute = _absolute_form(raw_path)
            if absolute is not None:  # keep the path
                raw_path = absolute[1]
            path, safe = decode_path(raw_path)
            method = key[0].decode("ascii", "surrogateescape")
            handler, mi = srv.routes.resolve(method, safe)
            if not qs and srv.routes.is_static(mi):
                targets = srv.targets
                if len(targets) >= _TARGETS_MAX:
                    targets.clear()
                targets[key] = (method, target, path, qs, handler, mi)
        lim = self.limits
        fields = self.fields
        if len(fields) > lim.max_headers:
            raise _Limit(_Fault(431, "The request has too many header fields.", "headers_too_large"))
        decoded = []
        # the head's size (data_received bounds a head still arriving, not one ending in the read that
        # crosses max_head): target and fields, give or take the request line's few fixed bytes
        size = self.url_len
        for n, v in fields:
            field = len(n) + len(v)
            if field > lim.max_field:
                raise _Limit(_Fault(431, "A request header field is too large.", "headers_too_large"))
            size += field + 4  # ": " and CRLF
            decoded.append((n.decode("latin-1"), v.decode("utf-8", "surrogateescape")))
        if size > lim.max_head:
            raise _Limit(_Fault(431, "The request head is too large.", "headers_too_large"))
        headers = CIMultiDictProxy(CIMultiDict(decoded))
        hv = p.get_http_version()
        if hv != "1.1" and hv != "1.0":  # (llhttp reads any digits: "HTTP/2.0" from a confused client)
            raise _Limit(_Fault(505, f"HTTP/{hv} is not served here: HTTP/1.1 or 1.0.", "http_version"))
        version = HttpVersion11 if hv == "1.1" else HttpVersion10
        hosts = len(headers.getall("Host", ()))
        if hosts > 1 or (hosts == 0 and version is HttpVersion11):  # RFC 9112 §3.2: a 400 for either
            msg = "More than one Host header field." if hosts else "An HTTP/1.1 request needs a Host header."
            raise _Limit(_Fault(400, msg, "bad_http_request"))
        absolute = _absolute_form(target.partition("?")[0])
        if absolute is not None:
            # its authority is the request's host (RFC 9112 §3.3), so a Host naming another would pass
            # the Host checks (allowed hosts, DNS rebinding) for a target they never saw
            authority = absolute[0]
            if authority.lower() != (headers.get("Host") or authority).lower():
                raise _Limit(
                    _Fault(
                        400, "The request target's authority and the Host header differ.", "bad_http_request"
                    )
                )
        cl_text = headers.get("Content-Length")
        content_length = int(cl_text) if cl_text is not None else None  # llhttp has checked it
        req = LeanRequest(
            self,
            srv.app,
            method,
            target,
            path,
            qs,
            headers,
            version,
            p.should_keep_alive(),
            content_length,
            mi,
            handler,
            self._transport,
            self.remote,
            self.secure,
        )
        self.cur = req
        te = headers.get("Transfer-Encoding")
        if te is not None and version is HttpVersion10:  # RFC 9112 §6.1: faulty framing, whatever it says
            raise _Limit(_Fault(400, "Transfer-Encoding in an HTTP/1.0 request.", "bad_http_request"))
        if te is not None and te.strip().lower() != "chunked":
            raise _Limit(_Fault(400, f"Unsupported Transfer-Encoding {te[:40]!r}.", "bad_http_request"))
        if p.should_upgrade() and method != "CONNECT" and (te is not None or content_length):
            framing = (
                b"Transfer-Encoding: chunked"
                if te is not None
                else b"Content-Length: %d" % (content_length or 0)
            )
            self.upgrade_body = b"POST / HTTP/1.1\r\n" + framing + b"\r\nConnection: close\r\n\r\n"
        gate = srv.body_gate
        if (
            gate is not None
            and (te is not None or content_length)
            and self.upgrade_body is None
            and gate(req)
        ):
            # a caller the app will refuse (no or a bad credential): its body is dropped as it comes, never
            # buffered (up to max_body a connection, before any answer), and the refusal answered now
            self._refuse(req, _refused_caller)
            self._dispatch_early(req)
            return
        limit = srv.max_body
        ce = headers.get("Content-Encoding")
        if ce is not None:
            coding = ce.strip().lower()
            if coding in ("gzip", "x-gzip", "deflate"):
                self.decoder = _Decoder(coding != "deflate", limit)
            elif coding not in ("", "identity"):
                self._refuse(req, _unsupported(ce))
        if content_length is not None and content_length > limit:
            self._refuse(req, functools.partial(_too_large, limit, content_length))
            self._dispatch_early(req)
            return
        expect = headers.get("Expect")
        if expect is not None and version is HttpVersion11 and expect.lower() == "100-continue":
            if self.task is None and not self.queue:
                with contextlib.suppress(ConnectionResetError):
                    self.send(_CONTINUE)
            else:
                self._continue = True

    def on_body(self, body: bytes) -> None:
        self.framing -= len(body)
        self.received += len(body)
        if self.dropping:
            return
        self.size += len(body)
        req = self.cur
        assert req is not None
        limit = self.srv.max_body
        if self.size > limit:
            self._refuse(req, functools.partial(_too_large, limit, self.size))
            self._dispatch_early(req)
            return
        dec = self.decoder
        if dec is not None:
            try:
                body = dec.feed(body)
            except OverflowError:
                self._refuse(req, functools.partial(_too_large, limit, dec.out))
                self._dispatch_early(req)
                return
            except zlib.error as e:
                self._refuse(req, functools.partial(_corrupt, str(e)))
                return
        if body:
            parts = self.parts
            if not parts:
                parts.append(body)
            elif isinstance(parts[0], bytearray):
                parts[0] += body
            else:  # many small chunks would cost ~40 bytes of object each: one buffer grows instead
                parts[0] = bytearray(parts[0]) + body

    def on_message_complete(self) -> None:
        if self.upgrade_body is not None:  # an upgrade request's head: its body is still to come
            return
        if self.declined:  # that body is in: nothing after it is parsed (another protocol, maybe)
            self.stopped = True
        self.started = None
        self.in_head = True
        self._continue = False
        req = self.cur
        assert req is not None
        self.cur = None
        req.complete = True
        if self.early:
            if self._linger is not None:  # its answer is out: the refused body is all read
                self._close()
            return
        if not self.dropping:
            body = bytes(self.parts[0]) if self.parts else b""
            dec = self.decoder
            if dec is not None:
                try:
                    body += dec.end()
                except OverflowError:
                    self._refuse(req, functools.partial(_too_large, self.srv.max_body, dec.out))
                except zlib.error as e:
                    self._refuse(req, functools.partial(_corrupt, str(e)))
            req._body = body
        self.parts = []
        self._enqueue(req)

    # ---- dispatch ----------------------------------------------------------------------------------

    def _refuse(self, req: LeanRequest, error: Callable[[], BaseException]) -> None:
        if not self.dropping:
            self.dropping = True
            self.parts = []
            req._error = error

    def _dispatch_early(self, req: LeanRequest) -> None:
        """The body will not be read: answer now (413), drop the rest of it as it comes."""
        if not self.early:
            self.early = True
            self._continue = False
            self._enqueue(req)

    def _fault(self, fault: _Fault) -> None:
        self.stopped = True
        if self._to_messages_api():
            fault = dataclasses.replace(fault, anthropic=True)
        self._enqueue(fault)

    def _to_messages_api(self) -> bool:
        """Whether the request being received (as much of its target as has come) is to the Messages API,
        whose errors have an envelope of their own."""
        cur = self.cur
        if cur is not None:
            return is_messages_path(cur.path)
        if not self.url:
            return False
        raw = b"".join(self.url).decode("latin-1").partition("?")[0]
        if not raw.startswith("/") and "://" in raw:  # absolute-form, as on_headers_complete reads it
            raw = "/" + raw.split("://", 1)[1].partition("/")[2]
        return is_messages_path(decode_path(raw)[0])

    def _enqueue(self, item: LeanRequest | _Fault) -> None:
        if self.task is None:
            idle = self._idle
            self._idle = None
            if idle is not None and not idle.done():  # the connection's task waits for its next request
                self.task = self._runner
                idle.set_result(item)
            else:
                self.task = self._runner = self.loop.create_task(self._serve(item))
            return
        self.queue.append(item)
        if isinstance(item, LeanRequest):
            self.queued_bytes += len(item._body)
        full = len(self.queue) > self.limits.max_pipeline or self.queued_bytes > self.srv.max_body
        if full and not self.read_paused and self.transport:
            self.read_paused = True
            self.transport.pause_reading()

    async def _serve(self, item: LeanRequest | _Fault) -> None:
        """The connection's serving task: answers requests as they come, in order; between them (an idle
        keep-alive connection) it waits for the next one rather than ending (a task per request costs
        ~2 µs). Cancelled when the client goes."""
        while await self._answer(item):
            idle: asyncio.Future[LeanRequest | _Fault] = self.loop.create_future()
            self._idle = idle
            try:
                item = await idle
            except asyncio.CancelledError:
                if self._idle is idle:
                    self._idle = None
                return

    async def _answer(self, item: LeanRequest | _Fault) -> bool:
        """Answer queued requests in order until none is left; whether the connection stays open for more."""
        try:
            while True:
                if isinstance(item, _Fault):
                    self._answer_fault(item)
                    return False
                if not await self._exchange(item):
                    self._end_after(item)
                    return False
                if self.write_paused:
                    await self.drain()
                if not self.queue:
                    break
                item = self.queue.popleft()
                if isinstance(item, LeanRequest):
                    self.queued_bytes -= len(item._body)
                low = (
                    len(self.queue) <= self.limits.max_pipeline // 2
                    and self.queued_bytes <= self.srv.max_body
                )
                if self.read_paused and low and self.transport:
                    self.read_paused = False
                    self.transport.resume_reading()
            if self._continue:
                self._continue = False
                self.send(_CONTINUE)
            return not self.lost
        except (ConnectionResetError, asyncio.CancelledError):
            self._close()  # the client is gone (or the server stops): nothing more to answer
            return False
        except Exception:
            log.exception("lean HTTP server: answering a request failed")
            self._close()
            return False
        finally:
            self.task = None
            self.last = now = self.clock()  # an idle keep-alive connection is idle from its last answer
            if self.started is not None:  # and a request arriving behind it (waiting for a 100 Continue,
                self.started = now  # say) has its head_secs / body_secs from then

    async def _exchange(self, req: LeanRequest) -> bool:
        """Run the request through the app and write its response; whether the connection goes on."""
        try:
            resp = await req.handler(req)  # type: ignore[arg-type]  # typed as aiohttp's web.Request
        except web.HTTPException as e:  # escaped the middlewares (a redirect, say): it is a response
            resp = e
        except asyncio.CancelledError:
            stream = req._stream
            if self.srv.stopping and not self.lost and (stream is None or not stream.prepared):
                # the node's grace is over and this request has no answer yet: a 503, not a dropped
                # connection (a stream already under way ends with its in-band error: the generation's)
                self._answer_fault(_Fault(503, "The node is shutting down.", "server_shutting_down"))
            raise
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("unhandled error on %s %s", req.method, req.path)
            resp = _internal_error()
        stream = req._stream
        if stream is not None and not (resp is not stream and stream.lean_abandon()):
            if resp is not stream:
                if not stream.lean_ended:  # failed midway: the client must not see a complete body
                    log.warning(
                        "%s %s: the stream failed midway: closing the connection", req.method, req.path
                    )
                    return False
                log.warning("%s %s: a response returned after a stream was ended", req.method, req.path)
            stream.lean_finish()
            return stream.lean_keep_alive
        if not isinstance(resp, web.Response):
            log.error("%s %s: the handler returned an unprepared %s", req.method, req.path, type(resp))
            resp = _internal_error()
        body = resp.body
        if body is not None and type(body) is not bytes and not isinstance(body, bytes | bytearray):
            body = await body.as_bytes()
        keep = self.keep_alive_for(req) and resp.keep_alive is not False
        try:
            data = self._encode(req, resp, body or b"", keep)
        except ValueError:
            log.exception("%s %s: a response header cannot be sent", req.method, req.path)
            data = self._encode(req, _internal_error(), _INTERNAL, keep)
        self.send(data)
        return keep

    def _encode(self, req: LeanRequest, resp: web.Response, body: bytes | bytearray, keep: bool) -> bytes:
        status = resp.status
        h = resp.headers
        add_head_extra(req, h)
        empty = status in (204, 304) or status < 200
        if empty:
            tail = ""
            body = b""
        else:
            tail = f"Content-Length: {len(body)}\r\n"
            if body and "Content-Type" not in h:
                tail += "Content-Type: application/octet-stream\r\n"
        v11 = req.version is HttpVersion11
        if not keep:
            if v11:
                tail += "Connection: close\r\n"
        elif not v11:
            tail += "Connection: keep-alive\r\n"
        head = encode_head(req.version, status, resp.reason, h, tail + "\r\n")
        if req.method == "HEAD" or not body:
            return head
        return head + body

    def _answer_fault(self, fault: _Fault) -> None:
        status, body = fault_body(fault)
        head = status_line(HttpVersion11, status, None) + (
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionResetError):  # a HEAD answer has no body (RFC 9112 §6.3)
            self.send(head.encode() if self.head_method else head.encode() + body)
        self.task = None
        t = self._transport()
        if t is None or t.is_closing() or not t.can_write_eof():
            self._close()
            return
        try:  # half-close: what the client is still sending is read and dropped, so no reset eats the answer
            t.write_eof()
        except OSError:  # the client has gone already (ENOTCONN): nothing left to answer
            self._close()
            return
        if self.read_paused:
            self.read_paused = False
            t.resume_reading()
        if self._linger is None:
            self._linger = self.loop.call_later(self.limits.linger_secs, self._close)

    def _end_after(self, req: LeanRequest) -> None:
        """The connection ends with this response: at once, or once a refused body has been read."""
        self.task = None
        self.closing = True
        if req.complete or self.stopped:
            self._close()
        elif self._linger is None:
            self._linger = self.loop.call_later(self.limits.linger_secs, self._close)

    def _close(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        if self._idle is not None and self._runner is not None:  # the serving task waits for no more
            self._runner.cancel()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def idle_close(self, now: float | None) -> bool:
        """Close if no request is being answered or waiting; with ``now`` (the keep-alive sweep), only a
        connection silent for ``keepalive_secs`` (a request still arriving included), or for
        ``head_secs`` when it has sent nothing at all yet (the first request's head is due within that
        of the connection: silent connections cannot hold slots for longer than a trickled head)."""
        if self.task is not None or self.queue:
            return False
        started = self.started
        lim = self.limits
        if now is not None and started is not None and not self.closing and not self.stopped:
            # a request arriving: too slow, or stopped partway (silent keepalive_secs): answered 408
            if now - started > (lim.head_secs if self.in_head else lim.body_secs):
                self._fault(_Fault(408, "The request took too long to arrive.", "request_timeout"))
                return True
            if now - self.last >= lim.keepalive_secs:
                self._fault(_Fault(408, "The request stopped arriving.", "request_timeout"))
                return True
            return False
        if now is not None and now - self.last < (lim.keepalive_secs if self.spoke else lim.head_secs):
            return False
        self.closing = True
        self._close()
        return True
