"""The client side of the HTTP front's fuzz targets: a reference parse of what is sent (httptools, the
parser the lean server itself runs, so both agree on where each request starts and ends) and a strict
reader of what comes back (every response must be well-formed HTTP/1.x, framed by Content-Length,
chunked encoding or the connection's close)."""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass, field

import httptools
import orjson

WAIT = 15.0  # seconds the server may take to answer before it is a hang (generous: never a timing assertion)
ENVELOPE_KEYS = {"message", "type", "param", "code"}

_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9]) ([^\r\n]*)\r\n")
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\r\n]*)\r\n")
_CHUNK = re.compile(rb"([0-9a-fA-F]{1,16})(;[^\r\n]*)?\r\n")


class Hang(AssertionError):
    """The server neither answered nor closed within ``WAIT`` seconds."""


# ---- what the server should see --------------------------------------------------------------------


@dataclass
class RefMessage:
    method: str
    target: str
    keep_alive: bool
    complete: bool = False


@dataclass
class RefParse:
    """The requests in a byte stream as llhttp frames them: each one whose head was read (in order), and
    how the stream ends (a parse error, an upgrade, or the end of the data, maybe inside a message)."""

    heads: list[RefMessage] = field(default_factory=list)
    error: str | None = None
    upgrade: bool = False

    @property
    def complete(self) -> int:
        return sum(1 for m in self.heads if m.complete)


class _Ref:
    def __init__(self) -> None:
        self.out = RefParse()
        self.url: list[bytes] = []
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.url = []

    def on_url(self, url: bytes) -> None:
        self.url.append(url)

    def on_headers_complete(self) -> None:
        p = self.parser
        self.out.heads.append(
            RefMessage(
                p.get_method().decode("ascii", "surrogateescape"),
                b"".join(self.url).decode("utf-8", "surrogateescape"),
                p.should_keep_alive(),
            )
        )

    def on_message_complete(self) -> None:
        self.out.heads[-1].complete = True


def reference_parse(data: bytes) -> RefParse:
    ref = _Ref()
    try:
        ref.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        ref.out.upgrade = True
    except httptools.HttpParserError as e:
        ref.out.error = f"{type(e).__name__}: {e}"
    return ref.out


# ---- what comes back --------------------------------------------------------------------------------


@dataclass
class Response:
    minor: int
    status: int
    reason: bytes
    headers: list[tuple[str, str]]
    body: bytes
    close_delimited: bool = False

    def header(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for k, v in self.headers if k.lower() == name.lower() for t in v.split(",")}

    @property
    def closes(self) -> bool:
        """The connection ends after this response."""
        if self.close_delimited or "close" in self.tokens("connection"):
            return True
        return self.minor == 0 and "keep-alive" not in self.tokens("connection")

    def error(self) -> dict[str, object]:
        """The OpenAI envelope's error object (asserting its shape)."""
        ctype = self.header("content-type") or ""
        assert ctype.startswith("application/json"), (
            f"{self.status} error not JSON: {ctype!r} {self.body[:200]!r}"
        )
        d = orjson.loads(self.body)
        assert isinstance(d, dict) and set(d) == {"error"}, d
        err = d["error"]
        assert isinstance(err, dict) and set(err) == ENVELOPE_KEYS, err
        assert isinstance(err["message"], str) and err["message"], err
        return err


