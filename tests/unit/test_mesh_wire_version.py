"""Mesh protocol versions (``shepherd.proto.wire_version``): what this minor accepts from the previous
and the next one, skipping unknown message types and fields, and refusing another major (codec, and a
real runtime on loopback: a log line and a counter by reason)."""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.auth.certs import client_context, server_context, write_dev_pki
from shepherd.mesh import state_wire
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.proto import mesh_wire, wire_version
from shepherd.proto.mesh_messages import (
    Ack,
    Member,
    MemberState,
    PushPullState,
    RpcReply,
    RpcRequest,
    RpcStatus,
    User,
)
from shepherd.proto.mesh_wire import (
    TEST_NEXT,
    WireError,
    WireVersionError,
    decode_packet,
    decode_push_pull,
    decode_rpc_reply,
    decode_tcp_request,
    encode_packet,
    encode_push_pull,
    encode_rpc_reply,
    encode_rpc_request,
)
from shepherd.proto.state_decode import StateDecodeError
from tests.unit.mesh_fixtures import FAST, KEY, eventually
from tests.unit.test_mesh_wire import members, messages

pytestmark = pytest.mark.timeout(120)

STAMP = (1_700_000_000_000, 7)
V = wire_version.version_byte


@pytest.fixture
def next_minor() -> Iterator[None]:
    """This process speaks the next minor for the test (the ``SHEPHERD_TEST_WIRE_NEXT`` build)."""
    wire_version.set_test_next(True)
    try:
        yield
    finally:
        wire_version.set_test_next(False)


def packed(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)  # type: ignore[no-any-return]


def test_this_build_speaks_0_1_in_the_byte_older_builds_sent() -> None:
    assert wire_version.speaks() == (0, 1)
    assert mesh_wire.VERSION == state_wire.VERSION == 1 == wire_version.encode()
    # the exact bytes of a packet from before versioning: [1, sender, [[ACK, 5]], unix_ms, seq]
    assert encode_packet([Ack(5)], sender="a", stamp=STAMP) == packed(1, "a", [[3, 5]], *STAMP)
    assert decode_packet(packed(1, "a", [[3, 5]])).msgs == (Ack(5),)


@pytest.mark.parametrize(
    ("version", "accepted"),
    [(V(0, 0), True), (V(0, 1), True), (V(0, 2), True), (V(0, 3), False), (V(1, 1), False), (V(2, 0), False)],
)
def test_accepts_the_previous_and_next_minor_only(version: int, accepted: bool) -> None:
    for data, decode in (
        (packed(version, "a", [[3, 1]], *STAMP), decode_packet),
        (packed(version, False, [], b""), decode_push_pull),
        (packed(version, 16, b"req"), decode_tcp_request),
        (packed(version, 17, 0, b"ok", ""), decode_rpc_reply),
    ):
        if accepted:
            decode(data)
        else:
            with pytest.raises(WireVersionError):
                decode(data)


@pytest.mark.parametrize(
    ("version", "reason"),
    [(V(1, 1), "major"), (V(15, 0), "major"), (V(0, 3), "minor_too_new"), (V(0, 9), "minor_too_new")],
)
def test_refusals_say_why(version: int, reason: str) -> None:
    with pytest.raises(WireVersionError) as info:
        decode_packet(packed(version, "a", [[3, 1]]))
    assert info.value.reason == reason
    assert isinstance(info.value, WireError)  # callers that only know WireError still drop it
    assert f"{version >> 4}.{version & 15}" in str(info.value) and "speaks 0.1" in str(info.value)


def test_a_version_that_is_no_integer_is_malformed() -> None:
    with pytest.raises(WireVersionError) as info:
        decode_packet(packed("1", "a", [[3, 1]]))
    assert info.value.reason == "malformed"


def test_the_next_minor_refuses_two_minors_back(next_minor: None) -> None:
    assert wire_version.speaks() == (0, 2)
    decode_packet(packed(V(0, 1), "a", [[3, 1]]))  # this build, its previous minor
    with pytest.raises(WireVersionError) as info:
        decode_packet(packed(V(0, 0), "a", [[3, 1]]))
    assert info.value.reason == "minor_too_old"


