"""API keys mesh-wide: node stores kept in step through the control-plane document (``KeySync``).

Nodes here are (``ConfigDoc``, ``MemoryKeyStore``, ``KeySync``, ``Authenticator``) exchanging the
document's updates by hand, in any order, duplicated or lost and repaired; one test goes through
``MeshState`` (gossip payloads and push-pull) and one through the admin API of an in-process app."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import event, given, settings
from hypothesis import strategies as st

from shepherd.auth.config import AuthConfig, auth_config
from shepherd.auth.keys import ApiKeyRecord, KeyStore, MemoryKeyStore, bootstrap_records, hash_key
from shepherd.auth.keys import create_key as _create_key
from shepherd.auth.middleware import Authenticator, AuthFailure
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_config import ApiKeyRecord as DocKeyRecord
from shepherd.mesh.state_config import ConfigDoc
from shepherd.node.api import keys as api_keys
from shepherd.node.api.common import GATEWAY, error_middleware
from shepherd.node.api.keys import KEY_SYNC
from shepherd.node.api.mesh import MESH
from shepherd.node.cluster.key_sync import KeySync, from_doc, to_doc
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.metrics import NodeMetrics
from shepherd.policies.prefix_replica_native import make_replica
from tests.unit.test_auth_middleware import whoami

KEYS_CFG = auth_config({"mode": "api_key"})


def create_key(store: KeyStore, name: str, *args: Any, **kw: Any) -> tuple[str, ApiKeyRecord]:
    """A key minted by an authenticated admin (only those go mesh-wide: test_auth_key_sync_rule)."""
    return _create_key(store, name, *args, minted_authenticated=True, **kw)


@dataclass
class Node:
    doc: ConfigDoc
    store: MemoryKeyStore
    sync: KeySync
    authn: Authenticator
    inbox: list[bytes] = field(default_factory=list)

    def take(self) -> bytes | None:
        return self.doc.take_delta()

    def receive(self, update: bytes) -> None:
        if self.doc.apply_update(update):  # what MeshState does: subscribers on a change from a peer
            self.sync.on_config_changed(self.doc)

    def accepts(self, key: str) -> bool:
        try:
            self.authn.api_key(key)
        except AuthFailure:
            return False
        return True

    def revoked(self) -> set[str]:
        return {r.id for r in self.store.records() if r.revoked}


def node(i: int, cfg: AuthConfig = KEYS_CFG, environ: dict[str, str] | None = None) -> Node:
    doc = ConfigDoc(client_id=i + 1)
    store = MemoryKeyStore(bootstrap_records(cfg, environ or {}))
    boot = {r.id for r in store.records()}
    sync = KeySync(store, doc, local_ids=boot, clock=lambda: 1000.0)
    return Node(doc, store, sync, Authenticator(cfg, store, None))


def flood(nodes: list[Node], rounds: int = 4) -> None:
    """Every node's fresh delta to every other node, until nothing changes (bounded)."""
    for _ in range(rounds):
        ups = [(i, n.take()) for i, n in enumerate(nodes)]
        if all(u is None for _, u in ups):
            return
        for i, u in ups:
            if u is not None:
                for j, other in enumerate(nodes):
                    if j != i:
                        other.receive(u)


def repair(nodes: list[Node]) -> None:
    """Push-pull between every pair (state vectors), as the mesh's TCP sync does."""
    for a in nodes:
        for b in nodes:
            if a is not b:
                b.receive(a.doc.update_since(b.doc.state_vector()))


def test_created_on_one_node_is_accepted_on_the_others_and_only_digests_travel() -> None:
    a, b, c = node(0), node(1), node(2)
    key, rec = create_key(a.store, "ci", "user", tenant="team-a", models=["qwen3"], now=5.0)
    delta = a.take()
    assert delta is not None and key.encode() not in delta and key[-12:].encode() not in delta
    b.receive(delta)
    relay = b.take()  # b relays what changed it; c learns through b
    assert relay is not None
    c.receive(relay)
    for n in (a, b, c):
        who = n.authn.api_key(key)
        assert who.principal.tenant == "team-a" and who.principal.role == "user"
        assert n.store.get(rec.id) == rec
    assert c.doc.get_api_key(rec.id) == to_doc(rec) and key not in str(c.doc.to_py())


def test_revoked_on_any_node_is_refused_on_every_node() -> None:
    nodes = [node(i) for i in range(3)]
    key, rec = create_key(nodes[0].store, "ci")
    flood(nodes)
    assert all(n.accepts(key) for n in nodes)
    assert nodes[1].store.revoke(rec.id) is not None
    flood(nodes)
    assert not any(n.accepts(key) for n in nodes)
    assert all(n.store.get(rec.id).revoked for n in nodes)  # type: ignore[union-attr]
    (rev,) = nodes[2].doc.revocations()
    assert (rev.key_hash, rev.key_id, rev.revoked_at) == (rec.digest, rec.id, 1000.0)
    assert nodes[2].doc.get_api_key(rec.id).disabled  # type: ignore[union-attr]


