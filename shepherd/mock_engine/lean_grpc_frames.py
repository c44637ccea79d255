"""The HTTP/2 side of the lean gRPC server (``lean_grpc``): the connection preface, frame types, flags,
window sizes and error codes it uses, ``frame`` (one frame's bytes), the gRPC response headers block
and ``trailers_block`` (``grpc-status`` / ``grpc-message``), and the ``grpc-timeout`` units.
"""

from __future__ import annotations

import grpc

from shepherd.mock_engine.hpack import encode_literal, encode_literal_indexed_name

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
DEFAULT_WINDOW = 65_535
OUR_STREAM_WINDOW = 1 << 24
OUR_CONN_WINDOW = 1 << 30
MAX_INBOUND_FRAME = 16_384
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0, 1, 3, 6, 9
CANCEL = 8

RESPONSE_HEADERS = b"\x88" + encode_literal_indexed_name(31, b"application/grpc")  # :status 200, content-type
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big") + payload


def _percent_encode(text: str) -> bytes:
    raw = text.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def trailers_block(code: grpc.StatusCode, details: str = "") -> bytes:
    block = encode_literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        block += encode_literal(b"grpc-message", _percent_encode(details))
    return block
