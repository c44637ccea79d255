"""The auth middleware and the key admin API in an aiohttp app (in process): planes, roles, envelopes,
tenants, per-key model lists, JWT beside keys, and no secret in logs or metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import jwt as pyjwt
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict, CIMultiDictProxy

from shepherd.auth.config import AuthConfig, auth_config
from shepherd.auth.keys import ApiKeyRecord, MemoryKeyStore, create_key, hash_key
from shepherd.auth.middleware import AUTH, Authenticator, AuthFailure, build_state, make_body_gate, plane_of
from shepherd.auth.principal import principal_of
from shepherd.node.api import keys as api_keys
from shepherd.node.api.common import GATEWAY, error_middleware, model_allowed
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.server import LeanServer
from shepherd.node.http.types import LeanRequest
from shepherd.node.metrics import NodeMetrics
from tests.unit.test_auth_jwt import ISS, Signer, hs_confused_token, jwks_of

ADMIN = "sk-smg-admin-key-for-tests-0000000000000000"
USER = "sk-smg-user-key-for-tests-00000000000000000"


async def whoami(request: web.Request) -> web.Response:
    p = principal_of(request)
    body = {"subject": p.subject, "tenant": p.tenant, "role": p.role, "method": p.method}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def chat(request: web.Request) -> web.Response:
    try:
        d = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        d = None
    if isinstance(d, dict) and isinstance(d.get("model"), str):
        model_allowed(request, d["model"])  # as the routes check the model they resolve
    return await whoami(request)


def make_app(raw: dict[str, Any], environ: dict[str, str] | None = None) -> web.Application:
    gw = SimpleNamespace(cfg=NodeConfig(auth=auth_config(raw)), metrics=NodeMetrics(), in_flight=0)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.render())

    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app.add_routes(
        [
            web.post("/v1/chat/completions", chat),
            web.get("/v1/models", whoami),
            web.get("/workers", whoami),
            web.post("/workers", whoami),
            web.get("/health", whoami),
            web.get("/metrics", metrics),
            web.get("/mesh/status", whoami),
        ]
    )
    api_keys.install(app)
    return app


Factory = Callable[..., Any]


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Factory]:
    monkeypatch.setenv("T_ADMIN_KEY", ADMIN)
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(raw: dict[str, Any]) -> TestClient[web.Request, web.Application]:
        c = TestClient(TestServer(make_app(raw)))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def bearer(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


KEYS = {"mode": "api_key", "admin_key_env": "T_ADMIN_KEY"}


def add_user(app: web.Application, **kw: Any) -> str:
    key, _ = create_key(app[AUTH].store, "u", "user", **kw)
    return key


async def test_auth_off_is_anonymous_and_ignores_headers(client: Factory) -> None:
    c = await client({})
    r = await c.get("/workers", headers=bearer("x"))
    assert r.status == 200 and (await r.json())["subject"] == "anonymous"


async def test_envelopes_planes_and_roles(client: Factory) -> None:
    c = await client(KEYS)
    user = add_user(c.app)
    r = await c.get("/v1/models")
    body = await r.json()
    assert r.status == 401 and r.headers["WWW-Authenticate"] == 'Bearer realm="shepherd"'
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "missing_credentials"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    r = await c.get("/v1/models", headers=bearer("sk-smg-wrong"))
    assert r.status == 401 and 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    assert (await r.json())["error"]["code"] == "invalid_api_key"
    r = await c.get("/v1/models", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_auth_scheme"
    r = await c.get("/v1/models", headers=bearer(user))
    assert r.status == 200 and (await r.json())["role"] == "user"
    r = await c.get("/v1/models", headers={"x-api-key": user})  # Anthropic clients
    assert r.status == 200
    for name in ("Authorization", "x-api-key"):  # a field twice: refused whichever copy is good
        for pair in ((user, "bogus"), ("bogus", user)):
            vals = [f"Bearer {v}" if name == "Authorization" else v for v in pair]
            r = await c.get("/v1/models", headers=[(name, vals[0]), (name, vals[1])])
            assert r.status == 400 and (await r.json())["error"]["code"] == "duplicate_credentials"
    # both fields, naming different callers: refused (Authorization won before); the same key in both: it
    for other in ("bogus", add_user(c.app)):
        r = await c.get("/v1/models", headers={**bearer(user), "x-api-key": other})
        assert r.status == 400 and (await r.json())["error"]["code"] == "duplicate_credentials"
    r = await c.get("/v1/models", headers={**bearer(user), "x-api-key": user})
    assert r.status == 200 and (await r.json())["role"] == "user"
    for method, path in (
        ("POST", "/workers"),
        ("GET", "/workers"),
        ("GET", "/mesh/status"),
        ("GET", "/admin/keys"),
    ):
        r = await c.request(method, path, headers=bearer(user))
        body = await r.json()
        assert r.status == 403 and body["error"]["type"] == "permission_error", (path, body)
        assert "WWW-Authenticate" not in r.headers
    r = await c.get("/workers", headers=bearer(ADMIN))
    assert r.status == 200 and (await r.json())["role"] == "admin"
    r = await c.get("/v1/models", headers=bearer(ADMIN))  # admins may use the data plane
    assert r.status == 200
    assert (await c.get("/health")).status == 200
    assert (await c.get("/metrics")).status == 401  # a control route by default
    assert (await c.get("/metrics", headers=bearer(ADMIN))).status == 200
    r = await c.get("/no/such/route")
    assert r.status == 401  # unknown paths are data plane: no route existence leaks
    r = await c.get("/no/such/route", headers=bearer(user))
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"


async def test_planes_configured_separately_and_metrics_protected(client: Factory) -> None:
    c = await client(
        {"data_plane": "off", "control_plane": "api_key", "metrics": True, "admin_key_env": "T_ADMIN_KEY"}
    )
    assert (await c.get("/v1/models")).status == 200
    assert (await c.get("/workers")).status == 401
    assert (await c.get("/metrics")).status == 401
    assert (await c.get("/metrics", headers=bearer(ADMIN))).status == 200
    assert plane_of("/metrics", False) == "public" and plane_of("/workers/{worker_id}", False) == "control"
    assert plane_of("/workersx", False) == "data" and plane_of(None, False) == "data"


async def test_key_admin_api(client: Factory) -> None:
    c = await client(KEYS)
    r = await c.post(
        "/admin/keys", json={"name": "ci", "tenant": "t1", "models": ["qwen3"]}, headers=bearer(ADMIN)
    )
    assert r.status == 201
    made = await r.json()
    key = made["key"]
    assert key.startswith("sk-smg-") and made["role"] == "user" and made["tenant"] == "t1"
    assert made["models"] == ["qwen3"] and made["created_by"] == "boot-env-0"
    r = await c.get("/admin/keys", headers=bearer(ADMIN))
    listing = await r.text()
    assert key not in listing and hash_key(key) not in listing and ADMIN not in listing
    assert made["id"] in listing
    r = await c.get(f"/admin/keys/{made['id']}", headers=bearer(ADMIN))
    assert (await r.json())["revoked"] is False and "key" not in await r.json()
    r = await c.post("/v1/chat/completions", json={"model": "qwen3"}, headers=bearer(key))
    assert r.status == 200 and (await r.json())["tenant"] == "t1"
    r = await c.delete(f"/admin/keys/{made['id']}", headers=bearer(ADMIN))
    assert r.status == 200 and (await r.json())["revoked"] is True
    r = await c.post("/v1/chat/completions", json={"model": "qwen3"}, headers=bearer(key))
    assert r.status == 401 and (await r.json())["error"]["code"] == "revoked_api_key"
    assert (await c.delete("/admin/keys/key_nope", headers=bearer(ADMIN))).status == 404
    assert (await c.get("/admin/keys/key_nope", headers=bearer(ADMIN))).status == 404
    for bad in ({"role": "root"}, {"expires_in": -1}, {"expires_at": 5}, {"models": "qwen3"}, {"name": ""}):
        r = await c.post("/admin/keys", json=bad, headers=bearer(ADMIN))
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error", bad
    for typo in ({"model": ["qwen3"]}, {"expire_at": 1}, {"key": "sk-smg-mine"}, {"rate_limit": 5}):
        # a misspelt or unsupported field is refused, not ignored (no key minted without the restriction)
        r = await c.post("/admin/keys", json={"name": "typo", **typo}, headers=bearer(ADMIN))
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == next(iter(typo)), typo
    r = await c.post(
        "/admin/keys", data=b"{not json", headers={**bearer(ADMIN), "Content-Type": "application/json"}
    )
    assert r.status == 400
    r = await c.post("/admin/keys", data=b"{not json", headers=bearer(ADMIN))  # no JSON content type
    assert r.status == 415
    r = await c.post("/admin/keys", json={"role": "admin", "expires_in": 3600}, headers=bearer(ADMIN))
    made = await r.json()
    assert made["role"] == "admin" and made["expires_at"] > time.time()
    assert (await c.get("/workers", headers=bearer(made["key"]))).status == 200


async def test_model_allow_list(client: Factory) -> None:
    c = await client(KEYS)
    key = add_user(c.app, models=["m1"])
    r = await c.post("/v1/chat/completions", json={"model": "m2"}, headers=bearer(key))
    body = await r.json()
    assert r.status == 403 and body["error"]["code"] == "model_not_allowed"
    r = await c.post("/v1/chat/completions", json={"model": "m1"}, headers=bearer(key))
    assert r.status == 200
    r = await c.post("/v1/chat/completions", data=b"{broken", headers=bearer(key))
    assert r.status == 200  # not ours to judge: the handler answers bad JSON


async def test_tenant_header_rules(client: Factory) -> None:
    c = await client({**KEYS, "trust_tenant_header": True})
    free = add_user(c.app)
    bound = add_user(c.app, tenant="home")
    h = {"x-smg-tenant": "elsewhere"}
    assert (await (await c.get("/v1/models", headers={**bearer(free), **h})).json())["tenant"] == "elsewhere"
    assert (await (await c.get("/v1/models", headers={**bearer(bound), **h})).json())["tenant"] == "home"
    assert (await (await c.get("/v1/models", headers={**bearer(ADMIN), **h})).json())["tenant"] == "elsewhere"
    assert (await (await c.get("/v1/models", headers=bearer(free))).json())["tenant"] == "default"
    r = await c.get("/v1/models", headers={**bearer(free), "x-smg-tenant": "x" * 500})
    assert r.status == 400
    c2 = await client(KEYS)  # header not trusted: ignored
    free2 = add_user(c2.app)
    assert (await (await c2.get("/v1/models", headers={**bearer(free2), **h})).json())["tenant"] == "default"
    c3 = await client({"trust_tenant_header": True})  # auth off, header trusted (a proxy in front)
    r = await c3.get("/v1/models", headers=h)
    assert (await r.json())["tenant"] == "elsewhere"
    # only the header named: a proxy that sets ours need not know of any other
    r = await c3.get("/v1/models", headers={"x-smg-tenant-id": "smg-t"})
    assert (await r.json())["tenant"] == "default"
    c4 = await client({"trust_tenant_header": True, "tenant_header": "X-Team"})  # (--tenant-header-name)
    assert (await (await c4.get("/v1/models", headers={"x-team": "blue"})).json())["tenant"] == "blue"
    assert (await (await c4.get("/v1/models", headers=h)).json())["tenant"] == "default"


async def test_expired_key_with_a_fake_clock() -> None:
    store = MemoryKeyStore()
    key, _ = create_key(store, "t", expires=100.0, now=0.0)
    now = [99.0]
    a = Authenticator(AuthConfig(data_plane="api_key"), store, None, clock=lambda: now[0])
    assert (await a.authenticate("data", bearer(key))).principal.role == "user"
    now[0] = 100.0
    with pytest.raises(AuthFailure) as e:
        await a.authenticate("data", bearer(key))
    assert e.value.code == "expired_api_key"


async def test_principal_cache_follows_record_changes() -> None:
    store = MemoryKeyStore()
    key, rec = create_key(store, "t", tenant="a")
    a = Authenticator(AuthConfig(data_plane="api_key"), store, None)
    assert (await a.authenticate("data", bearer(key))).principal.tenant == "a"
    store.apply([{**rec.to_dict(), "tenant": "b"}])  # replicated change from elsewhere
    assert (await a.authenticate("data", bearer(key))).principal.tenant == "b"
    store.apply([{**rec.to_dict(), "revoked": True}])
    with pytest.raises(AuthFailure):
        await a.authenticate("data", bearer(key))
    assert isinstance(store.get(rec.id), ApiKeyRecord)


async def test_jwt_beside_keys_and_no_secret_in_logs(
    client: Factory, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    signer = Signer("k1")
    (tmp_path / "jwks.json").write_text(orjson.dumps(jwks_of(signer)).decode())
    c = await client(
        {
            **KEYS,
            "mode": "both",
            "jwt": {"issuer": ISS, "audience": ["smg"], "public_key_files": [str(tmp_path / "jwks.json")]},
        }
    )
    tok = signer.token(role="admin", tenant="t9")
    r = await c.get("/workers", headers=bearer(tok))
    body = await r.json()
    assert r.status == 200 and body == {"subject": "alice", "tenant": "t9", "role": "admin", "method": "jwt"}
    r = await c.get("/workers", headers=bearer(signer.token()))
    assert r.status == 403
    assert (await c.get("/workers", headers=bearer(ADMIN))).status == 200
    caplog.set_level(logging.DEBUG)
    secrets = [
        "sk-smg-this-is-a-secret-key-nobody-has-000000",
        signer.token(exp=int(time.time()) - 100),
        signer.token(aud="other"),
        hs_confused_token(signer, "k1"),
        Signer("k1").token(),
    ]
    for s in secrets:
        r = await c.get("/v1/models", headers=bearer(s))
        body = await r.json()
        assert r.status == 401 and body["error"]["type"] == "authentication_error"
        assert s not in await r.text()
    metrics = await (await c.get("/metrics", headers=bearer(ADMIN))).text()
    assert "smg_auth_failures_total" in metrics
    for s in secrets:
        assert s not in caplog.text and s not in metrics
        assert s[-20:] not in caplog.text  # no tail of it either


class _Head(dict[Any, Any]):
    """A request's head as the lean server's body gate sees it (a mapping, as its requests are: the gate
    leaves its outcome there)."""

    def __init__(self, route: str, headers: dict[str, str], remote: str) -> None:
        super().__init__()
        self.match_info = SimpleNamespace(route=SimpleNamespace(resource=SimpleNamespace(canonical=route)))
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self.transport = None
        self.remote = remote


def _head(route: str, headers: dict[str, str], remote: str = "10.0.0.1") -> web.Request:
    """A request as the lean server's body gate sees it: its head only (route, headers, peer)."""
    return cast(web.Request, _Head(route, headers, remote))


