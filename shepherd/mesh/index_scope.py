"""Which members a node sends a model's prefix-index deltas to: the ones that route the model.

A model's index matters only to the nodes that route its requests (a node serves a fixed set of models;
the registry bridge leaves the workers of other models out). Each node says which models it routes with
a prefix index in its SWIM metadata, gossiped with its membership (``routes_meta``: a 4-byte key per
model, so any model name fits; at most ``MAX_MODELS``, beyond which the node asks for every model's
deltas). A sender keeps a model's deltas for the members whose metadata names the model (``IndexScope``);
a member whose metadata says nothing of it (a node of an older build, or too many models) gets every
model's, as before. A key collision only sends a model's deltas to a node that does not need them.

The same metadata says whether the node's control plane is authenticated (``"ca"``: ``routes_meta``'s
``control_auth``, read by ``control_authenticated``): a node with auth on takes no worker changes from a
member whose control plane is open (README "Authentication, roles, TLS, rate limits").

Pure: no I/O; the node's mesh (``node.cluster.mesh_node``) builds the metadata and asks the scope.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgpack  # type: ignore[import-untyped]

from shepherd.proto.mesh_messages import MAX_META_LEN

__all__ = ["MAX_MODELS", "IndexScope", "control_authenticated", "model_key", "routed_keys", "routes_meta"]

KEY_BYTES = 4
MAX_MODELS = (MAX_META_LEN - 16) // KEY_BYTES  # keys that fit the metadata with its framing


def model_key(model: str) -> bytes:
    """A model's 4-byte key in the metadata (stable across processes and builds)."""
    return hashlib.blake2b(model.encode(), digest_size=KEY_BYTES).digest()


def routes_meta(models: Iterable[str], control_auth: bool | None = None) -> bytes:
    """SWIM metadata saying this node routes ``models`` with a prefix index (none: it needs no index
    deltas; more than ``MAX_MODELS``: ``{"ix": None}``, every model's deltas), and, when given, whether
    its control plane is authenticated (``"ca"``)."""
    keys = sorted({model_key(m) for m in models})
    body = None if len(keys) > MAX_MODELS else b"".join(keys)
    meta: dict[str, object] = {"ix": body}
    if control_auth is not None:
        meta["ca"] = control_auth
    return bytes(msgpack.packb(meta, use_bin_type=True))


def _meta_map(meta: bytes) -> dict[str, object] | None:
    if not meta:
        return None
    try:
        v = msgpack.unpackb(meta, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    return v if type(v) is dict else None


def control_authenticated(meta: bytes) -> bool | None:
    """Whether a member's control plane is authenticated, as its metadata says; None: it does not say (a
    node of an older build, or metadata not ours)."""
    v = _meta_map(meta)
    ca = None if v is None else v.get("ca")
    return ca if type(ca) is bool else None


def routed_keys(meta: bytes) -> frozenset[bytes] | None:
    """The model keys a member's metadata names; None when it does not say (every model's deltas go to
    it): empty, not ours, malformed, or more models than fit."""
    v = _meta_map(meta)
    if v is None or "ix" not in v:
        return None
    body = v["ix"]
    if type(body) is not bytes or len(body) % KEY_BYTES:
        return None
    return frozenset(body[i : i + KEY_BYTES] for i in range(0, len(body), KEY_BYTES))


class IndexScope:
    """``routes(meta, model)``: whether a member with this metadata gets the model's index deltas. The
    parse of each distinct metadata value is kept (members share a few values; bounded)."""

    def __init__(self, max_cached: int = 4096) -> None:
        self._parsed: dict[bytes, frozenset[bytes] | None] = {}
        self._keys: dict[str, bytes] = {}
        self._max = max_cached

    def key(self, model: str) -> bytes:
        k = self._keys.get(model)
        if k is None:
            if len(self._keys) >= self._max:
                self._keys.clear()
            k = self._keys[model] = model_key(model)
        return k

    def keys_of(self, meta: bytes) -> frozenset[bytes] | None:
        if meta in self._parsed:
            return self._parsed[meta]
        if len(self._parsed) >= self._max:
            self._parsed.clear()
        keys = self._parsed[meta] = routed_keys(meta)
        return keys

    def routes(self, meta: bytes, model: str) -> bool:
        keys = self.keys_of(meta)
        return keys is None or self.key(model) in keys

    def models_for(self, meta: bytes, models: Iterable[str]) -> list[str]:
        """Those of ``models`` a member with this metadata routes."""
        keys = self.keys_of(meta)
        return list(models) if keys is None else [m for m in models if self.key(m) in keys]
