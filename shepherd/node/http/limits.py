"""What a connection of the lean HTTP/1.1 server may send, and how it is refused beyond that.

``Limits`` (the body limit is ``LeanServer(max_body=...)``); protocol-level faults (``_Fault``, carried out
of a parser callback by ``_Limit``), answered in the OpenAI error envelope (``error_body``), or in the
Anthropic one for a request to the Messages API (``fault_body``), before the connection closes; the
errors a refused request body raises in its handler (too large, undecodable, an unknown coding); the 500
answered for an error that escapes the app; and ``_Decoder``, which decodes a request's
``Content-Encoding`` as the body arrives, never past the size cap.

Request bodies with ``Content-Encoding: gzip`` / ``deflate`` are decoded as they arrive, under
the same size cap (a decompression bomb stops at ``max_body``); a corrupt one makes ``read()`` raise
``ContentEncodingError`` (→ 400), an unknown coding ``web.HTTPUnsupportedMediaType`` (→ 415).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from shepherd.proto.anthropic_errors import anthropic_body, anthropic_status
from shepherd.proto.openai_errors import ApiError


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection may send and keep (the body limit is ``LeanServer(max_body=...)``)."""

    max_line: int = 65536  # request target (URL) bytes → 414
    max_field: int = 65536  # one header field, name + value (large JWTs) → 431
    max_headers: int = 128  # header fields → 431
    max_head: int = 256 * 1024  # the whole head → 431
    max_pipeline: int = 16  # parsed requests waiting behind the current one before reading pauses
    linger_secs: float = 5.0  # reading (and dropping) a refused body before closing
    keepalive_secs: float = 75.0  # an idle connection is closed after this (aiohttp's default)
    head_secs: float = 30.0  # a request head must arrive whole within this of its first byte → 408
    body_secs: float = 300.0  # and the whole request (body included) within this → 408
    # a TLS handshake must be done within this of the accept (asyncio's default, 60 s, let a client that
    # opens connections and sends nothing hold a descriptor each for a minute before the cap counts them)
    tls_handshake_secs: float = 10.0
    # a client that reads nothing of a response for this long (its buffers full) is gone: the response
    # ends, and with it the engine request it holds (KV cache), which would otherwise wait for the
    # request timeout
    write_stall_secs: float = 60.0


def error_body(status: int, message: str, code: str | None) -> bytes:
    """The OpenAI error envelope of a protocol-level refusal."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code).body()


# what error_middleware answers for an unhandled error, for one that escapes the app
_INTERNAL = ApiError(500, "Internal error in the gateway.", type="internal_error", code="internal").body()


@dataclass(frozen=True, slots=True)
class _Fault:
    """A protocol-level refusal: answered in its turn, then the connection closes."""

    status: int
    message: str
    code: str
    anthropic: bool = False  # the request was to the Messages API (``/v1/messages*``): its envelope


def fault_body(fault: _Fault) -> tuple[int, bytes]:
    """The status and body a protocol-level refusal is answered with, in its API's envelope."""
    if fault.anthropic:
        return anthropic_status(fault.status), orjson.dumps(anthropic_body(fault.status, fault.message))
    return fault.status, error_body(fault.status, fault.message, fault.code)


class _Limit(Exception):
    def __init__(self, fault: _Fault) -> None:
        super().__init__(fault.message)
        self.fault = fault


class _Decoder:
    """A request ``Content-Encoding`` decoded as the body arrives, never past ``limit`` bytes out."""

    __slots__ = ("_d", "gzip", "limit", "members", "out")

    MAX_MEMBERS = 64  # gzip members in one body (real concatenated bodies have a handful)

    def __init__(self, gzip: bool, limit: int) -> None:
        self.gzip = gzip
        self.members = 1
        self._d: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        self.limit = limit
        self.out = 0

    def feed(self, data: bytes) -> bytes:
        """Decoded bytes; ``zlib.error`` on a corrupt stream, ``OverflowError`` past the limit. A gzip body
        may be several members one after another (RFC 1952 §2.2; ``gzip``'s and Python's readers take
        them): each ends where the next begins."""
        if not data:
            return b""
        if self._d is None:  # deflate: zlib-wrapped (RFC 9110) or raw, as clients send both
            self._d = zlib.decompressobj(zlib.MAX_WBITS if (data[0] & 0x0F) == 8 else -zlib.MAX_WBITS)
        outs: list[bytes] = []
        while True:  # (bounded: each turn takes a member's bytes off ``data``)
            d = self._d
            out: bytes = d.decompress(data, self.limit - self.out + 1)
            self.out += len(out)
            outs.append(out)
            if self.out > self.limit or d.unconsumed_tail:
                raise OverflowError
            if not (self.gzip and d.eof and d.unused_data):
                return outs[0] if len(outs) == 1 else b"".join(outs)
            # each member's end copies the rest of the read (``unused_data``): bounded in number, so that a
            # body of tiny empty members costs no more than a few copies of one read
            self.members += 1
            if self.members > self.MAX_MEMBERS:
                raise zlib.error(f"more than {self.MAX_MEMBERS} gzip members")
            data = d.unused_data
            self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def end(self) -> bytes:
        d = self._d
        if d is None:
            return b""
        out: bytes = d.flush()
        self.out += len(out)
        if self.out > self.limit:
            raise OverflowError
        if not d.eof:
            raise zlib.error("the compressed body ends early")
        if d.unused_data:
            raise zlib.error("data after the end of the compressed body")
        return out


def _too_large(limit: int, size: int) -> BaseException:
    return web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)


def _refused_caller() -> BaseException:
    """A gated request's body (never read: the app's authentication answers first, with the refusal made
    at the head; raised only if the address refused at the head for its failed attempts no longer was by
    the time the app ran, and its credential passed)."""
    return web.HTTPUnauthorized(text="The request's credential was refused before its body was read; retry.")


def _corrupt(why: str) -> BaseException:
    return ContentEncodingError(f"the request body does not decode: {why}")


def _unsupported(coding: str) -> Callable[[], BaseException]:
    msg = f"Content-Encoding {coding[:40]!r} is not supported (use gzip or deflate)."
    return lambda: web.HTTPUnsupportedMediaType(text=msg)


def _internal_error() -> web.Response:
    return web.Response(status=500, body=_INTERNAL, content_type="application/json")
