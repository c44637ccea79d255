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

from shepherd.mesh.swim_types import SwimConfig
from shepherd.mesh.transport import DEFAULT_MAX_FRAME
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
    swim: SwimConfig = field(default_factory=SwimConfig)
    tcp_timeout: float = 5.0
    max_frame: int = DEFAULT_MAX_FRAME
    max_push_pulls: int = 4
    """Concurrent outgoing push-pulls; more are skipped (swim retries later)."""
    max_tcp_sessions: int = 16
    lag_interval: float = 0.1
    max_timer_sleep: float = 0.5
    leave_timeout: float = 1.0
    """How long ``close()`` keeps gossiping so that the leave reaches the others."""


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
