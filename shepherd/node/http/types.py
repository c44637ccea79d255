"""What handlers see when the lean HTTP/1.1 server (``shepherd.node.http.server``) serves the app: the
request, its match info, the streaming response, the response head encoder they share, and the route
table the server resolves requests with.

Handlers are written against aiohttp's types (``web.Request`` in, ``web.Response`` /
``web.StreamResponse`` out) and run unchanged under both servers:

- ``LeanRequest`` has what the node's handlers and middlewares use of ``web.Request``: ``app``,
  ``match_info`` (``.route.resource.canonical``, ``[name]``, ``.get``), ``method``, ``path``, ``raw_path``,
  ``query`` / ``query_string``, ``headers`` (a case-insensitive ``CIMultiDictProxy``), ``version``,
  ``keep_alive``, ``content_length``, ``read()`` (the whole body, already received and decoded),
  ``transport``, ``remote``, ``secure`` and per-request storage (``get`` / ``[]`` / ``[]=``). The server
  casts it to ``web.Request`` at the dispatch site.
- ``stream_response(request, ...)`` is how a handler starts a streamed answer (SSE, relayed streams): a
  ``LeanStreamResponse`` under the lean server, a plain ``web.StreamResponse`` under aiohttp. Both are
  ``web.StreamResponse``: ``prepare`` / ``write`` / ``write_eof`` / ``prepared`` / ``headers``.
- ``Routes`` is the app's router flattened for one lookup per request: static paths in a dict, dynamic
  resources matched with aiohttp's own patterns, each route's handler already inside the app's
  middlewares (in app order, called as aiohttp calls them: ``await mw(request, handler=...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import parse_qsl

from aiohttp import HttpVersion, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.typedefs import LooseHeaders
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import AbstractResource

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# 529: Anthropic's overloaded_error (the Messages API's answer for the node's 503), no IANA phrase
REASONS: dict[int, str] = {s.value: s.phrase for s in HTTPStatus} | {529: "Overloaded"}
_FRAMING = frozenset({"connection", "content-length", "transfer-encoding"})
CHUNK_END = b"0\r\n\r\n"
# a request key the app may set to header (name, value) pairs the server adds to the response head,
# whoever makes the answer (a handler, a stream, an error middleware) and unless it set them itself
# (the data plane's CORS headers: shepherd.node.api.cors)
HEAD_EXTRA = "shepherd.head_extra"


def add_head_extra(req: Mapping[Any, Any], headers: Any) -> None:
    extra = req.get(HEAD_EXTRA)
    if extra:
        for name, value in extra:
            if name not in headers:
                headers[name] = value


class Wire(Protocol):
    """The connection side of one exchange, as the lean server gives it to a streaming response."""

    loop: asyncio.AbstractEventLoop
    write_paused: bool  # the transport's buffer is over its high-water mark: ``await drain()``

    def send(self, data: bytes) -> None:
        """One ``transport.write``; ``ConnectionResetError`` once the client is gone."""

    def send_chunk(self, data: bytes | bytearray | memoryview) -> bool:
        """``send`` of ``data`` (not empty) as one chunk of a chunked body; returns ``write_paused``."""

    def send_framed(self, chunk: bytes) -> bool:
        """``send`` of one chunk already framed (``%x\\r\\n`` data ``\\r\\n``); returns ``write_paused``."""

    async def drain(self) -> None:
        """Until the transport's buffer is below its low-water mark (or the connection is lost)."""

    def keep_alive_for(self, request: LeanRequest) -> bool:
        """Whether the connection stays open after this request's response."""


class NoRoute:
    """The ``route`` of a request no resource matched (aiohttp's system routes have no resource)."""

    __slots__ = ()
    resource: AbstractResource | None = None


NO_ROUTE = NoRoute()


class MatchInfo(dict[str, str]):
    """``request.match_info``: the path's variables, and ``route`` (aiohttp's own route object, whose
    ``resource.canonical`` the middlewares label requests with)."""

    __slots__ = ("route",)

    def __init__(self, route: Any, values: dict[str, str] | None = None) -> None:
        super().__init__(values or ())
        self.route = route


