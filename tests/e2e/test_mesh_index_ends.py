"""End to end: sparse index replication (``--mesh-index-replication ends``). Two real ``smg-node``
processes meshed on loopback (production security, as ``test_mesh_cluster``), two mock engines, KV events
off: a routing decision sends one turn end (the name of its prompt's last block), never blocks, yet a
follow-up turn sent to the other node goes to the engine holding its prefix and hits its cache. Bounded
polls; every process is stopped by its pid, also on failure."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_mesh_cluster import (
    Cluster,
    follow_ups_hit_on_another_node,
    index_pair,
    request,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

NAMES = ("a", "b")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = ("--mesh-index-replication", "ends", "--no-kv-events")
    with index_pair(tmp_path_factory, *flags, log_prefix="smg-ixends-") as c:
        yield c


def test_turn_ends_alone_send_follow_ups_on_another_node_to_the_holder(cluster: Cluster) -> None:
    for name in NAMES:
        wait_for(lambda name=name: cluster.members(name) == dict.fromkeys(NAMES, "alive"), f"{name}: alive")  # type: ignore[misc]
        wait_for(lambda name=name: len(cluster.worker_urls(name)) == 2, f"{name}: both engines")  # type: ignore[misc]
    # each node gets the other's turn ends, and no block of them; follow-ups on it find the holder
    follow_ups_hit_on_another_node(cluster, NAMES, 6, held="turn_ends")
    for name in NAMES:
        st = request(cluster.url(name) + "/mesh/state")
        assert st["index_replication"] == "ends" and st["stats"]["index_entries_in"] == 0
