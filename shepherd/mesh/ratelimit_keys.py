"""Per-key bookkeeping of ``shepherd.mesh.ratelimit``: the shards of one limit key, the cached sum of the
other nodes' shards, this node's unseen-changes ring, and the view the admission rule reads."""

from __future__ import annotations

import hashlib
import math
from collections import deque

from shepherd.mesh.ratelimit_shards import AREQ, ATOK, REF, REQ, TOK, Entry, time_of_ver

Key = tuple[str, str]  # (tenant, model); model "" = all of the tenant's models
ShardId = tuple[str, int]  # (node name, process generation)

# columns of KeyState.unseen()
U_REQ, U_TOK, U_CONC, U_PEAK = 1, 2, 3, 4

Published = tuple[int, int, int, int, int]  # window, req attempts prev, cur, token attempts prev, cur
HISTORY = 256  # own published attempts a key keeps (``KeyState.history``)
AHEAD_MAX = 1.0  # seconds a stamp may read ahead of the receiver's clock (skew) and still be a time


class Others:
    """The sum of the live shards of one key other than this process's own, in one window. It changes at
    gossip rate, so it is cached until a merge touches the key, membership changes, the window moves or
    ``until`` passes. ``at_*``/``n_*``: the times the held states were last changed (or published) by
    their owners (``time_of_ver``), summed weighted by each state's admitted requests (``n_*`` the
    weights), previous and current window; ``cap_*``/``m_*`` the same for the states held longer than
    their owner's usual interval (``Arrival.cap``: an idle owner, not a slow channel), by their capped
    age: the admission-weighted mean age of what this node holds (``View.age``). ``until``: when the
    first of the others' states reaches its cap (the sums are recomputed then)."""

    __slots__ = (
        "at_cur",
        "at_prev",
        "cap_cur",
        "cap_prev",
        "conc",
        "demand",
        "epoch",
        "m_cur",
        "m_prev",
        "n_cur",
        "n_prev",
        "req_cur",
        "req_prev",
        "tok_cur",
        "tok_prev",
        "until",
        "w",
    )

    def __init__(self, w: int, epoch: int) -> None:
        self.w = w
        self.epoch = epoch
        self.req_prev = self.req_cur = self.tok_prev = self.tok_cur = 0
        self.conc = 0
        self.demand: dict[str, list[int]] = {}  # node -> [req attempts prev, cur, token attempts prev, cur]
        self.at_prev = self.at_cur = self.cap_prev = self.cap_cur = 0.0
        self.n_prev = self.n_cur = self.m_prev = self.m_cur = 0
        self.until = math.inf

    def made(self, pw: float, now: float) -> float | None:
        """When the held states were made, on average weighted by admissions (``pw``: the previous
        window's weight), a state held past its cap counting as made its cap before ``now``; None when
        the others admitted nothing."""
        n = self.n_prev * pw + self.n_cur
        m = self.m_prev * pw + self.m_cur
        if n + m <= 0:
            return None
        return (self.at_prev * pw + self.at_cur + m * now - (self.cap_prev * pw + self.cap_cur)) / (n + m)


class Arrival:
    """When this node got the newest state it holds of a peer's shard (``at``) and how old that state was
    then (``delay``: arrival minus its stamp, the channel's delay, which does not grow while the peer is
    idle). Where shards come first-hand every change a peer makes is sent to every member at once, so a
    held state lacks only the changes made within about one ``delay`` of ``now`` (later ones would have
    arrived): its age counts up to ``cap`` = ``delay``, however long the peer stays silent (idle, its load
    moved away) or busy. (``delay`` is this state's own, not an average: one newer state may come seconds
    later than the last, and its whole delay counts.)"""

    __slots__ = ("at", "delay", "ver")

    def __init__(self, ver: int, at: float, delay: float) -> None:
        self.ver, self.at, self.delay = ver, at, delay

    @property
    def cap(self) -> float:
        return self.delay

    def newer(self, ver: int, at: float, made: float) -> None:
        """A newer state (``ver``, stamped ``made``) arrived at ``at``."""
        self.delay = max(at - made, 0.0)
        self.ver, self.at = ver, at


