"""``MeshRuntime``: the asyncio shell that drives the pure ``Swim`` state machine over real sockets.

It owns one UDP endpoint (sealed gossip) and one mTLS TCP push-pull server, both on the same port
number, and turns the machine's actions into I/O:

* a timer (``loop.call_at``) runs ``swim.tick`` at ``swim.next_deadline()``, re-armed after every call
  into the machine and never sleeping longer than ``max_timer_sleep``;
* UDP datagrams are opened (keyring), decoded (``mesh_wire``) and fed to ``swim.on_packet``;
  ``Send`` actions are encoded, sealed and sent as one datagram each;
* ``PushPull`` actions open a bounded number of concurrent mTLS exchanges; the server side merges the
  remote state first and answers with ours; a push-pull with a member reuses the connection kept from
  the previous one with it (``keep_push_pull_connections``: no TLS handshake), a join opens its own; a
  delegate with ``merge_remote_state_steps`` merges a state a part at a time, the loop running between
  the parts (a joining node's state is large);
* a lag monitor feeds ``swim.set_lag``: event-loop lag is the first cause of false suspicion in
  Python, Lifeguard backs off instead. It is the timer itself (lag = how late it fired), which never
  sleeps longer than ``lag_interval`` between two samples: with the default 0.4 s (the probe
  interval) the samples ride on SWIM's own wake-ups and cost an idle node none of its own;
* ``close()`` leaves gracefully (the leave is broadcast for at most ``leave_timeout``), ``abort()``
  drops off like a crash. Both stop every task and socket the runtime started.

Security: joining takes both the mesh key (datagrams *and* push-pull frames are sealed with the
keyring) and a certificate from the mesh CA (push-pulls run over mTLS). On TCP the peer is who its
certificate says (``peer_identity``): a push-pull whose state does not list the certificate's node is
refused, a dialled member answering with another node's certificate is refused, and a delegate
implementing ``merge_remote_state_from(data, peer)`` is given the certificate identity with the
remote state. UDP datagrams are authenticated by the shared keyring only (as in memberlist), and
carry a replay stamp (``replay``): a datagram outside ``replay_window`` of our clock, or seen before,
is dropped (counted in ``RuntimeMetrics.replays_dropped``). A datagram's user payloads (replicated
state) reach the delegate only if its sender's certificate was verified over mTLS at the datagram's
source address (``senders``: bound by every push-pull; a member seen without a binding is dialled to
verify it, its payloads held back meanwhile), so the delegate's ``on_user(payload, sender)`` can tie
entries to ``sender`` (``MeshState``'s ``first_hand``).

RPC: ``rpc(name, payload)`` sends one request to the member ``name`` over the push-pull channel (an
mTLS connection to its membership address, the server's certificate required to name ``name`` when it
is opened, frames sealed with the keyring, told apart from push-pull states by their frame kind,
``mesh_wire``) and
returns the reply of the handler that member installed with ``set_rpc_handler``; the handler is given
the caller's certificate identity, never a name from the payload. Failures raise ``RpcError`` whose
``reason`` is one of ``RPC_REASONS``: ``"unknown"`` (no such member, or it left or is dead),
``"suspect"`` (suspected: not tried), ``"failed"`` (connection, TLS, identity, seal, frame, timeout),
``"refused"`` (the member has no handler, or its handler raised or timed out: a short message, never
a traceback). A member with ``max_rpcs_in`` handlers running answers "busy", raised as ``"failed"``
(transient, like a timeout). Calling ``rpc`` with this node's own name runs the local handler directly.

RPC connections are kept alive (a TLS handshake costs more than a history lookup): the server keeps an
RPC session open for the same peer's next request (``transport`` module doc: an idle one holds no
session slot, ``rpc_idle_timeout``, ``rpc_max_idle_per_peer``), and ``rpc`` keeps a small pool per
member: at most ``rpc_pool_per_member`` idle connections per member and ``rpc_pool_max`` in all, one
request in flight per connection (more at once open more connections, under ``max_rpcs_per_member``),
the most recently used reused first, one idle past ``rpc_pool_idle_timeout`` or after
``rpc_max_requests_per_connection`` requests closed instead. A member's pool is closed when it leaves,
dies or is reaped, and all pools on ``close``/``abort``. At most once: an RPC is sent again (once,
over a new connection) only if it went out over a *reused* connection that the server had closed
gracefully before reading it: TLS close_notify and not one byte of reply (``ClosedBeforeRequest``; a
server closes a kept session gracefully only while idle, never after reading a request it did not
answer). A reset, a timeout or a partial reply is an ``RpcError("failed")`` as before, never retried:
the request may have run (history RPCs include writes).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shepherd.auth.certs import TlsFiles, certificate_identity, client_context, server_context
from shepherd.mesh.dns_seeds import DnsSeeder
from shepherd.mesh.keyring import OVERHEAD as SEAL_OVERHEAD
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.replay import ReplayGuard, SeqCounter
from shepherd.mesh.runtime_config import MeshRuntimeConfig, resolve_addrs
from shepherd.mesh.senders import SenderBinding
from shepherd.mesh.swim import Swim
from shepherd.mesh.swim_types import (
    Action,
    Delegate,
    JoinFailed,
    MemberDead,
    MemberEvent,
    MemberLeft,
    MemberReaped,
    MemberUp,
    NullDelegate,
    PushPull,
    Send,
)
from shepherd.mesh.transport import (
    ClosedBeforeRequest,
    KeptConnection,
    PushPullError,
    PushPullReply,
    PushPullServer,
    SessionRefused,
    TransportMetrics,
    UdpEndpoint,
    current_peer_address,
    keep_session_open,
    push_pull_request,
)
from shepherd.proto import mesh_wire
from shepherd.proto.mesh_messages import (
    Ack,
    Addr,
    MemberState,
    NodeAddr,
    PushPullState,
    RpcReply,
    RpcRequest,
    RpcStatus,
    User,
)

__all__ = [
    "RPC_REASONS",
    "MemberView",
    "MeshRuntime",
    "RpcError",
    "RpcHandler",
    "RpcReason",
    "RuntimeMetrics",
]

log = logging.getLogger(__name__)

_BIND_RETRIES = 8
_TIMER_SLACK = 0.001
_TIMER_MOVE = 0.005  # a timer armed this much (or more) before the next deadline is moved to it

RpcHandler = Callable[[str, bytes], Awaitable[bytes]]
"""``handler(peer_identity, request_payload) -> reply_payload``; the identity is the caller's certificate."""
RpcReason = Literal["unknown", "suspect", "failed", "refused"]
RPC_REASONS: tuple[RpcReason, ...] = ("unknown", "suspect", "failed", "refused")


