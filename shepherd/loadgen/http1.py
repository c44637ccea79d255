"""HTTP/1.1 on the client side, without I/O: request bytes and an incremental response parser.

The load generator keeps one request in flight per keep-alive connection, so the parser handles one
response at a time: status line and headers, then a body framed by ``Content-Length``, by
``Transfer-Encoding: chunked`` or by the connection closing. Bytes arrive split anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 1024


class ProtocolError(ValueError):
    """The peer sent something that is not a well-formed HTTP/1.1 response."""


class RequestTemplate:
    """Pre-built head bytes for one target; ``render(body)`` adds only the length and the body."""

    __slots__ = ("_head", "_tail")

    def __init__(self, host: str, port: int, path: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._tail = b"\r\n\r\n"

    def render(self, body: bytes) -> bytes:
        return b"".join((self._head, str(len(body)).encode("ascii"), self._tail, body))


# parser states
_HEAD = 0
_BODY_LENGTH = 1
_CHUNK_SIZE = 2
_CHUNK_DATA = 3
_CHUNK_CRLF = 4
_TRAILERS = 5
_BODY_EOF = 6
_DONE = 7


def _chunk_size(line: bytes) -> int:
    """The size in a chunk-size line (hex digits, optionally ``;extensions``)."""
    try:
        size = int(line, 16)
    except ValueError:
        semi = line.find(b";")
        try:
            size = int(line[:semi] if semi >= 0 else b"?", 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {line[:20]!r}") from None
    if size < 0:
        raise ProtocolError("negative chunk size")
    return size


class ResponseParser:
    """Incremental parser of one HTTP/1.1 response; ``reset()`` readies it for the next one.

    ``feed(data)`` consumes bytes and calls ``on_body`` with each piece of the decoded body as soon
    as it is known. After the last byte of the response, ``complete`` is true; bytes past the end
    of the response are returned by ``feed`` (the caller decides whether that is an error).
    ``feed_eof()`` marks the connection closed: it completes a close-delimited body and raises
    ``ProtocolError`` if the response was cut short.
    """

    __slots__ = (
        "_buf",
        "_on_body",
        "_remaining",
        "_state",
        "chunked",
        "content_length",
        "keep_alive",
        "reason",
        "status",
    )

    def __init__(self, on_body: Callable[[bytes], None]) -> None:
        self._on_body = on_body
        self.reset()

    def reset(self) -> None:
        self._buf = b""
        self._state = _HEAD
        self._remaining = 0
        self.status = 0
        self.reason = ""
        self.keep_alive = True
        self.chunked = False
        self.content_length: int | None = None

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    @property
    def started(self) -> bool:
        """Some bytes of the response have arrived."""
        return self._state != _HEAD or bool(self._buf)

    def feed(self, data: bytes) -> bytes:
        """Consume ``data``; return the bytes past the end of a complete response (normally none).

        The body pieces decoded from one ``feed`` go to ``on_body`` joined, in a single call.
        """
        buf = self._buf + data if self._buf else data
        self._buf = b""
        state = self._state
        remaining = self._remaining
        pieces: list[bytes] = []
        pos = 0
        size = len(buf)
        rest = b""
        while pos < size:
            if state == _CHUNK_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_CHUNK_LINE:
                        raise ProtocolError("chunk size line too long")
                    self._buf = buf[pos:]
                    break
                chunk_size = _chunk_size(buf[pos:end])
                pos = end + 2
                if chunk_size == 0:
                    state = _TRAILERS
                elif pos + chunk_size + 2 <= size:  # the whole chunk is here: the common case
                    end = pos + chunk_size
                    if buf[end : end + 2] != b"\r\n":
                        raise ProtocolError("chunk data not followed by CRLF")
                    pieces.append(buf[pos:end])
                    pos = end + 2
                else:
                    remaining = chunk_size
                    state = _CHUNK_DATA
            elif state in (_CHUNK_DATA, _BODY_LENGTH):
                avail = size - pos
                if avail <= remaining:
                    pieces.append(buf[pos:] if pos else buf)
                    remaining -= avail
                    pos = size
                else:
                    pieces.append(buf[pos : pos + remaining])
                    pos += remaining
                    remaining = 0
                if remaining == 0:
                    state = _CHUNK_CRLF if state == _CHUNK_DATA else _DONE
            elif state == _CHUNK_CRLF:
                if size - pos < 2:
                    self._buf = buf[pos:]
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            elif state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD_BYTES:
                        raise ProtocolError("response head too long")
                    self._buf = buf[pos:]
                    break
                self._parse_head(buf[pos:end])
                pos = end + 4
                state = self._state
                remaining = self._remaining
            elif state == _TRAILERS:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD_BYTES:
                        raise ProtocolError("trailer too long")
                    self._buf = buf[pos:]
                    break
                if end == pos:
                    state = _DONE
                pos = end + 2
            elif state == _BODY_EOF:
                pieces.append(buf[pos:] if pos else buf)
                pos = size
            else:  # _DONE
                rest = buf[pos:]
                break
        self._state = state
        self._remaining = remaining
        if pieces:
            self._on_body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return rest

    def feed_eof(self) -> None:
        """The connection closed. Completes a close-delimited body; otherwise the response was cut."""
        if self._state == _BODY_EOF:
            self._state = _DONE
            return
        if self._state != _DONE:
            raise ProtocolError("connection closed before the response was complete")

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = lines[0]
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise ProtocolError(f"bad status code {parts[1][:10]!r}") from None
        if not 100 <= status <= 999:
            raise ProtocolError(f"bad status code {status}")
        if 100 <= status < 200:
            # interim response (100 Continue, 103 Early Hints): wait for the final one
            return
        self.status = status
        self.reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        keep_alive = parts[0] == b"HTTP/1.1"
        content_length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            key = name.strip().lower()
            if key == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    raise ProtocolError(f"bad content-length {value[:20]!r}") from None
                if length < 0 or (content_length is not None and content_length != length):
                    raise ProtocolError("bad content-length")
                content_length = length
            elif key == b"transfer-encoding":
                codings = [c.strip().lower() for c in value.split(b",")]
                if codings and codings[-1] == b"chunked":
                    chunked = True
            elif key == b"connection":
                tokens = {c.strip().lower() for c in value.split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.content_length = content_length
        if status in (204, 304):
            self._state = _DONE
        elif chunked:
            self._state = _CHUNK_SIZE
        elif content_length is not None:
            if content_length == 0:
                self._state = _DONE
            else:
                self._remaining = content_length
                self._state = _BODY_LENGTH
        else:
            self.keep_alive = False
            self._state = _BODY_EOF
