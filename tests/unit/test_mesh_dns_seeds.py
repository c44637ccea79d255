"""DNS seeds (``shepherd.mesh.dns_seeds``): parsing, the resolve-and-join loop with an injected resolver
(back-off until joined, every A/AAAA address, re-resolving while the mesh is small), and two real
runtimes on loopback joining through a name (``localhost``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from shepherd.auth.certs import client_context, server_context, write_dev_pki
from shepherd.mesh.dns_seeds import DnsSeed, DnsSeedConfig, DnsSeeder, is_dns_seed, parse_dns_seed
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.node.config import ConfigError, build_config
from shepherd.proto.mesh_messages import Addr
from tests.unit.mesh_fixtures import FAST, KEY, eventually

pytestmark = pytest.mark.timeout(60)

ME: Addr = ("10.0.0.1", 39527)


def test_parse() -> None:
    assert parse_dns_seed("dns:shepherd-mesh.ns.svc:39527", 7946) == DnsSeed("shepherd-mesh.ns.svc", 39527)
    assert parse_dns_seed("dns:shepherd-mesh", 7946) == DnsSeed("shepherd-mesh", 7946)
    assert str(DnsSeed("a.b", 1)) == "dns:a.b:1"
    assert is_dns_seed("DNS:x") and not is_dns_seed("10.0.0.1:7946")
    for bad in ("dns:", "dns:bad name", "dns:a..b", "dns:-a", "dns:a:0", "dns:a:port", "dns:a:70000"):
        with pytest.raises(ValueError):
            parse_dns_seed(bad, 7946)


def test_the_node_config_takes_dns_seeds_and_refuses_bad_ones(tmp_path: object) -> None:
    base = {"mesh_port": 39527, "mesh_dev_pki": str(tmp_path), "mesh_name": "n1"}
    cfg = build_config({**base, "mesh_seeds": ["dns:shepherd-mesh.ns.svc:39527", "10.0.0.2"]}, {})
    assert cfg.mesh_seeds == ("dns:shepherd-mesh.ns.svc:39527", "10.0.0.2")
    with pytest.raises(ConfigError, match="not a DNS name"):
        build_config({**base, "mesh_seeds": ["dns:no such name"]}, {})


class World:
    """The resolver, the membership and the joins a ``DnsSeeder`` sees, played by the test."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.fail: Exception | None = None
        self.alive: set[Addr] = set()
        self.answering: set[Addr] = set()  # addresses whose join succeeds (they become alive)
        self.joins: list[list[Addr]] = []
        self.resolved: list[str] = []

    async def resolve(self, name: str, port: int) -> list[str]:
        self.resolved.append(name)
        if self.fail is not None:
            raise self.fail
        if name not in self.records:
            raise OSError(-2, "Name or service not known")
        return list(self.records[name])

    async def join(self, addrs: Sequence[Addr]) -> int:
        self.joins.append(list(addrs))
        ok = [a for a in addrs if a in self.answering]
        self.alive.update(ok)
        return len(ok)

    def seeder(self, *seeds: DnsSeed, **cfg: float) -> DnsSeeder:
        return DnsSeeder(
            seeds,
            join=self.join,
            alive=lambda: set(self.alive),
            me=lambda: ME,
            resolve=self.resolve,
            config=DnsSeedConfig(**cfg),  # type: ignore[arg-type]
            rng=random.Random(1),
        )


async def test_backs_off_until_the_name_resolves_and_a_member_answers() -> None:
    w = World()
    s = w.seeder(DnsSeed("mesh.svc", 39527), initial_backoff=1.0, max_backoff=8.0, refresh_interval=30.0)
    delays = [await s.step() for _ in range(6)]  # the name does not resolve yet
    assert w.joins == []
    assert all(0.8 * b <= d <= min(1.2 * b, 8.0) for d, b in zip(delays, (1, 2, 4, 8, 8, 8), strict=True))
    assert s.stats.resolve_failures == 6
    # the name appears with this node's own address and two pods (A and AAAA); none answers yet
    w.records["mesh.svc"] = ["10.0.0.1", "10.0.0.2", "fd00::3"]
    assert await s.step() <= 8.0
    assert w.joins[-1] == [("10.0.0.2", 39527), ("fd00::3", 39527)]  # every record but itself
    w.answering = {("fd00::3", 39527)}
    assert await s.step() == 30.0  # joined: the next round is the slow refresh
    assert w.alive == {("fd00::3", 39527)}
    # back-off reset: if the mesh is lost again, retries start from the initial back-off
    w.alive.clear()
    w.answering.clear()
    assert await s.step() <= 1.2


