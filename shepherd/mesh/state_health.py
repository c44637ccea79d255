"""Replicated worker health: one versioned record per observer, gossiped as changes; the combined view.

State: observer -> its record ``(version, checked, unhealthy)``: the workers the observer checks and
the ones of them it sees unhealthy (``unhealthy`` within ``checked``). Only the observer writes its
record; its ``version`` is the observer's HLC stamp at its last change. Nothing is re-published while
nothing changes: a record is as fresh as its observer is alive (SWIM), and a dead observer's record
is dropped at once (``on_member_dead``; what it wrote before its death that arrives later is refused
until it is alive again, ``on_member_alive``, however late it comes).

Dissemination, three message kinds (``state_wire`` tags ``"f"``, ``"b"``, ``"H"``):

- a **delta** ``(observer, prev, version, flips)``: the observer's changes since ``prev`` (a worker
  now healthy, unhealthy, or no longer checked). Flips a health check makes between two flushes go
  out as one delta. A receiver whose record of that observer is at ``prev`` applies it and stays in
  sync; one that missed a delta applies the flips (they are absolute states) but marks the record out
  of sync (its ``checked`` set may lack a change). A delta from ``prev`` 0 (the observer's first
  since it started) starts the record anew;
- a **beacon** ``(observer, version, unhealthy, checked hash)`` every ``beacon_s``: tiny (no
  healthy worker is listed); it repairs the unhealthy set of a receiver that missed deltas at once,
  and tells it whether its ``checked`` set is right (the hash);
- a **full record** (push-pull and repair): sent only to a peer whose digest (``versions()``: observer
  -> version of the records it holds in sync) is behind; the checked sets, the same on most
  observers, travel once per message.

Every merge is idempotent and order-insensitive in its outcome for records in sync (the highest
version of an observer wins; a full record replaces an out-of-sync one of the same version).

Combined view of a worker (``view`` / ``routable``), over the records of the live observers that check
it: no such record, routable (nothing is known against it; the node's own checks and circuit breaker
remain the first gate); otherwise routable iff more observers say healthy than unhealthy; on a tie,
this node's own observation decides, and without one, healthy. Views are cached per worker and
dropped when a record touching the worker changes, so ``routable`` is a dict lookup on the hot path.

Mixed fleets: observations of a peer of the earlier format (``"h"``: one LWW entry per (worker,
observer), re-published by its observer every 10 s) are still read and counted while fresh
(``legacy_fresh_s``) for observers without a record; earlier peers skip the new tags.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shepherd.mesh.hlc import HLC, MAX_STAMP, make_stamp, stamp_ms
from shepherd.proto.state_decode import (
    StateDecodeError,
    expect_bool,
    expect_bytes,
    expect_int,
    expect_list,
    expect_str,
)

__all__ = [
    "GONE",
    "HEALTHY",
    "UNHEALTHY",
    "HealthBeacon",
    "HealthConfig",
    "HealthDelta",
    "HealthRecord",
    "HealthView",
    "Observation",
    "ReplicatedHealth",
    "beacon_from_wire",
    "beacon_to_wire",
    "checked_hash",
    "delta_from_wire",
    "delta_to_wire",
    "observation_from_wire",
    "observation_to_wire",
    "observations_from_wire",
    "records_from_wire",
    "records_to_wire",
    "versions_from_wire",
]

HEALTHY, UNHEALTHY, GONE = 1, 0, -1  # a flip's new state (GONE: the observer no longer checks it)
_MAX_ID = 256


@dataclass(frozen=True, slots=True)
class HealthConfig:
    beacon_s: float = 10.0  # an observer announces its version and unhealthy set this often
    max_flips: int = 48  # flips per delta (a delta fits a gossip payload with 12-char worker ids)
    relay_max_flips: int = 8  # bigger deltas (a record's first fill, a mass change) are not relayed
    max_observers: int = 4096  # records held, at most (further observers are refused)
    max_checked: int = 65_536  # workers in one record, at most
    max_outbox: int = 16_384  # deltas and beacons waiting for the gossip layer (oldest dropped)
    dead_margin_s: float = 1.0  # records of a dead observer stamped up to this after its death are refused
    legacy_fresh_s: float = 30.0  # earlier-format observations older than this are ignored, then collected


@dataclass(frozen=True, slots=True)
class HealthView:
    healthy: int  # live observers that say healthy
    unhealthy: int
    local: bool | None  # this node's own observation
    routable: bool


@dataclass(frozen=True, slots=True)
class HealthRecord:
    """One observer's whole record (push-pull, repair, snapshot)."""

    observer: str
    version: int
    checked: frozenset[str]
    unhealthy: frozenset[str]


