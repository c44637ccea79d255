"""msgpack wire codec of the SWIM mesh: UDP packets (compound messages) and TCP push-pull states.

Messages are positional msgpack arrays whose first element is a type code:

    Ping      [1, seq, target, src_name, src_host, src_port]
    PingReq   [2, seq, t_name, t_host, t_port, s_name, s_host, s_port, nack]
    Ack       [3, seq]
    Nack      [4, seq]
    Alive     [5, name, host, port, incarnation, meta]
    Suspect   [6, incarnation, node, src]
    Dead      [7, incarnation, node, src]
    User      [8, payload]

A UDP packet is ``[VERSION, sender, [msg, ...], unix_ms, seq]``: usually a primary message followed
by piggybacked membership updates and user broadcasts, at most ``budget`` bytes (before sealing);
``unix_ms`` (the sender's wall clock) and ``seq`` (strictly increasing per sender, across restarts)
are the replay stamp receivers check (``shepherd.mesh.replay``). The older ``[VERSION, sender,
[msg, ...]]`` still decodes (``Packet.stamp`` None): the receiver decides whether to accept it.
A push-pull state (TCP) is ``[VERSION, join, [[name, host, port, incarnation, state, meta], ...],
user_state]``.

The same TCP channel (mTLS, sealed frames) carries node-to-node RPCs, told apart from push-pull states by
a frame kind in the second element (an integer, where a push-pull state has its ``join`` boolean):

    RpcRequest  [VERSION, RPC_REQUEST, payload]
    RpcReply    [VERSION, RPC_REPLY, status, payload, error]    (status: RpcStatus)

``decode_tcp_request`` reads what a push-pull server receives (a push-pull state, old frames unchanged,
or an RPC request); ``decode_rpc_reply`` reads an RPC's answer.

Incarnations are bounded by ``MAX_INCARNATION`` (2^63 - 1) on decode, see there.

Versions (``shepherd.proto.wire_version``: the scheme and the upgrade rule): ``VERSION`` above is the
one msgpack integer ``major << 4 | minor`` (``1`` = 0.1, what builds before versioning sent too). A
decoder accepts its major with a minor at most one away from its own; it refuses anything else as a
whole with ``WireVersionError`` (a ``WireError`` with the refusal's ``reason``). Within an accepted
version it **skips what it does not know**: a message whose type code it does not know is left out of
``Packet.msgs`` (counted in ``Packet.skipped``), and every array above (packet, message, push-pull
state, member, RPC frame) may carry fields after the ones listed, which are ignored. A field is only
ever added at an array's end and must be optional (absent in packets of the previous minor); it may
be any msgpack value but a map or an extension type (decoders of 0.1 refuse those anywhere). The
test build of the next minor (``wire_version.set_test_next``) sends ``MINOR + 1``, one extra field at
the end of every array (``TEST_NEXT_FIELD``) and one extra message type per packet when it fits
(``[TEST_NEXT, minor]``), so the rolling-upgrade scenario exercises both rules.

Decoding is bounded by what the messages hold: a TCP frame is read field by field (``_Frame``: the fields
a later minor adds are skipped, never made into objects), a datagram's arrays are counted
(``decode_packet``). It is otherwise strict: any malformed input (bad msgpack, wrong shape or type,
out-of-range value, a known message with missing fields, oversized field, trailing bytes) raises
``WireError`` and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]

from shepherd.proto import wire_version
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

VERSION = wire_version.version_byte(wire_version.MAJOR, wire_version.MINOR)
"""What this build sends first in every array (a test-next build sends ``wire_version.encode()``)."""
MAX_PACKET_BYTES = 65_507
MAX_PUSH_PULL_BYTES = 64 * 1024 * 1024
MAX_HOST_LEN = 255
MAX_SEQ = 2**32 - 1
MAX_INCARNATION = 2**63 - 1
"""Incarnations on the wire are at most this (decoding refuses more; an int64 in every msgpack
implementation). A node's own incarnation saturates here (``swim_members.MembershipTable.refute``):
so a forged accusation at the bound can never push a node to an incarnation nobody can encode or
decode, and the refutation rule at the bound is in ``swim_members``."""
MAX_PACKET_MSGS = 1024
MAX_PUSH_PULL_MEMBERS = 65_536

PING, PING_REQ, ACK, NACK, ALIVE, SUSPECT, DEAD, USER = 1, 2, 3, 4, 5, 6, 7, 8
RPC_REQUEST, RPC_REPLY = 16, 17  # TCP frame kinds (a push-pull state has a bool in their place)
TEST_NEXT = 100
"""Type code of the extra message the next-minor test build sends (a receiver of this minor skips it)."""
TEST_NEXT_FIELD = 1
"""The extra trailing field the next-minor test build appends to every array."""
MAX_TOP_FIELDS = 16  # fields of a packet / state / frame array, known ones and later additions
MAX_RPC_ERROR_LEN = 256

_ARRAY16_HEADER = 3  # bytes of a msgpack array header for 16..65535 items


class WireError(ValueError):
    """Malformed mesh bytes (the only exception decoding raises), or a message that cannot fit."""


class WireVersionError(WireError):
    """A version this node refuses (``reason``: one of ``wire_version.REFUSAL_REASONS``)."""

    def __init__(self, err: wire_version.VersionError) -> None:
        super().__init__(str(err))
        self.reason: wire_version.RefusalReason = err.reason
        self.version = err.version


def _next_extra(fields: list[Any]) -> list[Any]:
    """``fields`` with the test-next build's extra trailing field (unchanged otherwise)."""
    if wire_version.is_test_next():
        fields.append(TEST_NEXT_FIELD)
    return fields


