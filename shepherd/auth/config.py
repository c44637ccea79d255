"""Who may call a node: the auth configuration (frozen), its YAML/CLI coercion and its flags.

YAML (a mapping under ``auth``)::

    auth:
      mode: api_key              # both planes at once: off | api_key | jwt | both
      data_plane: both           # /v1/*, /tokenize, ... (anything not a probe or control route)
      control_plane: api_key     # /workers*, /admin/*, /mesh/*, /metrics (default: data_plane's mode)
      admin_key_env: [SMG_ADMIN_KEY]        # bootstrap admin keys: plaintext in an env var ...
      admin_key_sha256: [<hex digest>]      # ... or only its SHA-256
      keys:                                 # more bootstrap keys, any role
        - {name: batch, role: user, tenant: team-a, sha256: <hex>, models: [qwen3]}
      trust_tenant_header: false           # x-smg-tenant sets the tenant (see ``Authenticator``)
      tenant_header: null                   # its name (null: x-smg-tenant)
      failure_limit: 20                     # failed credentials per client address per window, then 429
      failure_window_secs: 10               # (0 failures: no limit; ``middleware.FailureLimiter``)
      client_cert:                          # mTLS identities (TLS on the client port + tls_client_ca_file)
        verify: required                    # required | optional: a client may connect without one
        rules:                              # first match wins; every field given must match
          - {ou: fleet-admins, role: admin}   # globs on cn, ou, o, dns_san, uri_san, email_san
          - {cn: "batch-*", role: user, tenant: batch}
        fingerprints:                       # SHA-256 of the DER certificate (colons allowed) -> rule
          "9f:86:...": {role: admin, name: ci}
        default_role: null                  # role of a verified certificate no rule matches (null: none)
        subject: cn                         # the principal's subject: a field above, or fingerprint
        tenant_from: null                   # o | ou | cn: the tenant when the rule names none
        prefer: certificate                 # certificate | credential (see shepherd.auth.client_cert)
      jwt:
        issuer: https://login.example.com   # expected ``iss``; its discovery document gives the JWKS
        audience: [smg]
        jwks_url: null                      # explicit JWKS instead of discovery
        public_key_files: []                # static PEM (key or certificate), JWK or JWKS JSON files
        algorithms: [RS256, ES256]
        role_claim: role                    # a string or a list; admin when it holds one of admin_roles
        tenant_claim: tenant

CLI: ``--auth-X`` sets ``auth.X``, ``--jwt-X`` sets ``auth.jwt.X`` and ``--client-cert-X`` sets
``auth.client_cert.X`` (scalars only: rules and fingerprints come from the YAML; see ``add_arguments``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import logging
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from shepherd.auth.principal import Role

AuthMode = Literal["off", "api_key", "jwt", "both"]
MODES: tuple[AuthMode, ...] = ("off", "api_key", "jwt", "both")
ROLES: tuple[Role, ...] = ("admin", "user")
ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

log = logging.getLogger("shepherd.auth")


class AuthConfigError(ValueError):
    """An auth setting is wrong; the message names it."""


@dataclass(frozen=True, slots=True)
class BootstrapKey:
    """An API key given in the configuration: its SHA-256 or the name of an env var holding it."""

    name: str
    role: Role = "admin"
    tenant: str | None = None
    sha256: str | None = None
    env: str | None = None
    models: tuple[str, ...] | None = None  # None: every model
    id: str | None = None  # stable id (default: derived from the name)

    @property
    def record_id(self) -> str:
        """The key's id: ``id``, else one derived from its name, never from its place in the list: what
        its callers store is owned by this id, so removing or reordering the other keys must not hand
        their records to another key."""
        return (
            self.id or "boot-" + hashlib.sha256(self.name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        )


@dataclass(frozen=True, slots=True)
class JwtConfig:
    issuer: str | None = None  # expected "iss"; also where OIDC discovery looks
    audience: tuple[str, ...] = ()  # "aud" must hold one of these (empty: not checked)
    jwks_url: str | None = None
    discovery: bool = True  # issuer, no jwks_url, no static keys: {issuer}/.well-known/openid-configuration
    public_key_files: tuple[str, ...] = ()
    hmac_secret_env: str | None = None  # only for HS* algorithms, never mixed with public keys
    algorithms: tuple[str, ...] = ("RS256", "ES256")
    leeway_secs: float = 30.0
    require_exp: bool = True
    subject_claim: str = "sub"
    role_claim: str = "role"
    admin_roles: tuple[str, ...] = ("admin",)
    scope_claim: str = "scope"  # a space-separated string or a list
    admin_scopes: tuple[str, ...] = ()
    tenant_claim: str | None = "tenant"
    jwks_ttl_secs: float = 300.0  # keys are refreshed in the background after this
    jwks_min_refresh_secs: float = 10.0  # an unknown kid triggers at most one fetch per this interval
    fetch_timeout_secs: float = 5.0
    cache_size: int = 10_000  # verified tokens kept (LRU) until they expire

    @property
    def remote(self) -> bool:
        """Keys come from a JWKS endpoint (explicit or discovered)."""
        return bool(self.jwks_url) or (bool(self.issuer) and self.discovery and not self.static)

    @property
    def static(self) -> bool:
        return bool(self.public_key_files) or bool(self.hmac_secret_env)


CertField = Literal["cn", "ou", "o", "dns_san", "uri_san", "email_san", "fingerprint"]
CERT_FIELDS: tuple[CertField, ...] = ("cn", "ou", "o", "dns_san", "uri_san", "email_san", "fingerprint")
CERT_PATTERN_FIELDS: tuple[CertField, ...] = ("cn", "ou", "o", "dns_san", "uri_san", "email_san")
CertVerify = Literal["required", "optional"]
CertPrefer = Literal["certificate", "credential"]


@dataclass(frozen=True, slots=True)
class CertRule:
    """Which verified client certificates get which principal. Every matcher given must match (globs,
    ``fnmatch`` case-sensitive, against any of the certificate's values of that field; the fingerprint
    exactly); a rule without a matcher is refused."""

    role: Role = "user"
    tenant: str | None = None  # None: ``client_cert.tenant_from``, else the default tenant (unbound)
    name: str | None = None  # the principal's subject (default: the ``client_cert.subject`` field)
    fingerprint: str | None = None  # lowercase hex SHA-256 of the DER certificate
    cn: str | None = None
    ou: str | None = None
    o: str | None = None
    dns_san: str | None = None
    uri_san: str | None = None
    email_san: str | None = None

    def matchers(self) -> list[tuple[CertField, str]]:
        return [(f, v) for f in CERT_FIELDS if (v := getattr(self, f)) is not None]


@dataclass(frozen=True, slots=True)
class ClientCertConfig:
    """Client certificates on the client port (mTLS) and their mapping to principals."""

    verify: CertVerify = "required"  # with tls_client_ca_file: required, or optional (checked if sent)
    rules: tuple[CertRule, ...] = ()  # the ``fingerprints`` map first, then ``rules``, in order
    default_role: Role | None = None  # a verified certificate no rule matches: this role (None: no login)
    subject: CertField = "cn"  # where the principal's subject comes from (else the fingerprint)
    tenant_from: Literal["cn", "ou", "o"] | None = None  # a subject attribute naming the tenant
    prefer: CertPrefer = "certificate"  # with a bearer credential too: which one names the caller

    @property
    def enabled(self) -> bool:
        """Certificates can authenticate someone."""
        return bool(self.rules) or self.default_role is not None


@dataclass(frozen=True, slots=True)
class AuthConfig:
    data_plane: AuthMode = "off"
    control_plane: AuthMode = "off"
    metrics: bool = True  # /metrics is a control route (admin auth, admin listener); False: a public route
    keys: tuple[BootstrapKey, ...] = ()
    trust_tenant_header: bool = False
    # the header trust_tenant_header reads (None: x-smg-tenant)
    tenant_header: str | None = None
    default_tenant: str = "default"
    max_credential_bytes: int = 8192
    key_prefix: str = "sk-smg-"
    # failed credentials a client address may present per window before its requests are answered 429
    # without looking at the credential (0: no limit; ``middleware.FailureLimiter``)
    failure_limit: int = 20
    failure_window_secs: float = 10.0
    jwt: JwtConfig = field(default_factory=JwtConfig)
    client_cert: ClientCertConfig = field(default_factory=ClientCertConfig)

    @property
    def enabled(self) -> bool:
        return self.data_plane != "off" or self.control_plane != "off"

    @property
    def uses_jwt(self) -> bool:
        return "jwt" in (self.data_plane, self.control_plane) or "both" in (
            self.data_plane,
            self.control_plane,
        )


# ---------------------------------------------------------------------------------------------- coercion


def _str_tuple(v: Any, what: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise AuthConfigError(f"{what} must be a string or a list of strings")


def _mode(v: Any, what: str) -> AuthMode:
    if v is False or v is None:
        return "off"
    if v not in MODES:
        raise AuthConfigError(f"{what} {v!r}: use one of {', '.join(MODES)}")
    return cast(AuthMode, v)


def _key(raw: Any) -> BootstrapKey:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise AuthConfigError("each entry of auth.keys needs a 'name'")
    known = {f.name for f in dataclasses.fields(BootstrapKey)}
    if unknown := set(raw) - known:
        raise AuthConfigError(f"unknown keys in auth key {raw['name']!r}: {sorted(unknown)}")
    role = raw.get("role", "admin")
    if role not in ROLES:
        raise AuthConfigError(f"auth key {raw['name']!r}: role must be 'admin' or 'user'")
    digest = raw.get("sha256")
    if digest is not None and (not isinstance(digest, str) or not _HEX64.match(digest.lower())):
        raise AuthConfigError(f"auth key {raw['name']!r}: sha256 must be 64 hex digits")
    if (digest is None) == (raw.get("env") is None):
        raise AuthConfigError(f"auth key {raw['name']!r}: give exactly one of 'sha256' and 'env'")
    models = raw.get("models")
    return BootstrapKey(
        name=raw["name"],
        role=role,
        tenant=None if raw.get("tenant") is None else str(raw["tenant"]),
        sha256=digest.lower() if isinstance(digest, str) else None,
        env=None if raw.get("env") is None else str(raw["env"]),
        models=None if models is None else _str_tuple(models, "auth key models"),
        id=None if raw.get("id") is None else str(raw["id"]),
    )


_JWT_TUPLES = ("audience", "public_key_files", "algorithms", "admin_roles", "admin_scopes")


def _jwt(raw: Any) -> JwtConfig:
    if isinstance(raw, JwtConfig):
        return raw
    if raw is None:
        return JwtConfig()
    if not isinstance(raw, Mapping):
        raise AuthConfigError("auth.jwt must be a mapping")
    known = {f.name for f in dataclasses.fields(JwtConfig)}
    if unknown := set(raw) - known:
        raise AuthConfigError(f"unknown keys in auth.jwt: {sorted(unknown)}")
    vals = dict(raw)
    for k in _JWT_TUPLES:
        if k in vals:
            vals[k] = _str_tuple(vals[k], f"auth.jwt.{k}")
    try:
        cfg = JwtConfig(**vals)
    except TypeError as e:
        raise AuthConfigError(f"auth.jwt: {e}") from None
    algs = set(cfg.algorithms)
    if not algs:
        raise AuthConfigError("auth.jwt.algorithms must not be empty")
    if bad := algs - ASYMMETRIC_ALGORITHMS - HMAC_ALGORITHMS:
        raise AuthConfigError(f"auth.jwt.algorithms: unsupported {sorted(bad)} ('none' is never accepted)")
    if algs & HMAC_ALGORITHMS and not cfg.hmac_secret_env:
        raise AuthConfigError("auth.jwt: HS* algorithms need hmac_secret_env (a shared secret)")
    if cfg.leeway_secs < 0 or cfg.jwks_ttl_secs <= 0 or cfg.jwks_min_refresh_secs < 0:
        raise AuthConfigError("auth.jwt: leeway, jwks_ttl_secs and jwks_min_refresh_secs must be positive")
    if cfg.cache_size < 0:
        raise AuthConfigError("auth.jwt.cache_size must be >= 0")
    return cfg


def fetched_url(cfg: JwtConfig) -> tuple[str, str] | None:
    """(the setting, the URL) keys are fetched from first: ``jwks_url``, else the issuer's discovery."""
    if cfg.jwks_url:
        return "jwks_url", cfg.jwks_url
    if cfg.remote and cfg.issuer:
        return "issuer", cfg.issuer
    return None


