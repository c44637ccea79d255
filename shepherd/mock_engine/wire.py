"""Hand-encoded protobuf bytes for the hottest message, a streamed ``GenerateResponse`` chunk.

Building and serializing the message with protobuf costs ~10 µs here; assembling the wire bytes from
a per-request prefix/suffix and a few varints costs a fraction of that. The bytes parse to exactly
the message protobuf would build (tests compare them field by field). Used by the lean gRPC server,
which passes ``bytes`` responses through unchanged.

SGLang ``GenerateResponse``: request_id = 1, chunk = 2; ``GenerateStreamChunk``: token_ids = 1
(packed), prompt_tokens = 2, completion_tokens = 3, cached_tokens = 4, index = 8.
vLLM ``GenerateResponse``: chunk = 1; ``GenerateStreamChunk``: token_ids = 1, prompt_tokens = 2,
completion_tokens = 3, cached_tokens = 4, index = 7.
"""

from __future__ import annotations

from collections.abc import Sequence

from shepherd.proto.varint import SMALL as _SMALL
from shepherd.proto.varint import varint


def packed_uint32(values: Sequence[int]) -> bytes:
    small = _SMALL
    return b"".join([small[v] if v < 16384 else varint(v) for v in values])


class ChunkWire:
    """Encodes the chunks of one request (the parts that do not change are built once)."""

    __slots__ = ("_cached", "_chunk_tag", "_head", "_index_tag", "_tail")

    def __init__(self, kind: str, request_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        if kind == "sglang":
            rid = request_id.encode()
            self._head = b"\x0a" + varint(len(rid)) + rid if rid else b""
            self._chunk_tag = b"\x12"
            self._index_tag = 0x40
        elif kind == "vllm":
            self._head = b""
            self._chunk_tag = b"\x0a"
            self._index_tag = 0x38
        else:
            raise ValueError(f"unknown kind {kind!r}")
        tail = b""
        if prompt_tokens:
            tail += b"\x10" + varint(prompt_tokens)
        self._tail = tail
        self._cached = b"\x20" + varint(cached_tokens) if cached_tokens else b""

    def chunk(self, token_ids: Sequence[int], completion_tokens: int, index: int = 0) -> bytes:
        ids = packed_uint32(token_ids)
        body = b"".join(
            (
                b"\x0a" + varint(len(ids)) + ids if ids else b"",
                self._tail,
                b"\x18" + varint(completion_tokens) if completion_tokens else b"",
                self._cached,
                bytes((self._index_tag,)) + varint(index) if index else b"",
            )
        )
        return b"".join((self._head, self._chunk_tag, varint(len(body)), body))
