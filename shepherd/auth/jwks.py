"""Verification keys for JWTs: static keys from files, and a JWKS endpoint (explicit or found through OIDC
discovery) cached with refresh.

Each key carries its *family* (RSA, an EC curve, Ed25519, HMAC) and optionally the algorithm its JWK
pins; a token's ``alg`` only ever selects keys of the matching family, so an HS256 token can never be
checked against an RSA public key used as an HMAC secret (algorithm confusion), and ``none`` matches no
key at all. Symmetric keys found in a remote JWKS are ignored.

``JwksSource`` keeps the fetched keys:

- the first use waits for a fetch; after ``jwks_ttl_secs`` the keys are refreshed in the background
  while the cached ones keep serving (stale-while-revalidate);
- a token whose ``kid`` is unknown triggers a fetch (key rotation), at most one per
  ``jwks_min_refresh_secs`` however many unknown kids arrive;
- one fetch at a time (callers share it); a failed fetch keeps the cached keys.

Fetching goes through an injected ``Fetch`` (``HttpFetch``: aiohttp, bounded in time and size), the clock
is injected: unit tests drive it with fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from jwt import PyJWK
from jwt.exceptions import PyJWKError

from shepherd.auth.config import JwtConfig, key_url_ok

log = logging.getLogger("shepherd.auth")

_CURVES = {"secp256r1": "EC-P-256", "secp384r1": "EC-P-384", "secp521r1": "EC-P-521"}
ALG_FAMILY = {
    **dict.fromkeys(("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"), "RSA"),
    "ES256": "EC-P-256",
    "ES384": "EC-P-384",
    "ES512": "EC-P-521",
    "EdDSA": "OKP",
    **dict.fromkeys(("HS256", "HS384", "HS512"), "HMAC"),
}
MAX_DOCUMENT_BYTES = 1 << 20


class KeyLoadError(ValueError):
    """A key file or JWKS document holds no usable key."""


@dataclass(frozen=True, slots=True)
class VerifyKey:
    kid: str | None
    key: Any  # a cryptography public key, or bytes for HMAC
    family: str
    alg: str | None = None  # pinned by the JWK's "alg"

    def fits(self, alg: str) -> bool:
        return ALG_FAMILY.get(alg) == self.family and (self.alg is None or self.alg == alg)


def family_of(key: Any) -> str | None:
    if isinstance(key, rsa.RSAPublicKey):
        return "RSA"
    if isinstance(key, ec.EllipticCurvePublicKey):
        return _CURVES.get(key.curve.name)
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return "OKP"
    return None


def _public(key: Any) -> Any:
    if isinstance(
        key,
        rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey,
    ):
        return key.public_key()
    return key


def key_from_jwk(jwk: Any) -> VerifyKey | None:
    """One JWK as a verification key; None when it is unusable, symmetric or not for signatures."""
    if not isinstance(jwk, dict) or jwk.get("kty") == "oct" or jwk.get("use", "sig") != "sig":
        return None
    try:
        pk = PyJWK(jwk)
    except (PyJWKError, ValueError, TypeError, KeyError):
        return None
    key = _public(pk.key)
    fam = family_of(key)
    if fam is None:
        return None
    kid = jwk.get("kid")
    alg = jwk.get("alg")
    return VerifyKey(
        kid=kid if isinstance(kid, str) else None,
        key=key,
        family=fam,
        alg=alg if isinstance(alg, str) else None,
    )


def keys_from_jwks(doc: Any) -> list[VerifyKey]:
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise KeyLoadError("a JWKS document must be an object with a 'keys' list")
    return [k for k in (key_from_jwk(j) for j in doc["keys"]) if k is not None]


def keys_from_file(path: str | Path) -> list[VerifyKey]:
    """A PEM public key or certificate, a JWK, or a JWKS file."""
    data = Path(path).read_bytes()
    if data.lstrip().startswith(b"{"):
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise KeyLoadError(f"{path}: not valid JSON: {e}") from None
        keys = keys_from_jwks(doc) if isinstance(doc, dict) and "keys" in doc else []
        if not keys and isinstance(doc, dict) and "kty" in doc:
            one = key_from_jwk(doc)
            keys = [one] if one is not None else []
    else:
        try:
            if b"CERTIFICATE" in data:
                pub: Any = x509.load_pem_x509_certificate(data).public_key()
            else:
                pub = load_pem_public_key(data)
        except ValueError as e:
            raise KeyLoadError(f"{path}: not a PEM public key or certificate: {e}") from None
        fam = family_of(pub)
        keys = [VerifyKey(kid=None, key=pub, family=fam)] if fam else []
    if not keys:
        raise KeyLoadError(f"{path}: no usable signature verification key")
    return keys


def static_keys(cfg: JwtConfig, environ: dict[str, str] | None = None) -> list[VerifyKey]:
    env = os.environ if environ is None else environ
    keys: list[VerifyKey] = []
    for p in cfg.public_key_files:
        keys += keys_from_file(p)
    if cfg.hmac_secret_env:
        secret = env.get(cfg.hmac_secret_env)
        if not secret:
            raise KeyLoadError(f"environment variable {cfg.hmac_secret_env} (JWT HMAC secret) is unset")
        keys.append(VerifyKey(kid=None, key=secret.encode(), family="HMAC"))
    return keys


def select(keys: Iterable[VerifyKey], kid: str | None, alg: str) -> list[VerifyKey]:
    """Keys that may have signed a token with this header, all of the algorithm's family (and pinned alg):
    a token naming a kid gets the key with that kid, else the keys without a kid; a token without a kid
    gets every fitting key."""
    fitting = [k for k in keys if k.fits(alg)]
    if kid is None:
        return fitting
    named = [k for k in fitting if k.kid == kid]
    return named or [k for k in fitting if k.kid is None]


# ---------------------------------------------------------------------------------------------- fetching

Fetch = Callable[[str], Awaitable[Any]]


class FetchError(Exception):
    pass


async def _read_capped(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body, however many chunks it arrives in, up to ``limit`` bytes (one more byte tells the
    caller it was larger). ``StreamReader.read(n)`` returns what has arrived so far, not ``n`` bytes."""
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await stream.read(limit + 1 - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


class HttpFetch:
    """GET a JSON document with aiohttp (one session, bounded time and size)."""

    def __init__(self, timeout: float = 5.0, max_bytes: int = MAX_DOCUMENT_BYTES) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max = max_bytes
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(url, headers={"Accept": "application/json"}) as r:
                if r.status != 200:
                    raise FetchError(f"GET {url}: HTTP {r.status}")
                # keys over plain HTTP (but from a loopback host): no, also not through a redirect
                if (url.startswith("https://") and r.url.scheme != "https") or not key_url_ok(str(r.url)):
                    raise FetchError(f"GET {url}: redirected off HTTPS")
                body = await _read_capped(r.content, self._max)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise FetchError(f"GET {url}: {type(e).__name__}: {e}") from None
        if len(body) > self._max:
            raise FetchError(f"GET {url}: document larger than {self._max} bytes")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise FetchError(f"GET {url}: not JSON") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class JwksSource:
    """Keys from a JWKS endpoint; see the module docstring for the refresh rules."""

    def __init__(self, cfg: JwtConfig, fetch: Fetch, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._fetch = fetch
        self._clock = clock
        self.keys: list[VerifyKey] = []
        self.loaded = False  # a fetch has succeeded once
        self.fetches = 0  # fetch attempts (observability and tests)
        self._jwks_uri = cfg.jwks_url
        self._stale_at = 0.0  # refresh in the background from then on
        self._last_attempt: float | None = None
        self._task: asyncio.Task[None] | None = None

    def _may_fetch(self, now: float) -> bool:
        return self._last_attempt is None or now - self._last_attempt >= self.cfg.jwks_min_refresh_secs

    async def _discover(self) -> str:
        issuer = (self.cfg.issuer or "").rstrip("/")
        doc = await self._fetch(issuer + "/.well-known/openid-configuration")
        if not isinstance(doc, dict) or not isinstance(doc.get("jwks_uri"), str):
            raise FetchError("the OIDC discovery document has no jwks_uri")
        if str(doc.get("issuer", "")).rstrip("/") != issuer:
            raise FetchError("the OIDC discovery document names another issuer")
        uri: str = doc["jwks_uri"]
        if not key_url_ok(uri) or (issuer.startswith("https://") and not uri.startswith("https://")):
            raise FetchError("the OIDC discovery document's jwks_uri is not HTTPS")
        return uri

    async def _load(self) -> None:
        self.fetches += 1
        self._last_attempt = self._clock()
        try:
            if self._jwks_uri is None:
                self._jwks_uri = await self._discover()
            keys = keys_from_jwks(await self._fetch(self._jwks_uri))
            if not keys:
                raise KeyLoadError("the JWKS holds no usable signature key")
        except Exception as e:  # never a 500 for a caller: a fetch that fails in any way is a failed fetch
            # keep serving what we have; try again after the minimum interval, not on every request
            self._stale_at = self._clock() + max(self.cfg.jwks_min_refresh_secs, 1.0)
            log.warning("JWKS fetch failed (%d keys cached): %s", len(self.keys), e)
            return
        self.keys = keys
        self.loaded = True
        self._stale_at = self._clock() + self.cfg.jwks_ttl_secs

    def _refresh(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._load())
        return self._task

    def _in_flight(self) -> bool:
        return self._task is not None and not self._task.done()

    def known(self, kid: str | None, alg: str) -> list[VerifyKey] | None:
        """The cached keys that fit, without waiting (None: none, ``candidates`` must be awaited: the
        first fetch, or a kid that may be new). Stale keys start their background refresh, as there."""
        if not self.loaded:
            return None
        now = self._clock()
        if now >= self._stale_at and self._may_fetch(now):
            self._refresh()
        return select(self.keys, kid, alg) or None

    async def candidates(self, kid: str | None, alg: str) -> list[VerifyKey]:
        now = self._clock()
        if not self.loaded:
            if self._in_flight() or self._may_fetch(now):
                await asyncio.shield(self._refresh())
        elif now >= self._stale_at and self._may_fetch(now):
            self._refresh()  # in the background: the cached keys answer this call
        found = select(self.keys, kid, alg)
        if not found and kid is not None and (self._in_flight() or self._may_fetch(self._clock())):
            await asyncio.shield(self._refresh())  # maybe a rotation: a new kid
            found = select(self.keys, kid, alg)
        return found

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