class RpcError(Exception):
    """An ``MeshRuntime.rpc`` that got no reply payload; ``reason`` is one of ``RPC_REASONS``."""

    def __init__(self, reason: RpcReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: RpcReason = reason
        self.message = message


@dataclass(frozen=True)
class MemberView:
    """One row of ``GET /mesh/members``."""

    name: str
    host: str
    port: int
    state: str
    incarnation: int
    last_change: float
    """Unix time of the last state change seen by this node (its start time if none seen)."""

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "state": self.state,
            "incarnation": self.incarnation,
            "last_change": self.last_change,
        }


@dataclass
class RuntimeMetrics:
    """Shell counters (the transport's are in ``TransportMetrics``, the machine's in ``SwimStats``)."""

    wire_errors: int = 0
    replays_dropped: int = 0
    encode_errors: int = 0
    push_pulls_ok: int = 0
    push_pulls_failed: int = 0
    push_pulls_skipped: int = 0
    push_pulls_refused: int = 0
    rpcs_out: int = 0
    rpcs_out_failed: int = 0
    rpcs_in: int = 0
    rpcs_in_refused: int = 0
    rpc_connects: int = 0
    """Connections opened for outgoing RPCs (a TLS handshake each)."""
    rpcs_reused: int = 0
    """Outgoing RPCs sent over a pooled (kept-alive) connection."""
    rpcs_retried: int = 0
    """Outgoing RPCs sent again over a new connection: the reused one was closed before reading it."""
    push_pulls_reused: int = 0
    """Push-pulls with a member sent over the connection kept from the previous one with it (no TLS
    handshake; ``MeshRuntimeConfig.keep_push_pull_connections``); joins always open their own."""
    push_pulls_retried: int = 0
    """Push-pulls sent again over a new connection: the kept one was closed before the server read it."""
    wire_refused: dict[str, int] = field(default_factory=dict)
    """Datagrams and TCP frames refused for their protocol version, by reason
    (``wire_version.REFUSAL_REASONS``); also counted in ``wire_errors``."""
    wire_skipped: int = 0
    """Messages of a type this build does not know (a later minor's), skipped (``mesh_wire``)."""
    member_events: dict[str, int] = field(default_factory=dict)
    lag_last: float = 0.0
    lag_max: float = 0.0
    ticks: int = 0


class _IdentityDelegate:
    """Forwards to the user's delegate; passes the certificate identity of a push-pull peer to
    ``merge_remote_state_from(data, peer)`` when the delegate has it, and user payloads through the
    runtime's sender check (``gate``)."""

    def __init__(self, inner: Delegate, gate: Callable[[bytes, str], None]) -> None:
        self.inner = inner
        self.peer: str | None = None
        self._gate = gate
        self._pending: Callable[[], bool] | None = getattr(inner, "has_broadcasts", None)
        if self._pending is not None:  # asked before every datagram: the delegate's own, one call less
            self.has_broadcasts = self._pending  # type: ignore[method-assign]

    def broadcasts(self, budget: int) -> list[bytes]:
        return self.inner.broadcasts(budget)

    def has_broadcasts(self) -> bool:
        pending = self._pending
        return True if pending is None else bool(pending())

    def on_user(self, payload: bytes, src_name: str) -> None:
        self._gate(payload, src_name)

    def local_state(self) -> bytes:
        return self.inner.local_state()

    def merge_remote_state(self, data: bytes) -> None:
        merge_from = getattr(self.inner, "merge_remote_state_from", None)
        if self.peer is not None and callable(merge_from):
            merge_from(data, self.peer)
        else:
            self.inner.merge_remote_state(data)

    def merge_steps(self, data: bytes, peer: str) -> Iterator[None] | None:
        """The delegate's merge of a push-pull state a part at a time, if it can
        (``merge_remote_state_steps(data, peer)``: a generator that yields between its parts)."""
        steps = getattr(self.inner, "merge_remote_state_steps", None)
        return steps(data, peer) if callable(steps) else None


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


