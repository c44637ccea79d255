"""Replicated worker health: per-observer last-writer-wins observations, and the mesh's combined view.

State: (worker, observer) -> ``Observation(stamp, healthy)``. Only the observer writes its key, with
its HLC, so last-writer-wins by ``(stamp, healthy)`` is a join semilattice (commutative, associative,
idempotent): merges in any order, with duplicates, end equal.

Combined view of a worker (``view`` / ``routable``), over its *fresh* observations (stamped within
``fresh_s`` of the local clock):

- no fresh observation: routable (nothing is known against it; the node's own checks and circuit
  breaker remain the first gate);
- otherwise routable iff more fresh observers say healthy than unhealthy; on a tie, this node's own
  fresh observation decides, and without one, healthy.

Bounded: an observer republishes an unchanged observation when it observes again ``refresh_s``
after the last publication (its health checks run more often than ``fresh_s``), and observations
older than ``fresh_s`` are collected (the observer's own too, if it stopped checking that worker),
so the state is at most (workers checked recently x live observers). A dead
observer's observations are dropped at once (``on_member_dead``), and the ones it wrote before its
death that arrive later are refused until it is alive again (``on_member_alive``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from shepherd.mesh.hlc import HLC, MAX_STAMP, make_stamp, stamp_ms
from shepherd.proto.state_decode import expect_bool, expect_int, expect_list, expect_str

__all__ = [
    "HealthConfig",
    "HealthView",
    "Observation",
    "ReplicatedHealth",
    "observation_from_wire",
    "observation_to_wire",
    "observations_from_wire",
]


@dataclass(frozen=True, slots=True)
class Observation:
    worker: str
    observer: str
    stamp: int  # the observer's HLC
    healthy: bool

    def key(self) -> tuple[int, bool]:
        return (self.stamp, self.healthy)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    fresh_s: float = 30.0  # observations older than this are stale: ignored, then collected
    refresh_s: float = 10.0  # an unchanged observation is published again this long after the last
    max_entries: int = 200_000  # hard cap (stalest first)
    dead_margin_s: float = (
        1.0  # observations of a dead observer stamped up to this after its death are refused
    )


@dataclass(frozen=True, slots=True)
class HealthView:
    healthy: int  # fresh observers that say healthy
    unhealthy: int
    local: bool | None  # this node's own fresh observation
    routable: bool


class ReplicatedHealth:
    """Health observations of one node (``node``), merged with its peers'."""

    def __init__(self, node: str, hlc: HLC, config: HealthConfig | None = None) -> None:
        self.node = node
        self.hlc = hlc
        self.config = config or HealthConfig()
        self._obs: dict[str, dict[str, Observation]] = {}  # worker -> observer -> observation
        self._pending: dict[tuple[str, str], None] = {}
        self._dead: dict[str, int] = {}  # observer -> stamp floor (refused at or below)
        self._fresh_ms = int(self.config.fresh_s * 1000)
        self._refresh_ms = int(self.config.refresh_s * 1000)
        self.dropped = 0  # incoming observations dropped (drift, dead observer)

    # -- views --------------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return stamp_ms(self.hlc.wall())

    def view(self, worker: str) -> HealthView:
        cutoff = self._now_ms() - self._fresh_ms
        h = u = 0
        local: bool | None = None
        for o in self._obs.get(worker, {}).values():
            if stamp_ms(o.stamp) < cutoff:
                continue
            if o.healthy:
                h += 1
            else:
                u += 1
            if o.observer == self.node:
                local = o.healthy
        ok = h > u if h != u else (local is None or local)
        return HealthView(h, u, local, ok)

    def routable(self, worker: str) -> bool:
        return self.view(worker).routable

    def observations(self, worker: str | None = None) -> list[Observation]:
        if worker is not None:
            return list(self._obs.get(worker, {}).values())
        return [o for d in self._obs.values() for o in d.values()]

    def __len__(self) -> int:
        return sum(map(len, self._obs.values()))

    # -- local writes -------------------------------------------------------------------------------

    def observe(self, worker: str, healthy: bool) -> Observation | None:
        """This node's health check result. Published (stamped, queued for gossip) when it differs
        from the last one or that one is ``refresh_s`` old; returns what was published, if anything."""
        cur = self._obs.get(worker, {}).get(self.node)
        fresh = cur is not None and stamp_ms(self.hlc.wall()) - stamp_ms(cur.stamp) < self._refresh_ms
        if cur is not None and cur.healthy == healthy and fresh:
            return None
        o = Observation(worker, self.node, self.hlc.now(), healthy)
        self._obs.setdefault(worker, {})[self.node] = o
        self._pending[(worker, self.node)] = None
        return o

    def forget(self, worker: str) -> None:
        """The worker left the registry: drop what is known of it here (peers let theirs expire)."""
        self._obs.pop(worker, None)
        for key in [k for k in self._pending if k[0] == worker]:
            del self._pending[key]

    # -- merge --------------------------------------------------------------------------------------

    def merge(self, observations: Iterable[Observation]) -> set[str]:
        """Join remote observations; returns the workers whose observations changed. Changed ones
        are queued for gossip again (rumor spreading stops where nothing changes)."""
        changed: set[str] = set()
        cutoff = self._now_ms() - self._fresh_ms
        horizon = self.hlc.horizon()
        top = 0
        dead = self._dead
        for o in observations:
            floor = dead.get(o.observer) if dead else None
            if (floor is not None and o.stamp <= floor) or o.stamp > horizon:
                self.dropped += 1
                continue
            if o.stamp > top:
                top = o.stamp
            d = self._obs.get(o.worker)
            if d is None:
                d = self._obs[o.worker] = {}
            cur = d.get(o.observer)
            if cur is not None and cur.key() >= o.key():
                continue
            d[o.observer] = o
            if stamp_ms(o.stamp) >= cutoff:
                self._pending[(o.worker, o.observer)] = None
            changed.add(o.worker)
        if top:
            self.hlc.observe(top)
        if len(self) > self.config.max_entries:
            self._cap()
        return changed

    # -- membership and time ------------------------------------------------------------------------

    def on_member_dead(self, name: str) -> set[str]:
        """Drop the observations of a dead (or departed) observer; returns the workers affected."""
        if name == self.node:
            return set()
        floor = self.hlc.now() + make_stamp(int(self.config.dead_margin_s * 1000))  # its clock may be ahead
        changed = set()
        for w, d in list(self._obs.items()):
            o = d.pop(name, None)
            if o is not None:
                floor = max(floor, o.stamp)
                changed.add(w)
                self._pending.pop((w, name), None)
                if not d:
                    del self._obs[w]
        self._dead[name] = max(floor, self._dead.get(name, 0))
        return changed

    def on_member_alive(self, name: str) -> None:
        self._dead.pop(name, None)

    def tick(self) -> set[str]:
        """Collect stale observations (this node's too: it refreshes them by observing again) and
        old floors. Returns the workers whose observations changed."""
        cutoff = self._now_ms() - self._fresh_ms
        changed: set[str] = set()
        for w, d in list(self._obs.items()):
            for name, o in list(d.items()):
                if stamp_ms(o.stamp) < cutoff:
                    del d[name]
                    self._pending.pop((w, name), None)
                    changed.add(w)
            if not d:
                del self._obs[w]
        for name, floor in list(self._dead.items()):
            if stamp_ms(floor) < cutoff:
                del self._dead[name]
        return changed

    def _cap(self) -> None:
        over = len(self) - self.config.max_entries
        stale = sorted((o.stamp, o.worker, o.observer) for d in self._obs.values() for o in d.values())
        for _, w, name in stale[:over]:
            d = self._obs[w]
            del d[name]
            self._pending.pop((w, name), None)
            if not d:
                del self._obs[w]

    # -- gossip and repair --------------------------------------------------------------------------

    def take_delta(self, limit: int | None = None) -> list[Observation]:
        keys = list(self._pending) if limit is None else list(self._pending)[:limit]
        out = []
        for key in keys:
            del self._pending[key]
            o = self._obs.get(key[0], {}).get(key[1])
            if o is not None:
                out.append(o)
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def digest(self) -> bytes:
        wire = sorted(observation_to_wire(o) for d in self._obs.values() for o in d.values())
        return hashlib.blake2b(msgpack.packb(wire), digest_size=16).digest()

    def to_wire(self) -> list[Any]:
        return [observation_to_wire(o) for d in self._obs.values() for o in d.values()]


def observation_to_wire(o: Observation) -> list[Any]:
    return [o.worker, o.observer, o.stamp, o.healthy]


def observation_from_wire(v: Any) -> Observation:
    f = expect_list(v, 4)
    return Observation(expect_str(f[0]), expect_str(f[1]), expect_int(f[2], 0, MAX_STAMP), expect_bool(f[3]))


def observations_from_wire(v: Any, max_len: int = 1 << 20) -> list[Observation]:
    return [observation_from_wire(x) for x in expect_list(v, max_len=max_len)]
