"""JWT verification with keys made in the test: claims checks, attack tokens, the verified-token cache,
static key files, and the JWKS source (discovery, rotation, rate-limited refetch, TTL, failures) with a
fake fetch and a fake clock."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.auth.config import JwtConfig
from shepherd.auth.jwks import (
    FetchError,
    HttpFetch,
    JwksSource,
    KeyLoadError,
    keys_from_file,
    keys_from_jwks,
    static_keys,
)
from shepherd.auth.jwt_verify import JwtError, JwtVerifier, principal_from_claims
from shepherd.auth.principal import Principal

ISS = "https://idp.test"
AUD = "smg"


# ---- helpers (also used by the end-to-end auth tests) --------------------------------------------------


class Signer:
    """A private key with its kid: signs tokens and publishes its public JWK."""

    def __init__(self, kid: str, kind: str = "RSA") -> None:
        self.kid = kid
        self.alg = "RS256" if kind == "RSA" else "ES256"
        self.key: Any = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048)
            if kind == "RSA"
            else ec.generate_private_key(ec.SECP256R1())
        )

    def jwk(self) -> dict[str, Any]:
        algo = jwt.algorithms.RSAAlgorithm if self.alg == "RS256" else jwt.algorithms.ECAlgorithm
        d: dict[str, Any] = json.loads(algo.to_jwk(self.key.public_key()))
        return {**d, "kid": self.kid, "use": "sig", "alg": self.alg}

    def public_pem(self) -> bytes:
        pem: bytes = self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem

    def token(self, kid: str | None = "", **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": ISS, "aud": AUD, "sub": "alice", "iat": now, "exp": now + 600, **claims}
        body = {k: v for k, v in body.items() if v is not None}
        headers = {"kid": self.kid if kid == "" else kid} if kid is not None else {}
        return jwt.encode(body, self.key, algorithm=self.alg, headers=headers)


def b64(d: dict[str, Any] | bytes) -> str:
    raw = d if isinstance(d, bytes) else json.dumps(d).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unsigned_token(**claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISS, "aud": AUD, "sub": "x", "exp": now + 600, **claims}
    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(body)}."


def hs_confused_token(signer: Signer, kid: str | None = None) -> str:
    """HS256 signed with the RSA public key's PEM as the secret: the classic algorithm confusion."""
    import hashlib
    import hmac

    now = int(time.time())
    header = {"alg": "HS256", "typ": "JWT", **({"kid": kid} if kid else {})}
    signing_input = (
        f"{b64(header)}.{b64({'iss': ISS, 'aud': AUD, 'sub': 'mallory', 'role': 'admin', 'exp': now + 600})}"
    )
    sig = hmac.new(signer.public_pem(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(sig)}"


@pytest.fixture(scope="module")
def rsa_a() -> Signer:
    return Signer("a")


@pytest.fixture(scope="module")
def rsa_b() -> Signer:
    return Signer("b")


@pytest.fixture(scope="module")
def ec_c() -> Signer:
    return Signer("c", "EC")


class FakeFetch:
    def __init__(self, docs: dict[str, Any]) -> None:
        self.docs = docs
        self.calls: list[str] = []
        self.fail = False

    async def __call__(self, url: str) -> Any:
        self.calls.append(url)
        await asyncio.sleep(0)
        if self.fail or url not in self.docs:
            raise FetchError(f"GET {url}: HTTP 503")
        return self.docs[url]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def verifier(cfg: JwtConfig, static: list[Any], remote: JwksSource | None = None, **kw: Any) -> JwtVerifier:
    return JwtVerifier(cfg, static, remote, **kw)


def cfg(**kw: Any) -> JwtConfig:
    return JwtConfig(issuer=ISS, audience=(AUD,), **kw)


def jwks_of(*signers: Signer) -> dict[str, Any]:
    return {"keys": [s.jwk() for s in signers]}


# ---- verification -----------------------------------------------------------------------------------


async def test_valid_rs256_and_es256(rsa_a: Signer, ec_c: Signer) -> None:
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a, ec_c)))
    p = (await v.verify(rsa_a.token(role="admin", tenant="t1"))).principal
    assert (p.subject, p.role, p.tenant, p.method) == ("alice", "admin", "t1", "jwt")
    p = (await v.verify(ec_c.token())).principal
    assert (p.role, p.tenant) == ("user", "default")


