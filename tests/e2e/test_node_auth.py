"""End to end: who may call a real node. API keys and JWTs (a real local OIDC discovery + JWKS endpoint,
key rotation, attack tokens) through the official openai SDK; TLS on the client port with client
certificates and a certificate reload; mTLS from the node to a gRPC engine (a TLS front on the mock)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from aiohttp import web
from cryptography import x509

from shepherd.auth.certs import PemPair, generate_ca, generate_node_cert
from shepherd.auth.tls import EngineTls
from shepherd.node.dispatch.workers import make_client
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.proto.engine_types import EngineError
from tests.e2e.node_procs import NodeProc, start_node
from tests.e2e.node_procs import env as node_env
from tests.e2e.procs import start_mock_engine
from tests.unit.test_auth_jwt import Signer, hs_confused_token, unsigned_token

MSGS: list[Any] = [{"role": "user", "content": "Say something."}]
ADMIN_KEY = "sk-smg-e2e-admin-" + os.urandom(16).hex()
T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a thread, for the servers this test plays (JWKS issuer, TLS front)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def bg() -> Iterator[LoopThread]:
    t = LoopThread()
    yield t
    t.stop()


def sdk(url: str, key: str, http_client: openai.DefaultHttpxClient | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=key, max_retries=0, timeout=30, http_client=http_client
    )


def chat(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=3)
    return r.choices[0].message.content or ""


# ---- a local OIDC issuer -------------------------------------------------------------------------


class Issuer:
    """``/.well-known/openid-configuration`` and ``/jwks`` on 127.0.0.1, keys changeable at run time."""

    def __init__(self, bg: LoopThread) -> None:
        self.bg = bg
        self.keys: list[dict[str, Any]] = []
        self.jwks_fetches = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _discovery(self, request: web.Request) -> web.Response:
        return web.json_response({"issuer": self.url, "jwks_uri": self.url + "/jwks"})

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_fetches += 1
        return web.json_response({"keys": list(self.keys)})

    async def _start(self) -> None:
        app = web.Application()
        app.add_routes(
            [web.get("/.well-known/openid-configuration", self._discovery), web.get("/jwks", self._jwks)]
        )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> Issuer:
        self.bg.run(self._start())
        return self

    def stop(self) -> None:
        if self.runner is not None:
            self.bg.run(self.runner.cleanup())


# ---- TLS material and the TLS front of the engine ---------------------------------------------


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = generate_ca()
        self.ca_file = self.put("ca.pem", self.ca.cert_pem)

    def put(self, name: str, data: bytes) -> str:
        path = self.root / name
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic, as a cert manager does
        return str(path)

    def issue(self, name: str) -> tuple[str, str, PemPair]:
        pair = generate_node_cert(self.ca, "localhost")
        return self.put(f"{name}.pem", pair.cert_pem), self.put(f"{name}-key.pem", pair.key_pem), pair


class TlsFront:
    """TLS (ALPN h2, client certificates required) in front of the mock engine's cleartext gRPC port."""

    def __init__(self, bg: LoopThread, ctx: ssl.SSLContext, target_port: int) -> None:
        self.bg, self.ctx, self.target = bg, ctx, target_port
        self.client_subjects: list[str] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        cert = w.get_extra_info("peercert") or {}
        self.client_subjects.append(str(cert.get("subject", "")))
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.close()
            return
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    def start(self) -> TlsFront:
        self.bg.run(self._start())
        return self

    def stop(self) -> None:
        self.bg.run(self._stop())


def client_ctx(pki: Pki, cert: tuple[str, str] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca_file)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


def served_serial(port: int, ctx: ssl.SSLContext) -> int:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as s,
        ctx.wrap_socket(s, server_hostname="localhost") as t,
    ):
        der = t.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


async def detect(url: str, tls: EngineTls) -> str:
    """Settle the engine kind over grpcio (the channel is made on this loop)."""
    client = make_client(url, "grpcio", tls)
    assert isinstance(client, GrpcEngineClient)
    try:
        return await client.detect(10.0)
    except EngineError:
        return "refused"
    finally:
        await client.close()