async def test_re_resolves_while_small_and_joins_only_new_addresses() -> None:
    w = World()
    w.records["mesh.svc"] = ["10.0.0.1", "10.0.0.2"]
    w.answering = {("10.0.0.2", 39527), ("10.0.0.9", 39527)}
    s = w.seeder(DnsSeed("mesh.svc", 39527), refresh_interval=30.0, small_mesh=3)
    assert await s.step() == 30.0
    # the headless service's pods restarted: a new address appears; the known one is not dialled again
    w.records["mesh.svc"] = ["10.0.0.2", "10.0.0.9"]
    assert await s.step() == 30.0
    assert w.joins[-1] == [("10.0.0.9", 39527)]
    # a mesh of small_mesh members: no more resolving (gossip finds new members)
    before = len(w.resolved)
    assert await s.step() == 30.0
    assert len(w.resolved) == before


async def test_several_names_and_a_timeout_are_survived() -> None:
    w = World()
    w.records = {"a.svc": ["10.0.0.2"], "b.svc": ["10.0.0.3", "10.0.0.2"]}
    w.answering = {("10.0.0.3", 1)}
    s = w.seeder(DnsSeed("a.svc", 1), DnsSeed("b.svc", 1), DnsSeed("missing.svc", 1))
    await s.step()
    assert w.joins == [[("10.0.0.2", 1), ("10.0.0.3", 1)]]  # deduplicated, both names, the missing skipped
    w.fail = TimeoutError()
    w.alive.clear()
    w.answering.clear()
    assert await s.step() > 0  # a resolver timeout is a failed round, not an exception


async def test_run_loops_with_the_delays_step_returns() -> None:
    w = World()
    slept: list[float] = []

    async def sleep(d: float) -> None:
        slept.append(d)
        if len(slept) == 4:
            raise asyncio.CancelledError

    s = DnsSeeder(
        [DnsSeed("mesh.svc", 1)],
        join=w.join,
        alive=lambda: set(w.alive),
        me=lambda: ME,
        resolve=w.resolve,
        sleep=sleep,
        config=DnsSeedConfig(initial_backoff=0.5, max_backoff=1.0),
        rng=random.Random(2),
    )
    with pytest.raises(asyncio.CancelledError):
        await s.run()
    assert len(slept) == 4 and all(0 < d <= 1.0 for d in slept)


async def test_two_runtimes_join_through_a_name(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``localhost`` resolves (system resolver) to the loopback address the first runtime is on."""
    pki = write_dev_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2"])
    rts: list[MeshRuntime] = []
    try:
        for name in ("n1", "n2"):
            dns = (DnsSeed("localhost", rts[0].address[1]),) if rts else ()
            rt = MeshRuntime(
                MeshRuntimeConfig(
                    name=name,
                    bind_host="127.0.0.1",
                    bind_port=0,
                    swim=FAST,
                    dns_seeds=dns,
                    dns=DnsSeedConfig(initial_backoff=0.2, max_backoff=1.0),
                ),
                Keyring([KEY]),
                server_context(pki[name]),
                client_context(pki[name]),
                rng=random.Random(name),
            )
            await rt.start()
            rts.append(rt)
        await eventually(
            lambda: all(rt.member_state(n) is not None for rt in rts for n in ("n1", "n2")),
            what="n2 joined n1 through the name",
        )
        assert rts[1].dns_seeder is not None and rts[1].dns_seeder.stats.joined_addresses >= 1
    finally:
        for rt in rts:
            await rt.abort()
