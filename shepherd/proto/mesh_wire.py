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

A UDP packet is ``[VERSION, sender, [msg, ...]]``: usually a primary message followed by
piggybacked membership updates and user broadcasts, at most ``budget`` bytes (before sealing).
A push-pull state (TCP) is ``[VERSION, join, [[name, host, port, incarnation, state, meta], ...],
user_state]``.

Decoding is strict: any malformed input (bad msgpack, wrong shape or type, out-of-range value,
unknown type code, oversized field, trailing bytes) raises ``WireError`` and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]

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
    Suspect,
    User,
)

VERSION = 1
MAX_PACKET_BYTES = 65_507
MAX_PUSH_PULL_BYTES = 64 * 1024 * 1024
MAX_HOST_LEN = 255
MAX_SEQ = 2**32 - 1
MAX_INCARNATION = 2**64 - 1
MAX_PACKET_MSGS = 1024
MAX_PUSH_PULL_MEMBERS = 65_536

PING, PING_REQ, ACK, NACK, ALIVE, SUSPECT, DEAD, USER = 1, 2, 3, 4, 5, 6, 7, 8

_ARRAY16_HEADER = 3  # bytes of a msgpack array header for 16..65535 items


class WireError(ValueError):
    """Malformed mesh bytes (the only exception decoding raises), or a message that cannot fit."""


# ---------------------------------------------------------------------------------------- encoding


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
            return [ALIVE, name, host, port, inc, meta]
        case Suspect(inc, node, src):
            return [SUSPECT, inc, node, src]
        case Dead(inc, node, src):
            return [DEAD, inc, node, src]
        case User(payload):
            return [USER, payload]
    raise WireError(f"not a mesh message: {msg!r}")


@functools.lru_cache(maxsize=8192)
def encode_msg(msg: Message) -> bytes:
    """One message as msgpack bytes (cached: broadcasts are re-sent several times)."""
    try:
        return msgpack.packb(_fields(msg), use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {type(msg).__name__}: {e}") from e


def encoded_size(msg: Message) -> int:
    return len(encode_msg(msg))


def packet_overhead(sender: str) -> int:
    """Bytes a packet adds around its messages (an upper bound: assumes a 16-bit array header)."""
    n: int = 1 + 1 + len(msgpack.packb(sender)) + _ARRAY16_HEADER
    return n


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big")


def encode_packet(msgs: Sequence[Message], budget: int = 1400, sender: str = "") -> bytes:
    """A compound packet of ``msgs`` in at most ``budget`` bytes.

    Trailing (piggybacked) messages that do not fit are dropped; if the first one alone does not fit,
    ``WireError``. (``Swim`` sizes its ``Send.msgs`` to fit, so nothing is dropped in practice.)
    """
    if not msgs:
        raise WireError("empty packet")
    head: bytes = b"\x93" + msgpack.packb(VERSION) + msgpack.packb(sender)
    free = budget - len(head) - _ARRAY16_HEADER
    parts: list[bytes] = []
    for i, msg in enumerate(msgs[:MAX_PACKET_MSGS]):
        b = encode_msg(msg)
        if len(b) > free:
            if i == 0:
                raise WireError(f"{type(msg).__name__} of {len(b)} bytes does not fit in {budget}")
            continue
        free -= len(b)
        parts.append(b)
    return head + _array_header(len(parts)) + b"".join(parts)


def encode_push_pull(state: PushPullState) -> bytes:
    members = [[m.name, m.host, m.port, m.incarnation, int(m.state), m.meta] for m in state.members]
    try:
        return msgpack.packb(  # type: ignore[no-any-return]
            [VERSION, state.join, members, state.user_state], use_bin_type=True
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode push-pull state: {e}") from e


# ---------------------------------------------------------------------------------------- decoding


def _unpack(data: bytes, max_len: int) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("not bytes")
    if len(data) > max_len:
        raise WireError(f"{len(data)} bytes > {max_len}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_ext_len=0,
            max_map_len=0,
        )
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, ...)
        raise WireError(f"bad msgpack: {e}") from e


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
    if type(v) is not list or (n is not None and len(v) != n) or len(v) > max_len:
        raise WireError("bad array")
    return v


def _name(v: Any) -> str:
    return _str(v, MAX_NAME_LEN)


def _host(v: Any) -> str:
    return _str(v, MAX_HOST_LEN)


def _port(v: Any) -> int:
    return _int(v, 65535)


def _node(name: Any, host: Any, port: Any) -> NodeAddr:
    return NodeAddr(_name(name), _host(host), _port(port))


_ARITY = {PING: 6, PING_REQ: 9, ACK: 2, NACK: 2, ALIVE: 6, SUSPECT: 4, DEAD: 4, USER: 2}


def _decode_msg(raw: Any, max_payload: int) -> Message:
    if type(raw) is not list or not raw:
        raise WireError("message is not a non-empty array")
    kind = raw[0]
    if type(kind) is not int or kind not in _ARITY or len(raw) != _ARITY[kind]:
        raise WireError(f"bad message type/arity {kind!r}")
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


def decode_packet(data: bytes) -> Packet:
    """A UDP datagram's packet; ``WireError`` on anything malformed (including zero messages)."""
    top = _list(_unpack(data, MAX_PACKET_BYTES), 3)
    if _int(top[0], 255) != VERSION:
        raise WireError(f"unsupported version {top[0]}")
    sender = _str(top[1], MAX_NAME_LEN, allow_empty=True)
    raws = _list(top[2])
    if not raws:
        raise WireError("empty packet")
    return Packet(sender, tuple(_decode_msg(r, MAX_PACKET_BYTES) for r in raws))


def decode_push_pull(data: bytes, max_bytes: int = MAX_PUSH_PULL_BYTES) -> PushPullState:
    top = _list(_unpack(data, max_bytes), 4)
    if _int(top[0], 255) != VERSION:
        raise WireError(f"unsupported version {top[0]}")
    join = _bool(top[1])
    members: list[Member] = []
    for raw in _list(top[2], max_len=MAX_PUSH_PULL_MEMBERS):
        f = _list(raw, 6)
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
    return PushPullState(tuple(members), _bytes(top[3], max_bytes), join)