def test_the_body_gate_refuses_bad_tokens_and_blocked_addresses_at_the_head(tmp_path: Any) -> None:
    """A caller the middleware will refuse whatever its body has its body dropped, not buffered: with
    JWTs too (a token that does not verify against keys at hand, ``alg: none``), and any caller from an
    address the failure limiter refuses (429)."""
    signer = Signer("k1")
    (tmp_path / "jwks.json").write_text(orjson.dumps(jwks_of(signer)).decode())
    jwt_cfg = {"issuer": ISS, "audience": ["smg"], "public_key_files": [str(tmp_path / "jwks.json")]}
    state = build_state(auth_config({"mode": "jwt", "jwt": jwt_cfg, "failure_limit": 2}))
    gate = make_body_gate(state.authenticator)
    chat = "/v1/chat/completions"
    assert not gate(_head(chat, bearer(signer.token())))  # verified (now cached): the body is read
    for bad in (
        Signer("k1").token(),  # another key under the kid
        signer.token(exp=int(time.time()) - 100),
        signer.token(aud="other"),
        hs_confused_token(signer, "k1"),
        "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.",
        "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.AAAA",
    ):
        assert gate(_head(chat, bearer(bad)))
    limiter = state.authenticator.failures
    assert limiter is not None
    limiter.failed("10.0.0.9", "a")
    limiter.failed("10.0.0.9", "b")
    assert gate(_head(chat, bearer(signer.token()), remote="10.0.0.9"))  # answered 429 whatever it sends
    assert not gate(_head(chat, bearer(signer.token()), remote="10.0.0.8"))
    # keys still to be fetched (a JWKS endpoint not loaded yet): the middleware verifies after the head
    remote = build_state(auth_config({"mode": "jwt", "jwt": {"issuer": ISS, "jwks_url": ISS + "/keys"}}))
    assert not make_body_gate(remote.authenticator)(_head(chat, bearer(signer.token())))