def key_url_ok(url: str) -> bool:
    """Whether keys (a JWKS, an OIDC discovery document) may be fetched from ``url``: HTTPS, or plain
    HTTP to a loopback host only (as SMG, ``crates/auth/src/jwks.rs`` ``validate_url``): whoever is on
    the path of a fetch in the clear can hand the node their own keys, then mint any token, admin too."""
    try:
        u = urllib.parse.urlsplit(url.strip())
        host = u.hostname or ""
    except ValueError:
        return False
    if u.scheme.lower() == "https":
        return bool(host)
    if u.scheme.lower() != "http":
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_HEX64_COLONS = re.compile(r"^(?:[0-9a-f]{2}:){31}[0-9a-f]{2}$")


def normalize_fingerprint(v: Any, what: str = "fingerprint") -> str:
    """A SHA-256 fingerprint as 64 lowercase hex digits (``AB:CD:...`` and ``abcd...`` accepted)."""
    if isinstance(v, str):
        s = v.strip().lower()
        if _HEX64_COLONS.match(s):
            s = s.replace(":", "")
        if _HEX64.match(s):
            return s
    raise AuthConfigError(f"{what} must be a SHA-256 fingerprint (64 hex digits, colons allowed)")


def _role(v: Any, what: str) -> Role:
    if v not in ROLES:
        raise AuthConfigError(f"{what} must be 'admin' or 'user'")
    return cast(Role, v)


