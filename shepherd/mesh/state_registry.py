"""Replicated worker registry: a last-writer-wins register per worker id, with leases and tombstones.

State: worker id -> ``RegEntry``. An entry is a *version* (``stamp``: HLC of the write, ``writer``:
the node that wrote it, ``kind``: live / removed / owner-gone, ``record`` for a live one) plus
``renewed``, the HLC stamp of the latest renewal of that version. Entries are totally ordered by
``(stamp, writer, kind, record, renewed)`` and merge takes the greatest: a join semilattice
(commutative, associative, idempotent), whatever the order, duplication or loss of deltas.

- ``put`` writes a new live version (fresh HLC stamp); ``remove`` writes a tombstone (``REMOVED``)
  with a fresh stamp, so it beats every version its writer has seen.
- Leases: a live entry's owner (``record.owner``, the node that added it) renews it every
  ``renew_s`` (a new ``renewed``, same version, so a renewal never beats a concurrent removal). A
  live entry not renewed within ``lease_s`` is gone, on every replica alike (it is a function of the
  entry and the clock). This bounds what a dead or partitioned owner leaves behind.
- A dead owner (``on_member_dead``): each of its live entries is replaced by the deterministic
  tombstone of that version: same ``(stamp, writer)``, kind ``OWNER_GONE``. Every replica derives the
  same tombstone from the same version, it beats exactly that version (and its renewals), and it
  loses to anything written later (a re-add by another node, or the owner's own writes if it comes
  back). Versions owned by a node this replica saw die, stamped before its death (plus
  ``dead_margin_s`` for clock skew), that arrive later are turned into that tombstone on arrival,
  until the node is alive again (``on_member_alive``).
- Tombstones are collected ``lease_s + tombstone_grace_s`` after their ``renewed``: by then every
  version they beat has lost its lease, so a stale copy arriving later is expired on arrival and
  cannot resurrect the worker (up to the HLC's drift bound).

Bounded: live entries are the workers (renewed by live owners); tombstones are the removals of the
last ``lease_s + grace`` seconds (plus a hard cap, ``max_entries``, oldest tombstones first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from shepherd.mesh.hlc import HLC, MAX_STAMP, make_stamp, stamp_ms
from shepherd.proto.state_decode import StateDecodeError, expect_int, expect_list, expect_str

__all__ = [
    "LIVE",
    "OWNER_GONE",
    "REMOVED",
    "RegEntry",
    "RegistryChange",
    "RegistryConfig",
    "ReplicatedRegistry",
    "WorkerRecord",
    "entry_from_wire",
    "entry_to_wire",
    "merge_entry",
]

LIVE, REMOVED, OWNER_GONE = 0, 1, 2
_KINDS = (LIVE, REMOVED, OWNER_GONE)


@dataclass(frozen=True, slots=True, order=True)
class WorkerRecord:
    """What the mesh knows of a worker. ``labels`` are sorted (key, value) pairs."""

    id: str
    url: str
    model: str
    kind: str = ""  # engine kind: "sglang" | "vllm" | "http" | ...
    labels: tuple[tuple[str, str], ...] = ()
    owner: str = ""  # the node that added it (renews its lease)


@dataclass(frozen=True, slots=True)
class RegEntry:
    id: str
    stamp: int
    writer: str
    kind: int
    record: WorkerRecord | None  # set iff kind == LIVE
    renewed: int

    def key(self) -> tuple[int, str, int, WorkerRecord | None, int]:
        return (self.stamp, self.writer, self.kind, self.record, self.renewed)

    @property
    def live(self) -> bool:
        return self.kind == LIVE


def merge_entry(a: RegEntry, b: RegEntry) -> RegEntry:
    """The greater of two entries of one worker id (the semilattice join)."""
    return b if b.key() > a.key() else a


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    lease_s: float = 90.0  # a live entry not renewed by its owner within this is gone
    renew_s: float = 30.0  # the owner renews its entries this often (well under lease_s)
    tombstone_grace_s: float = 30.0  # tombstones are kept lease_s + this after their last stamp
    max_entries: int = 100_000  # hard cap (tombstones go first, oldest first)
    dead_margin_s: float = 1.0  # versions of a dead owner stamped up to this after its death are its old ones


@dataclass(frozen=True, slots=True)
class RegistryChange:
    """The live view of one worker before and after an operation (None: absent)."""

    id: str
    before: WorkerRecord | None
    after: WorkerRecord | None


class ReplicatedRegistry:
    """The worker registry CRDT of one node (``node``: this node's name)."""

    def __init__(self, node: str, hlc: HLC, config: RegistryConfig | None = None) -> None:
        self.node = node
        self.hlc = hlc
        self.config = config or RegistryConfig()
        self._entries: dict[str, RegEntry] = {}
        self._pending: dict[str, None] = {}  # ids whose entry changed since the last take_delta
        self._dead: dict[str, int] = {}  # node -> HLC stamp when this replica saw it die
        self._lease_ms = int(self.config.lease_s * 1000)
        self._renew_ms = int(self.config.renew_s * 1000)
        self._gc_ms = int((self.config.lease_s + self.config.tombstone_grace_s) * 1000)
        self.dropped = 0  # incoming entries dropped (clock drift)

    # -- views --------------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return stamp_ms(self.hlc.wall())

    def _live(self, e: RegEntry | None, now_ms: int) -> WorkerRecord | None:
        if e is None or e.record is None or stamp_ms(e.renewed) + self._lease_ms < now_ms:
            return None
        return e.record

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The live record of a worker (None if absent, removed or its lease ran out)."""
        return self._live(self._entries.get(worker_id), self._now_ms())

    def records(self) -> list[WorkerRecord]:
        now = self._now_ms()
        out = []
        for e in self._entries.values():
            r = self._live(e, now)
            if r is not None:
                out.append(r)
        return out

    def entry(self, worker_id: str) -> RegEntry | None:
        return self._entries.get(worker_id)

    def entries(self) -> dict[str, RegEntry]:
        """The raw state (live, expired-not-yet-collected and tombstones), a copy."""
        return dict(self._entries)

    @property
    def live_count(self) -> int:
        return sum(1 for e in self._entries.values() if e.kind == LIVE)

    @property
    def tombstone_count(self) -> int:
        return sum(1 for e in self._entries.values() if e.kind != LIVE)

    @property
    def dead_marks(self) -> int:
        return len(self._dead)

    # -- local writes -------------------------------------------------------------------------------

    def put(self, record: WorkerRecord) -> RegistryChange | None:
        """Add or replace a worker (a new version, written by this node). ``record.owner`` defaults
        to this node. Returns the change of the live view (None if it did not change)."""
        record = WorkerRecord(
            record.id,
            record.url,
            record.model,
            record.kind,
            tuple(sorted(record.labels)),
            record.owner or self.node,
        )
        s = self.hlc.now()
        return self._set(RegEntry(record.id, s, self.node, LIVE, record, s))

    def remove(self, worker_id: str) -> RegistryChange | None:
        """Remove a worker: a tombstone newer than every version this node has seen."""
        s = self.hlc.now()
        return self._set(RegEntry(worker_id, s, self.node, REMOVED, None, s))

    def _set(self, e: RegEntry) -> RegistryChange | None:
        now = self._now_ms()
        old = self._entries.get(e.id)
        before = self._live(old, now)
        self._entries[e.id] = e
        self._pending[e.id] = None
        after = self._live(e, now)
        return None if before == after else RegistryChange(e.id, before, after)

    # -- merge --------------------------------------------------------------------------------------

    def merge(self, entries: Iterable[RegEntry]) -> list[RegistryChange]:
        """Join remote entries into this state; returns the changes of the live view. Entries that
        changed this state are queued for gossip again (rumor spreading stops where nothing changes).
        Entries stamped beyond the HLC's drift bound are dropped. If a peer declared this node dead
        and the owner-gone tombstone of one of its entries arrives, this node writes the entry again
        (a new version, as SWIM's refutation does for membership)."""
        now = self._now_ms()
        changes: list[RegistryChange] = []
        table = self._entries
        refute: list[WorkerRecord] = []
        horizon = self.hlc.horizon()
        top = 0
        dead = self._dead
        for e in entries:
            if e.renewed > horizon:
                self.dropped += 1
                continue
            if e.renewed > top:
                top = e.renewed
            if dead:
                e = self._dead_filter(e)
            old = table.get(e.id)
            if old is not None and old.key() >= e.key():
                continue
            before = self._live(old, now)
            table[e.id] = e
            after = self._live(e, now)
            if after is not None or (e.kind != LIVE and stamp_ms(e.renewed) + self._gc_ms >= now):
                self._pending[e.id] = None  # relay what is still worth something
            if (
                e.kind == OWNER_GONE
                and old is not None
                and old.record is not None
                and old.record.owner == self.node
            ):
                refute.append(old.record)  # written again below: the live view does not change
            elif before != after:
                changes.append(RegistryChange(e.id, before, after))
        if top:
            self.hlc.observe(top)
        for rec in refute:
            self.put(rec)
        if len(table) > self.config.max_entries:
            self._cap()
        return changes

    def _dead_filter(self, e: RegEntry) -> RegEntry:
        if e.record is not None:
            died = self._dead.get(e.record.owner)
            if died is not None and e.stamp <= died:
                return _owner_gone(e, died)
        return e

    # -- membership ---------------------------------------------------------------------------------

    def on_member_dead(self, name: str) -> list[RegistryChange]:
        """``name`` was declared dead (or left): its live entries become their owner-gone tombstones."""
        if name == self.node:
            return []
        died = self.hlc.now() + make_stamp(int(self.config.dead_margin_s * 1000))  # its clock may be ahead
        self._dead[name] = max(died, self._dead.get(name, 0))
        now = self._now_ms()
        changes = []
        for wid, e in list(self._entries.items()):
            if e.record is not None and e.record.owner == name:
                t = _owner_gone(e, died)
                self._entries[wid] = t
                self._pending[wid] = None
                before = self._live(e, now)
                if before is not None:
                    changes.append(RegistryChange(wid, before, None))
        return changes

    def on_member_alive(self, name: str) -> None:
        """``name`` is alive (again): versions it writes from now on are accepted."""
        self._dead.pop(name, None)

    # -- time ---------------------------------------------------------------------------------------

    def tick(self) -> list[RegistryChange]:
        """Renew this node's leases that are due; collect expired entries and old tombstones.
        Returns the changes of the live view (entries whose lease ran out). Call every few seconds."""
        now = self._now_ms()
        changes: list[RegistryChange] = []
        renew_before = now - self._renew_ms
        expire_before = now - self._lease_ms
        gc_before = now - self._gc_ms
        table = self._entries
        for wid, e in list(table.items()):
            r = stamp_ms(e.renewed)
            if e.record is not None:
                if r < expire_before:
                    # gone, even if it is ours: a lapsed version may be a stale copy of one that was
                    # removed (and its tombstone collected) since; the owner writes a new one instead
                    del table[wid]
                    self._pending.pop(wid, None)
                    changes.append(RegistryChange(wid, e.record, None))
                elif e.record.owner == self.node and r < renew_before:
                    table[wid] = RegEntry(e.id, e.stamp, e.writer, e.kind, e.record, self.hlc.now())
                    self._pending[wid] = None
            elif r < gc_before:
                del table[wid]
                self._pending.pop(wid, None)
        for name, died in list(self._dead.items()):
            if stamp_ms(died) < gc_before:
                del self._dead[name]
        return changes

    def _cap(self) -> None:
        over = len(self._entries) - self.config.max_entries
        tombs = sorted((e.renewed, wid) for wid, e in self._entries.items() if e.kind != LIVE)
        for _, wid in tombs[:over]:
            del self._entries[wid]
            self._pending.pop(wid, None)

    # -- gossip and repair --------------------------------------------------------------------------

    def take_delta(self, limit: int | None = None) -> list[RegEntry]:
        """Entries changed since the last call (at most ``limit``; the rest stay pending)."""
        ids = list(self._pending) if limit is None else list(self._pending)[:limit]
        out = []
        for wid in ids:
            del self._pending[wid]
            e = self._entries.get(wid)
            if e is not None:
                out.append(e)
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def digest(self) -> bytes:
        """16 bytes naming the whole state (equal states, equal digests)."""
        wire = sorted(entry_to_wire(e) for e in self._entries.values())
        return hashlib.blake2b(msgpack.packb(wire), digest_size=16).digest()

    def to_wire(self) -> list[Any]:
        return [entry_to_wire(e) for e in self._entries.values()]


def _owner_gone(e: RegEntry, died: int) -> RegEntry:
    """The deterministic tombstone of a live version whose owner died (beats exactly that version)."""
    return RegEntry(e.id, e.stamp, e.writer, OWNER_GONE, None, max(e.renewed, died))


# -- wire ---------------------------------------------------------------------------------------------


def entry_to_wire(e: RegEntry) -> list[Any]:
    r = e.record
    rec = None if r is None else [r.url, r.model, r.kind, [list(kv) for kv in r.labels], r.owner]
    return [e.id, e.stamp, e.writer, e.kind, e.renewed, rec]


def entry_from_wire(v: Any) -> RegEntry:
    """Decode one entry; raises ``StateDecodeError`` on anything malformed."""
    f = expect_list(v, 6)
    wid = expect_str(f[0])
    stamp = expect_int(f[1], 0, MAX_STAMP)
    writer = expect_str(f[2])
    kind = expect_int(f[3], 0, 2)
    renewed = expect_int(f[4], stamp, MAX_STAMP)
    rec: WorkerRecord | None = None
    if kind == LIVE:
        r = expect_list(f[5], 5)
        labels = []
        for kv in expect_list(r[3], max_len=64):
            k, val = expect_list(kv, 2)
            labels.append((expect_str(k, 128), expect_str(val, 1024, allow_empty=True)))
        labels.sort()
        rec = WorkerRecord(
            wid,
            expect_str(r[0], 2048),
            expect_str(r[1], 512, allow_empty=True),
            expect_str(r[2], 64, allow_empty=True),
            tuple(labels),
            expect_str(r[4]),
        )
    elif f[5] is not None:
        raise StateDecodeError("a tombstone carries no record")
    return RegEntry(wid, stamp, writer, kind, rec, renewed)


def entries_from_wire(v: Any, max_len: int = 1 << 20) -> list[RegEntry]:
    return [entry_from_wire(x) for x in expect_list(v, max_len=max_len)]