def start_tls_node(
    args: list[str], ctx: ssl.SSLContext, env: dict[str, str], timeout: float = 60.0
) -> NodeProc:
    """``start_node`` for a TLS port: readiness is polled over HTTPS with ``ctx``."""
    with node_env(env):
        return start_node(*args, tls=ctx, timeout=timeout)


# ---- one node with everything on ----------------------------------------------------------------


@dataclass
class Setup:
    node: NodeProc
    url: str
    pki: Pki
    ok_ctx: ssl.SSLContext  # trusts our CA and holds a client certificate
    first_cert: PemPair
    issuer: Issuer
    signer: Signer
    front: TlsFront
    gw_cert: tuple[str, str]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.ok_ctx, timeout=30)

    def sdk(self, key: str) -> openai.OpenAI:
        return sdk(self.url, key, openai.DefaultHttpxClient(verify=self.ok_ctx))

    def assert_no_secret_logged(self, secrets: list[str]) -> None:
        log = self.node.log()
        assert "Traceback" not in log
        for s in secrets:
            assert s not in log and s[-16:] not in log


@pytest.fixture(scope="module")
def setup(bg: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A mock engine behind a TLS front that wants client certificates; a local OIDC issuer; one node
    with TLS + client certificates on its port, keys and JWTs on both planes, mTLS to the engine."""
    pki = Pki(tmp_path_factory.mktemp("pki"))
    srv_cert, srv_key, first = pki.issue("node")
    cli_cert, cli_key, _ = pki.issue("client")  # the SDK's client certificate (mTLS on the client port)
    gw_cert, gw_key, _ = pki.issue("gw")  # the node's client certificate towards the engine
    eng_cert, eng_key, _ = pki.issue("engine")
    front_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki.ca_file)
    front_ctx.load_cert_chain(eng_cert, eng_key)
    front_ctx.verify_mode = ssl.CERT_REQUIRED
    front_ctx.set_alpn_protocols(["h2"])
    signer = Signer("k1")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(start_mock_engine("--zero-latency"))
        front = TlsFront(bg, front_ctx, engine.grpc_port).start()
        stack.callback(front.stop)
        issuer = Issuer(bg).start()
        stack.callback(issuer.stop)
        issuer.keys = [signer.jwk()]
        ok_ctx = client_ctx(pki, (cli_cert, cli_key))
        node = start_tls_node(
            [
                *("--worker-urls", f"grpcs://127.0.0.1:{front.port}", "--model-id", "qwen3"),
                *("--tokenizer-workers", "0", "--log-level", "debug"),
                *(
                    "--tls-cert-file",
                    srv_cert,
                    "--tls-key-file",
                    srv_key,
                    "--tls-client-ca-file",
                    pki.ca_file,
                ),
                *("--tls-reload-interval-secs", "0.2", "--engine-tls-ca-file", pki.ca_file),
                *("--engine-tls-cert-file", gw_cert, "--engine-tls-key-file", gw_key),
                *("--auth-mode", "both", "--auth-admin-key-env", "SMG_E2E_ADMIN_KEY"),
                *("--jwt-issuer", issuer.url, "--jwt-audience", "smg", "--jwt-jwks-min-refresh-secs", "0.2"),
            ],
            ok_ctx,
            {"SMG_E2E_ADMIN_KEY": ADMIN_KEY},
        )
        stack.callback(node.stop)
        url = f"https://127.0.0.1:{node.port}"
        yield Setup(node, url, pki, ok_ctx, first, issuer, signer, front, (gw_cert, gw_key))


def assert_401(r: httpx.Response, code: str | None = None) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_api_keys(setup: Setup) -> None:
    admin = bearer(ADMIN_KEY)
    secrets = [ADMIN_KEY]
    with setup.http() as http:
        assert chat(setup.sdk(ADMIN_KEY))
        with pytest.raises(openai.AuthenticationError) as e:
            chat(setup.sdk("sk-smg-not-a-key"))
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert_401(http.get("/v1/models"), "missing_credentials")
        assert http.get("/readiness").status_code == 200  # probes stay open

        # an admin makes a user key; it works on the data plane, not on the control plane
        r = http.post("/admin/keys", json={"name": "ci", "tenant": "team-a"}, headers=admin)
        assert r.status_code == 201, r.text
        made = r.json()
        user_key = made["key"]
        secrets.append(user_key)
        assert chat(setup.sdk(user_key))
        r = http.post("/workers", json={"url": "grpc://127.0.0.1:1"}, headers={"x-api-key": user_key})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        listing = http.get("/admin/keys", headers=admin).text
        assert made["id"] in listing and user_key not in listing
        assert http.delete(f"/admin/keys/{made['id']}", headers=admin).status_code == 200
        with pytest.raises(openai.AuthenticationError) as e:
            chat(setup.sdk(user_key))
        assert e.value.code == "revoked_api_key"
        # the operator's own key (the configuration's) is not revoked through the API: no lock-out
        boot = [
            k["id"] for k in http.get("/admin/keys", headers=admin).json()["data"] if k["id"] != made["id"]
        ]
        assert boot, "the bootstrap admin key is listed"
        for kid in boot:
            r = http.delete(f"/admin/keys/{kid}", headers=admin)
            assert r.status_code == 409 and r.json()["error"]["code"] == "bootstrap_key", r.text
        assert http.get("/admin/keys", headers=admin).status_code == 200

        huge = "sk-smg-" + "A" * 20_000  # over aiohttp's header limit: a plain 400, never a 500
        assert 400 <= http.get("/v1/models", headers=bearer(huge)).status_code < 500
        assert chat(setup.sdk(ADMIN_KEY))  # still serving
        assert_401(http.get("/metrics"), "missing_credentials")  # a control route
        metrics = http.get("/metrics", headers=admin).text
        assert 'smg_auth_failures_total{code="invalid_api_key",plane="data"}' in metrics
    setup.assert_no_secret_logged(secrets)
    assert "AAAAAAAAAAAAAAAA" not in setup.node.log()


def test_a_keys_model_list_holds_however_the_model_is_named(setup: Setup) -> None:
    """The list is checked on the model a route resolves: in the body, as ?model=, or none at all on a
    one-model node (the body's "model" alone was checked before: the other two went through)."""
    admin = bearer(ADMIN_KEY)
    msgs = [{"role": "user", "content": "hi"}]
    with setup.http() as http:
        keys = {}
        for models in (["other"], ["qwen3"]):
            r = http.post("/admin/keys", json={"name": "m", "models": models}, headers=admin)
            assert r.status_code == 201, r.text
            keys[models[0]] = bearer(r.json()["key"])
        asks = [
            ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "qwen3", "messages": msgs, "max_tokens": 2}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
            ("/generate?model=qwen3", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "model": "qwen3"}),
            ("/v1/messages", {"model": "qwen3", "messages": msgs, "max_tokens": 2}),
            ("/tokenize", {"prompt": "hi"}),
        ]
        for path, body in asks:
            r = http.post(path, json=body, headers=keys["other"])
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err.get("code") == "model_not_allowed" or err.get("type") == "permission_error", (
                path,
                err,
            )
            r = http.post(path, json=body, headers=keys["qwen3"])
            assert r.status_code == 200, (path, r.text)
        # and the models it lists and shows are its own
        assert http.get("/v1/models", headers=keys["other"]).json()["data"] == []
        assert [m["id"] for m in http.get("/v1/models", headers=keys["qwen3"]).json()["data"]] == ["qwen3"]
        assert http.get("/v1/models/qwen3", headers=keys["other"]).status_code == 404
        assert http.get("/v1/models/qwen3", headers=keys["qwen3"]).status_code == 200
        # an unknown model's 404 names only the models the key may use
        for r in (
            http.get("/v1/models/nope", headers=keys["other"]),
            http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=keys["other"]),
        ):
            assert r.status_code == 404 and "qwen3" not in r.json()["error"]["message"], r.text
        r = http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=keys["qwen3"])
        assert r.status_code == 404 and "qwen3" in r.json()["error"]["message"]


