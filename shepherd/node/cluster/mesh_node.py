"""The mesh on a node: ``MeshState`` + ``MeshRuntime``, wired to the node's workers, routing and limits.

Off unless ``mesh_port`` is set (``smg-node serve --mesh-port P``, or ``smg-node join SEED ...``); a
node without it behaves as before. ``serve`` builds the ``MeshNode`` before the gateway starts (the
policies must route with the replicated indexes from the first request), starts it after the gateway,
and closes it (graceful leave) while the node drains.

- **Security**: the mesh is sealed (keyring: ``mesh_keyring_file`` / ``mesh_keys``) and its TCP sync is
  mTLS (``mesh_cert``/``mesh_key``/``mesh_ca``, the certificate naming ``mesh_name``); both are required.
  ``mesh_dev_pki DIR`` (development only) makes a CA, this node's certificate and a key file in DIR
  when missing, under a file lock, so nodes started on one machine with the same DIR trust each other.
- **Workers** (``RegistryBridge``): a worker added to this node (config or ``POST /workers``) is put in
  the replicated registry (the config's ones pinned: re-asserted if their owner dies); one removed
  here (``DELETE /workers``) is removed mesh-wide. The registry's changes, whoever made them, are
  applied to the local ``WorkerRegistry`` by one reconcile task per worker (desired = the mesh's live
  record, bounded rounds), so there is no echo: a change the bridge applies itself is not published
  back. A worker of a model this node does not serve is left out. A dead node's workers leave every
  node (the registry's owner-gone tombstones), except the ones this node's own config pins.
- **Health**: every local check result is fed to ``observe_health`` (each tick; only a change is sent,
  as a delta of this node's health record, plus a small beacon every 10 s), and the
  mesh's combined view gates routing (``WorkerRegistry.gate``) beside the local checks and breakers.
- **Prefix index**: one replicated prefix index per model (``MeshState.index``, made by ``replica_factory``:
  ``make_replica``, native where built) is installed in the model's ``cache_aware`` policy before anything
  uses it, so the policy's routing decisions, the KV event feed (``kv_feed.feed_index_of``) and replication
  share it. Deltas are flushed when written (at most every ``INDEX_FLUSH_S``, ``flush_soon``) as datagrams
  of their own to the alive members that route the model (their SWIM metadata says which:
  ``mesh.index_scope``); a member that (re)joins gets the whole index of its models once, paced, from one
  designated node routing each (digest repair leaves recent time slots alone). What is sent
  (``mesh_index_replication``, README "Mesh at scale"): KV-event inserts never; ``auto`` (default) the
  routing decisions of workers without a live KV-event stream here (the others are quiet:
  ``sync_index_quiet``, each tick), ``all`` every worker's, ``none`` nothing, ``ends`` one turn end per
  routing decision (the name of its prompt's last full block, the worker, its length; tag ``"t"``) and
  no blocks: receivers match follow-ups against them (``policies.turn_ends``).
- **Rate limits**: the node's ``RateLimiter`` (its ``Admission``'s, handed over by ``app.serve``) is
  registered as the state component ``"ratelimit"`` and told the member list (live = alive, N = all
  but left) on every membership event and every tick; a ``local`` one (the Redis backend's fallback)
  is told the member list only.
- **Ownership**: the state runs ``first_hand`` (``shepherd.mesh.state``): entries naming a node (its
  workers, health observations, rate-limit shards) are taken only from that node (a datagram's
  verified sender, a push-pull's certificate), and each node sends its own to every alive member
  itself (``owned_batches``, flushed with the index deltas), never relaying others'.
- **RPC**: ``rpc(name, payload)`` / ``set_rpc_handler(h)`` are the runtime's request/response channel
  (``MeshRuntime.rpc``: mTLS + sealed frames, the handler given the caller's certificate identity,
  ``RpcError.reason`` in unknown / suspect / failed / refused); ``member_status(name)`` says whether a
  member is worth calling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import msgpack  # type: ignore[import-untyped]

from shepherd.auth.certs import TlsFiles, write_dev_pki
from shepherd.auth.files import make_private_dir, write_atomic
from shepherd.mesh import faults
from shepherd.mesh.dns_seeds import DnsSeedConfig, is_dns_seed, parse_dns_seed
from shepherd.mesh.hlc import stamp_seconds
from shepherd.mesh.index_scope import IndexScope, control_authenticated, routes_meta
from shepherd.mesh.keyring import Keyring, generate_key, load_keyring
from shepherd.mesh.ratelimit import RateLimiter
from shepherd.mesh.runtime import MeshRuntime, RpcError, RpcHandler
from shepherd.mesh.runtime_config import MeshRuntimeConfig, parse_addr
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_registry import REMOVED, WorkerRecord
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.mesh.state_wire import ENVELOPE_OVERHEAD, VERSION
from shepherd.mesh.swim_types import MemberEvent, MemberUp, SwimConfig
from shepherd.node.config import NodeConfig
from shepherd.node.dispatch.gateway import Gateway
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.prefix_index import PrefixIndexConfig
from shepherd.policies.prefix_replica import IndexReplConfig
from shepherd.policies.prefix_replica_native import Replica, make_replica
from shepherd.proto import wire_version
from shepherd.proto.engine_types import worker_id
from shepherd.proto.index_wire import encode_index_bodies
from shepherd.proto.mesh_messages import MemberState
from shepherd.proto.openai_errors import ApiError

log = logging.getLogger("shepherd.mesh_node")

RATE_LIMIT_COMPONENT = "ratelimit"
TICK_S = 1.0
# the engines' KV-event streams are read on the runtime's wake-ups too (``KvFeed.lazy_reads``): at the
# first one at least KV_READ_S - KV_READ_SLACK_S after the last read, at the latest KV_READ_S after it
# (the window is longer than SWIM's default probe interval, 0.4 s: a probe tick comes in every such
# window, so the reads do not wake the node themselves); the tick runs on the first read TICK_S -
# KV_READ_S after the last tick (its period 0.5-1 s, ~0.8 s on probe ticks)
KV_READ_S = 0.5
KV_READ_SLACK_S = 0.45
# the longest a fresh delta waits to be flushed. The flush is event-driven: a write that leaves something
# to send (a routing decision's index insert, a rate-limit admission, a local worker or health change)
# arms one timer this far ahead, and the tick flushes whatever else changed; an idle node never wakes
# for it (it used to tick every 20 ms, then back off to 0.16 s: bench/idle_bench.py)
INDEX_FLUSH_S = 0.02
# a rate-limit admission's shard goes out this soon after the last flush (not INDEX_FLUSH_S): requests
# that alternate between nodes (``--procs``) faster than 20 ms would otherwise each be admitted against
# a view without the other's last admissions (the e2e test saw 8 admitted of 6 across two processes)
LIMIT_FLUSH_S = 0.002
# with ``--mesh-index-replication ends`` a routing decision leaves one turn end (11 bytes): they wait up to
# this long to share a datagram (a follow-up comes seconds later; 100 at 1,000 req/s instead of 20)
TURN_FLUSH_S = 0.1
MAX_FLUSH_ENTRIES = 50_000  # index entries one flush takes (the rest wait for the next)
JOIN_PACE = 32  # datagrams of a full-index transfer between short sleeps
RECONCILE_ROUNDS = 8
DELTA_LAG_MAX_S = 30.0  # older writes arriving are a full sync's catch-up, not a delta's lag
DEV_KEYRING = "mesh.keyring"
RECENT_DELTAS = 256
_STATUS: dict[MemberState, Literal["alive", "suspect", "dead", "left"]] = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}


# ---- configuration -----------------------------------------------------------------------------------


def swim_config(cfg: NodeConfig) -> SwimConfig:
    """SWIM timings: the LAN defaults, with the node's tuning (a probe timeout defaults to half the
    probe interval given; the ping-req nack timeout stays under the probe timeout)."""
    base = SwimConfig()
    kw: dict[str, Any] = {}
    if cfg.mesh_probe_interval is not None:
        kw["probe_interval"] = cfg.mesh_probe_interval
        kw["probe_timeout"] = cfg.mesh_probe_interval / 2
    if cfg.mesh_probe_timeout is not None:
        kw["probe_timeout"] = cfg.mesh_probe_timeout
    kw["nack_timeout"] = min(base.nack_timeout, 0.8 * kw.get("probe_timeout", base.probe_timeout))
    if cfg.mesh_push_pull_interval is not None:
        kw["push_pull_interval"] = cfg.mesh_push_pull_interval
    if cfg.mesh_suspicion_mult is not None:
        kw["suspicion_mult"] = cfg.mesh_suspicion_mult
    if cfg.mesh_gossip_interval is not None:
        kw["gossip_interval"] = cfg.mesh_gossip_interval
    if faults.injected(faults.DISABLE_REFUTATION):  # test-only (chaos.run --inject)
        kw["fault_no_refutation"] = True
    return dataclasses.replace(base, **kw)


def limiter_members(
    members: Iterable[tuple[str, str]], ignore_partition: bool = False
) -> list[tuple[str, str]]:
    """The (name, state) pairs the rate limiter counts: every member. With the test-only fault
    ``IGNORE_PARTITION_RULE`` (``ignore_partition``) only the alive ones, so that its N is the members it
    reaches and each side of a partition admits the whole limit (what ``chaos.run --prove-can-fail
    mesh_large`` shows the partition checks catch)."""
    return [(n, s) for n, s in members if not ignore_partition or s == "alive"]


def runtime_config(cfg: NodeConfig) -> MeshRuntimeConfig:
    assert cfg.mesh_name is not None and cfg.mesh_port is not None
    port = cfg.mesh_port
    adv_host: str | None = None
    adv_port: int | None = None
    if cfg.mesh_advertise is not None:
        adv_host, p1 = parse_addr(cfg.mesh_advertise, 1)
        explicit = parse_addr(cfg.mesh_advertise, 2)[1] == p1
        adv_port = p1 if explicit else (port or None)  # None: the port bound
    return MeshRuntimeConfig(
        name=cfg.mesh_name,
        bind_host=cfg.mesh_bind,
        bind_port=port,
        advertise_host=adv_host,
        advertise_port=adv_port,
        seeds=tuple(parse_addr(s, port or 7946) for s in cfg.mesh_seeds if not is_dns_seed(s)),
        dns_seeds=tuple(parse_dns_seed(s, port or 7946) for s in cfg.mesh_seeds if is_dns_seed(s)),
        dns=DnsSeedConfig(
            initial_backoff=min(1.0, cfg.mesh_dns_refresh_interval),
            max_backoff=min(30.0, cfg.mesh_dns_refresh_interval),
            refresh_interval=cfg.mesh_dns_refresh_interval,
        ),
        swim=swim_config(cfg),
    )


def ensure_dev_pki(directory: str | os.PathLike[str], name: str) -> tuple[TlsFiles, Path]:
    """DEVELOPMENT: the CA and key file shared through ``directory`` (made 0700 if missing) and a fresh
    certificate for ``name``. A file lock keeps nodes started together from making two CAs. Keys and
    the keyring are written 0600 through new temporary files (``shepherd.auth.files.write_atomic``)."""
    d = Path(directory)
    make_private_dir(d)  # 0700 when made here (an existing directory is the operator's)
    # the lock file: never truncated, never through a planted link
    lock_fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(lock_fd, "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        files = write_dev_pki(d, [name])[name]
        keyring = d / DEV_KEYRING
        if not keyring.exists():  # a new temp file, 0600, never a planted one (``write_atomic``)
            write_atomic(keyring, Keyring.format_file([generate_key()]).encode(), private=True)
    return files, keyring


def security(cfg: NodeConfig) -> tuple[TlsFiles, Keyring]:
    """The node's mTLS files and keyring (blocking file I/O; dev PKI generated if configured)."""
    assert cfg.mesh_name is not None
    keyring_file: str | None = cfg.mesh_keyring_file
    if cfg.mesh_cert and cfg.mesh_key and cfg.mesh_ca:
        tls = TlsFiles(Path(cfg.mesh_cert), Path(cfg.mesh_key), Path(cfg.mesh_ca))
    else:
        assert cfg.mesh_dev_pki is not None
        log.warning(
            "mesh: DEVELOPMENT PKI in %s (a CA and key anyone with that dir shares)", cfg.mesh_dev_pki
        )
        tls, dev_keyring = ensure_dev_pki(cfg.mesh_dev_pki, cfg.mesh_name)
        if keyring_file is None and not cfg.mesh_keys:
            keyring_file = str(dev_keyring)
    return tls, load_keyring(path=keyring_file, keys_b64=cfg.mesh_keys, cluster=cfg.mesh_cluster)


