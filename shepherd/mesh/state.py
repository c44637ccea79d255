"""MeshState: the replicated state of one node (workers, health, prefix indexes, config, extras), and
the SWIM ``Delegate`` that carries it.

Components (each a CRDT whose merge is commutative, associative and idempotent, memory bounded):
``registry`` (``state_registry``), ``health`` (``state_health``), one prefix-index replica per model
(an ``IndexReplica``, made on first use by the ``new_index`` factory the state is given: a node gives
the routing policies' replicated index, ``policies.prefix_replica_native.make_replica``; its wire is
``shepherd.proto.index_wire``), ``config`` (``state_config``, pycrdt), and any number of extra
components registered by name (``register``; e.g. the rate-limit counters) that follow
``StateComponent`` (both protocols, with the state's config and counters: ``state_types``).

Every payload is one msgpack envelope ``[VERSION, tag, body]`` (``state_wire``: the codec, and the
table of tags and bodies). Decoding is all-or-nothing per payload: the body is validated into typed
values before anything is merged; anything malformed raises ``StateDecodeError`` (the Delegate entry
points count and drop it).

Dissemination (how the node's runtime should drive it):

- ``broadcasts(budget)`` (Delegate): registry, health, config and extras deltas, one small payload
  each, piggybacked by SWIM with memberlist's retransmit limit (``BroadcastQueue``; a newer entry of a
  worker replaces the queued older one). Receivers relay what changed their state, so the spread is
  epidemic and stops where nothing is new.
- ``index_batches(budget)``: prefix-index deltas, too many for piggybacking (a routing decision adds
  up to ~100 blocks): the runtime sends each batch as its own datagram to every alive member, once
  (``index_batches_by_model``: a node sends a model's only to the members routing it,
  ``index_scope``); receivers call ``apply``. (``index_in_broadcasts=True`` puts them in the SWIM
  queue instead, for small meshes.) Lost batches are repaired by digests. A replica in sparse mode
  (``set_turns``) adds turn ends (tag ``"t"``: one record per routing decision, not its blocks; not
  repaired: a lost one costs a follow-up its hit on that node).
- Push-pull (TCP): ``local_state()`` / ``merge_remote_state()``. The requester sends the registry,
  config and extras, its own health record and the digests (health: observer -> version of each
  record held in sync; registry, config, extras); the responder, right after merging that, answers
  with only what differs (the health records the requester holds older, an extra's ``diff``, the
  registry or config where their digests differ), so an exchange between converged nodes is a few
  KB whatever the fleet's size. Index digests travel both ways; each side queues its entries of the
  differing (worker, time slot) buckets for ``index_batches``. A runtime that can do two rounds on
  the connection should rather exchange ``digest()`` and send back ``repair(peer_digest)`` (only
  what the peer lacks, only to it).
- ``snapshot()`` / ``merge_snapshot()``: everything, for a joining node or tests.

Ownership (``MeshStateConfig.first_hand``, on in a node's mesh): entries that name the node they belong
to are accepted only from that node, the payload's *sender*: the certificate identity of a push-pull
peer (``merge_remote_state_from``), or the sender of a datagram, which the runtime delivers only once
that name's certificate was verified over mTLS at the datagram's source address
(``shepherd.mesh.senders``). Per component:

- registry: a live version only if its ``writer`` and its record's ``owner`` are the sender; a removal
  (``REMOVED``) only if its ``writer`` is the sender; an owner-gone tombstone only about a version this
  node wrote (it then writes it again: the refutation); every replica derives the owner-gone
  tombstones of a dead node itself, so nobody needs them relayed;
- health: a delta, beacon or record only if its ``observer`` is the sender (``state_health``);
- extras: through the component's ``apply_delta_from`` / ``merge_snapshot_from(value, sender)`` when it
  has them (the rate limiter: only the sender's own shards); a component without them has no owners;
- config (the control-plane document) and the prefix indexes name no node: they are multi-writer by
  design (any node's admin API writes the config; any node routing to a worker indexes its blocks) and
  are accepted from any verified sender. Tying them to a writer would need signed updates.

Relaying an entry on another node's behalf would be refused by every receiver, so with
``first_hand`` nothing is relayed: the owner sends its own deltas to every alive member itself
(``owned_batches``, which the node's runtime sends like ``index_batches``), and renews them (registry
leases every ``renew_s``, health as a beacon every ``beacon_s`` with its unhealthy set, rate-limit
shards on every change), which repairs a lost datagram; a member that joins or comes back gets each
node's own entries first-hand from the push-pull every pair of members does when they first see each
other (the runtime verifies a new member that way), and from the periodic push-pulls. Without
``first_hand`` (the default, tests and the simulation) entries are relayed epidemically and accepted
from anyone holding the mesh key.

Membership: ``on_member_up/dead/left`` (or ``on_member_event`` with SWIM's actions). ``tick()`` every
second or so renews this node's worker leases, queues its health beacon when due, collects
expired entries and tombstones, expires the indexes, re-asserts pinned workers and clears index
entries of workers gone from the registry. Time comes from the injected ``clock`` (wall clock,
seconds): use the same clock for the prefix index's insert times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shepherd.mesh.hlc import HLC
from shepherd.mesh.state_config import ConfigDoc
from shepherd.mesh.state_health import (
    HealthBeacon,
    HealthDelta,
    HealthRecord,
    HealthView,
    Observation,
    ReplicatedHealth,
    beacon_from_wire,
    beacon_to_wire,
    delta_from_wire,
    delta_to_wire,
    observations_from_wire,
    records_from_wire,
    records_to_wire,
    versions_from_wire,
)
from shepherd.mesh.state_registry import (
    LIVE,
    OWNER_GONE,
    REMOVED,
    RegEntry,
    RegistryChange,
    ReplicatedRegistry,
    WorkerRecord,
    entries_from_wire,
    entry_to_wire,
)
from shepherd.mesh.state_types import IndexReplica, MeshStateConfig, MeshStateStats, StateComponent
from shepherd.mesh.state_wire import (
    ENVELOPE_OVERHEAD,
    MAX_MODELS,
    TEST_NEXT_TAG,
    chunks,
    decode_digest,
    decode_index_digests,
    envelope,
    peek,
    peek_steps,
)
from shepherd.mesh.swim_broadcast import BroadcastQueue
from shepherd.mesh.swim_types import MemberDead, MemberEvent, MemberLeft, MemberUp
from shepherd.proto import wire_version
from shepherd.proto.index_wire import (
    Group,
    decode_index_body,
    decode_turn_body,
    encode_index_bodies,
    encode_index_digest,
    encode_turn_bodies,
)
from shepherd.proto.mesh_messages import USER_MSG_OVERHEAD
from shepherd.proto.state_decode import StateDecodeError, expect_bytes, expect_list, expect_str

__all__ = ["MeshState"]

log = logging.getLogger("shepherd.mesh.state")

MAX_RESEND = 256  # owned payloads held for their second send (``resend_s``), the newest kept

IX_co = TypeVar("IX_co", bound=IndexReplica, covariant=True)
_Observed = TypeVar("_Observed", HealthRecord, HealthDelta, HealthBeacon, Observation)


@dataclass(frozen=True, slots=True)
class _PeerDigest:
    """A push-pull requester's digests (what ``local_state`` answers with the difference to)."""

    health: dict[str, int]
    registry: bytes
    config_sv: bytes
    config_digest: bytes
    extras: dict[str, Any]