@pytest.mark.parametrize("order", ["revoke-first", "reput-first", "together"])
def test_revocation_wins_over_a_concurrent_reput(order: str) -> None:
    """b revokes while c (which has not seen it) writes the record again, unrevoked: whichever write of
    the record's map key wins, the key stays revoked everywhere."""
    a, b, c = node(0), node(1), node(2)
    key, rec = create_key(a.store, "ci")
    flood([a, b, c])
    b.store.revoke(rec.id)
    c.doc.set_api_key(DocKeyRecord(rec.id, rec.digest, "", "user", "ci-renamed", rec.created))
    ub, uc = b.take(), c.take()
    assert ub is not None and uc is not None
    if order == "revoke-first":
        a.receive(ub)
        a.receive(uc)
    elif order == "reput-first":
        a.receive(uc)
        a.receive(ub)
    else:  # a learns both at once (a full sync): it never saw the revoked record on its own
        merged = ConfigDoc(client_id=99)
        merged.apply_update(ub)
        merged.apply_update(uc)
        a.receive(merged.update_since(None))
    repair([a, b, c])
    for n in (a, b, c):
        assert not n.accepts(key)
        assert n.store.get(rec.id).revoked  # type: ignore[union-attr]
        assert n.doc.find_api_key(key).disabled  # type: ignore[union-attr]


def test_bootstrap_keys_stay_local_and_do_not_fight() -> None:
    shared, other = "sk-smg-shared-bootstrap-0000000000000000", "sk-smg-other-bootstrap-00000000000000000"
    cfg = auth_config({"mode": "api_key", "admin_key_env": ["BOOT"]})
    a, b = node(0, cfg, {"BOOT": shared}), node(1, cfg, {"BOOT": shared})
    c = node(2, cfg, {"BOOT": other})  # the same id (boot-env-0), another key
    user_key, _ = create_key(c.store, "u")
    flood([a, b, c])
    repair([a, b, c])
    assert a.doc.api_keys() == b.doc.api_keys() == c.doc.api_keys()  # only the created key
    assert [r.key_id for r in a.doc.api_keys()] != ["boot-env-0"] and len(a.doc.api_keys()) == 1
    assert a.accepts(shared) and b.accepts(shared) and c.accepts(other)
    assert not a.accepts(other) and not c.accepts(shared)
    assert all(n.accepts(user_key) for n in (a, b, c))
    # revoking a bootstrap key revokes that key (by digest) where it is configured, not the id elsewhere
    a.store.revoke("boot-env-0")
    flood([a, b, c])
    assert not a.accepts(shared) and not b.accepts(shared) and c.accepts(other)
    # a node that restarts with the revoked key configured learns the revocation again
    a2 = node(3, cfg, {"BOOT": shared})
    a2.sync.publish_all()
    a2.receive(b.doc.update_since(None))
    assert not a2.accepts(shared)


def test_records_without_a_usable_role_or_digest_are_skipped() -> None:
    n = node(0)
    n.receive(_doc_with(DocKeyRecord("k-root", hash_key("x"), role="root")))
    n.receive(_doc_with(DocKeyRecord("k-bad", "nothex", role="user")))
    assert n.store.records() == [] and n.sync.stats.skipped == 2
    n.sync.pull()  # counted once per record
    assert n.sync.stats.skipped == 2
    assert from_doc(DocKeyRecord("k", hash_key("y").upper(), tenant="")) == ApiKeyRecord(
        id="k", name="", role="user", digest=hash_key("y"), tenant=None, hint="..."
    )


def _doc_with(rec: DocKeyRecord) -> bytes:
    d = ConfigDoc()  # a random Yjs client id: a writer of its own
    d.set_api_key(rec)
    return d.update_since(None)


def test_pull_applies_only_what_changes_the_store() -> None:
    a, b = node(0), node(1)
    create_key(a.store, "ci")
    flood([a, b])
    assert b.sync.stats.applied == 1
    b.sync.pull()
    b.sync.on_config_changed(b.doc)
    assert b.sync.stats.applied == 1  # nothing new: the store (and the principal cache) untouched
    assert a.sync.stats.applied == 0  # no echo: a never re-applies its own key