@dataclass(frozen=True, slots=True)
class HealthDelta:
    """An observer's changes from version ``prev`` to ``version``: (worker, HEALTHY|UNHEALTHY|GONE)."""

    observer: str
    prev: int
    version: int
    flips: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class HealthBeacon:
    observer: str
    version: int
    unhealthy: tuple[str, ...]
    checked: bytes  # checked_hash of the observer's checked set


@dataclass(frozen=True, slots=True)
class Observation:
    """An earlier-format observation (``"h"``, from a peer of the earlier format): LWW per (worker,
    observer), fresh for ``legacy_fresh_s``."""

    worker: str
    observer: str
    stamp: int  # the observer's HLC
    healthy: bool

    def key(self) -> tuple[int, bool]:
        return (self.stamp, self.healthy)


Item = HealthDelta | HealthBeacon

_EMPTY: frozenset[str] = frozenset()


def checked_hash(checked: frozenset[str]) -> bytes:
    """8 bytes naming a checked set (order-free)."""
    return hashlib.blake2b("\n".join(sorted(checked)).encode(), digest_size=8).digest()


class _Rec:
    __slots__ = ("checked", "synced", "unhealthy", "version")

    def __init__(
        self, version: int, synced: bool, checked: frozenset[str], unhealthy: frozenset[str]
    ) -> None:
        self.version = version
        self.synced = synced  # every change up to ``version`` applied (else only a full record fixes it)
        self.checked = checked
        self.unhealthy = unhealthy