# ---------------------------------------------------------------------------------------- encoding


def _inc(inc: int) -> int:
    if type(inc) is not int or not 0 <= inc <= MAX_INCARNATION:
        raise WireError(f"incarnation {inc!r} out of range (0..{MAX_INCARNATION})")
    return inc


def _fields(msg: Message) -> list[Any]:
    match msg:
        case Ping(seq, target, src):
            return [PING, seq, target, src.name, src.host, src.port]
        case PingReq(seq, t, s, nack):
            return [PING_REQ, seq, t.name, t.host, t.port, s.name, s.host, s.port, nack]
        case Ack(seq):
            return [ACK, seq]
        case Nack(seq):
            return [NACK, seq]
        case Alive(name, host, port, inc, meta):
            return [ALIVE, name, host, port, _inc(inc), meta]
        case Suspect(inc, node, src):
            return [SUSPECT, _inc(inc), node, src]
        case Dead(inc, node, src):
            return [DEAD, _inc(inc), node, src]
        case User(payload):
            return [USER, payload]
    raise WireError(f"not a mesh message: {msg!r}")


def encode_msg(msg: Message) -> bytes:
    """One message as msgpack bytes (cached: broadcasts are re-sent several times)."""
    return _encode_msg(msg, wire_version.is_test_next())


@functools.lru_cache(maxsize=8192)
def _encode_msg(msg: Message, test_next: bool) -> bytes:
    fields = _fields(msg)
    if test_next:
        fields.append(TEST_NEXT_FIELD)
    try:
        return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {type(msg).__name__}: {e}") from e


def encoded_size(msg: Message) -> int:
    return len(encode_msg(msg))


MAX_STAMP_VALUE = 2**64 - 1
_STAMP_BYTES = 18  # two msgpack uint64 at most


def packet_overhead(sender: str) -> int:
    """Bytes a packet adds around its messages (an upper bound: assumes a 16-bit array header and a
    replay stamp)."""
    version = len(msgpack.packb(wire_version.encode()))
    n: int = 1 + version + len(msgpack.packb(sender)) + _ARRAY16_HEADER + _STAMP_BYTES
    if wire_version.is_test_next():
        n += len(msgpack.packb(TEST_NEXT_FIELD))
    return n


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big")


