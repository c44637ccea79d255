"""``smg-bench mesh-scale`` on a small mesh: the simulated mesh (real Swim, codec, MeshState, RateLimiter)
measures what it claims -- every worker add and health flip reaches every node, the mesh admits about
its limit at 2x load, staleness is sampled -- and the relaying mode keeps peers' shards fresher than the
owner's piggybacking alone (same seed: deterministic). The cost parts return their figures."""

from __future__ import annotations

import pytest

from shepherd.loadgen.benchmarks import mesh_scale, registry
from shepherd.loadgen.benchmarks.mesh_index import index_cost
from shepherd.loadgen.benchmarks.mesh_scale import ScaleConfig, _pct, pushpull_cost, run_scale

pytestmark = pytest.mark.timeout(600)


def test_mesh_scale_is_a_benchmark() -> None:
    assert "mesh-scale" in registry()


def test_small_mesh_before_and_after() -> None:
    runs = {}
    for relay in (False, True):
        cfg = ScaleConfig(window=10.0, windows=2, trials=4, relay=relay, stale_sample_pairs=50)
        r = runs[relay] = run_scale(8, 4, cfg)
        assert r.health_missed == 0 and r.add_missed == 0, relay
        assert len(r.health_lag) == 2 * 7 and len(r.add_lag) == 2 * 7
        assert len(r.admitted) == 2 and all(0.7 <= a <= 1.2 for a in r.admitted), r.admitted
        assert r.staleness and r.false_deaths == 0
        assert r.pp_bytes > 0 and r.pp_run_max_bytes > 0
    assert _pct(runs[True].staleness, 0.99) <= _pct(runs[False].staleness, 0.99)


def test_cost_parts() -> None:
    pc = pushpull_cost(4, 8)
    assert pc.request_bytes > 0 and pc.request_merge_ms >= 0 and pc.join_merge_ms >= 0
    assert pc.reply_bytes < pc.join_bytes  # converged: the reply carries only what differs
    c = index_cost(50.0, seconds=5.0)
    assert c.requests > 100 and c.datagrams > 0 and c.bytes > 0
    assert c.send_us > 0 and c.recv_us > 0


def test_small_mesh_first_hand() -> None:
    """The node's delivery (``first_hand``): every node sends its own deltas to every member; a worker
    add and a health flip reach every node, the limits hold, and the owner's sends are counted."""
    cfg = ScaleConfig(window=10.0, windows=2, trials=4, first_hand=True, stale_sample_pairs=50)
    r = run_scale(8, 4, cfg)
    assert r.health_missed == 0 and r.add_missed == 0
    assert len(r.health_lag) == 2 * 7 and len(r.add_lag) == 2 * 7
    assert len(r.admitted) == 2 and all(0.7 <= a <= 1.2 for a in r.admitted), r.admitted
    assert r.staleness and r.false_deaths == 0
    # each arrival changes the owner's shard, sent to the 7 others: at least ~2 x 7 datagrams a second
    assert r.owned_datagrams_s >= 10 and r.owned_bps > 0
    # nothing rides SWIM's piggybacking: the owners' datagrams are most of what is sent
    assert r.owned_datagrams_s > r.datagrams_s / 2, (r.owned_datagrams_s, r.datagrams_s)
    relayed = run_scale(8, 4, ScaleConfig(window=10.0, windows=2, trials=4, stale_sample_pairs=50))
    assert relayed.owned_datagrams_s == 0
    # sent once by the owner: the add reaches a node in a datagram's delay unless lost (1%)
    assert _pct(r.add_lag, 0.5) < 0.01 and _pct(r.add_lag, 0.5) <= _pct(relayed.add_lag, 0.5)


def test_flush_timing_is_the_nodes() -> None:
    from shepherd.node.cluster import mesh_node  # (not at the top: the benchmark mirrors its constants)

    assert (mesh_scale.INDEX_FLUSH_S, mesh_scale.LIMIT_FLUSH_S) == (
        mesh_node.INDEX_FLUSH_S,
        mesh_node.LIMIT_FLUSH_S,
    )
