"""The mesh wire codec: round trips, compact compound packets within budget, strict decoding (fuzzed)."""

from __future__ import annotations

import contextlib
import tracemalloc
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.proto.mesh_messages import (
    MAX_META_LEN,
    USER_MSG_OVERHEAD,
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
    RpcRequest,
    Suspect,
    User,
)
from shepherd.proto.mesh_wire import (
    MAX_PUSH_PULL_BYTES,
    RPC_REQUEST,
    VERSION,
    WireError,
    decode_packet,
    decode_push_pull,
    decode_tcp_request,
    encode_msg,
    encode_packet,
    encode_push_pull,
    encoded_size,
    packet_overhead,
)

names = st.text(min_size=1, max_size=40)
hosts = st.text(min_size=1, max_size=40)
ports = st.integers(0, 65535)
seqs = st.integers(0, 2**32 - 1)
incs = st.integers(0, 2**63 - 1)  # MAX_INCARNATION: decoding refuses more
addrs = st.builds(NodeAddr, names, hosts, ports)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Ping, seqs, names, addrs),
    st.builds(PingReq, seqs, addrs, addrs, st.booleans()),
    st.builds(Ack, seqs),
    st.builds(Nack, seqs),
    st.builds(Alive, names, hosts, ports, incs, st.binary(max_size=MAX_META_LEN)),
    st.builds(Suspect, incs, names, names),
    st.builds(Dead, incs, names, names),
    st.builds(User, st.binary(max_size=300)),
)
members = st.builds(
    Member, names, hosts, ports, incs, st.sampled_from(list(MemberState)), st.binary(max_size=50)
)


@settings(max_examples=60, deadline=None)
@given(st.lists(messages, min_size=1, max_size=8), st.text(max_size=30))
def test_packet_round_trip(msgs: list[Message], sender: str) -> None:
    data = encode_packet(msgs, budget=65_000, sender=sender)
    assert decode_packet(data) == Packet(sender, tuple(msgs))
    assert len(data) <= packet_overhead(sender) + sum(encoded_size(m) for m in msgs)


@settings(max_examples=40, deadline=None)
@given(st.lists(members, max_size=20), st.binary(max_size=500), st.booleans())
def test_push_pull_round_trip(ms: list[Member], user: bytes, join: bool) -> None:
    state = PushPullState(tuple(ms), user, join)
    assert decode_push_pull(encode_push_pull(state)) == state


def test_messages_are_compact() -> None:
    me = NodeAddr("node-01", "10.0.0.1", 7946)
    assert encoded_size(Ack(2**31)) == 7
    assert encoded_size(Ping(2**31, "node-02", me)) <= 40
    assert encoded_size(Alive("node-01", "10.0.0.1", 7946, 12, b"")) <= 30
    assert encoded_size(Suspect(12, "node-01", "node-02")) <= 20
    for n in (0, 1, 255, 256, 65_535, 65_536):
        assert encoded_size(User(b"x" * n)) <= n + USER_MSG_OVERHEAD


def test_compound_packet_fits_budget_dropping_trailing_piggyback() -> None:
    msgs: list[Message] = [Ping(1, "b", NodeAddr("a", "h", 1))]
    msgs += [User(b"z" * 200) for _ in range(10)]
    data = encode_packet(msgs, budget=1360, sender="a")
    assert len(data) <= 1360
    pkt = decode_packet(data)
    assert pkt.msgs[0] == msgs[0]
    assert 1 < len(pkt.msgs) < len(msgs)
    with pytest.raises(WireError):
        encode_packet([User(b"z" * 2000)], budget=1400)
    with pytest.raises(WireError):
        encode_packet([], budget=1400)


def test_many_small_messages_use_a_16_bit_array_header() -> None:
    msgs: list[Message] = [Ack(i) for i in range(40)]
    assert decode_packet(encode_packet(msgs, sender="s")).msgs == tuple(msgs)