@functools.lru_cache(maxsize=256)
def _packet_head(arity: int, version: int, sender: str) -> bytes:
    """A packet's array header, version and sender (the same for every packet a node sends)."""
    return bytes([0x90 | arity]) + msgpack.packb(version) + msgpack.packb(sender)  # type: ignore[no-any-return]


def encode_packet(
    msgs: Sequence[Message], budget: int = 1400, sender: str = "", stamp: tuple[int, int] | None = None
) -> bytes:
    """A compound packet of ``msgs`` in at most ``budget`` bytes, with the replay ``stamp``
    ``(unix_ms, seq)`` if given.

    Trailing (piggybacked) messages that do not fit are dropped; if the first one alone does not fit,
    ``WireError``. (``Swim`` sizes its ``Send.msgs`` to fit, so nothing is dropped in practice.)
    """
    if not msgs:
        raise WireError("empty packet")
    tail = b""
    if stamp is not None:
        if not all(type(v) is int and 0 <= v <= MAX_STAMP_VALUE for v in stamp) or len(stamp) != 2:
            raise WireError(f"bad packet stamp {stamp!r}")
        tail = msgpack.packb(stamp[0]) + msgpack.packb(stamp[1])
    test_next = wire_version.is_test_next()
    if test_next and stamp is not None:
        tail += msgpack.packb(TEST_NEXT_FIELD)
    arity = (6 if test_next else 5) if stamp is not None else 3
    head = _packet_head(arity, wire_version.encode(), sender)
    free = budget - len(head) - _ARRAY16_HEADER - len(tail)
    parts: list[bytes] = []
    for i, msg in enumerate(msgs[:MAX_PACKET_MSGS]):
        b = encode_msg(msg)
        if len(b) > free:
            if i == 0:
                raise WireError(f"{type(msg).__name__} of {len(b)} bytes does not fit in {budget}")
            continue
        free -= len(b)
        parts.append(b)
    if test_next and len(parts) < MAX_PACKET_MSGS:
        extra = msgpack.packb([TEST_NEXT, wire_version.speaks()[1]])
        if len(extra) <= free:
            parts.append(extra)
    return head + _array_header(len(parts)) + b"".join(parts) + tail


def lone_fields(msgs: Sequence[Message]) -> list[Any] | None:
    """The fields of ``msgs`` if it is one ``Ping`` or ``Ack`` (what an idle node sends: its probes and
    their answers), for ``encode_lone``; None otherwise."""
    if len(msgs) != 1:
        return None
    m = msgs[0]
    t = type(m)
    if t is Ack:
        return [ACK, m.seq]  # type: ignore[union-attr]
    if t is Ping:
        src = m.src  # type: ignore[union-attr]
        return [PING, m.seq, m.target, src.name, src.host, src.port]  # type: ignore[union-attr]
    return None


def encode_lone(fields: list[Any], sender: str, stamp: tuple[int, int], budget: int) -> bytes | None:
    """The bytes ``encode_packet`` makes of the one message of ``fields`` (``lone_fields``) with a
    ``stamp``, in one msgpack call; None where it would not be these (the test-next build, a stamp out
    of range, a packet over ``budget``: call ``encode_packet``, which says why)."""
    ms, seq = stamp
    if (
        type(ms) is not int
        or type(seq) is not int
        or not (0 <= ms <= MAX_STAMP_VALUE and 0 <= seq <= MAX_STAMP_VALUE)
        or wire_version.is_test_next()
    ):
        return None
    try:
        data: bytes = msgpack.packb([VERSION, sender, [fields], ms, seq])
    except (TypeError, ValueError, OverflowError):
        return None
    # encode_packet's bound: the message fits ``budget`` less the head, tail and a 3-byte array header
    # (here 1 byte: one message)
    return data if len(data) + 2 <= budget else None