async def test_attack_and_bad_tokens_are_refused(rsa_a: Signer, rsa_b: Signer, ec_c: Signer) -> None:
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a, ec_c)))
    now = int(time.time())
    other_key_same_kid = Signer("a")  # signs with kid "a" but a different private key
    cases = [
        ("token_expired", rsa_a.token(exp=now - 120)),
        ("token_not_yet_valid", rsa_a.token(nbf=now + 600)),
        ("invalid_audience", rsa_a.token(aud="someone-else")),
        ("invalid_issuer", rsa_a.token(iss="https://evil.test")),
        ("missing_claim", rsa_a.token(exp=None)),
        ("invalid_algorithm", unsigned_token()),
        ("unknown_key", rsa_b.token()),  # kid "b" is not published
        ("invalid_signature", other_key_same_kid.token()),
        ("invalid_signature", "eyJhbGciOiJSUzI1NiJ9.bm90IGpzb24.c2ln"),
        ("malformed_token", "eyJhbGciOiJSUzI1NiJ9.e30"),
    ]
    for code, tok in cases:
        with pytest.raises(JwtError) as e:
            await v.verify(tok)
        assert e.value.code == code, (code, e.value.code)
        assert tok not in str(e.value)
    for tok in (hs_confused_token(rsa_a, "a"), hs_confused_token(rsa_a)):
        with pytest.raises(JwtError) as e:
            await v.verify(tok)
        assert e.value.code == "invalid_algorithm"


async def test_algorithm_must_fit_the_key_family(rsa_a: Signer, ec_c: Signer) -> None:
    # an ES256 token whose kid names an RSA key finds no key; RS384 is not allowed at all
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    with pytest.raises(JwtError) as e:
        await v.verify(ec_c.token(kid="a"))
    assert e.value.code == "unknown_key"
    tok = jwt.encode({"iss": ISS, "aud": AUD, "exp": int(time.time()) + 60}, rsa_a.key, "RS384", {"kid": "a"})
    with pytest.raises(JwtError) as e:
        await v.verify(tok)
    assert e.value.code == "invalid_algorithm"


async def test_hs_confusion_refused_even_when_hs256_is_allowed(rsa_a: Signer) -> None:
    c = cfg(algorithms=("RS256", "HS256"), hmac_secret_env="S")
    v = verifier(
        c, [*static_keys(c, {"S": "shared-secret-of-at-least-32-bytes!!"}), *keys_from_jwks(jwks_of(rsa_a))]
    )
    with pytest.raises(JwtError) as e:
        await v.verify(hs_confused_token(rsa_a))
    assert e.value.code == "invalid_signature"
    good = jwt.encode(
        {"iss": ISS, "aud": AUD, "sub": "svc", "exp": int(time.time()) + 60},
        "shared-secret-of-at-least-32-bytes!!",
        "HS256",
    )
    assert (await v.verify(good)).principal.subject == "svc"


