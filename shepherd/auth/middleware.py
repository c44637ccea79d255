"""Who may call the node: the authenticator (credentials → principal) and its aiohttp middleware.

Routes fall in three planes, decided once per route from its template (never from the raw path, so
``/v1/../workers`` tricks see the route the router picked):

- public: the probes ``/health``, ``/liveness``, ``/readiness`` (and ``/metrics`` with
  ``auth.metrics: false``) — never authenticated;
- control: ``/workers*``, ``/admin/*``, ``/mesh/*`` and ``/metrics`` — the ``admin`` role (and, with an
  admin listener, only there: ``shepherd.auth.control``);
- data: everything else (``/v1/*``, ``/tokenize``, unknown paths) — ``user`` or ``admin``.

The control plane's mode defaults to the data plane's (``shepherd.auth.config``). ``x-smg-target-worker``
(route to one worker, bypassing the health checks and the circuit breaker) is honoured for admin
principals only: a user sending it gets a 403 (with the data plane's auth off every caller is the
anonymous admin).

Each plane's mode is off, api_key, jwt or both. Credentials come from ``Authorization: Bearer <c>``, or
``x-api-key: <c>`` (what Anthropic clients send). With ``both``, a credential shaped like a JWT is
checked as one and anything else as an API key. A plane that is off gives ``ANONYMOUS``. On a plane
that is on, a verified TLS client certificate mapped by ``auth.client_cert`` is one more credential
(``shepherd.auth.client_cert``: which one wins when a bearer credential is sent too is its ``prefer``).

Tenant: the key record's, or the JWT's tenant claim; ``x-smg-tenant`` is read only with
``trust_tenant_header``, and then sets the tenant of principals not bound to one (keys without a tenant,
tokens without the claim, anonymous callers) and of admins (who act for tenants); a user bound to a
tenant cannot leave it.

Refusals are answered here (never raised to a 500): 401 with ``WWW-Authenticate: Bearer`` or 403, in
the OpenAI error envelope (Anthropic's on the Messages API routes, ``/v1/messages*``). Messages never
hold the credential.

Guessing: a client address whose presented credentials failed ``auth.failure_limit`` times within
``auth.failure_window_secs`` (a token bucket per address, IPv6 per /64: ``FailureLimiter``) is answered
429 with ``Retry-After`` (code ``auth_rate_limited``) on the planes that authenticate, before any
credential is looked at, until the bucket refills. Only distinct failed credentials count (not a request
without one, nor the same bad key again); a request that authenticates is never delayed. Behind a proxy
every client shares its address.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter

from shepherd.auth.client_cert import CertMapper, CertPrincipal
from shepherd.auth.config import AuthConfig, AuthMode
from shepherd.auth.jwks import HttpFetch, JwksSource, static_keys
from shepherd.auth.jwt_verify import JwtError, JwtVerifier, looks_like_jwt
from shepherd.auth.keys import (
    MIN_KEY_CHARS,
    ApiKeyRecord,
    KeyStore,
    MemoryKeyStore,
    bootstrap_records,
    hash_key,
    principal_for,
    short_env_keys,
)
from shepherd.auth.principal import ANONYMOUS, PRINCIPAL_KEY, Principal
from shepherd.proto.addresses import client_key
from shepherd.proto.anthropic_errors import anthropic_error_response, is_messages_path
from shepherd.proto.openai_errors import ApiError, error_response

log = logging.getLogger("shepherd.auth")

Plane = Literal["public", "data", "control"]
PUBLIC_ROUTES = frozenset({"/health", "/liveness", "/readiness", "/ping"})
# /flush_cache acts on every engine, /get_loads names the workers' URLs: the control plane's, as in SMG
CONTROL_PREFIXES = (
    "/workers",
    "/admin",
    "/mesh",
    "/flush_cache",
    "/reset_prefix_cache",
    "/get_loads",
    "/add_worker",  # SMG's older worker admin
    "/list_workers",
    "/remove_worker",
)
TENANT_HEADER = "x-smg-tenant"
TARGET_WORKER_HEADER = "x-smg-target-worker"
MAX_TENANT_CHARS = 128
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
FAILURE_CLIENTS_MAX = 10_000  # client addresses whose failures are remembered (the oldest forgotten)


class AuthFailure(Exception):
    """A refused request: 401 (no or bad credential) or 403 (a credential without the right)."""

    def __init__(
        self, status: int, message: str, code: str, *, presented: bool = True, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.presented = presented  # a credential was sent (RFC 6750: error="invalid_token")
        self.retry_after = retry_after  # seconds (429)

    def response(self, anthropic: bool = False) -> web.Response:
        """The refusal in the OpenAI envelope (``anthropic``: Anthropic's, for the Messages routes)."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = (
                'Bearer realm="shepherd", error="invalid_token"'
                if self.presented
                else 'Bearer realm="shepherd"'
            )
        typ = _TYPES.get(self.status, "invalid_request_error")
        err = ApiError(self.status, self.message, type=typ, code=self.code, headers=headers)
        return anthropic_error_response(err) if anthropic else error_response(err)


