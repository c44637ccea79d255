"""Where a node's mesh listens and whom it joins: ``MeshRuntimeConfig``, and the address helpers of
``runtime.MeshRuntime`` (``parse_addr`` reads a ``host[:port]`` of the node's configuration,
``resolve_addrs`` turns the seeds' host names into the IP addresses gossip compares and sends to).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from shepherd.mesh.dns_seeds import DnsSeed, DnsSeedConfig
from shepherd.mesh.replay import DEFAULT_REPLAY_WINDOW_S
from shepherd.mesh.swim_types import SwimConfig
from shepherd.mesh.transport import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HANDSHAKES_PER_IP,
    DEFAULT_MAX_IDLE,
    DEFAULT_MAX_IDLE_PER_PEER,
    DEFAULT_MAX_SESSION_REQUESTS,
)
from shepherd.proto.mesh_messages import Addr

__all__ = ["MeshRuntimeConfig", "parse_addr", "resolve_addrs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshRuntimeConfig:
    """Where a node's mesh listens and whom it joins.

    ``bind_port`` 0 picks a free port (UDP and TCP share it). ``advertise_host`` is the address other
    nodes reach us at; required when ``bind_host`` is a wildcard (``0.0.0.0`` / ``::``).
    """

    name: str
    bind_host: str = "127.0.0.1"
    bind_port: int = 7946
    advertise_host: str | None = None
    advertise_port: int | None = None
    seeds: tuple[Addr, ...] = ()
    dns_seeds: tuple[DnsSeed, ...] = ()
    """Names whose A/AAAA records are members to join through (``dns_seeds``: re-resolved until joined,
    and while the mesh is small)."""
    dns: DnsSeedConfig = field(default_factory=DnsSeedConfig)
    swim: SwimConfig = field(default_factory=SwimConfig)
    tcp_timeout: float = 5.0
    max_frame: int = DEFAULT_MAX_FRAME
    max_push_pulls: int = 4
    """Concurrent outgoing push-pulls; more are skipped (swim retries later)."""
    max_tcp_sessions: int = 16
    """Authenticated TCP sessions (push-pull, RPC) served at once; more wait for a slot (``tcp_timeout``)."""
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    """Bound of an incoming connection's TLS handshake (before it is authenticated)."""
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    """Incoming TLS handshakes in progress at once; more connections are closed at once."""
    max_handshakes_per_ip: int = DEFAULT_MAX_HANDSHAKES_PER_IP
    """Incoming TLS handshakes in progress from one source address; more are closed at once."""
    rpc_timeout: float = 5.0
    """Default bound of one ``MeshRuntime.rpc`` (connect, TLS, request, the remote handler, reply)."""
    max_rpcs_out: int = 32
    """Concurrent outgoing RPCs; more wait for a slot (within their timeout)."""
    max_rpcs_per_member: int = 8
    """Concurrent outgoing RPCs to one member (under its ``max_handshakes_per_ip``); more wait."""
    max_rpcs_in: int = 8
    """RPC handlers running at once on this node; more are refused ("busy"), so that RPCs leave
    session slots to push-pulls (joins, anti-entropy)."""
    rpc_idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    """Server side: how long an RPC connection from a peer is kept open, idle, for its next request
    (0: one request per connection, as nodes before kept-alive RPC did). An idle one holds no session
    slot (``transport`` module doc)."""
    rpc_max_requests_per_connection: int = DEFAULT_MAX_SESSION_REQUESTS
    """Requests served over one RPC connection (both sides); then it is closed and a new one opened."""
    rpc_max_idle_per_peer: int = DEFAULT_MAX_IDLE_PER_PEER
    """Server side: idle RPC (and push-pull) connections kept per peer (certificate identity); the
    oldest is closed when one more goes idle. Keep it > the peers' ``rpc_pool_per_member`` (their
    pool, plus the one push-pull connection each keeps)."""
    rpc_max_idle: int = DEFAULT_MAX_IDLE
    """Server side: idle RPC connections kept in all (the oldest is closed when one more goes idle)."""
    rpc_pool_per_member: int = 4
    """Client side: idle RPC connections kept per member for reuse (0: a new connection per RPC)."""
    rpc_pool_max: int = 64
    """Client side: idle RPC connections kept in all."""
    rpc_pool_idle_timeout: float = 120.0
    """Client side: a pooled connection idle longer than this is closed rather than reused (below the
    peers' ``rpc_idle_timeout``, so that a reused connection is rarely one the peer is just closing)."""
    keep_push_pull_connections: bool = True
    """Client side: a push-pull with a member goes over the connection kept from the previous push-pull
    with it (one per member, idle like an RPC connection, reused within ``rpc_pool_idle_timeout``)
    instead of a new mTLS connection each time (a TLS handshake costs ~14x the exchange). Joins always
    open their own. The server keeps a push-pull session open for the next one either way."""
    lag_interval: float = 0.4
    """The longest between two event-loop lag samples (the timer fires this late at the latest): at the
    probe interval, the samples ride on SWIM's own probe timer (an idle node wakes no more for them).
    A stall of a probe period or more is always seen; a shorter one delays no verdict of ours unless
    it covers one of SWIM's deadlines, and then ``Swim.tick`` finds that deadline late itself."""
    max_timer_sleep: float = 0.5
    replay_window: float = DEFAULT_REPLAY_WINDOW_S
    """Datagrams stamped further than this (seconds) from our wall clock, either way, are dropped
    (``replay``); must stay below ``swim.gossip_to_the_dead_time + swim.tombstone_time``."""
    accept_unstamped_packets: bool = False
    """Accept datagrams of the older format (no replay stamp): only while upgrading a mesh."""
    bind_udp_senders: bool = True
    """Deliver a datagram's user payloads (replicated state) only if its sender's certificate was
    verified at the datagram's source address (``senders``); False: at any address (NAT between
    members, where datagrams do not come from the advertised address)."""
    leave_timeout: float = 1.0
    """How long ``close()`` keeps gossiping so that the leave reaches the others."""
    meta: bytes = b""
    """This node's SWIM metadata, gossiped with its membership (at most 512 bytes): a node's mesh puts the
    models it routes there (``index_scope``: their index deltas come to it, no others)."""


def parse_addr(text: str, default_port: int) -> Addr:
    """``host``, ``host:port``, ``[v6]:port`` or ``v6`` -> ``(host, port)``."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else default_port
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = int(p)
    else:
        host, port = text, default_port
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad address {text!r}")
    return (host, port)


async def resolve_addrs(addrs: Sequence[Addr], *, timeout: float = 5.0) -> list[Addr]:
    """Resolve host names to IP addresses (gossip compares and sends to IPs). A name that does not
    resolve yet is kept as it is: the join's TCP connect resolves it again at every retry, so a seed
    whose DNS record appears later (a container that starts after this one) is still joined. IP
    literals pass through."""
    loop = asyncio.get_running_loop()
    out: list[Addr] = []
    for host, port in addrs:
        try:
            ipaddress.ip_address(host)
            out.append((host, int(port)))
            continue
        except ValueError:
            pass
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except (OSError, TimeoutError) as e:
            log.warning("mesh: cannot resolve seed %s yet (%s): retried at every join attempt", host, e)
            out.append((host, int(port)))
            continue
        if infos:
            out.append((str(infos[0][4][0]), int(port)))
    return list(dict.fromkeys(out))