async def test_leeway_accepts_a_token_just_expired(rsa_a: Signer) -> None:
    keys = keys_from_jwks(jwks_of(rsa_a))
    now = int(time.time())
    just_expired = rsa_a.token(sub="late", exp=now - 5)
    p = (await verifier(cfg(leeway_secs=30), keys).verify(just_expired)).principal
    assert (p.subject, p.method) == ("late", "jwt")
    # the same token without leeway, and a token expired for longer than the leeway, are refused
    with pytest.raises(JwtError) as e:
        await verifier(cfg(leeway_secs=0), keys).verify(just_expired)
    assert e.value.code == "token_expired"
    with pytest.raises(JwtError) as e:
        await verifier(cfg(leeway_secs=30), keys).verify(rsa_a.token(exp=now - 120))
    assert e.value.code == "token_expired"
    # the leeway applies to nbf too
    p = (await verifier(cfg(leeway_secs=30), keys).verify(rsa_a.token(nbf=now + 5))).principal
    assert p.subject == "alice"


async def test_verified_tokens_are_cached_until_expiry(rsa_a: Signer) -> None:
    clock = Clock()
    clock.t = time.time()
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)), clock=clock)
    tok = rsa_a.token(exp=int(clock.t) + 100)
    assert v.cached(tok) is None
    first = await v.verify(tok)
    assert v.cached(tok) is first
    clock.t += 101
    assert v.cached(tok) is None


async def test_cache_is_bounded(rsa_a: Signer) -> None:
    v = verifier(cfg(cache_size=3), keys_from_jwks(jwks_of(rsa_a)))
    toks = [rsa_a.token(sub=f"u{i}") for i in range(5)]
    for t in toks:
        await v.verify(t)
    assert [v.cached(t) is not None for t in toks] == [False, False, True, True, True]


async def test_oversized_token(rsa_a: Signer) -> None:
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)), max_token_bytes=100)
    with pytest.raises(JwtError) as e:
        await v.verify(rsa_a.token())
    assert e.value.code == "token_too_long"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300) | st.builds(lambda a, b, c: f"eyJ{a}.{b}.{c}", st.text(), st.text(), st.text()))
def test_garbage_is_refused_with_jwt_error(rsa_a: Signer, garbage: str) -> None:
    # with a real key loaded: a verifier that accepted garbage (or raised anything else) fails here
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    with pytest.raises(JwtError):
        asyncio.run(v.verify(garbage))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_change_to_a_valid_token_is_refused(rsa_a: Signer, data: st.DataObject) -> None:
    """Mutate one character of a valid token (header, claims or signature): refused, never accepted with
    other claims. The unchanged token is accepted (the test is not vacuous)."""
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    tok = rsa_a.token(sub="alice")
    assert asyncio.run(v.verify(tok)).principal.subject == "alice"
    i = data.draw(st.integers(0, len(tok) - 1))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.="
    c = data.draw(st.sampled_from(alphabet).filter(lambda ch: ch != tok[i]))
    bad = tok[:i] + c + tok[i + 1 :]
    try:
        got = asyncio.run(v.verify(bad))
    except JwtError:
        return
    # base64url's last character may carry unused bits: a change there can decode to the same bytes
    assert (
        base64.urlsafe_b64decode(_pad(bad.split(".")[2])) == base64.urlsafe_b64decode(_pad(tok.split(".")[2]))
        and bad.split(".")[:2] == tok.split(".")[:2]
    ), f"a changed token was accepted: {got.principal}"


def _pad(s: str) -> str:
    return s + "=" * (-len(s) % 4)


def test_claims_to_principal() -> None:
    c = cfg(role_claim="realm_access.roles", admin_scopes=("smg:admin",), tenant_claim="org")
    p = principal_from_claims(
        {"sub": "bob", "realm_access": {"roles": ["viewer", "admin"]}, "org": "o1"}, c, "d"
    )
    assert (p.subject, p.role, p.tenant) == ("bob", "admin", "o1")
    p = principal_from_claims({"sub": 7, "scope": "openid smg:admin"}, c, "d")
    assert (p.subject, p.role, p.tenant) == ("7", "admin", "d")
    p = principal_from_claims({"sub": "x", "scope": ["openid"], "org": ""}, c, "d")
    assert (p.subject, p.role, p.tenant) == ("x", "user", "d")
    p = principal_from_claims({"sub": "x", "role": "admin"}, cfg(tenant_claim=None), "d")
    assert p.role == "admin"
    # no subject: a 401 (what such tokens stored would be every such token's), not a shared name
    for claims in ({"scope": ["openid"]}, {"sub": ""}, {"sub": None}, {"sub": True}, {"sub": ["a"]}):
        with pytest.raises(JwtError) as ei:
            principal_from_claims(claims, c, "d")
        assert ei.value.code == "missing_claim"