class LeanRequest(dict[Any, Any]):
    """One request as the lean server received it (the dict is the per-request storage)."""

    __slots__ = (
        "_body",
        "_error",
        "_query",
        "_stream",
        "_wire",
        "app",
        "complete",
        "content_length",
        "handler",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query_string",
        "raw_path",
        "remote",
        "secure",
        "transport_of",
        "version",
    )

    def __init__(
        self,
        wire: Wire,
        app: web.Application,
        method: str,
        raw_path: str,
        path: str,
        query_string: str,
        headers: CIMultiDictProxy[str],
        version: HttpVersion,
        keep_alive: bool,
        content_length: int | None,
        match_info: MatchInfo,
        handler: Handler,
        transport_of: Callable[[], asyncio.Transport | None],
        remote: str | None,
        secure: bool,
    ) -> None:
        super().__init__()
        self._wire = wire
        self.app = app
        self.method = method
        self.raw_path = raw_path
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.match_info = match_info
        self.handler = handler
        self.transport_of = transport_of
        self.remote = remote
        self.secure = secure
        self._body = b""
        self._error: Callable[[], BaseException] | None = None
        self._query: MultiDictProxy[str] | None = None
        self._stream: LeanStreamResponse | None = None
        self.complete = False  # the whole message (body included) has arrived

    def __repr__(self) -> str:
        return f"<LeanRequest {self.method} {self.raw_path}>"

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (None once it is closed): the mTLS principal reads its certificate."""
        return self.transport_of()

    @property
    def scheme(self) -> str:
        return "https" if self.secure else "http"

    @property
    def query(self) -> MultiDictProxy[str]:
        q = self._query
        if q is None:
            q = self._query = MultiDictProxy(MultiDict(parse_qsl(self.query_string, keep_blank_values=True)))
        return q

    @property
    def can_read_body(self) -> bool:
        return bool(self._body) or self._error is not None

    def body_now(self) -> bytes | None:
        """The body ``read()`` would return, without a coroutine (None when ``read()`` would raise)."""
        return self._body if self._error is None else None

    async def read(self) -> bytes:
        """The whole body, decoded (``Content-Encoding``). Raises as aiohttp's does: a body over the limit
        ``web.HTTPRequestEntityTooLarge``, a body that does not decode ``ContentEncodingError``, and an
        encoding the server does not know ``web.HTTPUnsupportedMediaType``."""
        if self._error is not None:
            raise self._error()
        return self._body

    async def text(self) -> str:
        return (await self.read()).decode("utf-8")


# ---- routing (for the lean server) ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Target:
    handler: Handler  # the route's handler inside the app's middlewares
    match_info: MatchInfo | None  # static routes share one (no variables)
    route: Any


_Methods = dict[str, _Target]


def _chain(app: web.Application, handler: Handler) -> Handler:
    for mw in reversed(app.middlewares):
        if getattr(mw, "__middleware_version__", None) != 1:
            raise TypeError(f"old-style middleware {mw!r}: decorate it with @web.middleware")
        handler = functools.partial(mw, handler=handler)
    return handler


def _raiser(exc: Callable[[], web.HTTPException]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise exc()

    return handler


class Routes:
    """The app's route table: static paths in a dict, dynamic resources tried in order. Resources of one
    path (aiohttp keeps one per registration when they are not consecutive) are merged, the first
    registered route of a method winning, as in aiohttp's resolution."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self.static: dict[str, _Methods] = {}
        self.dynamic: dict[str, tuple[re.Pattern[str], _Methods]] = {}
        self._allowed: dict[frozenset[str], Handler] = {}
        for resource in app.router.resources():
            info = resource.get_info()
            if "path" in info:
                methods = self.static.setdefault(info["path"], {})
            elif "pattern" in info:
                pattern = info["pattern"]
                methods = self.dynamic.setdefault(pattern.pattern, (pattern, {}))[1]
            else:
                raise TypeError(f"the lean HTTP server cannot serve resource {resource!r}")
            for route in resource:
                static_mi = MatchInfo(route) if "path" in info else None
                methods.setdefault(route.method, _Target(_chain(app, route.handler), static_mi, route))
        self.not_found = _chain(app, _raiser(web.HTTPNotFound))
        self.not_found_mi = MatchInfo(NO_ROUTE)
        self._static_mis = frozenset(
            id(t.match_info) for ms in self.static.values() for t in ms.values() if t.match_info is not None
        )

    def is_static(self, mi: MatchInfo) -> bool:
        """Whether ``resolve`` gave a static route's own match info (the same for every request to it)."""
        return id(mi) in self._static_mis

    def _not_allowed(self, allowed: frozenset[str]) -> Handler:
        h = self._allowed.get(allowed)
        if h is None:
            exc = functools.partial(web.HTTPMethodNotAllowed, "", sorted(allowed))
            h = self._allowed[allowed] = _chain(self._app, _raiser(exc))
        return h

    def resolve(self, method: str, path: str) -> tuple[Handler, MatchInfo]:
        """The handler chain and match info for ``method`` on ``path`` (aiohttp's ``path_safe``: decoded,
        except ``%2F``)."""
        methods = self.static.get(path)
        if methods is not None:
            target = methods.get(method) or methods.get(hdrs.METH_ANY)
            if target is not None:
                assert target.match_info is not None
                return target.handler, target.match_info
        allowed = set(methods or ())
        for pattern, ms in self.dynamic.values():
            m = pattern.fullmatch(path)
            if m is None:
                continue
            target = ms.get(method) or ms.get(hdrs.METH_ANY)
            if target is None:
                allowed.update(ms)
                continue
            values = {k: v.replace("%2F", "/").replace("%2f", "/") for k, v in m.groupdict().items()}
            return target.handler, MatchInfo(target.route, values)
        if allowed:
            return self._not_allowed(frozenset(allowed)), MatchInfo(NO_ROUTE)
        return self.not_found, self.not_found_mi


