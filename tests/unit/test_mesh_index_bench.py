"""``smg-bench mesh-scale``'s index part (``mesh_index``) on a short trace: cross-node follow-ups find
their prefix through the real replicas in every design; ``all`` (no slot-move re-sends) sends fewer bytes
per request than ``before`` on the same trace (same seed: deterministic counts), ``ends`` (turn ends) a
fraction of ``all``'s; ``auto`` gossips nothing
and feeds every node from KV events; the per-N projection is per request x rate x fanout."""

from __future__ import annotations

import pytest

from shepherd.loadgen.benchmarks.mesh_index import index_cost, models_for, project

pytestmark = pytest.mark.timeout(900)


def test_designs_on_a_short_trace() -> None:
    runs = {
        d: index_cost(20.0, seconds=40.0, warmup=100.0, design=d, nodes=3)
        for d in ("before", "all", "auto", "ends")
    }
    for d, c in runs.items():
        assert c.requests > 1000 and c.follow_ups > 100, d
        assert c.hit_rate >= 0.9, (d, c.hit_rate)
    before, after, auto, ends = runs["before"], runs["all"], runs["auto"], runs["ends"]
    assert before.requests == after.requests == auto.requests == ends.requests  # the same trace
    # sparse: one turn end a decision (11 bytes and the worker's name), found through the replica's match
    assert 0 < ends.bytes * 5 < after.bytes and ends.datagrams <= after.datagrams
    assert 0 < after.bytes < before.bytes  # held prefixes that crossed a slot are not sent again
    assert after.send_us > 0 and after.recv_us > 0
    assert auto.datagrams == 0 and auto.kv_events > 0 and auto.kv_us > 0
    dg, kb, cpu, kv = project(after, 200, 199)
    dpr, bpr = after.per_request
    assert dg == pytest.approx(dpr * 20.0 * 199) and kb == pytest.approx(bpr * 20.0 * 199 / 1000)
    assert cpu == pytest.approx(dg * (after.send_us + after.recv_us) / 1e6) and kv == 0.0
    assert project(auto, 200, 28)[:3] == (0.0, 0.0, 0.0) and project(auto, 200, 28)[3] > 0
    assert models_for(200, 400) == 7 and models_for(20, 16) == 1