def test_unknown_message_types_are_skipped_and_counted() -> None:
    raw = packed(V(0, 2), "a", [[3, 1], [77, "new", 1], [TEST_NEXT, 2], [4, 2]], *STAMP)
    pkt = decode_packet(raw)
    assert pkt.msgs == (Ack(1), mesh_wire.decode_packet(packed(1, "a", [[4, 2]])).msgs[0])
    assert pkt.skipped == 2
    only_unknown = decode_packet(packed(V(0, 2), "a", [[77]], *STAMP))
    assert only_unknown.msgs == () and only_unknown.skipped == 1


def test_unknown_fields_are_ignored_everywhere() -> None:
    pkt = decode_packet(packed(V(0, 2), "a", [[3, 1, "later"], [8, b"p", ["k", 1]]], *STAMP, "later", 9))
    assert pkt.msgs == (Ack(1), User(b"p")) and pkt.stamp == STAMP
    state = decode_push_pull(packed(V(0, 2), True, [["m", "h", 1, 2, 0, b"", "later"]], b"u", "later"))
    assert state == PushPullState((Member("m", "h", 1, 2, MemberState.ALIVE, b""),), b"u", True)
    assert decode_tcp_request(packed(V(0, 2), 16, b"q", "later")) == RpcRequest(b"q")
    assert decode_rpc_reply(packed(V(0, 2), 17, 0, b"r", "", "later")) == RpcReply(RpcStatus.OK, b"r")


def test_a_later_minors_message_may_carry_long_lists_of_its_own() -> None:
    pairs = [[i % 100, 1] for i in range(3000)]  # (3 bytes a list: more lists than messages could make)
    pkt = decode_packet(packed(V(0, 2), "a", [[3, 1, pairs], [77, pairs]], *STAMP))
    assert pkt.msgs == (Ack(1),) and pkt.skipped == 1


def test_missing_known_fields_and_unknown_frame_kinds_are_still_errors() -> None:
    for data, decode in (
        (packed(V(0, 2), "a", [[5, "n", "h", 1]], *STAMP), decode_packet),  # Alive cut short
        (packed(V(0, 2), False, [["m", "h", 1]], b""), decode_push_pull),
        (packed(V(0, 2), 18, b"?"), decode_tcp_request),  # an RPC kind we cannot answer
        (packed(V(0, 2), "a", [[3, 1]], 5), decode_packet),  # a stamp needs both fields
    ):
        with pytest.raises(WireError):
            decode(data)


def test_the_next_minor_build_adds_a_field_and_a_message_type(next_minor: None) -> None:
    raw = encode_packet([Ack(3)], sender="a", stamp=STAMP)
    top = msgpack.unpackb(raw)
    assert top[0] == V(0, 2) and len(top) == 6  # one extra trailing field
    assert top[2] == [[3, 3, mesh_wire.TEST_NEXT_FIELD], [TEST_NEXT, 2]]
    pp = msgpack.unpackb(encode_push_pull(PushPullState((Member("m", "h", 1, 0, MemberState.ALIVE),))))
    assert len(pp) == 5 and len(pp[2][0]) == 7
    # the extra costs 3 bytes per packet and 1 per message; the version is still one byte
    wire_version.set_test_next(False)
    assert len(raw) - len(encode_packet([Ack(3)], sender="a", stamp=STAMP)) == 1 + 1 + 3


def test_the_test_message_never_displaces_a_real_one(next_minor: None) -> None:
    budget = 200
    big = User(b"x" * (budget - mesh_wire.packet_overhead("a") - 4))
    raw = encode_packet([big], budget=budget, sender="a", stamp=STAMP)
    assert len(raw) <= budget
    wire_version.set_test_next(False)
    assert decode_packet(raw).msgs == (big,)