def plane_of(route: str | None, metrics_protected: bool) -> Plane:
    """The plane of a route template (``None``: no route matched)."""
    if route is None:
        return "data"
    if route in PUBLIC_ROUTES:
        return "public"
    if route == "/metrics":
        return "control" if metrics_protected else "public"
    for p in CONTROL_PREFIXES:
        if route == p or route.startswith(p + "/"):
            return "control"
    return "data"


def request_planes(metrics_protected: bool) -> Callable[[web.Request], tuple[str | None, Plane]]:
    """A request's matched route template (None: none matched) and its plane, each route's plane decided
    once (``plane_of``) and kept: the auth middleware and the control middleware each hold one."""
    planes: dict[str | None, Plane] = {}

    def route_plane(request: web.Request) -> tuple[str | None, Plane]:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else None
        plane = planes.get(route)
        if plane is None:
            plane = planes[route] = plane_of(route, metrics_protected)
        return route, plane

    return route_plane


def has_credential(headers: Mapping[str, str]) -> bool:
    """A bearer credential was sent (well formed or not)."""
    return "Authorization" in headers or bool((headers.get("x-api-key") or "").strip())


def credential(headers: Mapping[str, str], max_bytes: int) -> str:
    """The presented credential; raises ``AuthFailure`` when there is none or it is unusable. Either field
    sent twice is refused (400), as a second ``Host`` is: a proxy that reads the last copy and this node,
    which would read the first, could disagree about who calls (RFC 9110 §5.3: a single-valued field); and
    both fields naming different credentials, for the same reason (the same one in both is that one)."""
    getall = getattr(headers, "getall", None)  # (a multidict: the request's own headers)
    if getall is not None and (len(getall("Authorization", ())) > 1 or len(getall("x-api-key", ())) > 1):
        raise AuthFailure(
            400, "More than one Authorization or x-api-key header field.", "duplicate_credentials"
        )
    raw = headers.get("Authorization")
    other = (headers.get("x-api-key") or "").strip()
    if raw is not None:
        scheme, _, cred = raw.partition(" ")
        if scheme.lower() != "bearer":
            raise AuthFailure(401, "Use 'Authorization: Bearer <key or token>'.", "invalid_auth_scheme")
        cred = cred.strip()
        if other and other != cred:  # two callers named at once: which one a proxy reads is anyone's guess
            raise AuthFailure(
                400,
                "Authorization and x-api-key name different credentials: send one (or the same in both).",
                "duplicate_credentials",
            )
    else:
        cred = other
    if not cred:
        raise AuthFailure(
            401,
            "No credential: send 'Authorization: Bearer <key or token>' (or 'x-api-key: <key>').",
            "missing_credentials",
            presented=False,
        )
    if len(cred) > max_bytes:
        raise AuthFailure(401, "The credential is too long.", "credential_too_long")
    return cred