# ---- the policies' indexes ---------------------------------------------------------------------------


def index_config(policies: Mapping[str, object]) -> PrefixIndexConfig:
    for p in policies.values():
        if isinstance(p, CacheAware):
            return p.config.index
    return PrefixIndexConfig()


def replica_factory(
    policies: Mapping[str, object], turn_ends_max: int | None = None
) -> Callable[[], Replica]:
    """The mesh state's index factory: replicas with the ``cache_aware`` policies' index configuration
    and the default replication settings (the same on every node) but the turn ends kept
    (``--mesh-index-turn-ends``: this node's memory)."""
    config, repl = index_config(policies), IndexReplConfig()
    if turn_ends_max is not None:
        repl = dataclasses.replace(repl, turn_ends_max=turn_ends_max)
    return lambda: make_replica(config, repl)


def attach_indexes(policies: Mapping[str, object], state: MeshState[Replica]) -> list[str]:
    """Give each ``cache_aware`` policy the model's replicated index (before anything used its own);
    returns the models attached."""
    out = []
    for model, p in policies.items():
        if isinstance(p, CacheAware):
            old = p.indexes.get(model)
            if old is not None and old.live_blocks:
                log.warning("mesh: the %s index already held entries; they are not replicated", model)
            p.indexes[model] = state.index(model)
            out.append(model)
    return out


