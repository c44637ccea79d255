"""Configuration reload without a restart: SIGHUP and ``POST /admin/reload``.

The YAML file the node started with (``--config``) is read again and the same command-line flags are
applied over it (``NodeConfig.config_file`` / ``config_overrides``: flags still win over the file). The
new configuration is **validated first, as a whole** (``build_config``: every check of a start, plus the
bootstrap keys' env vars and the policies); a file that fails is refused, nothing is applied, the running
configuration is kept, and the node says so in a log line (``config reload ... refused``) and in the
route's answer (422 with the reason). A valid file then applies its dynamic parts:

- **workers**: the workers the configuration lists (``worker_urls``, or each model's under ``models``)
  are diffed against the ones the previous configuration listed: new ones are added, dropped ones
  removed; workers added by ``POST /workers``, discovery or the mesh are left alone;
- **policies**: the node's ``policy``, a model's ``policy`` and the ``cache_aware`` parameters: a
  model whose policy changed gets a new policy instance (its routing state starts afresh; in a mesh it
  is given the replicated prefix index again);
- **rate limits**: ``rate_limits`` and the ``rate_limit_*`` values; turning rate limits on when the
  node started without any needs a restart (said in the answer), changing or removing them does not;
- **auth keys**: the bootstrap keys (``auth.keys``, ``admin_key_sha256``, ``admin_key_env``): new ones
  are accepted at once, removed or changed ones stop authenticating at once (keys minted through
  ``/admin/keys`` are not touched).

Everything else that differs from the configuration the node started with (ports, TLS files, the mesh,
models added or removed, auth modes, ``request_timeout_secs`` and the health-check and circuit-breaker
settings, which every worker, old or new, keeps from the start...) is listed under ``restart_required``
and not applied, at every reload until a restart. TLS certificates keep their own reload (``auth.tls``):
SIGHUP also reloads them, in the same handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from typing import Any

from aiohttp import web

from shepherd.auth.keys import ApiKeyRecord, BootstrapError, MemoryKeyStore, bootstrap_records
from shepherd.auth.middleware import AuthState
from shepherd.auth.tls import ServerTls
from shepherd.node.api.admission import Admission
from shepherd.node.cluster.key_journal import KeyJournal
from shepherd.node.cluster.key_sync import KeySync
from shepherd.node.cluster.mesh_node import MeshNode, attach_indexes
from shepherd.node.config import (
    ConfigError,
    NodeConfig,
    RateLimitRule,
    build_config,
    cache_aware_config,
    load_yaml,
)
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import json_response
from shepherd.policies.simple import make_policy

__all__ = ["RELOADER", "ReloadResult", "Reloader", "install", "routes"]

log = logging.getLogger("shepherd.node.reload")

_CACHE_AWARE_FIELDS = (
    "cache_threshold",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "cache_move_base",
    "cache_move_tokens_per_load",
    "conversation_weight",
    "conversation_lifetime_secs",
    "shared_prefix_tokens_per_load",
    "shared_prefix_after",
)
_RATE_FIELDS = ("rate_limits", "rate_limit_rpm", "rate_limit_tpm", "rate_limit_max_concurrent")
_DYNAMIC = frozenset({"worker_urls", "policy", "models", "auth", *_CACHE_AWARE_FIELDS, *_RATE_FIELDS})
_INTERNAL = frozenset({"extra", "config_file", "config_overrides"})


@dataclasses.dataclass(slots=True)
class ReloadResult:
    """What a reload did (``ok``), or why it was refused (``error``: nothing was applied)."""

    ok: bool
    file: str | None
    changed: dict[str, Any] = dataclasses.field(default_factory=dict)
    restart_required: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # parts that failed while applying
    error: str | None = None
    tls: str = "off"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reloaded": self.ok, "file": self.file, "tls": self.tls}
        if self.ok:
            out.update(changed=self.changed, restart_required=self.restart_required, errors=self.errors)
        else:
            out["error"] = {"message": self.error, "type": "invalid_request_error", "code": "config_refused"}
        return out

    def summary(self) -> str:
        parts = []
        w = self.changed.get("workers")
        if w:
            parts.append(f"workers +{len(w['added'])} -{len(w['removed'])}")
        if "policies" in self.changed:
            parts.append("policies " + ", ".join(f"{m}={p}" for m, p in self.changed["policies"].items()))
        if "rate_limits" in self.changed:
            parts.append(f"rate limits: {len(self.changed['rate_limits']['rules'])} rules")
        k = self.changed.get("auth_keys")
        if k:
            parts.append(f"auth keys +{len(k['added'])} -{len(k['removed'])} ~{len(k['changed'])}")
        text = "; ".join(parts) or "nothing changed"
        if self.restart_required:
            text += f"; not applied, needs a restart: {', '.join(self.restart_required)}"
        if self.errors:
            text += f"; failed: {'; '.join(self.errors)}"
        return text


@dataclasses.dataclass(slots=True)
class _Plan:
    new: NodeConfig
    add: list[tuple[str, str]]  # (url, model)
    remove: list[tuple[str, str]]
    policies: dict[str, tuple[str, Any]]  # model -> (policy name, instance)
    rules: list[RateLimitRule] | None  # None: unchanged
    boot: list[ApiKeyRecord] | None  # None: unchanged
    restart_required: list[str]


def config_workers(cfg: NodeConfig, served: list[str]) -> dict[str, tuple[str, ...]]:
    """The workers the configuration lists, by served model (PD pools are not reloaded)."""
    if cfg.models:
        return {m.name: m.worker_urls for m in cfg.models}
    return {served[0]: cfg.worker_urls} if served else {}


def _policy_name(cfg: NodeConfig, model: str) -> str:
    for m in cfg.models:
        if m.name == model and m.policy:
            return m.policy
    return cfg.policy


def _static_models(cfg: NodeConfig) -> list[Any]:
    return [dataclasses.replace(m, worker_urls=(), policy=None) for m in cfg.models]


def _auth_static(cfg: NodeConfig) -> Any:
    return dataclasses.replace(cfg.auth, keys=())


class Reloader:
    """Reads the node's configuration file again and applies its dynamic parts (module doc)."""

    def __init__(
        self,
        cfg: NodeConfig,
        gw: Gateway,
        *,
        admission: Admission | None = None,
        auth: AuthState | None = None,
        journal: KeyJournal | None = None,
        key_sync: KeySync | None = None,
        mesh: MeshNode | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.cfg = cfg  # the configuration as given (before models were resolved from the engines)
        # what the node runs with, but for the dynamic parts: what a reload's restart_required is read
        # against (against ``cfg``, the last file applied, a second reload would forget what still waits)
        self.started = cfg
        self.gw = gw
        self.admission = admission
        self.auth = auth
        self.journal = journal
        self.key_sync = key_sync
        self.mesh = mesh
        self.tls = tls
        self.reloads = 0
        self.refusals = 0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sighup = False

    # ---- planning: everything checked before anything changes ------------------------------------

    def _plan(self, new: NodeConfig) -> _Plan:
        old, started = self.cfg, self.started
        served = list(self.gw.models)
        restart = sorted(
            f.name
            for f in dataclasses.fields(NodeConfig)
            if f.name not in _DYNAMIC
            and f.name not in _INTERNAL
            and getattr(started, f.name) != getattr(new, f.name)
        )
        if _static_models(started) != _static_models(new):
            restart.append("models (added, removed or changed other than worker_urls / policy)")
        if _auth_static(started) != _auth_static(new):
            restart.append("auth (modes, jwt, client certificates; the keys are reloaded)")
        before, after = config_workers(old, served), config_workers(new, served)
        unknown = sorted(set(after) - set(self.gw.models))
        if unknown:
            raise ConfigError(
                f"workers for models this node does not serve: {unknown} (a restart adds models)"
            )
        add = [(u, m) for m, urls in after.items() for u in urls if u not in before.get(m, ())]
        remove = [(u, m) for m, urls in before.items() for u in urls if u not in after.get(m, ())]
        for url, model in add:
            known = self.gw.registry.find(url)
            if known is not None and known.model != model:
                raise ConfigError(f"worker {url} is already registered for model {known.model!r}")
        ca_changed = any(getattr(old, f) != getattr(new, f) for f in _CACHE_AWARE_FIELDS)
        policies: dict[str, tuple[str, Any]] = {}
        for model in served:
            name = _policy_name(new, model)
            if name != _policy_name(old, model) or (ca_changed and name == "cache_aware"):
                try:
                    policies[model] = (name, make_policy(name, cache_aware=cache_aware_config(new)))
                except (TypeError, ValueError) as e:
                    raise ConfigError(f"policy {name!r} for model {model!r}: {e}") from None
        rules: list[RateLimitRule] | None = None
        if self.admission is None:  # (never applied: said at every reload)
            if Admission.rules_of(new):
                restart.append("rate_limits (the node started without any: a restart turns them on)")
        elif Admission.rules_of(new) != Admission.rules_of(old):
            rules = Admission.rules_of(new)
        boot: list[ApiKeyRecord] | None = None
        if new.auth.keys != old.auth.keys:
            try:
                boot = bootstrap_records(new.auth)
            except BootstrapError as e:
                raise ConfigError(str(e)) from None
            if self.auth is None:
                boot = None
        if self.auth is None and new.auth.keys != started.auth.keys:
            restart.append("auth.keys")
        return _Plan(new, add, remove, policies, rules, boot, restart)

    # ---- applying ----------------------------------------------------------------------------------

    async def _apply(self, plan: _Plan, result: ReloadResult) -> None:
        gw = self.gw
        added, removed = [], []
        for url, model in plan.add:
            try:
                w = await gw.registry.add(url, model)
                added.append({"url": url, "model": model, "id": w.id})
            except Exception as e:  # a probe budget refusal, a dial error: reported, the rest goes on
                result.errors.append(f"worker {url}: {e}")
        for url, model in plan.remove:
            gone = gw.registry.find(url)
            if gone is not None and gone.model == model:
                await gw.registry.remove(gone.id)
                removed.append({"url": url, "model": model, "id": gone.id})
        if added or removed:
            result.changed["workers"] = {"added": added, "removed": removed}
        if plan.policies:
            for model, (_, policy) in plan.policies.items():
                if self.mesh is not None:
                    attach_indexes({model: policy}, self.mesh.state)
                gw.set_policy(model, policy)
            result.changed["policies"] = {m: name for m, (name, _) in plan.policies.items()}
        if plan.rules is not None and self.admission is not None:
            self.admission.set_rules(plan.rules)
            result.changed["rate_limits"] = {"rules": [dataclasses.asdict(r) for r in plan.rules]}
        if plan.boot is not None and self.auth is not None:
            result.changed["auth_keys"] = self._apply_keys(plan.boot)
        self.cfg = plan.new

    def _apply_keys(self, boot: list[ApiKeyRecord]) -> dict[str, list[str]]:
        assert self.auth is not None
        store = self.auth.store
        new = {r.id: r for r in boot}
        old_ids = self.auth.bootstrap_ids
        out: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for kid in sorted(old_ids - set(new)):
            r = store.get(kid)
            if isinstance(store, MemoryKeyStore):
                store.forget(kid)
            elif r is not None:
                store.revoke(kid)
            out["removed"].append(r.name if r is not None else kid)
        for kid, rec in new.items():
            cur = store.get(kid)
            if cur is None or kid not in old_ids:
                out["added"].append(rec.name)
            elif dataclasses.replace(cur, revoked=False) != rec:
                out["changed"].append(rec.name)
                if isinstance(store, MemoryKeyStore):
                    store.forget(kid)  # a new digest or role under the same id: not merged with the old
            else:
                continue
            store.apply([rec.to_dict()])
        ids = frozenset(new)
        self.auth.bootstrap_ids = ids
        if self.journal is not None:
            self.journal.local_ids = ids
        if self.key_sync is not None:
            self.key_sync.local_ids = ids
        return out

    # ---- entry points ------------------------------------------------------------------------------

    async def reload(self, trigger: str) -> ReloadResult:
        """Read the file again, validate, apply (one reload at a time); never raises."""
        async with self._lock:
            path = self.cfg.config_file
            result = ReloadResult(ok=False, file=path)
            if self.tls is not None:
                result.tls = "reloaded" if self.tls.reload(True) else "unchanged"
            if path is None:  # SIGHUP then only reloads the TLS certificate: not worth a warning
                result.error = "this node was started without --config: there is no file to reload"
                log.info("config reload (%s): %s (TLS: %s)", trigger, result.error, result.tls)
                return result
            try:
                new = build_config(load_yaml(path), dict(self.cfg.config_overrides))
                new = dataclasses.replace(
                    new, config_file=path, config_overrides=dict(self.cfg.config_overrides)
                )
                plan = self._plan(new)
            except ConfigError as e:
                self.refusals += 1
                result.error = str(e)
                log.error(
                    "config reload (%s) from %s refused, the running configuration is kept: %s",
                    trigger,
                    path,
                    e,
                )
                return result
            result.ok = True
            result.restart_required = plan.restart_required
            await self._apply(plan, result)
            self.reloads += 1
            log.warning("config reloaded (%s) from %s: %s", trigger, path, result.summary())
            return result

    def start(self) -> None:
        """Reload on SIGHUP (TLS certificates and the configuration file, in this one handler)."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
            log.warning("SIGHUP reload unavailable here; POST /admin/reload still works")

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._sighup:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


RELOADER: web.AppKey[Reloader] = web.AppKey("shepherd.reloader")


async def reload_route(request: web.Request) -> web.Response:
    """``POST /admin/reload`` (control plane, admin guard): 200 with what changed, 422 refused (409: no
    configuration file to reload)."""
    reloader = request.app[RELOADER]
    result = await reloader.reload("POST /admin/reload")
    status = 200 if result.ok else 409 if reloader.cfg.config_file is None else 422
    return json_response(result.to_json(), status)


def routes() -> list[web.RouteDef]:
    return [web.post("/admin/reload", reload_route)]


def install(app: web.Application, reloader: Reloader) -> None:
    app[RELOADER] = reloader
    app.add_routes(routes())
