"""Mesh-wide rate limits: per-node counter shards, merged by gossip, and the admission rule.

Limits (requests per minute, tokens per minute, concurrent requests) hold per key: a tenant
(``(tenant, "")``) or a tenant on one model (``(tenant, model)``). Every node admits requests itself,
against the count of the whole mesh, and never waits for another node on the request path.

**State.** Each node process owns one shard per key (``ratelimit_shards.Entry``): G-counters of
admitted requests, reserved tokens, refunded tokens and attempts (demand) for the current and the
previous window, plus an in-flight gauge as a PN pair. Only the owner increments its shard; gossip
carries whole shard states and ``join`` (per-field max) merges them, so deltas may be lost, repeated or
reordered. A node's count of the mesh is the sum of the shards of the *live* members: a member that
is not live (suspect, dead or partitioned away) counts for nothing, its gauge included, because
its side of a partition accounts for it under that side's own share (below). A member that left (a
graceful leave, a rolling restart) admits no more, but what it admitted in the window still counts (its
requests and tokens, not its gauge): the others would admit it again otherwise.

**Sliding window.** The estimate is ``prev * (1 - f) + cur`` (the usual sliding-window counter; f is
the elapsed fraction of the current window). Tokens are reserved at admission (prompt + max_tokens,
or a configured estimate) and settled with the real usage when the request ends: the difference is
refunded into the window of the reservation (or added to the current one).

**Partitions.** With R live members out of N known (N counts unreachable members that have not
left), a side admits against ``limit * R / N``: two sides of a partition together stay within the
limit, each without hearing from the other.

**Between gossip rounds (the lease).** A node sees the others' shards as they were some time ago;
call τ (``propagation``) the bound on how long a node's increments take to reach every live peer.
Checking only ``estimate + cost <= limit`` would let every node spend the same headroom at once (the
simulation's burst scenario: 1.4x the limit in one window). So each node also bounds what the others
cannot have seen yet: let ``u`` be the net change of its own shard in the last τ (a small local ring
of time slots). The headroom the others can see is at least ``H = limit - (estimate - u)``. Node i
admits a request of cost c only if

    estimate + c <= limit              (the mesh-wide count)      and
    u + c        <= s_i * H            (its lease: share s_i of the headroom everyone sees)

Summed over nodes, the increments not yet seen everywhere are ``sum(u_i) <= H * sum(s_i) = H``: the
mesh does not admit more than the limit between gossip rounds, however the load arrives. Shares sum
to 1 and follow demand, so that uneven load is not starved: ``s_i = floor/R + (1 - floor) * d_i /
sum(d)``, d being each live node's attempts (admitted or not) in the sliding window; for its own d_i a
node uses what it last sent in a delta, so that every node computes the shares from the same data
(with no demand known yet, as in a cold burst, the shares are equal). On a relaying mesh the others'
copies of its shard lag by seconds, as its copies of theirs do: there it uses the oldest of the last
``ECHO_KEEP`` states of its own shard the peers relayed back (what they see of its demand), since its
fresh demand against their stale one made each share many times its due (shares summing far above
1). Under-admission stays small because only *unseen* increments are bounded: older admissions are in
the common estimate, so in steady state the lease holds back about ``(1 - s_i) / s_i * u_i`` of
headroom, a fraction of τ/window.
τ may follow the staleness the node observes (``propagation_max``): each shard state carries when
its owner last changed it (its version stamp, ``ratelimit_shards.ver_at``), so a node knows how old
the peers' states it holds are; by symmetry the peers' copies of its own shard are about as old. How
many admissions the held states lack is, per peer, its admission rate times its state's age (the
arrivals after a state are independent of it), so τ is the mean age weighted by what each peer admitted
in the sliding window, per key, within [``propagation``, ``propagation_max``]: in steady state the
lease then bounds the unseen admissions by what the estimate lacks, where a τ below the staleness
over-admits by about (staleness - τ) / window and one above it under-admits as much. The lease
spans that many slots (the designation slots keep the configured τ: every node must compute the same
ones). Where shards come first-hand (not ``relay``: the node's mesh, the simulations) a peer sends
every change to every member as it makes it, so a held state lacks only what its owner changed within
about one delivery delay of now, however long ago it was made (an idle peer's state ages without
lacking anything, a busy one's is replaced within a delay of each change): its age counts up to its
delay (``ratelimit_keys.Arrival``: the arrival minus the stamp of the newest state held; the arrival
is the clock's reading at the merge, or without a clock the next ``now`` this node looks at the key
with). There, with a clock, τ may go below ``propagation``, down to one slot (``propagation /
slots``), but the span reaches back to the node's own oldest change not yet published and, while its
last publication may be in flight (τ and a slot after it), to that publication's oldest change: the
peers lack those whatever their age; and the shares take the node's demand from the publication
before one that may be in flight, as the peers still do. (Issue 24: τ at ``propagation`` made the
lease hold back ~1.4 requests of headroom per node where each admits about one a second, 10% of a
15 s window's limit at any N.) Without a clock a node knows neither when it published nor its delays
closely: τ stays at least ``propagation``. On a relaying mesh a busy peer's states can wait in the
relays' queues for seconds while others arrive, which looks the same as idleness: the ages count in
full there. A stamp further than ``ratelimit_keys.AHEAD_MAX`` ahead of the receiver's clock is not a
time (forged, or a broken clock) and is left out of the ages (read as fresh it shrank τ, and the join
keeps the highest stamp, which would have held that shard's age at 0).

**Fractions of a request.** When a node's lease is less than one request (small limits: with
rpm=60 on 3 nodes a second of headroom is a third of a request each), it may still admit one if
it has nothing unseen and either is the *designated* node of the current slot (weighted rendezvous
hashing of (key, slot) over the live nodes, shares as weights: every node picks the same one; a slot
lasts about the time one request's headroom takes to grow back, at least τ), or wins a coin toss
with probability lease / cost (rates only). Either can exceed the limit by one request at most,
and the sliding window takes it back from the next headroom.

**Concurrency.** The in-flight gauge goes through the same two checks, with ``u`` the node's net
in-flight change over the last τ. At saturation the gauge's headroom is a slot or two, which shares
would split into fractions nobody can use; so a node may also refill, up to its own peak of the last
τ, slots it freed itself: the others still count it at that level unless a gossip round caught the
dip (the simulation measures what that costs: well under 1 % of the limit, time-averaged).

Everything here is pure: time is passed in (``now``, wall-clock seconds the mesh shares), there is
no I/O, and ``RateLimiter`` is the component that ``MeshState`` registers (take_delta / apply_delta /
snapshot / merge_snapshot / digest / diff / on_member_dead; membership through ``update_members``).
With ``LimiterConfig.local`` it is the Redis backend's fallback instead: not gossiped, counting this
node alone against ``limit / N``, charged (``charge``) with what Redis admitted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

from shepherd.mesh.ratelimit_keys import (
    AHEAD_MAX,
    HISTORY,
    U_CONC,
    U_PEAK,
    U_REQ,
    U_TOK,
    Key,
    KeyState,
    Published,
    ShardId,
    View,
    unit_hash,
)
from shepherd.mesh.ratelimit_shards import (
    AREQ,
    ATOK,
    REF,
    REQ,
    TOK,
    W_CUR,
    W_GEN,
    W_PREV,
    W_VER,
    W_WIN,
    Entry,
    entry_from_wire,
    entry_of_wire,
    entry_to_wire,
    join_wire,
    sliding,
    time_of_ver,
    ver_at,
    wait_until_fits,
    window_of,
    wire_entries_ok,
    wire_size,
)

__all__ = ["Counts", "Denial", "Grant", "LimiterConfig", "Limits", "Quota", "RateLimiter", "quota_of"]

Metric = Literal["requests", "tokens", "concurrency"]

_EPS = 1e-9
_VSUM_MOD = 1 << 62
GC_STEP = 32  # keys looked at per admission while a collection round runs
ECHO_KEEP = 8  # echoes of its own shard per key a node keeps (the oldest is its demand in the shares)
MERGE_STEP = 1000  # entries per slice of ``merge_snapshot_steps`` (~1-2 ms of loop time)


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    window: float = 60.0  # seconds; rpm and tpm are per window
    propagation: float = 1.0  # τ: time within which a node's increments reach every live peer
    share_floor: float = 0.2  # part of the headroom split equally, the rest by demand
    slots: int = 8  # τ is tracked in this many slots (the unseen sum covers τ to τ(1 + 1/slots)); first-hand
    # with a clock τ may go down to one (issue 24: 4 slots of 0.25 s held back 3.5% of a 15 s window)
    gc_interval: float = 5.0
    lease: bool = True  # False: the naive rule (estimate + cost <= limit only), for comparison
    relay: bool = False
    """Re-gossip the peers' shards this node learns (``take_keyed_deltas``: one queued delta per shard,
    a newer one replacing the older), for a mesh that relays (not ``first_hand``): epidemic spread
    instead of the owner's piggybacking alone. Off where receivers take only first-hand shards."""
    propagation_max: float = 15.0
    """Above ``propagation``: τ follows the staleness this node observes, within [``propagation``,
    ``propagation_max``]: per key, the age of the peers' shard states it holds (since their owners last
    changed them or, with a clock, published them), averaged weighted by what each peer admitted in the
    sliding window (a peer that admitted nothing lacks nothing); without ``relay`` (first-hand shards), a
    state counts at most as old as its delay (arrival minus stamp: ``ratelimit_keys.Arrival``), and with
    a clock τ may go down to one slot (``propagation / slots``) while covering this node's own changes
    not yet published or maybe in flight. A lease's fraction of a request is admitted with that
    probability (without ``relay``, over the own arrivals expected within τ when fewer than one), and on
    a relaying mesh the shares take this node's demand as it was as old as the held states. 0 (or at
    most ``propagation``): off, τ is ``propagation``."""
    relay_batch: int = 4
    """With ``relay``: peers' shards handed out per ``take_keyed_deltas`` call (one per piggybacked
    packet), at most, so that relays leave room for the other state on the channel (worker adds,
    health); the shards waiting are sent at their newest state when their turn comes."""
    unreachable_grace: float = 300.0
    """Seconds an unreachable member that did not leave keeps counting in N after it was last alive,
    also once SWIM has reaped it: a partitioned side admits its share for that long. A crashed node
    that does not come back lowers the survivors' share as long (a node that leaves gracefully
    stops counting at once)."""
    local: bool = False
    """Count alone: no gossip (the mesh does not register this limiter), live is this node only and N the
    mesh's, so a node admits ``limit / N`` on its own counts: the Redis backend's rule while Redis is
    unreachable (``shepherd.node.api.ratelimit_redis``)."""