def test_jwts_rotation_and_attacks(setup: Setup) -> None:
    k1, issuer = setup.signer, setup.issuer
    iss = {"iss": issuer.url}
    user_tok, admin_tok = k1.token(**iss), k1.token(role="admin", **iss)
    secrets = [user_tok, admin_tok]
    with setup.http() as http:
        assert chat(setup.sdk(user_tok))
        assert http.get("/workers", headers=bearer(admin_tok)).status_code == 200
        r = http.get("/workers", headers=bearer(user_tok))
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role"

        # rotation: the issuer publishes k2 and signs with it; the node refetches on the unknown kid
        k2 = Signer("k2", "EC")
        issuer.keys = [k1.jwk(), k2.jwk()]
        new_tok = k2.token(**iss)
        secrets.append(new_tok)
        for _ in range(100):  # bounded: the refetch is rate-limited (0.2 s here)
            if http.get("/v1/models", headers=bearer(new_tok)).status_code == 200:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a token signed by the rotated-in key was never accepted")
        assert chat(setup.sdk(new_tok))

        # attacks and bad tokens: 401 in the envelope, never a 500
        now = int(time.time())
        attacks = [
            ("token_expired", k1.token(exp=now - 300, **iss)),
            ("invalid_audience", k1.token(aud="another-service", **iss)),
            ("invalid_issuer", k1.token(iss="http://127.0.0.1:1")),
            ("token_not_yet_valid", k1.token(nbf=now + 3600, **iss)),
            ("invalid_algorithm", unsigned_token(iss=issuer.url, role="admin")),
            ("invalid_algorithm", hs_confused_token(k1, "k1")),
            ("invalid_signature", Signer("k1").token(role="admin", **iss)),
            ("unknown_key", Signer("k-unknown").token(**iss)),
            ("invalid_api_key", "eyJhbGciOiJSUzI1NiJ9.e30"),  # not JWT-shaped: in "both" mode, a key
        ]
        for code, tok in attacks:
            secrets.append(tok)
            assert_401(http.get("/workers", headers=bearer(tok)), code)
        with pytest.raises(openai.AuthenticationError):
            chat(setup.sdk(attacks[0][1]))
    setup.assert_no_secret_logged(secrets)