class FailureLimiter:
    """Failed authentications per client address: a token bucket of ``limit`` tokens refilled at
    ``limit / window`` a second, one token per failed credential; an address with less than one token
    left is refused (``blocked``) until it refills. A credential that failed from that address lately
    (one of its last ``RECENT`` distinct ones) costs nothing again: guessing needs new credentials, and a
    client retrying a stale key (behind a proxy, everyone's address) does not lock the others out. At
    most ``max_clients`` addresses are remembered, the one that failed least recently forgotten first;
    a full bucket is forgotten when next looked at."""

    RECENT = 8

    def __init__(
        self,
        limit: int,
        window: float,
        *,
        max_clients: int = FAILURE_CLIENTS_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = float(limit)
        self.rate = limit / window  # tokens a second
        self.max_clients = max_clients
        self._clock = clock
        # key -> (tokens, at, the digests of its last distinct failed credentials)
        self._buckets: OrderedDict[str, tuple[float, float, tuple[bytes, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, key: str, now: float) -> float:
        hit = self._buckets.get(key)
        if hit is None:
            return self.limit
        return min(self.limit, hit[0] + (now - hit[1]) * self.rate)

    def blocked(self, remote: str | None) -> int | None:
        """Seconds (at least 1) until ``remote`` may try again; None: it may now."""
        key = client_key(remote)
        if key not in self._buckets:
            return None
        tokens = self._tokens(key, self._clock())
        if tokens >= self.limit:
            del self._buckets[key]
            return None
        if tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - tokens) / self.rate))

    def failed(self, remote: str | None, credential: str = "") -> None:
        """``remote`` presented ``credential`` (the header's value) and it failed."""
        key = client_key(remote)
        now = self._clock()
        digest = hashlib.blake2b(credential.encode("utf-8", "surrogateescape"), digest_size=8).digest()
        hit = self._buckets.get(key)
        recent = hit[2] if hit is not None else ()
        tokens = self._tokens(key, now)
        if digest not in recent:
            tokens = max(0.0, tokens - 1.0)
            recent = (*recent[-(self.RECENT - 1) :], digest)
        self._buckets[key] = (tokens, now, recent)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Authenticated:
    principal: Principal
    record: ApiKeyRecord | None = None  # the API key, when one was used


# the body gate's outcome for a request (the lean server's, at its head): the caller or its refusal, which
# the middleware takes instead of checking the credential again (a token's signature check is the costly
# part, and a caller can send bad tokens at will)
_AT_HEAD: web.RequestKey[Authenticated | AuthFailure] = web.RequestKey("shepherd.auth.at_head")