@dataclass(frozen=True, slots=True)
class Quota:
    """What the x-ratelimit-* headers report: the most constrained key per metric (None: no limit)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float = 0.0  # seconds until the used part drains at the nominal rate
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Denial:
    key: Key
    metric: Metric
    limit: int
    used: float
    requested: int
    retry_after: float  # seconds; math.inf when the request can never fit (larger than the limit)
    quota: Quota


class Grant:
    """An admitted request; give it back to ``RateLimiter.settle`` exactly once (extra calls are no-ops).
    ``quota()`` is the headers' view right after admission (computed on first use)."""

    __slots__ = ("_quota", "done", "keys", "tokens", "win")

    def __init__(self, keys: tuple[Key, ...], win: int, tokens: int, quota: Callable[[], Quota]) -> None:
        self.keys = keys
        self.win = win
        self.tokens = tokens
        self._quota: Quota | Callable[[], Quota] = quota
        self.done = False

    def quota(self) -> Quota:
        q = self._quota
        if not isinstance(q, Quota):
            q = self._quota = q()
        return q


class Counts(Protocol):
    """A key's counts as the estimate reads them: requests and net tokens, previous and current window."""

    @property
    def req_prev(self) -> float: ...
    @property
    def req_cur(self) -> float: ...
    @property
    def tok_prev(self) -> float: ...
    @property
    def tok_cur(self) -> float: ...


