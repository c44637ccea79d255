"""JWT bearer tokens: verification with pyjwt, a cache of verified tokens, and claims → principal.

``JwtVerifier.verify(token)`` checks, in order: size and shape, the header's ``alg`` against the allowed
algorithms (``none`` is never allowed), a key of the algorithm's family (by ``kid``; see ``jwks``), the
signature, then ``exp`` (required by default), ``nbf``, ``iss`` and ``aud`` with a small leeway. A
verified token's principal is cached (bounded LRU) until the token expires, so a client reusing its
token costs one dict lookup. Failures raise ``JwtError`` with a fixed message: never the token, never
pyjwt's text (which may quote the input).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

import jwt
from jwt import exceptions as jx

from shepherd.auth.config import JwtConfig
from shepherd.auth.jwks import JwksSource, VerifyKey, select
from shepherd.auth.principal import Principal, Role


class JwtError(Exception):
    """A token was refused; ``code`` is machine-readable, the message is safe to show and log."""

    def __init__(self, message: str, code: str = "invalid_token") -> None:
        super().__init__(message)
        self.code = code


_REASONS: tuple[tuple[type[Exception], str, str], ...] = (
    (jx.ExpiredSignatureError, "The token has expired.", "token_expired"),
    (jx.ImmatureSignatureError, "The token is not valid yet (nbf/iat).", "token_not_yet_valid"),
    (jx.InvalidAudienceError, "The token is not for this audience.", "invalid_audience"),
    (jx.InvalidIssuerError, "The token is from an untrusted issuer.", "invalid_issuer"),
    (jx.MissingRequiredClaimError, "The token lacks a required claim.", "missing_claim"),
    (jx.InvalidSignatureError, "The token's signature does not verify.", "invalid_signature"),
    (jx.InvalidAlgorithmError, "The token's algorithm is not accepted.", "invalid_algorithm"),
    (jx.InvalidIssuedAtError, "The token's iat claim is invalid.", "invalid_token"),
    (jx.DecodeError, "The token is malformed.", "malformed_token"),
)


_TIME_CLAIMS = ("exp", "nbf", "iat")


def _reason(e: Exception) -> JwtError:
    for cls, msg, code in _REASONS:
        if isinstance(e, cls):
            return JwtError(msg, code)
    return JwtError("The token is invalid.", "invalid_token")


def looks_like_jwt(token: str) -> bool:
    """Three dot-separated parts and a JSON header (base64url of '{"')."""
    return token.startswith("eyJ") and token.count(".") == 2


def claim(claims: Mapping[str, Any], path: str) -> Any:
    """A claim by name, or by a dotted path into nested objects (``realm_access.roles``)."""
    if path in claims:
        return claims[path]
    cur: Any = claims
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _values(v: Any, split: bool = False) -> set[str]:
    if isinstance(v, str):
        return set(v.split()) if split else {v}
    if isinstance(v, list | tuple):
        return {x for x in v if isinstance(x, str)}
    return set()


def principal_from_claims(claims: Mapping[str, Any], cfg: JwtConfig, default_tenant: str) -> Principal:
    """Role from the role claim (a string or a list) or the scope claim; tenant from the tenant claim."""
    sub = claim(claims, cfg.subject_claim)
    if not (isinstance(sub, str | int) and not isinstance(sub, bool) and str(sub)):
        # no name for the caller: what it stores would be shared by every such token (RFC 7519 4.1.2)
        raise JwtError(f"The token has no subject ({cfg.subject_claim!r} claim).", "missing_claim")
    subject = str(sub)
    iss = claims.get("iss")
    admin = bool(_values(claim(claims, cfg.role_claim)) & set(cfg.admin_roles)) or bool(
        cfg.admin_scopes and _values(claim(claims, cfg.scope_claim), split=True) & set(cfg.admin_scopes)
    )
    role: Role = "admin" if admin else "user"
    tenant = tenant_of(claims, cfg)
    return Principal(
        subject=subject,
        tenant=tenant or default_tenant,
        role=role,
        method="jwt",
        issuer=iss if isinstance(iss, str) else "",
    )


MAX_TENANT_CHARS = 128


def tenant_of(claims: Mapping[str, Any], cfg: JwtConfig) -> str | None:
    """The tenant claim (None when absent, null or empty). A tenant names rate-limit buckets, metric
    labels and stored records: one that is not a string of 1 to 128 printable characters refuses the token."""
    t = claim(claims, cfg.tenant_claim) if cfg.tenant_claim else None
    if t is None or t == "":  # absent, null or empty: bound to no tenant (as before)
        return None
    if not isinstance(t, str) or not 0 < len(t) <= MAX_TENANT_CHARS or not t.isprintable():
        raise JwtError(
            f"The token's tenant claim must be a string of 1 to {MAX_TENANT_CHARS} printable characters.",
            "invalid_tenant_claim",
        )
    return t


def tenant_bound(claims: Mapping[str, Any], cfg: JwtConfig) -> bool:
    return tenant_of(claims, cfg) is not None


class VerifiedToken:
    __slots__ = ("principal", "tenant_bound", "until")

    def __init__(self, principal: Principal, tenant_bound: bool, until: float) -> None:
        self.principal = principal
        self.tenant_bound = tenant_bound
        self.until = until


class JwtVerifier:
    def __init__(
        self,
        cfg: JwtConfig,
        static: list[VerifyKey],
        remote: JwksSource | None,
        *,
        default_tenant: str = "default",
        max_token_bytes: int = 8192,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self._static = static
        self._remote = remote
        self._default_tenant = default_tenant
        self._max = max_token_bytes
        self._clock = clock
        self._algs = frozenset(cfg.algorithms)
        self._cache: collections.OrderedDict[str, VerifiedToken] = collections.OrderedDict()
        self._options: dict[str, Any] = {
            "require": ["exp"] if cfg.require_exp else [],
            "verify_aud": bool(cfg.audience),
            "verify_iss": bool(cfg.issuer),
        }

    def cached(self, token: str) -> VerifiedToken | None:
        """The fast path: a token verified before and not yet expired."""
        v = self._cache.get(token)
        if v is None:
            return None
        if self._clock() >= v.until:
            del self._cache[token]
            return None
        self._cache.move_to_end(token)
        return v

    def _header(self, token: str) -> tuple[str, str | None]:
        """The token's ``alg`` and ``kid`` after the checks that need no key."""
        if len(token) > self._max:
            raise JwtError("The token is too long.", "token_too_long")
        if not token.isascii():  # (base64url and dots only: pyjwt would raise a UnicodeEncodeError)
            raise JwtError("The token is malformed.", "malformed_token")
        try:
            header = jwt.get_unverified_header(token)
        except (jx.PyJWTError, ValueError, TypeError):
            raise JwtError("The token is malformed.", "malformed_token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._algs:
            raise JwtError("The token's algorithm is not accepted.", "invalid_algorithm")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise JwtError("The token is malformed.", "malformed_token")
        return alg, kid

    def verify_now(self, token: str) -> VerifiedToken | None:
        """``verify`` without waiting: None when the token's keys must be fetched first (a JWKS not
        loaded yet, an unknown kid). Refusals raise ``JwtError`` here already, so a request carrying a
        bad token is refused at its head, before its body is read (``middleware.make_body_gate``)."""
        v = self.cached(token)
        if v is not None:
            return v
        alg, kid = self._header(token)
        keys = select(self._static, kid, alg)
        if not keys and self._remote is not None:
            found = self._remote.known(kid, alg)
            if found is None:
                return None
            keys = found
        if not keys:
            raise JwtError("No key is known for this token (kid or algorithm).", "unknown_key")
        return self._remember(token, self._decode(token, alg, keys))

    async def verify(self, token: str) -> VerifiedToken:
        v = self.verify_now(token)
        if v is not None:
            return v
        alg, kid = self._header(token)
        keys = await self._remote.candidates(kid, alg) if self._remote is not None else []
        if not keys:
            raise JwtError("No key is known for this token (kid or algorithm).", "unknown_key")
        claims = self._decode(token, alg, keys)
        return self._remember(token, claims)

    def _decode(self, token: str, alg: str, keys: list[VerifyKey]) -> dict[str, Any]:
        last: Exception | None = None
        for k in keys[:8]:
            try:
                claims: dict[str, Any] = jwt.decode(
                    token,
                    k.key,
                    algorithms=[alg],
                    options=self._options,  # type: ignore[arg-type]
                    audience=list(self.cfg.audience) or None,
                    issuer=self.cfg.issuer,
                    leeway=self.cfg.leeway_secs,
                )
                for name in _TIME_CLAIMS:  # NumericDate (RFC 7519 2): pyjwt also takes digit strings
                    t = claims.get(name)
                    if t is not None and (not isinstance(t, int | float) or isinstance(t, bool)):
                        raise JwtError(f"The token's {name} claim is not a number.", "invalid_token")
                return claims
            except jx.InvalidSignatureError as e:
                last = e  # another key without a kid may fit
            except jx.PyJWTError as e:
                raise _reason(e) from None
            except (ValueError, TypeError):  # a key pyjwt cannot use for this algorithm
                last = jx.InvalidSignatureError()
        raise _reason(last or jx.InvalidSignatureError())

    def _remember(self, token: str, claims: Mapping[str, Any]) -> VerifiedToken:
        now = self._clock()
        exp = claims.get("exp")
        ttl = self.cfg.jwks_ttl_secs
        # (compared before any float(): an integer exp past a float's range is a time far away)
        until = float(exp) if isinstance(exp, int | float) and exp < now + ttl else now + ttl
        v = VerifiedToken(
            principal_from_claims(claims, self.cfg, self._default_tenant),
            tenant_bound(claims, self.cfg),
            until,
        )
        if self.cfg.cache_size > 0:
            self._cache[token] = v
            if len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return v
