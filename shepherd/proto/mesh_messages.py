"""The SWIM + Lifeguard wire vocabulary: addresses, members, messages, packets, push-pull state.

Plain frozen values shared by the membership state machine (``shepherd.mesh.swim``), the wire codec
(``shepherd.proto.mesh_wire``) and the I/O shell (``shepherd.mesh.runtime``). The protocol's contract,
config and actions are in ``shepherd.mesh.swim_types``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

Addr = tuple[str, int]
"""A ``(host, port)`` UDP/TCP endpoint."""

USER_MSG_OVERHEAD = 7
"""Upper bound of the wire bytes a ``User`` message adds to its payload (for ``Delegate.broadcasts``)."""

MAX_NAME_LEN = 128
MAX_META_LEN = 512


# ---------------------------------------------------------------------------------------- members


class MemberState(IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass(frozen=True, slots=True)
class NodeAddr:
    """A node's identity (unique name) and its gossip endpoint."""

    name: str
    host: str
    port: int

    @property
    def addr(self) -> Addr:
        return (self.host, self.port)


@dataclass(frozen=True, slots=True)
class Member:
    """One member as seen by the local node (a snapshot; the state machine keeps its own)."""

    name: str
    host: str
    port: int
    incarnation: int
    state: MemberState
    meta: bytes = b""

    @property
    def addr(self) -> Addr:
        return (self.host, self.port)


# ---------------------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Ping:
    """Direct probe. ``target`` is the probed node's name (a misdirected ping is ignored)."""

    seq: int
    target: str
    src: NodeAddr


@dataclass(frozen=True, slots=True)
class PingReq:
    """Ask a relay to probe ``target`` on behalf of ``src`` (ack forwarded, nack if ``nack``)."""

    seq: int
    target: NodeAddr
    src: NodeAddr
    nack: bool = True


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True)
class Nack:
    seq: int


@dataclass(frozen=True, slots=True)
class Alive:
    name: str
    host: str
    port: int
    incarnation: int
    meta: bytes = b""

    @property
    def addr(self) -> Addr:
        return (self.host, self.port)


@dataclass(frozen=True, slots=True)
class Suspect:
    incarnation: int
    node: str
    src: str


@dataclass(frozen=True, slots=True)
class Dead:
    """``src == node``: the node left gracefully (LEFT, not DEAD)."""

    incarnation: int
    node: str
    src: str


@dataclass(frozen=True, slots=True)
class User:
    """A delegate's payload (replicated state deltas), piggybacked like membership updates."""

    payload: bytes


Message = Ping | PingReq | Ack | Nack | Alive | Suspect | Dead | User


@dataclass(frozen=True, slots=True)
class Packet:
    """One UDP datagram: the sender's name, then a primary message and/or piggybacked ones.

    ``stamp`` (``(unix_ms, seq)``, inside the sealed plaintext, so authenticated) lets receivers
    refuse replays (``shepherd.mesh.replay``); None on packets of the older format. ``skipped``: the
    messages of a type this build does not know, left out of ``msgs`` (``mesh_wire``: versions)."""

    sender: str
    msgs: tuple[Message, ...]
    stamp: tuple[int, int] | None = None
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class PushPullState:
    """A full-state sync (TCP): every member (and tombstone) we know, plus the delegate's state."""

    members: tuple[Member, ...]
    user_state: bytes = b""
    join: bool = False


# ---------------------------------------------------------------------------------------- rpc (TCP)


@dataclass(frozen=True, slots=True)
class RpcRequest:
    """One node-to-node request over the push-pull channel (mTLS + sealed frames); opaque payload."""

    payload: bytes


class RpcStatus(IntEnum):
    OK = 0
    REFUSED = 1
    """No handler, or the handler raised or timed out."""
    BUSY = 2
    """Too many RPCs in progress on the server: worth retrying."""


@dataclass(frozen=True, slots=True)
class RpcReply:
    """The answer to an ``RpcRequest``: ``OK`` with the handler's payload, or not with a short
    ``error`` (never a traceback)."""

    status: RpcStatus
    payload: bytes = b""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == RpcStatus.OK
