"""mTLS identities: a verified client certificate on the client port → the caller's ``Principal``.

With TLS on the client port and ``tls_client_ca_file`` set, the port asks for client certificates
(``auth.client_cert.verify``: ``required`` refuses a handshake without one, ``optional`` lets clients
without one connect and authenticate otherwise). A certificate the handshake verified against that CA
can then name the caller, so a fleet can use its mTLS identities instead of bearer tokens::

    auth:
      mode: api_key                 # the planes where authentication is on (certificates add to it)
      client_cert:
        verify: optional
        fingerprints:               # one certificate, by the SHA-256 of its DER form (colons allowed)
          "3b:1f:...:9a": {role: admin, name: ci-runner}
        rules:                      # first match wins; every field given must match (globs)
          - {ou: fleet-admins, role: admin}
          - {uri_san: "spiffe://fleet/tenant/team-a/*", tenant: team-a}
          - {cn: "batch-*", o: "Example Corp", role: user, tenant: batch}
        default_role: null          # a verified certificate no rule matches: no login (or a role)
        subject: cn                 # the principal's subject: cn, ou, o, dns_san, uri_san, email_san or
                                    # fingerprint (the fingerprint when the certificate lacks the field)
        tenant_from: null           # cn | ou | o: the tenant when the matching rule names none
        prefer: certificate         # or credential

- **Matching**: the ``fingerprints`` entries first, then ``rules`` in order; a rule matches when every
  matcher it gives matches at least one of the certificate's values of that field (``fnmatch``,
  case-sensitive: ``cn``, ``ou``, ``o`` from the subject, ``dns_san``, ``uri_san``, ``email_san`` from
  the subject alternative names), the fingerprint exactly. The first match gives the role, the tenant
  (the rule's, else the ``tenant_from`` attribute, else the default tenant, unbound) and the subject
  (the rule's ``name``, else the ``subject`` field). No match: ``default_role`` if set, else the
  certificate authenticates no one (the request needs a bearer credential as before).
- **Where it counts**: on the planes whose mode is not ``off`` (a plane that is off lets everyone in
  anyway), as one more credential beside API keys and JWTs; roles apply as for them (a ``user``
  certificate on a control route gets 403). ``prefer: certificate`` (default): a mapped certificate
  names the caller and a bearer credential sent too is not looked at (SDKs always send some
  ``api_key``); ``prefer: credential``: a bearer credential, when sent, is checked instead (it must
  be valid), and the certificate names callers that send none.
- **Principals**: ``method="mtls"``, ``key_id=None``; tenants and ``x-smg-tenant`` as for keys (a
  certificate whose tenant comes from its rule or ``tenant_from`` is bound to it).
- **Trust**: only a certificate the TLS handshake verified counts (``getpeercert()`` is empty for an
  unverified one, and a port without a client CA never asks for one). Revocation of client
  certificates (CRL/OCSP) is not checked: remove a fingerprint rule, or rotate the CA.

The mapping is pure (``CertIdentity`` in, principal out, ``CertMapper.map``); ``CertMapper.from_transport``
reads the connection's verified certificate and caches the result by its DER bytes (bounded).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from shepherd.auth.config import CertField, CertRule, ClientCertConfig
from shepherd.auth.principal import Principal, Role

MAX_CACHE = 10_000
MAX_TENANT_CHARS = 128
_SUBJECT_ATTRS = {"commonName": "cn", "organizationalUnitName": "ou", "organizationName": "o"}
_SAN_TYPES = {"DNS": "dns_san", "URI": "uri_san", "email": "email_san"}


def fingerprint(der: bytes) -> str:
    """Lowercase hex SHA-256 of a certificate's DER form (what ``fingerprints`` keys are)."""
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True, slots=True)
class CertIdentity:
    """What a verified client certificate says, field by field (each may hold several values)."""

    fingerprint: str
    cn: tuple[str, ...] = ()
    ou: tuple[str, ...] = ()
    o: tuple[str, ...] = ()
    dns_san: tuple[str, ...] = ()
    uri_san: tuple[str, ...] = ()
    email_san: tuple[str, ...] = ()

    def values(self, f: CertField) -> tuple[str, ...]:
        if f == "fingerprint":
            return (self.fingerprint,)
        v: tuple[str, ...] = getattr(self, f)
        return v

    @classmethod
    def from_peercert(cls, decoded: Mapping[str, Any], der: bytes) -> CertIdentity:
        """From ``SSLObject.getpeercert()`` (the decoded dict) and ``getpeercert(binary_form=True)``."""
        found: dict[str, list[str]] = {f: [] for f in ("cn", "ou", "o", "dns_san", "uri_san", "email_san")}
        for rdn in _tuples(decoded.get("subject")):
            for pair in _tuples(rdn):
                if len(pair) == 2 and isinstance(pair[1], str) and pair[0] in _SUBJECT_ATTRS:
                    found[_SUBJECT_ATTRS[pair[0]]].append(pair[1])
        for pair in _tuples(decoded.get("subjectAltName")):
            if len(pair) == 2 and isinstance(pair[1], str) and pair[0] in _SAN_TYPES:
                found[_SAN_TYPES[pair[0]]].append(pair[1])
        return cls(fingerprint(der), **{k: tuple(v) for k, v in found.items()})