def test_owners_never_meet_across_sources_tenants_and_issuers() -> None:
    c = cfg(tenant_claim="org")
    a = principal_from_claims({"sub": "key_1", "iss": "https://a", "org": "t"}, c, "d")
    b = principal_from_claims({"sub": "key_1", "iss": "https://b", "org": "t"}, c, "d")
    t = principal_from_claims({"sub": "key_1", "iss": "https://a", "org": "u"}, c, "d")
    key = Principal(subject="key_1", tenant="t", role="user", key_id="key_1", method="api_key")
    cert = Principal(subject="key_1", tenant="t", role="user", method="mtls")
    owners = {p.owner for p in (a, b, t, key, cert)}
    assert len(owners) == 5
    assert a.owner == principal_from_claims({"sub": "key_1", "iss": "https://a", "org": "t"}, c, "d").owner


async def test_time_claims_must_be_numbers(rsa_a: Signer) -> None:
    """RFC 7519 2 NumericDate: pyjwt checks a digit-string exp too, but the verified-token cache would
    keep such a token past it; any non-number time claim is refused."""
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    now = int(time.time())
    for name, value in (("exp", str(now + 60)), ("nbf", str(now - 5)), ("iat", str(now))):
        claims: dict[str, Any] = {name: value}
        with pytest.raises(JwtError) as ei:
            await v.verify(rsa_a.token(**claims))
        assert ei.value.code == "invalid_token", (name, ei.value)


async def test_a_non_ascii_token_is_malformed_not_a_crash(rsa_a: Signer) -> None:
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    for token in ("eyJhbGciOiJSUzI1NiJ9.\udce9\udce9.x", "eyJhbGciOiJSUzI1NiJ9\udce9.e30.x"):
        with pytest.raises(JwtError) as ei:
            await v.verify(token)
        assert ei.value.code == "malformed_token"


# ---- key files ------------------------------------------------------------------------------------


async def test_static_key_files(tmp_path: Path, rsa_a: Signer, ec_c: Signer) -> None:
    (tmp_path / "a.pem").write_bytes(rsa_a.public_pem())
    (tmp_path / "c.jwk").write_text(json.dumps(ec_c.jwk()))
    (tmp_path / "set.json").write_text(json.dumps(jwks_of(rsa_a, ec_c)))
    assert keys_from_file(tmp_path / "a.pem")[0].family == "RSA"
    assert keys_from_file(tmp_path / "c.jwk")[0].kid == "c"
    assert len(keys_from_file(tmp_path / "set.json")) == 2
    c = cfg(public_key_files=(str(tmp_path / "a.pem"), str(tmp_path / "c.jwk")))
    v = verifier(c, static_keys(c))
    await v.verify(rsa_a.token(kid=None))  # a PEM key has no kid: tokens without one use it
    await v.verify(rsa_a.token(kid="whatever"))
    await v.verify(ec_c.token())
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(KeyLoadError):
        keys_from_file(tmp_path / "bad.pem")
    (tmp_path / "oct.json").write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}))
    with pytest.raises(KeyLoadError):
        keys_from_file(tmp_path / "oct.json")  # symmetric keys are never taken from a key set


# ---- JWKS source ----------------------------------------------------------------------------------

DISCOVERY = ISS + "/.well-known/openid-configuration"
JWKS_URL = ISS + "/keys"


