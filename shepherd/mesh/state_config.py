"""Control-plane config of the mesh as a ``pycrdt`` document: API keys, tenants, limits, model policies.

One Y-Map per section; a record is stored as one JSON string under its key, so concurrent writes of
one record resolve as a whole (Yjs' deterministic last-writer-wins on a map key), never field by
field. Yjs updates merge commutatively, associatively and idempotently; Yrs keeps tombstones of
deleted items forever, which is why only this low-churn data lives here (docs/DESIGN.md §6), never the
prefix index or counters.

API key revocations have a section of their own (``revoked_keys``, by key hash): a revocation is
only ever added, never overwritten or deleted, so it outlasts any concurrent write of the key's record
(a last-writer-wins map key could not promise that); readers treat a key whose hash is there as revoked
(``KeyRevocation``, ``revoke_api_key``, ``revoked_key_hashes``).

Replication: ``take_delta()`` is the update since the last one taken (local edits and remote ones
that changed this document: relaying stops where nothing changes); ``state_vector()`` and
``update_since(sv)`` repair a peer; ``apply_update(u)`` validates ``u`` on a scratch copy first
(the document must still decode into typed records), so a malformed update raises
``StateDecodeError`` and leaves the document as it was. API keys are stored hashed
(``hash_secret``): the secret itself never enters the mesh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pycrdt import Doc, Map, TransactionEvent

from shepherd.proto.state_decode import StateDecodeError

__all__ = [
    "SECTIONS",
    "ApiKeyRecord",
    "ConfigDoc",
    "KeyRevocation",
    "LimitRecord",
    "ModelPolicyRecord",
    "TenantRecord",
    "hash_secret",
]

SECTIONS = ("api_keys", "tenants", "limits", "policies", "revoked_keys")
OptionValue = str | int | float | bool


def hash_secret(secret: str) -> str:
    """The stored form of an API key (keys are long random strings: a fast hash is enough)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _str(d: dict[str, Any], k: str, default: str | None = None) -> str:
    v = d.get(k, default)
    if type(v) is not str:
        raise StateDecodeError(f"{k}: expected a string")
    return v


def _opt_num(d: dict[str, Any], k: str, kind: type[int] | type[float]) -> Any:
    v = d.get(k)
    if v is None:
        return None
    if type(v) is bool or not isinstance(v, int | float) or (kind is int and type(v) is not int):
        raise StateDecodeError(f"{k}: expected a number")
    return kind(v)


def _bool(d: dict[str, Any], k: str) -> bool:
    v = d.get(k, False)
    if type(v) is not bool:
        raise StateDecodeError(f"{k}: expected a bool")
    return v


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    key_id: str
    key_hash: str  # hash_secret(secret)
    tenant: str = "default"  # "": bound to no tenant (the node's default one)
    role: str = "user"  # "admin" | "user" | ...
    name: str = ""
    created_at: float = 0.0
    expires_at: float | None = None
    disabled: bool = False
    models: tuple[str, ...] | None = None  # models the key may use; None: every model
    hint: str = ""  # what listings show of the key (its prefix and last 4 characters)
    minted_authenticated: bool = False  # by an authenticated admin (nodes with auth on need it)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "key_hash": self.key_hash,
            "tenant": self.tenant,
            "role": self.role,
            "name": self.name,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "disabled": self.disabled,
            "models": None if self.models is None else list(self.models),
            "hint": self.hint,
            "minted_authenticated": self.minted_authenticated,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ApiKeyRecord:
        models = d.get("models")
        if models is not None and (type(models) is not list or any(type(m) is not str for m in models)):
            raise StateDecodeError("models: expected a list of strings or null")
        return cls(
            _str(d, "key_id"),
            _str(d, "key_hash"),
            _str(d, "tenant", "default"),
            _str(d, "role", "user"),
            _str(d, "name", ""),
            _opt_num(d, "created_at", float) or 0.0,
            _opt_num(d, "expires_at", float),
            _bool(d, "disabled"),
            None if models is None else tuple(models),
            _str(d, "hint", ""),
            d.get("minted_authenticated") is True,
        )

    @property
    def key(self) -> str:
        return self.key_id


@dataclass(frozen=True, slots=True)
class KeyRevocation:
    """A revoked API key, by its hash: added once, never deleted (revocation is final)."""

    key_hash: str
    key_id: str = ""  # the record it revoked (for the operator: any record with this hash is revoked)
    revoked_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"key_hash": self.key_hash, "key_id": self.key_id, "revoked_at": self.revoked_at}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KeyRevocation:
        return cls(_str(d, "key_hash"), _str(d, "key_id", ""), _opt_num(d, "revoked_at", float) or 0.0)

    @property
    def key(self) -> str:
        return self.key_hash


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant: str
    models: tuple[str, ...] = ()  # models it may use; () = all
    max_concurrency: int | None = None
    disabled: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "models": list(self.models),
            "max_concurrency": self.max_concurrency,
            "disabled": self.disabled,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TenantRecord:
        models = d.get("models", [])
        if type(models) is not list or any(type(m) is not str for m in models):
            raise StateDecodeError("models: expected a list of strings")
        return cls(
            _str(d, "tenant"), tuple(models), _opt_num(d, "max_concurrency", int), _bool(d, "disabled")
        )

    @property
    def key(self) -> str:
        return self.tenant