def quota_of(rows: Sequence[tuple[Limits, Counts]], f: float, window: float, scale: float) -> Quota:
    """The x-ratelimit-* view of a request's keys (the most constrained per metric): ``rows`` are each
    key's limits and counts, ``f`` the elapsed fraction of the window, ``scale`` the part of the limit
    this node may admit against (R / N in a mesh; the Redis backend's counts are whole: 1)."""
    req: tuple[int, int, float] | None = None
    tok: tuple[int, int, float] | None = None
    for lim, v in rows:
        if lim.rpm:
            est = sliding(v.req_prev, v.req_cur, f)
            rem = max(0, math.floor(lim.rpm * scale - est + _EPS))
            if req is None or rem < req[1]:
                req = (lim.rpm, rem, max(0.0, est) * window / lim.rpm)
        if lim.tpm:
            est = sliding(v.tok_prev, v.tok_cur, f)
            rem = max(0, math.floor(lim.tpm * scale - est + _EPS))
            if tok is None or rem < tok[1]:
                tok = (lim.tpm, rem, max(0.0, est) * window / lim.tpm)
    q = Quota()
    if req is not None:
        q = Quota(req[0], req[1], req[2])
    if tok is not None:
        q = Quota(q.limit_requests, q.remaining_requests, q.reset_requests, tok[0], tok[1], tok[2])
    return q


def _finite(retry: float, tau: float) -> float:
    """A denial's wait when the request fits the limit (``math.inf`` is for one larger than the limit
    itself, never admitted: ``Denial.retry_after``): a request within the limit but above this node's part
    of it (``limit x reachable / N``: partitioned, or the Redis backend's fallback rule) waits until the
    part grows back (members back, Redis back), not known here: try again after τ."""
    return tau if math.isinf(retry) else retry


def _checked(delta: Any) -> Sequence[Any]:
    """``delta`` if it is a list of well-formed wire entries (``wire_entries_ok``, then item by item if
    that is not sure), else ``ValueError``."""
    if not isinstance(delta, (list, tuple)):
        raise ValueError("rate-limit state: a list of entries expected")
    if not wire_entries_ok(delta):
        for item in delta:
            if entry_from_wire(item) is None:
                raise ValueError(f"rate-limit state: malformed entry {item!r:.200}")
    return delta