def source(docs: dict[str, Any], clock: Clock, **kw: Any) -> tuple[JwksSource, FakeFetch]:
    f = FakeFetch(docs)
    c = cfg(jwks_min_refresh_secs=10.0, jwks_ttl_secs=300.0, **kw)
    return JwksSource(c, f, clock), f


async def test_discovery_then_rotation_with_rate_limit(rsa_a: Signer, rsa_b: Signer, ec_c: Signer) -> None:
    clock = Clock()
    docs: dict[str, Any] = {DISCOVERY: {"issuer": ISS, "jwks_uri": JWKS_URL}, JWKS_URL: jwks_of(rsa_a)}
    src, f = source(docs, clock)
    v = verifier(src.cfg, [], src)
    await v.verify(rsa_a.token())
    assert f.calls == [DISCOVERY, JWKS_URL]
    # rotation: kid "b" appears; the first token that names it makes the source refetch, if allowed
    docs[JWKS_URL] = jwks_of(rsa_a, rsa_b)
    clock.t += 5
    with pytest.raises(JwtError) as e:
        await v.verify(rsa_b.token())  # within the minimum interval: no fetch
    assert e.value.code == "unknown_key" and len(f.calls) == 2
    clock.t += 6
    await v.verify(rsa_b.token())
    assert f.calls[-1] == JWKS_URL and len(f.calls) == 3  # discovery is not repeated
    # a flood of unknown kids costs at most one fetch per interval
    for i in range(20):
        with pytest.raises(JwtError):
            await v.verify(ec_c.token(kid=f"nope-{i}"))
    assert len(f.calls) == 3


async def test_concurrent_first_use_shares_one_fetch(rsa_a: Signer) -> None:
    clock = Clock()
    src, f = source({DISCOVERY: {"issuer": ISS, "jwks_uri": JWKS_URL}, JWKS_URL: jwks_of(rsa_a)}, clock)
    v = verifier(dataclasses.replace(src.cfg, cache_size=0), [], src)
    tok = rsa_a.token()
    await asyncio.gather(*(v.verify(tok) for _ in range(10)))
    assert f.calls == [DISCOVERY, JWKS_URL]


async def test_ttl_refresh_in_background_and_failure_keeps_the_cache(rsa_a: Signer, rsa_b: Signer) -> None:
    clock = Clock()
    docs: dict[str, Any] = {JWKS_URL: jwks_of(rsa_a)}
    src, f = source(docs, clock, jwks_url=JWKS_URL)
    v = verifier(dataclasses.replace(src.cfg, cache_size=0), [], src)
    await v.verify(rsa_a.token())
    assert f.calls == [JWKS_URL]
    clock.t += 301
    f.fail = True
    await v.verify(rsa_a.token())  # stale keys answer; a refresh starts in the background
    await asyncio.sleep(0.01)
    assert len(f.calls) == 2 and src.keys  # it failed: the cached keys stay
    await v.verify(rsa_a.token())
    assert len(f.calls) == 2  # no retry on every request
    clock.t += 11
    f.fail = False
    docs[JWKS_URL] = jwks_of(rsa_b)  # a was retired
    await v.verify(rsa_a.token())
    await asyncio.sleep(0.01)
    assert len(f.calls) == 3 and [k.kid for k in src.keys] == ["b"]
    with pytest.raises(JwtError):
        await v.verify(rsa_a.token())


async def test_discovery_must_name_the_same_issuer(rsa_a: Signer) -> None:
    clock = Clock()
    src, f = source(
        {DISCOVERY: {"issuer": "https://evil", "jwks_uri": JWKS_URL}, JWKS_URL: jwks_of(rsa_a)}, clock
    )
    v = verifier(src.cfg, [], src)
    with pytest.raises(JwtError) as e:
        await v.verify(rsa_a.token())
    assert e.value.code == "unknown_key" and f.calls == [DISCOVERY]


