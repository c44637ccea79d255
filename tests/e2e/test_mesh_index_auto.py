"""End to end: index replication ``auto`` with KV events (the default for gRPC engines). Two real
``smg-node`` processes meshed on loopback (production security, as ``test_mesh_cluster``), two mock
engines, KV events on: once each node's KV-event stream of an engine is live, the node's routing
decisions for it are not replicated (``/mesh/state`` lists the engine as quiet), yet a follow-up turn
sent to the other node goes to the engine holding its prefix and hits its cache: the engine's own events
told that node. Bounded polls; every process is stopped by its pid, also on failure."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shepherd.proto.engine_types import worker_id
from tests.e2e.test_mesh_cluster import (
    MODEL,
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
    with index_pair(tmp_path_factory, "--mesh-index-replication", "auto", log_prefix="smg-ixauto-") as c:
        yield c


def index_state(cluster: Cluster, name: str) -> dict[str, object]:
    st = request(cluster.url(name) + "/mesh/state")
    return {
        "mode": st["index_replication"],
        "quiet": st["index"].get(MODEL, {}).get("quiet", []),
        "payloads_out": st["stats"]["index_payloads_out"],
    }


def test_event_fed_engines_are_not_gossiped_and_follow_ups_still_hit(cluster: Cluster) -> None:
    for name in NAMES:
        wait_for(lambda name=name: cluster.members(name) == dict.fromkeys(NAMES, "alive"), f"{name}: alive")  # type: ignore[misc]
    wids = sorted(worker_id(cluster.engine_url(i)) for i in range(2))
    # one request to each engine: its KV-event stream delivers to both nodes (live), which quiets it
    for i in range(2):
        request(
            cluster.url("a") + "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": f"warm {i}"}], "max_tokens": 2},
            headers={"x-smg-target-worker": worker_id(cluster.engine_url(i))},
        )
    for name in NAMES:
        wait_for(lambda name=name: index_state(cluster, name)["quiet"] == wids, f"{name}: both engines quiet")  # type: ignore[misc]
        assert index_state(cluster, name)["mode"] == "auto"
    sent = {name: index_state(cluster, name)["payloads_out"] for name in NAMES}
    # the other node learns the first turns from the engines' events (KV events applied there)
    follow_ups_hit_on_another_node(cluster, NAMES, 4)
    # none of it went through the mesh's index gossip
    assert {name: index_state(cluster, name)["payloads_out"] for name in NAMES} == sent