class RateLimiter:
    """Mesh-wide admission for one node. ``node`` is its mesh name, ``gen`` distinguishes its process
    incarnations (a restarted node starts a new shard rather than counting again from zero)."""

    def __init__(
        self,
        node: str,
        gen: int,
        config: LimiterConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: the wall clock (seconds), if the owner has one: a published state is then stamped
        with the time it is published (it was this node's state until then), not only with its last
        change's, and a peer's state reads younger by the time between the two."""
        self.node = node
        self.gen = gen
        self.cfg = config or LimiterConfig()
        self.clock = clock
        self.foreign_dropped = 0  # shards of other nodes a sender offered (apply_delta_from)
        self._sid: ShardId = (node, gen)
        self._keys: dict[Key, KeyState] = {}
        self._live: set[str] = {node}
        self._n = 1
        self._members = 1  # N as the mesh last said (``set_membership``)
        self._floor = 1  # the least N (``set_floor``)
        self._unreachable: dict[str, float] = {}  # member not alive (and not left) -> since when
        # members that left the mesh -> since when: what they admitted in the window still counts (a
        # rolling restart's leaving node took its count with it: the others admitted it again), for two
        # windows (their shards count for nothing after that)
        self._left: dict[str, float] = {}
        self._gone: frozenset[str] = frozenset()
        self._epoch = 0  # bumped when what counts changes for every key (membership, generations)
        self._gen_of: dict[str, int] = {node: gen}
        self._ver = 0
        self._dirty: dict[Key, None] = {}  # ordered set of keys whose own entry changed
        self._unstamped: dict[Key, None] = {}  # ... since its last version stamp (``_stamp``)
        # called when the first of them changes after a take: there is a delta to send (the mesh node
        # arms its flush)
        self.on_dirty: Callable[[], None] | None = None
        self._relay: dict[tuple[Key, ShardId], None] = {}  # peers' shards learnt since the last take
        # own attempts as the peers last relayed them back (``relay``), the last ECHO_KEEP per key as
        # (version, attempts): the oldest of them is what the others see of this node's demand, about as
        # stale as its view of theirs; the shares use it rather than ``published``
        self._echoed: dict[Key, deque[tuple[int, Published]]] = {}
        self._slot_len = self.cfg.propagation / self.cfg.slots
        # τ in slots: at least ``slots``; with propagation_max, per key from the held states' ages, up to
        # ``_keep`` (the slots each key's ring keeps); ``_span`` the last one used (``propagation``)
        self._ages = self.cfg.propagation_max > self.cfg.propagation
        self._keep = max(self.cfg.slots, math.ceil(self.cfg.propagation_max / self._slot_len - _EPS))
        self._span = self.cfg.slots
        # a peer's age capped at its delay (``ratelimit_keys.Arrival``) where shards come first-hand: on a
        # relaying mesh a busy peer's states can wait in the relays' queues for seconds while others
        # arrive, which looks the same as idleness, so the ages count in full there
        self._idle_caps = self._ages and not self.cfg.relay
        self._next_gc = -math.inf
        self._gc_queue: list[Key] = []  # keys still to look at in the current collection round

    # ---- membership (the mesh runtime calls these) --------------------------------------------------

    def set_membership(self, live: Iterable[str], cluster_size: int) -> None:
        """``live``: reachable members (self included or not); ``cluster_size``: N, every member that has
        not left, reachable or not."""
        live_set = {*live, self.node}
        self._members = cluster_size
        n = max(cluster_size, len(live_set), self._floor)
        if live_set != self._live or n != self._n:
            self._live, self._n = live_set, n
            self._epoch += 1  # the cached sums of the others' shards are stale

    def set_floor(self, n: int) -> None:
        """N is at least ``n``: the Redis backend's fallback counts the nodes that shared Redis lately,
        also those the mesh does not know (nodes without a mesh, another mesh on the same Redis)."""
        self._floor = max(1, n)
        self.set_membership(self._live, self._members)

    def on_member_dead(self, name: str) -> None:
        if name != self.node:
            self._live.discard(name)
            self._epoch += 1

    def update_members(self, states: Iterable[tuple[str, str]], now: float) -> None:
        """From the mesh's member list as (name, state) pairs, state one of alive / suspect / dead /
        left (``MeshRuntime.members()``): live = alive (a suspect may be partitioned away: counting it
        out at once shortens the time both sides spend the same headroom), N = every member but the
        ones that left, plus the members reaped from the list without leaving that were alive less
        than ``unreachable_grace`` ago (SWIM reaps a dead member after ~30 s; a partition outlasts
        that, and a side that stopped counting the other would admit the whole limit)."""
        live: list[str] = []
        listed: set[str] = set()
        away, left = self._unreachable, self._left
        for name, state in states:
            if state == "left":
                away.pop(name, None)
                if name != self.node:
                    left.setdefault(name, now)
                continue
            listed.add(name)
            left.pop(name, None)
            if state == "alive":
                live.append(name)
                away.pop(name, None)
            else:
                away.setdefault(name, now)
        grace = self.cfg.unreachable_grace
        for name in [m for m, since in away.items() if m not in listed and now - since > grace]:
            del away[name]
        for name in [m for m, since in left.items() if now - since > 2 * self.cfg.window]:
            del left[name]
        gone = frozenset(left)
        if gone != self._gone:
            self._gone = gone
            self._epoch += 1  # the cached sums of the others' shards are stale
        self.set_membership(
            () if self.cfg.local else live, len(listed) + sum(1 for m in away if m not in listed)
        )

    @property
    def propagation(self) -> float:
        """τ as the lease last used it (``LimiterConfig.propagation``, or derived from the held states'
        ages: see ``propagation_max``), rounded up to whole slots."""
        return self._span * self._slot_len

    def _span_of(self, v: View, now: float, ks: KeyState | None = None) -> int:
        """τ in slots for a key (``propagation_max``: from the age of the peers' states held). Where
        shards come first-hand and this node has a clock, their ages count up to their delays and τ may
        go down to one slot (below ``propagation``), as long as it still covers this node's own changes
        the peers may lack: back to its oldest change not yet published (``ks.pending``), and to the
        oldest one of its last publication while that may be in flight (``ks.sent_at``: within τ and a
        slot), up to the configured τ. (Without a clock a node does not know when it published, and its
        delays are measured late: τ stays at least ``propagation`` there.) A concurrency gauge's refill
        looks back over ``propagation`` at least whatever this τ (``acquire``)."""
        if not self._ages:
            return self.cfg.slots
        age = v.age(now)
        span = self.cfg.slots
        if age is not None:
            sl = self._slot_len
            # the ring covers ``span`` slots and the current one's elapsed part: age on average
            aged = math.floor(age / sl + _EPS)
            least = span
            if self._idle_caps and self.clock is not None:
                oldest = math.inf if ks is None else ks.pending
                if ks is not None:
                    ks.flight = (max(1, aged) + 1) * sl  # how long a publication may be in flight
                    if now - ks.sent_at <= ks.flight:
                        oldest = min(oldest, ks.sent_oldest)
                least = 1
                if oldest < now:
                    least = max(1, min(span, math.floor(now / sl) - math.floor(oldest / sl)))
            span = min(self._keep, max(least, aged))
        self._span = span
        return span

    @property
    def reachable(self) -> int:
        return len(self._live)

    @property
    def cluster_size(self) -> int:
        return self._n

    # ---- admission ----------------------------------------------------------------------------------

    def acquire(self, now: float, rules: Sequence[tuple[Key, Limits]], tokens: int) -> Grant | Denial:
        """Admit one request costing ``tokens`` (reserved) under every rule, or say why not."""
        if self._gc_queue or now >= self._next_gc:
            self._gc_step(now)
        w, f = window_of(now, self.cfg.window)
        slot = math.floor(now / self._slot_len)
        scale = len(self._live) / self._n
        views: list[tuple[Key, Limits, KeyState, View]] = []
        denial: tuple[Key, Metric, int, float, float] | None = None
        for key, lim in rules:
            ks = self._keys.get(key)
            if ks is None:
                ks = self._keys[key] = KeyState()
            v = self._view(key, ks, w, f)
            views.append((key, lim, ks, v))
            if denial is None:
                span = self._span_of(v, now, ks)
                u = ks.unseen(slot, span, self._keep)
                if lim.max_concurrent is not None and span < self.cfg.slots:
                    # the gauge's refill (a slot this node freed itself taken back) looks back over
                    # ``propagation`` at least, as before τ could go below it: its next arrival comes
                    # about a second after a settle at a few admissions a second, past a first-hand τ
                    # of a slot or two (which cut the mean in flight from 0.89-0.97 to ~0.51 of the
                    # limit on a real 15-node mesh)
                    u[U_PEAK] = ks.unseen(slot, self.cfg.slots, self._keep)[U_PEAK]
                denial = self._check(key, lim, ks, v, u, tokens, scale, now, f)
        if denial is not None:
            for key, _, ks, _ in views:
                self._record(key, ks, w, slot, now, admitted=False, tokens=tokens)
            key, metric, limit, used, retry = denial
            requested = tokens if metric == "tokens" else 1
            return Denial(key, metric, limit, used, requested, retry, self._quota(views, f))
        for key, _, ks, v in views:
            self._record(key, ks, w, slot, now, admitted=True, tokens=tokens)
            v.req_cur += 1
            v.tok_cur += tokens
        return Grant(tuple(k for k, *_ in views), w, tokens, partial(self._quota, views, f))

    def charge(self, now: float, rules: Sequence[tuple[Key, Limits]], tokens: int) -> Grant:
        """Count an admission decided elsewhere (the Redis backend's store) in this node's own shard,
        unchecked: what the node admitted stays in its count, which the ``local`` fallback rule admits
        against. ``settle`` it like a grant of ``acquire`` (its ``quota`` is this node's view)."""
        if self._gc_queue or now >= self._next_gc:
            self._gc_step(now)
        w, f = window_of(now, self.cfg.window)
        slot = math.floor(now / self._slot_len)
        views: list[tuple[Key, Limits, KeyState, View]] = []
        for key, lim in rules:
            ks = self._keys.get(key)
            if ks is None:
                ks = self._keys[key] = KeyState()
            self._record(key, ks, w, slot, now, admitted=True, tokens=tokens)
            views.append((key, lim, ks, self._view(key, ks, w, f)))
        return Grant(tuple(k for k, *_ in views), w, tokens, partial(self._quota, views, f))

    def settle(self, now: float, grant: Grant, real_tokens: int | None) -> None:
        """The request ended (done, failed or disconnected): release its concurrency slot and replace the
        reservation by ``real_tokens`` (None: keep the reservation)."""
        if grant.done:
            return
        grant.done = True
        w, _ = window_of(now, self.cfg.window)
        slot = math.floor(now / self._slot_len)
        for key in grant.keys:
            ks = self._keys.get(key)
            e = ks.shards.get(self._sid) if ks is not None else None
            if ks is None or e is None:
                continue
            if w > e.win:
                e.roll(w)
            e.dec += 1
            dt = 0
            if real_tokens is not None:
                diff = real_tokens - grant.tokens
                if diff > 0:
                    e.cur[TOK] += diff
                    dt = diff
                elif diff < 0 and grant.win == e.win:
                    e.cur[REF] -= diff
                    dt = diff
                elif diff < 0 and grant.win == e.win - 1:
                    e.prev[REF] -= diff
                    dt = diff
            self._touch(key, ks, now)
            ks.ring_add(slot, 0, dt, -1, e.inc - e.dec + 1)

    def quota(self, now: float, rules: Sequence[tuple[Key, Limits]]) -> Quota:
        """The headers' view without admitting anything."""
        w, f = window_of(now, self.cfg.window)
        views = []
        for key, lim in rules:
            ks = self._keys.get(key) or KeyState()
            views.append((key, lim, ks, self._view(key, ks, w, f)))
        return self._quota(views, f)

    # ---- the rule -----------------------------------------------------------------------------------

    def _check(
        self,
        key: Key,
        lim: Limits,
        ks: KeyState,
        v: View,
        u: list[int],
        tokens: int,
        scale: float,
        now: float,
        f: float,
    ) -> tuple[Key, Metric, int, float, float] | None:
        win, tau = self.cfg.window, self.cfg.propagation
        if lim.rpm is not None:
            est = sliding(v.req_prev, v.req_cur, f)
            limit = lim.rpm * scale
            dslot = math.floor(now / max(tau, win / max(limit, _EPS)))
            verdict = self._fits(key, dslot, est, u[U_REQ], limit, 1, v, 0)
            if verdict:
                retry = wait_until_fits(v.req_prev, v.req_cur, f, win, limit, 1) if verdict == 1 else tau
                return key, "requests", lim.rpm, est, _finite(retry, tau)
        if lim.tpm is not None:
            est = sliding(v.tok_prev, v.tok_cur, f)
            if tokens > lim.tpm:
                return key, "tokens", lim.tpm, est, math.inf
            limit = lim.tpm * scale
            dslot = math.floor(now / max(tau, win * tokens / max(limit, _EPS)))
            verdict = self._fits(key, dslot, est, u[U_TOK], limit, tokens, v, 1)
            if verdict:
                retry = wait_until_fits(v.tok_prev, v.tok_cur, f, win, limit, tokens) if verdict == 1 else tau
                return key, "tokens", lim.tpm, est, _finite(retry, tau)
        if lim.max_concurrent is not None:
            limit = lim.max_concurrent * scale
            verdict = self._fits(key, math.floor(now / tau), v.conc, u[U_CONC], limit, 1, v, 0, rate=False)
            if verdict == 2 and v.own_level + 1 <= max(v.own_level - u[U_CONC], u[U_PEAK]):
                verdict = 0  # refilling a slot this node itself freed within τ
            if verdict:
                return key, "concurrency", lim.max_concurrent, float(v.conc), tau
        return None

    def _fits(
        self,
        key: Key,
        dslot: int,
        est: float,
        u: float,
        limit: float,
        cost: float,
        v: View,
        m: int,
        rate: bool = True,
    ) -> int:
        """0: admit; 1: the mesh-wide count is full; 2: this node's lease is spent for now. ``dslot``
        numbers the designation slot (about the time one request's worth of headroom takes to grow
        back, at least τ)."""
        if est + cost > limit + _EPS:
            return 1
        if not self.cfg.lease:
            return 0
        total = v.total_demand(m)
        budget = self._share(v, m, self.node, total) * (limit - est + u)
        if u + cost <= budget + _EPS:
            return 0
        if u <= 0 and self._designated(key, dslot, v, m, total):
            return 0
        if rate and u <= 0 and 0 < budget < cost and unit_hash(self.node, self._ver) < budget / cost:
            return 0  # a fraction of a request: admitted with that probability (rates only)
        if rate and self._ages and u < budget < u + cost:
            # the lease's fraction left: the unseen sum meets the budget on average, not below it. The
            # budget is per τ: with fewer than one own arrival expected within τ (first-hand shards, τ
            # from their delays) each arrival's chance is the fraction over the arrivals expected
            p = (budget - u) / cost
            if self._idle_caps:
                n = v.own_areq / self.cfg.window * (self._span + 0.5) * self._slot_len
                if n < 1.0:
                    p = p / n if n > p else 1.0
            if unit_hash(self.node, self._ver) < p:
                return 0
        return 2

    def _share(self, v: View, m: int, node: str, total: float) -> float:
        r = len(self._live)
        if total <= 0:
            return 1.0 / r
        a = self.cfg.share_floor
        return a / r + (1.0 - a) * v.demand(node, self.node, m) / total

    def _designated(self, key: Key, slot: int, v: View, m: int, total: float) -> bool:
        best, best_score = self.node, -math.inf
        for node in sorted(self._live):
            score = -self._share(v, m, node, total) / math.log(unit_hash(key[0], key[1], slot, node))
            if score > best_score:
                best, best_score = node, score
        return best == self.node

    # ---- counting -----------------------------------------------------------------------------------

    def _view(self, key: Key, ks: KeyState, w: int, f: float) -> View:
        o = ks.others
        win = self.cfg.window
        now = (w + f) * win
        if o is None or o.w != w or o.epoch != self._epoch or now > o.until:
            o = ks.sum_others(
                w, self._epoch, self._live, self._gen_of, self._sid, win, now, self._idle_caps, self._gone
            )
            ks.others = o
        pub = ks.published
        made = o.made(1.0 - f, now) if self._ages and self.cfg.relay and ks.history else None
        if made is not None:  # relaying: own demand as old as the others' states held, shares sum to ~1
            for t, p in reversed(ks.history):
                pub = p
                if t <= made:
                    break
        else:
            echoes = self._echoed.get(key)
            echo = min(echoes)[1] if echoes else None
            if echo is not None and (pub is None or echo[0] <= pub[0]):
                pub = echo  # own demand as stale as the others' (a relaying mesh): shares sum to ~1
            elif self._idle_caps and now - ks.sent_at <= ks.flight:
                # first-hand: the last publication may be in flight, the peers' shares still take the one
                # before it: so does this node's (its fresher demand would give it more than its due)
                pub = ks.published_before
        return View(o, ks.shards.get(self._sid), pub, w, f)

    def _record(
        self, key: Key, ks: KeyState, w: int, slot: int, now: float, *, admitted: bool, tokens: int
    ) -> None:
        e = ks.shards.get(self._sid)
        if e is None:
            self._ver += 1
            e = ks.shards[self._sid] = Entry(born=self._ver, win=w)
        elif w > e.win:
            e.roll(w)
        c = e.cur
        c[AREQ] += 1
        c[ATOK] += tokens
        if admitted:
            c[REQ] += 1
            c[TOK] += tokens
            e.inc += 1
            ks.ring_add(slot, 1, tokens, 1, e.inc - e.dec - 1)
        self._touch(key, ks, now)

    def _touch(self, key: Key, ks: KeyState, now: float) -> None:
        """The own entry of ``key`` changed at ``now``: it is stamped when it is published
        (``take_delta``)."""
        self._ver += 1  # (operations: the coin tosses' input)
        ks.changed = now
        if key not in self._dirty:
            ks.pending = now
        self._unstamped[key] = None
        if not self._dirty and self.on_dirty is not None:
            self.on_dirty()
        self._dirty[key] = None

    def _quota(self, views: list[tuple[Key, Limits, KeyState, View]], f: float) -> Quota:
        return quota_of([(lim, v) for _, lim, _, v in views], f, self.cfg.window, len(self._live) / self._n)

    # ---- memory -------------------------------------------------------------------------------------

    def gc(self, now: float) -> None:
        """Drop shards that no longer count (windows older than the previous one, and nothing in flight
        or of a node that is not live or was restarted) and keys left empty: a full round now.
        ``acquire`` does the same in steps of ``GC_STEP`` keys, one round every ``gc_interval``."""
        self._gc_queue = list(self._keys)
        self._next_gc = now + self.cfg.gc_interval
        while self._gc_queue:
            self._gc_step(now)

    def _gc_step(self, now: float) -> None:
        if not self._gc_queue:
            self._gc_queue = list(self._keys)
            self._next_gc = now + self.cfg.gc_interval
        w, _ = window_of(now, self.cfg.window)
        slot = math.floor(now / self._slot_len)
        for _ in range(min(GC_STEP, len(self._gc_queue))):
            key = self._gc_queue.pop()
            ks = self._keys.get(key)
            if ks is None:
                continue
            for sid in list(ks.shards):
                e = ks.shards[sid]
                if e.win >= w - 1:
                    continue
                node, gen = sid
                stale = node not in self._live or gen != self._gen_of.get(node, gen)
                if e.inc == e.dec or (stale and sid != self._sid):
                    del ks.shards[sid]
                    ks.arrivals.pop(sid, None)
                    ks.others = None
            ks.unseen(slot, self.cfg.slots, self._keep)
            if not ks.shards and not ks.recent:
                del self._keys[key]
                self._dirty.pop(key, None)
                self._echoed.pop(key, None)
        if not self._gc_queue:  # the round is over: forget generations of nodes gone everywhere
            known = {node for ks in self._keys.values() for node, _ in ks.shards}
            for node in list(self._gen_of):
                if node != self.node and node not in known and node not in self._live:
                    del self._gen_of[node]

    def key_count(self) -> int:
        return len(self._keys)

    def shard_version(self, key: Key, node: str) -> int:
        """The highest version held of ``node``'s shard of ``key`` (0: none), e.g. to measure staleness."""
        ks = self._keys.get(key)
        if ks is None:
            return 0
        return max((e.ver for (nd, _), e in ks.shards.items() if nd == node), default=0)

    def shard_time(self, key: Key, node: str) -> float | None:
        """When ``node`` last changed the newest state held of its shard of ``key`` (its version stamp,
        ``time_of_ver``; None: none held), e.g. to measure staleness."""
        ks = self._keys.get(key)
        if ks is None:
            return None
        held = [(e.ver, gen) for (nd, gen), e in ks.shards.items() if nd == node and e.ver > 0]
        return time_of_ver(*max(held)) if held else None

    # ---- gossip (the MeshState component interface) -------------------------------------------------

    def take_delta(self, max_bytes: int = 900) -> list[list[Any]] | None:
        """This node's changed entries since the last call, as a msgpack-able list of at most about
        ``max_bytes`` encoded (the rest stay for the next call); None when nothing changed."""
        out: list[list[Any]] = []
        size = 5
        while self._dirty:
            key = next(iter(self._dirty))
            ks = self._keys.get(key)
            e = ks.shards.get(self._sid) if ks is not None else None
            if e is None:
                del self._dirty[key]
                continue
            assert ks is not None
            self._stamp(key, ks, e)
            item = entry_to_wire(key[0], key[1], self.node, self.gen, e)
            n = wire_size(item)
            if out and size + n > max_bytes:
                break
            del self._dirty[key]
            if self.clock is not None:  # (in flight from now: ``_span_of``)
                ks.sent_at, ks.sent_oldest = self.clock(), min(ks.pending, ks.changed)
            ks.pending = math.inf
            out.append(item)
            size += n
            ks.published_before = ks.published
            ks.published = (e.win, e.prev[AREQ], e.cur[AREQ], e.prev[ATOK], e.cur[ATOK])
            if self._ages and self.cfg.relay:
                h, t = ks.history, ks.changed
                if len(h) >= HISTORY:  # full: every other one goes (the span covered stays)
                    ks.history = h = deque(list(h)[1::2])
                h.append((t, ks.published))
                while len(h) > 1 and h[1][0] <= t - self.cfg.propagation_max:
                    h.popleft()
        return out or None

    @property
    def keyed_gossip(self) -> bool:
        """``MeshState`` queues this component's deltas by ``take_keyed_deltas`` (``relay``)."""
        return self.cfg.relay

    def take_keyed_deltas(self, limit: int = 256) -> list[tuple[str, list[list[Any]]]]:
        """With ``relay``: this node's changed shards and the peers' shards it learnt since the last
        call, one (queue key, delta of one entry) per shard, at most ``limit``: the state layer queues
        each under its key, so a newer state of a shard replaces the older one still queued (a shard's
        state includes every earlier change: nothing is lost by dropping the older)."""
        out: list[tuple[str, list[list[Any]]]] = []
        while self._dirty and len(out) < limit:
            d = self.take_delta(0)  # one entry
            if d is None:
                break
            out.append((f"{d[0][0]}/{d[0][1]}/{self.node}", d))
        limit = min(limit, len(out) + self.cfg.relay_batch)
        while self._relay and len(out) < limit:
            key, sid = next(iter(self._relay))
            del self._relay[(key, sid)]
            ks = self._keys.get(key)
            e = ks.shards.get(sid) if ks is not None else None
            if e is not None:
                item = entry_to_wire(key[0], key[1], sid[0], sid[1], e)
                out.append((f"{key[0]}/{key[1]}/{sid[0]}", [item]))
        return out

    def apply_delta(self, delta: Any) -> None:
        """Merge entries from a peer (a delta, a snapshot or a diff alike). The whole input is validated
        first: anything malformed raises ``ValueError`` and nothing is merged."""
        self._merge_items(_checked(delta))

    def apply_delta_from(self, delta: Any, source: str) -> None:
        """``apply_delta`` of what ``source`` (the verified sender) sent, keeping only its own shards:
        a node's shard is written by that node alone, so nobody else may speak for it."""
        self._merge_items(self._own_of(_checked(delta), source))

    def merge_snapshot_from(self, snapshot: Any, source: str) -> None:
        self.apply_delta_from(snapshot, source)

    def merge_snapshot_steps(self, snapshot: Any, source: str = "", step: int = MERGE_STEP) -> Iterator[None]:
        """``merge_snapshot`` (``merge_snapshot_from(snapshot, source)`` if ``source``) in slices of
        ``step`` entries, yielding between them, for a caller that lets its event loop run meanwhile (a
        joining node's push-pull carries every shard of the mesh: 4,000 at N = 200 with 20 tenants).
        The whole input is validated first (in slices too): anything malformed raises ``ValueError``
        and nothing is merged. Whatever runs between two slices (admissions, deltas, other merges),
        the result is the same: each slice merges as a delta of its own would, and joins commute."""
        if not isinstance(snapshot, (list, tuple)):
            raise ValueError("rate-limit state: a list of entries expected")
        step = max(1, step)
        for i in range(0, len(snapshot), step):
            if i:
                yield
            _checked(snapshot[i : i + step])
        items = self._own_of(snapshot, source) if source else snapshot
        for i in range(0, len(items), step):
            yield
            self._merge_items(items[i : i + step])

    def _own_of(self, items: Sequence[Any], source: str) -> list[Any]:
        """The items ``source`` may speak for: its own shards, and this node's shards of its earlier
        process generations (a restarted node: nobody writes them any more and only the peers hold
        them; without them it would admit again what its previous process admitted in the window, while
        the peers still count it). A peer could inflate its own shard as much: taking these gives it no
        more say."""
        me, my_gen = self.node, self.gen
        own = [item for item in items if item[2] == source or (item[2] == me and item[W_GEN] < my_gen)]
        self.foreign_dropped += len(items) - len(own)
        return own

    def _merge_items(self, items: Iterable[Sequence[Any]]) -> None:
        """Merge wire entries that passed the checks (``_checked``): a held shard is joined in place
        (``join_wire``: no entry decoded), one not held is decoded once."""
        me, my_gen, relay, keys = self.node, self.gen, self.cfg.relay, self._keys
        caps, clock = self._idle_caps, self.clock
        arrival: float | None = None
        for item in items:
            node, gen = item[2], item[W_GEN]
            key = (item[0], item[1])
            if node == me and gen >= my_gen:
                if gen == my_gen:
                    ver = item[W_VER]
                    if relay:
                        echoes = self._echoed.get(key)
                        if echoes is None:
                            echoes = self._echoed[key] = deque(maxlen=ECHO_KEEP)
                        pub = (
                            item[W_WIN],
                            item[W_PREV + AREQ],
                            item[W_CUR + AREQ],
                            item[W_PREV + ATOK],
                            item[W_CUR + ATOK],
                        )
                        echoes.append((ver, pub))
                continue  # my own shard: I am its only writer
            if gen > self._gen_of.get(node, -1):
                self._gen_of[node] = gen
                self._epoch += 1
            ks = keys.get(key)
            if ks is None:
                ks = keys[key] = KeyState()
            sid = (node, gen)
            old = ks.shards.get(sid)
            if old is None:
                old = ks.shards[sid] = entry_of_wire(item)
                advanced = True
            else:
                ver = old.ver
                if not join_wire(old, item):
                    continue  # nothing new: the cached sums still hold
                advanced = old.ver > ver
            if advanced and caps and clock is not None:  # the arrival, as precise as the clock
                if arrival is None:
                    arrival = clock()
                made = time_of_ver(old.ver, gen)
                # a time (not an earlier build's counter, nor a stamp ahead of any clock skew)
                if (old.win - 1) * self.cfg.window <= made <= arrival + AHEAD_MAX:
                    ks.note_arrival(sid, old.ver, min(made, arrival), arrival)
            if relay and advanced:
                self._relay[(key, sid)] = None
            ks.others = None

    def _stamp(self, key: Key, ks: KeyState, e: Entry) -> None:
        """Give the own entry of ``key`` its version stamp if it changed since the last one: the time of
        its last change (``ver_at``), above the previous stamp. Every way the entry leaves this node
        (a delta, a snapshot, a digest) stamps it first."""
        if key in self._unstamped:
            del self._unstamped[key]
            t = ks.changed if self.clock is None else max(ks.changed, self.clock())
            e.ver = max(e.ver + 1, ver_at(t, self.gen))

    def _stamp_all(self) -> None:
        for key in list(self._unstamped):
            ks = self._keys.get(key)
            e = ks.shards.get(self._sid) if ks is not None else None
            if ks is None or e is None:
                del self._unstamped[key]
            else:
                self._stamp(key, ks, e)

    def snapshot(self) -> list[list[Any]]:
        """Every entry this node holds (its own and what it learnt), for a push-pull full sync."""
        self._stamp_all()
        return [
            entry_to_wire(key[0], key[1], node, gen, e)
            for key, ks in self._keys.items()
            for (node, gen), e in ks.shards.items()
        ]

    def own_snapshot(self) -> list[list[Any]]:
        """This node's own shards only: what a push-pull request carries (the reply, by digest, the
        rest; a peer with ``first_hand`` takes nothing else from this node anyway)."""
        self._stamp_all()
        return [
            entry_to_wire(key[0], key[1], node, gen, e)
            for key, ks in self._keys.items()
            for (node, gen), e in ks.shards.items()
            if node == self.node
        ]

    def merge_snapshot(self, snapshot: Any) -> None:
        self.apply_delta(snapshot)

    def digest(self) -> list[list[Any]]:
        """Per shard held: [node, gen, highest version, entry count, sum of versions], for anti-entropy."""
        self._stamp_all()
        top: dict[ShardId, list[int]] = {}
        for ks in self._keys.values():
            for sid, e in ks.shards.items():
                row = top.get(sid)
                if row is None:
                    row = top[sid] = [0, 0, 0]
                row[0] = max(row[0], e.ver)
                row[1] += 1
                row[2] = (row[2] + e.ver) % _VSUM_MOD
        return [[node, gen, *row] for (node, gen), row in top.items()]

    def diff(self, remote_digest: Any) -> list[list[Any]]:
        """The entries of every shard whose summary differs from the peer's ``remote_digest``: a lost
        delta leaves a hole that changes the entry count or the version sum, not only the top version."""
        have: dict[ShardId, tuple[int, int, int]] = {}
        if isinstance(remote_digest, (list, tuple)):
            for row in remote_digest:
                if isinstance(row, (list, tuple)) and len(row) == 5:
                    node, gen, *nums = row
                    if isinstance(node, str) and type(gen) is int and all(type(x) is int for x in nums):
                        have[(node, gen)] = (nums[0], nums[1], nums[2])
        mine = {(node, gen): (top, n, vsum) for node, gen, top, n, vsum in self.digest()}
        stale = {sid for sid, summary in mine.items() if have.get(sid) != summary}
        return [
            entry_to_wire(key[0], key[1], node, gen, e)
            for key, ks in self._keys.items()
            for (node, gen), e in ks.shards.items()
            if (node, gen) in stale
        ]

    def entries(self) -> dict[tuple[Key, ShardId], Entry]:
        """A copy of the CRDT state (for tests and /mesh/state)."""
        return {(key, sid): e.copy() for key, ks in self._keys.items() for sid, e in ks.shards.items()}
