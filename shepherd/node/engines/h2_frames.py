"""HTTP/2 frames and header blocks for the lean gRPC client connection (h2_conn.py): the codec.

- frame encoders (``frame``, ``settings_frame``, ...) and request-header encoding (``RequestHeaders``:
  the HPACK block of a path is built once; only ``grpc-timeout`` is added per call);
- ``HeaderDecoder``: HPACK decoding with the ``hpack`` package, plus a cache of header blocks that leave
  the dynamic table unchanged (indexed fields and non-indexing literals: what a gRPC server sends for
  its usual response headers and OK trailers once its table is warm); such a decoding holds until a
  block that may change the table;
- the protocol's constants (frame types, flags, settings, error codes, default windows) and
  ``H2ProtocolError``.
"""

from __future__ import annotations

import struct

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
LOCAL_WINDOW = 16 * 1024 * 1024  # the connection's receive window
# each stream's (SETTINGS_INITIAL_WINDOW_SIZE): what an engine may send a stream whose credit is held (its
# client stopped reading) before it must wait; a token stream never comes near it
STREAM_WINDOW = 1024 * 1024

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