class Authenticator:
    """Credentials → principal, for one plane's mode. No I/O except a JWKS fetch on a cold JWT path."""

    def __init__(
        self,
        cfg: AuthConfig,
        store: KeyStore,
        jwt: JwtVerifier | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.jwt = jwt
        self._clock = clock
        self._principals: dict[str, tuple[ApiKeyRecord, Principal]] = {}  # digest → (record, principal)
        # verified client certificates → principals (None: certificates authenticate no one)
        self.certs = CertMapper(cfg.client_cert, cfg.default_tenant) if cfg.client_cert.enabled else None
        # failed credentials per client address (None: not limited)
        self.failures = (
            FailureLimiter(cfg.failure_limit, cfg.failure_window_secs) if cfg.failure_limit > 0 else None
        )

    def mode(self, plane: Plane) -> AuthMode:
        if plane == "public":
            return "off"
        return self.cfg.control_plane if plane == "control" else self.cfg.data_plane

    def api_key(self, key: str) -> Authenticated:
        digest = hash_key(key)
        rec = self.store.find(digest)
        if rec is None:
            raise AuthFailure(401, "Invalid API key.", "invalid_api_key")
        if rec.revoked:
            raise AuthFailure(401, "The API key has been revoked.", "revoked_api_key")
        if rec.expires is not None and self._clock() >= rec.expires:
            raise AuthFailure(401, "The API key has expired.", "expired_api_key")
        hit = self._principals.get(digest)
        if hit is None or hit[0] is not rec:  # the record changed (revoked, replaced, re-applied)
            if len(self._principals) > 100_000:
                self._principals.clear()
            hit = self._principals[digest] = (rec, principal_for(rec, self.cfg.default_tenant))
        return Authenticated(hit[1], rec)

    def _is_jwt(self, mode: AuthMode, cred: str) -> bool:
        return mode == "jwt" or (mode == "both" and looks_like_jwt(cred))

    def authenticate_now(
        self, plane: Plane, headers: Mapping[str, str], peer: CertPrincipal | None = None
    ) -> Authenticated | None:
        """The caller, without waiting: None only when a JWT's keys must be fetched first (then
        ``authenticate``). Raises ``AuthFailure``. The hot path: keys and tokens whose keys are at hand
        (static, or a loaded JWKS) end here, refused or not.
        ``peer``: the principal of the connection's verified client certificate, if it maps to one."""
        mode = self.mode(plane)
        if mode == "off":
            return Authenticated(self._with_tenant(ANONYMOUS, False, headers))
        if peer is not None and (self.cfg.client_cert.prefer == "certificate" or not has_credential(headers)):
            return self._finish(plane, Authenticated(peer.principal), peer.tenant_bound, headers)
        cred = credential(headers, self.cfg.max_credential_bytes)
        if self._is_jwt(mode, cred):
            assert self.jwt is not None
            try:
                v = self.jwt.verify_now(cred)
            except JwtError as e:
                raise AuthFailure(401, str(e), e.code) from None
            if v is None:
                return None
            return self._finish(plane, Authenticated(v.principal), v.tenant_bound, headers)
        out = self.api_key(cred)
        return self._finish(plane, out, out.record is not None and out.record.tenant is not None, headers)

    async def authenticate(
        self, plane: Plane, headers: Mapping[str, str], peer: CertPrincipal | None = None
    ) -> Authenticated:
        """The caller of a route of ``plane``; raises ``AuthFailure``."""
        out = self.authenticate_now(plane, headers, peer)
        if out is not None:
            return out
        assert self.jwt is not None
        try:
            v = await self.jwt.verify(credential(headers, self.cfg.max_credential_bytes))
        except JwtError as e:
            raise AuthFailure(401, str(e), e.code) from None
        return self._finish(plane, Authenticated(v.principal), v.tenant_bound, headers)

    def _finish(
        self, plane: Plane, out: Authenticated, bound: bool, headers: Mapping[str, str]
    ) -> Authenticated:
        if plane == "control" and out.principal.role != "admin":
            raise AuthFailure(403, "This route needs the admin role.", "insufficient_role")
        if self.cfg.trust_tenant_header:
            out = dataclasses.replace(out, principal=self._with_tenant(out.principal, bound, headers))
        return out

    def _with_tenant(self, p: Principal, bound: bool, headers: Mapping[str, str]) -> Principal:
        if not self.cfg.trust_tenant_header or (bound and p.role != "admin"):
            return p
        name = self.cfg.tenant_header or TENANT_HEADER
        t = headers.get(name)
        if not t:
            return p
        if len(t) > MAX_TENANT_CHARS or not t.isprintable():
            raise AuthFailure(400, f"The {name} header is invalid.", "invalid_tenant")
        return dataclasses.replace(p, tenant=t)


# ---------------------------------------------------------------------------------------------- aiohttp

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthFailures:
    """``smg_auth_failures_total{plane,code}`` (codes are fixed strings: no credential in a label)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._c = (
            Counter(
                "smg_auth_failures",
                "Requests refused by authentication",
                ["plane", "code"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def inc(self, plane: str, code: str) -> None:
        if self._c is not None:
            self._c.labels(plane, code).inc()


def make_middleware(authn: Authenticator, failures: AuthFailures | None = None) -> Middleware:
    """The aiohttp middleware: put it after the error middleware (``install`` does)."""
    plane_for = request_planes(authn.cfg.metrics)
    count = failures or AuthFailures(None)
    certs = authn.certs
    limiter = authn.failures

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route, plane = plane_for(request)
        if plane == "public":
            return await handler(request)
        if limiter is not None and authn.mode(plane) != "off":
            wait = limiter.blocked(request.remote)
            if wait is not None:  # too many failures from there: the credential is not looked at
                count.inc(plane, "auth_rate_limited")
                refused = AuthFailure(
                    429,
                    "Too many failed authentication attempts from this address; retry later.",
                    "auth_rate_limited",
                    retry_after=wait,
                )
                return refused.response(anthropic=is_messages_path(request.path))
        try:
            who = request.get(_AT_HEAD)  # (the head's outcome: the credential is checked once a request)
            if isinstance(who, AuthFailure):
                raise who
            if who is None:
                peer = certs.from_transport(request.transport) if certs is not None else None
                who = authn.authenticate_now(plane, request.headers, peer) or await authn.authenticate(
                    plane, request.headers, peer
                )
            if plane == "data" and who.principal.role != "admin" and TARGET_WORKER_HEADER in request.headers:
                raise AuthFailure(
                    403, "The x-smg-target-worker header needs the admin role.", "target_worker_forbidden"
                )
            # (an API key's model list: checked by the routes on the model they resolve, the principal's
            # ``models``: the body's "model" alone missed ?model= and a request naming none)
        except AuthFailure as e:
            count.inc(plane, e.code)
            log.debug("refused %s %s: %s", request.method, route or "unmatched", e.code)
            if limiter is not None and e.status == 401 and e.presented:
                h = request.headers
                limiter.failed(request.remote, h.get("Authorization") or h.get("x-api-key") or "")
            return e.response(anthropic=is_messages_path(request.path))
        if who.principal is not ANONYMOUS:
            request[PRINCIPAL_KEY] = who.principal
        return await handler(request)

    return auth_middleware


def make_body_gate(authn: Authenticator) -> Callable[[web.Request], bool]:
    """Whether a request, its head just read, will be refused by the middleware above whatever its body:
    from an address refused for its failed attempts (429), with no credential, a malformed, unknown,
    revoked or expired key, or a token that does not verify (the checks that need no wait; a token whose
    keys must be fetched first passes, the middleware verifies it). The lean server then drops the body
    as it comes instead of buffering it (an unauthenticated caller could hold ``max_body`` a
    connection). The outcome stays on the request (``_AT_HEAD``): the middleware does not check the
    credential again."""
    plane_for = request_planes(authn.cfg.metrics)
    certs = authn.certs
    limiter = authn.failures

    def gate(request: web.Request) -> bool:
        _, plane = plane_for(request)
        if plane == "public" or authn.mode(plane) == "off":
            return False
        if limiter is not None and limiter.blocked(request.remote) is not None:
            return True
        try:
            peer = certs.from_transport(request.transport) if certs is not None else None
            who = authn.authenticate_now(plane, request.headers, peer)
        except AuthFailure as e:
            request[_AT_HEAD] = e
            return True
        if who is not None:
            request[_AT_HEAD] = who
        return False

    return gate


# ---------------------------------------------------------------------------------------------- assembly


class RedactBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (an oversized header, say) with the parser's message, which
    quotes the start of the offending line: possibly an ``Authorization`` value. Keep the event, drop the
    quote and the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.msg} ({type(exc).__name__}, answered {exc.code})"
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def redact_aiohttp_logs() -> None:
    lg = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RedactBadRequests) for f in lg.filters):
        lg.addFilter(RedactBadRequests())


@dataclass(slots=True)
class AuthState:
    cfg: AuthConfig
    store: KeyStore
    authenticator: Authenticator
    fetch: HttpFetch | None = None
    jwks: JwksSource | None = None
    bootstrap_ids: frozenset[str] = frozenset()  # the configuration's keys (local to this node)

    async def close(self) -> None:
        if self.jwks is not None:
            await self.jwks.close()
        if self.fetch is not None:
            await self.fetch.close()


AUTH: web.AppKey[AuthState] = web.AppKey("shepherd.auth")


def build_state(cfg: AuthConfig, store: KeyStore | None = None) -> AuthState:
    """The store (seeded with the bootstrap keys), the JWT verifier and the authenticator."""
    boot = bootstrap_records(cfg)
    for name, env, n in short_env_keys(cfg):
        log.warning(
            "auth key %r from environment variable %s is %d characters: a short key can be guessed; use "
            "at least %d random characters",
            name,
            env,
            n,
            MIN_KEY_CHARS,
        )
    if store is None:
        store = MemoryKeyStore(boot)
    else:
        store.apply(r.to_dict() for r in boot)  # configuration, not replicated: no change callback
    fetch: HttpFetch | None = None
    jwks: JwksSource | None = None
    verifier: JwtVerifier | None = None
    if cfg.uses_jwt:
        j = cfg.jwt
        if j.remote:
            fetch = HttpFetch(j.fetch_timeout_secs)
            jwks = JwksSource(j, fetch)
        if not j.audience:
            log.warning("JWT auth without an audience: tokens for any audience of the issuer are accepted")
        verifier = JwtVerifier(
            j,
            static_keys(j),
            jwks,
            default_tenant=cfg.default_tenant,
            max_token_bytes=cfg.max_credential_bytes,
        )
    return AuthState(
        cfg, store, Authenticator(cfg, store, verifier), fetch, jwks, frozenset(r.id for r in boot)
    )


def install(
    app: web.Application,
    cfg: AuthConfig,
    *,
    registry: CollectorRegistry | None = None,
    store: KeyStore | None = None,
) -> AuthState:
    """Put the auth state on the app and, when auth is on, the middleware after those already there
    (the error middleware stays outermost)."""
    state = build_state(cfg, store)
    app[AUTH] = state
    redact_aiohttp_logs()
    if cfg.enabled or cfg.trust_tenant_header:
        app.middlewares.append(make_middleware(state.authenticator, AuthFailures(registry)))

    async def _close(_app: web.Application) -> None:
        await state.close()

    app.on_cleanup.append(_close)
    return state