def test_jwt_tenant_claims_are_bounded(setup: Setup) -> None:
    """A tenant names rate-limit buckets, metric labels and stored records: 1 to 128 printable
    characters, else the token is refused (401), never a tenant of any size or with control bytes."""
    k1, iss = setup.signer, {"iss": setup.issuer.url}
    with setup.http() as http:
        for bad in ("t" * 129, "team\nx-injected: 1", "\x00", 7, ["a", "b"]):
            tok = k1.token(tenant=bad, **iss)
            assert_401(http.get("/v1/models", headers=bearer(tok)), "invalid_tenant_claim")
        ok = k1.token(tenant="t" * 128, **iss)
        assert http.get("/v1/models", headers=bearer(ok)).status_code == 200
    assert "Traceback" not in setup.node.log()


def test_client_tls_and_certificate_reload(setup: Setup) -> None:
    pki, port = setup.pki, setup.node.port
    for bad in (client_ctx(pki, None), ssl.create_default_context()):  # no client cert; not our CA
        with pytest.raises(openai.APIConnectionError):
            chat(sdk(setup.url, ADMIN_KEY, openai.DefaultHttpxClient(verify=bad)))
    old = x509.load_pem_x509_certificate(setup.first_cert.cert_pem).serial_number
    assert served_serial(port, setup.ok_ctx) == old
    _, _, renewed = pki.issue("node")  # rotate the files in place
    new = x509.load_pem_x509_certificate(renewed.cert_pem).serial_number
    for _ in range(200):  # bounded wait for the reload (checked every 0.2 s)
        if served_serial(port, setup.ok_ctx) == new:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the renewed certificate was never served")
    assert chat(setup.sdk(ADMIN_KEY))


def test_engine_mtls(setup: Setup, bg: LoopThread) -> None:
    assert chat(setup.sdk(ADMIN_KEY))  # the node reaches the engine only through the mTLS front
    assert setup.front.client_subjects and all("localhost" in s for s in setup.front.client_subjects)
    # the grpcio transport through the same front, with the same material (in this process)
    target = f"grpcs://127.0.0.1:{setup.front.port}"
    cert, key = setup.gw_cert
    assert bg.run(detect(target, EngineTls(setup.pki.ca_file, cert, key))) == "sglang"
    assert bg.run(detect(target, EngineTls(setup.pki.ca_file))) == "refused"  # no client certificate
