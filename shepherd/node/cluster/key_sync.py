"""API keys mesh-wide: a node's ``KeyStore`` kept in step with the mesh's control-plane document.

A key created on any node (``POST /admin/keys``) is usable on every node, and a key revoked on any
node (``DELETE /admin/keys/{id}``) is refused on every node, as soon as the document's update has
reached it (piggybacked on the next gossip rounds; push-pull repairs what a datagram lost).

- **Local → document**: ``KeySync`` subscribes to the store. A key made here is written to the
  document's ``api_keys`` section as its digest and metadata (``state_config.ApiKeyRecord``: never the
  plaintext, which only the creator's answer ever holds); a revocation here writes the key's
  revocation (``revoked_keys``, by digest) and marks the record disabled, in one transaction.
- **Document → local**: ``pull`` (called on every change of the document from a peer:
  ``MeshState.on_config_changed``, and once at start) applies the document's records to the store
  with ``KeyStore.apply``, which calls no subscriber, so nothing echoes back. Only records that
  change what the store holds are applied (the authenticator's per-key cache stays warm).
- **Revocation is final**: a revocation lives under its own key in the document and is never
  overwritten or deleted, so it survives any concurrent write of the key's record (the record's own
  map key is last-writer-wins); a key whose digest is revoked there is revoked here whatever its
  record says, and the store's merge (``keys.merge_record``) never un-revokes. Whatever order the
  updates arrive in, every node ends with the same set of revoked keys: the union of the revocations.
- **Bootstrap keys** (configuration and env) stay local: they are never written to the document
  (each node's configuration is authoritative for its own, so two nodes that configure different
  keys under the same id never fight over a map key), and a document record with the id of a local
  bootstrap key is ignored here. A revocation is by digest, so revoking a bootstrap key revokes that
  key on every node configured with it, also after a restart (a revoked key must be replaced, not
  re-enabled).

- **Who may put keys in the document**: only keys minted by an authenticated admin on a node whose
  control plane has auth (``ApiKeyRecord.minted_authenticated``) go mesh-wide. A node whose control
  plane is unauthenticated (``publish=False``) writes nothing to the document (its keys, minted by
  anyone who reaches it, and its revocations stay local), and a node with auth on
  (``require_authenticated``) ignores every document record without the mark: a key minted by an
  anonymous admin, or written by a node from before the rule, is never honoured there.

Conversion between the two records: ``tenant`` None here is ``""`` in the document; a document record
whose role is not ``admin``/``user`` or whose digest is not 64 hex digits is skipped (and counted).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from shepherd.auth.keys import ApiKeyRecord, KeyStore, merge_record
from shepherd.auth.principal import Role
from shepherd.mesh.state_config import ApiKeyRecord as DocKeyRecord
from shepherd.mesh.state_config import ConfigDoc

log = logging.getLogger("shepherd.node.cluster.key_sync")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ROLES: dict[str, Role] = {"admin": "admin", "user": "user"}


class ConfigSource(Protocol):
    """What ``KeySync.attach`` uses of ``shepherd.mesh.state.MeshState``."""

    config: ConfigDoc
    on_config_changed: list[Callable[[ConfigDoc], None]]


def to_doc(r: ApiKeyRecord) -> DocKeyRecord:
    """The document's form of a store record (digest and metadata; the key itself is never there)."""
    return DocKeyRecord(
        key_id=r.id,
        key_hash=r.digest,
        tenant=r.tenant or "",
        role=r.role,
        name=r.name,
        created_at=r.created,
        expires_at=r.expires,
        disabled=r.revoked,
        models=r.models,
        hint=r.hint,
        minted_authenticated=r.minted_authenticated,
    )


def from_doc(d: DocKeyRecord, revoked: bool = False) -> ApiKeyRecord | None:
    """The store's form of a document record (None when it cannot authenticate anyone)."""
    role = _ROLES.get(d.role)
    digest = d.key_hash.lower()
    if role is None or not _HEX64.match(digest) or not d.key_id:
        return None
    return ApiKeyRecord(
        id=d.key_id,
        name=d.name,
        role=role,
        digest=digest,
        tenant=d.tenant or None,
        created=d.created_at,
        revoked=d.disabled or revoked,
        expires=d.expires_at,
        models=d.models,
        hint=d.hint or "...",
        minted_authenticated=d.minted_authenticated,
    )


@dataclass(slots=True)
class KeySyncStats:
    published: int = 0  # records written to the document
    revocations_published: int = 0
    applied: int = 0  # records from the document that changed the store
    revocations_applied: int = 0  # local records revoked by a revocation from the document
    skipped: int = 0  # document records that cannot be used (bad role or digest), each counted once
    shadowed: int = 0  # document records with the id of a local bootstrap key (ignored), each once
    unattested: int = 0  # document records not minted by an authenticated admin (ignored), each once