# ---- any order of operations and deliveries ------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["create", "revoke", "revoke", "reput", "reput", "deliver", "deliver", "deliver", "drop"]
        ),
        st.integers(0, 2),  # node
        st.integers(0, 2),  # key slot (0 and 1 exist from the start; 2 when created)
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, seed=st.integers(0, 1 << 30))
def test_revoked_stays_revoked_and_nodes_converge_whatever_the_order(
    ops: list[tuple[str, int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    nodes = [node(i) for i in range(3)]
    queue: list[tuple[int, bytes]] = []  # (destination, update)

    def send(i: int) -> None:
        u = nodes[i].take()
        if u is not None:
            queue.extend((j, u) for j in range(3) if j != i for _ in range(rng.choice([1, 1, 2])))
            rng.shuffle(queue)

    made = {k: create_key(nodes[k].store, f"k{k}", now=float(k)) for k in (0, 1)}  # slot -> (key, record)
    send(0)
    send(1)
    ever_revoked: set[str] = set()
    reput_revoked = False
    seen_revoked: list[set[str]] = [set() for _ in nodes]
    for op, i, k in ops:
        n = nodes[i]
        if op == "create" and k not in made:
            made[k] = create_key(n.store, f"k{k}", now=float(k))
        elif op == "revoke" and k in made and n.store.get(made[k][1].id) is not None:
            n.store.revoke(made[k][1].id)
            ever_revoked.add(made[k][1].id)
        elif op == "reput" and k in made:  # another writer puts the key's record back, unrevoked: i learns it
            rec = made[k][1]
            reput_revoked |= rec.id in ever_revoked
            n.receive(_doc_with(DocKeyRecord(rec.id, rec.digest, "", "user", f"again{i}", rec.created)))
        elif op == "deliver" and queue:
            j, u = queue.pop()
            nodes[j].receive(u)
        elif op == "drop" and queue:
            queue.pop()  # lost: push-pull repairs it below
        send(i)
        for s, m in zip(seen_revoked, nodes, strict=True):  # once revoked on a node, revoked there for good
            assert s <= m.revoked()
            s |= m.revoked()
    if reput_revoked:
        event("a revoked key was re-put")
    for j, u in queue:
        nodes[j].receive(u)
    repair(nodes)
    exports = [n.store.export() for n in nodes]
    assert exports[0] == exports[1] == exports[2]
    assert all(n.revoked() == ever_revoked for n in nodes)
    for key, rec in made.values():
        assert all(n.accepts(key) == (rec.id not in ever_revoked) for n in nodes)


# ---- through MeshState, and through the admin API --------------------------------------------------


def test_through_mesh_state_gossip_and_push_pull() -> None:
    states = [MeshState(name, lambda: 1000.0, new_index=make_replica) for name in ("a", "b", "c")]
    stores = [MemoryKeyStore() for _ in states]
    syncs = [KeySync.attach(st_, s) for st_, s in zip(stores, states, strict=True)]
    key, rec = create_key(stores[0], "ci", tenant="t")
    for p in states[0].broadcasts(1400):  # gossip: a's payloads reach b
        states[1].on_user(p, "a")
    assert stores[1].get(rec.id) == rec and stores[2].get(rec.id) is None
    states[2].merge_remote_state(states[1].local_state())  # push-pull: c from b
    assert stores[2].get(rec.id) == rec
    stores[2].revoke(rec.id)
    for p in states[2].broadcasts(1400):
        states[0].on_user(p, "c")
    assert stores[0].get(rec.id).revoked and not stores[1].get(rec.id).revoked  # type: ignore[union-attr]
    states[1].merge_remote_state(states[0].local_state())
    assert stores[1].get(rec.id).revoked  # type: ignore[union-attr]
    assert syncs[0].stats.published == 1 and syncs[2].stats.revocations_published == 1
    assert key not in repr([s.snapshot() for s in states])


async def test_admin_api_on_a_meshed_node_writes_the_document() -> None:
    admin = "sk-smg-admin-key-for-sync-tests-000000000"
    cfg = NodeConfig(auth=auth_config({"mode": "api_key", "admin_key_sha256": [hash_key(admin)]}))
    gw = SimpleNamespace(cfg=cfg, metrics=NodeMetrics(), in_flight=0)
    state = MeshState("a", lambda: 1000.0, new_index=make_replica)
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app[MESH] = cast(MeshNode, SimpleNamespace(state=state))
    app.add_routes([web.get("/v1/models", whoami)])
    api_keys.install(app)
    h = {"Authorization": f"Bearer {admin}"}
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/admin/keys", json={"name": "ci", "models": ["qwen3"]}, headers=h)
        assert r.status == 201
        made: dict[str, Any] = await r.json()
        doc_rec = state.config.get_api_key(made["id"])
        assert (
            doc_rec is not None and doc_rec.key_hash == hash_key(made["key"]) and doc_rec.models == ("qwen3",)
        )
        assert state.config.get_api_key("boot-sha-0") is None  # the bootstrap key stays local
        assert (await client.delete(f"/admin/keys/{made['id']}", headers=h)).status == 200
        assert hash_key(made["key"]) in state.config.revoked_key_hashes()
        # a key a peer created arrives through the document
        peer = ConfigDoc(client_id=77)
        peer_key, peer_rec = create_key(MemoryKeyStore(), "from-b")
        peer.set_api_key(to_doc(peer_rec))
        state.merge_remote_state(_push_pull_of(peer))
        r = await client.get("/v1/models", headers={"Authorization": f"Bearer {peer_key}"})
        assert r.status == 200 and (await r.json())["subject"] == peer_rec.id
        sync = app[KEY_SYNC]
        assert sync is not None and sync.stats.applied == 1


def _push_pull_of(doc: ConfigDoc) -> bytes:
    """A peer's push-pull state holding only its document."""
    other = MeshState("b", lambda: 1000.0, new_index=make_replica)
    other.config.apply_update(doc.update_since(None))
    return other.local_state()