@dataclass(frozen=True, slots=True)
class LimitRecord:
    scope: str  # "global" | "tenant:<name>" | "key:<key_id>" | "model:<name>"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    window_s: float = 60.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "window_s": self.window_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LimitRecord:
        return cls(
            _str(d, "scope"),
            _opt_num(d, "requests_per_minute", int),
            _opt_num(d, "tokens_per_minute", int),
            _opt_num(d, "window_s", float) or 60.0,
        )

    @property
    def key(self) -> str:
        return self.scope


@dataclass(frozen=True, slots=True)
class ModelPolicyRecord:
    model: str
    policy: str  # "cache_aware" | "round_robin" | ... (routing policy name)
    options: tuple[tuple[str, OptionValue], ...] = ()  # sorted (name, value) pairs

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "policy": self.policy, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelPolicyRecord:
        opts = d.get("options", {})
        if type(opts) is not dict or any(type(v) not in (str, int, float, bool) for v in opts.values()):
            raise StateDecodeError("options: expected a map of scalars")
        return cls(_str(d, "model"), _str(d, "policy"), tuple(sorted(opts.items())))

    @property
    def key(self) -> str:
        return self.model


Record = ApiKeyRecord | TenantRecord | LimitRecord | ModelPolicyRecord | KeyRevocation
R = TypeVar("R", ApiKeyRecord, TenantRecord, LimitRecord, ModelPolicyRecord, KeyRevocation)
_TYPES: dict[str, Callable[[dict[str, Any]], Record]] = {
    "api_keys": ApiKeyRecord.from_dict,
    "tenants": TenantRecord.from_dict,
    "limits": LimitRecord.from_dict,
    "policies": ModelPolicyRecord.from_dict,
    "revoked_keys": KeyRevocation.from_dict,
}


def _decode(section: str, raw: Any) -> Record:
    if type(raw) is not str:
        raise StateDecodeError(f"{section}: a record must be a JSON string")
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise StateDecodeError(f"{section}: bad JSON: {e}") from None
    if type(d) is not dict:
        raise StateDecodeError(f"{section}: a record must be a JSON object")
    return _TYPES[section](d)


