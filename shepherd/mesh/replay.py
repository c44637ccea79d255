"""Replay protection for sealed mesh datagrams: a time window and a per-sender sliding window of sequence
numbers (as IPsec's anti-replay window).

Every packet a runtime sends carries a stamp ``(unix_ms, seq)`` inside the sealed (authenticated)
plaintext (``mesh_wire``): ``unix_ms`` is the sender's wall clock, ``seq`` is strictly increasing per
sender for its whole life *and across restarts* (``SeqCounter`` starts at the boot time in
microseconds and adds one per packet, far fewer than a million a second, so a later process always
starts above everything an earlier one sent, as long as the wall clock does not step back).

A receiver accepts a packet only if

* its ``unix_ms`` is within ``window_s`` of the receiver's wall clock, either way (default 30 s: wide
  enough for NTP-level skew and queueing, much narrower than how long SWIM remembers a member that
  left, ``gossip_to_the_dead_time + tombstone_time``, which the runtime checks, so a captured
  ``Alive`` replayed later cannot bring back a member whose leave was forgotten), and
* its ``seq`` was not seen from that sender before: above the highest seen (the window slides), or
  within ``seq_window`` below it and not marked in the bitmap. Packets reordered more than
  ``seq_window`` behind the newest are dropped like lost ones (gossip tolerates loss).

Memory is bounded: a ``seq_window``-bit integer per sender, for at most ``max_senders`` senders (the
least recently heard one is forgotten first; a forgotten sender is still covered by the time window).
This stops replays by anyone who captured datagrams; it does not stop a holder of the mesh key, who
can seal new packets anyway.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_REPLAY_WINDOW_S", "ReplayGuard", "ReplayStats", "SeqCounter"]

DEFAULT_REPLAY_WINDOW_S = 30.0


class SeqCounter:
    """A sender's packet sequence: starts at the wall clock in microseconds, +1 per packet."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._seq = int(clock() * 1_000_000)

    def next(self) -> tuple[int, int]:
        """The stamp of the next packet: ``(unix_ms, seq)``."""
        self._seq += 1
        return (max(0, int(self._clock() * 1000)), self._seq)


@dataclass
class ReplayStats:
    accepted: int = 0
    unstamped: int = 0
    outside_window: int = 0
    duplicates: int = 0
    too_old: int = 0


class ReplayGuard:
    """Per-sender anti-replay state of one receiver (see the module doc)."""

    def __init__(
        self,
        window_s: float = DEFAULT_REPLAY_WINDOW_S,
        *,
        seq_window: int = 4096,
        max_senders: int = 4096,
        accept_unstamped: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0 or seq_window <= 0 or max_senders <= 0:
            raise ValueError("replay guard: the windows and max_senders must be positive")
        self.window_ms = int(window_s * 1000)
        self.seq_window = seq_window
        self.max_senders = max_senders
        self.accept_unstamped = accept_unstamped
        self.clock = clock
        self.stats = ReplayStats()
        self._senders: OrderedDict[str, tuple[int, int]] = OrderedDict()  # sender -> (highest, bitmap)
        self._mask = (1 << seq_window) - 1

    def __len__(self) -> int:
        return len(self._senders)

    def accept(self, sender: str, stamp: tuple[int, int] | None) -> bool:
        """True if the packet is fresh (and remember it); False if it is to be dropped."""
        st = self.stats
        if stamp is None:
            if self.accept_unstamped:
                st.accepted += 1
                return True
            st.unstamped += 1
            return False
        unix_ms, seq = stamp
        if abs(int(self.clock() * 1000) - unix_ms) > self.window_ms:
            st.outside_window += 1
            return False
        prev = self._senders.get(sender)
        if prev is None:
            high, bits = seq, 1
        else:
            high, bits = prev
            if seq > high:
                shift = seq - high
                bits = ((bits << shift) | 1) & self._mask if shift < self.seq_window else 1
                high = seq
            else:
                back = high - seq
                if back >= self.seq_window:
                    st.too_old += 1
                    return False
                if bits >> back & 1:
                    st.duplicates += 1
                    return False
                bits |= 1 << back
        self._senders[sender] = (high, bits)
        self._senders.move_to_end(sender)
        if len(self._senders) > self.max_senders:
            self._senders.popitem(last=False)
        st.accepted += 1
        return True
