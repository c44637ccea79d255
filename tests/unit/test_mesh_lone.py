"""The lone ping/ack path of an idle node (issue 25 item 5): ``mesh_wire.encode_lone`` makes the very bytes
``encode_packet`` makes, ``decode_lone`` accepts only what ``decode_packet`` decodes to the same one
message, and ``Swim.on_ack_alone`` / ``on_ping_alone`` leave the machine as ``on_packet`` would."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.swim import Swim
from shepherd.mesh.swim_types import Send, SwimConfig
from shepherd.proto import wire_version
from shepherd.proto.mesh_messages import (
    Ack,
    Alive,
    Member,
    MemberState,
    Message,
    NodeAddr,
    Packet,
    Ping,
    PushPullState,
    Suspect,
)
from shepherd.proto.mesh_wire import (
    ACK,
    MAX_SEQ,
    MAX_STAMP_VALUE,
    PING,
    VERSION,
    WireError,
    decode_lone,
    decode_packet,
    encode_lone,
    encode_packet,
    lone_fields,
)


@contextlib.contextmanager
def wire_mode(*, test_next: bool = False, strict: bool = False) -> Iterator[None]:
    wire_version.set_test_next(test_next)
    wire_version.set_strict(strict)
    try:
        yield
    finally:
        wire_version.set_test_next(False)
        wire_version.set_strict(False)


names = st.text(min_size=1, max_size=20)
seqs = st.integers(0, MAX_SEQ)
stamps = st.tuples(st.integers(0, MAX_STAMP_VALUE), st.integers(0, MAX_STAMP_VALUE))
lone_msgs = st.one_of(
    st.builds(Ack, seqs),
    st.builds(Ping, seqs, names, st.builds(NodeAddr, names, names, st.integers(0, 65535))),
)


@settings(max_examples=300, deadline=None)
@given(msg=lone_msgs, sender=st.text(max_size=20), stamp=stamps)
def test_encode_lone_is_encode_packet_and_decode_lone_reads_it_back(
    msg: Message, sender: str, stamp: tuple[int, int]
) -> None:
    fields = lone_fields([msg])
    assert fields is not None
    data = encode_lone(fields, sender, stamp, 1400)
    assert data == encode_packet([msg], budget=1400, sender=sender, stamp=stamp)
    got = decode_lone(data)
    assert got is not None
    assert got[0] == sender and got[1] == stamp
    assert decode_packet(data) == Packet(sender, (msg,), stamp)


def test_what_is_not_a_lone_ping_or_ack_is_left_to_encode_packet() -> None:
    ping = Ping(1, "b", NodeAddr("a", "10.0.0.1", 7946))
    assert lone_fields([ping, Ack(2)]) is None
    assert lone_fields([Alive("a", "h", 1, 1, b"")]) is None
    assert lone_fields([]) is None
    fields = lone_fields([ping])
    assert fields is not None
    exact = len(encode_packet([ping], budget=1400, sender="a", stamp=(5, 6)))
    # encode_packet's budget: the message within budget - head - tail - a 3-byte array header
    encode_packet([ping], budget=exact + 2, sender="a", stamp=(5, 6))
    with pytest.raises(WireError):
        encode_packet([ping], budget=exact + 1, sender="a", stamp=(5, 6))
    assert encode_lone(fields, "a", (5, 6), exact + 2) is not None
    assert encode_lone(fields, "a", (5, 6), exact + 1) is None
    assert encode_lone(fields, "a", (-1, 6), 1400) is None
    assert encode_lone(fields, "a", (5, MAX_STAMP_VALUE + 1), 1400) is None
    with wire_mode(test_next=True):  # the next minor's packets carry more: not these bytes
        assert encode_lone(fields, "a", (5, 6), 1400) is None


def _packet(top: list[object]) -> bytes:
    return msgpack.packb(top, use_bin_type=True)  # type: ignore[no-any-return]


GOOD_PING = [PING, 7, "me", "p", "10.0.0.2", 7946]


@pytest.mark.parametrize(
    "top",
    [
        [VERSION, "p", [GOOD_PING, [ACK, 1]], 1, 2],  # two messages
        [VERSION, "p", [[ACK, 1]]],  # no stamp
        [VERSION, "p", [[ACK, 1]], 1, 2, 9],  # a later minor's extra field
        [VERSION + 1, "p", [[ACK, 1]], 1, 2],  # another minor
        [True, "p", [[ACK, 1]], 1, 2],
        [VERSION, "p", [[True, 1]], 1, 2],
        [VERSION, "p", [[ACK, True]], 1, 2],
        [VERSION, "p", [[ACK, MAX_SEQ + 1]], 1, 2],
        [VERSION, "p", [[ACK, 1, 9]], 1, 2],  # a later minor's extra field in the message
        [VERSION, "p", [[ACK, 1]], -1, 2],
        [VERSION, "p", [[ACK, 1]], 1, True],
        [VERSION, b"p", [[ACK, 1]], 1, 2],
        [VERSION, "x" * 129, [[ACK, 1]], 1, 2],
        [VERSION, "p", [[PING, 7, "", "p", "h", 1]], 1, 2],
        [VERSION, "p", [[PING, 7, "me", "", "h", 1]], 1, 2],
        [VERSION, "p", [[PING, 7, "me", "p", "", 1]], 1, 2],
        [VERSION, "p", [[PING, 7, "me", "p", "h", 65536]], 1, 2],
        [VERSION, "p", [[PING, 7, "me", "p", "h" * 256, 1]], 1, 2],
        [VERSION, "p", [[PING, 7, "me", "p", "h", 1, 0]], 1, 2],
        [VERSION, "p", [[6, 1, "a", "b"]], 1, 2],  # a suspicion
        [VERSION, "p", [], 1, 2],
        [VERSION, "p", "abc", 1, 2],
    ],
)
def test_decode_lone_leaves_everything_else_to_decode_packet(top: list[object]) -> None:
    assert decode_lone(_packet(top)) is None


def test_decode_lone_refuses_garbage_and_what_strict_mode_refuses() -> None:
    assert decode_lone(b"") is None
    assert decode_lone(b"\xc1") is None
    assert decode_lone(_packet([VERSION, "p", [[ACK, 1]], 1, 2]) + b"\x00") is None  # trailing bytes
    assert decode_lone(_packet([VERSION, "p", [[ACK, 1]], 1, 2])) == ("p", (1, 2), [ACK, 1])
    with wire_mode(test_next=True, strict=True):  # exactly the next minor then: 0.1 is refused
        data = _packet([VERSION, "p", [[ACK, 1]], 1, 2])
        assert decode_lone(data) is None
        with pytest.raises(WireError):
            decode_packet(data)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=60), seed=st.integers(0, 2**32))
def test_decode_lone_accepts_only_what_decode_packet_reads_as_that_message(data: bytes, seed: int) -> None:
    # random bytes and mutations of a real ping: whatever decode_lone takes decodes the same
    rng = random.Random(seed)
    ping = bytearray(_packet([VERSION, "p", [GOOD_PING], 1, 2]))
    for _ in range(rng.randint(1, 3)):
        ping[rng.randrange(len(ping))] = rng.randrange(256)
    for candidate in (data, bytes(ping)):
        got = decode_lone(candidate)
        if got is None:
            continue
        sender, stamp, f = got
        msg: Message = Ack(f[1]) if f[0] == ACK else Ping(f[1], f[2], NodeAddr(f[3], f[4], f[5]))
        assert decode_packet(candidate) == Packet(sender, (msg,), stamp)


# ---- the machine ---------------------------------------------------------------------------------

CFG = SwimConfig()
ME = NodeAddr("me", "10.0.0.1", 7946)
PEER = NodeAddr("p", "10.0.0.2", 7946)
OTHER = NodeAddr("q", "10.0.0.3", 7946)


def pair() -> tuple[Swim, Swim]:
    """Two identical joined machines (same seed), their join news gone."""
    out = []
    for _ in range(2):
        s = Swim(CFG, ME, random.Random(5), _Quiet(), incarnation=1)
        s.start(0.0, [])
        members = tuple(Member(n.name, n.host, n.port, 1, MemberState.ALIVE) for n in (PEER, OTHER))
        s.merge_push_pull(0.0, PushPullState(members))
        for i in range(200):  # bounded: the join broadcasts go out with the gossip rounds
            if s.pending_broadcasts == 0:
                break
            s.tick(i * 0.05)
        assert s.pending_broadcasts == 0
        out.append(s)
    return out[0], out[1]


class _Quiet:
    def broadcasts(self, budget: int) -> list[bytes]:
        return []

    def on_user(self, payload: bytes, src_name: str) -> None:
        pass

    def local_state(self) -> bytes:
        return b""

    def merge_remote_state(self, data: bytes) -> None:
        pass

    def has_broadcasts(self) -> bool:
        return False


def _probe_seq(actions: Sequence[object]) -> int:
    return next(m.seq for a in actions if isinstance(a, Send) for m in a.msgs if isinstance(m, Ping))


def _same(a: Swim, b: Swim) -> None:
    assert a.stats == b.stats
    assert a.next_deadline() == b.next_deadline()
    assert a.health == b.health
    assert a.members() == b.members()


def test_a_lone_ack_of_the_probe_leaves_the_machine_as_on_packet_does() -> None:
    a, b = pair()
    t = a.next_deadline()
    seq = _probe_seq(a.tick(t))
    assert _probe_seq(b.tick(t)) == seq
    assert a.on_packet(t + 0.01, PEER.addr, Packet("p", (Ack(seq),))) == []
    assert b.on_ack_alone(t + 0.01, seq)
    _same(a, b)
    # an ack of nothing in flight: not handled here, and nothing changed
    before = (b.stats.packets_in, b.next_deadline())
    assert not b.on_ack_alone(t + 0.02, seq)
    assert (b.stats.packets_in, b.next_deadline()) == before


def test_a_lone_ping_is_answered_with_a_lone_ack_as_on_packet_does() -> None:
    a, b = pair()
    now = 1.0
    ping = Ping(42, "me", PEER)
    out = a.on_packet(now, PEER.addr, Packet("p", (ping,)))
    assert out == [Send(PEER.addr, (Ack(42),))]
    assert b.on_ping_alone(now, 42, "me", "p")
    _same(a, b)
    # misdirected, or from a node we do not know: on_packet's (it may sync with the stranger)
    assert not b.on_ping_alone(now, 43, "other", "p")
    assert not b.on_ping_alone(now, 43, "me", "stranger")
    _same(a, b)


def test_nothing_is_taken_alone_while_something_else_is_going_on() -> None:
    _, b = pair()
    t = b.next_deadline()
    seq = _probe_seq(b.tick(t))
    # an accusation of us: the refutation is urgent and rides on the next datagrams
    b.on_packet(t, PEER.addr, Packet("p", (Suspect(1, "me", "p"),)))
    assert b.pending_broadcasts > 0
    assert not b.on_ack_alone(t + 0.01, seq)
    assert not b.on_ping_alone(t + 0.01, 9, "me", "p")
    out = b.on_packet(t + 0.01, PEER.addr, Packet("p", (Ping(9, "me", PEER),)))
    assert [len(x.msgs) > 1 for x in out if isinstance(x, Send)] == [True]  # the ack carries news