_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _decode_escapes(m: re.Match[str]) -> str:
    """One run of percent-escapes, decoded as UTF-8; bytes that are not UTF-8 keep their escape as sent."""
    run = m.group(0)
    text = bytes.fromhex(run.replace("%", "")).decode("utf-8", "surrogateescape")
    if text.isascii() or not any("\udc80" <= c <= "\udcff" for c in text):
        return text
    out = []
    at = 0  # the byte (escape) of ``run`` the next character starts at
    for c in text:
        if "\udc80" <= c <= "\udcff":
            out.append(run[3 * at : 3 * at + 3])
            at += 1
        else:
            out.append(c)
            at += len(c.encode("utf-8"))
    return "".join(out)


def _unquote(raw: str) -> str:
    return _ESCAPES.sub(_decode_escapes, raw)


def decode_path(raw: str) -> tuple[str, str]:
    """(path, path_safe) of a request target's path: percent-decoded, and the same keeping ``%2F``.

    Escapes that do not decode as UTF-8 stay escaped (``/a%C3%A9%ff`` -> ``/aé%ff``), as yarl leaves them
    under aiohttp's server: a path is always valid text (a lone surrogate would make every JSON answer
    that names the path, a 404's say, fail to serialise)."""
    if "%" not in raw:
        return raw, raw
    path = _unquote(raw)
    parts = re.split("%2[fF]", raw)
    safe = "%2F".join(_unquote(p) for p in parts) if len(parts) > 1 else path
    return path, safe


def as_web_request(req: LeanRequest) -> web.Request:
    """The dispatch site's cast: handlers are typed against aiohttp's request."""
    return cast(web.Request, req)


def lean_request(request: web.BaseRequest) -> LeanRequest | None:
    """The lean request behind a handler's ``web.Request`` (None under aiohttp)."""
    obj = cast(object, request)
    return obj if isinstance(obj, LeanRequest) else None


