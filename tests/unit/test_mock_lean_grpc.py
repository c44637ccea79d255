"""The mock engine's lean gRPC server: HPACK, hand-encoded chunks, HTTP/2 flow control and cancellation
(driven frame by frame through a fake transport; the real-client path is in the e2e tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2, vllm_engine_pb2

from shepherd.mock_engine.hpack import (
    HUFFMAN_CODES,
    HUFFMAN_LENGTHS,
    Decoder,
    HpackError,
    encode_int,
    encode_literal,
    huffman_decode,
    huffman_encode,
)
from shepherd.mock_engine.lean_grpc import GrpcH2Protocol, LeanGrpcServer
from shepherd.mock_engine.lean_grpc_frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from shepherd.mock_engine.wire import ChunkWire

# ---- HPACK ------------------------------------------------------------------------------------------


def test_huffman_table_is_the_rfc_code() -> None:
    assert sum(2.0**-n for n in HUFFMAN_LENGTHS) == 1.0  # a complete prefix code
    assert HUFFMAN_CODES[0] == 0x1FF8 and HUFFMAN_CODES[ord("a")] == 0x3 and HUFFMAN_CODES[ord(" ")] == 0x14
    assert HUFFMAN_CODES[255] == 0x3FFFFEE and HUFFMAN_CODES[256] == 0x3FFFFFFF  # EOS
    assert huffman_encode(b"www.example.com").hex() == "f1e3c2e5f23a6ba0ab90f4ff"  # RFC 7541 C.4.1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_huffman_round_trip(data: bytes) -> None:
    assert huffman_decode(huffman_encode(data)) == data


def test_huffman_rejects_bad_padding() -> None:
    with pytest.raises(HpackError):
        huffman_decode(b"\x00")  # '0' then 3 zero bits of padding (padding must be ones)


def test_rfc_7541_request_examples_with_dynamic_table() -> None:
    d = Decoder()
    first = d.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    assert first == [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/"),
        (b":authority", b"www.example.com"),
    ]
    second = d.decode(bytes.fromhex("828684be5886a8eb10649cbf"))
    assert second[-1] == (b"cache-control", b"no-cache") and second[3] == (b":authority", b"www.example.com")
    third = d.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))
    assert third[-1] == (b"custom-key", b"custom-value") and third[2] == (b":path", b"/index.html")
    with pytest.raises(HpackError):
        d.decode(b"\xff\x7f")  # an index far past the tables


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**28), st.integers(1, 8))
def test_integer_encoding_round_trips(value: int, prefix: int) -> None:
    block = encode_int(value, prefix)
    # wrap as a literal-without-indexing name index when the prefix is 4 (exercises the decoder path)
    if prefix == 4 and 0 < value <= 61:
        assert Decoder().decode(block + b"\x01x")[0][1] == b"x"
    assert block[0] & ((1 << prefix) - 1) == min(value, (1 << prefix) - 1)


# ---- hand-encoded chunks ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["sglang", "vllm"]),
    rid=st.text(max_size=40),
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    prompt=st.integers(0, 2**31 - 1),
    cached=st.integers(0, 2**31 - 1),
    completion=st.integers(0, 2**31 - 1),
    index=st.integers(0, 2**31 - 1),
)
def test_chunk_wire_equals_protobuf(
    kind: str, rid: str, ids: list[int], prompt: int, cached: int, completion: int, index: int
) -> None:
    got = ChunkWire(kind, rid, prompt, cached).chunk(ids, completion, index)
    fields = {
        "token_ids": ids,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
    }
    if kind == "sglang":
        pb = sglang_scheduler_pb2
        want = pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(index=index, **fields))
    else:
        pb = vllm_engine_pb2
        want = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(index=index, **fields))
    assert got == want.SerializeToString()


# ---- HTTP/2 through a fake transport ------------------------------------------------------------------


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        out = []
        buf = bytes(self.data)
        pos = 0
        while pos + 9 <= len(buf):
            n = int.from_bytes(buf[pos : pos + 3], "big")
            out.append(
                (
                    buf[pos + 3],
                    buf[pos + 4],
                    int.from_bytes(buf[pos + 5 : pos + 9], "big"),
                    buf[pos + 9 : pos + 9 + n],
                )
            )
            pos += 9 + n
        return out


def request_frames(stream_id: int, path: bytes, message: bytes, timeout: bytes | None = None) -> bytes:
    block = (
        b"\x83\x86" + encode_literal(b":path", path) + encode_literal(b"content-type", b"application/grpc")
    )
    if timeout is not None:
        block += encode_literal(b"grpc-timeout", timeout)
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    return frame(HEADERS, END_HEADERS, stream_id, block) + frame(DATA, END_STREAM, stream_id, body)


def settings_frame(**values: int) -> bytes:
    ids = {"initial_window": 4, "max_frame": 5}
    payload = b"".join(ids[k].to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items())
    return frame(SETTINGS, 0, 0, payload)


def grpc_messages(frames: list[tuple[int, int, int, bytes]], stream_id: int) -> list[bytes]:
    data = b"".join(p for t, _, s, p in frames if t == DATA and s == stream_id)
    out = []
    pos = 0
    while pos + 5 <= len(data):
        n = int.from_bytes(data[pos + 1 : pos + 5], "big")
        out.append(data[pos + 5 : pos + 5 + n])
        pos += 5 + n
    return out


def trailers(frames: list[tuple[int, int, int, bytes]], stream_id: int) -> dict[bytes, bytes] | None:
    for t, flags, s, p in frames:
        if t == HEADERS and s == stream_id and flags & END_STREAM:
            return dict(Decoder().decode(p))
    return None


class Harness:
    def __init__(self) -> None:
        self.server = LeanGrpcServer()
        self.proto = GrpcH2Protocol(self.server)
        self.transport = FakeTransport()
        self.proto.connection_made(self.transport)  # type: ignore[arg-type]
        self.done: list[str] = []

    def feed(self, data: bytes) -> None:
        self.proto.data_received(data)

    async def settle(self, rounds: int = 5) -> list[tuple[int, int, int, bytes]]:
        for _ in range(rounds):
            await asyncio.sleep(0)
        return self.transport.frames()


async def test_streamed_messages_respect_the_flow_control_window() -> None:
    h = Harness()

    async def stream(request: bytes, ctx: Any) -> AsyncIterator[bytes]:
        for i in range(4):
            yield bytes([i]) * 10  # 15 bytes per framed gRPC message

    h.server.handlers[b"/t.S/Stream"] = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=bytes, response_serializer=bytes
    )
    h.feed(PREFACE + settings_frame(initial_window=20) + request_frames(1, b"/t.S/Stream", b"hi"))
    frames = await h.settle()
    sent = sum(len(p) for t, _, s, p in frames if t == DATA and s == 1)
    assert sent == 20 and trailers(frames, 1) is None  # blocked on the stream window
    h.feed(frame(WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    frames = await h.settle()
    assert grpc_messages(frames, 1) == [bytes([i]) * 10 for i in range(4)]
    t = trailers(frames, 1)
    assert t is not None and t[b"grpc-status"] == b"0"
    assert all(len(p) <= 20 for tp, _, s, p in frames if tp == DATA and s == 1)


async def test_client_reset_cancels_the_handler_and_runs_done_callbacks() -> None:
    h = Harness()
    started = asyncio.Event()
    finished: list[str] = []

    async def slow(request: bytes, ctx: Any) -> AsyncIterator[bytes]:
        ctx.add_done_callback(lambda _c: finished.append("done"))
        try:
            yield b"first"
            started.set()
            await asyncio.sleep(30)
            yield b"never"
        finally:
            finished.append("finally")

    h.server.handlers[b"/t.S/Slow"] = grpc.unary_stream_rpc_method_handler(
        slow, request_deserializer=bytes, response_serializer=bytes
    )
    h.feed(PREFACE + settings_frame() + request_frames(1, b"/t.S/Slow", b""))
    await asyncio.wait_for(started.wait(), 5)
    h.feed(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
    frames = await h.settle()
    assert sorted(finished) == ["done", "finally"]
    assert trailers(frames, 1) is None and grpc_messages(frames, 1) == [b"first"]


async def test_unknown_method_abort_and_deadline() -> None:
    h = Harness()

    async def unary(request: bytes, ctx: Any) -> bytes:
        if request == b"abort":
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected 100%")
        if request == b"sleep":
            await asyncio.sleep(30)
        return request.upper()

    h.server.handlers[b"/t.S/Unary"] = grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=bytes, response_serializer=bytes
    )
    h.feed(PREFACE + settings_frame())
    h.feed(request_frames(1, b"/t.S/Nope", b""))
    h.feed(request_frames(3, b"/t.S/Unary", b"abort"))
    h.feed(request_frames(5, b"/t.S/Unary", b"ok"))
    h.feed(request_frames(7, b"/t.S/Unary", b"sleep", timeout=b"20m"))
    await asyncio.sleep(0.3)
    frames = await h.settle()
    nope = trailers(frames, 1)
    assert nope is not None and nope[b"grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]).encode()
    aborted = trailers(frames, 3)
    assert (
        aborted is not None
        and aborted[b"grpc-status"] == b"14"
        and aborted[b"grpc-message"] == b"injected 100%25"
    )
    ok = trailers(frames, 5)
    assert ok is not None and ok[b"grpc-status"] == b"0" and grpc_messages(frames, 5) == [b"OK"]
    late = trailers(frames, 7)
    assert late is not None and late[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED


async def test_large_message_is_split_into_frames_and_ping_is_answered() -> None:
    h = Harness()
    big = bytes(range(256)) * 200  # 51,200 bytes: several 16 KiB frames

    async def unary(request: bytes, ctx: Any) -> bytes:
        return big

    h.server.handlers[b"/t.S/Big"] = grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=bytes, response_serializer=bytes
    )
    h.feed(
        PREFACE
        + settings_frame(initial_window=1 << 20)
        + frame(WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big"))
    )
    h.feed(request_frames(1, b"/t.S/Big", b"") + frame(6, 0, 0, b"12345678"))
    frames = await h.settle()
    assert (6, 1, 0, b"12345678") in frames  # PING ACK
    assert grpc_messages(frames, 1) == [big]
    assert max(len(p) for t, _, _, p in frames if t == DATA) <= 16384
