"""mTLS identities: the ``auth.client_cert`` settings, the certificate → principal mapping (pure), and
real TLS handshakes into an in-process app with the auth middleware (client certificates made by the
development CA of ``shepherd.auth.certs``)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from shepherd.auth.certs import (
    PemPair,
    generate_ca,
    generate_client_cert,
    generate_node_cert,
    pem_fingerprint,
)
from shepherd.auth.client_cert import CertIdentity, CertMapper
from shepherd.auth.config import AuthConfigError, ClientCertConfig, auth_config, merge_auth
from shepherd.auth.keys import hash_key
from shepherd.auth.tls import server_context, server_tls
from shepherd.node.cli import config_from_args
from shepherd.node.config import ConfigError, NodeConfig
from tests.unit.test_auth_middleware import make_app

ADMIN = "sk-smg-admin-key-for-cert-tests-0000000000"
FP = "ab" * 32


# ---- settings ----------------------------------------------------------------------------------------


def test_settings_from_yaml_fingerprints_first_then_rules() -> None:
    colons = ":".join(["AB"] * 32)
    cfg = auth_config(
        {
            "mode": "api_key",
            "client_cert": {
                "verify": "optional",
                "fingerprints": {colons: {"role": "admin", "name": "ci"}},
                "rules": [{"ou": "fleet-admins", "role": "admin"}, {"cn": "batch-*", "tenant": "batch"}],
                "tenant_from": "o",
                "subject": "uri_san",
                "prefer": "credential",
            },
        }
    ).client_cert
    assert cfg.verify == "optional" and cfg.enabled and cfg.prefer == "credential"
    assert [(r.fingerprint, r.role, r.name) for r in cfg.rules[:1]] == [(FP, "admin", "ci")]
    assert [(r.ou, r.cn, r.role, r.tenant) for r in cfg.rules[1:]] == [
        ("fleet-admins", None, "admin", None),
        (None, "batch-*", "user", "batch"),
    ]
    assert (cfg.tenant_from, cfg.subject) == ("o", "uri_san")
    assert not auth_config({}).client_cert.enabled
    assert auth_config({"client_cert": {"default_role": "user"}}).client_cert.enabled


@pytest.mark.parametrize(
    "raw",
    [
        {"rules": [{"role": "admin"}]},  # matches nothing
        {"rules": [{"cn": "x", "role": "root"}]},
        {"rules": [{"cn": "x", "colour": "blue"}]},
        {"rules": [{"cn": ""}]},
        {"rules": {"cn": "x"}},
        {"fingerprints": {"abc": {"role": "admin"}}},
        {"fingerprints": {FP: {"role": "admin", "cn": "x"}}},
        {"verify": "sometimes"},
        {"subject": "serial"},
        {"tenant_from": "dns_san"},
        {"prefer": "both"},
        {"default_role": "root"},
        {"rules": [{"cn": "x", "tenant": "bad\ntenant"}]},
        {"wat": 1},
    ],
)
def test_bad_client_cert_settings_are_refused(raw: dict[str, Any]) -> None:
    with pytest.raises(AuthConfigError):
        auth_config({"client_cert": raw})


def test_flags_set_the_scalars_and_merge_with_the_yaml(tmp_path: Path, pki: Pki) -> None:
    flags = [
        ("verify", "optional"),
        ("default-role", "user"),
        ("tenant-from", "ou"),
        ("prefer", "credential"),
    ]
    cert, key = pki.server
    tls = ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", pki.ca_file]
    cfg = config_from_args(["serve", *tls, *(x for k, v in flags for x in (f"--client-cert-{k}", v))])
    cc = cfg.auth.client_cert
    assert (cc.verify, cc.default_role, cc.tenant_from, cc.prefer) == ("optional", "user", "ou", "credential")
    merged = merge_auth({"client_cert": {"rules": [{"cn": "a"}]}}, {"client_cert": {"verify": "optional"}})
    assert merged == {"client_cert": {"rules": [{"cn": "a"}], "verify": "optional"}}
    y = tmp_path / "node.yaml"
    y.write_text("auth:\n  client_cert:\n    rules:\n      - {o: Example, role: admin}\n")
    cc = config_from_args(
        ["serve", *tls, "--config", str(y), "--client-cert-verify", "optional"]
    ).auth.client_cert
    assert cc.verify == "optional" and cc.rules[0].o == "Example" and cc.rules[0].role == "admin"
    with pytest.raises(ConfigError, match="tls_client_ca_file"):  # rules that could never see a certificate
        config_from_args(["serve", "--config", str(y)])


# ---- mapping (pure) ----------------------------------------------------------------------------------


def ident(**kw: Any) -> CertIdentity:
    return CertIdentity(fingerprint=kw.pop("fingerprint", FP), **{k: tuple(v) for k, v in kw.items()})


def mapper(**raw: Any) -> CertMapper:
    return CertMapper(auth_config({"client_cert": raw}).client_cert, "dflt")


def test_first_matching_rule_names_role_tenant_and_subject() -> None:
    m = mapper(
        fingerprints={FP: {"role": "admin", "name": "ci-runner"}},
        rules=[
            {"ou": "fleet-admins", "role": "admin"},
            {"cn": "batch-*", "o": "Example", "tenant": "batch"},
            {"uri_san": "spiffe://fleet/tenant/*", "role": "user"},
        ],
        tenant_from="ou",
    )
    got = m.map(ident(cn=["anything"]))
    assert got is not None and got.rule == 0 and got.principal.subject == "ci-runner"
    assert got.principal.role == "admin" and got.principal.method == "mtls" and got.principal.key_id is None
    got = m.map(ident(fingerprint="00" * 32, cn=["ops"], ou=["dev", "fleet-admins"]))  # any OU value
    assert got is not None and got.rule == 1 and got.principal.role == "admin"
    assert got.principal.tenant == "dev" and got.tenant_bound  # tenant_from: the first OU
    got = m.map(ident(fingerprint="00" * 32, cn=["batch-7"], o=["Example"]))
    assert (
        got is not None
        and got.rule == 2
        and (got.principal.subject, got.principal.tenant) == ("batch-7", "batch")
    )
    assert (
        m.map(ident(fingerprint="00" * 32, cn=["batch-7"], o=["Other"])) is None
    )  # every matcher must match
    assert m.map(ident(fingerprint="00" * 32, cn=["Batch-7"], o=["Example"])) is None  # case-sensitive
    got = m.map(ident(fingerprint="00" * 32, uri_san=["spiffe://fleet/tenant/a"]))
    assert got is not None and got.rule == 3
    assert got.principal.subject == "00" * 32  # no CN: the fingerprint names it
    assert got.principal.tenant == "dflt" and not got.tenant_bound  # no OU to take the tenant from


def test_default_role_and_unmapped_certificates() -> None:
    assert mapper(rules=[{"cn": "x"}]).map(ident(cn=["y"])) is None
    got = mapper(default_role="user", subject="email_san").map(ident(cn=["y"], email_san=["a@b.c"]))
    assert got is not None and got.rule is None and got.principal.role == "user"
    assert got.principal.subject == "a@b.c" and got.principal.tenant == "dflt"
    bad_tenant = mapper(default_role="user", tenant_from="cn").map(ident(cn=["x" * 200]))
    assert bad_tenant is not None and bad_tenant.principal.tenant == "dflt" and not bad_tenant.tenant_bound


# ---- real handshakes into an app with the auth middleware ---------------------------------------------


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = generate_ca()
        self.ca_file = self.put("ca.pem", self.ca.cert_pem)
        server = generate_node_cert(self.ca, "localhost")
        self.server = (self.put("server.pem", server.cert_pem), self.put("server-key.pem", server.key_pem))

    def put(self, name: str, data: bytes) -> str:
        (self.root / name).write_bytes(data)
        return str(self.root / name)

    def client(self, name: str, pair: PemPair) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.put(f"{name}.pem", pair.cert_pem), self.put(f"{name}-key.pem", pair.key_pem))
        return ctx

    def anonymous(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)


Get = Callable[..., Awaitable[tuple[int, dict[str, Any]]]]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
async def serve(pki: Pki) -> AsyncIterator[Callable[..., Awaitable[Get]]]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(client_cert: dict[str, Any], verify_optional: bool = True) -> Get:
        raw = {"mode": "api_key", "admin_key_sha256": [hash_key(ADMIN)], "client_cert": client_cert}
        app = make_app(raw)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        ctx = server_context(*pki.server, pki.ca_file, client_cert_optional=verify_optional)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = runner.addresses[0][1]

        async def get(
            path: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None
        ) -> tuple[int, Any]:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True))
            sessions.append(s)
            async with s.get(f"https://localhost:{port}{path}", headers=headers) as r:
                return r.status, await r.json()

        return get

    yield start
    for s in sessions:
        await s.close()
    for r in runners:
        await r.cleanup()


def bearer(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


RULES = {
    "rules": [{"ou": "fleet-admins", "role": "admin"}, {"cn": "batch-*", "tenant": "batch"}],
}


async def test_verified_certificates_name_the_caller(pki: Pki, serve: Callable[..., Awaitable[Get]]) -> None:
    ops = pki.client("ops", generate_client_cert(pki.ca, "ops-1", ous=["fleet-admins"]))
    batch = pki.client("batch", generate_client_cert(pki.ca, "batch-7", uris=["spiffe://fleet/batch-7"]))
    stranger = pki.client("stranger", generate_client_cert(pki.ca, "stranger"))
    get = await serve(RULES)
    assert await get("/workers", ops) == (
        200,
        {"subject": "ops-1", "tenant": "default", "role": "admin", "method": "mtls"},
    )
    assert await get("/v1/models", batch) == (
        200,
        {"subject": "batch-7", "tenant": "batch", "role": "user", "method": "mtls"},
    )
    status, body = await get("/workers", batch)
    assert status == 403 and body["error"]["code"] == "insufficient_role"
    # certificate first (default): an SDK's placeholder key does not get in the way
    assert (await get("/v1/models", batch, bearer("sk-placeholder")))[1]["tenant"] == "batch"
    # a certificate no rule maps authenticates no one: bearer credentials as before
    status, body = await get("/v1/models", stranger)
    assert status == 401 and body["error"]["code"] == "missing_credentials"
    assert (await get("/workers", stranger, bearer(ADMIN)))[1]["method"] == "api_key"
    # optional: a client without a certificate connects, and needs a credential
    status, body = await get("/v1/models", pki.anonymous())
    assert status == 401 and body["error"]["code"] == "missing_credentials"
    assert (await get("/workers", pki.anonymous(), bearer(ADMIN)))[1]["role"] == "admin"
    assert (await get("/health", pki.anonymous()))[0] == 200


async def test_prefer_credential_checks_a_bearer_sent_with_a_certificate(
    pki: Pki, serve: Callable[..., Awaitable[Get]]
) -> None:
    batch = pki.client("batch", generate_client_cert(pki.ca, "batch-7"))
    get = await serve({**RULES, "prefer": "credential"})
    status, body = await get("/v1/models", batch, bearer("sk-smg-not-a-key"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await get("/workers", batch, bearer(ADMIN)))[1]["method"] == "api_key"
    assert (await get("/v1/models", batch))[1] == {
        "subject": "batch-7",
        "tenant": "batch",
        "role": "user",
        "method": "mtls",
    }


async def test_fingerprint_map_and_a_foreign_ca(pki: Pki, serve: Callable[..., Awaitable[Get]]) -> None:
    pair = generate_client_cert(pki.ca, "ci")
    der = x509.load_pem_x509_certificate(pair.cert_pem).public_bytes(serialization.Encoding.DER)
    fp = pem_fingerprint(pair.cert_pem)
    assert CertIdentity.from_peercert({}, der).fingerprint == fp
    colons = ":".join(fp[i : i + 2] for i in range(0, 64, 2)).upper()
    get = await serve({"fingerprints": {colons: {"role": "admin", "tenant": "ops", "name": "ci-runner"}}})
    assert await get("/workers", pki.client("ci", pair)) == (
        200,
        {"subject": "ci-runner", "tenant": "ops", "role": "admin", "method": "mtls"},
    )
    twin = generate_client_cert(pki.ca, "ci")  # same names, another certificate: not in the map
    assert (await get("/workers", pki.client("twin", twin)))[0] == 401
    foreign_ca = generate_ca()
    foreign = pki.client("foreign", generate_client_cert(foreign_ca, "ci", ous=["fleet-admins"]))
    with pytest.raises(aiohttp.ClientError):
        await get("/workers", foreign)


async def test_required_refuses_a_handshake_without_a_certificate(
    pki: Pki, serve: Callable[..., Awaitable[Get]]
) -> None:
    get = await serve(RULES, verify_optional=False)
    with pytest.raises(aiohttp.ClientError):
        await get("/v1/models", pki.anonymous(), bearer(ADMIN))
    ops = pki.client("ops", generate_client_cert(pki.ca, "ops-1", ous=["fleet-admins"]))
    assert (await get("/workers", ops))[0] == 200


def test_server_tls_takes_the_verify_mode_from_the_auth_settings(pki: Pki) -> None:
    cert, key = pki.server
    base = NodeConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=pki.ca_file)
    tls = server_tls(base)
    assert tls is not None and tls.context.verify_mode == ssl.CERT_REQUIRED
    optional = auth_config({"client_cert": {"verify": "optional"}})
    tls = server_tls(NodeConfig(**{**_fields(base), "auth": optional}))
    assert tls is not None and tls.context.verify_mode == ssl.CERT_OPTIONAL
    assert server_tls(SimpleNamespace(tls_cert_file=None, tls_key_file=None)) is None
    assert ClientCertConfig().verify == "required"


def _fields(cfg: NodeConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")}