@settings(max_examples=80, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.lists(members, max_size=4), st.binary(max_size=40))
def test_both_minors_read_each_other(msgs: list[object], mems: list[Member], user: bytes) -> None:
    """Whatever one minor encodes, the other decodes to the same values (in both directions)."""
    state = PushPullState(tuple(mems), user, bool(mems))
    for sender_next in (False, True):
        wire_version.set_test_next(sender_next)
        try:
            raw = encode_packet(msgs, budget=65_000, sender="s", stamp=STAMP)  # type: ignore[arg-type]
            pp = encode_push_pull(state)
            rpc = encode_rpc_request(RpcRequest(user))
            rep = encode_rpc_reply(RpcReply(RpcStatus.BUSY, user, "e"))
        finally:
            wire_version.set_test_next(not sender_next)  # the receiver speaks the other minor
        try:
            pkt = decode_packet(raw)
            assert pkt.msgs == tuple(msgs) and pkt.stamp == STAMP
            assert pkt.skipped == (1 if sender_next else 0)
            assert decode_push_pull(pp) == state
            assert decode_tcp_request(rpc) == RpcRequest(user)
            assert decode_rpc_reply(rep) == RpcReply(RpcStatus.BUSY, user, "e")
        finally:
            wire_version.set_test_next(False)


def test_state_envelopes_follow_the_same_rule(next_minor: None) -> None:
    payload = state_wire.envelope("r", [])
    assert msgpack.unpackb(payload) == [V(0, 2), "r", [], 1]
    wire_version.set_test_next(False)
    assert state_wire.peek(payload) == ("r", [])
    with pytest.raises(StateDecodeError, match="major"):
        state_wire.peek(packed(V(1, 1), "r", []))
    with pytest.raises(StateDecodeError, match="minor_too_new"):
        state_wire.peek(packed(V(0, 3), "r", []))


# ---- a real runtime: the refusal is logged once and counted by reason -----------------------------


async def test_a_runtime_refuses_another_major_with_a_log_line_and_a_counter(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    files = write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1"])["n1"]
    rt = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_host="127.0.0.1", bind_port=0, swim=FAST),
        Keyring([KEY]),
        server_context(files),
        client_context(files),
        rng=random.Random(1),
    )
    await rt.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sealer = Keyring([KEY])
        now = int(time.time() * 1000)
        caplog.set_level(logging.WARNING, logger="shepherd.mesh.runtime")
        alive = [5, "n9", "127.0.0.1", 9, 1, b""]
        for i in range(3):
            sock.sendto(sealer.seal(packed(V(1, 0), "n9", [alive], now, 10 + i)), rt.address)
        sock.sendto(sealer.seal(packed(V(0, 4), "n9", [alive], now, 20)), rt.address)
        # the next minor, with an unknown message type and fields: taken (n9 becomes a member)
        sock.sendto(sealer.seal(packed(V(0, 2), "n9", [[77], [*alive, "x"]], now, 21, "x")), rt.address)
        await eventually(lambda: rt.metrics.wire_refused == {"major": 3, "minor_too_new": 1}, what="refusals")
        await eventually(lambda: rt.swim.member("n9") is not None, what="the next minor's Alive taken")
        assert rt.metrics.wire_skipped == 1
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 2, lines  # once per (peer, reason), not once per datagram
        assert any("wire version 1.0 refused (major)" in line for line in lines)
    finally:
        sock.close()
        await rt.abort()


def test_the_strict_wire_fault_decodes_as_before_versioning() -> None:
    """``SHEPHERD_FAULT_STRICT_WIRE`` (the break ``mesh_wire_upgrade`` must catch): only this exact
    version, no unknown message type, no extra field."""
    wire_version.set_strict(True)
    try:
        decode_packet(packed(1, "a", [[3, 1]], *STAMP))
        decode_push_pull(packed(1, False, [], b""))
        with pytest.raises(WireVersionError):
            decode_packet(packed(V(0, 2), "a", [[3, 1]], *STAMP))
        for data, decode in (
            (packed(1, "a", [[3, 1], [77]], *STAMP), decode_packet),
            (packed(1, "a", [[3, 1, "later"]], *STAMP), decode_packet),
            (packed(1, "a", [[3, 1]], *STAMP, "later"), decode_packet),
            (packed(1, False, [], b"", "later"), decode_push_pull),
            (packed(1, False, [], b"", "later"), decode_tcp_request),
            (packed(1, 16, b"q", "later"), decode_tcp_request),
        ):
            with pytest.raises(WireError):
                decode(data)
        with pytest.raises(StateDecodeError):
            state_wire.peek(packed(1, "r", [], "later"))
    finally:
        wire_version.set_strict(False)