_LONE_MAX_BYTES = 4096  # a lone ping's names and host at their longest fit (larger: decode_packet's)


def decode_lone(data: bytes) -> tuple[str, tuple[int, int], list[Any]] | None:
    """A datagram of one ``Ping`` or ``Ack`` and a replay stamp, of this build's version, as
    ``(sender, stamp, fields)`` (``fields``: ``[ACK, seq]`` or ``[PING, seq, target, name, host,
    port]``, checked as ``decode_packet`` checks them); None for anything else (``decode_packet``
    then decodes it or says what is wrong with it). What it accepts, ``decode_packet`` decodes to
    ``Packet(sender, (Ack(seq),) or (Ping(...),), stamp)``: one msgpack call instead of ~25."""
    if len(data) > _LONE_MAX_BYTES:
        return None
    try:
        top = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_ext_len=0, max_map_len=0, max_array_len=6
        )
    except Exception:  # msgpack raises many types
        return None
    if type(top) is not list or len(top) != 5:
        return None
    v, sender, msgs, ms, seq = top
    if (
        type(v) is not int
        or v != VERSION
        or type(sender) is not str
        or len(sender) > MAX_NAME_LEN
        or type(msgs) is not list
        or len(msgs) != 1
        or type(ms) is not int
        or type(seq) is not int
        or not (0 <= ms <= MAX_STAMP_VALUE and 0 <= seq <= MAX_STAMP_VALUE)
    ):
        return None
    f = msgs[0]
    if type(f) is not list:
        return None
    n = len(f)
    if n == 2:
        if type(f[0]) is not int or f[0] != ACK:
            return None
    elif n == 6:
        if (
            type(f[0]) is not int
            or f[0] != PING
            or type(f[2]) is not str
            or not 0 < len(f[2]) <= MAX_NAME_LEN
            or type(f[3]) is not str
            or not 0 < len(f[3]) <= MAX_NAME_LEN
            or type(f[4]) is not str
            or not 0 < len(f[4]) <= MAX_HOST_LEN
            or type(f[5]) is not int
            or not 0 <= f[5] <= 65535
        ):
            return None
    else:
        return None
    s = f[1]
    if type(s) is not int or not 0 <= s <= MAX_SEQ:
        return None
    if wire_version.is_strict() and wire_version.is_test_next():  # this version refused then
        return None
    return sender, (ms, seq), f


def encode_push_pull(state: PushPullState) -> bytes:
    members = [
        _next_extra([m.name, m.host, m.port, _inc(m.incarnation), int(m.state), m.meta])
        for m in state.members
    ]
    try:
        return msgpack.packb(  # type: ignore[no-any-return]
            _next_extra([wire_version.encode(), state.join, members, state.user_state]), use_bin_type=True
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode push-pull state: {e}") from e


def encode_rpc_request(req: RpcRequest) -> bytes:
    fields = _next_extra([wire_version.encode(), RPC_REQUEST, bytes(req.payload)])
    return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]


def encode_rpc_reply(rep: RpcReply) -> bytes:
    """An RPC answer; an over-long ``error`` is cut to ``MAX_RPC_ERROR_LEN`` characters."""
    fields = [wire_version.encode(), RPC_REPLY, int(rep.status), bytes(rep.payload)]
    fields = _next_extra([*fields, str(rep.error)[:MAX_RPC_ERROR_LEN]])
    return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------- decoding


# msgpack's first bytes of a map or an extension
_MAP_OR_EXT = frozenset([*range(0x80, 0x90), 0xDE, 0xDF, 0xC7, 0xC8, 0xC9, *range(0xD4, 0xD9)])
_MAX_SCALAR_STR = 64 * 1024  # a string field (known ones are at most MAX_HOST_LEN)


