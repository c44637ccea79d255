"""End to end: API keys mesh-wide and mTLS identities, on a mesh of 3 real ``smg-node`` processes.

Every node: API keys on both planes (the same bootstrap admin key, plus a bootstrap user key of its own
under the same id on every node), TLS on the client port with optional client certificates from the
test's CA mapped to principals (``auth.client_cert`` in a YAML file), and the mesh (sealed, mTLS) as
in ``test_mesh_cluster``, whose helpers start the processes. A key created on one node is used on
another, revoked on a third, refused everywhere; a client certificate names an admin or a tenant's
user. Every wait is a bounded poll (nothing is timed) and every process is stopped by its pid.
"""

from __future__ import annotations

import json
import signal
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shepherd.auth.certs import PemPair, generate_client_cert, write_dev_pki
from shepherd.auth.keys import hash_key
from shepherd.mesh.keyring import Keyring, generate_key
from tests.e2e.node_procs import NodeProc, reserved_port
from tests.e2e.test_mesh_cluster import FAST, MODEL, NAMES, spawn, wait_for

pytestmark = pytest.mark.timeout(180)

ADMIN_KEY = "sk-smg-e2e-mesh-admin-" + "a1" * 16
LOCAL_KEYS = {n: f"sk-smg-e2e-local-{n}-" + "b2" * 16 for n in NAMES}  # one per node, all with id local-0