class ReplicatedHealth:
    """The health records of one node (``node``, its own among them), merged with its peers'."""

    def __init__(self, node: str, hlc: HLC, config: HealthConfig | None = None) -> None:
        self.node = node
        self.hlc = hlc
        self.config = config or HealthConfig()
        self._own = _Rec(0, True, _EMPTY, _EMPTY)
        self._recs: dict[str, _Rec] = {node: self._own}
        self._flips: dict[str, int] = {}  # own changes not yet in a delta
        self._out: deque[Item] = deque(maxlen=self.config.max_outbox)  # own and relayed, for gossip
        self._dead: dict[str, int] = {}  # observer -> stamp floor (refused at or below)
        self._views: dict[str, HealthView] = {}
        self._sets: dict[frozenset[str], frozenset[str]] = {}  # interned checked sets
        self._hashes: dict[frozenset[str], bytes] = {}
        self._legacy: dict[str, dict[str, Observation]] = {}  # observer -> worker -> observation
        self._next_beacon_ms = 0
        self.dropped = 0  # incoming records, deltas or beacons dropped (drift, dead observer, bounds)
        self.out_of_sync = 0  # deltas applied across a gap (a missed delta)

    # -- views --------------------------------------------------------------------------------------

    def view(self, worker: str) -> HealthView:
        v = self._views.get(worker)
        if v is not None:
            return v
        h = u = 0
        local: bool | None = None
        for rec in self._recs.values():
            if worker in rec.checked:
                if worker in rec.unhealthy:
                    u += 1
                else:
                    h += 1
        if worker in self._own.checked:
            local = worker not in self._own.unhealthy
        cacheable = True
        if self._legacy:
            cutoff = self._now_ms() - int(self.config.legacy_fresh_s * 1000)
            for observer, obs in self._legacy.items():
                o = obs.get(worker)
                if o is None or observer in self._recs:
                    continue
                cacheable = False  # ages out by itself
                if stamp_ms(o.stamp) >= cutoff:
                    if o.healthy:
                        h += 1
                    else:
                        u += 1
        ok = h > u if h != u else (local is None or local)
        v = HealthView(h, u, local, ok)
        if cacheable:
            self._views[worker] = v
        return v

    def routable(self, worker: str) -> bool:
        return self.view(worker).routable

    def records(self) -> list[HealthRecord]:
        """Every record held (this node's own included, its pending changes published first)."""
        self._publish()
        return [
            HealthRecord(o, r.version, r.checked, r.unhealthy) for o, r in self._recs.items() if r.checked
        ]

    def record(self, observer: str) -> HealthRecord | None:
        if observer == self.node:
            self._publish()
        r = self._recs.get(observer)
        return None if r is None else HealthRecord(observer, r.version, r.checked, r.unhealthy)

    def in_sync(self, observer: str) -> bool:
        r = self._recs.get(observer)
        return r is not None and r.synced

    def observations(self, worker: str | None = None) -> list[Observation]:
        """The records (and earlier-format observations) as per-(worker, observer) observations."""
        out = [
            Observation(w, o, r.version, w not in r.unhealthy)
            for o, r in self._recs.items()
            for w in r.checked
            if worker is None or w == worker
        ]
        out += [
            x
            for o, d in self._legacy.items()
            if o not in self._recs
            for x in d.values()
            if worker is None or x.worker == worker
        ]
        return out

    def __len__(self) -> int:
        """Records held (observers)."""
        return sum(1 for r in self._recs.values() if r.checked) + len(self._legacy)

    @property
    def pending(self) -> int:
        return len(self._flips) + len(self._out)

    # -- local writes -------------------------------------------------------------------------------

    def observe(self, worker: str, healthy: bool) -> bool:
        """This node's health check result; True if it changed this node's record (a flip, published
        with the next ``take_delta``)."""
        own = self._own
        if worker in own.checked and (worker in own.unhealthy) != healthy:
            return False
        if worker not in own.checked:
            if len(own.checked) >= self.config.max_checked:
                return False
            own.checked = self._intern(own.checked | {worker})
        own.unhealthy = own.unhealthy - {worker} if healthy else own.unhealthy | {worker}
        self._flips[worker] = HEALTHY if healthy else UNHEALTHY
        self._views.pop(worker, None)
        return True

    def forget(self, worker: str) -> bool:
        """This node no longer checks ``worker`` (it left the registry): a flip to GONE."""
        own = self._own
        if worker not in own.checked:
            return False
        own.checked = self._intern(own.checked - {worker})
        own.unhealthy = own.unhealthy - {worker}
        self._flips[worker] = GONE
        self._views.pop(worker, None)
        return True

    def _publish(self) -> None:
        """Turn the pending flips into deltas (chained versions), queued for gossip."""
        if not self._flips:
            return
        items = list(self._flips.items())
        self._flips.clear()
        # even chunks: a bulk publication never leaves a remainder small enough to pass for a flip
        n = -(-len(items) // max(1, self.config.max_flips))
        step = -(-len(items) // n)
        for i in range(0, len(items), step):
            v = self.hlc.now()
            self._out.append(HealthDelta(self.node, self._own.version, v, tuple(items[i : i + step])))
            self._own.version = v

    # -- merge --------------------------------------------------------------------------------------

    def _refused(self, observer: str, version: int) -> bool:
        floor = self._dead.get(observer) if self._dead else None
        if (floor is not None and version <= floor) or version > self.hlc.horizon():
            self.dropped += 1
            return True
        return False

    def _rec_of(self, observer: str) -> _Rec | None:
        rec = self._recs.get(observer)
        if rec is None:
            if len(self._recs) >= self.config.max_observers:
                self.dropped += 1
                return None
            rec = self._recs[observer] = _Rec(0, False, _EMPTY, _EMPTY)
        return rec

    def merge_delta(self, d: HealthDelta, relay: bool = True) -> set[str]:
        """Apply an observer's delta; returns the workers whose view may have changed. A delta that
        moved the record forward is queued again for gossip (``relay``)."""
        if d.observer == self.node or self._refused(d.observer, d.version):
            return set()
        rec = self._rec_of(d.observer)
        if rec is None or d.version <= rec.version:
            return set()
        was: frozenset[str] = _EMPTY
        if d.prev == 0 and rec.version:  # the observer's first delta since it started: a new record
            was = rec.checked
            rec.checked, rec.unhealthy, rec.version, rec.synced = _EMPTY, _EMPTY, 0, True
        in_chain = d.prev == rec.version and (rec.synced or rec.version == 0)
        if not in_chain:
            self.out_of_sync += 1
        add = {w for w, s in d.flips if s != GONE and w not in rec.checked}
        gone = {w for w, s in d.flips if s == GONE and w in rec.checked}
        sick = {w for w, s in d.flips if s == UNHEALTHY}
        well = {w for w, s in d.flips if s != UNHEALTHY}
        checked = rec.checked
        if add or gone:
            checked = (checked | add) - gone
            if len(checked) > self.config.max_checked:
                self.dropped += 1
                return set()
            checked = self._intern(checked)
        unhealthy = (rec.unhealthy - well) | sick
        changed = set(rec.unhealthy ^ unhealthy) | add | gone | was
        rec.checked, rec.unhealthy = checked, unhealthy
        rec.version, rec.synced = d.version, in_chain
        self.hlc.observe(d.version)
        self._invalidate(changed)
        if relay and len(d.flips) <= self.config.relay_max_flips:
            self._out.append(d)  # a flip spreads epidemically; a record's bulk is left to push-pull
        return changed

    def merge_beacon(self, b: HealthBeacon, relay: bool = True) -> set[str]:
        """Apply an observer's beacon: its unhealthy set is exact as of ``version``; a record behind it
        (or with another checked set) is out of sync until a full record comes."""
        if b.observer == self.node or self._refused(b.observer, b.version):
            return set()
        rec = self._rec_of(b.observer)
        if rec is None or b.version < rec.version:
            return set()
        sick = frozenset(b.unhealthy)
        if b.version == rec.version and rec.synced and sick == rec.unhealthy:
            return set()  # in sync: the common case
        checked = rec.checked
        if not sick <= checked:
            checked = self._intern(checked | sick)
        changed = set((rec.unhealthy ^ sick) | (checked - rec.checked))
        rec.checked, rec.unhealthy, rec.version = checked, sick, b.version
        rec.synced = self._hash(checked) == b.checked
        self.hlc.observe(b.version)
        self._invalidate(changed)
        if relay and changed:  # it corrected what we counted: others may need it too
            self._out.append(b)
        return changed

    def merge_records(self, records: Iterable[HealthRecord]) -> set[str]:
        """Merge full records (push-pull, repair): one newer than ours, or of the same version where
        ours is out of sync, replaces ours. Returns the workers whose view may have changed."""
        changed: set[str] = set()
        for r in records:
            if r.observer == self.node or self._refused(r.observer, r.version):
                continue
            rec = self._rec_of(r.observer)
            if rec is None or r.version < rec.version or (r.version == rec.version and rec.synced):
                continue
            if len(r.checked) > self.config.max_checked:
                self.dropped += 1
                continue
            checked = self._intern(r.checked)
            unhealthy = r.unhealthy & checked
            if checked is not rec.checked:
                changed |= checked ^ rec.checked
            changed |= unhealthy ^ rec.unhealthy
            rec.checked, rec.unhealthy, rec.version, rec.synced = checked, unhealthy, r.version, True
            self.hlc.observe(r.version)
        self._invalidate(changed)
        return changed

    def merge_legacy(self, observations: Iterable[Observation]) -> set[str]:
        """Earlier-format observations (a peer of the earlier minor): LWW per (worker, observer)."""
        changed: set[str] = set()
        horizon = self.hlc.horizon()
        cutoff = self._now_ms() - int(self.config.legacy_fresh_s * 1000)
        for o in observations:
            floor = self._dead.get(o.observer)
            if o.observer == self.node or (floor is not None and o.stamp <= floor) or o.stamp > horizon:
                self.dropped += 1
                continue
            if stamp_ms(o.stamp) < cutoff:
                continue
            d = self._legacy.get(o.observer)
            if d is None:
                if len(self._legacy) >= self.config.max_observers:
                    self.dropped += 1
                    continue
                d = self._legacy[o.observer] = {}
            cur = d.get(o.worker)
            if cur is not None and cur.key() >= o.key():
                continue
            if cur is None and len(d) >= self.config.max_checked:
                self.dropped += 1
                continue
            d[o.worker] = o
            changed.add(o.worker)
        self._invalidate(changed)
        return changed

    # -- membership and time ------------------------------------------------------------------------

    def on_member_dead(self, name: str) -> set[str]:
        """Drop the record of a dead (or departed) observer; returns the workers affected."""
        if name == self.node:
            return set()
        floor = self.hlc.now() + make_stamp(int(self.config.dead_margin_s * 1000))  # its clock may be ahead
        changed: set[str] = set()
        rec = self._recs.pop(name, None)
        if rec is not None:
            floor = max(floor, rec.version)
            changed |= rec.checked
        legacy = self._legacy.pop(name, None)
        if legacy:
            floor = max(floor, max(o.stamp for o in legacy.values()))
            changed |= legacy.keys()
        # kept until it is alive again (no record expires by time, so a late one must stay refused)
        self._dead[name] = max(floor, self._dead.pop(name, 0))
        self._invalidate(changed)
        return changed

    def on_member_alive(self, name: str) -> None:
        self._dead.pop(name, None)

    def tick(self) -> set[str]:
        """Queue this node's beacon when due, collect stale earlier-format observations, old floors and
        unused interned sets. Returns the workers whose view changed."""
        now = self._now_ms()
        self._publish()
        if self._own.checked and now >= self._next_beacon_ms:
            self._next_beacon_ms = now + int(self.config.beacon_s * 1000)
            own = self._own
            self._out.append(
                HealthBeacon(self.node, own.version, tuple(sorted(own.unhealthy)), self._hash(own.checked))
            )
        changed: set[str] = set()
        cutoff = now - int(self.config.legacy_fresh_s * 1000)
        for observer, d in list(self._legacy.items()):
            for w, o in list(d.items()):
                if stamp_ms(o.stamp) < cutoff:
                    del d[w]
                    changed.add(w)
            if not d:
                del self._legacy[observer]
        while len(self._dead) > self.config.max_observers:  # the oldest deaths go first
            del self._dead[next(iter(self._dead))]
        if len(self._sets) > 2 * len(self._recs) + 16:
            live = {id(r.checked) for r in self._recs.values()}
            self._sets = {k: v for k, v in self._sets.items() if id(v) in live}
            self._hashes = {k: h for k, h in self._hashes.items() if k in self._sets}
        self._invalidate(changed)
        return changed

    # -- gossip and repair --------------------------------------------------------------------------

    def take_delta(self, limit: int | None = None) -> list[Item]:
        """Deltas and beacons to gossip (this node's own, and, where relayed, others' that moved a
        record forward here), oldest first."""
        self._publish()
        n = len(self._out) if limit is None else min(limit, len(self._out))
        return [self._out.popleft() for _ in range(n)]

    def versions(self) -> dict[str, int]:
        """Digest: observer -> version of every record held in sync (this node's own included)."""
        self._publish()
        return {o: r.version for o, r in self._recs.items() if r.synced and r.version}

    def newer_than(self, remote: Mapping[str, int], only: str | None = None) -> list[HealthRecord]:
        """The records (in sync here) a peer with digest ``remote`` lacks or holds older; ``only``:
        just that observer's."""
        self._publish()
        return [
            HealthRecord(o, r.version, r.checked, r.unhealthy)
            for o, r in self._recs.items()
            if r.synced and r.version > remote.get(o, 0) and (only is None or o == only)
        ]

    def digest(self) -> bytes:
        wire = sorted(self.versions().items())
        return hashlib.blake2b(repr(wire).encode(), digest_size=16).digest()

    # -- internals ----------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return stamp_ms(self.hlc.wall())

    def _intern(self, s: frozenset[str]) -> frozenset[str]:
        return self._sets.setdefault(s, s)

    def _hash(self, s: frozenset[str]) -> bytes:
        h = self._hashes.get(s)
        if h is None:
            h = self._hashes[s] = checked_hash(s)
        return h

    def _invalidate(self, workers: Iterable[str]) -> None:
        views = self._views
        if not views:
            return
        for w in workers:
            views.pop(w, None)


# -- wire ---------------------------------------------------------------------------------------------


def delta_to_wire(d: HealthDelta) -> list[Any]:
    return [d.observer, d.prev, d.version, [[w, s] for w, s in d.flips]]


def delta_from_wire(v: Any) -> HealthDelta:
    f = expect_list(v)
    if len(f) < 4:  # later minors may add fields at the end
        raise StateDecodeError("a health delta has 4 fields")
    flips = []
    for x in expect_list(f[3], max_len=4096):
        g = expect_list(x)
        if len(g) < 2:
            raise StateDecodeError("a flip has 2 fields")
        flips.append((expect_str(g[0], _MAX_ID), expect_int(g[1], GONE, HEALTHY)))
    return HealthDelta(
        expect_str(f[0], _MAX_ID),
        expect_int(f[1], 0, MAX_STAMP),
        expect_int(f[2], 1, MAX_STAMP),
        tuple(flips),
    )


def beacon_to_wire(b: HealthBeacon) -> list[Any]:
    return [b.observer, b.version, list(b.unhealthy), b.checked]


def beacon_from_wire(v: Any) -> HealthBeacon:
    f = expect_list(v)
    if len(f) < 4:
        raise StateDecodeError("a health beacon has 4 fields")
    sick = tuple(expect_str(w, _MAX_ID) for w in expect_list(f[2], max_len=1 << 16))
    return HealthBeacon(
        expect_str(f[0], _MAX_ID), expect_int(f[1], 0, MAX_STAMP), sick, expect_bytes(f[3], 32)
    )


def records_to_wire(records: Iterable[HealthRecord]) -> list[Any]:
    """``[[checked set, ...], [[observer, version, set index, [unhealthy, ...]], ...]]``: each distinct
    checked set once."""
    index: dict[frozenset[str], int] = {}
    sets: list[list[str]] = []
    recs: list[list[Any]] = []
    for r in records:
        i = index.get(r.checked)
        if i is None:
            i = index[r.checked] = len(sets)
            sets.append(sorted(r.checked))
        recs.append([r.observer, r.version, i, sorted(r.unhealthy)])
    return [sets, recs]


def records_from_wire(v: Any) -> list[HealthRecord]:
    f = expect_list(v)
    if len(f) < 2:
        raise StateDecodeError("health records have 2 fields")
    sets = []
    for s in expect_list(f[0], max_len=1 << 16):
        ids = expect_list(s, max_len=1 << 16)
        for w in ids:
            expect_str(w, _MAX_ID)
        sets.append(frozenset(ids))
    out = []
    for x in expect_list(f[1], max_len=1 << 16):
        g = expect_list(x)
        if len(g) < 4:
            raise StateDecodeError("a health record has 4 fields")
        i = expect_int(g[2], 0, len(sets) - 1)
        sick = frozenset(expect_str(w, _MAX_ID) for w in expect_list(g[3], max_len=1 << 16))
        if not sick <= sets[i]:
            raise StateDecodeError("a health record's unhealthy workers are not all checked")
        out.append(HealthRecord(expect_str(g[0], _MAX_ID), expect_int(g[1], 1, MAX_STAMP), sets[i], sick))
    return out


def versions_from_wire(v: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in expect_list(v, max_len=1 << 16):
        g = expect_list(x)
        if len(g) < 2:
            raise StateDecodeError("a version entry has 2 fields")
        out[expect_str(g[0], _MAX_ID)] = expect_int(g[1], 0, MAX_STAMP)
    return out


def observation_to_wire(o: Observation) -> list[Any]:
    return [o.worker, o.observer, o.stamp, o.healthy]


def observation_from_wire(v: Any) -> Observation:
    f = expect_list(v, 4)
    return Observation(expect_str(f[0]), expect_str(f[1]), expect_int(f[2], 0, MAX_STAMP), expect_bool(f[3]))


def observations_from_wire(v: Any, max_len: int = 1 << 20) -> list[Observation]:
    return [observation_from_wire(x) for x in expect_list(v, max_len=max_len)]
