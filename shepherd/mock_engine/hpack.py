"""HPACK (RFC 7541) for the lean gRPC server: a full decoder (static + dynamic table, Huffman) and a
minimal encoder (literals without indexing, so the encoder keeps no state).

The Huffman code is canonical (codes assigned in order of length, then symbol), so the table is the
257 code lengths of RFC 7541 Appendix B; codes and a 4-bit-at-a-time decoding automaton are derived
from them at import.
"""

from __future__ import annotations

from collections import deque

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)

# RFC 7541 Appendix B: code length of each symbol 0..255, then EOS (256).
HUFFMAN_LENGTHS: tuple[int, ...] = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
)  # fmt: skip

EOS = 256


class HpackError(ValueError):
    """A malformed header block (a connection error of type COMPRESSION_ERROR)."""


def _canonical_codes(lengths: tuple[int, ...]) -> list[int]:
    codes = [0] * len(lengths)
    code = 0
    prev = 0
    for sym in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code <<= lengths[sym] - prev
        codes[sym] = code
        code += 1
        prev = lengths[sym]
    return codes


HUFFMAN_CODES: tuple[int, ...] = tuple(_canonical_codes(HUFFMAN_LENGTHS))


def _build_decoder() -> tuple[list[int], list[int], list[bool]]:
    """A 4-bit automaton over the code tree: ``next_state[s*16+n]``, ``emit[s*16+n]`` (-1: none)."""
    children: list[list[int]] = [[-1, -1]]  # internal nodes; a leaf is stored as -(symbol + 2)
    depth = [0]
    all_ones = [True]
    for sym, (code, length) in enumerate(zip(HUFFMAN_CODES, HUFFMAN_LENGTHS, strict=True)):
        node = 0
        for i in range(length - 1, -1, -1):
            bit = (code >> i) & 1
            if i == 0:
                children[node][bit] = -(sym + 2)
            else:
                nxt = children[node][bit]
                if nxt == -1:
                    nxt = len(children)
                    children.append([-1, -1])
                    depth.append(depth[node] + 1)
                    all_ones.append(all_ones[node] and bit == 1)
                    children[node][bit] = nxt
                node = nxt
    states = len(children)
    next_state = [0] * (states * 16)
    emit = [-1] * (states * 16)
    for s in range(states):
        for nibble in range(16):
            node = s
            sym = -1
            for i in (3, 2, 1, 0):
                nxt = children[node][(nibble >> i) & 1]
                if nxt < -1:
                    sym = -nxt - 2
                    node = 0
                elif nxt == -1:  # cannot happen: the code is complete
                    raise AssertionError("incomplete Huffman code")
                else:
                    node = nxt
            next_state[s * 16 + nibble] = node
            emit[s * 16 + nibble] = sym
    accepting = [s == 0 or (all_ones[s] and depth[s] <= 7) for s in range(states)]
    return next_state, emit, accepting


_NEXT, _EMIT, _ACCEPT = _build_decoder()


def huffman_decode(data: bytes) -> bytes:
    nxt = _NEXT
    emit = _EMIT
    out = bytearray()
    state = 0
    for byte in data:
        i = (state << 4) | (byte >> 4)
        sym = emit[i]
        if sym >= 0:
            if sym == EOS:
                raise HpackError("EOS in a Huffman string")
            out.append(sym)
        i = (nxt[i] << 4) | (byte & 15)
        sym = emit[i]
        if sym >= 0:
            if sym == EOS:
                raise HpackError("EOS in a Huffman string")
            out.append(sym)
        state = nxt[i]
    if not _ACCEPT[state]:
        raise HpackError("bad Huffman padding")
    return bytes(out)


def huffman_encode(data: bytes) -> bytes:
    """Huffman-encode (for tests: the server's own encoder never uses Huffman)."""
    acc = 0
    bits = 0
    out = bytearray()
    for b in data:
        acc = (acc << HUFFMAN_LENGTHS[b]) | HUFFMAN_CODES[b]
        bits += HUFFMAN_LENGTHS[b]
        while bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
        acc &= (1 << bits) - 1
    if bits:
        out.append(((acc << (8 - bits)) | ((1 << (8 - bits)) - 1)) & 0xFF)
    return bytes(out)


def _decode_int(data: bytes, pos: int, prefix: int) -> tuple[int, int]:
    mask = (1 << prefix) - 1
    if pos >= len(data):
        raise HpackError("truncated integer")
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("truncated integer")
        b = data[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 35:
            raise HpackError("integer too large")


def encode_int(value: int, prefix: int, first_bits: int = 0) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((first_bits | value,))
    out = bytearray((first_bits | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + encode_int(len(name), 7) + name + encode_int(len(value), 7) + value


def encode_literal_indexed_name(index: int, value: bytes) -> bytes:
    """A literal header field without indexing whose name is a static-table entry."""
    return encode_int(index, 4) + encode_int(len(value), 7) + value


class Decoder:
    """Decodes header blocks of one connection (the dynamic table is connection state)."""

    def __init__(self, max_table_size: int = 4096) -> None:
        self.max_allowed = max_table_size  # what we advertised (SETTINGS_HEADER_TABLE_SIZE)
        self.max_size = max_table_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._size = 0
        self._huffman_cache: dict[bytes, bytes] = {}

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackError("truncated string")
        huff = data[pos] & 0x80
        length, pos = _decode_int(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("truncated string")
        raw = data[pos:end]
        if huff:
            cached = self._huffman_cache.get(raw)
            if cached is None:
                cached = huffman_decode(raw)
                if len(self._huffman_cache) < 4096:
                    self._huffman_cache[raw] = cached
            return cached, end
        return raw, end

    def _get(self, index: int) -> tuple[bytes, bytes]:
        if index <= 0:
            raise HpackError("index 0")
        if index <= 61:
            return STATIC_TABLE[index - 1]
        i = index - 62
        if i >= len(self._table):
            raise HpackError(f"index {index} out of range")
        return self._table[i]

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 32
        table = self._table
        while table and self._size + size > self.max_size:
            n, v = table.pop()
            self._size -= len(n) + len(v) + 32
        if size <= self.max_size:
            table.appendleft((name, value))
            self._size += size

    def _resize(self, size: int) -> None:
        if size > self.max_allowed:
            raise HpackError("table size update over the advertised limit")
        self.max_size = size
        table = self._table
        while table and self._size > size:
            n, v = table.pop()
            self._size -= len(n) + len(v) + 32

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos = 0
        end = len(data)
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field
                index, pos = _decode_int(data, pos, 7)
                headers.append(self._get(index))
            elif b & 0x40:  # literal with incremental indexing
                name, value, pos = self._literal(data, pos, 6)
                self._add(name, value)
                headers.append((name, value))
            elif b & 0x20:  # dynamic table size update
                size, pos = _decode_int(data, pos, 5)
                self._resize(size)
            else:  # literal without indexing (0000) / never indexed (0001)
                name, value, pos = self._literal(data, pos, 4)
                headers.append((name, value))
        return headers

    def _literal(self, data: bytes, pos: int, prefix: int) -> tuple[bytes, bytes, int]:
        """A literal field at ``pos``: its name by index (a ``prefix``-bit integer, the kinds of literal
        differ only in that width) or, at index 0, as a string; then its value."""
        index, pos = _decode_int(data, pos, prefix)
        if index:
            name = self._get(index)[0]
        else:
            name, pos = self._string(data, pos)
        value, pos = self._string(data, pos)
        return name, value, pos
