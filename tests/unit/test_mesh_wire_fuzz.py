"""The mesh wire decoders are total and strict: on any input they raise ``WireError`` (nothing else) or
return a well-formed value: one the encoders accept and that decodes back to itself (round trip).

Every decoder (``decode_packet``, ``decode_push_pull``, ``decode_tcp_request``, ``decode_rpc_reply``) is
fed random bytes, valid frames of every kind with bytes mutated, truncated or extended, and well-formed
msgpack of the wrong shape (numbers at and over every bound); a valid frame cut short or with trailing
bytes must be refused, and a frame with a field pushed past its bound must be refused. Examples are bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import (
    MAX_META_LEN,
    MAX_NAME_LEN,
    Ack,
    Alive,
    Dead,
    Member,
    MemberState,
    Message,
    Nack,
    NodeAddr,
    Packet,
    Ping,
    PingReq,
    PushPullState,
    RpcReply,
    RpcRequest,
    RpcStatus,
    Suspect,
    User,
)
from shepherd.proto.mesh_wire import MAX_INCARNATION, WireError

DECODERS: list[Callable[[bytes], Any]] = [
    mesh_wire.decode_packet,
    mesh_wire.decode_push_pull,
    mesh_wire.decode_tcp_request,
    mesh_wire.decode_rpc_reply,
]

names = st.text(min_size=1, max_size=20)
incs = st.integers(0, MAX_INCARNATION)
addrs = st.builds(NodeAddr, names, names, st.integers(0, 65535))
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Ping, st.integers(0, 2**32 - 1), names, addrs),
    st.builds(PingReq, st.integers(0, 2**32 - 1), addrs, addrs, st.booleans()),
    st.builds(Ack, st.integers(0, 2**32 - 1)),
    st.builds(Nack, st.integers(0, 2**32 - 1)),
    st.builds(Alive, names, names, st.integers(0, 65535), incs, st.binary(max_size=20)),
    st.builds(Suspect, incs, names, names),
    st.builds(Dead, incs, names, names),
    st.builds(User, st.binary(max_size=50)),
)
stamps = st.none() | st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
members = st.builds(
    Member,
    names,
    names,
    st.integers(0, 65535),
    incs,
    st.sampled_from(list(MemberState)),
    st.binary(max_size=20),
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One valid frame of any kind."""
    kind = draw(st.sampled_from(["packet", "push_pull", "rpc_request", "rpc_reply"]))
    if kind == "packet":
        msgs = draw(st.lists(messages, min_size=1, max_size=5))
        return mesh_wire.encode_packet(msgs, budget=60_000, sender=draw(names), stamp=draw(stamps))
    if kind == "push_pull":
        state = PushPullState(
            tuple(draw(st.lists(members, max_size=5))), draw(st.binary(max_size=40)), draw(st.booleans())
        )
        return mesh_wire.encode_push_pull(state)
    if kind == "rpc_request":
        return mesh_wire.encode_rpc_request(RpcRequest(draw(st.binary(max_size=40))))
    status = draw(st.sampled_from(list(RpcStatus)))
    return mesh_wire.encode_rpc_reply(
        RpcReply(status, draw(st.binary(max_size=40)), draw(st.text(max_size=30)))
    )


def _reencode(value: object) -> bytes | None:
    """The encoding of a decoded value (None: a packet whose every message was of an unknown type)."""
    if isinstance(value, Packet):
        if not value.msgs:
            assert value.skipped > 0  # a packet with no message at all is refused
            return None
        return mesh_wire.encode_packet(
            list(value.msgs), budget=mesh_wire.MAX_PACKET_BYTES, sender=value.sender, stamp=value.stamp
        )
    if isinstance(value, PushPullState):
        return mesh_wire.encode_push_pull(value)
    if isinstance(value, RpcRequest):
        return mesh_wire.encode_rpc_request(value)
    assert isinstance(value, RpcReply), value
    return mesh_wire.encode_rpc_reply(value)