class KeyState:
    """Everything one node holds for one key."""

    __slots__ = (
        "arrivals",
        "changed",
        "flight",
        "history",
        "others",
        "pending",
        "published",
        "published_before",
        "recent",
        "sent_at",
        "sent_oldest",
        "shards",
    )

    def __init__(self) -> None:
        # when the newest state held of each peer's shard arrived (τ from the ages, ``propagation_max``)
        self.arrivals: dict[ShardId, Arrival] = {}
        self.changed = 0.0  # when this node last changed its own entry (its version stamp at publication)
        self.pending = math.inf  # when its oldest change not yet published was made (inf: none)
        # when it last published its entry (with a clock) and the oldest change that publication carried
        self.sent_at = -math.inf
        self.sent_oldest = math.inf
        self.flight = 0.0  # how long its last publication may be in flight (``RateLimiter._span_of``)
        # own attempts as published, with the time of their last change, for τ from the ages
        # (``LimiterConfig.propagation_max``; HISTORY at most, thinned out): the shares take the one as old
        # as the others' states
        self.history: deque[tuple[float, Published]] = deque()
        self.shards: dict[ShardId, Entry] = {}
        self.recent: deque[list[int]] = deque()  # own changes per time slot: [slot, req, tok, conc, peak]
        self.others: Others | None = None
        # own attempts as last sent in a delta: what the others know of this node's demand, so that
        # every node computes the shares from the same data
        self.published: Published | None = None
        self.published_before: Published | None = None  # the publication before (first-hand, with a clock)

    def sum_others(
        self,
        w: int,
        epoch: int,
        live: set[str],
        gen_of: dict[str, int],
        me: ShardId,
        window: float = 60.0,
        now: float = 0.0,
        caps: bool = False,
        gone: frozenset[str] = frozenset(),
    ) -> Others:
        """The sums of the live others' shards in window ``w``; ``window`` (seconds) and ``now`` for the
        ages (a state stamped a little later than ``now``, within ``AHEAD_MAX``: clock skew, counts as
        fresh; one stamped before the window before its own is not a time, e.g. an earlier build's
        counter, and is left out of the ages). A stamp further ahead is not a time either (forged, or a
        broken clock) and is left out too: read as fresh it would shrink τ, and the join keeps the highest
        stamp, so its age would stay 0 while it is held, whatever the owner sends later. ``caps``
        (first-hand shards): a state's age counts up to its delay (``Arrival``); a state
        newer than the arrival held is taken as arriving at ``now`` unless the merge noted it
        (``note_arrival``, with a clock). ``gone``: members that left the mesh lately: what they admitted
        in the window still counts (requests and tokens; no gauge, ages or demand: they admit no more)."""
        o = Others(w, epoch)
        arrivals = self.arrivals
        for sid, e in self.shards.items():
            node, gen = sid
            if node not in live or sid == me:
                if node in gone and sid != me:
                    p, c = e.aligned(w)
                    o.req_prev += p[REQ]
                    o.req_cur += c[REQ]
                    o.tok_prev += p[TOK] - p[REF]
                    o.tok_cur += c[TOK] - c[REF]
                continue
            p, c = e.aligned(w)
            o.req_prev += p[REQ]
            o.req_cur += c[REQ]
            o.tok_prev += p[TOK] - p[REF]
            o.tok_cur += c[TOK] - c[REF]
            if gen == gen_of.get(node, gen):  # the gauge of a restarted node's old process is gone
                o.conc += e.inc - e.dec
                t = time_of_ver(e.ver, gen)
                if e.ver > 0 and t > now + AHEAD_MAX:  # not a time (yet: a skewed clock's stamp becomes one)
                    o.until = min(o.until, t - AHEAD_MAX)
                elif e.ver > 0 and t >= (e.win - 1) * window:
                    t = min(t, now)
                    cap = math.inf
                    if caps:
                        a = arrivals.get(sid)
                        if a is None or a.ver != e.ver:
                            a = self.note_arrival(sid, e.ver, t, now)
                        cap = a.cap
                    if now - t <= cap:
                        o.at_prev += p[REQ] * t
                        o.at_cur += c[REQ] * t
                        o.n_prev += p[REQ]
                        o.n_cur += c[REQ]
                        if p[REQ] or c[REQ]:
                            o.until = min(o.until, t + cap)
                    else:  # held past its cap: its age stops there
                        o.cap_prev += p[REQ] * cap
                        o.cap_cur += c[REQ] * cap
                        o.m_prev += p[REQ]
                        o.m_cur += c[REQ]
            d = o.demand.get(node)
            if d is None:
                d = o.demand[node] = [0, 0, 0, 0]
            d[0] += p[AREQ]
            d[1] += c[AREQ]
            d[2] += p[ATOK]
            d[3] += c[ATOK]
        return o

    def note_arrival(self, sid: ShardId, ver: int, made: float, at: float) -> Arrival:
        """A state of ``sid``'s shard stamped ``ver`` (made at ``made``) arrived at ``at``."""
        a = self.arrivals.get(sid)
        if a is None:
            a = self.arrivals[sid] = Arrival(ver, at, max(at - made, 0.0))
        elif ver > a.ver:
            a.newer(ver, at, made)
        else:  # a new incarnation's entry (its stamps restart lower)
            a.ver = ver
        return a

    def unseen(self, slot: int, span: int, keep: int = 0) -> list[int]:
        """Own net changes over the last ``span`` slots (req, tok, conc at U_REQ..U_CONC) and the own
        in-flight peak over them (at U_PEAK); slots older than ``max(span, keep)`` are forgotten (``keep``:
        the longest span a later call may ask for). Summed from the newest slot back: a short span (τ
        from first-hand delays, a slot or two) costs as many rows, whatever the ring keeps."""
        ring = self.recent
        oldest = slot - max(span, keep)
        while ring and ring[0][0] < oldest:
            ring.popleft()
        first = slot - span
        req = tok = conc = peak = 0
        for row in reversed(ring):
            if row[0] < first:  # kept for a longer span, not in this one
                break
            req += row[1]
            tok += row[2]
            conc += row[3]
            if row[4] > peak:
                peak = row[4]
        return [0, req, tok, conc, peak]

    def ring_add(self, slot: int, req: int, tok: int, conc: int, level: int) -> None:
        """Add own changes to the current slot; ``level`` is the in-flight count before the change (the
        slot keeps the peak, for refills). A slot before the newest row's (a clock stepped back) adds to
        that row: the ring stays in order, and the change counts as unseen for longer, not shorter."""
        ring = self.recent
        peak = level + conc if conc > 0 else level
        if ring and ring[-1][0] >= slot:
            row = ring[-1]
            row[1] += req
            row[2] += tok
            row[3] += conc
            if peak > row[4]:
                row[4] = peak
        else:
            ring.append([slot, req, tok, conc, peak])


