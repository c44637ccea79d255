"""Per-key bookkeeping of ``shepherd.mesh.ratelimit``: the shards of one limit key, the cached sum of the
other nodes' shards, this node's unseen-changes ring, and the view the admission rule reads."""

from __future__ import annotations

import hashlib
from collections import deque

from shepherd.mesh.ratelimit_shards import AREQ, ATOK, REF, REQ, TOK, Entry

Key = tuple[str, str]  # (tenant, model); model "" = all of the tenant's models
ShardId = tuple[str, int]  # (node name, process generation)

# columns of KeyState.unseen()
U_REQ, U_TOK, U_CONC, U_PEAK = 1, 2, 3, 4

Published = tuple[int, int, int, int, int]  # window, req attempts prev, cur, token attempts prev, cur


class Others:
    """The sum of the live shards of one key other than this process's own, in one window. It changes at
    gossip rate, so it is cached until a merge touches the key, membership changes or the window moves."""

    __slots__ = ("conc", "demand", "epoch", "req_cur", "req_prev", "tok_cur", "tok_prev", "w")

    def __init__(self, w: int, epoch: int) -> None:
        self.w = w
        self.epoch = epoch
        self.req_prev = self.req_cur = self.tok_prev = self.tok_cur = 0
        self.conc = 0
        self.demand: dict[str, list[int]] = {}  # node -> [req attempts prev, cur, token attempts prev, cur]


class KeyState:
    """Everything one node holds for one key."""

    __slots__ = ("others", "published", "recent", "shards", "usum")

    def __init__(self) -> None:
        self.shards: dict[ShardId, Entry] = {}
        self.recent: deque[list[int]] = deque()  # own changes per time slot: [slot, req, tok, conc, peak]
        self.usum = [0] * 4  # running sums of columns 1..3 of ``recent``
        self.others: Others | None = None
        # own attempts as last sent in a delta: what the others know of this node's demand, so that
        # every node computes the shares from the same data
        self.published: Published | None = None

    def sum_others(self, w: int, epoch: int, live: set[str], gen_of: dict[str, int], me: ShardId) -> Others:
        o = Others(w, epoch)
        for sid, e in self.shards.items():
            node, gen = sid
            if node not in live or sid == me:
                continue
            p, c = e.aligned(w)
            o.req_prev += p[REQ]
            o.req_cur += c[REQ]
            o.tok_prev += p[TOK] - p[REF]
            o.tok_cur += c[TOK] - c[REF]
            if gen == gen_of.get(node, gen):  # the gauge of a restarted node's old process is gone
                o.conc += e.inc - e.dec
            d = o.demand.get(node)
            if d is None:
                d = o.demand[node] = [0, 0, 0, 0]
            d[0] += p[AREQ]
            d[1] += c[AREQ]
            d[2] += p[ATOK]
            d[3] += c[ATOK]
        return o

    def unseen(self, slot: int, span: int) -> list[int]:
        """Own net changes over the last ``span`` slots (req, tok, conc at U_REQ..U_CONC) and the own
        in-flight peak over them (at U_PEAK)."""
        ring, usum = self.recent, self.usum
        oldest = slot - span
        while ring and ring[0][0] < oldest:
            row = ring.popleft()
            usum[1] -= row[1]
            usum[2] -= row[2]
            usum[3] -= row[3]
        peak = 0
        for row in ring:
            if row[4] > peak:
                peak = row[4]
        return [0, usum[1], usum[2], usum[3], peak]

    def ring_add(self, slot: int, req: int, tok: int, conc: int, level: int) -> None:
        """Add own changes to the current slot; ``level`` is the in-flight count before the change (the
        slot keeps the peak, for refills)."""
        ring, usum = self.recent, self.usum
        peak = level + conc if conc > 0 else level
        if ring and ring[-1][0] == slot:
            row = ring[-1]
            row[1] += req
            row[2] += tok
            row[3] += conc
            if peak > row[4]:
                row[4] = peak
        else:
            ring.append([slot, req, tok, conc, peak])
        usum[1] += req
        usum[2] += tok
        usum[3] += conc


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