class KeySync:
    """Keeps one ``KeyStore`` and one ``ConfigDoc`` in step, both ways, without echo (see the module)."""

    def __init__(
        self,
        store: KeyStore,
        doc: ConfigDoc,
        *,
        local_ids: Collection[str] = (),
        clock: Callable[[], float] | None = None,
        publish: bool = True,
        require_authenticated: bool = False,
    ) -> None:
        self.store = store
        self.doc = doc
        self.local_ids = frozenset(local_ids)  # bootstrap keys: this node's configuration, never published
        self.publish = publish  # False: this node's control plane is unauthenticated, nothing goes out
        self.require_authenticated = require_authenticated  # auth on here: only attested records come in
        self.clock = clock or time.time
        self.stats = KeySyncStats()
        self._seen_version = -1
        self._warned: set[str] = set()
        store.subscribe(self._local_changed)

    @classmethod
    def attach(
        cls,
        store: KeyStore,
        state: ConfigSource,
        *,
        local_ids: Collection[str] = (),
        clock: Callable[[], float] | None = None,
        publish: bool = True,
        require_authenticated: bool = False,
    ) -> KeySync:
        """Wire ``store`` to a mesh state's document: publish what the store holds, take what the
        document holds, and pull on every change a peer makes."""
        sync = cls(
            store,
            state.config,
            local_ids=local_ids,
            clock=clock,
            publish=publish,
            require_authenticated=require_authenticated,
        )
        sync.publish_all()
        sync.pull()
        state.on_config_changed.append(sync.on_config_changed)
        return sync

    def on_config_changed(self, _doc: ConfigDoc) -> None:
        """``MeshState.on_config_changed`` subscriber: a peer changed the document."""
        self.pull()

    # -- local -> document --------------------------------------------------------------------------

    def _local_changed(self, r: ApiKeyRecord) -> None:
        if not self.publish:
            return
        if r.id not in self.local_ids and r.minted_authenticated:
            self._publish(r)
        if r.revoked:
            self._publish_revocation(r)

    def _publish(self, r: ApiKeyRecord) -> None:
        cur = self.doc.get_api_key(r.id)
        rec = to_doc(r)
        if cur is not None and cur.disabled and not rec.disabled and cur.key_hash == rec.key_hash:
            rec = replace(rec, disabled=True)  # never un-disable a record here
        if cur != rec:
            self.doc.set_api_key(rec)
            self.stats.published += 1

    def _publish_revocation(self, r: ApiKeyRecord) -> None:
        if r.digest in self.doc.revoked_key_hashes():
            return
        self.doc.revoke_api_key(r.digest, r.id, self.clock())
        self.stats.revocations_published += 1

    def publish_all(self) -> None:
        """Write every key of the store the document lacks (non-bootstrap ones) and every revocation."""
        for r in self.store.records():
            self._local_changed(r)

    # -- document -> local --------------------------------------------------------------------------

    def pull(self) -> int:
        """Apply the document to the store; returns the records that changed here."""
        if self.doc.version == self._seen_version:
            return 0
        self._seen_version = self.doc.version
        revoked = self.doc.revoked_key_hashes()
        changed = 0
        for d in self.doc.api_keys():
            if d.key_id in self.local_ids:
                if self._warn_once(d.key_id, "a mesh key record has a local bootstrap key's id: ignored"):
                    self.stats.shadowed += 1
                continue
            if self.require_authenticated and not d.minted_authenticated:
                if self._warn_once(d.key_id, "a mesh key record not minted by an authenticated admin"):
                    self.stats.unattested += 1
                continue
            new = from_doc(d, revoked=d.key_hash.lower() in revoked)
            if new is None:
                if self._warn_once(d.key_id, "a mesh key record has no usable role or digest: ignored"):
                    self.stats.skipped += 1
                continue
            cur = self.store.get(new.id)
            if cur is None or merge_record(cur, new) != cur:
                self.store.apply([new.to_dict()])
                self.stats.applied += 1
                changed += 1
        for digest in revoked:  # keys known here by another route (bootstrap ones, or records not yet seen)
            cur = self.store.find(digest)
            if cur is not None and not cur.revoked:
                self.store.apply([replace(cur, revoked=True).to_dict()])
                self.stats.revocations_applied += 1
                changed += 1
        return changed

    def _warn_once(self, key_id: str, what: str) -> bool:
        """Log ``what`` the first time a record is seen (True then); bounded."""
        if key_id in self._warned or len(self._warned) >= 10_000:
            return False
        self._warned.add(key_id)
        log.warning("%s (key id %r)", what, key_id[:64])
        return True
