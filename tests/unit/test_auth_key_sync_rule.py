"""Who may put API keys into the mesh (``KeySync``'s publish / accept rule), on the real components: the
pycrdt control-plane document, the key store, the authenticator and the admin API of an in-process app.

The attack: a node whose control plane is unauthenticated (anyone reaching it is an admin) mints a key;
before the rule it went into the replicated document and the nodes with auth on accepted it. Now such a
node publishes nothing, and a node with auth on honours only records minted by an authenticated admin.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shepherd.auth.config import auth_config
from shepherd.auth.keys import MemoryKeyStore, create_key, hash_key
from shepherd.auth.middleware import Authenticator, AuthFailure
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_config import ConfigDoc
from shepherd.node.api import keys as api_keys
from shepherd.node.api.common import GATEWAY, error_middleware
from shepherd.node.api.keys import KEY_SYNC
from shepherd.node.api.mesh import MESH
from shepherd.node.cluster.key_sync import KeySync, to_doc
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.metrics import NodeMetrics
from shepherd.policies.prefix_replica_native import make_replica
from tests.unit.test_auth_middleware import whoami

ADMIN = "sk-smg-admin-key-for-the-rule-tests-0000000"
KEYS_ON = auth_config({"mode": "api_key", "admin_key_sha256": [hash_key(ADMIN)]})


def accepts(store: MemoryKeyStore, key: str) -> bool:
    try:
        Authenticator(KEYS_ON, store, None).api_key(key)
    except AuthFailure:
        return False
    return True


def test_an_unauthenticated_node_publishes_nothing() -> None:
    doc = ConfigDoc(client_id=1)
    store = MemoryKeyStore()
    KeySync(store, doc, publish=False)
    _, rec = create_key(store, "anon")  # what an anonymous admin mints
    _, marked = create_key(store, "marked", minted_authenticated=True)  # even a marked one stays local
    store.revoke(rec.id)
    assert doc.api_keys() == [] and doc.revoked_key_hashes() == set()
    assert doc.take_delta() is None  # nothing to gossip
    assert store.get(marked.id) is not None


def test_nodes_with_auth_refuse_records_not_minted_by_an_authenticated_admin() -> None:
    doc = ConfigDoc(client_id=2)
    store = MemoryKeyStore()
    sync = KeySync(store, doc, require_authenticated=True)
    scratch = MemoryKeyStore()
    anon_key, anon = create_key(scratch, "from-an-open-node")  # an old or misconfigured node wrote it
    good_key, good = create_key(scratch, "from-an-admin", minted_authenticated=True)
    doc.set_api_key(to_doc(anon))
    doc.set_api_key(to_doc(good))
    sync.pull()
    assert not accepts(store, anon_key) and store.get(anon.id) is None
    assert accepts(store, good_key)
    assert sync.stats.unattested == 1
    # a node with auth off everywhere takes what it is given (it authenticates no one anyway)
    lax = MemoryKeyStore()
    KeySync(lax, doc).pull()
    assert lax.get(anon.id) is not None


async def _mint(cfg: NodeConfig, state: MeshState[Any], headers: dict[str, str]) -> dict[str, Any]:
    gw = SimpleNamespace(cfg=cfg, metrics=NodeMetrics(), in_flight=0)
    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app[MESH] = cast(MeshNode, SimpleNamespace(state=state))
    app.add_routes([web.get("/v1/models", whoami)])
    api_keys.install(app)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/admin/keys", json={"name": "k", "role": "admin"}, headers=headers)
        assert r.status == 201, await r.text()
        made: dict[str, Any] = await r.json()
        assert app[KEY_SYNC] is not None
        return made


async def test_through_the_admin_api_of_an_open_node_and_a_protected_one() -> None:
    json_ct = {"Content-Type": "application/json"}
    open_state = MeshState("open", lambda: 1000.0, new_index=make_replica)
    made = await _mint(NodeConfig(), open_state, json_ct)  # auth off: the caller is the anonymous admin
    assert open_state.config.get_api_key(made["id"]) is None and open_state.config.api_keys() == []

    # auth on the data plane only: the control plane follows it, the admin is authenticated, the key
    # goes mesh-wide marked, and a protected peer accepts it
    cfg = NodeConfig(auth=auth_config({"data_plane": "api_key", "admin_key_sha256": [hash_key(ADMIN)]}))
    assert cfg.auth.control_plane == "api_key"
    state = MeshState("a", lambda: 1000.0, new_index=make_replica)
    made = await _mint(cfg, state, {**json_ct, "Authorization": f"Bearer {ADMIN}"})
    rec = state.config.get_api_key(made["id"])
    assert rec is not None and rec.minted_authenticated
    peer = MeshState("b", lambda: 1000.0, new_index=make_replica)
    peer_store = MemoryKeyStore()
    KeySync.attach(peer_store, peer, require_authenticated=True)
    peer.merge_remote_state(state.local_state())
    assert accepts(peer_store, made["key"])

    # the open node's document reaching the protected peer changes nothing there
    before = {r.id for r in peer_store.records()}
    _, stray = create_key(MemoryKeyStore(), "written-by-an-old-open-node")
    open_state.config.set_api_key(to_doc(stray))
    peer.merge_remote_state(open_state.local_state())
    assert {r.id for r in peer_store.records()} == before