class Wire:
    """A buffered reader over a blocking socket (its timeout is ``WAIT``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False
        self.reset = False

    def _fill(self) -> bool:
        """More bytes into the buffer; False at the end of the stream (a reset counts as its end)."""
        if self.eof:
            return False
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise Hang(f"no answer and no close within {WAIT}s (have {self.buf[:300]!r})") from None
        except ConnectionResetError:
            self.reset = True
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def _line(self, what: str) -> bytes:
        while b"\r\n" not in self.buf:
            assert len(self.buf) < 1 << 20, f"unterminated {what}"
            if not self._fill():
                raise AssertionError(f"the connection ended inside a {what}: {self.buf[:300]!r}")
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line + b"\r\n"

    def _exactly(self, n: int, what: str) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise AssertionError(f"the connection ended inside a {what} ({len(self.buf)} of {n} bytes)")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        """Everything until the server closes (``Hang`` if it does not)."""
        while self._fill():
            assert len(self.buf) < 1 << 24, "an endless answer"
        out, self.buf = self.buf, b""
        return out

    def response(self, head_request: bool) -> Response | None:
        """The next response, checked to be well-formed; None if the connection ends before its first byte."""
        while not self.buf:
            if not self._fill():
                return None
        line = self._line("status line")
        m = _STATUS.fullmatch(line)
        assert m, f"not an HTTP/1.x status line: {line[:200]!r}"
        minor, status, reason = int(m.group(1)), int(m.group(2)), m.group(3)
        headers: list[tuple[str, str]] = []
        while (h := self._line("header block")) != b"\r\n":
            hm = _HEADER.fullmatch(h)
            assert hm, f"malformed response header line: {h[:200]!r}"
            headers.append((hm.group(1).decode("latin-1"), hm.group(2).decode("latin-1").rstrip(" \t")))
            assert len(headers) <= 200, "too many response headers"
        resp = Response(minor, status, reason, headers, b"")
        te = resp.tokens("transfer-encoding") - {""}
        cls = [v for k, v in headers if k.lower() == "content-length"]
        assert not (te and cls), f"both Transfer-Encoding and Content-Length: {headers}"
        assert len(cls) <= 1, f"several Content-Length fields: {cls}"
        if status < 200:
            assert status == 100 and not headers, f"unexpected interim response {status} {headers}"
            return resp
        if head_request or status in (204, 304):
            return resp
        if te:
            assert te == {"chunked"}, f"response Transfer-Encoding {te}"
            resp.body = self._chunked()
        elif cls:
            assert cls[0].isdigit(), f"bad response Content-Length {cls[0]!r}"
            resp.body = self._exactly(int(cls[0]), "response body")
        else:
            resp.body = self.rest()
            resp.close_delimited = True
        return resp

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            line = self._line("chunk size")
            m = _CHUNK.fullmatch(line)
            assert m, f"bad response chunk size line {line[:100]!r}"
            size = int(m.group(1), 16)
            if size == 0:
                while self._line("trailer") != b"\r\n":
                    pass
                return b"".join(parts)
            data = self._exactly(size + 2, "chunk")
            assert data.endswith(b"\r\n"), f"chunk not followed by CRLF: {data[-10:]!r}"
            parts.append(data[:-2])


# ---- one exchange ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    responses: list[Response]
    interim: int
    closed: bool
    port: int  # the client's port (the server's record of the requests it ran is by port)
    ran: list[tuple[str, str]] = field(default_factory=list)


def converse(port: int, data: bytes, wait_close: bool = True) -> Outcome:
    """Send ``data`` on a new connection and read what the server owes for it, checking what concerns
    the connection: one well-formed final answer per complete request at most (plus one protocol error),
    in order; an answer to every complete request unless one said it closes; a parse error answered and
    the connection closed; nothing after an answer that closes (``wait_close``: wait for the close,
    else stop reading there); every wait bounded (``Hang``)."""
    ref = reference_parse(data)
    responses: list[Response] = []
    interim = 0
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        local = s.getsockname()[1]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may close after an early answer
            s.sendall(data)
        wire = Wire(s)
        owed = ref.complete  # final responses owed if the connection stays open
        while True:
            i = len(responses)
            head = i < len(ref.heads) and ref.heads[i].method == "HEAD"
            if responses and responses[-1].closes:
                if not wait_close:
                    break
                last = responses[-1]
                rest = wire.rest()  # the server must close now (Hang otherwise)
                was_head = ref.heads[i - 1].method == "HEAD" if i - 1 < len(ref.heads) else False
                if (
                    was_head
                    and last.status >= 400
                    and rest
                    and len(rest) == int(last.header("content-length") or -1)
                ):
                    rest = b""  # a protocol error answered to HEAD with its envelope: a known defect
                assert rest == b"", f"bytes after a response that closes the connection: {rest[:300]!r}"
                closed = True
                break
            if len(responses) >= owed and ref.error is None and not ref.upgrade:
                break  # all answered: the connection is idle or waits for the rest of a message
            r = wire.response(head_request=head)
            if r is None:
                closed = True
                assert ref.error is None, (
                    f"closed without answering the malformed request ({ref.error}); "
                    f"{len(responses)} answers; reset={wire.reset}"
                )
                assert len(responses) >= owed, (
                    f"closed after {len(responses)} answers; {owed} requests were complete "
                    f"(reset={wire.reset})"
                )
                break
            if r.status < 200:
                interim += 1
                assert interim <= len(ref.heads), "more 100 Continue than requests"
                continue
            responses.append(r)
            assert len(responses) <= len(ref.heads) + 1, (
                f"{len(responses)} answers to {len(ref.heads)} requests"
            )
    return Outcome(responses, interim, closed, local)