async def test_a_discovered_jwks_uri_in_the_clear_is_refused(rsa_a: Signer) -> None:
    # an issuer on loopback over http (a local IdP) may not send the node to fetch keys in the clear
    # from elsewhere
    clock = Clock()
    local = "http://127.0.0.1:8080"
    f = FakeFetch(
        {
            local + "/.well-known/openid-configuration": {
                "issuer": local,
                "jwks_uri": "http://idp.example/k",
            },
            "http://idp.example/k": jwks_of(rsa_a),
        }
    )
    src = JwksSource(JwtConfig(issuer=local, audience=(AUD,)), f, clock)
    v = verifier(src.cfg, [], src)
    with pytest.raises(JwtError) as e:
        await v.verify(rsa_a.token(iss=local))
    assert e.value.code == "unknown_key" and f.calls == [local + "/.well-known/openid-configuration"]


async def test_remote_symmetric_keys_are_ignored(rsa_a: Signer) -> None:
    clock = Clock()
    doc = {"keys": [{"kty": "oct", "k": b64(rsa_a.public_pem()), "kid": "h"}, rsa_a.jwk()]}
    src, _ = source({JWKS_URL: doc}, clock, jwks_url=JWKS_URL)
    v = verifier(cfg(algorithms=("RS256", "HS256"), hmac_secret_env="X"), [], src)
    with pytest.raises(JwtError):
        await v.verify(hs_confused_token(rsa_a, "h"))
    assert [k.kid for k in src.keys] == ["a"]


async def test_an_empty_or_broken_key_set_does_not_replace_the_cached_keys(rsa_a: Signer) -> None:
    clock = Clock()
    docs: dict[str, Any] = {JWKS_URL: jwks_of(rsa_a)}
    src, f = source(docs, clock, jwks_url=JWKS_URL)
    v = verifier(dataclasses.replace(src.cfg, cache_size=0), [], src)
    await v.verify(rsa_a.token())
    bads: list[Any] = [{"keys": []}, {"keys": "nope"}, ["not", "an", "object"]]
    for bad in bads:
        docs[JWKS_URL] = bad
        clock.t += 400
        await v.verify(rsa_a.token())  # the cached key answers while the refresh fails
        await asyncio.sleep(0.01)
        assert [k.kid for k in src.keys] == ["a"]
    assert len(f.calls) == 4


async def test_http_fetch_refuses_bad_answers() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"keys": []})

    async def text(request: web.Request) -> web.Response:
        return web.Response(text="<html>")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"[" + b"0," * 600 + b"0]")

    app = web.Application()
    app.add_routes([web.get("/ok", ok), web.get("/text", text), web.get("/big", big)])
    async with TestServer(app) as server:
        fetch = HttpFetch(timeout=5.0, max_bytes=1000)
        try:
            assert await fetch(str(server.make_url("/ok"))) == {"keys": []}
            for path in ("/missing", "/text", "/big"):
                with pytest.raises(FetchError):
                    await fetch(str(server.make_url(path)))
        finally:
            await fetch.close()
    refused = HttpFetch(timeout=1.0)
    try:
        with pytest.raises(FetchError):
            await refused("http://127.0.0.1:1/nothing")
    finally:
        await refused.close()


async def test_an_exp_past_a_floats_range_is_no_crash(rsa_a: Signer) -> None:
    """A signed integer exp too large for a float: verified (a time far away), cached until the cache's
    own limit, never an OverflowError (a 500)."""
    v = verifier(cfg(), keys_from_jwks(jwks_of(rsa_a)))
    got = await v.verify(rsa_a.token(exp=10**400))
    assert got.principal.subject == "alice" and got.until <= time.time() + cfg().jwks_ttl_secs


def test_owners_are_unambiguous_whatever_the_names_hold() -> None:
    victim = Principal(subject="a::b", tenant="t", role="user", method="mtls")
    other = Principal(subject="b", tenant="t::a", role="user", method="mtls")
    assert victim.owner != other.owner