class _Frame:
    """Bytes read field by field (one ``msgpack.Unpacker``): only the fields this build knows become
    objects, each the scalar or the array it must be (refused at its header otherwise); the fields
    after them (a later minor's) are skipped without making any. So what a datagram or frame makes
    is bounded by the messages and members it may hold, whatever else it carries (one byte is an empty
    array: a 16 MiB frame decoded whole is 16 million lists, 1.2 GB)."""

    __slots__ = ("_data", "_size", "_u")

    def __init__(self, data: bytes, max_len: int) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise WireError("not bytes")
        if len(data) > max_len:
            raise WireError(f"{len(data)} bytes > {max_len}")
        self._data = data
        self._size = len(data)
        self._u = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=max(1, self._size),
            max_str_len=_MAX_SCALAR_STR,
            max_bin_len=max_len,
            max_array_len=0,  # (arrays are read by their header)
            max_map_len=0,
            max_ext_len=0,
        )
        self._u.feed(data)

    def array(self, n: int | None = None, max_len: int = MAX_PACKET_MSGS) -> int:
        """The length of the array that comes next: at least ``n`` (later fields are a newer minor's,
        refused under STRICT_WIRE) and at most ``max_len``."""
        try:
            length: int = self._u.read_array_header()
        except Exception as e:  # msgpack raises many types (not an array: ValueError, ...)
            raise WireError(f"bad array: {e}") from e
        if (n is not None and length < n) or length > max_len:
            raise WireError("bad array")
        if n is not None and length > n and wire_version.is_strict():
            raise WireError("bad array: extra fields (STRICT_WIRE)")
        return length

    def value(self) -> Any:
        """The scalar that comes next (the limits refuse an array, a map or an extension at its header:
        only an empty array decodes, which no field accepts)."""
        try:
            return self._u.unpack()
        except Exception as e:  # msgpack raises many types (FormatError, ValueError, ...)
            raise WireError(f"bad msgpack: {e}") from e

    def values(self, n: int) -> list[Any]:
        """The ``n`` scalars that come next (as ``value``)."""
        unpack = self._u.unpack
        try:
            return [unpack() for _ in range(n)]
        except Exception as e:  # msgpack raises many types (FormatError, ValueError, ...)
            raise WireError(f"bad msgpack: {e}") from e

    def skip(self, n: int) -> None:
        """Skip ``n`` values (fields after the known ones: any value but a map or an extension)."""
        for _ in range(n):
            pos = self._u.tell()
            if pos < self._size and self._data[pos] in _MAP_OR_EXT:
                raise WireError("bad field: a map or an extension")
            try:
                self._u.skip()
            except Exception as e:  # msgpack raises many types (StackError, ...)
                raise WireError(f"bad msgpack: {e}") from e

    def end(self) -> None:
        if self._u.tell() != self._size:
            raise WireError("bad msgpack: trailing bytes")


def _int(v: Any, hi: int, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"bad integer {v!r}")
    return v


def _str(v: Any, max_len: int, allow_empty: bool = False) -> str:
    if type(v) is not str or len(v) > max_len or (not v and not allow_empty):
        raise WireError(f"bad string {v!r:.80}")
    return v


def _bytes(v: Any, max_len: int) -> bytes:
    if type(v) is not bytes or len(v) > max_len:
        raise WireError("bad bytes")
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise WireError(f"bad bool {v!r}")
    return v


def _list(v: Any, n: int | None = None, max_len: int = MAX_PACKET_MSGS) -> list[Any]:
    """An array of at most ``max_len`` items, and at least ``n`` (later fields are a newer minor's)."""
    if type(v) is not list or (n is not None and len(v) < n) or len(v) > max_len:
        raise WireError("bad array")
    if n is not None and len(v) > n and wire_version.is_strict():
        raise WireError("bad array: extra fields (STRICT_WIRE)")
    return v


def _version(v: Any) -> tuple[int, int]:
    try:
        return wire_version.check(v)
    except wire_version.VersionError as e:
        raise WireVersionError(e) from None