def _tuples(v: Any) -> Iterable[Any]:
    return v if isinstance(v, tuple | list) else ()


def _printable(v: str | None) -> str | None:
    return v if v and len(v) <= MAX_TENANT_CHARS and v.isprintable() else None


@dataclass(frozen=True, slots=True)
class CertPrincipal:
    """A certificate's principal, and whether its tenant is bound (from the rule or ``tenant_from``)."""

    principal: Principal
    tenant_bound: bool
    rule: int | None  # index in ``ClientCertConfig.rules`` of the match (None: ``default_role``)


class CertMapper:
    """Verified client certificate → principal, per ``ClientCertConfig``."""

    def __init__(self, cfg: ClientCertConfig, default_tenant: str = "default") -> None:
        self.cfg = cfg
        self.default_tenant = default_tenant
        self._cache: dict[bytes, CertPrincipal | None] = {}

    def match(self, ident: CertIdentity) -> tuple[int, CertRule] | None:
        """The first rule that matches, with its index."""
        for i, rule in enumerate(self.cfg.rules):
            if all(_matches(ident.values(f), f, pat) for f, pat in rule.matchers()):
                return i, rule
        return None

    def map(self, ident: CertIdentity) -> CertPrincipal | None:
        """The principal of a verified certificate; None when it names no one."""
        hit = self.match(ident)
        role: Role
        if hit is not None:
            index, rule = hit
            role, tenant, name = rule.role, rule.tenant, rule.name
        elif self.cfg.default_role is not None:
            index, role, tenant, name = None, self.cfg.default_role, None, None
        else:
            return None
        if tenant is None and self.cfg.tenant_from is not None:
            tenant = next((t for t in ident.values(self.cfg.tenant_from) if _printable(t)), None)
        if name is None:
            name = next((_printable(v) for v in ident.values(self.cfg.subject) if _printable(v)), None)
        p = Principal(
            subject=name or ident.fingerprint,
            tenant=tenant or self.default_tenant,
            role=role,
            key_id=None,
            method="mtls",
        )
        return CertPrincipal(p, tenant is not None, index)

    def from_ssl_object(self, ssl_object: Any) -> CertPrincipal | None:
        """The principal of the connection's verified client certificate (None: none, or unmapped)."""
        if ssl_object is None:
            return None
        der = ssl_object.getpeercert(binary_form=True)
        if not der:
            return None
        if der in self._cache:
            return self._cache[der]
        decoded = ssl_object.getpeercert()
        if not decoded:  # not verified (a context that does not ask for one): never trusted
            return None
        out = self.map(CertIdentity.from_peercert(decoded, der))
        if len(self._cache) >= MAX_CACHE:
            self._cache.clear()
        self._cache[der] = out
        return out

    def from_transport(self, transport: Any) -> CertPrincipal | None:
        """``from_ssl_object`` of an asyncio transport (None on a plain or closed connection)."""
        if transport is None:
            return None
        return self.from_ssl_object(transport.get_extra_info("ssl_object"))


def _matches(values: tuple[str, ...], f: CertField, pattern: str) -> bool:
    if f == "fingerprint":
        return pattern in values
    return any(fnmatchcase(v, pattern) for v in values)
