"""The mesh on a node: the registry bridge (both ways, no echo, dead owners, pinned config workers,
races), the policies' replicated indexes, the full index for a joiner, the mesh settings and dev PKI,
and two real ``MeshNode``s on loopback (in one event loop, real sockets, short intervals).

Replicas exchange state in memory (``outgoing_batches`` -> ``apply``) with a fake clock; the bridge's
local side is a fake registry with the real one's hook semantics. Waits are bounded polls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shepherd.auth.certs import certificate_identity
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.state import MeshState
from shepherd.node.app import build_app
from shepherd.node.cli import config_from_args
from shepherd.node.cluster.mesh_node import (
    RegistryBridge,
    attach_indexes,
    ensure_dev_pki,
    full_index_payloads,
    runtime_config,
    swim_config,
)
from shepherd.node.config import ConfigError, build_config
from shepherd.node.dispatch.kv_feed import feed_index_of
from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto.engine_types import worker_id
from tests.unit.mesh_fixtures import eventually, two_mesh_nodes

pytestmark = pytest.mark.timeout(60)

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeHealth:
    healthy: bool = True
    checked: bool = True


@dataclass
class FakeWorker:
    id: str
    url: str
    model: str
    health: FakeHealth = field(default_factory=FakeHealth)


class FakeRegistry:
    """``WorkerRegistry``'s hooks: ``on_added`` after the first check (an await), only if the worker is
    still there; ``on_removed`` before the client closes (an await)."""

    def __init__(self) -> None:
        self.workers: dict[str, FakeWorker] = {}
        self.on_added: Callable[[FakeWorker], None] | None = None
        self.on_removed: Callable[[FakeWorker], None] | None = None
        self.hold: asyncio.Event | None = None  # set: first checks wait for it
        self.adds: list[str] = []
        self.removes: list[str] = []

    def get(self, wid: str) -> FakeWorker | None:
        return self.workers.get(wid)

    async def add(self, url: str, model: str) -> FakeWorker:
        wid = worker_id(url)
        if wid in self.workers:
            return self.workers[wid]
        w = self.workers[wid] = FakeWorker(wid, url, model)
        self.adds.append(url)
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0)
        if self.on_added is not None and self.workers.get(wid) is w:
            self.on_added(w)
        return w

    async def remove(self, wid: str) -> FakeWorker | None:
        w = self.workers.pop(wid, None)
        if w is not None:
            self.removes.append(w.url)
            if self.on_removed is not None:
                self.on_removed(w)
        await asyncio.sleep(0)
        return w


@dataclass
class Node:
    state: MeshState[Replica]
    reg: FakeRegistry
    bridge: RegistryBridge

    async def api_add(self, url: str, model: str = MODEL) -> None:
        await self.reg.add(url, model)

    async def api_remove(self, url: str) -> None:
        await self.reg.remove(worker_id(url))


def node(
    name: str,
    clock: Clock,
    pinned: tuple[str, ...] = (),
    models: tuple[str, ...] = (MODEL,),
    trusted: Callable[[str], bool] | None = None,
) -> Node:
    st = MeshState(name, clock, new_index=make_replica)
    reg = FakeRegistry()
    br = RegistryBridge(
        st, reg, models=set(models), pinned={worker_id(u) for u in pinned}, ident=worker_id, trusted=trusted
    )
    reg.on_added = br.local_added
    reg.on_removed = br.local_removed
    return Node(st, reg, br)


def meet(*nodes: Node) -> None:
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.state.on_member_up(b.state.node)


async def settle(*nodes: Node) -> None:
    """Gossip until nothing moves and the bridges are idle (bounded)."""
    for _ in range(50):
        moved = False
        for n in nodes:
            for p in n.state.outgoing_batches(1100):
                moved = True
                for o in nodes:
                    if o is not n:
                        o.state.apply(p, n.state.node)
        for _ in range(20):
            await asyncio.sleep(0)
        if not moved and not any(n.bridge.busy for n in nodes):
            return
    raise AssertionError("the replicas did not settle")


def urls(n: Node) -> set[str]:
    return {w.url for w in n.reg.workers.values()}


W1, W2 = "grpc://10.0.0.1:50051", "grpc://10.0.0.2:50051"


async def test_added_anywhere_is_added_everywhere_without_echo() -> None:
    clock = Clock()
    a, b, c = node("a", clock), node("b", clock), node("c", clock)
    meet(a, b, c)
    await a.api_add(W1)
    await settle(a, b, c)
    assert urls(a) == urls(b) == urls(c) == {W1}
    assert a.bridge.stats.published_adds == 1
    assert b.bridge.stats.published_adds == c.bridge.stats.published_adds == 0  # no echo
    assert b.bridge.stats.applied_adds == c.bridge.stats.applied_adds == 1
    assert b.state.worker(worker_id(W1)) is not None
    assert b.state.worker(worker_id(W1)).owner == "a"  # type: ignore[union-attr]


async def test_a_node_with_auth_takes_no_worker_changes_from_an_open_control_plane() -> None:
    """d's control plane is open (anyone reaching it may add or remove workers); a and b have auth on and
    take none of d's changes, adds or removals, while c (auth off, no trust check) takes them all. A
    worker d re-adds or removes stays on a and b as it was."""
    clock = Clock()

    def trusted(name: str) -> bool:
        return name != "d"

    a, b = node("a", clock, trusted=trusted), node("b", clock, trusted=trusted)
    c, d = node("c", clock), node("d", clock)
    meet(a, b, c, d)
    await a.api_add(W1)
    await settle(a, b, c, d)
    assert urls(a) == urls(b) == urls(c) == urls(d) == {W1}
    await d.api_add(W2)  # an add through d's open control plane
    clock.t += 1
    await d.api_remove(W1)  # and a removal of a's worker
    await settle(a, b, c, d)
    assert urls(a) == urls(b) == {W1}
    assert urls(c) == urls(d) == {W2}
    assert a.bridge.stats.untrusted >= 2 and c.bridge.stats.untrusted == 0


async def test_a_change_left_dirty_after_the_bounded_rounds_is_resumed_on_tick() -> None:
    clock = Clock()
    a, b = node("a", clock), node("b", clock)
    meet(a, b)
    await a.api_add(W1)
    for p in a.state.outgoing_batches(1100):
        b.state.apply(p, "a")
    wid = worker_id(W1)
    for _ in range(20):  # let b's task finish, then mark the worker dirty with no task to take it
        await asyncio.sleep(0)
    b.reg.workers.pop(wid)  # out of step with the mesh, as if the rounds ran out mid-change
    b.bridge._dirty.add(wid)
    assert not b.bridge.busy and W1 not in urls(b)
    b.bridge.resume_leftovers()
    await settle(a, b)
    assert urls(b) == {W1}


async def test_removed_anywhere_is_removed_everywhere() -> None:
    clock = Clock()
    a, b, c = node("a", clock), node("b", clock), node("c", clock)
    meet(a, b, c)
    await a.api_add(W1)
    await a.api_add(W2)
    await settle(a, b, c)
    await c.api_remove(W1)  # removed on another node than the one that added it
    await settle(a, b, c)
    assert urls(a) == urls(b) == urls(c) == {W2}
    assert c.bridge.stats.published_removes == 1
    assert a.bridge.stats.published_removes == b.bridge.stats.published_removes == 0
    # and added again later: a fresh version beats the tombstone
    clock.t += 1
    await b.api_add(W1)
    await settle(a, b, c)
    assert urls(a) == urls(b) == urls(c) == {W1, W2}


async def test_dead_owner_workers_leave_every_node() -> None:
    clock = Clock()
    a, b, c = node("a", clock), node("b", clock), node("c", clock)
    meet(a, b, c)
    await a.api_add(W1)
    await b.api_add(W2)
    await settle(a, b, c)
    for n in (b, c):
        n.state.on_member_dead("a")
    await settle(b, c)
    assert urls(b) == urls(c) == {W2}


async def test_pinned_config_worker_survives_its_owner() -> None:
    """Every node configures W1; the last writer owns it. When that owner dies, the others keep their
    client (no flap: its cache affinity stays) and re-assert the worker on the next tick."""
    clock = Clock()
    a, b = node("a", clock, pinned=(W1,)), node("b", clock, pinned=(W1,))
    c = node("c", clock)  # does not configure it
    meet(a, b, c)
    await a.api_add(W1)
    clock.t += 0.01
    await b.api_add(W1)
    await settle(a, b, c)
    assert a.state.worker(worker_id(W1)).owner == "b"  # type: ignore[union-attr]
    for n in (a, c):
        n.state.on_member_dead("b")
    await settle(a, c)
    assert urls(a) == {W1} and a.reg.removes == []  # pinned here: kept
    assert urls(c) == set()  # not pinned there: gone with its owner...
    clock.t += 1
    a.state.tick()  # ...until a re-asserts it
    await settle(a, c)
    assert urls(c) == {W1}
    assert c.state.worker(worker_id(W1)).owner == "a"  # type: ignore[union-attr]


async def test_removing_a_pinned_worker_on_purpose_removes_it_everywhere() -> None:
    clock = Clock()
    a, b = node("a", clock, pinned=(W1,)), node("b", clock)
    meet(a, b)
    await a.api_add(W1)
    await settle(a, b)
    clock.t += 0.01
    await b.api_remove(W1)
    await settle(a, b)
    assert urls(a) == urls(b) == set()
    clock.t += 1
    a.state.tick()  # not re-asserted
    await settle(a, b)
    assert urls(a) == urls(b) == set()


async def test_models_a_node_does_not_serve_are_left_out() -> None:
    clock = Clock()
    a, b = node("a", clock, models=(MODEL, "other")), node("b", clock)
    meet(a, b)
    await a.api_add(W1, "other")
    await settle(a, b)
    assert urls(b) == set() and b.bridge.stats.skipped_models == 1
    assert b.state.worker(worker_id(W1)) is not None  # still in the replicated registry


async def test_removal_while_the_local_add_is_in_flight_wins() -> None:
    clock = Clock()
    a, b = node("a", clock), node("b", clock)
    meet(a, b)
    b.reg.hold = asyncio.Event()  # b's first check of the worker hangs
    await a.api_add(W1)
    await settle_gossip_only(a, b)
    assert worker_id(W1) in b.reg.workers and b.bridge.busy
    clock.t += 0.01
    await a.api_remove(W1)
    await settle_gossip_only(a, b)
    b.reg.hold.set()
    await settle(a, b)
    assert urls(a) == urls(b) == set()
    assert a.state.worker(worker_id(W1)) is None  # b did not publish the add it applied


async def settle_gossip_only(*nodes: Node) -> None:
    for _ in range(10):
        for n in nodes:
            for p in n.state.outgoing_batches(1100):
                for o in nodes:
                    if o is not n:
                        o.state.apply(p, n.state.node)
        for _ in range(20):
            await asyncio.sleep(0)


async def test_health_is_published_and_combined() -> None:
    clock = Clock()
    a, b, c = node("a", clock), node("b", clock), node("c", clock)
    meet(a, b, c)
    await a.api_add(W1)
    await settle(a, b, c)
    wid = worker_id(W1)
    for n in (a, b):
        n.reg.workers[wid].health.healthy = False
        n.bridge.publish_health()
    c.bridge.publish_health()  # c still sees it healthy
    await settle(a, b, c)
    view = c.state.health_view(wid)
    assert (view.healthy, view.unhealthy, view.local) == (1, 2, True)
    assert not c.state.routable(wid)  # the mesh's majority
    unchecked = node("d", clock)
    await unchecked.api_add(W2)
    unchecked.reg.workers[worker_id(W2)].health.checked = False
    unchecked.bridge.publish_health()
    assert unchecked.state.health_view(worker_id(W2)).local is None  # nothing known yet: not published


# ---- indexes ----------------------------------------------------------------------------------------


def test_the_policy_the_kv_feed_and_replication_share_one_index() -> None:
    clock = Clock()
    a, b = MeshState("a", clock, new_index=make_replica), MeshState("b", clock, new_index=make_replica)
    pa, pb = CacheAware(clock=clock), CacheAware(clock=clock)
    assert attach_indexes({MODEL: pa, "rr": object()}, a) == [MODEL]
    attach_indexes({MODEL: pb}, b)
    assert feed_index_of(pa, MODEL) is a.index(MODEL) is pa.index(MODEL)
    ids = list(range(1000, 1400))
    workers = [WorkerView("w1", "u1"), WorkerView("w2", "u2")]
    chosen = pa.pick(workers, RouteRequest(MODEL, ids))
    assert chosen is not None
    for p in a.index_batches():
        b.apply(p, "a")
    assert pb.index(MODEL).match(ids) == {chosen.id: 400}
    # the follow-up turn on node b goes where the prefix is, though the holder is busier there
    busy = [WorkerView(w.id, w.url, in_flight=1 if w.id == chosen.id else 0) for w in workers]
    follow_up = RouteRequest(MODEL, [*ids, *range(5000, 5100)])
    assert CacheAware(clock=clock).pick(busy, follow_up).id != chosen.id  # type: ignore[union-attr]
    again = pb.pick(busy, follow_up)
    assert again is not None and again.id == chosen.id


def test_full_index_for_a_joiner() -> None:
    clock = Clock()
    a, joiner = MeshState("a", clock, new_index=make_replica), MeshState("j", clock, new_index=make_replica)
    ix = a.index(MODEL)
    for k in range(50):
        ix.insert(list(range(k * 10_000, k * 10_000 + 320)), f"w{k % 3}", clock())
    payloads = full_index_payloads(a)
    assert payloads and all(len(p) <= a.cfg.udp_payload_bytes for p in payloads)
    for p in payloads:
        joiner.apply(p, "a")
    jx = joiner.index(MODEL)
    assert jx.live_blocks == ix.live_blocks
    assert {w: jx.worker_blocks(w) for w in jx.workers} == {w: ix.worker_blocks(w) for w in ix.workers}


# ---- settings --------------------------------------------------------------------------------------


def mesh(**kw: object) -> dict[str, object]:
    return {"mesh_port": 7946, "mesh_name": "n1", "mesh_dev_pki": "/tmp/unused", **kw}


def test_mesh_off_by_default_and_security_required() -> None:
    cfg = build_config({}, {})
    assert cfg.mesh_port is None and cfg.mesh_name is None
    with pytest.raises(ConfigError, match="mesh-dev-pki"):
        build_config({}, {"mesh_port": 7946})
    with pytest.raises(ConfigError, match="go together"):
        build_config({}, {"mesh_port": 7946, "mesh_cert": "c.pem", "mesh_keys": ["x"]})
    with pytest.raises(ConfigError, match="need mesh_port"):
        build_config({}, {"mesh_seeds": ["a:1"]})
    with pytest.raises(ConfigError, match="mesh_advertise"):
        build_config({}, mesh(mesh_bind="0.0.0.0"))
    with pytest.raises(ConfigError, match="invalid node name"):
        build_config({}, mesh(mesh_name="bad name"))
    with pytest.raises(ConfigError, match="base64"):
        build_config({}, mesh(mesh_keys=["not base64!"]))
    ok = build_config(
        {"mesh_keys": Keyring.format_file([bytes(32)]).split()},
        {"mesh_port": 7946, "mesh_cert": "c", "mesh_key": "k", "mesh_ca": "ca"},
    )
    assert ok.mesh_name  # the host name


def test_yaml_keys_and_runtime_settings() -> None:
    cfg = build_config(
        mesh(mesh_seeds="node-a", mesh_advertise="10.0.0.5", mesh_probe_interval=0.2, mesh_suspicion_mult=3),
        {},
    )
    rc = runtime_config(cfg)
    assert rc.seeds == (("node-a", 7946),)
    assert (rc.advertise_host, rc.advertise_port) == ("10.0.0.5", 7946)
    sw = swim_config(cfg)
    assert (sw.probe_interval, sw.probe_timeout, sw.suspicion_mult) == (0.2, 0.1, 3)
    assert sw.nack_timeout < sw.probe_timeout
    rc0 = runtime_config(build_config(mesh(mesh_port=0, mesh_advertise="10.0.0.5"), {}))
    assert rc0.advertise_port is None  # the port bound


def test_join_subcommand_is_serve_with_seeds() -> None:
    cfg = config_from_args(
        ["join", "node-a:39527", "node-c", "--port", "30001", "--mesh-dev-pki", "/tmp/x", "--mesh-name", "b"]
    )
    assert cfg.mesh_seeds == ("node-a:39527", "node-c") and cfg.mesh_port == 7946 and cfg.port == 30001
    cfg = config_from_args(
        ["join", "a", "--mesh-port", "39527", "--mesh-dev-pki", "/tmp/x", "--mesh-name", "b"]
    )
    assert cfg.mesh_port == 39527 and runtime_config(cfg).seeds == (("a", 39527),)
    assert config_from_args(["serve"]).mesh_port is None


def test_dev_pki_is_shared_through_its_directory(tmp_path: Path) -> None:
    f1, k1 = ensure_dev_pki(tmp_path, "n1")
    f2, k2 = ensure_dev_pki(tmp_path, "n2")
    assert f1.ca == f2.ca and k1 == k2
    assert certificate_identity(f2.cert.read_bytes()) == "n2"
    key = Keyring.from_file(k1).primary
    ensure_dev_pki(tmp_path, "n1")  # again: same CA, same key
    assert Keyring.from_file(k1).primary == key
    assert (k1.stat().st_mode & 0o077) == 0


async def test_mesh_routes_answer_404_without_a_mesh() -> None:
    from shepherd.node.dispatch.gateway import Gateway

    gw = Gateway(build_config({}, {"tokenizer_workers": 0}))
    try:
        async with TestClient(TestServer(build_app(gw))) as http:
            for path in ("/mesh/members", "/mesh/state"):
                r = await http.get(path)
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "mesh_disabled"
    finally:
        await gw.close()


# ---- two real nodes -------------------------------------------------------------------------------


async def test_two_mesh_nodes_on_loopback(tmp_path: Path) -> None:
    fast: dict[str, object] = {"mesh_probe_interval": 0.2, "mesh_gossip_interval": 0.05}
    async with two_mesh_nodes(tmp_path, MODEL, extra=fast) as (gw_a, a, gw_b, b):
        url = "grpc://127.0.0.1:9"
        await gw_a.registry.add(url, MODEL)
        gb = gw_b
        await eventually(lambda: gb.registry.find(url) is not None, what="the worker on b")
        # a routing decision on a reaches b's index
        ids = list(range(2000, 2320))
        w = gw_a.registry.find(url)
        assert w is not None
        pa = gw_a.policy_for(MODEL)
        assert pa.pick([w.view()], RouteRequest(MODEL, ids)) is not None
        ib = feed_index_of(gw_b.policy_for(MODEL), MODEL)
        assert ib is not None
        await eventually(lambda: ib.match(ids) == {w.id: 320}, what="a's decision in b's index")
        assert a.index_datagrams_out >= 1
        # the HTTP views
        async with TestClient(TestServer(build_app(gw_b, b))) as http:
            members = await (await http.get("/mesh/members")).json()
            assert {m["name"]: m["state"] for m in members["members"]} == {"a": "alive", "b": "alive"}
            st = await (await http.get("/mesh/state")).json()
            (row,) = st["workers"]
            assert (row["url"], row["owner"], row["local"]) == (url, "a", True)
            assert st["index"][MODEL]["workers"] == {w.id: 20}
            assert st["members"] == {"total": 2, "alive": 2}
            assert st["gossip"]["udp_bytes_in"] > 0 and st["runtime"]["joined"]
            assert [d["op"] for d in st["recent_deltas"] if d["worker"] == w.id] == ["add"]
            text = await (await http.get("/metrics")).text()
            assert 'smg_mesh_members{state="alive"} 2.0' in text
            assert "smg_mesh_delta_lag_seconds_count" in text
            # the replay guard's refusals, by reason, where an operator (or a test from outside) sees them
            assert 'smg_mesh_replays_refused_total{reason="duplicate"} 0.0' in text
        # a leaves: b forgets a's worker
        await a.close()
        await eventually(lambda: gb.registry.find(url) is None, what="a's worker gone from b")
        assert [m["state"] for m in b.members() if m["name"] == "a"] == ["left"]
