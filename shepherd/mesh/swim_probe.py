"""Probe bookkeeping of SWIM (pure): the randomized round-robin order, the probe in flight, and
the ping-req relays we run for others. Used by ``shepherd.mesh.swim.Swim``."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from shepherd.mesh.swim_members import DEAD, LEFT, SUSPECT, Node
from shepherd.proto.mesh_messages import Addr

MAX_RELAYS = 1024


@dataclass(slots=True)
class Probe:
    """Our probe in flight: direct ping until ``direct_deadline``, then ping-reqs until ``deadline``."""

    seq: int
    target: str
    incarnation: int
    direct_deadline: float
    deadline: float
    indirect_sent: bool = False
    expected_nacks: int = 0
    nacks: int = 0
    extended: bool = False

    def next_deadline(self) -> float:
        return self.deadline if self.indirect_sent else self.direct_deadline

    def extend(self, now: float, lag: float, probe_interval: float, probe_timeout: float) -> None:
        """We were stalled for ``lag``: push the deadlines so queued acks get read first (once)."""
        if self.extended:
            return
        self.extended = True
        ext = min(lag, probe_interval)
        if not self.indirect_sent:
            self.direct_deadline = max(self.direct_deadline + ext, now + probe_timeout)
            self.deadline = max(self.deadline + ext, self.direct_deadline + probe_interval - probe_timeout)
        else:
            self.deadline = max(self.deadline + ext, now + probe_timeout)


class ProbeOrder:
    """Randomized round-robin over the members (shuffled each round; new members inserted at a
    random place), with a priority queue in front (suspects to probe next)."""

    def __init__(self, me: str, rng: random.Random) -> None:
        self.me = me
        self.rng = rng
        self._list: list[str] = []
        self._set: set[str] = set()
        self._idx = 0
        self._priority: list[str] = []

    def add(self, name: str) -> None:
        if name in self._set or name == self.me:
            return
        self._set.add(name)
        self._list.insert(self.rng.randint(0, len(self._list)), name)

    def prioritize(self, name: str) -> None:
        if name not in self._priority:
            self._priority.append(name)

    def next(self, nodes: dict[str, Node], on_new_round: Callable[[], None]) -> Node | None:
        """The next member to probe (not ourselves, not DEAD/LEFT), or None if there is none."""
        while self._priority:
            node = nodes.get(self._priority.pop(0))
            if node is not None and node.state == SUSPECT:
                return node
        for _ in range(2 * len(self._list) + 2):
            if self._idx >= len(self._list):
                on_new_round()
                self._list = [n for n in nodes if n != self.me]
                self.rng.shuffle(self._list)
                self._set = set(self._list)
                self._idx = 0
                if not self._list:
                    return None
            node = nodes.get(self._list[self._idx])
            self._idx += 1
            if node is not None and node.state not in (DEAD, LEFT):
                return node
        return None


@dataclass(slots=True)
class Relay:
    orig_seq: int
    orig: Addr
    nack: bool
    nack_at: float
    expire_at: float


class Relays:
    """Ping-reqs we relay: our ping's seq -> who asked; nack at ``nack_at``, forget at ``expire_at``."""

    def __init__(self) -> None:
        self.by_seq: dict[int, Relay] = {}  # (read-only outside: empty, nothing to nack or expire)

    def __len__(self) -> int:
        return len(self.by_seq)

    def add(self, seq: int, relay: Relay) -> bool:
        if len(self.by_seq) >= MAX_RELAYS:
            return False
        self.by_seq[seq] = relay
        return True

    def pop(self, seq: int) -> Relay | None:
        return self.by_seq.pop(seq, None)

    def next_deadline(self) -> float:
        t = float("inf")
        if not self.by_seq:
            return t
        for r in self.by_seq.values():
            t = min(t, r.expire_at, r.nack_at if r.nack else t)
        return t

    def due_nacks(self, now: float) -> list[Relay]:
        """Relays whose nack is due now (each once); expired relays are dropped."""
        due: list[Relay] = []
        for seq, r in list(self.by_seq.items()):
            if r.nack and now >= r.nack_at:
                r.nack = False
                due.append(r)
            if now >= r.expire_at:
                del self.by_seq[seq]
        return due
