"""Who sent a datagram's user payloads: UDP senders bound to certificate identities (``SenderBinding``).

UDP datagrams are authenticated by the shared keyring only, so the sender name inside a packet is
whatever a key holder wrote. Replicated state (user payloads) is tied to the sender this way: a
member's name is *bound* to a gossip address once its certificate was verified over mTLS at that
address (``bind``: a push-pull we dialled to that address, or one the member opened to us from that
host listing itself there), and a user payload is delivered only when the packet's sender is bound to
the datagram's source address. So a key holder without a certificate can only speak as a member by
also sending from that member's address.

A payload from a sender not bound (yet) at that address is held back, bounded (``max_held`` payloads
for each of at most ``max_senders`` senders, for ``hold_s`` seconds), and the runtime is asked to
verify it (``needs_verify``: a push-pull to that member): delivered once bound, dropped (counted)
otherwise. This covers the moments after a member joins, before the pair has done its push-pull.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shepherd.proto.mesh_messages import Addr

__all__ = ["SenderBinding", "SenderStats"]


@dataclass
class SenderStats:
    delivered: int = 0
    held: int = 0
    released: int = 0
    dropped_unbound: int = 0
    dropped_expired: int = 0
    dropped_full: int = 0


class SenderBinding:
    """The bindings of one runtime (pure: time comes in as arguments)."""

    def __init__(
        self,
        deliver: Callable[[bytes, str], None],
        *,
        match_address: bool = True,
        hold_s: float = 5.0,
        max_held: int = 1024,
        max_senders: int = 64,
    ) -> None:
        self._deliver = deliver
        self.match_address = match_address
        self.hold_s = hold_s
        self.max_held = max_held
        self.max_senders = max_senders
        self.stats = SenderStats()
        self._bound: dict[str, Addr] = {}
        # payloads held back per sender (read-only outside: empty, nothing to expire or verify)
        self.held: dict[str, deque[tuple[float, Addr, bytes]]] = {}

    def bound(self, name: str) -> Addr | None:
        return self._bound.get(name)

    def is_bound(self, name: str, addr: Addr) -> bool:
        got = self._bound.get(name)
        return got is not None and (not self.match_address or got == addr)

    def bind(self, name: str, addr: Addr, now: float) -> None:
        """``name``'s certificate was verified at gossip address ``addr``: deliver what it sent from there."""
        self._bound[name] = addr
        held = self.held.pop(name, None)
        if not held:
            return
        for t, src, payload in held:
            if now - t > self.hold_s:
                self.stats.dropped_expired += 1
            elif self.is_bound(name, src):
                self.stats.released += 1
                self._deliver(payload, name)
            else:
                self.stats.dropped_unbound += 1

    def held_names(self) -> list[str]:
        """Senders with payloads held back (not bound yet)."""
        return list(self.held)

    def unbind(self, name: str) -> None:
        self._bound.pop(name, None)

    def on_user(self, payload: bytes, sender: str, src: Addr, now: float, member_addr: Addr | None) -> bool:
        """A user payload from ``sender`` (packet name) at ``src``: delivered now, or held back (then
        True is returned if the runtime should verify the member now: the first payload held), or
        dropped. ``member_addr`` is the sender's address in the membership (None if not a member)."""
        if self.is_bound(sender, src):
            self.stats.delivered += 1
            self._deliver(payload, sender)
            return False
        if member_addr is None or (self.match_address and member_addr != src):
            self.stats.dropped_unbound += 1
            return False
        q = self.held.get(sender)
        first = q is None
        if q is None:
            if len(self.held) >= self.max_senders:
                self.stats.dropped_full += 1
                return False
            q = self.held[sender] = deque()
        while q and now - q[0][0] > self.hold_s:
            q.popleft()
            self.stats.dropped_expired += 1
        if len(q) >= self.max_held:
            self.stats.dropped_full += 1
            return first
        q.append((now, src, payload))
        self.stats.held += 1
        return first or len(q) == 1

    def expire(self, now: float) -> None:
        """Drop held payloads older than ``hold_s`` (call now and then)."""
        for name in list(self.held):
            q = self.held[name]
            while q and now - q[0][0] > self.hold_s:
                q.popleft()
                self.stats.dropped_expired += 1
            if not q:
                del self.held[name]