def _total(data: bytes) -> int:
    """Every decoder on ``data``: ``WireError``, or a value that round-trips (re-encoded by the encoders,
    which check every bound, and decoded again to an equal value). How many decoders accepted it."""
    accepted = 0
    for decode in DECODERS:
        try:
            value = decode(data)
        except WireError:
            continue
        accepted += 1
        again = _reencode(value)
        if again is not None:
            back = decode(again)
            if isinstance(value, Packet):  # the replay stamp and the known messages survive; skipped ones not
                assert (back.sender, back.msgs, back.stamp) == (value.sender, value.msgs, value.stamp)
            else:
                assert back == value
    return accepted


def _decoder_of(frame: bytes) -> Callable[[bytes], Any]:
    """The decoder of a valid frame's own kind (the first that accepts it)."""
    for decode in (mesh_wire.decode_packet, mesh_wire.decode_push_pull, mesh_wire.decode_rpc_reply):
        try:
            decode(frame)
        except WireError:
            continue
        return decode
    return mesh_wire.decode_tcp_request  # an RPC request


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes(data: bytes) -> None:
    _total(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames(), st.data())
def test_mutated_valid_frames(frame: bytes, data: st.DataObject) -> None:
    raw = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "extend"]))
        if op == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        elif op == "insert":
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=9))
        else:
            raw += data.draw(st.binary(min_size=1, max_size=9))
    _total(bytes(raw))


@settings(max_examples=200, deadline=None)
@given(frames())
def test_valid_frames_decode_by_their_kind_and_round_trip(frame: bytes) -> None:
    assert _total(frame) >= 1  # at least its own kind's decoder takes it
    assert _decoder_of(frame)(frame) is not None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames(), st.data())
def test_a_valid_frame_cut_short_or_with_trailing_bytes_is_refused(frame: bytes, data: st.DataObject) -> None:
    decode = _decoder_of(frame)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(WireError):
        decode(frame[:cut])  # msgpack sees the end of the input inside the frame
    with pytest.raises(WireError):
        decode(frame + data.draw(st.binary(min_size=1, max_size=9)))  # bytes after the frame


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["seq", "port", "incarnation", "name", "meta"]), st.integers(1, 2**20))
def test_a_field_past_its_bound_is_refused(field: str, over: int) -> None:
    """The decoder checks every bound the encoder keeps: an Alive / Ping with one field just past it."""
    addr = ["n", "h", 1]
    if field == "seq":
        raw: list[Any] = [mesh_wire.PING, mesh_wire.MAX_SEQ + over, "t", *addr]
    elif field == "port":
        raw = [mesh_wire.PING, 1, "t", "n", "h", 65535 + over]
    elif field == "incarnation":
        raw = [mesh_wire.ALIVE, "n", "h", 1, MAX_INCARNATION + over, b""]
    elif field == "name":
        raw = [mesh_wire.ALIVE, "x" * (MAX_NAME_LEN + min(over, 1000)), "h", 1, 1, b""]
    else:
        raw = [mesh_wire.ALIVE, "n", "h", 1, 1, b"m" * (MAX_META_LEN + min(over, 1000))]
    good = mesh_wire.encode_packet([Ack(1)], sender="s")
    packet = msgpack.unpackb(good, raw=False)
    packet[2] = [raw]
    with pytest.raises(WireError):
        mesh_wire.decode_packet(msgpack.packb(packet, use_bin_type=True))


edge_ints = st.sampled_from(
    [
        -1,
        0,
        1,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        MAX_INCARNATION,
        MAX_INCARNATION + 1,
        2**64 - 1,
        -(2**63),
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | edge_ints
        | st.integers().filter(lambda v: -(2**63) <= v < 2**64)
        | st.floats(allow_nan=True)
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda kids: st.lists(kids, max_size=7) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
        max_leaves=25,
    )
)
def test_well_formed_msgpack_of_any_shape(obj: object) -> None:
    _total(msgpack.packb(obj, use_bin_type=True))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(st.none(), st.booleans(), edge_ints, st.text(max_size=4), st.binary(max_size=4)), max_size=6
    )
)
def test_frames_with_a_valid_head_and_garbage_fields(fields: list[Any]) -> None:
    for head in ([1, "s"], [1, mesh_wire.RPC_REQUEST], [1, mesh_wire.RPC_REPLY], [1, True], [1, "s", [[5]]]):
        _total(msgpack.packb(head + fields, use_bin_type=True))
