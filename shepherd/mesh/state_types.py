"""The types ``state.MeshState`` is configured and driven through: its config (``MeshStateConfig``),
its counters (``MeshStateStats``), and the protocols of its pluggable components:

``StateComponent``: an extra replicated component registered by name (e.g. the rate-limit counters).
``IndexReplica``: a model's replicated prefix index, made by the ``new_index`` factory ``MeshState`` is
given (a node gives ``policies.prefix_replica_native.make_replica``; the values are those of
``shepherd.proto.index_wire``). Both are structural: the mesh never imports what implements them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shepherd.mesh.state_health import HealthConfig
from shepherd.mesh.state_registry import RegistryConfig
from shepherd.proto.index_wire import Digest, Group, Slot, TurnBatch

__all__ = ["IndexReplica", "MeshStateConfig", "MeshStateStats", "StateComponent"]


class StateComponent(Protocol):
    """An extra replicated component (e.g. rate-limit counters). Every method is synchronous and
    fast; values are msgpack-able plain data. ``apply_delta``/``merge_snapshot`` validate their
    input before changing anything and raise ``ValueError`` (or a subclass) on malformed data.
    Keep a delta well under ``MeshStateConfig.udp_payload_bytes`` (bigger ones wait for repair; a
    component may return its pending changes in pieces, one per ``take_delta`` call). Optional:
    ``diff(remote_digest) -> delta`` (what a peer with that digest lacks; otherwise repair sends
    the whole snapshot); ``keyed_gossip`` true with ``take_keyed_deltas() -> [(key, delta), ...]``
    (a relaying mesh queues each delta under its key, a newer one replacing the queued older one:
    ``RateLimiter`` with ``LimiterConfig.relay``); ``merge_snapshot_steps(snapshot, source) ->
    Iterator[None]`` (the merge in slices, yielding between them, validated first; ``source`` "" or the
    sender whose own entries alone are kept), which push-pull merges use
    (``MeshState.merge_remote_state_steps``)."""

    def take_delta(self) -> Any | None: ...

    def apply_delta(self, delta: Any) -> None: ...

    def snapshot(self) -> Any: ...

    def merge_snapshot(self, snapshot: Any) -> None: ...

    def digest(self) -> Any: ...

    def on_member_dead(self, name: str) -> None: ...


class IndexReplica(Protocol):
    """A model's replicated prefix index, as ``MeshState`` drives it: the map (block, worker) -> last
    access under max-merge, with a delta buffer for gossip and a digest per (worker, time slot) for
    repair (the values of ``shepherd.proto.index_wire``). ``MeshState`` takes a factory of them
    (``new_index``), called once per model; the replica is also what the routing policy uses."""

    @property
    def workers(self) -> list[str]:
        """The workers holding entries (a copy: ``tick`` clears some while iterating)."""
        ...

    @property
    def live_blocks(self) -> int: ...

    @property
    def pending(self) -> int:
        """Entries buffered for gossip."""
        ...

    @property
    def pending_dropped(self) -> int: ...

    @property
    def rejected(self) -> int:
        """Received entries dropped (too old or too far in the future)."""
        ...

    def take_groups(self, limit: int | None = None) -> list[Group]:
        """The buffered deltas, oldest first, at most ``limit`` entries."""
        ...

    def apply_groups(self, groups: Iterable[Group], now: float) -> int:
        """Max-merge received groups; returns how many entries changed."""
        ...

    def digest(self) -> Digest: ...

    def diff(self, remote: Digest, now: float | None = None) -> dict[str, set[Slot]]:
        """The (worker, time slot) buckets where ``remote`` differs from ours (settled ones, with ``now``)."""
        ...

    def entries_in(self, sel: Mapping[str, Collection[Slot]] | None = None) -> list[Group]:
        """Our entries of the buckets ``sel`` (None: all)."""
        ...

    def queue_repair(self, sel: Mapping[str, Collection[Slot]], limit: int | None = None) -> int:
        """Buffer our entries of the buckets ``sel`` for gossip (at most ``limit``); returns how many."""
        ...

    def take_turns(self) -> TurnBatch | None:
        """The buffered turn ends of routing decisions (sparse replication), oldest first."""
        ...

    def apply_turns(self, batch: TurnBatch, now: float) -> int:
        """Keep a peer's turn ends (what ``match`` also consults); returns the records kept."""
        ...

    def expire(self, now: float) -> int: ...

    def clear_worker(self, worker: str) -> None: ...


@dataclass(frozen=True, slots=True)
class MeshStateConfig:
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    max_drift_s: float = 60.0  # HLC: remote stamps further ahead are refused
    udp_payload_bytes: int = 1100  # one gossip payload (fits a 1400-byte datagram with SWIM's own)
    tcp_batch_bytes: int = 256 * 1024  # one repair payload
    retransmit_mult: int = 4
    max_broadcasts: int = 4096
    index_in_broadcasts: bool = False  # index deltas ride SWIM's queue too (small meshes)
    repair_max_entries: int = 65_536  # index entries queued by one push-pull diff, at most
    orphan_grace_s: float = 120.0  # index entries of a worker absent from the registry this long go
    config_client_id: int | None = None  # Yjs client id (random by default)
    resend_s: float = 1.0
    """``first_hand``: this node's registry and health payloads go out once more this long after their
    first send (with the next flush after it): a datagram lost to one member (nothing relays it) would
    otherwise wait for the lease renewal (30 s) or the next health beacon (10 s); two sends make that a
    loss squared. 0: once only."""
    first_hand: bool = False
    """Entries that name a node are accepted only from that node, and nothing is relayed: each node
    sends its own entries to every member itself (``MeshState.owned_batches``); see ``state``."""


@dataclass(slots=True)
class MeshStateStats:
    payloads_in: int = 0
    bytes_in: int = 0
    decode_errors: int = 0
    broadcast_payloads: int = 0
    index_payloads_out: int = 0
    index_entries_in: int = 0
    turn_ends_in: int = 0  # turn ends received (sparse replication, tag "t")
    index_entries_changed: int = 0
    index_entries_repair_queued: int = 0
    oversize: int = 0  # deltas too big for a gossip payload (left to repair)
    callback_errors: int = 0
    foreign_entries_dropped: int = 0  # first_hand: entries naming another node than their sender
    unknown_skipped: int = 0  # payloads of a tag this build does not know (a later minor's, state_wire)