class ConfigDoc:
    """The control-plane document of one node. ``client_id``: Yjs client id (random by default;
    it must be unique per live document, so never reuse one across restarts)."""

    def __init__(self, client_id: int | None = None) -> None:
        self.doc: Doc[Any] = Doc(client_id=client_id)
        self._maps: dict[str, Map[Any]] = {s: self.doc.get(s, type=Map) for s in SECTIONS}
        self._sent_sv = self.doc.get_state()
        self.changed = False  # whether ``take_delta`` has an update to give (read-only outside)
        self.version = 0  # bumped on every change, local or remote (consumers cache by it)
        self._digest: tuple[int, bytes] | None = None  # (version, digest())
        self._sub = self.doc.observe(self._on_change)

    def _on_change(self, event: TransactionEvent) -> None:
        self.changed = True
        self.version += 1

    # -- generic access -----------------------------------------------------------------------------

    def put(self, section: str, record: Record) -> None:
        if not isinstance(record, _record_type(section)):
            raise TypeError(f"{type(record).__name__} does not belong in {section}")
        raw = json.dumps(record.to_dict(), sort_keys=True, separators=(",", ":"))
        m = self._maps[section]
        if m.get(record.key) != raw:
            m[record.key] = raw

    def get(self, section: str, key: str) -> Record | None:
        raw = self._maps[section].get(key)
        if raw is None:
            return None
        try:
            return _decode(section, raw)
        except StateDecodeError:
            return None

    def delete(self, section: str, key: str) -> bool:
        m = self._maps[section]
        if key in m:
            m.pop(key)
            return True
        return False

    def items(self, section: str) -> dict[str, Record]:
        out: dict[str, Record] = {}
        for k, raw in self._maps[section].items():
            try:
                out[k] = _decode(section, raw)
            except StateDecodeError:
                continue
        return out

    def to_py(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every section's records as plain dicts (for ``/mesh/state`` and comparisons)."""
        return {s: {k: r.to_dict() for k, r in sorted(self.items(s).items())} for s in SECTIONS}

    # -- typed helpers ------------------------------------------------------------------------------

    def set_api_key(self, rec: ApiKeyRecord) -> None:
        self.put("api_keys", rec)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        return _as(ApiKeyRecord, self.get("api_keys", key_id))

    def delete_api_key(self, key_id: str) -> bool:
        return self.delete("api_keys", key_id)

    def api_keys(self) -> list[ApiKeyRecord]:
        return [r for r in self.items("api_keys").values() if isinstance(r, ApiKeyRecord)]

    def find_api_key(self, secret: str) -> ApiKeyRecord | None:
        """The record of a presented secret (by its hash), if any; disabled if its hash was revoked."""
        h = hash_secret(secret)
        r = next((r for r in self.api_keys() if r.key_hash == h), None)
        if r is not None and not r.disabled and h in self._maps["revoked_keys"]:
            r = dataclasses.replace(r, disabled=True)
        return r

    def revoke_api_key(self, key_hash: str, key_id: str = "", revoked_at: float = 0.0) -> None:
        """Revoke the key of ``key_hash`` for good: its revocation record (kept even if a concurrent
        write of the key's record wins), and the record, if here, marked disabled; one transaction."""
        with self.doc.transaction():
            if self.get("revoked_keys", key_hash) is None:
                self.put("revoked_keys", KeyRevocation(key_hash, key_id, revoked_at))
            rec = self.get_api_key(key_id) if key_id else None
            if rec is not None and rec.key_hash == key_hash and not rec.disabled:
                self.put("api_keys", dataclasses.replace(rec, disabled=True))

    def revocations(self) -> list[KeyRevocation]:
        return [r for r in self.items("revoked_keys").values() if isinstance(r, KeyRevocation)]

    def revoked_key_hashes(self) -> frozenset[str]:
        return frozenset(self._maps["revoked_keys"].keys())

    def set_tenant(self, rec: TenantRecord) -> None:
        self.put("tenants", rec)

    def get_tenant(self, name: str) -> TenantRecord | None:
        return _as(TenantRecord, self.get("tenants", name))

    def delete_tenant(self, name: str) -> bool:
        return self.delete("tenants", name)

    def tenants(self) -> list[TenantRecord]:
        return [r for r in self.items("tenants").values() if isinstance(r, TenantRecord)]

    def set_limit(self, rec: LimitRecord) -> None:
        self.put("limits", rec)

    def get_limit(self, scope: str) -> LimitRecord | None:
        return _as(LimitRecord, self.get("limits", scope))

    def delete_limit(self, scope: str) -> bool:
        return self.delete("limits", scope)

    def limits(self) -> list[LimitRecord]:
        return [r for r in self.items("limits").values() if isinstance(r, LimitRecord)]

    def set_policy(self, rec: ModelPolicyRecord) -> None:
        self.put("policies", rec)

    def get_policy(self, model: str) -> ModelPolicyRecord | None:
        return _as(ModelPolicyRecord, self.get("policies", model))

    def delete_policy(self, model: str) -> bool:
        return self.delete("policies", model)

    def policies(self) -> list[ModelPolicyRecord]:
        return [r for r in self.items("policies").values() if isinstance(r, ModelPolicyRecord)]

    # -- replication --------------------------------------------------------------------------------

    def state_vector(self) -> bytes:
        return self.doc.get_state()

    def update_since(self, state_vector: bytes | None = None) -> bytes:
        """What a peer at ``state_vector`` (None: an empty peer) lacks, with the full delete set."""
        try:
            return self.doc.get_update(state_vector)
        except ValueError as e:
            raise StateDecodeError(f"bad state vector: {e}") from None

    def apply_update(self, update: bytes) -> bool:
        """Apply a peer's update; True if the document changed. Raises ``StateDecodeError`` (and
        changes nothing) if the update does not decode or leaves records that do not."""
        if type(update) is not bytes:
            raise StateDecodeError("a config update is bytes")
        scratch: Doc[Any] = Doc()
        try:
            scratch.apply_update(self.doc.get_update())
            scratch.apply_update(update)
        except ValueError as e:
            raise StateDecodeError(f"bad config update: {e}") from None
        for s in SECTIONS:
            for raw in scratch.get(s, type=Map).values():
                _decode(s, raw)
        before = self.version
        self.doc.apply_update(update)
        return self.version != before

    def take_delta(self) -> bytes | None:
        """The update since the last delta taken, if anything changed since."""
        if not self.changed:
            return None
        u = self.doc.get_update(self._sent_sv)
        self._sent_sv = self.doc.get_state()
        self.changed = False
        return u

    def digest(self) -> bytes:
        """16 bytes naming the document's state: its state vector (the operations it holds) and its
        content (deletions do not move the state vector). Not the full update: Yrs may encode equal
        states differently (the property test found converged documents whose updates differ)."""
        got = self._digest
        if got is not None and got[0] == self.version:  # (the content's JSON: once per change)
            return got[1]
        h = hashlib.blake2b(self.doc.get_state(), digest_size=16)
        h.update(json.dumps(self.to_py(), sort_keys=True, separators=(",", ":"), default=str).encode())
        self._digest = (self.version, h.digest())
        return self._digest[1]


def _record_type(section: str) -> type[Record]:
    return {
        "api_keys": ApiKeyRecord,
        "tenants": TenantRecord,
        "limits": LimitRecord,
        "policies": ModelPolicyRecord,
        "revoked_keys": KeyRevocation,
    }[section]


def _as(cls: type[R], rec: Record | None) -> R | None:
    return rec if isinstance(rec, cls) else None