def stream_response(
    request: web.BaseRequest, *, status: int = 200, headers: LooseHeaders | None = None
) -> web.StreamResponse:
    """A streamed response for this request, for whichever server serves it."""
    lean = lean_request(request)
    if lean is not None:
        return LeanStreamResponse(lean, status=status, headers=headers)
    return web.StreamResponse(status=status, headers=headers)


def status_line(version: HttpVersion, status: int, reason: str | None) -> str:
    key = (version.minor, status, reason)
    line = _STATUS_LINES.get(key)
    if line is None:
        line = f"HTTP/{version.major}.{version.minor} {status} {reason or REASONS.get(status, 'Unknown')}\r\n"
        if "\n" in line[:-1] or "\r" in line[:-2]:
            raise ValueError("newline or carriage return in a response reason")
        if len(_STATUS_LINES) < 256:
            _STATUS_LINES[key] = line
    return line


_STATUS_LINES: dict[tuple[int, int, str | None], str] = {}


def encode_head(
    version: HttpVersion,
    status: int,
    reason: str | None,
    headers: CIMultiDict[str] | CIMultiDictProxy[str],
    tail: str,
) -> bytes:
    """Status line and header block. The handler's own framing headers (``Connection``,
    ``Content-Length``, ``Transfer-Encoding``) are dropped: ``tail`` holds the server's, and the blank line.
    A CR or LF in a header is refused (``ValueError``), as aiohttp does: no header injection."""
    items: Iterable[tuple[str, str]] = headers.items()
    if "Connection" in headers or "Content-Length" in headers or "Transfer-Encoding" in headers:
        items = [(k, v) for k, v in items if k.lower() not in _FRAMING]
    lines = [f"{k}: {v}\r\n" for k, v in items]
    block = "".join(lines)
    n = len(lines)
    if block.count("\n") != n or block.count("\r") != n:
        raise ValueError("newline or carriage return in a response header")
    return (status_line(version, status, reason) + block + tail).encode("utf-8", "surrogateescape")