@pytest.mark.parametrize("cache_size", [10_000, 0])
async def test_a_token_is_verified_once_a_request_behind_the_body_gate(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, cache_size: int
) -> None:
    """On the lean server a request with a body has its token checked at its head (the body gate) and
    the middleware takes that outcome: one signature check a request, refused or not, whether verified
    tokens are cached or not (a bad token cost two: the RSA check is what a caller can make the node
    do at will)."""
    signer = Signer("k1")
    (tmp_path / "jwks.json").write_text(orjson.dumps(jwks_of(signer)).decode())
    jwt_cfg = {
        "issuer": ISS,
        "audience": ["smg"],
        "public_key_files": [str(tmp_path / "jwks.json")],
        "cache_size": cache_size,
    }
    app = make_app({"mode": "jwt", "jwt": jwt_cfg})
    checks = [0]
    decode = pyjwt.decode

    def counted(*args: Any, **kw: Any) -> Any:
        checks[0] += 1
        return decode(*args, **kw)

    monkeypatch.setattr(pyjwt, "decode", counted)
    runner = web.AppRunner(app)
    await runner.setup()
    server = LeanServer(app, max_body=1 << 16)
    server.body_gate = cast(
        Callable[[LeanRequest], bool], make_body_gate(app[AUTH].authenticator)
    )  # as the node's
    await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            for token, status in (
                (Signer("k1").token(), 401),  # another key under the kid: the signature fails
                (signer.token(exp=int(time.time()) - 100), 401),  # signed, expired
                (signer.token(), 200),
            ):
                checks[0] = 0
                url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
                async with s.post(url, json={"model": "m"}, headers=bearer(token)) as r:
                    assert r.status == status
                    if status == 401:
                        assert (await r.json())["error"]["type"] == "authentication_error"
                        assert "invalid_token" in r.headers["WWW-Authenticate"]
                    else:
                        assert (await r.json())["subject"] == "alice"
                assert checks[0] == 1
    finally:
        await server.shutdown(timeout=5.0)
        await runner.cleanup()
