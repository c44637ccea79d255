"""DNS seeds: join a mesh through a name whose records list its members (a Kubernetes headless service).

A seed written ``dns:NAME[:PORT]`` (``--mesh-seeds``, ``smg-node join``; PORT defaults to the mesh
port) is not one address: every A and AAAA record of NAME is a member to join through. ``DnsSeeder``
runs beside the SWIM machine:

- **until joined** (no other member alive): resolve every DNS seed, join (push-pull) every address that
  is not this node's own, and if none answered try again after a back-off that doubles from
  ``initial_backoff`` up to ``max_backoff`` (bounded, with jitter): pods that are not ready yet, or a
  name that does not resolve yet, are found when they appear;
- **once joined**, while the mesh is small (fewer than ``small_mesh`` alive members, this node
  included), resolve again every ``refresh_interval`` and join the addresses no alive member has: a
  headless service whose pods all restarted lists new addresses, and two halves that formed apart
  (every pod resolved the name before the others were ready) find each other. In a larger mesh gossip
  does that on its own (every new pod joins through the name itself).

A name that does not resolve is logged (once per error) and retried like an unanswered join; the
resolver (``system_resolver``: the system's, through ``getaddrinfo``, so ``/etc/resolv.conf`` and
search domains apply) and the sleep are injectable for tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from shepherd.proto.mesh_messages import Addr

__all__ = [
    "DNS_PREFIX",
    "DnsSeed",
    "DnsSeedConfig",
    "DnsSeeder",
    "DnsSeederStats",
    "Resolver",
    "is_dns_seed",
    "parse_dns_seed",
    "system_resolver",
]

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``resolve(name, port) -> [ip, ...]``: every address of the name (A and AAAA); raises ``OSError``."""


@dataclass(frozen=True, slots=True)
class DnsSeed:
    name: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.name}:{self.port}"


def is_dns_seed(text: str) -> bool:
    return text.strip().lower().startswith(DNS_PREFIX)


def parse_dns_seed(text: str, default_port: int) -> DnsSeed:
    """``dns:NAME`` or ``dns:NAME:PORT`` -> ``DnsSeed`` (``ValueError`` saying what is wrong)."""
    rest = text.strip()[len(DNS_PREFIX) :]
    name, sep, port_s = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    try:
        port = int(port_s) if sep else default_port
    except ValueError:
        raise ValueError(f"DNS seed {text!r}: bad port {port_s!r}") from None
    bare = name[:-1] if name.endswith(".") else name
    if not bare or len(bare) > 253 or not all(_LABEL.match(label) for label in bare.split(".")):
        raise ValueError(f"DNS seed {text!r}: {name!r} is not a DNS name (dns:NAME[:PORT])")
    if not 0 < port < 65536:
        raise ValueError(f"DNS seed {text!r}: port {port} out of range")
    return DnsSeed(name, port)


async def system_resolver(name: str, port: int) -> list[str]:
    """Every A and AAAA record of ``name`` (the system resolver), in the order it gave them."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, family=socket.AF_UNSPEC, type=socket.SOCK_DGRAM
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class DnsSeedConfig:
    initial_backoff: float = 1.0
    max_backoff: float = 30.0
    refresh_interval: float = 30.0
    small_mesh: int = 16
    resolve_timeout: float = 5.0


@dataclass(slots=True)
class DnsSeederStats:
    resolutions: int = 0
    resolve_failures: int = 0
    join_attempts: int = 0  # rounds that dialled at least one address
    joined_addresses: int = 0  # addresses that answered a join
    last_addresses: list[Addr] = field(default_factory=list)


class DnsSeeder:
    """The resolve-and-join loop of the DNS seeds (module doc). ``alive`` gives the addresses of the
    members this node holds alive (itself excluded), ``me`` its own gossip address, ``join`` pushes and
    pulls with each address and returns how many answered (``MeshRuntime.join``)."""

    def __init__(
        self,
        seeds: Sequence[DnsSeed],
        *,
        join: Callable[[Sequence[Addr]], Awaitable[int]],
        alive: Callable[[], Iterable[Addr]],
        me: Callable[[], Addr],
        resolve: Resolver = system_resolver,
        config: DnsSeedConfig | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.seeds = list(seeds)
        self.join = join
        self.alive = alive
        self.me = me
        self.resolve = resolve
        self.config = config or DnsSeedConfig()
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.stats = DnsSeederStats()
        self._backoff = self.config.initial_backoff
        self._warned: set[str] = set()

    async def addresses(self) -> list[Addr]:
        """Every address of every DNS seed (a seed that fails to resolve adds none)."""
        out: list[Addr] = []
        for seed in self.seeds:
            self.stats.resolutions += 1
            try:
                async with asyncio.timeout(self.config.resolve_timeout):
                    ips = await self.resolve(seed.name, seed.port)
            except (OSError, TimeoutError, UnicodeError) as e:
                self.stats.resolve_failures += 1
                msg = f"{seed}: {e or type(e).__name__}"
                if msg not in self._warned:
                    self._warned.add(msg)
                    log.warning("mesh: DNS seed %s does not resolve (yet): %s; retried", seed, e)
                continue
            out.extend((ip, seed.port) for ip in ips)
        addrs = list(dict.fromkeys(out))
        self.stats.last_addresses = addrs
        return addrs

    def joined(self) -> bool:
        return any(True for _ in self.alive())

    async def step(self) -> float:
        """One round: resolve, join what is new; returns how long to wait before the next one."""
        cfg = self.config
        was_joined = self.joined()
        alive = set(self.alive())
        if was_joined and len(alive) + 1 >= cfg.small_mesh:
            return cfg.refresh_interval  # a large mesh: gossip finds new members on its own
        me = self.me()
        new = [a for a in await self.addresses() if a != me and a not in alive]
        if new:
            self.stats.join_attempts += 1
            try:
                answered = await self.join(new)
            except Exception as e:  # the runtime is closing, or a dial failed as a whole
                log.debug("mesh: join through DNS seeds failed: %s", e)
                answered = 0
            self.stats.joined_addresses += answered
            if answered and not was_joined:
                log.info("mesh: joined through DNS seeds (%d of %d addresses answered)", answered, len(new))
        if self.joined():
            self._backoff = cfg.initial_backoff
            return cfg.refresh_interval
        delay = self._backoff * self.rng.uniform(0.8, 1.2)
        self._backoff = min(self._backoff * 2, cfg.max_backoff)
        return min(delay, cfg.max_backoff)

    async def run(self) -> None:
        """``step`` forever (until cancelled)."""
        while True:
            try:
                delay = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("mesh: DNS seed round failed")
                delay = self.config.max_backoff
            await self.sleep(delay)