def _chunk(data: bytes | bytearray | memoryview) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class LeanStreamResponse(web.StreamResponse):
    """A streamed answer written straight to the lean server's connection: chunked on HTTP/1.1, ended by
    closing the connection on HTTP/1.0. One ``transport.write`` per ``write``; the head rides with the
    first write made in the same loop iteration as ``prepare`` (else it goes out on its own at once), and
    ``write_eof(data)`` sends ``data`` and the end of the body together. ``write`` waits for the transport
    to drain when its buffer is over the high-water mark."""

    def __init__(
        self,
        request: LeanRequest,
        *,
        status: int = 200,
        reason: str | None = None,
        headers: LooseHeaders | None = None,
    ) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self._lean_req = request
        self._lean_phase = 0  # 0 new, 1 head pending, 2 streaming, 3 ended
        self._lean_head = b""
        self._lean_chunked = request.version >= (1, 1)
        self._lean_empty = False  # set by prepare, from the final status
        self._lean_keep = False

    @property
    def prepared(self) -> bool:
        return self._lean_phase > 0

    @property
    def lean_ended(self) -> bool:
        """The end of the body has been sent (``write_eof`` / ``lean_finish``)."""
        return self._lean_phase == 3

    def lean_abandon(self) -> bool:
        """Drop a response whose head has not gone out yet (the handler answers otherwise): whether it was."""
        if self._lean_phase != 1:
            return False
        self._lean_phase = 3
        self._lean_head = b""
        self._lean_req._stream = None
        return True

    @property
    def lean_keep_alive(self) -> bool:
        """Whether the connection may serve another request once this response has ended."""
        return self._lean_keep

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self._lean_phase:
            return None
        req = self._lean_req
        wire = req._wire
        keep = wire.keep_alive_for(req) and self._keep_alive is not False
        status = self.status
        self._lean_empty = req.method == "HEAD" or status in (204, 304) or status < 200
        if status in (204, 304) or status < 200:
            tail = ""  # no body, and no Content-Length (RFC 9110 §8.6)
        elif self._lean_empty:
            tail = "Content-Length: 0\r\n"
        elif self._lean_chunked:
            tail = "Transfer-Encoding: chunked\r\n"
        else:
            keep = False  # HTTP/1.0: the end of the body is the end of the connection
            tail = ""
        if keep:
            if req.version < (1, 1):
                tail += "Connection: keep-alive\r\n"
        elif req.version >= (1, 1):
            tail += "Connection: close\r\n"
        self._lean_keep = keep
        add_head_extra(req, self.headers)
        self._lean_head = encode_head(req.version, self.status, self.reason, self.headers, tail + "\r\n")
        self._lean_phase = 1
        req._stream = self
        wire.loop.call_soon(self._lean_flush_head)
        return None

    def _lean_flush_head(self) -> None:
        if self._lean_phase == 1:
            self._lean_phase = 2
            head, self._lean_head = self._lean_head, b""
            with contextlib.suppress(ConnectionResetError):  # the client is gone: the handler is cancelled
                self._lean_req._wire.send(head)

    def _lean_frame(self, data: bytes | bytearray | memoryview) -> bytes:
        if self._lean_empty or not data:
            return b""
        return _chunk(data) if self._lean_chunked else bytes(data)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.lean_write(data):
            await self._lean_req._wire.drain()

    def lean_write(self, data: bytes | bytearray | memoryview) -> bool:
        """``write`` without the wait: sends ``data`` at once; returns whether the transport is over its
        high-water mark (the caller then awaits ``drain`` before writing more)."""
        phase = self._lean_phase
        if phase == 0:
            raise RuntimeError("Cannot call write() before prepare()")
        if phase == 3:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._lean_chunked and data and not self._lean_empty:  # (_lean_frame's usual case, inlined)
            if phase == 2:  # the head is out: one chunk, framed and sent by the connection
                return self._lean_req._wire.send_chunk(data)
            frame = b"%x\r\n%s\r\n" % (len(data), data)
        else:
            frame = self._lean_frame(data)
        if phase == 1:
            frame = self._lean_head + frame
            self._lean_head = b""
            self._lean_phase = 2
        if not frame:
            return False
        wire = self._lean_req._wire
        wire.send(frame)
        return wire.write_paused

    def chunk_sender(self) -> Callable[[bytes], bool] | None:
        """Once the head is out, on a chunked body: what ``lean_write`` of non-empty data then does (the
        connection's ``send_chunk``: one chunk, returns whether to pause), for a caller writing many
        chunks; None otherwise. Not for empty data, nor after ``write_eof``."""
        if self._lean_phase == 2 and self._lean_chunked and not self._lean_empty:
            return self._lean_req._wire.send_chunk
        return None

    def framed_sender(self) -> Callable[[bytes], bool] | None:
        """``chunk_sender`` for chunks the caller frames itself (the connection's ``send_framed``: the
        plain token step in C builds each chunk's framing with its bytes)."""
        if self._lean_phase == 2 and self._lean_chunked and not self._lean_empty:
            return self._lean_req._wire.send_framed
        return None

    def lean_finish(self, data: bytes | bytearray | memoryview = b"") -> None:
        """End the body (idempotent): what ``write_eof`` sends, without waiting for the transport."""
        phase = self._lean_phase
        if phase == 3:
            return
        if phase == 0:
            raise RuntimeError("Cannot end a response that was not prepared")
        out = self._lean_frame(data)
        if self._lean_chunked and not self._lean_empty:
            out += CHUNK_END
        if phase == 1:
            out = self._lean_head + out
            self._lean_head = b""
        self._lean_phase = 3
        self._eof_sent = True
        if out:
            self._lean_req._wire.send(out)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._lean_phase == 3:
            return
        self.lean_finish(data)
        wire = self._lean_req._wire
        if wire.write_paused:
            await wire.drain()

    async def drain(self) -> None:
        await self._lean_req._wire.drain()