class View:
    """The mesh's count for one key as this node sees it now (live members only)."""

    __slots__ = (
        "conc",
        "others",
        "own_areq",
        "own_atok",
        "own_level",
        "pw",
        "req_cur",
        "req_prev",
        "tok_cur",
        "tok_prev",
        "totals",
    )

    def __init__(self, o: Others, own: Entry | None, pub: Published | None, w: int, f: float) -> None:
        self.others = o
        self.pw = pw = 1.0 - f
        self.req_prev, self.req_cur = float(o.req_prev), float(o.req_cur)
        self.tok_prev, self.tok_cur = float(o.tok_prev), float(o.tok_cur)
        self.conc = o.conc
        self.own_level = 0
        self.own_areq = self.own_atok = 0.0
        self.totals: list[float | None] = [None, None]
        if own is not None:
            p, c = own.aligned(w)
            self.req_prev += p[REQ]
            self.req_cur += c[REQ]
            self.tok_prev += p[TOK] - p[REF]
            self.tok_cur += c[TOK] - c[REF]
            self.own_level = own.inc - own.dec
            self.conc += self.own_level
        if pub is not None:
            pwin, rp, rc, tp, tc = pub
            if pwin == w - 1:
                rp, rc, tp, tc = rc, 0, tc, 0
            if w - 1 <= pwin <= w:
                self.own_areq = rp * pw + rc
                self.own_atok = tp * pw + tc

    def demand(self, node: str, me: str, m: int) -> float:
        """A node's attempts in the sliding window (m = 0: requests, 1: tokens)."""
        d = self.others.demand.get(node)
        extra = (self.own_areq if m == 0 else self.own_atok) if node == me else 0.0
        if d is None:
            return extra
        return extra + (d[0] * self.pw + d[1] if m == 0 else d[2] * self.pw + d[3])

    def age(self, now: float) -> float | None:
        """How old the others' states this node holds are, weighted by what each admitted in the
        sliding window (how many of its admissions a state may lack grows with its age and its rate);
        None when they admitted nothing."""
        t = self.others.made(self.pw, now)
        return None if t is None else now - t

    def total_demand(self, m: int) -> float:
        t = self.totals[m]
        if t is None:
            pw = self.pw
            if m == 0:
                t = self.own_areq + sum(d[0] * pw + d[1] for d in self.others.demand.values())
            else:
                t = self.own_atok + sum(d[2] * pw + d[3] for d in self.others.demand.values())
            self.totals[m] = t
        return t


def unit_hash(*parts: object) -> float:
    """A hash in (0, 1) that every node computes alike (unlike ``hash``, which is salted per process)."""
    h = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "big") + 0.5) / 2.0**64