def _name(v: Any) -> str:
    return _str(v, MAX_NAME_LEN)


def _host(v: Any) -> str:
    return _str(v, MAX_HOST_LEN)


def _port(v: Any) -> int:
    return _int(v, 65535)


def _node(name: Any, host: Any, port: Any) -> NodeAddr:
    return NodeAddr(_name(name), _host(host), _port(port))


_ARITY = {PING: 6, PING_REQ: 9, ACK: 2, NACK: 2, ALIVE: 6, SUSPECT: 4, DEAD: 4, USER: 2}


def _decode_msg(raw: Any, max_payload: int) -> Message | None:
    """A message, or None for a type code this build does not know (skipped); fields after the known
    ones are ignored."""
    if type(raw) is not list or not raw:
        raise WireError("message is not a non-empty array")
    kind = raw[0]
    if type(kind) is not int or not 0 <= kind <= 255:
        raise WireError(f"bad message type {kind!r:.20}")
    if kind not in _ARITY:
        if wire_version.is_strict():
            raise WireError(f"unknown message type {kind} (STRICT_WIRE)")
        return None
    if len(raw) < _ARITY[kind] or (wire_version.is_strict() and len(raw) != _ARITY[kind]):
        raise WireError(f"message type {kind} with {len(raw)} fields < {_ARITY[kind]}")
    f = raw
    if kind == PING:
        return Ping(_int(f[1], MAX_SEQ), _name(f[2]), _node(f[3], f[4], f[5]))
    if kind == PING_REQ:
        return PingReq(_int(f[1], MAX_SEQ), _node(f[2], f[3], f[4]), _node(f[5], f[6], f[7]), _bool(f[8]))
    if kind == ACK:
        return Ack(_int(f[1], MAX_SEQ))
    if kind == NACK:
        return Nack(_int(f[1], MAX_SEQ))
    if kind == ALIVE:
        return Alive(
            _name(f[1]), _host(f[2]), _port(f[3]), _int(f[4], MAX_INCARNATION), _bytes(f[5], MAX_META_LEN)
        )
    if kind == SUSPECT:
        return Suspect(_int(f[1], MAX_INCARNATION), _name(f[2]), _name(f[3]))
    if kind == DEAD:
        return Dead(_int(f[1], MAX_INCARNATION), _name(f[2]), _name(f[3]))
    return User(_bytes(f[1], max_payload))


def _count_arrays(budget: int) -> Any:
    """A ``list_hook`` refusing the array after the ``budget``-th."""
    made = 0

    def hook(v: list[Any]) -> list[Any]:
        nonlocal made
        made += 1
        if made > budget:
            raise WireError(f"more than {budget} arrays")
        return v

    return hook


# arrays in a datagram: the packet's, its message list's and each message's (and one each more for fields
# a later minor adds), or one per 3 bytes if more (a later minor's message may carry lists of its own,
# which this minor skips: a list of pairs of small integers is 3 bytes a list): a datagram of empty
# arrays (65K lists, 42 ms of the loop) is refused at the first past these
_PACKET_ARRAYS = 2 * (MAX_PACKET_MSGS + 2)
_PACKET_BYTES_PER_ARRAY = 3