def _opt_name(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > 128 or not v.isprintable():
        raise AuthConfigError(f"{what} must be a printable string of 1 to 128 characters")
    return v


def _cert_rule(raw: Any, what: str) -> CertRule:
    if not isinstance(raw, Mapping):
        raise AuthConfigError(f"{what} must be a mapping")
    known = {f.name for f in dataclasses.fields(CertRule)}
    if unknown := set(raw) - known:
        raise AuthConfigError(f"unknown keys in {what}: {sorted(unknown)}")
    pats: dict[str, str] = {}
    for f in CERT_PATTERN_FIELDS:
        v = raw.get(f)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise AuthConfigError(f"{what}.{f} must be a non-empty string (a glob pattern)")
            pats[f] = v
    fp = raw.get("fingerprint")
    rule = CertRule(
        role=_role(raw.get("role", "user"), f"{what}.role"),
        tenant=_opt_name(raw.get("tenant"), f"{what}.tenant"),
        name=_opt_name(raw.get("name"), f"{what}.name"),
        fingerprint=None if fp is None else normalize_fingerprint(fp, f"{what}.fingerprint"),
        **pats,
    )
    if not rule.matchers():
        raise AuthConfigError(
            f"{what} matches nothing: give fingerprint, cn, ou, o, dns_san, uri_san or email_san"
        )
    return rule


def _client_cert(raw: Any) -> ClientCertConfig:
    if isinstance(raw, ClientCertConfig):
        return raw
    if raw is None:
        return ClientCertConfig()
    if not isinstance(raw, Mapping):
        raise AuthConfigError("auth.client_cert must be a mapping")
    known = {f.name for f in dataclasses.fields(ClientCertConfig)} | {"fingerprints"}
    if unknown := set(raw) - known:
        raise AuthConfigError(f"unknown keys in auth.client_cert: {sorted(unknown)}")
    fps = raw.get("fingerprints") or {}
    if not isinstance(fps, Mapping):
        raise AuthConfigError("auth.client_cert.fingerprints must map fingerprints to {role, tenant, name}")
    rules = []
    for fp, r in fps.items():
        what = "auth.client_cert.fingerprints entry"
        if r is not None and not isinstance(r, Mapping):
            raise AuthConfigError(f"{what} {str(fp)[:20]!r}: expected {{role, tenant, name}}")
        extra = set(r or {}) - {"role", "tenant", "name"}
        if extra:
            raise AuthConfigError(f"{what} {str(fp)[:20]!r}: unknown keys {sorted(extra)}")
        rules.append(_cert_rule({**(r or {}), "fingerprint": fp}, what))
    raw_rules = raw.get("rules") or ()
    if not isinstance(raw_rules, list | tuple):
        raise AuthConfigError("auth.client_cert.rules must be a list")
    rules.extend(_cert_rule(r, f"auth.client_cert.rules[{i}]") for i, r in enumerate(raw_rules))
    verify = raw.get("verify", "required")
    if verify not in ("required", "optional"):
        raise AuthConfigError("auth.client_cert.verify must be 'required' or 'optional'")
    subject = raw.get("subject", "cn")
    if subject not in CERT_FIELDS:
        raise AuthConfigError(f"auth.client_cert.subject must be one of {', '.join(CERT_FIELDS)}")
    tenant_from = raw.get("tenant_from")
    if tenant_from not in (None, "cn", "ou", "o"):
        raise AuthConfigError("auth.client_cert.tenant_from must be cn, ou, o or null")
    prefer = raw.get("prefer", "certificate")
    if prefer not in ("certificate", "credential"):
        raise AuthConfigError("auth.client_cert.prefer must be 'certificate' or 'credential'")
    default_role = raw.get("default_role")
    return ClientCertConfig(
        verify=cast(CertVerify, verify),
        rules=tuple(rules),
        default_role=None if default_role is None else _role(default_role, "auth.client_cert.default_role"),
        subject=cast(CertField, subject),
        tenant_from=tenant_from,
        prefer=cast(CertPrefer, prefer),
    )


def auth_config(raw: Mapping[str, Any] | AuthConfig | None) -> AuthConfig:
    """Build an ``AuthConfig`` from a plain mapping (the ``auth`` section of the YAML, merged with flags)."""
    if isinstance(raw, AuthConfig):
        return raw
    if raw is None:
        return AuthConfig()
    if not isinstance(raw, Mapping):
        raise AuthConfigError("auth must be a mapping")
    vals = dict(raw)
    mode_given = vals.get("mode") is not None
    mode = _mode(vals.pop("mode", None), "auth.mode")
    keys = [_key(k) for k in vals.pop("keys", None) or ()]
    for i, env in enumerate(_str_tuple(vals.pop("admin_key_env", None), "auth.admin_key_env")):
        keys.append(BootstrapKey(name=f"bootstrap-admin-env-{i}", env=env, id=f"boot-env-{i}"))
    for i, digest in enumerate(_str_tuple(vals.pop("admin_key_sha256", None), "auth.admin_key_sha256")):
        keys.append(_key({"name": f"bootstrap-admin-{i}", "sha256": digest, "id": f"boot-sha-{i}"}))
    seen: dict[str, str] = {}
    for k in keys:
        if (other := seen.get(k.record_id)) is not None:
            raise AuthConfigError(
                f"auth.keys: {other!r} and {k.name!r} have one id (a key's id is its 'id', else its name: "
                "each must be unique)"
            )
        seen[k.record_id] = k.name
    known = {f.name for f in dataclasses.fields(AuthConfig)}
    if unknown := set(vals) - known:
        raise AuthConfigError(f"unknown keys in auth: {sorted(unknown)}")
    data = _mode(vals.pop("data_plane", mode), "auth.data_plane")
    # secure by default: a control plane not set on its own takes ``mode``, else the data plane's mode;
    # enabling auth for clients never leaves /admin/* open to anonymous admins
    control = _mode(vals.pop("control_plane", mode if mode_given else data), "auth.control_plane")
    jwt_cfg = _jwt(vals.pop("jwt", None))
    cc = _client_cert(vals.pop("client_cert", None))
    try:
        cfg = AuthConfig(
            data_plane=data, control_plane=control, keys=tuple(keys), jwt=jwt_cfg, client_cert=cc, **vals
        )
    except TypeError as e:
        raise AuthConfigError(f"auth: {e}") from None
    if cfg.uses_jwt and not (cfg.jwt.remote or cfg.jwt.static):
        raise AuthConfigError("JWT auth needs auth.jwt.issuer, jwks_url, public_key_files or hmac_secret_env")
    if cfg.uses_jwt and (where := fetched_url(cfg.jwt)) is not None and not key_url_ok(where[1]):
        raise AuthConfigError(
            f"auth.jwt.{where[0]} {where[1][:200]!r}: verification keys are fetched over HTTPS only "
            "(plain http to a loopback host alone): keys fetched in the clear can be replaced on the way"
        )
    th = cfg.tenant_header
    if th is not None and (
        not isinstance(th, str) or not th or len(th) > 128 or not th.isascii() or not th.isprintable()
    ):
        raise AuthConfigError("auth.tenant_header must be a header name")
    if th is not None:
        cfg = dataclasses.replace(cfg, tenant_header=th.lower())
    if cfg.max_credential_bytes < 64:
        raise AuthConfigError("auth.max_credential_bytes must be >= 64")
    fl, fw = cfg.failure_limit, cfg.failure_window_secs
    if isinstance(fl, bool) or not isinstance(fl, int) or not 0 <= fl <= 1_000_000:
        raise AuthConfigError("auth.failure_limit must be an integer in 0..1000000 (0: no limit)")
    if isinstance(fw, bool) or not isinstance(fw, int | float) or not 0 < fw <= 86_400:
        raise AuthConfigError("auth.failure_window_secs must be a number of seconds in (0, 86400]")
    if cfg.uses_jwt and cfg.jwt.jwks_url and not cfg.jwt.issuer:
        log.warning(
            "auth.jwt: jwks_url without issuer: tokens of any issuer those keys sign are accepted "
            "(set auth.jwt.issuer / --jwt-issuer to check iss)"
        )
    return cfg


def merge_auth(base: Any, over: Any) -> Any:
    """Merge two ``auth`` mappings (YAML < flags); ``jwt`` and ``client_cert`` are merged one level down."""
    if not isinstance(base, Mapping) or not isinstance(over, Mapping):
        return over
    out = {**base, **over}
    for k in ("jwt", "client_cert"):
        if isinstance(base.get(k), Mapping) and isinstance(over.get(k), Mapping):
            out[k] = {**base[k], **over[k]}
    return out


# ---------------------------------------------------------------------------------------------- flags

_AUTH_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("mode", {"choices": MODES, "help": "auth on both planes: off (default), api_key, jwt, both"}),
    ("data-plane", {"choices": MODES, "help": "auth on /v1/* and the other data routes"}),
    (
        "control-plane",
        {"choices": MODES, "help": "auth on /workers*, /admin/*, /mesh/*, /metrics (default: data plane's)"},
    ),
    (
        "metrics",
        {
            "action": argparse.BooleanOptionalAction,
            "default": None,
            "help": "/metrics is a control route (default; an admin credential when the control plane "
            "has auth, the admin listener when set); --no-auth-metrics makes it public",
        },
    ),
    (
        "admin-key-env",
        {"nargs": "+", "action": "extend", "metavar": "VAR", "help": "env vars holding bootstrap admin keys"},
    ),
    (
        "admin-key-sha256",
        {"nargs": "+", "action": "extend", "metavar": "HEX", "help": "SHA-256 of bootstrap admin keys"},
    ),
    (
        "trust-tenant-header",
        {"action": "store_true", "default": None, "help": "x-smg-tenant sets the tenant"},
    ),
    (
        "tenant-header",
        {
            "metavar": "NAME",
            "help": "the header --auth-trust-tenant-header reads (default: x-smg-tenant)",
        },
    ),
    ("default-tenant", {"help": "tenant of callers bound to none (default: default)"}),
    (
        "failure-limit",
        {
            "type": int,
            "help": "failed credentials a client address may present per window before it is answered "
            "429 (default 20; 0: no limit)",
        },
    ),
    ("failure-window-secs", {"type": float, "help": "the window of --auth-failure-limit, s (default 10)"}),
)
_JWT_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("issuer", {"help": "expected iss; OIDC discovery at {issuer}/.well-known/openid-configuration"}),
    ("audience", {"nargs": "+", "action": "extend", "help": "aud must hold one of these"}),
    ("jwks-url", {"help": "JWKS endpoint (instead of OIDC discovery)"}),
    (
        "public-key-file",
        {"nargs": "+", "action": "extend", "dest": "public_key_files", "help": "PEM, JWK or JWKS files"},
    ),
    ("hmac-secret-env", {"metavar": "VAR", "help": "env var with a shared secret for HS256/384/512"}),
    ("algorithms", {"nargs": "+", "action": "extend", "help": "accepted algorithms (default RS256 ES256)"}),
    ("leeway-secs", {"type": float, "help": "clock skew allowed on exp/nbf/iat (default 30)"}),
    ("role-claim", {"help": "claim holding the role(s), dotted paths allowed (default role)"}),
    (
        "admin-roles",
        {"nargs": "+", "action": "extend", "help": "role values that mean admin (default admin)"},
    ),
    ("scope-claim", {"help": "claim holding scopes (default scope)"}),
    ("admin-scopes", {"nargs": "+", "action": "extend", "help": "scopes that mean admin"}),
    ("tenant-claim", {"help": "claim holding the tenant (default tenant)"}),
    ("jwks-ttl-secs", {"type": float, "help": "refresh the JWKS after this (default 300)"}),
    (
        "jwks-min-refresh-secs",
        {"type": float, "help": "at most one unknown-kid refetch per this (default 10)"},
    ),
)
_CERT_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "verify",
        {
            "choices": ("required", "optional"),
            "help": "with --tls-client-ca-file: required (default) or optional",
        },
    ),
    (
        "default-role",
        {"choices": ROLES, "help": "role of a verified client certificate no rule matches (default: none)"},
    ),
    ("subject", {"choices": CERT_FIELDS, "help": "certificate field naming the principal (default cn)"}),
    ("tenant-from", {"choices": ("cn", "ou", "o"), "help": "subject attribute naming the tenant"}),
    (
        "prefer",
        {
            "choices": ("certificate", "credential"),
            "help": "certificate (default) or a bearer credential sent too",
        },
    ),
)
_PREFIX_AUTH = "auth__"
_PREFIX_JWT = "auth_jwt__"
_PREFIX_CERT = "auth_cc__"


