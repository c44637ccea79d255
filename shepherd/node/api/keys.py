"""Admin API for API keys (control plane: the admin role when control-plane auth is on).

- ``POST /admin/keys`` ``{"name", "role": "user"|"admin", "tenant"?, "expires_in"? (seconds) or
  "expires_at"? (unix seconds), "models"? [names]}`` → 201 with the record and ``"key"``: the plaintext,
  shown this once and never again;
- ``GET /admin/keys`` → ``{"object": "list", "data": [records]}`` (never a key or its digest);
- ``GET /admin/keys/{key_id}`` → one record;
- ``DELETE /admin/keys/{key_id}`` → the record, revoked (revocation is final).

With the mesh on (``app[mesh.MESH]`` set before ``install``), the store is kept in step with the
mesh's control-plane document (``shepherd.node.cluster.key_sync.KeySync``): a key created or revoked on any
node is accepted or refused on every node after a gossip round; bootstrap keys stay local. Only keys made
by an authenticated admin go mesh-wide: a node whose control plane is unauthenticated keeps the keys it
mints (and its revocations) to itself, and a node with auth on ignores document records not so marked.

``install`` also puts the control plane's guard (``shepherd.auth.control``: the admin listener split and
the browser checks) in front of the auth middleware.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from shepherd.auth import middleware as auth
from shepherd.auth.control import ControlGuard, make_control_middleware
from shepherd.auth.keys import KeyStore, create_key
from shepherd.auth.principal import ANONYMOUS, principal_of
from shepherd.node.api.common import GATEWAY, audit
from shepherd.node.api.mesh import MESH
from shepherd.node.cluster.key_sync import KeySync
from shepherd.node.config import control_listener, insecure_admin_in_effect
from shepherd.node.http.body import json_response, read_json
from shepherd.proto.openai_errors import ApiError, bad

MAX_NAME = 200


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_NAME or not v.isprintable():
        raise bad(
            f"'{key}' must be a non-empty printable string of at most {MAX_NAME} characters.", param=key
        )
    return v


_MAX_EXPIRY = 1 << 40  # seconds: far beyond any real expiry, still a 64-bit integer everywhere


def _expiry(d: dict[str, Any], now: float) -> float | None:
    e_in, e_at = d.get("expires_in"), d.get("expires_at")
    if e_in is not None and e_at is not None:
        raise bad("Give 'expires_in' or 'expires_at', not both.", param="expires_in")
    for key, v in (("expires_in", e_in), ("expires_at", e_at)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < _MAX_EXPIRY:
            raise bad(f"'{key}' must be a positive number of seconds, below {_MAX_EXPIRY}.", param=key)
        at = now + float(v) if key == "expires_in" else float(v)
        if at <= now:
            raise bad("'expires_at' is in the past.", param=key)
        return at
    return None


_CREATE_FIELDS = ("name", "role", "tenant", "models", "expires_in", "expires_at")


async def create(request: web.Request) -> web.Response:
    state = request.app[auth.AUTH]
    _, d = await read_json(request, 64 * 1024)
    # an unknown field is refused, not ignored: a misspelt restriction ("model", "expire_at") would
    # otherwise mint a key without it
    for k in d:
        if k not in _CREATE_FIELDS:
            raise bad(f"Unknown field '{k}'; a key takes {', '.join(_CREATE_FIELDS)}.", param=k)
    name = _opt_str(d, "name") or "key"
    role = d.get("role", "user")
    if role not in ("user", "admin"):
        raise bad("'role' must be 'user' or 'admin'.", param="role")
    tenant = _opt_str(d, "tenant")
    models = d.get("models")
    if models is not None and (
        not isinstance(models, list)
        or not all(isinstance(m, str) and m for m in models)
        or len(models) > 1000
    ):
        raise bad("'models' must be a list of model names (or null for every model).", param="models")
    now = time.time()
    who = principal_of(request)
    key, rec = create_key(
        state.store,
        name,
        role,
        tenant=tenant,
        expires=_expiry(d, now),
        models=models,
        prefix=state.cfg.key_prefix,
        now=now,
        minted_authenticated=who is not ANONYMOUS and state.cfg.control_plane != "off",
    )
    audit(request, "api key minted", f"{rec.id} (role {role}, tenant {tenant or '-'})")
    return json_response({**rec.public(), "key": key, "created_by": who.subject}, 201)


async def list_keys(request: web.Request) -> web.Response:
    state = request.app[auth.AUTH]
    return json_response({"object": "list", "data": [r.public() for r in state.store.records()]})


async def get_key(request: web.Request) -> web.Response:
    rec = request.app[auth.AUTH].store.get(request.match_info["key_id"])
    if rec is None:
        raise ApiError(404, "No such API key.", code="key_not_found")
    return json_response(rec.public())


async def revoke(request: web.Request) -> web.Response:
    state = request.app[auth.AUTH]
    key_id = request.match_info["key_id"]
    if key_id in state.bootstrap_ids:  # the operator's, from the configuration: changed there, not here
        raise ApiError(
            409,
            f"API key {key_id!r} comes from the node's configuration (a bootstrap admin key): revoke it by "
            "removing it there and reloading.",
            code="bootstrap_key",
        )
    rec = state.store.revoke(key_id)
    if rec is None:
        raise ApiError(404, "No such API key.", code="key_not_found")
    audit(request, "api key revoked", rec.id)
    return json_response(rec.public())


# the key store's link to the mesh's control-plane document (None: the mesh is off)
KEY_SYNC: web.AppKey[KeySync | None] = web.AppKey("key_sync")


def routes() -> list[web.RouteDef]:
    return [
        web.post("/admin/keys", create),
        web.get("/admin/keys", list_keys),
        web.get("/admin/keys/{key_id}", get_key),
        web.delete("/admin/keys/{key_id}", revoke),
    ]


def install(app: web.Application, store: KeyStore | None = None) -> auth.AuthState:
    """Auth for a node's app: the key store (``store``; default in memory), linked to the mesh's
    control-plane document when the mesh is on, the middleware (after the error middleware) and these
    routes. Call after ``app[GATEWAY]`` (and ``api_mesh.install``) are set."""
    gw = app[GATEWAY]
    cfg = gw.cfg
    host, _ = control_listener(cfg)
    guard = ControlGuard.build(
        host,
        cfg.admin_allowed_origins,
        cfg.admin_allowed_hosts,
        unauthenticated=insecure_admin_in_effect(cfg),
    )
    app.middlewares.append(
        make_control_middleware(guard, admin_port=cfg.admin_port, metrics_protected=cfg.auth.metrics)
    )
    state = auth.install(app, cfg.auth, registry=gw.metrics.registry, store=store)
    mesh = app.get(MESH)
    app[KEY_SYNC] = (
        KeySync.attach(
            state.store,
            mesh.state,
            local_ids=state.bootstrap_ids,
            publish=cfg.auth.control_plane != "off",
            require_authenticated=cfg.auth.enabled,
        )
        if mesh is not None
        else None
    )
    app.add_routes(routes())
    return state