@dataclass
class Mesh:
    nodes: dict[str, NodeProc]
    pki: Path
    ca: PemPair

    def url(self, name: str) -> str:
        return f"https://127.0.0.1:{self.nodes[name].port}"

    def ctx(self, cert: PemPair | None = None, name: str = "client") -> ssl.SSLContext:
        """Trusts the test CA; presents ``cert`` as the client certificate when given."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.pem"))
        if cert is not None:
            (self.pki / f"{name}.pem").write_bytes(cert.cert_pem)
            (self.pki / f"{name}-key.pem").write_bytes(cert.key_pem)
            ctx.load_cert_chain(self.pki / f"{name}.pem", self.pki / f"{name}-key.pem")
        return ctx

    def call(
        self,
        name: str,
        method: str,
        path: str,
        key: str | None = None,
        body: Any = None,
        ctx: ssl.SSLContext | None = None,
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(verify=ctx or self.ctx(), timeout=30) as c:
            return c.request(method, self.url(name) + path, headers=headers, json=body)

    def status(self, name: str, path: str, key: str | None) -> int:
        try:
            return self.call(name, "GET", path, key).status_code
        except httpx.HTTPError:
            return 0

    def members(self, name: str) -> dict[str, str]:
        r = self.call(name, "GET", "/mesh/members", ADMIN_KEY)
        return {m["name"]: m["state"] for m in r.json()["members"]} if r.status_code == 200 else {}


def node_yaml(name: str) -> str:
    auth = {
        "mode": "api_key",
        "admin_key_sha256": [hash_key(ADMIN_KEY)],
        "keys": [{"name": "local", "id": "local-0", "role": "user", "sha256": hash_key(LOCAL_KEYS[name])}],
        "client_cert": {
            "verify": "optional",
            "rules": [{"ou": "fleet-admins", "role": "admin"}, {"cn": "batch-*", "tenant": "batch"}],
        },
    }
    return json.dumps({"auth": auth})  # JSON is YAML


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    pki = tmp_path_factory.mktemp("auth-mesh-pki")
    files = write_dev_pki(pki, NAMES)  # the mesh's certificates, also served on the client port
    keyring = pki / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    nodes: dict[str, NodeProc] = {}
    m = Mesh(nodes, pki, PemPair((pki / "ca.pem").read_bytes(), (pki / "ca-key.pem").read_bytes()))
    try:
        mesh_ports = {n: reserved_port() for n in NAMES}

        def flags(name: str) -> list[str]:
            f = files[name]
            cfg = pki / f"{name}.yaml"
            cfg.write_text(node_yaml(name))
            return [
                "--config", str(cfg), "--model-id", MODEL, "--tokenizer-workers", "0",
                "--tls-cert-file", str(f.cert), "--tls-key-file", str(f.key),
                "--tls-client-ca-file", str(f.ca),
                "--mesh-port", str(mesh_ports[name]), "--mesh-name", name,
                "--mesh-cert", str(f.cert), "--mesh-key", str(f.key), "--mesh-ca", str(f.ca),
                "--mesh-keyring-file", str(keyring), *FAST,
            ]  # fmt: skip

        seed = f"127.0.0.1:{mesh_ports['a']}"
        nodes["b"] = spawn("join", seed, *flags("b"), port=reserved_port())
        nodes["c"] = spawn("join", f"127.0.0.1:{mesh_ports['b']}", seed, *flags("c"), port=reserved_port())
        nodes["a"] = spawn("serve", *flags("a"), port=reserved_port())
        for name, node in nodes.items():
            wait_for(
                lambda node=node, name=name: (
                    node.proc.poll() is not None  # type: ignore[misc]
                    or m.status(name, "/liveness", None) == 200
                ),
                f"node {name} up",
                timeout=90,
            )
            if node.proc.poll() is not None:
                raise RuntimeError(f"node {name} exited:\n{node.log()}")
        for name in NAMES:
            wait_for(lambda name=name: m.members(name) == dict.fromkeys(NAMES, "alive"), f"{name}: 3 alive")  # type: ignore[misc]
        yield m
    finally:
        for node in nodes.values():
            node.stop(signal.SIGTERM, timeout=10)


def accepted(m: Mesh, name: str, key: str) -> bool:
    return m.status(name, "/v1/models", key) == 200


def refused_as_revoked(m: Mesh, name: str, key: str) -> bool:
    r = m.call(name, "GET", "/v1/models", key)
    return r.status_code == 401 and r.json()["error"]["code"] == "revoked_api_key"


def test_key_created_on_a_is_accepted_on_c_and_revoked_on_b_is_refused_everywhere(mesh: Mesh) -> None:
    r = mesh.call("a", "POST", "/admin/keys", ADMIN_KEY, {"name": "mesh-e2e", "tenant": "team-a"})
    assert r.status_code == 201, r.text
    made = r.json()
    key = made["key"]
    for name in ("c", "b"):
        wait_for(lambda name=name: accepted(mesh, name, key), f"the key accepted on {name}")  # type: ignore[misc]
    listing = mesh.call("c", "GET", "/admin/keys", ADMIN_KEY).text
    assert made["id"] in listing and key not in listing
    state = mesh.call("c", "GET", "/mesh/state", ADMIN_KEY).json()
    assert state["config"]["api_keys"] >= 1
    # a user key stays a user key everywhere
    assert mesh.call("c", "GET", "/workers", key).status_code == 403

    assert mesh.call("b", "DELETE", f"/admin/keys/{made['id']}", ADMIN_KEY).status_code == 200
    for name in ("a", "c"):
        wait_for(lambda name=name: refused_as_revoked(mesh, name, key), f"the key refused on {name}")  # type: ignore[misc]
    assert mesh.call("a", "GET", f"/admin/keys/{made['id']}", ADMIN_KEY).json()["revoked"] is True
    for name, node in mesh.nodes.items():
        assert key not in node.log() and key[-16:] not in node.log(), name


def test_bootstrap_keys_stay_with_their_node(mesh: Mesh) -> None:
    for name in NAMES:
        assert accepted(mesh, name, LOCAL_KEYS[name])  # each node its own key under the shared id
        others = [LOCAL_KEYS[o] for o in NAMES if o != name]
        assert not any(accepted(mesh, name, k) for k in others)
        assert accepted(mesh, name, ADMIN_KEY)


def test_client_certificates_name_admins_and_tenant_users(mesh: Mesh) -> None:
    ops = mesh.ctx(generate_client_cert(mesh.ca, "ops-1", ous=["fleet-admins"]), "ops")
    batch = mesh.ctx(generate_client_cert(mesh.ca, "batch-7"), "batch")
    stranger = mesh.ctx(generate_client_cert(mesh.ca, "stranger"), "stranger")
    assert mesh.call("c", "GET", "/mesh/members", ctx=ops).status_code == 200  # admin: no bearer needed
    assert mesh.call("c", "GET", "/v1/models", ctx=batch).status_code == 200
    r = mesh.call("c", "GET", "/workers", ctx=batch)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role"
    for ctx in (stranger, mesh.ctx()):  # unmapped certificate, no certificate: a credential is needed
        r = mesh.call("c", "GET", "/v1/models", ctx=ctx)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_credentials"
    # the certificate's admin makes a key on c; it is accepted on a
    r = mesh.call("c", "POST", "/admin/keys", body={"name": "by-cert"}, ctx=ops)
    assert r.status_code == 201 and r.json()["created_by"] == "ops-1"
    key = r.json()["key"]
    wait_for(lambda: accepted(mesh, "a", key), "the certificate admin's key accepted on a")


def test_nodes_still_serve_after_the_churn(mesh: Mesh) -> None:
    with ThreadPoolExecutor(3) as ex:
        statuses = list(ex.map(lambda n: mesh.status(n, "/v1/models", ADMIN_KEY), NAMES))
    assert statuses == [200, 200, 200]
    for name, node in mesh.nodes.items():
        assert node.proc.poll() is None and "Traceback" not in node.log(), name