_TLS_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("tls-cert-file", {"help": "serve the client port over TLS with this certificate (PEM chain)"}),
    ("tls-key-file", {"help": "the certificate's private key (PEM)"}),
    ("tls-client-ca-file", {"help": "require client certificates signed by this CA (mTLS)"}),
    (
        "tls-reload-interval-secs",
        {"type": float, "help": "reload changed cert files (default 10; 0: SIGHUP only)"},
    ),
    ("engine-tls-ca-file", {"help": "TLS to gRPC engines, verified against this CA (also grpcs:// URLs)"}),
    ("engine-tls-cert-file", {"help": "client certificate for engines (mTLS)"}),
    ("engine-tls-key-file", {"help": "its private key"}),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``--auth-*``, ``--jwt-*`` and TLS flags to the ``serve`` parser (TLS flags are plain
    ``NodeConfig`` fields; the others go through ``pop_overrides``)."""
    t = p.add_argument_group("TLS")
    for name, kw in _TLS_FLAGS:
        t.add_argument(f"--{name}", **kw)
    g = p.add_argument_group("authentication")
    for name, kw in _AUTH_FLAGS:
        g.add_argument(
            f"--auth-{name}", **{**_metavar(name, kw), "dest": _PREFIX_AUTH + name.replace("-", "_")}
        )
    for name, kw in _JWT_FLAGS:
        dest = _PREFIX_JWT + kw.get("dest", name.replace("-", "_"))
        g.add_argument(f"--jwt-{name}", **{**_metavar(name, kw), "dest": dest})
    c = p.add_argument_group("client certificates (mTLS identities; rules in the YAML's auth.client_cert)")
    for name, kw in _CERT_FLAGS:
        c.add_argument(f"--client-cert-{name}", **{**kw, "dest": _PREFIX_CERT + name.replace("-", "_")})


def _metavar(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    if kw.get("action") or "choices" in kw or "metavar" in kw:
        return kw
    return {**kw, "metavar": name.upper().replace("-", "_")}


def pop_overrides(values: dict[str, Any]) -> dict[str, Any] | None:
    """Take the auth flags out of parsed CLI ``values``; the ``auth`` override mapping, None when unset."""
    out: dict[str, Any] = {}
    jwt: dict[str, Any] = {}
    cert: dict[str, Any] = {}
    for k in [k for k in values if k.startswith((_PREFIX_AUTH, _PREFIX_JWT, _PREFIX_CERT))]:
        v = values.pop(k)
        if v is None:
            continue
        if k.startswith(_PREFIX_JWT):
            jwt[k[len(_PREFIX_JWT) :]] = v
        elif k.startswith(_PREFIX_CERT):
            cert[k[len(_PREFIX_CERT) :]] = v
        else:
            out[k[len(_PREFIX_AUTH) :]] = v
    if jwt:
        out["jwt"] = jwt
    if cert:
        out["client_cert"] = cert
    return out or None