@pytest.mark.parametrize(
    "obj",
    [
        [0x11, "a", [[3, 1]]],  # another major (1.1): test_mesh_wire_version.py has the rest
        [3, "a", [[3, 1]]],  # minor 0.3: two ahead of 0.1
        [1, "a", []],  # no messages
        [1, "a", [[3]]],  # arity: a known message with missing fields
        [1, "a", [[-1, 1]]],  # a type code is 0..255
        [1, "a", [["3", 1]]],
        [1, "a", [[3, -1]]],  # negative seq
        [1, "a", [[3, 2**32]]],  # seq out of range
        [1, "a", [[3, True]]],  # bool is not an int
        [1, "a", [[3, 1.5]]],
        [1, "a", [[5, "", "h", 1, 1, b""]]],  # empty name
        [1, "a", [[5, "n", "h", 70000, 1, b""]]],  # port
        [1, "a", [[5, "n", "h", 1, 1, "meta-as-str"]]],
        [1, "a", [[5, "n", "h", 1, 1, b"m" * (MAX_META_LEN + 1)]]],
        [1, "a", [[5, "n" * 200, "h", 1, 1, b""]]],  # name too long
        [1, "a", [[2, 1, "t", "h", 1, "s", "h", 1, 1]]],  # nack flag not a bool
        [1, "a", [[8, "text"]]],  # user payload must be bytes
        [1, "a", [{"k": 1}]],
        [1, 5, [[3, 1]]],  # sender not a string
        [1, "a", [[3, 1]], "extra"],
        {"v": 1},
        "hello",
        None,
    ],
)
def test_strict_decoding_rejects(obj: object) -> None:
    with pytest.raises(WireError):
        decode_packet(msgpack.packb(obj, use_bin_type=True))


def test_trailing_bytes_and_truncation_rejected() -> None:
    good = encode_packet([Ack(1)], sender="a")
    with pytest.raises(WireError):
        decode_packet(good + b"\x00")
    for cut in range(len(good)):
        with pytest.raises(WireError):
            decode_packet(good[:cut])


def test_push_pull_strictness() -> None:
    good = encode_push_pull(PushPullState((Member("a", "h", 1, 2, MemberState.ALIVE),), b"u", False))
    decode_push_pull(good)
    with pytest.raises(WireError):
        decode_push_pull(good, max_bytes=len(good) - 1)
    bad_state = msgpack.packb([1, False, [["a", "h", 1, 2, 9, b""]], b""], use_bin_type=True)
    with pytest.raises(WireError):
        decode_push_pull(bad_state)
    with pytest.raises(WireError):
        decode_push_pull(msgpack.packb([1, 0, [], b""], use_bin_type=True))


def test_a_frame_decodes_into_what_its_known_fields_hold() -> None:
    """A TCP frame's fields after the known ones (a later minor's) are skipped without becoming objects,
    and a known field holding an array is refused at its header: 300,000 empty arrays (one byte each)
    decoded whole are ~22 MB of lists."""
    junk: list[Any] = [[]] * 300_000
    rpc = msgpack.packb([VERSION, RPC_REQUEST, b"payload", junk], use_bin_type=True)
    state = [VERSION, False, [["a", "h", 1, 2, 0, b"", junk]], b"u", junk]
    tracemalloc.start()
    try:
        assert decode_tcp_request(rpc) == RpcRequest(b"payload")
        got = decode_push_pull(msgpack.packb(state, use_bin_type=True))
        assert [m.name for m in got.members] == ["a"] and got.user_state == b"u"
        for bad in (
            [VERSION, RPC_REQUEST, junk],  # the payload: bytes
            [VERSION, False, [["a", "h", 1, 2, 0, junk]], b"u"],  # a member's meta
            [VERSION, False, junk, b"u"],  # members that are no members
        ):
            with pytest.raises(WireError):
                decode_tcp_request(msgpack.packb(bad, use_bin_type=True), MAX_PUSH_PULL_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak


def test_a_datagram_of_arrays_is_refused() -> None:
    """A datagram holds the packet's arrays and its messages' (a field a later minor adds at most one
    more each): 64 KiB of empty arrays (65,000 lists) is refused, not decoded."""
    ok = msgpack.packb([VERSION, "a", [[3, 1]] * 1024, 1, 2, [[]] * 900])
    assert len(decode_packet(ok).msgs) == 1024
    bad = msgpack.packb([VERSION, "a", [[3, 1]], 1, 2, *([[[]] * 1000] * 5)])
    with pytest.raises(WireError, match="arrays"):
        decode_packet(bad)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_only_raise_wire_error(data: bytes) -> None:
    for decode in (decode_packet, decode_push_pull):
        with contextlib.suppress(WireError):
            decode(data)


@settings(max_examples=100, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_fuzz_mutated_packets_only_raise_wire_error(msgs: list[Message], data: st.DataObject) -> None:
    raw = bytearray(encode_packet(msgs, budget=65_000, sender="s"))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(WireError):
        decode_packet(bytes(raw))


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda kids: st.lists(kids, max_size=6),
        max_leaves=20,
    )
)
def test_fuzz_well_formed_msgpack_of_wrong_shape(obj: object) -> None:
    blob = msgpack.packb(obj, use_bin_type=True)
    for decode in (decode_packet, decode_push_pull):
        with contextlib.suppress(WireError):
            decode(blob)


def test_encode_msg_rejects_out_of_range() -> None:
    with pytest.raises(WireError):
        encode_msg(Ack(2**70))