def decode_packet(data: bytes) -> Packet:
    """A UDP datagram's packet; ``WireError`` on anything malformed (including zero messages).
    (One ``unpackb`` with its arrays counted, not ``_Frame``: twice as fast on a compound packet, and a
    datagram's at most 64 KiB leave a few ms of scalars at worst.)"""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("not bytes")
    if len(data) > MAX_PACKET_BYTES:
        raise WireError(f"{len(data)} bytes > {MAX_PACKET_BYTES}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
            max_map_len=0,
            list_hook=_count_arrays(max(_PACKET_ARRAYS, len(data) // _PACKET_BYTES_PER_ARRAY)),
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, ...)
        raise WireError(f"bad msgpack: {e}") from e
    top = _list(raw, max_len=MAX_TOP_FIELDS)
    if len(top) < 3 or len(top) == 4 or (wire_version.is_strict() and len(top) not in (3, 5)):
        raise WireError("bad packet arity")
    _version(top[0])
    sender = _str(top[1], MAX_NAME_LEN, allow_empty=True)
    raws = _list(top[2])
    if not raws:
        raise WireError("empty packet")
    stamp = (_int(top[3], MAX_STAMP_VALUE), _int(top[4], MAX_STAMP_VALUE)) if len(top) >= 5 else None
    msgs = [_decode_msg(r, MAX_PACKET_BYTES) for r in raws]
    known = tuple(m for m in msgs if m is not None)
    return Packet(sender, known, stamp, len(msgs) - len(known))


def decode_push_pull(data: bytes, max_bytes: int = MAX_PUSH_PULL_BYTES) -> PushPullState:
    frame = _Frame(data, max_bytes)
    n = frame.array(4, max_len=MAX_TOP_FIELDS)
    return _push_pull(frame, n, frame.value(), frame.value(), max_bytes)


def decode_tcp_request(data: bytes, max_bytes: int = MAX_PUSH_PULL_BYTES) -> PushPullState | RpcRequest:
    """What a push-pull server receives: a push-pull state or an RPC request (by the frame kind)."""
    frame = _Frame(data, max_bytes)
    n = frame.array(max_len=MAX_TOP_FIELDS)
    strict = wire_version.is_strict()
    if n < 3:
        raise WireError("neither a push-pull state nor an RPC request")
    version, kind = frame.value(), frame.value()
    if type(kind) is int:  # a frame kind (a push-pull state has its join bool here)
        _version(version)
        if kind != RPC_REQUEST or (strict and n != 3):
            raise WireError(f"unknown TCP frame kind {kind}")
        req = RpcRequest(_bytes(frame.value(), max_bytes))
        frame.skip(n - 3)
        frame.end()
        return req
    if n < 4 or (strict and n != 4):
        raise WireError("neither a push-pull state nor an RPC request")
    return _push_pull(frame, n, version, kind, max_bytes)


def decode_rpc_reply(data: bytes, max_bytes: int = MAX_PUSH_PULL_BYTES) -> RpcReply:
    frame = _Frame(data, max_bytes)
    n = frame.array(5, max_len=MAX_TOP_FIELDS)
    _version(frame.value())
    kind = frame.value()
    if type(kind) is not int or kind != RPC_REPLY:
        raise WireError(f"not an RPC reply: kind {kind!r:.20}")
    status = RpcStatus(_int(frame.value(), max(RpcStatus)))
    payload = _bytes(frame.value(), max_bytes)
    error = _str(frame.value(), MAX_RPC_ERROR_LEN, allow_empty=True)
    frame.skip(n - 5)
    frame.end()
    return RpcReply(status, payload, error)


def _push_pull(frame: _Frame, n: int, version: Any, join: Any, max_bytes: int) -> PushPullState:
    """The rest of a push-pull state of ``n`` fields, after its first two (``version``, ``join``)."""
    _version(version)
    joining = _bool(join)
    members: list[Member] = []
    for _ in range(frame.array(max_len=MAX_PUSH_PULL_MEMBERS)):
        k = frame.array(6)
        f = frame.values(6)
        if k > 6:
            frame.skip(k - 6)
        state = _int(f[4], max(MemberState))
        members.append(
            Member(
                _name(f[0]),
                _host(f[1]),
                _port(f[2]),
                _int(f[3], MAX_INCARNATION),
                MemberState(state),
                _bytes(f[5], MAX_META_LEN),
            )
        )
    user_state = _bytes(frame.value(), max_bytes)
    frame.skip(n - 4)
    frame.end()
    return PushPullState(tuple(members), user_state, joining)
