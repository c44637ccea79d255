"""API keys: generation, hashing, records and the key store.

A key is ``<prefix><43 url-safe characters>`` (256 random bits), e.g. ``sk-smg-Qm9...``. Only its SHA-256
is stored: a key is high-entropy, so a fast hash is enough (no salt or KDF is needed against guessing;
a low-entropy bootstrap key chosen by an operator is the operator's risk). The plaintext is returned
once, by ``create_key``. Lookup is by digest; the final comparison is constant-time.

The store is behind ``KeyStore`` so that it can be backed by the mesh's replicated control-plane
document: records go in and out as plain dicts (``export`` / ``apply``), and ``subscribe`` registers a
callback that sees every local change (to write it to the document). ``apply`` merges records from
elsewhere by id with revocation winning: once revoked, a key stays revoked on every node. With the
mesh on, ``shepherd.node.cluster.key_sync.KeySync`` is that link (``shepherd.node.api.keys.install``
sets it up). ``MemoryKeyStore.watch`` sees every change, applied ones included: the node's key journal
(``shepherd.node.cluster.key_journal``) writes them to its durable records so that keys survive a
restart of every node at once.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from shepherd.auth.config import ROLES, AuthConfig
from shepherd.auth.principal import Principal, Role

DEFAULT_PREFIX = "sk-smg-"


def hash_key(key: str) -> str:
    """Hex SHA-256 of a key's UTF-8 bytes: what the store keeps."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def generate_key(prefix: str = DEFAULT_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def key_hint(key: str, prefix: str = DEFAULT_PREFIX) -> str:
    """What listings show of a key: its prefix and the last 4 characters (never enough to use it)."""
    if key.startswith(prefix) and len(key) > len(prefix) + 8:
        return f"{prefix}...{key[-4:]}"
    return "..."


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: str
    name: str
    role: Role
    digest: str  # hex SHA-256 of the key
    tenant: str | None = None  # None: not bound (the default tenant, or a trusted header)
    created: float = 0.0  # unix seconds
    revoked: bool = False
    expires: float | None = None  # unix seconds
    models: tuple[str, ...] | None = None  # None: every model
    hint: str = "..."
    # minted by an authenticated admin on a node whose control plane has auth: only such keys are
    # published to the mesh, and nodes with auth on accept no other (shepherd.node.cluster.key_sync)
    minted_authenticated: bool = False

    def usable(self, now: float) -> bool:
        return not self.revoked and (self.expires is None or now < self.expires)

    def public(self) -> dict[str, Any]:
        """The record as the admin API shows it (no digest, no key)."""
        return {
            "id": self.id,
            "object": "api_key",
            "name": self.name,
            "role": self.role,
            "tenant": self.tenant,
            "created": int(self.created),
            "expires_at": None if self.expires is None else math.ceil(self.expires),
            "revoked": self.revoked,
            "models": None if self.models is None else list(self.models),
            "hint": self.hint,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain data for replication (the digest included, never the key)."""
        return {
            "id": self.id,
            "name": self.name,
            "role": self.role,
            "digest": self.digest,
            "tenant": self.tenant,
            "created": self.created,
            "revoked": self.revoked,
            "expires": self.expires,
            "models": None if self.models is None else list(self.models),
            "hint": self.hint,
            "minted_authenticated": self.minted_authenticated,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ApiKeyRecord:
        role = d.get("role")
        digest = d.get("digest")
        if role not in ROLES or not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("an API key record needs a role ('admin' or 'user') and a 64-hex digest")
        models = d.get("models")
        return cls(
            id=str(d["id"]),
            name=str(d.get("name", "")),
            role=cast(Role, role),
            digest=digest.lower(),
            tenant=None if d.get("tenant") is None else str(d["tenant"]),
            created=float(d.get("created") or 0.0),
            revoked=bool(d.get("revoked", False)),
            expires=None if d.get("expires") is None else float(d["expires"]),
            models=None if models is None else tuple(str(m) for m in models),
            hint=str(d.get("hint", "...")),
            minted_authenticated=d.get("minted_authenticated") is True,
        )


ChangeCallback = Callable[[ApiKeyRecord], None]


class KeyStore(Protocol):
    """Where API key records live. ``find`` is on every authenticated request: it must not do I/O."""

    def find(self, digest: str) -> ApiKeyRecord | None: ...
    def get(self, key_id: str) -> ApiKeyRecord | None: ...
    def records(self) -> list[ApiKeyRecord]: ...
    def add(self, record: ApiKeyRecord) -> None: ...
    def revoke(self, key_id: str) -> ApiKeyRecord | None: ...
    def export(self) -> list[dict[str, Any]]: ...
    def apply(self, records: Iterable[Mapping[str, Any]]) -> None: ...
    def subscribe(self, callback: ChangeCallback) -> None: ...


def merge_record(old: ApiKeyRecord | None, new: ApiKeyRecord) -> ApiKeyRecord:
    """Merge two versions of one key: revocation wins, the earliest expiry wins; else the newer fields."""
    if old is None:
        return new
    expires = (
        new.expires
        if old.expires is None
        else old.expires
        if new.expires is None
        else min(old.expires, new.expires)
    )
    return replace(new, revoked=old.revoked or new.revoked, expires=expires)


class MemoryKeyStore:
    """The in-memory ``KeyStore``: dicts by id and by digest."""

    def __init__(self, records: Iterable[ApiKeyRecord] = ()) -> None:
        self._by_id: dict[str, ApiKeyRecord] = {}
        self._by_digest: dict[str, ApiKeyRecord] = {}
        self._subscribers: list[ChangeCallback] = []
        self._watchers: list[ChangeCallback] = []
        for r in records:
            self._put(r)

    def _put(self, record: ApiKeyRecord) -> ApiKeyRecord:
        merged = merge_record(self._by_id.get(record.id), record)
        old = self._by_id.get(record.id)
        if old is not None and old.digest != merged.digest:
            self._by_digest.pop(old.digest, None)
        self._by_id[merged.id] = merged
        self._by_digest[merged.digest] = merged
        if merged != old:
            for cb in list(self._watchers):
                cb(merged)
        return merged

    def _changed(self, record: ApiKeyRecord) -> None:
        for cb in list(self._subscribers):
            cb(record)

    def find(self, digest: str) -> ApiKeyRecord | None:
        r = self._by_digest.get(digest)
        if r is not None and hmac.compare_digest(r.digest, digest):
            return r
        return None

    def get(self, key_id: str) -> ApiKeyRecord | None:
        return self._by_id.get(key_id)

    def records(self) -> list[ApiKeyRecord]:
        return sorted(self._by_id.values(), key=lambda r: (r.created, r.id))

    def add(self, record: ApiKeyRecord) -> None:
        if record.digest in self._by_digest and self._by_digest[record.digest].id != record.id:
            raise ValueError("a key with this digest is already stored under another id")
        self._changed(self._put(record))

    def revoke(self, key_id: str) -> ApiKeyRecord | None:
        r = self._by_id.get(key_id)
        if r is None:
            return None
        if not r.revoked:
            r = self._put(replace(r, revoked=True))
            self._changed(r)
        return r

    def export(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records()]

    def apply(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Records changed elsewhere (another node, the replicated document); no callback is called."""
        for d in records:
            self._put(ApiKeyRecord.from_dict(d))

    def subscribe(self, callback: ChangeCallback) -> None:
        self._subscribers.append(callback)

    def forget(self, key_id: str) -> ApiKeyRecord | None:
        """Drop a record as if it had never been stored (no callback): a bootstrap key the configuration
        no longer lists (``shepherd.node.api.reload``). Never for replicated keys: revoke those."""
        r = self._by_id.pop(key_id, None)
        if r is not None and self._by_digest.get(r.digest) is r:
            del self._by_digest[r.digest]
        return r

    def watch(self, callback: ChangeCallback) -> None:
        """Call ``callback`` with every record whose stored form changes, whoever changed it (``add``,
        ``revoke`` and ``apply`` alike, unlike ``subscribe``): a journal that keeps the store across
        restarts (``shepherd.node.cluster.key_journal``)."""
        self._watchers.append(callback)


def create_key(
    store: KeyStore,
    name: str,
    role: Role = "user",
    *,
    tenant: str | None = None,
    expires: float | None = None,
    models: Iterable[str] | None = None,
    prefix: str = DEFAULT_PREFIX,
    now: float | None = None,
    minted_authenticated: bool = False,
) -> tuple[str, ApiKeyRecord]:
    """Make a new key, store its record, and return the plaintext (shown once) with the record.
    ``minted_authenticated``: the caller is an authenticated admin (the key may go mesh-wide)."""
    key = generate_key(prefix)
    record = ApiKeyRecord(
        id=new_key_id(),
        name=name,
        role=role,
        digest=hash_key(key),
        tenant=tenant,
        created=time.time() if now is None else now,
        expires=expires,
        models=None if models is None else tuple(models),
        hint=key_hint(key, prefix),
        minted_authenticated=minted_authenticated,
    )
    store.add(record)
    return key, record


class BootstrapError(ValueError):
    """A bootstrap key from the configuration cannot be loaded (e.g. its env var is unset)."""


def bootstrap_records(cfg: AuthConfig, environ: Mapping[str, str] | None = None) -> list[ApiKeyRecord]:
    """The configuration's keys as records (env vars read here; their values are never logged)."""
    env = os.environ if environ is None else environ
    out = []
    for k in cfg.keys:
        if k.env is not None:
            secret = env.get(k.env)
            if not secret:
                raise BootstrapError(f"auth key {k.name!r}: environment variable {k.env} is unset or empty")
            digest = hash_key(secret)
            hint = key_hint(secret, cfg.key_prefix)
        else:
            assert k.sha256 is not None
            digest, hint = k.sha256, "..."
        out.append(
            ApiKeyRecord(
                id=k.record_id,
                name=k.name,
                role=k.role,
                digest=digest,
                tenant=k.tenant,
                created=0.0,
                models=k.models,
                hint=hint,
            )
        )
    return out


MIN_KEY_CHARS = 32  # a bootstrap key shorter than this is warned about at start


def short_env_keys(cfg: AuthConfig, environ: Mapping[str, str] | None = None) -> list[tuple[str, str, int]]:
    """The configuration's keys read from environment variables that are shorter than ``MIN_KEY_CHARS``:
    (key name, variable, length); never the value."""
    env = os.environ if environ is None else environ
    out = []
    for k in cfg.keys:
        if k.env is not None:
            n = len(env.get(k.env) or "")
            if 0 < n < MIN_KEY_CHARS:
                out.append((k.name, k.env, n))
    return out


def principal_for(record: ApiKeyRecord, default_tenant: str) -> Principal:
    return Principal(
        subject=record.id,
        tenant=record.tenant or default_tenant,
        role=record.role,
        key_id=record.id,
        method="api_key",
        models=record.models,
    )