class MeshRuntime:
    """One node's membership and gossip over the network. Start with ``await start()``, stop with
    ``await close()`` (graceful leave) or ``await abort()`` (no leave). One-shot: not restartable."""

    def __init__(
        self,
        config: MeshRuntimeConfig,
        keyring: Keyring,
        server_ssl: ssl.SSLContext,
        client_ssl: ssl.SSLContext,
        delegate: Delegate | None = None,
        *,
        on_member_event: Callable[[MemberEvent], None] | None = None,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        memory = config.swim.gossip_to_the_dead_time + config.swim.tombstone_time
        if not 0 < config.replay_window < memory:
            raise ValueError(
                f"mesh: replay_window must be in (0, {memory}) s (how long a member that left is remembered)"
            )
        if config.advertise_host is None and _is_wildcard(config.bind_host):
            raise ValueError("mesh: advertise_host is required when bind_host is a wildcard address")
        if config.swim.seal_overhead < SEAL_OVERHEAD:
            raise ValueError(f"mesh: swim.seal_overhead must be >= {SEAL_OVERHEAD}")
        self.config = config
        self.keyring = keyring
        self.delegate: Delegate = delegate if delegate is not None else NullDelegate()
        self.transport_metrics = TransportMetrics()
        self.metrics = RuntimeMetrics()
        self.on_member_event = on_member_event
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        self._rng = rng if rng is not None else random.Random(os.urandom(16))
        self._me = NodeAddr(config.name, config.advertise_host or config.bind_host, config.bind_port)
        self._adapter = _IdentityDelegate(self.delegate, self._gate_user)
        self.senders = SenderBinding(self._deliver_user, match_address=config.bind_udp_senders)
        self._udp_src: Addr | None = None
        self._verify_at: dict[str, float] = {}  # member -> when we last dialled it to verify it
        self._version_logged: dict[tuple[str, str], float] = {}  # (peer, reason) -> last logged
        self._warned_addr: set[str] = set()
        self._seq = SeqCounter(wall_clock)
        self._budget = config.swim.packet_budget  # (a property: read once)
        self.replay = ReplayGuard(
            config.replay_window, accept_unstamped=config.accept_unstamped_packets, clock=wall_clock
        )
        self._swim: Swim | None = None
        self._udp: UdpEndpoint | None = None
        self._tcp: PushPullServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._lag_due = float("inf")  # the timer fires by then at the latest (a lag sample)
        self._job: Callable[[], object] | None = None  # ``call_every``'s job, its period, slack, due time
        self._job_period = self._job_slack = 0.0
        self._job_due = float("inf")
        self._dns_task: asyncio.Task[None] | None = None
        self.dns_seeder: DnsSeeder | None = None  # with DNS seeds (``dns_seeds``)
        self._push_pulls: set[asyncio.Task[bool]] = set()
        self._rpc_handler: RpcHandler | None = None
        self._rpcs_in = 0
        self._rpc_slots = asyncio.Semaphore(config.max_rpcs_out)
        self._member_slots: dict[str, asyncio.Semaphore] = {}  # per member called (members are bounded)
        self._pool: dict[str, list[KeptConnection]] = {}  # idle RPC connections per member, newest last
        self._pool_size = 0
        self._pp_conns: dict[str, KeptConnection] = {}  # the kept push-pull connection per member, idle
        self._last_change: dict[str, float] = {}
        self._started_at = 0.0
        self._closing = False
        self._closed = False
        self.join_failed = False

    @classmethod
    def from_files(
        cls,
        config: MeshRuntimeConfig,
        keyring: Keyring,
        tls: TlsFiles,
        delegate: Delegate | None = None,
        *,
        on_member_event: Callable[[MemberEvent], None] | None = None,
    ) -> MeshRuntime:
        """Build the mTLS contexts from ``tls`` and check that the certificate names this node
        (peers refuse a node whose certificate names another one)."""
        ident = certificate_identity(tls.cert.read_bytes())
        if ident != config.name:
            raise ValueError(f"mesh: the certificate {tls.cert} is for node {ident!r}, not {config.name!r}")
        return cls(
            config,
            keyring,
            server_context(tls),
            client_context(tls),
            delegate,
            on_member_event=on_member_event,
        )

    # --- public -------------------------------------------------------------------------------

    @property
    def swim(self) -> Swim:
        if self._swim is None:
            raise RuntimeError("mesh runtime not started")
        return self._swim

    @property
    def me(self) -> NodeAddr:
        return self._me

    @property
    def address(self) -> Addr:
        """The advertised gossip address (UDP and TCP)."""
        return self._me.addr

    @property
    def bound_address(self) -> Addr:
        if self._udp is None:
            raise RuntimeError("mesh runtime not started")
        return self._udp.address

    @property
    def running(self) -> bool:
        return self._swim is not None and not self._closing

    def members(self) -> list[MemberView]:
        """Every member this node knows (itself included), sorted by name."""
        if self._swim is None:
            return []
        out = [
            MemberView(
                name=m.name,
                host=m.host,
                port=m.port,
                state=m.state.name.lower(),
                incarnation=m.incarnation,
                last_change=self._last_change.get(m.name, self._started_at),
            )
            for m in self._swim.members()
        ]
        out.sort(key=lambda v: v.name)
        return out

    def member_state(self, name: str) -> MemberState | None:
        if self._swim is None:
            return None
        m = self._swim.member(name)
        return None if m is None else m.state

    async def start(self) -> None:
        """Bind UDP + TCP, start the machine (join the seeds, retried by swim until one answers)."""
        if self._swim is not None or self._closed:
            raise RuntimeError("mesh runtime already started")
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        await self._bind()
        try:
            assert self._udp is not None
            port = cfg.advertise_port or self._udp.address[1]
            host = cfg.advertise_host or cfg.bind_host
            self._me = NodeAddr(cfg.name, host, port)
            self._started_at = time.time()
            self._last_change[cfg.name] = self._started_at
            self._swim = Swim(cfg.swim, self._me, self._rng, self._adapter, meta=cfg.meta)
            seeds = await resolve_addrs(cfg.seeds, timeout=cfg.tcp_timeout)
            self._lag_due = self._now() + cfg.lag_interval
            if self._job is not None:  # (``call_every`` before ``start``)
                self._job_due = self._now() + self._job_period
            self._execute(self._swim.start(self._now(), seeds))
            if cfg.dns_seeds:
                self.dns_seeder = DnsSeeder(
                    cfg.dns_seeds,
                    join=self.join,
                    alive=self._alive_addrs,
                    me=lambda: self._me.addr,
                    config=cfg.dns,
                    rng=random.Random(self._rng.random()),
                )
                self._dns_task = self._loop.create_task(self.dns_seeder.run(), name=f"mesh-dns-{cfg.name}")
        except BaseException:
            await self._shutdown()
            raise

    def send_user(self, dest: Addr, payloads: Sequence[bytes]) -> int:
        """Send each payload as a datagram of its own (one ``User`` message) to ``dest``, outside SWIM's
        piggybacking: for the state layer's prefix-index batches (``MeshState.index_batches``), which
        the receiver's delegate gets through ``on_user``. Returns how many were handed to the socket."""
        if self._udp is None or self._closed:
            return 0
        for p in payloads:
            self._send(Send(dest, (User(p),)))
        return len(payloads)

    def set_rpc_handler(self, handler: RpcHandler | None) -> None:
        """Serve RPCs with ``handler(peer_identity, payload) -> reply`` (None: refuse them). At most
        ``config.max_rpcs_in`` run at once (more are answered "busy"), each bounded by 0.9 x
        ``config.tcp_timeout`` (then refused: "handler timed out"), whatever the caller's timeout."""
        self._rpc_handler = handler

    async def rpc(self, name: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        """Send ``payload`` to the member ``name`` and return its handler's reply (bounded by
        ``timeout``, default ``config.rpc_timeout``); ``RpcError`` otherwise (see the module doc)."""
        if self._swim is None or self._closing:
            raise RpcError("failed", "mesh runtime not running")
        limit = self.config.rpc_timeout if timeout is None else timeout
        if name == self._me.name:
            return await self._local_rpc(payload, limit)
        m = self._swim.member(name)
        if m is None or m.state in (MemberState.DEAD, MemberState.LEFT):
            raise RpcError("unknown", f"no live member {name!r}")
        if m.state == MemberState.SUSPECT:
            raise RpcError("suspect", f"member {name!r} is suspected")
        self.metrics.rpcs_out += 1
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + limit
            slots = self._member_slots.get(name)
            if slots is None:
                slots = self._member_slots[name] = asyncio.Semaphore(self.config.max_rpcs_per_member)
            async with asyncio.timeout(limit):
                await self._rpc_slots.acquire()
                try:
                    await slots.acquire()
                except BaseException:
                    self._rpc_slots.release()
                    raise
            try:
                reply = await self._rpc_exchange(
                    name, m.addr, mesh_wire.encode_rpc_request(RpcRequest(payload)), deadline
                )
            finally:
                slots.release()
                self._rpc_slots.release()
            answer = mesh_wire.decode_rpc_reply(reply, max_bytes=self.config.max_frame)
        except TimeoutError:
            self.metrics.rpcs_out_failed += 1
            raise RpcError("failed", f"rpc to {name!r}: no free slot within {limit} s") from None
        except (PushPullError, mesh_wire.WireError) as e:
            if isinstance(e, mesh_wire.WireVersionError):
                self._wire_error(e, name, "RPC reply")
            self.metrics.rpcs_out_failed += 1
            raise RpcError("failed", f"rpc to {name!r}: {e}") from None
        if answer.status == RpcStatus.BUSY:
            self.metrics.rpcs_out_failed += 1
            raise RpcError("failed", f"rpc to {name!r}: busy")
        if not answer.ok:
            self.metrics.rpcs_out_failed += 1
            raise RpcError("refused", f"rpc to {name!r}: {answer.error}")
        return answer.payload

    async def _rpc_exchange(self, name: str, addr: Addr, request: bytes, deadline: float) -> bytes:
        """One request over a pooled connection to ``name`` (or a new one), sent again once over a new
        connection only if the reused one was closed before the server read it (module doc)."""
        conn, reused = await self._checkout(name, addr, deadline)
        try:
            reply = await self._send_rpc(conn, request, deadline)
        except ClosedBeforeRequest:
            if not reused:
                raise
            self.metrics.rpcs_retried += 1
            conn = await self._connect_rpc(name, addr, deadline)
            reply = await self._send_rpc(conn, request, deadline)
        self._checkin(name, conn)
        return reply

    async def _send_rpc(self, conn: KeptConnection, request: bytes, deadline: float) -> bytes:
        return await conn.exchange(
            request,
            keyring=self.keyring,
            metrics=self.transport_metrics,
            max_frame=self.config.max_frame,
            timeout=max(0.001, deadline - self._now()),
        )

    async def _connect_rpc(self, name: str, addr: Addr, deadline: float) -> KeptConnection:
        conn = await KeptConnection.open(
            addr,
            self._client_ssl,
            expected_identity=name,
            metrics=self.transport_metrics,
            timeout=max(0.001, deadline - self._now()),
        )
        self.metrics.rpc_connects += 1
        return conn

    async def _checkout(self, name: str, addr: Addr, deadline: float) -> tuple[KeptConnection, bool]:
        """The most recently used idle connection to ``name`` that is still open, else a new one."""
        max_idle = self.config.rpc_pool_idle_timeout
        while idle := self._pool.get(name):
            conn = idle.pop()
            self._pool_size -= 1
            if not idle:
                del self._pool[name]
            if conn.dest != addr or self._now() - conn.idle_since > max_idle:
                conn.close()
                continue
            if await conn.unpark():
                self.metrics.rpcs_reused += 1
                return conn, True
        return await self._connect_rpc(name, addr, deadline), False

    def _checkin(self, name: str, conn: KeptConnection) -> None:
        """After a reply: back to ``name``'s pool if it has room, else closed."""
        cfg = self.config
        m = self._swim.member(name) if self._swim is not None else None
        idle = self._pool.get(name, [])
        if (
            self._closing
            or m is None
            or m.state != MemberState.ALIVE
            or m.addr != conn.dest
            or conn.requests >= cfg.rpc_max_requests_per_connection
            or len(idle) >= cfg.rpc_pool_per_member
            or self._pool_size >= cfg.rpc_pool_max
            or not conn.usable
        ):
            conn.close()
            return
        idle.append(conn)
        self._pool[name] = idle
        self._pool_size += 1
        conn.park(lambda c: self._pool_lost(name, c))

    def _pool_lost(self, name: str, conn: KeptConnection) -> None:
        """A pooled connection the server closed (idle timeout, eviction, restart): forget it."""
        idle = self._pool.get(name)
        if idle is not None and conn in idle:
            idle.remove(conn)
            self._pool_size -= 1
            if not idle:
                del self._pool[name]
        conn.close()

    def _drop_pool(self, name: str) -> None:
        for conn in self._pool.pop(name, []):
            self._pool_size -= 1
            conn.close()
        pp = self._pp_conns.pop(name, None)
        if pp is not None:
            pp.close()

    def pooled_connections(self, name: str | None = None) -> int:
        """Idle RPC connections kept for reuse (to ``name``, or in all)."""
        return self._pool_size if name is None else len(self._pool.get(name, ()))

    async def _local_rpc(self, payload: bytes, limit: float) -> bytes:
        """``rpc`` to this node itself: the handler called in-process, errors mapped as a peer's."""
        answer = await self._serve_rpc(self._me.name, payload, limit)
        if answer.status == RpcStatus.BUSY:
            raise RpcError("failed", f"rpc to {self._me.name!r} (self): busy")
        if not answer.ok:
            raise RpcError("refused", f"rpc to {self._me.name!r} (self): {answer.error}")
        return answer.payload

    async def _serve_rpc(self, identity: str, payload: bytes, limit: float) -> RpcReply:
        handler = self._rpc_handler
        self.metrics.rpcs_in += 1
        if handler is None:
            self.metrics.rpcs_in_refused += 1
            return RpcReply(RpcStatus.REFUSED, error="no rpc handler")
        if self._rpcs_in >= self.config.max_rpcs_in:
            self.metrics.rpcs_in_refused += 1
            return RpcReply(RpcStatus.BUSY, error="busy")
        self._rpcs_in += 1
        try:
            async with asyncio.timeout(limit):
                reply = await handler(identity, payload)
            if not isinstance(reply, bytes | bytearray | memoryview):
                raise TypeError(f"rpc handler returned {type(reply).__name__}, not bytes")
            return RpcReply(RpcStatus.OK, bytes(reply))
        except TimeoutError:
            self.metrics.rpcs_in_refused += 1
            return RpcReply(RpcStatus.REFUSED, error="handler timed out")
        except Exception as e:
            self.metrics.rpcs_in_refused += 1
            log.warning("mesh: rpc handler failed for %s: %s: %s", identity, type(e).__name__, e)
            return RpcReply(RpcStatus.REFUSED, error=f"handler failed: {type(e).__name__}")
        finally:
            self._rpcs_in -= 1

    def _alive_addrs(self) -> list[Addr]:
        """The gossip addresses of the other members held alive (or suspect)."""
        swim = self._swim
        if swim is None:
            return []
        live = (MemberState.ALIVE, MemberState.SUSPECT)
        return [m.addr for m in swim.members() if m.name != self._me.name and m.state in live]

    async def join(self, seeds: Sequence[Addr]) -> int:
        """Push-pull (join) with each of ``seeds`` now; the number that answered (``smg-node join``,
        an admin endpoint). Unlike the configured seeds, these are tried once."""
        if self._swim is None or self._closing:
            raise RuntimeError("mesh runtime not running")
        addrs = [(str(h), int(p)) for h, p in seeds]
        tasks = [self._spawn_push_pull(PushPull(a, "", True)) for a in addrs if a != self._me.addr]
        if not tasks:
            return 0
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return sum(1 for r in results if r is True)

    async def close(self) -> None:
        """Leave gracefully (bounded by ``leave_timeout``), then stop everything."""
        if self._swim is not None and not self._closing and not self._swim.left:
            self._execute(self._swim.leave(self._now()))
            await self._drain_leave()
        await self._shutdown()

    async def abort(self) -> None:
        """Stop without leaving: to the others this looks like a crash."""
        await self._shutdown()

    # --- lifecycle ----------------------------------------------------------------------------

    async def _bind(self) -> None:
        cfg = self.config
        last: OSError | None = None
        for _ in range(_BIND_RETRIES if cfg.bind_port == 0 else 1):
            udp = await UdpEndpoint.open(
                cfg.bind_host, cfg.bind_port, self.keyring, self._on_datagram, metrics=self.transport_metrics
            )
            try:
                tcp = await PushPullServer.start(
                    cfg.bind_host,
                    udp.address[1],
                    self._server_ssl,
                    self._on_push_pull,
                    metrics=self.transport_metrics,
                    max_frame=cfg.max_frame,
                    timeout=cfg.tcp_timeout,
                    max_sessions=cfg.max_tcp_sessions,
                    keyring=self.keyring,
                    handshake_timeout=cfg.handshake_timeout,
                    max_handshakes=cfg.max_handshakes,
                    max_handshakes_per_ip=cfg.max_handshakes_per_ip,
                    idle_timeout=cfg.rpc_idle_timeout,
                    max_session_requests=cfg.rpc_max_requests_per_connection,
                    max_idle_per_peer=cfg.rpc_max_idle_per_peer,
                    max_idle=cfg.rpc_max_idle,
                )
            except OSError as e:  # the TCP port of that number is taken: try another one
                udp.close()
                last = e
                continue
            self._udp, self._tcp = udp, tcp
            return
        raise OSError(f"mesh: cannot bind UDP+TCP on {cfg.bind_host}:{cfg.bind_port}: {last}")

    async def _drain_leave(self) -> None:
        """Keep ticking (the timer runs) until the leave has been piggybacked enough, bounded."""
        steps = max(1, int(self.config.leave_timeout / 0.02))
        for _ in range(steps):
            swim = self._swim
            if swim is None or swim.pending_broadcasts == 0:
                return
            if not any(m.name != self._me.name for m in swim.alive_members()):
                return  # nobody to tell
            await asyncio.sleep(0.02)

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closing = True
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        tasks: list[asyncio.Task[Any]] = list(self._push_pulls)
        if self._dns_task is not None:
            tasks.append(self._dns_task)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for name in list(self._pool) + list(self._pp_conns):
            self._drop_pool(name)
        if self._tcp is not None:
            await self._tcp.close()
        if self._udp is not None:
            self._udp.close()

    # --- machine driving ----------------------------------------------------------------------

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _execute(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action)
            elif isinstance(action, PushPull):
                self._start_push_pull(action)
            elif isinstance(action, JoinFailed):
                self.join_failed = True
                log.warning("mesh: no seed answered after %d attempts", action.attempts)
            else:
                self._member_event(action)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._swim is None or self._closed or self._loop is None:
            return
        now = self._now()
        due = min(self._swim.next_deadline(), now + self.config.max_timer_sleep, self._lag_due, self._job_due)
        # a deadline already past (e.g. a probe made due at once by a suspicion, armed when the probe in
        # flight is acked) fires now, and the lag sample counts from now: its age is not loop lag
        due = max(due, now)
        if self._timer is not None:
            # armed for then already; or for an earlier deadline that went away (a probe's timeout once
            # its ack is in): moved, rather than woken for nothing (an idle node's every other wake-up)
            if self._timer_at <= due <= self._timer_at + _TIMER_MOVE:
                return
            self._timer.cancel()
        self._timer_at = due
        # a little late on purpose: uvloop's timers and clock have 1 ms granularity and would
        # otherwise fire just before the deadline, again and again until the clock reaches it
        self._timer = self._loop.call_at(due + _TIMER_SLACK, self._on_timer)

    def _on_timer(self) -> None:
        armed = self._timer_at
        self._timer = None
        self._timer_at = float("inf")
        if self._swim is None or self._closed:
            return
        self.metrics.ticks += 1
        now = self._loop.time() if self._loop is not None else 0.0
        self._lag_sample(max(0.0, now - armed - _TIMER_SLACK), now)
        try:
            actions = self._swim.tick(now)
        except Exception:
            log.exception("mesh: swim.tick failed")
            actions = []
        self._execute(actions)
        self._run_job()

    def _send(self, action: Send) -> None:
        udp = self._udp
        if udp is None or self._closed:
            return
        msgs = action.msgs
        stamp = self._seq.next()
        # a lone ping or ack (an idle node's every datagram): the same bytes in one msgpack call
        fields = mesh_wire.lone_fields(msgs)
        data = None if fields is None else mesh_wire.encode_lone(fields, self._me.name, stamp, self._budget)
        if data is None:
            try:
                data = mesh_wire.encode_packet(
                    list(msgs), budget=self._budget, sender=self._me.name, stamp=stamp
                )
            except Exception:
                self.metrics.encode_errors += 1
                log.exception("mesh: cannot encode a packet for %s", action.dest)
                return
        udp.send(data, action.dest)

    def _on_datagram(self, data: bytes, src: Addr) -> None:
        swim = self._swim
        if swim is None or self._closed:
            return
        # an idle node's datagrams: a lone ping to answer or a lone ack of our probe, decoded in one
        # msgpack call and, when nothing else is going on, handled without building a packet
        lone = mesh_wire.decode_lone(data)
        if lone is not None:
            sender, stamp, f = lone
            if not self.replay.accept(sender, stamp):
                self.metrics.replays_dropped += 1
                return
            if self._lone(swim, f):
                return
            packet = mesh_wire.decode_packet(data)  # (decodes what decode_lone accepted)
        else:
            try:
                packet = mesh_wire.decode_packet(data)
            except mesh_wire.WireError as e:
                self._wire_error(e, f"{src[0]}:{src[1]}", "datagram")
                return
            self.metrics.wire_skipped += packet.skipped
            if not self.replay.accept(packet.sender, packet.stamp):
                self.metrics.replays_dropped += 1
                return
        self._udp_src = src
        try:
            actions = swim.on_packet(self._now(), src, packet)
        finally:
            self._udp_src = None
        self._execute(actions)
        self._run_job()

    def _lone(self, swim: Swim, f: list[Any]) -> bool:
        """A lone ping or ack (``mesh_wire.decode_lone``'s ``f``) handled as ``on_packet`` would, if
        ``Swim`` says nothing else is going on; False: not handled (nothing changed)."""
        assert self._loop is not None
        now = self._loop.time()
        if f[0] == mesh_wire.ACK:
            if not swim.on_ack_alone(now, f[1]):
                return False
            self._arm_timer()  # the probe's timeout went away
        else:
            if not swim.on_ping_alone(now, f[1], f[2], f[3]):
                return False
            udp = self._udp
            data = mesh_wire.encode_lone([mesh_wire.ACK, f[1]], self._me.name, self._seq.next(), self._budget)
            if udp is not None and data is not None:
                udp.send(data, (f[4], f[5]))
            elif udp is not None:
                self._send(Send((f[4], f[5]), (Ack(f[1]),)))
            if self._timer is None:  # (answering changes no deadline: the timer stays as armed)
                self._arm_timer()
        self._run_job()
        return True

    def call_every(self, period: float, job: Callable[[], object], *, slack: float = 0.0) -> None:
        """Run ``job()`` every ``period`` seconds on this runtime's own wake-ups: at the first timer or
        datagram in the last ``slack`` seconds before it is due (then due again ``period`` later), and
        when due at the latest (the timer is armed for it). So an idle node does not wake for it while
        probes and acks come in that window: the period is between ``period - slack`` and ``period``.
        One job (a second call replaces it); not run once the runtime is closing; exceptions logged."""
        if period <= 0 or not 0 <= slack < period:
            raise ValueError("mesh: call_every needs period > 0 and 0 <= slack < period")
        self._job, self._job_period, self._job_slack = job, period, slack
        if self._loop is not None:
            self._job_due = self._now() + period
            self._arm_timer()

    def _run_job(self) -> None:
        job = self._job
        if job is None or self._closing:
            return
        now = self._now()
        if now < self._job_due - self._job_slack:
            return
        self._job_due = now + self._job_period
        try:
            job()
        except Exception:
            log.exception("mesh: periodic %s failed", getattr(job, "__name__", job))
        self._arm_timer()

    def _wire_error(self, e: mesh_wire.WireError, peer: str, what: str) -> None:
        """Count a malformed datagram or frame; a refused version is also counted by reason and logged
        (once a minute per peer and reason: a peer of another major sends many)."""
        self.metrics.wire_errors += 1
        if not isinstance(e, mesh_wire.WireVersionError):
            return
        refused = self.metrics.wire_refused
        refused[e.reason] = refused.get(e.reason, 0) + 1
        key = (peer, e.reason)
        now = time.monotonic()
        if now - self._version_logged.get(key, -1e9) >= 60.0:
            if len(self._version_logged) > 1024:
                self._version_logged.clear()
            self._version_logged[key] = now
            log.warning(
                "mesh: %s from %s refused: %s (a rolling upgrade moves one minor version at a time; "
                "another major needs every node upgraded)",
                what,
                peer,
                e,
            )

    # --- user payloads: tied to the sender (``senders``) ---------------------------------------

    def _gate_user(self, payload: bytes, sender: str) -> None:
        """A user payload of the datagram being handled: to the delegate if ``sender`` is bound to the
        datagram's source address (verified over mTLS), else held back while we verify it."""
        src, swim = self._udp_src, self._swim
        if src is None or swim is None:
            return
        m = swim.member(sender) if sender != self._me.name else None
        member_addr = (
            m.addr if m is not None and m.state in (MemberState.ALIVE, MemberState.SUSPECT) else None
        )
        if self.senders.on_user(payload, sender, src, self._now(), member_addr) and member_addr is not None:
            self._verify(sender, member_addr)

    def _deliver_user(self, payload: bytes, sender: str) -> None:
        try:
            self.delegate.on_user(payload, sender)
        except Exception:
            log.exception("mesh: delegate on_user failed (payload from %s)", sender)

    def _verify(self, name: str, addr: Addr) -> None:
        """Dial ``name`` at ``addr`` (a push-pull requiring its certificate), at most once a second."""
        now = self._now()
        if now - self._verify_at.get(name, -1e9) < 1.0 or self._closing:
            return
        if len(self._verify_at) > 4096:
            self._verify_at.clear()
        self._verify_at[name] = now
        self._start_push_pull(PushPull(addr, name, False))

    def _member_event(self, event: MemberEvent) -> None:
        kind = type(event).__name__
        self.metrics.member_events[kind] = self.metrics.member_events.get(kind, 0) + 1
        name = event.name if isinstance(event, MemberReaped) else event.member.name
        if isinstance(event, MemberDead | MemberLeft | MemberReaped):
            self.senders.unbind(name)
            self._drop_pool(name)
        elif (
            isinstance(event, MemberUp)
            and name != self._me.name
            and not self.senders.is_bound(name, event.member.addr)
        ):
            self._verify(name, event.member.addr)
        self._last_change[name] = time.time()
        if isinstance(event, MemberReaped):
            self._last_change.pop(name, None)
        log.info("mesh: %s %s", kind, name)
        hook: Any = None
        if isinstance(event, MemberDead | MemberLeft):
            hook = getattr(self.delegate, "on_member_dead", None)
        elif isinstance(event, MemberUp):
            hook = getattr(self.delegate, "on_member_alive", None)
        if callable(hook):
            try:
                hook(name)
            except Exception:
                log.exception("mesh: delegate hook for %s %s failed", kind, name)
        if self.on_member_event is not None:
            try:
                self.on_member_event(event)
            except Exception:
                log.exception("mesh: on_member_event callback failed")

    # --- push-pull ----------------------------------------------------------------------------

    def _start_push_pull(self, action: PushPull) -> None:
        if self._closing or self._loop is None:
            return
        if len(self._push_pulls) >= self.config.max_push_pulls:
            self.metrics.push_pulls_skipped += 1
            return
        self._spawn_push_pull(action)

    def _spawn_push_pull(self, action: PushPull) -> asyncio.Task[bool]:
        assert self._loop is not None
        task = self._loop.create_task(self._push_pull(action), name=f"mesh-pp-{action.dest}")
        self._push_pulls.add(task)
        task.add_done_callback(self._push_pulls.discard)
        return task

    def _check_remote(self, remote: PushPullState, identity: str) -> bool:
        """A peer must list itself (its certificate name) among the members it sends."""
        if any(m.name == identity for m in remote.members):
            return True
        self.metrics.push_pulls_refused += 1
        log.warning("mesh: push-pull from %r refused: its state does not list that node", identity)
        return False

    async def _merge(self, remote: PushPullState, identity: str) -> None:
        """Merge a peer's push-pull state: the members at once, the delegate's state a part at a time
        when it can (``merge_remote_state_steps``), the loop running between the parts: a joining
        node's state carries every rate-limit shard of the mesh (tens of ms in one go at N = 200 with
        many tenants). The reply is due when this returns."""
        assert self._swim is not None
        steps = self._adapter.merge_steps(remote.user_state, identity) if remote.user_state else None
        if steps is not None:
            remote = PushPullState(remote.members, b"", remote.join)
        self._adapter.peer = identity
        try:
            actions = self._swim.merge_push_pull(self._now(), remote)
        finally:
            self._adapter.peer = None
        self._execute(actions)
        if steps is not None:
            for _ in steps:  # (it ends with its input's parts)
                await asyncio.sleep(0)

    async def _push_pull(self, action: PushPull) -> bool:
        swim = self.swim
        conn: KeptConnection | None = None  # the connection to keep, once its reply proved valid
        try:
            try:
                payload = mesh_wire.encode_push_pull(swim.local_push_pull(action.join))
                if action.name and not action.join and self.config.keep_push_pull_connections:
                    reply, conn = await self._push_pull_kept(action.name, action.dest, payload)
                else:  # a join (or an unnamed seed): one exchange over a connection of its own
                    reply = await push_pull_request(
                        action.dest,
                        self._client_ssl,
                        payload,
                        expected_identity=action.name or None,
                        keyring=self.keyring,
                        metrics=self.transport_metrics,
                        max_frame=self.config.max_frame,
                        timeout=self.config.tcp_timeout,
                    )
                remote = mesh_wire.decode_push_pull(reply.payload, max_bytes=self.config.max_frame)
            except (PushPullError, mesh_wire.WireError) as e:
                if isinstance(e, mesh_wire.WireVersionError):
                    self._wire_error(e, f"{action.dest[0]}:{action.dest[1]}", "push-pull reply")
                self.metrics.push_pulls_failed += 1
                log.debug("mesh: push-pull with %s failed: %s", action.dest, e)
                return False
            if self._closed or not self._check_remote(remote, reply.identity):
                return False
            if conn is not None:  # the reply was read, opened, decoded and lists its sender: kept
                self._keep_push_pull(action.name, conn)
                conn = None
        finally:
            if conn is not None:  # a reply we refused: that connection is not used again
                conn.close()
        try:
            await self._merge(remote, reply.identity)
        except Exception:
            self.metrics.push_pulls_failed += 1
            log.exception("mesh: merging the state of %s failed", reply.identity)
            return False
        self.metrics.push_pulls_ok += 1
        # its certificate answered at the address we dialled: its datagrams from there are its own
        self.senders.bind(reply.identity, action.dest, self._now())
        return True

    async def _push_pull_kept(
        self, name: str, addr: Addr, payload: bytes
    ) -> tuple[PushPullReply, KeptConnection]:
        """A push-pull with the member ``name`` over the connection kept from the last one with it
        (a new mTLS connection costs ~14x the CPU of an exchange over a kept one: README "More than
        one core"), else over a new one; the reply and the connection, which the caller keeps
        (``_keep_push_pull``) once the reply proved valid, else closes. Sent again once over a new
        connection only if the kept one was closed before the server read it (idempotent)."""
        deadline = self._now() + self.config.tcp_timeout
        conn = self._pp_conns.pop(name, None)
        reused = False
        if conn is not None:
            fresh = self._now() - conn.idle_since <= self.config.rpc_pool_idle_timeout
            reused = conn.dest == addr and fresh and await conn.unpark()
            if not reused:
                conn.close()
        if conn is None or not reused:
            conn = await self._connect_push_pull(name, addr, deadline)
        try:
            answer = await self._send_rpc(conn, payload, deadline)
        except ClosedBeforeRequest:
            if not reused:
                raise
            self.metrics.push_pulls_retried += 1
            conn = await self._connect_push_pull(name, addr, deadline)
            answer = await self._send_rpc(conn, payload, deadline)
        else:
            self.metrics.push_pulls_reused += int(reused)
        return PushPullReply(conn.identity, answer), conn

    async def _connect_push_pull(self, name: str, addr: Addr, deadline: float) -> KeptConnection:
        return await KeptConnection.open(
            addr,
            self._client_ssl,
            expected_identity=name,
            metrics=self.transport_metrics,
            timeout=max(0.001, deadline - self._now()),
        )

    def _keep_push_pull(self, name: str, conn: KeptConnection) -> None:
        """Park ``conn`` for the next push-pull with ``name`` (one per member), or close it."""
        m = self._swim.member(name) if self._swim is not None else None
        if (
            self._closing
            or name in self._pp_conns
            or m is None
            or m.state != MemberState.ALIVE
            or m.addr != conn.dest
            or conn.requests >= self.config.rpc_max_requests_per_connection
            or not conn.usable
        ):
            conn.close()
            return
        self._pp_conns[name] = conn
        conn.park(lambda c: self._push_pull_lost(name, c))

    def _push_pull_lost(self, name: str, conn: KeptConnection) -> None:
        """A kept push-pull connection the server closed (idle timeout, eviction, restart)."""
        if self._pp_conns.get(name) is conn:
            del self._pp_conns[name]
        conn.close()

    def kept_push_pull_connections(self) -> list[str]:
        """The members a push-pull connection is kept open to (idle, for the next push-pull)."""
        return sorted(self._pp_conns)

    async def _on_push_pull(self, identity: str, request: bytes) -> bytes:
        if self._swim is None or self._closing:
            raise SessionRefused("mesh runtime is closing")
        try:
            remote = mesh_wire.decode_tcp_request(request, max_bytes=self.config.max_frame)
        except mesh_wire.WireError as e:
            self._wire_error(e, identity, "push-pull")
            raise SessionRefused(f"malformed push-pull state: {e}") from None
        if isinstance(remote, RpcRequest):
            keep_session_open()  # the caller may send its next RPC over this connection
            # under the transport's own bound on the handler (tcp_timeout): answer before it fires
            answer = await self._serve_rpc(identity, remote.payload, self.config.tcp_timeout * 0.9)
            return mesh_wire.encode_rpc_reply(answer)
        if not self._check_remote(remote, identity):
            raise SessionRefused(f"push-pull state from {identity!r} does not list that node")
        if not remote.join:
            keep_session_open()  # the peer's next push-pull may come over this connection (or it closes)
        await self._merge(remote, identity)
        peer = current_peer_address()
        own = next((m for m in remote.members if m.name == identity), None)
        if peer is not None and own is not None and own.host == peer[0]:
            self.senders.bind(identity, own.addr, self._now())  # it listed itself at its own host
        return mesh_wire.encode_push_pull(self._swim.local_push_pull(remote.join))

    # --- lag ----------------------------------------------------------------------------------

    def _lag_sample(self, lag: float, now: float) -> None:
        """The timer fired ``lag`` seconds late (at ``now``): event-loop lag (Lifeguard's input); and the
        upkeep that goes with each sample (held payloads expired, their unverified senders dialled)."""
        self._lag_due = now + self.config.lag_interval
        self.metrics.lag_last = lag
        self.metrics.lag_max = max(self.metrics.lag_max, lag)
        assert self._swim is not None
        if lag > self._swim.lag_floor:  # (up to it ``set_lag`` does nothing: not called every wake-up)
            try:
                actions = self._swim.set_lag(now, lag)
                if actions:  # (the tick that follows arms the timer)
                    self._execute(actions)
            except Exception:
                log.exception("mesh: swim.set_lag failed")
        if not self.senders.held:
            return
        self.senders.expire(now)
        for name in self.senders.held_names():
            m = self._swim.member(name)
            if m is not None and m.state in (MemberState.ALIVE, MemberState.SUSPECT):
                self._verify(name, m.addr)