class MeshState(Generic[IX_co]):
    """The replicated state of node ``node_name`` (a SWIM ``Delegate``). ``new_index`` makes a model's
    prefix-index replica (called on the model's first use, here or by a peer's payload): every node
    of a mesh gives one of the same configuration (capacity, age, digest granularity)."""

    def __init__(
        self,
        node_name: str,
        clock: Callable[[], float],
        config: MeshStateConfig | None = None,
        *,
        new_index: Callable[[], IX_co],
        num_nodes: Callable[[], int] | None = None,
    ) -> None:
        self.node = node_name
        self.clock = clock
        self.cfg = config or MeshStateConfig()
        self._new_index = new_index
        self.hlc = HLC(clock, self.cfg.max_drift_s)
        self.registry = ReplicatedRegistry(node_name, self.hlc, self.cfg.registry)
        self.health = ReplicatedHealth(node_name, self.hlc, self.cfg.health)
        self.config = ConfigDoc(self.cfg.config_client_id)
        self._indexes: dict[str, IX_co] = {}
        self._extras: dict[str, StateComponent] = {}
        self._members: set[str] = {node_name}
        self._queue = BroadcastQueue(
            self.cfg.retransmit_mult, num_nodes or (lambda: len(self._members)), self.cfg.max_broadcasts
        )
        # registry entries and health changes go first on every packet: few, and what worker adds and
        # routing around a sick worker wait on (relayed rate-limit shards can fill the channel at scale)
        self._urgent = BroadcastQueue(
            self.cfg.retransmit_mult, num_nodes or (lambda: len(self._members)), self.cfg.max_broadcasts
        )
        self._pinned: dict[str, WorkerRecord] = {}
        self._orphans: dict[str, float] = {}  # index worker -> when first seen absent from the registry
        self._pp_peer: _PeerDigest | None = None  # the last push-pull requester's digests, for our reply
        self._again: list[bytes] = []  # owned registry/health payloads to send once more (``resend_s``)
        self._again_due = 0.0
        self.stats = MeshStateStats()
        # subscribers (called synchronously; exceptions are logged and counted)
        self.on_worker_added: list[Callable[[WorkerRecord], None]] = []  # new or changed
        self.on_worker_removed: list[Callable[[WorkerRecord], None]] = []
        self.on_health_changed: list[Callable[[str], None]] = []  # worker id
        self.on_config_changed: list[Callable[[ConfigDoc], None]] = []

    # -- typed accessors ----------------------------------------------------------------------------

    def workers(self) -> list[WorkerRecord]:
        return self.registry.records()

    def worker(self, worker_id: str) -> WorkerRecord | None:
        return self.registry.get(worker_id)

    def add_worker(self, record: WorkerRecord, pin: bool = False) -> WorkerRecord:
        """Add (or replace) a worker, owned by this node unless ``record.owner`` says otherwise.
        ``pin``: this node re-adds it whenever it disappears other than by an explicit removal (its
        owner died, its lease ran out): use it for the workers of the node's own configuration."""
        ch = self.registry.put(record)
        rec = self.registry.get(record.id)
        assert rec is not None
        if pin:
            self._pinned[record.id] = rec
        self._registry_changed([ch] if ch else [])
        return rec

    def remove_worker(self, worker_id: str) -> bool:
        """Remove a worker mesh-wide (a tombstone); False if it was not live here."""
        self._pinned.pop(worker_id, None)
        ch = self.registry.remove(worker_id)
        self._registry_changed([ch] if ch else [])
        return ch is not None

    def index(self, model: str) -> IX_co:
        """The model's replicated prefix index (created on first use, by ``new_index``): give it to the
        routing policy (e.g. ``CacheAware.indexes[model]``); its inserts are gossiped, peers' merged in."""
        ix = self._indexes.get(model)
        if ix is None:
            ix = self._indexes[model] = self._new_index()
        return ix

    @property
    def indexes(self) -> Mapping[str, IX_co]:
        return self._indexes

    def observe_health(self, worker_id: str, healthy: bool) -> None:
        """This node's health check result for a worker (gossiped when it changes, and refreshed)."""
        if self.health.observe(worker_id, healthy):
            self._health_changed({worker_id})

    def health_view(self, worker_id: str) -> HealthView:
        return self.health.view(worker_id)

    def routable(self, worker_id: str) -> bool:
        return self.health.routable(worker_id)

    def register(self, name: str, component: StateComponent) -> None:
        """Add an extra replicated component under ``name`` (same name on every node)."""
        if name in self._extras:
            raise ValueError(f"state component {name!r} is already registered")
        expect_str(name, 64)
        self._extras[name] = component

    def component(self, name: str) -> StateComponent | None:
        return self._extras.get(name)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def describe(self) -> dict[str, Any]:
        """Sizes and counters, for ``/mesh/state`` and metrics (cheap: no entry is copied)."""
        return {
            "node": self.node,
            "members": sorted(self._members),
            "workers": {
                "live": self.registry.live_count,
                "tombstones": self.registry.tombstone_count,
                "pinned": len(self._pinned),
                "pending": self.registry.pending,
            },
            "health": {
                "records": len(self.health),
                "pending": self.health.pending,
                "out_of_sync": self.health.out_of_sync,
                "dropped": self.health.dropped,
            },
            "indexes": {
                m: {
                    "blocks": ix.live_blocks,
                    "workers": len(ix.workers),
                    "pending": ix.pending,
                    "pending_dropped": ix.pending_dropped,
                    "rejected": ix.rejected,
                }
                for m, ix in self._indexes.items()
            },
            "config_version": self.config.version,
            "components": sorted(self._extras),
            "broadcast_queue": len(self._queue) + len(self._urgent),
            "hlc_refused": self.hlc.refused,
            "stats": {k: getattr(self.stats, k) for k in self.stats.__slots__},
        }

    # -- membership ---------------------------------------------------------------------------------

    def on_member_up(self, name: str) -> None:
        """``name`` is alive (joined, came back, refuted a suspicion)."""
        self._members.add(name)
        self.registry.on_member_alive(name)
        self.health.on_member_alive(name)

    on_member_alive = on_member_up  # the name MeshRuntime's delegate hook uses

    def on_member_dead(self, name: str) -> None:
        """``name`` is dead (or left): its workers are removed and its observations dropped, here
        and, through the tombstones, everywhere."""
        if name == self.node:
            return
        self._members.discard(name)
        self._registry_changed(self.registry.on_member_dead(name))
        self._health_changed(self.health.on_member_dead(name))
        for comp in self._extras.values():
            try:
                comp.on_member_dead(name)
            except Exception:
                log.exception("state component failed on_member_dead(%s)", name)

    on_member_left = on_member_dead

    def on_member_event(self, event: MemberEvent) -> None:
        """Feed SWIM's membership actions (MemberSuspect and MemberReaped change nothing here)."""
        if isinstance(event, MemberUp):
            self.on_member_up(event.member.name)
        elif isinstance(event, MemberDead | MemberLeft):
            self.on_member_dead(event.member.name)

    # -- time ---------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic upkeep (every second or so; cost bounded by the state's size)."""
        now = self.clock()
        self._registry_changed(self.registry.tick())
        self._health_changed(self.health.tick())
        for wid, rec in list(self._pinned.items()):
            e = self.registry.entry(wid)
            if e is not None and e.kind == REMOVED:
                del self._pinned[wid]  # removed on purpose, after we pinned it
            elif self.registry.get(wid) is None:
                ch = self.registry.put(
                    WorkerRecord(rec.id, rec.url, rec.model, rec.kind, rec.labels, self.node)
                )
                self._registry_changed([ch] if ch else [])
        live = {r.id for r in self.registry.records()}
        seen: set[str] = set()
        for ix in self._indexes.values():
            ix.expire(now)
            for w in ix.workers:
                seen.add(w)
                if w in live:
                    continue
                since = self._orphans.setdefault(w, now)
                if now - since >= self.cfg.orphan_grace_s:
                    ix.clear_worker(w)
        for w in list(self._orphans):
            if w in live or w not in seen:
                del self._orphans[w]

    # -- callbacks ----------------------------------------------------------------------------------

    def _registry_changed(self, changes: Iterable[RegistryChange]) -> None:
        for ch in changes:
            if ch.after is not None:
                self._call(self.on_worker_added, ch.after)
            elif ch.before is not None:
                # this node stops checking it (a GONE flip); every observer does the same on its removal
                if self.health.forget(ch.before.id):
                    self._health_changed([ch.before.id])
                self._call(self.on_worker_removed, ch.before)

    def _health_changed(self, workers: Iterable[str]) -> None:
        for w in workers:
            self._call(self.on_health_changed, w)

    def _call(self, fns: list[Callable[[Any], None]], arg: Any) -> None:
        for fn in list(fns):
            try:
                fn(arg)
            except Exception:
                self.stats.callback_errors += 1
                log.exception("mesh state subscriber failed")

    # -- Delegate -----------------------------------------------------------------------------------

    def has_broadcasts(self) -> bool:
        """SWIM Delegate (optional): whether ``broadcasts`` may have anything to give; False lets an
        idle node skip its gossip rounds. Exact for ``first_hand`` (the node's mode: the config's
        updates and what is queued); the other modes always say True."""
        if not self.cfg.first_hand or self.cfg.index_in_broadcasts or wire_version.is_test_next():
            return True
        return bool(self._urgent or self._queue or self.config.changed)

    def broadcasts(self, budget: int) -> list[bytes]:
        """SWIM Delegate: payloads to piggyback (``sum(len + USER_MSG_OVERHEAD) <= budget``)."""
        self._fill_queue()
        out = self._urgent.get(budget)
        out += self._queue.get(budget - sum(len(p) + USER_MSG_OVERHEAD for p in out))
        if wire_version.is_test_next():  # the next minor's extra payload type (state_wire "~")
            extra = envelope(TEST_NEXT_TAG, wire_version.speaks()[1])
            if sum(len(p) + USER_MSG_OVERHEAD for p in out) + len(extra) + USER_MSG_OVERHEAD <= budget:
                out.append(extra)
        self.stats.broadcast_payloads += len(out)
        return out

    def on_user(self, payload: bytes, src_name: str) -> None:
        """SWIM Delegate: a peer's payload. Malformed ones are counted and dropped."""
        try:
            self.apply(payload, src_name)
        except StateDecodeError as e:
            log.debug("dropped a malformed state payload from %s: %s", src_name, e)

    def local_state(self) -> bytes:
        """SWIM Delegate: push-pull state. Called as a push-pull's responder (right after merging the
        requester's state, which carried its digests): only what the requester lacks (health records
        it holds older, the registry, config and extras where their digests differ, an extra's
        ``diff`` where it has one). Otherwise (the requester, or the responder to a peer of the
        earlier format): the registry, config and extras in full, this node's own health record and
        the digests, so that the responder can answer with the difference alone."""
        peer, self._pp_peer = self._pp_peer, None
        body: dict[str, Any] = {"n": self.node, "d": self._index_digests()}
        if peer is None:
            own = self.health.record(self.node)
            body["r"] = self.registry.to_wire()
            body["c"] = self.config.update_since(None)
            body["x"] = [[n, self._own_snapshot(c)] for n, c in self._extras.items()]
            body["hr"] = records_to_wire([own] if own is not None and own.checked else [])
            body["hd"] = [[o, v] for o, v in self.health.versions().items()]
            body["rd"] = self.registry.digest()
            body["cd"] = [self.config.state_vector(), self.config.digest()]
            body["xd"] = [[n, c.digest()] for n, c in self._extras.items()]
            return envelope("P", body)
        if peer.registry != self.registry.digest():
            body["r"] = self.registry.to_wire()
        if peer.config_digest != self.config.digest():
            body["c"] = self.config.update_since(peer.config_sv or None)
        xs = []
        for name, comp in self._extras.items():
            remote = peer.extras.get(name)
            if remote is not None and remote == comp.digest():
                continue
            diff = getattr(comp, "diff", None)  # only what differs, if the component can tell
            xs.append([name, diff(remote) if callable(diff) and remote is not None else comp.snapshot()])
        body["x"] = xs
        only = self.node if self.cfg.first_hand else None  # the peer takes nothing else from us
        body["hr"] = records_to_wire(self.health.newer_than(peer.health, only))
        return envelope("P", body)

    def merge_remote_state(self, data: bytes) -> None:
        """SWIM Delegate: a peer's push-pull state; our entries of the index buckets that differ are
        queued for ``index_batches``. Malformed states are counted and dropped."""
        self.merge_remote_state_from(data, "")

    def merge_remote_state_from(self, data: bytes, peer: str) -> None:
        """``merge_remote_state`` from ``peer``, the certificate identity the runtime verified (with
        ``first_hand``, only its own entries are taken)."""
        for _ in self.merge_remote_state_steps(data, peer):
            pass

    def merge_remote_state_steps(self, data: bytes, peer: str = "") -> Iterator[None]:
        """``merge_remote_state_from`` a part at a time: a generator that yields between the slices of
        a component that merges in steps (the rate limiter's shards: a joining node's push-pull carries
        every shard of the mesh), for a runtime that lets its event loop run between steps. After the
        last step the state is what ``merge_remote_state_from`` leaves (the merges are joins: what runs
        in between does not change the result) and the push-pull reply (``local_state``) is due."""
        self._pp_peer = None
        self.stats.payloads_in += 1
        self.stats.bytes_in += len(data)
        try:
            tag, body = yield from peek_steps(data)
            src = peer if self.cfg.first_hand else ""
            if tag in ("S", "P"):
                yield from self._apply_full_steps(tag, body, src)
            else:
                self._apply(tag, body, src)
        except StateDecodeError as e:
            self.stats.decode_errors += 1
            log.debug("dropped a malformed push-pull state from %s: %s", peer or "?", e)

    # -- outgoing -----------------------------------------------------------------------------------

    def _fill_queue(self) -> None:
        limit = self.cfg.udp_payload_bytes
        if self.cfg.first_hand:  # owned entries go out through owned_batches, never relayed
            u = self.config.take_delta()
            if u is not None:
                self._queue_payload(envelope("c", u), None, limit)
            if self.cfg.index_in_broadcasts:
                for p in self.index_batches(limit):
                    self._queue.queue(p)
            return
        for e in self.registry.take_delta():
            self._queue_payload(envelope("r", [entry_to_wire(e)]), f"r/{e.id}", limit, urgent=True)
        # health flips go first too: few since nothing is refreshed, and what routing around a sick
        # worker waits on; a record's bulk (its first fill, a mass change) goes with the rest
        small = self.cfg.health.relay_max_flips
        for item in self.health.take_delta():
            if isinstance(item, HealthDelta):
                urgent = len(item.flips) <= small
                self._queue_payload(envelope("f", [delta_to_wire(item)]), None, limit, urgent=urgent)
            else:  # a newer beacon of the observer replaces the queued one
                key = f"b/{item.observer}"
                self._queue_payload(envelope("b", [beacon_to_wire(item)]), key, limit, urgent=True)
        u = self.config.take_delta()
        if u is not None:
            self._queue_payload(envelope("c", u), None, limit)
        for name, comp in self._extras.items():
            if getattr(comp, "keyed_gossip", False):  # one queued delta per entry, a newer one replacing it
                for k, d in comp.take_keyed_deltas():  # type: ignore[attr-defined]
                    self._queue_payload(envelope("x", [name, d]), f"x/{name}/{k}", limit)
                continue
            d = comp.take_delta()
            if d is not None:
                self._queue_payload(envelope("x", [name, d]), None, limit)
        if self.cfg.index_in_broadcasts:
            for p in self.index_batches(limit):
                self._queue.queue(p)

    def _queue_payload(self, p: bytes, key: str | None, limit: int, *, urgent: bool = False) -> None:
        if len(p) > limit:
            self.stats.oversize += 1  # left to push-pull repair
            return
        (self._urgent if urgent else self._queue).queue(p, key)

    def owned_batches(self, budget: int | None = None) -> list[bytes]:
        """``first_hand``: this node's own registry entries, health observations and extras' deltas
        changed since the last call, as payloads of at most ``budget`` bytes (default the UDP payload
        size) for the runtime to send to every alive member (others' entries are never relayed); with
        them, the registry and health payloads of ``resend_s`` ago or more, once again (nobody relays a
        lost one; rate-limit shards go out again on their next change anyway)."""
        budget = budget or self.cfg.udp_payload_bytes
        body_budget = budget - ENVELOPE_OVERHEAD
        me = self.node
        regs = [entry_to_wire(e) for e in self.registry.take_delta() if e.writer == me]
        own = [envelope("r", c) for c in chunks(regs, body_budget)]
        own += self._health_payloads([i for i in self.health.take_delta() if i.observer == me], body_budget)
        out: list[bytes] = []
        if self._again and self.clock() >= self._again_due:  # the second send of earlier changes
            out, self._again = self._again, []
        if own and self.cfg.resend_s > 0:
            if not self._again:
                self._again_due = self.clock() + self.cfg.resend_s
            self._again += own
            del self._again[:-MAX_RESEND]
        out += own
        for name, comp in self._extras.items():
            for _ in range(1024):  # a component may hand its delta out in pieces
                d = comp.take_delta()
                if d is None:
                    break
                out.append(envelope("x", [name, d]))
        self.stats.broadcast_payloads += len(out)
        return out

    @staticmethod
    def _own_snapshot(comp: StateComponent) -> Any:
        """A push-pull request's part of an extra: only the node's own entries where the component can
        tell them (``own_snapshot``; the responder answers with its ``diff`` for the rest), else all."""
        own = getattr(comp, "own_snapshot", None)
        return own() if callable(own) else comp.snapshot()

    def _health_payloads(self, items: list[HealthDelta | HealthBeacon], body_budget: int) -> list[bytes]:
        deltas = [delta_to_wire(i) for i in items if isinstance(i, HealthDelta)]
        beacons = [beacon_to_wire(i) for i in items if isinstance(i, HealthBeacon)]
        out = [envelope("f", c) for c in chunks(deltas, body_budget)]
        out += [envelope("b", c) for c in chunks(beacons, body_budget)]
        return out

    def index_batches(self, budget: int | None = None, max_entries: int | None = None) -> list[bytes]:
        """Fresh prefix-index delta payloads (each at most ``budget`` bytes; default the UDP payload
        size), for the runtime to send to every alive member once. ``max_entries`` bounds one call."""
        return [p for _, ps in self.index_batches_by_model(budget, max_entries) for p in ps]

    def index_batches_by_model(
        self, budget: int | None = None, max_entries: int | None = None
    ) -> list[tuple[str, list[bytes]]]:
        """``index_batches``, per model: for a runtime that sends a model's deltas only to the members
        routing it (``index_scope``)."""
        budget = budget or self.cfg.udp_payload_bytes
        out: list[tuple[str, list[bytes]]] = []
        left = max_entries
        for model, ix in self._indexes.items():
            if left is not None and left <= 0:
                break
            groups = ix.take_groups(left)
            if not groups:
                continue
            if left is not None:
                left -= sum(len(g[2]) for g in groups)
            ps = [envelope("i", b) for b in encode_index_bodies(model, groups, budget - ENVELOPE_OVERHEAD)]
            self.stats.index_payloads_out += len(ps)
            out.append((model, ps))
        for model, ix in self._indexes.items():  # turn ends (sparse replication): a few bytes a decision
            batch = ix.take_turns()
            if batch is None:
                continue
            ps = [envelope("t", b) for b in encode_turn_bodies(model, batch, budget - ENVELOPE_OVERHEAD)]
            self.stats.index_payloads_out += len(ps)
            if out and out[-1][0] == model:
                out[-1][1].extend(ps)
            else:
                out.append((model, ps))
        return out

    def outgoing_batches(self, budget: int) -> list[bytes]:
        """Every pending delta (all components) as fresh payloads of at most ``budget`` bytes, for a
        runtime that disseminates by itself (no retransmit accounting here). A config update or an
        extra's delta larger than ``budget`` is still sent, alone."""
        body_budget = budget - ENVELOPE_OVERHEAD
        out = [
            envelope("r", c)
            for c in chunks([entry_to_wire(e) for e in self.registry.take_delta()], body_budget)
        ]
        out += self._health_payloads(self.health.take_delta(), body_budget)
        u = self.config.take_delta()
        if u is not None:
            out.append(envelope("c", u))
        for name, comp in self._extras.items():
            for _ in range(1024):  # a component may hand its delta out in pieces
                d = comp.take_delta()
                if d is None:
                    break
                out.append(envelope("x", [name, d]))
        out += self.index_batches(budget)
        return out

    # -- snapshot, digest, repair -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state (every index entry included)."""
        body = {
            "r": self.registry.to_wire(),
            "hr": records_to_wire(self.health.newer_than({})),  # the records held in sync
            "c": self.config.update_since(None),
            "x": [[n, c.snapshot()] for n, c in self._extras.items()],
            "i": [
                b for m, ix in self._indexes.items() for b in encode_index_bodies(m, ix.entries_in(), 1 << 62)
            ],
        }
        return envelope("S", body)

    def merge_snapshot(self, data: bytes) -> None:
        """Merge a peer's ``snapshot()`` (raises ``StateDecodeError`` if malformed, merging nothing)."""
        tag, _ = peek(data)
        if tag != "S":
            raise StateDecodeError(f"not a snapshot (tag {tag!r})")
        self.apply(data, "")

    def digest(self) -> bytes:
        body = {
            "n": self.node,
            "r": self.registry.digest(),
            "h": self.health.digest(),
            "hv": [[o, v] for o, v in self.health.versions().items()],
            "c": [self.config.state_vector(), self.config.digest()],
            "d": self._index_digests(),
            "x": [[n, c.digest()] for n, c in self._extras.items()],
        }
        return envelope("D", body)

    def repair(self, remote_digest: bytes, budget: int | None = None) -> list[bytes]:
        """Payloads carrying what a peer (its ``digest()``) lacks or holds differently from us; the
        peer applies them with ``apply``. Raises ``StateDecodeError`` if the digest is malformed."""
        budget = budget or self.cfg.tcp_batch_bytes
        tag, body = peek(remote_digest)
        if tag != "D":
            raise StateDecodeError(f"not a digest (tag {tag!r})")
        d = decode_digest(body)
        body_budget = budget - ENVELOPE_OVERHEAD
        out: list[bytes] = []
        if d.registry != self.registry.digest():
            out += [envelope("r", c) for c in chunks(self.registry.to_wire(), body_budget)]
        if d.health != self.health.digest():
            records = self.health.newer_than(versions_from_wire(body.get("hv", [])))
            out += [envelope("H", records_to_wire(records[i : i + 16])) for i in range(0, len(records), 16)]
        if d.config_digest != self.config.digest():
            out.append(envelope("c", self.config.update_since(d.config_sv)))
        for name, comp in self._extras.items():
            remote = d.extras.get(name)
            if remote != comp.digest():
                diff = getattr(comp, "diff", None)  # only what differs, if the component can tell
                out.append(
                    envelope("x", [name, diff(remote)])
                    if callable(diff)
                    else envelope("X", [name, comp.snapshot()])
                )
        for model, ix in self._indexes.items():
            sel = ix.diff(d.indexes.get(model, {}), self.clock())
            if sel:
                out += [envelope("i", b) for b in encode_index_bodies(model, ix.entries_in(sel), body_budget)]
        return out

    def _index_digests(self) -> list[Any]:
        return [[m, encode_index_digest(ix.digest())] for m, ix in self._indexes.items()]

    # -- incoming -----------------------------------------------------------------------------------

    def apply(self, payload: bytes, src: str = "") -> None:
        """Apply one payload (any tag). Raises ``StateDecodeError`` if it is malformed, in which case
        nothing was merged (extras and config validate before they change)."""
        self.stats.payloads_in += 1
        self.stats.bytes_in += len(payload)
        try:
            tag, body = peek(payload)
            self._apply(tag, body, src if self.cfg.first_hand else "")
        except StateDecodeError:
            self.stats.decode_errors += 1
            raise

    def _apply(self, tag: str, body: Any, src: str = "") -> None:
        """``src``: the verified sender when entries must be first-hand (``first_hand``), else ""."""
        if tag == "r":
            self._registry_changed(self.registry.merge(self._own_entries(entries_from_wire(body), src)))
        elif tag == "f":
            deltas = [delta_from_wire(x) for x in expect_list(body, max_len=4096)]
            relay = not self.cfg.first_hand
            for d in self._own(deltas, src):
                self._health_changed(self.health.merge_delta(d, relay))
        elif tag == "b":
            beacons = [beacon_from_wire(x) for x in expect_list(body, max_len=4096)]
            relay = not self.cfg.first_hand
            for b in self._own(beacons, src):
                self._health_changed(self.health.merge_beacon(b, relay))
        elif tag == "H":
            self._health_changed(self.health.merge_records(self._own(records_from_wire(body), src)))
        elif tag == "h":  # a peer of the earlier format's observations
            self._health_changed(self.health.merge_legacy(self._own(observations_from_wire(body), src)))
        elif tag == "i":
            model, groups = decode_index_body(body)
            self._apply_index(model, groups)
        elif tag == "t":
            model, batch = decode_turn_body(body)
            if model not in self._indexes and len(self._indexes) >= MAX_MODELS:
                raise StateDecodeError("too many models")
            self.stats.turn_ends_in += len(batch)
            self.index(model).apply_turns(batch, self.clock())
        elif tag == "c":
            self._apply_config(expect_bytes(body))
        elif tag in ("x", "X"):
            name_raw, value = expect_list(body, 2)
            self._apply_extra(expect_str(name_raw, 64), value, snapshot=tag == "X", src=src)
        elif tag in ("S", "P"):
            self._apply_full(tag, body, src)
        elif tag == "D":
            raise StateDecodeError("a digest is not applied: pass it to repair()")
        elif wire_version.is_strict():  # the test-only fault STRICT_WIRE: as before versioning
            raise StateDecodeError(f"unknown state payload tag {tag!r}")
        else:  # a later minor's payload type: skipped (state_wire, wire_version)
            self.stats.unknown_skipped += 1

    def _apply_index(self, model: str, groups: list[Group]) -> None:
        if model not in self._indexes and len(self._indexes) >= MAX_MODELS:
            raise StateDecodeError("too many models")
        n = sum(len(g[2]) for g in groups)
        self.stats.index_entries_in += n
        self.stats.index_entries_changed += self.index(model).apply_groups(groups, self.clock())

    def _apply_config(self, update: bytes) -> None:
        if self.config.apply_update(update):
            self._call(self.on_config_changed, self.config)

    def _own_entries(self, entries: list[RegEntry], src: str) -> list[RegEntry]:
        """First-hand registry entries (see the module doc); all of them when ``src`` is ""."""
        if not src:
            return entries
        me = self.node
        out = [
            e
            for e in entries
            if (e.kind == LIVE and e.writer == src and e.record is not None and e.record.owner == src)
            or (e.kind == REMOVED and e.writer == src)
            or (e.kind == OWNER_GONE and e.writer == me)
        ]
        self.stats.foreign_entries_dropped += len(entries) - len(out)
        return out

    def _own(self, items: list[_Observed], src: str) -> list[_Observed]:
        """Health items first-hand from ``src`` only (its own observations; ``src`` "": all)."""
        if not src:
            return items
        out = [x for x in items if x.observer == src]
        self.stats.foreign_entries_dropped += len(items) - len(out)
        return out

    def _apply_extra(self, name: str, value: Any, snapshot: bool, src: str = "") -> None:
        comp = self._extras.get(name)
        if comp is None:
            return  # a component this node does not run (a newer peer): ignore
        owned: Any = getattr(comp, "merge_snapshot_from" if snapshot else "apply_delta_from", None)
        try:
            if src and callable(owned):
                owned(value, src)
            elif snapshot:
                comp.merge_snapshot(value)
            else:
                comp.apply_delta(value)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise StateDecodeError(f"state component {name!r}: {e}") from None

    def _apply_extra_steps(self, name: str, value: Any, src: str) -> Iterator[None]:
        """``_apply_extra`` of a snapshot, in the component's slices if it merges in steps
        (``merge_snapshot_steps(value, src)``, which keeps only ``src``'s own entries when ``src``)."""
        steps: Any = getattr(self._extras.get(name), "merge_snapshot_steps", None)
        if not callable(steps):
            self._apply_extra(name, value, snapshot=True, src=src)
            return
        try:
            yield from steps(value, src)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise StateDecodeError(f"state component {name!r}: {e}") from None

    def _apply_full(self, tag: str, body: Any, src: str = "") -> None:
        for _ in self._apply_full_steps(tag, body, src):
            pass

    def _apply_full_steps(self, tag: str, body: Any, src: str = "") -> Iterator[None]:
        """A snapshot or push-pull state merged in steps: it yields between the slices of a component
        that merges in steps (``_apply_extra_steps``). The registry, health and digests are decoded and
        validated before anything merges; an extra component's snapshot is checked by the component as
        it merges (the rate limiter checks all of its own before its first slice), so a malformed extra
        stops the merge there, with the components before it merged (joins: nothing is lost, the next
        exchange repairs the rest) as before the steps."""
        if type(body) is not dict:
            raise StateDecodeError("a snapshot is a map")
        # decode and validate everything first
        entries = entries_from_wire(body.get("r", []))
        observations = observations_from_wire(body.get("h", []))  # a peer of the earlier format
        records = records_from_wire(body["hr"]) if "hr" in body else []
        peer = None
        if tag == "P" and "hd" in body:  # a requester's digests: our local_state() answers them
            rd, cd = body.get("rd", b""), expect_list(body.get("cd", [b"", b""]))
            xd = [expect_list(x) for x in expect_list(body.get("xd", []), max_len=1024)]
            peer = _PeerDigest(
                versions_from_wire(body["hd"]),
                expect_bytes(rd, 64),
                expect_bytes(cd[0] if cd else b""),
                expect_bytes(cd[1] if len(cd) > 1 else b"", 64),
                {expect_str(x[0], 64): x[1] for x in xd if len(x) >= 2},
            )
        update = expect_bytes(body.get("c", b""))
        extras = [expect_list(x, 2) for x in expect_list(body.get("x", []), max_len=1024)]
        for x in extras:
            expect_str(x[0], 64)
        bodies = [decode_index_body(b) for b in expect_list(body.get("i", []), max_len=MAX_MODELS)]
        digests = decode_index_digests(body.get("d", []))
        if tag == "P":
            expect_str(body.get("n"), 256)
        # then merge: the parts that can still refuse their input go first
        if update:
            self._apply_config(update)
        for name, value in extras:
            yield from self._apply_extra_steps(name, value, src)
        self._registry_changed(self.registry.merge(self._own_entries(entries, src)))
        if observations:
            self._health_changed(self.health.merge_legacy(self._own(observations, src)))
        if records:
            self._health_changed(self.health.merge_records(self._own(records, src)))
        self._pp_peer = peer
        for model, groups in bodies:
            self._apply_index(model, groups)
        left = self.cfg.repair_max_entries
        for model, ix in self._indexes.items():
            if left <= 0:
                break
            if tag == "P":
                sel = ix.diff(digests.get(model, {}), self.clock())
                if sel:
                    n = ix.queue_repair(sel, left)
                    left -= n
                    self.stats.index_entries_repair_queued += n