def full_index_payloads(state: MeshState[Replica], models: Iterable[str] | None = None) -> list[bytes]:
    """Every index entry as state payloads (envelope ``[VERSION, "i", body]``), for a joining member."""
    budget = state.cfg.udp_payload_bytes - ENVELOPE_OVERHEAD
    out: list[bytes] = []
    for model in models if models is not None else list(state.indexes):
        ix = state.indexes.get(model)
        if ix is None:
            continue
        bodies = encode_index_bodies(model, ix.entries_in(), budget)
        out.extend(msgpack.packb([VERSION, "i", body], use_bin_type=True) for body in bodies)
    return out


# ---- workers: local registry <-> replicated registry -------------------------------------------------


class _Health(Protocol):
    @property
    def healthy(self) -> bool: ...

    @property
    def checked(self) -> bool: ...


class LocalWorker(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def health(self) -> _Health: ...


class LocalRegistry(Protocol):
    """What the bridge uses of ``shepherd.node.dispatch.workers.WorkerRegistry``."""

    @property
    def workers(self) -> Mapping[str, LocalWorker]: ...

    def get(self, wid: str) -> LocalWorker | None: ...

    async def add(self, url: str, model: str) -> LocalWorker: ...

    async def remove(self, wid: str) -> LocalWorker | None: ...


@dataclasses.dataclass(slots=True)
class BridgeStats:
    published_adds: int = 0
    published_removes: int = 0
    applied_adds: int = 0
    applied_removes: int = 0
    skipped_models: int = 0
    bad_ids: int = 0
    refused: int = 0  # workers of the mesh this node's allowlist refuses
    untrusted: int = 0  # worker changes written by a member whose control plane is open (auth on here)
    errors: int = 0


class RegistryBridge:
    """Keeps the local worker registry and the replicated one in step, both ways, without echo.

    Call ``local_added`` / ``local_removed`` / ``local_health`` from the registry's hooks; the mesh's
    changes arrive through ``MeshState``'s subscriber lists (installed here) and are applied by
    asyncio tasks (one at a time per worker): run it inside an event loop."""

    def __init__(
        self,
        state: MeshState[Replica],
        registry: LocalRegistry,
        *,
        models: Collection[str],
        pinned: Iterable[str],
        ident: Callable[[str], str],
        trusted: Callable[[str], bool] | None = None,
    ) -> None:
        self.state = state
        self.registry = registry
        self.models = models
        self.pinned = set(pinned)  # this node's config workers: re-asserted, never dropped with an owner
        self.ident = ident  # worker id of a URL (the same on every node)
        # whether the worker changes a member writes are taken here (None: every member's): a node with
        # auth on takes none from a member whose control plane is open, where anyone who reaches it may
        # add or remove workers (as it honours no key minted there: key_sync)
        self.trusted = trusted
        self.stats = BridgeStats()
        self._expect_added: set[str] = set()
        self._expect_removed: set[str] = set()
        self._dirty: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._warned: set[str] = set()
        state.on_worker_added.append(self._mesh_changed)
        state.on_worker_removed.append(self._mesh_changed)

    # -- local -> mesh ------------------------------------------------------------------------------

    def local_added(self, w: LocalWorker) -> None:
        if w.id in self._expect_added:
            self._expect_added.discard(w.id)
            return
        pin = w.id in self.pinned
        if not pin and self.state.worker(w.id) is not None:
            return  # the mesh has it already
        kind = getattr(getattr(w, "client", None), "kind", "") or ""
        self.state.add_worker(WorkerRecord(w.id, w.url, w.model, str(kind)), pin=pin)
        self.stats.published_adds += 1

    def local_removed(self, w: LocalWorker) -> None:
        if w.id in self._expect_removed:
            self._expect_removed.discard(w.id)
            return
        self.pinned.discard(w.id)
        if self.state.worker(w.id) is not None:
            self.state.remove_worker(w.id)
            self.stats.published_removes += 1

    def local_health(self, w: LocalWorker) -> None:
        if w.health.checked:
            self.state.observe_health(w.id, w.health.healthy)

    def publish_health(self) -> None:
        """This node's current view of every local worker (``observe_health`` sends only changes)."""
        for w in list(self.registry.workers.values()):
            self.local_health(w)

    # -- mesh -> local ------------------------------------------------------------------------------

    def _mesh_changed(self, rec: WorkerRecord) -> None:
        self.schedule(rec.id)

    def schedule(self, wid: str) -> None:
        """Bring the local registry in line with the mesh for ``wid`` (soon, in a task)."""
        self._dirty.add(wid)
        if wid not in self._tasks:
            self._tasks[wid] = asyncio.get_running_loop().create_task(self._reconcile(wid))

    def resume_leftovers(self) -> None:
        """Reschedule workers still dirty after their task used up its rounds (called every tick):
        rounds stay bounded per task, and no change is left behind."""
        for wid in list(self._dirty):
            if wid not in self._tasks:
                self.schedule(wid)

    def sync_all(self) -> None:
        """Reconcile every worker either side knows (after a start or a full sync)."""
        for wid in {r.id for r in self.state.workers()} | set(self.registry.workers):
            self.schedule(wid)

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def _reconcile(self, wid: str) -> None:
        try:
            for _ in range(RECONCILE_ROUNDS):  # bounded: each round starts from a fresh read
                if wid not in self._dirty:
                    break
                self._dirty.discard(wid)
                try:
                    await self._apply(wid)
                except Exception:
                    self.stats.errors += 1
                    log.exception("mesh: applying the registry's change of worker %s failed", wid)
        finally:
            self._tasks.pop(wid, None)

    async def _apply(self, wid: str) -> None:
        e = self.state.registry.entry(wid)
        if e is not None and self.trusted is not None and not self.trusted(e.writer):
            self.stats.untrusted += 1  # the local registry stays as it is for this worker
            return
        rec = self.state.worker(wid)
        local = self.registry.get(wid)
        if rec is not None:
            if local is not None:
                return
            if rec.model not in self.models:
                self.stats.skipped_models += 1
                if rec.model not in self._warned:
                    self._warned.add(rec.model)
                    log.warning("mesh: workers of model %r are not served by this node: left out", rec.model)
                return
            if self.ident(rec.url) != wid:
                self.stats.bad_ids += 1
                log.warning("mesh: worker record %s does not name its URL %s: ignored", wid, rec.url)
                return
            self._expect_added.add(wid)
            try:
                await self.registry.add(rec.url, rec.model)
                self.stats.applied_adds += 1
            except ApiError as refusal:  # this node's --worker-allow refuses it (never dialed): left out
                self.stats.refused += 1
                log.warning("mesh: worker %s from the mesh refused here: %s", wid, refusal.message)
            finally:
                self._expect_added.discard(wid)
            return
        if local is None:
            return
        if e is not None and e.kind == REMOVED:
            self.pinned.discard(wid)  # removed on purpose, somewhere: here too
        elif wid in self.pinned:
            return  # gone with its owner (or its lease): this node's config re-asserts it
        self._expect_removed.add(wid)
        try:
            await self.registry.remove(wid)
            self.stats.applied_removes += 1
        finally:
            self._expect_removed.discard(wid)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _chain(prev: Callable[[Any], None] | None, fn: Callable[[Any], None]) -> Callable[[Any], None]:
    if prev is None:
        return fn

    def both(w: Any) -> None:
        prev(w)
        fn(w)

    return both


# ---- the node's mesh ---------------------------------------------------------------------------------


class MeshNode:
    """One node's mesh: build it before ``Gateway.start`` (no I/O), ``await start()`` after it,
    ``await close()`` (graceful leave) on shutdown."""

    def __init__(
        self,
        cfg: NodeConfig,
        gw: Gateway,
        *,
        limiter: RateLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if cfg.mesh_name is None or cfg.mesh_port is None:
            raise ValueError("the mesh is off (no mesh_port)")
        self.cfg = cfg
        self.gw = gw
        self.name = cfg.mesh_name
        self.clock = clock
        feed = getattr(gw, "kv_feed", None)
        if feed is not None:  # before the gateway starts its workers' feeds
            feed.read_lazily()
        self._tick_due = 0.0  # monotonic time from which the tick is due again
        # first_hand: entries naming a node are taken only from that node (see shepherd.mesh.state)
        self.state = MeshState(
            self.name,
            clock,
            MeshStateConfig(first_hand=True),
            new_index=replica_factory(gw.policies, cfg.mesh_index_turn_ends),
        )
        self.indexed_models = attach_indexes(gw.policies, self.state)
        pd = getattr(gw, "pd", None)  # PD disaggregation: each pool's policy (their workers are disjoint)
        for policy in (getattr(pd, "prefill_policy", None), getattr(pd, "decode_policy", None)):
            if policy is not None:
                attach_indexes(dict.fromkeys(gw.models, policy), self.state)
        # index replication (README "Mesh at scale"): which routing decisions are sent (auto: those of
        # workers without a live KV-event stream here; KV-event inserts never), and to whom: the members
        # whose SWIM metadata says they route the model (``index_scope``)
        self.index_replication = cfg.mesh_index_replication
        self.routed_models = sorted(self.state.indexes)
        self.scope = IndexScope()
        self.index_deltas_dropped = 0  # index payloads not sent (--mesh-index-replication none)
        reg = gw.registry
        pinned = {worker_id(u) for m in gw.models.values() for u in m.worker_urls}
        self.control_auth = cfg.auth.control_plane != "off"
        self._open_writers: set[str] = set()  # members seen with an open control plane (_writer_trusted)
        self.bridge = RegistryBridge(
            self.state,
            reg,
            models=gw.models,
            pinned=pinned,
            ident=worker_id,
            trusted=self._writer_trusted if cfg.auth.enabled else None,
        )
        reg.on_added = _chain(reg.on_added, self.bridge.local_added)
        reg.on_removed = _chain(reg.on_removed, self.bridge.local_removed)
        reg.on_health_change = _chain(reg.on_health_change, self.bridge.local_health)
        reg.gate = self.state.routable
        self.limiter = limiter  # the node's admission limiter, its shards replicated here
        # test-only fault switches (shepherd.mesh.faults; chaos.run --inject): shards or index kept local
        self.fault_no_index_gossip = faults.injected(faults.DISABLE_INDEX_GOSSIP)
        self.fault_ignore_partition = faults.injected(faults.IGNORE_PARTITION_RULE)
        # a local limiter (the Redis backend's fallback) is told the members but never gossiped
        self.limiter_gossip = limiter is not None and not limiter.cfg.local
        gossiped = limiter if self.limiter_gossip else None
        if gossiped is not None and not faults.injected(faults.DISABLE_RATELIMIT_GOSSIP):
            self.state.register(RATE_LIMIT_COMPONENT, gossiped)
        self.state.on_worker_added.append(self._observe_lag)
        self.state.on_worker_removed.append(self._observe_lag)
        self.sync_index_quiet()  # the configured workers' mode from the first decision, not the first tick
        self.runtime: MeshRuntime | None = None
        self.index_datagrams_out = 0
        self.join_transfers = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._side: set[asyncio.Task[None]] = set()
        self.on_delta_lag: Callable[[float], None] | None = None  # seconds, per registry write from a peer
        # the latest of them: (worker id, writer, "add" | "remove", seconds from the write to here)
        self.recent_deltas: deque[tuple[str, str, str, float]] = deque(maxlen=RECENT_DELTAS)
        self._rpc_handler: RpcHandler | None = None
        self._closed = False
        self._flush_timer: asyncio.Handle | None = None
        self._last_flush = -INDEX_FLUSH_S  # loop time of the last flush_soon flush
        self._flush_at = 0.0  # loop time the armed flush is due
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): flushes are armed on it
        # the writes that leave something to flush arm it (flush_soon): routing decisions' index
        # inserts, rate-limit admissions, local worker and health changes
        for policy in self._indexing_policies():
            policy.on_insert = self._after_insert
        if self.limiter_gossip and self.limiter is not None:
            self.limiter.on_dirty = self._limits_dirty
        reg.on_added = _chain(reg.on_added, self._local_change)
        reg.on_removed = _chain(reg.on_removed, self._local_change)
        reg.on_health_change = _chain(reg.on_health_change, self._local_change)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if wire_version.enable_test_next_from_env():
            log.warning("mesh: %s=1: a test build speaking the next wire minor", wire_version.TEST_NEXT_ENV)
        wire_version.set_strict(faults.injected(faults.STRICT_WIRE))  # test-only (chaos.run --inject)
        self._loop = asyncio.get_running_loop()
        tls, keyring = await asyncio.to_thread(security, self.cfg)
        rt = MeshRuntime.from_files(
            dataclasses.replace(
                runtime_config(self.cfg), meta=routes_meta(self.routed_models, self.control_auth)
            ),
            keyring,
            tls,
            delegate=self.state,
            on_member_event=self._on_member_event,
        )
        rt.set_rpc_handler(self._rpc_handler)
        await rt.start()
        self.runtime = rt
        # the KV-event reads and the tick ride on the runtime's wake-ups (probes, acks: ~7 a second):
        # reads every KV_READ_S at the latest; the tick at the first read TICK_S - KV_READ_S after the
        # last, so it runs every TICK_S at the latest and an idle node rarely wakes for either alone
        self._tick_due = time.monotonic() + TICK_S - KV_READ_S
        rt.call_every(KV_READ_S, self._wake, slack=KV_READ_SLACK_S)
        # and so do the workers' health checks and load polls (no timers of their own: each was a
        # wake-up of an otherwise quiet node)
        self.gw.registry.ride_rounds()
        self.bridge.sync_all()
        log.info(
            "mesh: node %s on %s:%d, wire %d.%d, seeds %s",
            self.name,
            *rt.address,
            *wire_version.speaks(),
            list(self.cfg.mesh_seeds) or "none",
        )

    async def close(self) -> None:
        """Leave the mesh gracefully and stop every task this object started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.gw.registry.own_rounds()  # the node may drain on: its health checks and polls go on
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        tasks = self._tasks + list(self._side)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        await self.bridge.close()
        if self.runtime is not None:
            await self.runtime.close()

    def flush_soon(self, gap: float = INDEX_FLUSH_S) -> None:
        """Something to send was written: flush now, or ``gap`` after the last flush (one handle; writes
        meanwhile ride on it, and an earlier due time re-arms it): index deltas at most every
        ``INDEX_FLUSH_S`` (20 ms), a rate-limit admission's shard within ``LIMIT_FLUSH_S`` (2 ms), which
        ``--procs`` needs (requests alternating between processes must not over-admit)."""
        loop = self._loop
        if loop is None or self._closed:
            return
        now = loop.time()
        due = max(self._last_flush + gap, now)
        if self._flush_timer is not None:
            if self._flush_at <= due:
                return
            self._flush_timer.cancel()
        self._flush_at = due
        if due > now:  # flushed less than ``gap`` ago: this write rides on the next one
            self._flush_timer = loop.call_later(due - now, self._flush_due)
        else:  # the first write after a quiet spell goes at once (after the current callbacks)
            self._flush_timer = loop.call_soon(self._flush_due)

    def _limits_dirty(self) -> None:
        self.flush_soon(LIMIT_FLUSH_S)

    def _flush_due(self) -> None:
        self._flush_timer = None
        if self._loop is not None:
            self._last_flush = self._loop.time()
        try:
            self.flush_index()
        except Exception:
            log.exception("mesh: flush_index failed")
        rt = self.runtime
        if rt is not None and rt.running and self._index_pending():  # more than one flush takes
            self.flush_soon()  # (MAX_FLUSH_ENTRIES): the rest next

    def _local_change(self, _w: object) -> None:
        if self.index_replication in ("none", "ends"):  # a worker's mode known from its first decision
            self.sync_index_quiet()
        self.flush_soon()

    def _after_insert(self) -> None:
        if self._index_pending():  # a quiet worker's decision (its KV events replicate it) left nothing
            self.flush_soon(TURN_FLUSH_S if self.index_replication == "ends" else INDEX_FLUSH_S)

    def _indexing_policies(self) -> list[CacheAware]:
        pd = getattr(self.gw, "pd", None)
        cands = [
            *self.gw.policies.values(),
            getattr(pd, "prefill_policy", None),
            getattr(pd, "decode_policy", None),
        ]
        return [p for p in cands if isinstance(p, CacheAware)]

    def _index_pending(self) -> bool:
        return not self.fault_no_index_gossip and any(ix.pending for ix in self.state.indexes.values())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._side.add(t)
        t.add_done_callback(self._side.discard)

    # -- periodic -----------------------------------------------------------------------------------

    def _wake(self) -> None:
        """On the runtime's wake-ups: read the KV-event streams, start the workers' health and load rounds
        that are due, and tick when due (period 0.5-1 s)."""
        if self._closed:
            return
        self.gw.registry.run_due_rounds(KV_READ_SLACK_S)  # first: whatever a poll below may raise
        feed = getattr(self.gw, "kv_feed", None)
        if feed is not None:
            feed.poll()
        now = time.monotonic()
        if now >= self._tick_due:
            self._tick_due = now + TICK_S - KV_READ_S
            self.tick()

    def _tick(self) -> None:
        if not self._closed:
            self.tick()

    def tick(self) -> None:
        self.sync_index_quiet()
        self.state.tick()
        self.bridge.resume_leftovers()
        self.bridge.publish_health()
        self._update_limiter()
        # what changed without a write hook (expiries, pinned re-assertions, digest repair) goes now
        self.flush_index()

    def flush_index(self) -> int:
        """Send this node's own state deltas (``owned_batches``: workers, health, rate-limit shards:
        first-hand, never relayed) and the prefix indexes' fresh deltas to every alive member;
        datagrams sent."""
        rt = self.runtime
        if rt is None or not rt.running:
            return 0
        payloads = self.state.owned_batches()
        by_model: list[tuple[str, list[bytes]]] = []
        if not self.fault_no_index_gossip:
            by_model = self.state.index_batches_by_model(max_entries=MAX_FLUSH_ENTRIES)
            if self.index_replication == "none":  # drained (digest repair may have queued some), not sent
                self.index_deltas_dropped += sum(len(ps) for _, ps in by_model)
                by_model = []
        if not payloads and not by_model:
            return 0
        n = 0
        for m in rt.swim.alive_members():
            if m.name == self.name:
                continue
            out = payloads
            for model, ps in by_model:  # a model's deltas only to the members routing it
                if self.scope.routes(m.meta, model):
                    out = out + ps
            if out:
                n += rt.send_user(m.addr, out)
        self.index_datagrams_out += n
        return n

    def sync_index_quiet(self) -> None:
        """Tell each model's replica which workers' routing decisions are not replicated: with
        ``auto``, those whose KV-event stream is live here (every node subscribes to the engine and
        gets its events: the default for gRPC engines); with ``none``, all; with ``all``, none; with
        ``ends``, all, and every worker's decisions are sent as turn ends instead (sparse replication)."""
        mode = self.index_replication
        feed = getattr(self.gw, "kv_feed", None)
        ends = mode == "ends"
        for model, ix in self.state.indexes.items():
            quiet, turns = ix.quiet_workers, ix.turn_workers
            ws = {w.id for w in self.gw.registry.workers.values() if w.model == model} | quiet | turns
            for w in ws:
                q = mode in ("none", "ends") or (mode == "auto" and feed is not None and feed.live(w))
                if q != (w in quiet):
                    ix.set_quiet(w, q)
                if ends != (w in turns):
                    ix.set_turns(w, ends)

    # -- membership ---------------------------------------------------------------------------------

    def _update_limiter(self) -> None:
        if self.limiter is not None and self.runtime is not None:
            members = [(m.name, m.state) for m in self.runtime.members()]
            self.limiter.update_members(limiter_members(members, self.fault_ignore_partition), time.time())

    def _on_member_event(self, ev: MemberEvent) -> None:
        self._update_limiter()
        self.flush_soon()
        if not isinstance(ev, MemberUp) or ev.member.name == self.name:
            return
        if ev.prev not in (None, MemberState.DEAD, MemberState.LEFT) or self.runtime is None:
            return
        if not self.state.indexes or self.fault_no_index_gossip or self.index_replication in ("none", "ends"):
            return  # (ends: blocks are not replicated; a joiner learns turn ends from then on)
        # per model the joiner routes, the first (by name) of the other members routing it sends it
        alive = [m for m in self.runtime.swim.alive_members() if m.name != ev.member.name]
        mine = []
        for model in self.scope.models_for(ev.member.meta, list(self.state.indexes)):
            names = sorted(m.name for m in alive if self.scope.routes(m.meta, model))
            if names and names[0] == self.name:
                mine.append(model)
        if mine:
            self._spawn(self._send_full_index(ev.member.name, ev.member.addr, mine))

    async def _send_full_index(
        self, name: str, addr: tuple[str, int], models: list[str] | None = None
    ) -> None:
        payloads = full_index_payloads(self.state, models)  # on the loop: the index is not thread-safe
        rt = self.runtime
        if not payloads or rt is None:
            return
        self.join_transfers += 1
        log.info("mesh: sending the prefix index to %s (%d datagrams)", name, len(payloads))
        for i in range(0, len(payloads), JOIN_PACE):
            if not rt.running:
                return
            self.index_datagrams_out += rt.send_user(addr, payloads[i : i + JOIN_PACE])
            await asyncio.sleep(0.002)

    # -- rpc --------------------------------------------------------------------------------------------

    def set_rpc_handler(self, handler: RpcHandler | None) -> None:
        """Serve peers' RPCs with ``handler(peer_identity, payload) -> reply`` (kept across ``start``)."""
        self._rpc_handler = handler
        if self.runtime is not None:
            self.runtime.set_rpc_handler(handler)

    async def rpc(self, name: str, payload: bytes, timeout: float | None = None) -> bytes:
        """One request to member ``name``, its reply; ``RpcError`` (``.reason``) otherwise."""
        rt = self.runtime
        if rt is None or not rt.running:
            raise RpcError("failed", "the mesh is not running")
        return await rt.rpc(name, payload, timeout=timeout)

    def removed_on_purpose(self, wid: str) -> bool:
        """Whether a worker that left this node was removed on purpose (a removal anywhere in the mesh, or
        one it never held), not gone with the node that added it (or its lease): that one comes back
        with its node, which keeps it (``WorkerJournal``)."""
        e = self.state.registry.entry(wid)
        return e is None or e.kind == REMOVED

    def _writer_trusted(self, name: str) -> bool:
        """Whether the worker changes member ``name`` writes are taken here (this node has auth on): its
        own, and a member's whose metadata does not say its control plane is open (a node of an older
        build says nothing). A member once seen open stays so for this process (its records outlive it)."""
        if name == self.name:
            return True
        if name in self._open_writers:
            return False
        swim = None if self.runtime is None else self.runtime.swim
        m = None if swim is None else swim.member(name)
        if m is not None and control_authenticated(m.meta) is False:
            self._open_writers.add(name)
            log.warning(
                "mesh: worker changes written by %r, whose control plane has no auth, are ignored here "
                "(auth is on): give every node of the mesh the same auth settings",
                name,
            )
            return False
        return True

    def member_status(self, name: str) -> Literal["alive", "suspect", "dead", "left"] | None:
        """A member's state as this node sees it; None if it is unknown (or the mesh not started)."""
        st = None if self.runtime is None else self.runtime.member_state(name)
        return None if st is None else _STATUS[st]

    # -- observability (the views and metrics are in api/mesh.py) --------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """``GET /mesh/members`` rows: every member this node knows, itself included."""
        return [] if self.runtime is None else [m.to_json() for m in self.runtime.members()]

    def _observe_lag(self, rec: WorkerRecord) -> None:
        e = self.state.registry.entry(rec.id)
        if e is None or e.writer == self.name or not (e.live or e.kind == REMOVED):
            return  # our own write, or a dead owner's tombstone (its stamp is the old version's)
        lag = self.clock() - stamp_seconds(e.stamp)
        if 0 <= lag <= DELTA_LAG_MAX_S:
            self.recent_deltas.append((rec.id, e.writer, "add" if e.live else "remove", lag))
            if self.on_delta_lag is not None:
                self.on_delta_lag(lag)
