"""Scenarios that need the SWIM mesh (TODO-mesh): registered as placeholders, skipped with their reason.

When the mesh lands (``smg-node serve --mesh-port P`` + seeds to join, ``GET /mesh/members``), each of these
becomes a function like the ones in node_faults.py, on ``FleetSpec(mesh=True, nodes=3 or 5)``:

- build: ``Fleet`` passes ``mesh_args()`` to every node (check the flag names there first);
- inject: ``faults.partition`` / ``faults.one_way`` / ``faults.Flapper`` between node namespaces (checked
  today by the ``partition_primitives`` scenario), ``fleet.pause`` / ``fleet.crash_node`` for failures;
- observe: poll ``fleet.mesh_members(n)`` on every node (bounded) and record when each view changes;
- figures: detection time (fault -> first node marks the victim suspect/dead), convergence time (-> every
  node agrees), false-dead count (a live node declared dead), requests lost through the LB, rate-limit
  over-admission (admitted / limit while partitioned), cache affinity kept after failover (share of
  follow-up turns that land on the engine holding their prefix, before vs after).
"""

from __future__ import annotations

from chaos.scenarios.base import todo_mesh

todo_mesh(
    "mesh_partition_2_1",
    "3-node mesh partitioned 2 | 1, then healed",
    "the majority side declares the lone node dead within the suspicion timeout; after the heal every node "
    "sees 3 alive members again (convergence time); no request lost through the LB",
)
todo_mesh(
    "mesh_partition_3_2",
    "5-node mesh partitioned 3 | 2, then healed",
    "each side converges on its own view; after the heal one view again, within a bounded time",
)
todo_mesh(
    "mesh_one_way_partition",
    "a one-way partition (A's packets to B dropped)",
    "indirect probes (k = 3) keep A alive in everyone's view: no false dead",
)
todo_mesh(
    "mesh_flapping_partition",
    "a partition that flaps every 0.5-2 s",
    "membership does not oscillate faster than the suspicion timeout; false-dead count reported",
)
todo_mesh(
    "mesh_detection_convergence",
    "detection and convergence after a crash, a 10 s pause and a graceful leave",
    "figures: detection time, convergence time, false-dead count "
    "(Lifeguard: a slow node is not declared dead)",
)
todo_mesh(
    "mesh_ratelimit_over_admission",
    "a mesh-wide rate limit under a partition",
    "admitted requests stay within the partition's allowance (each side admits limit x reachable / N)",
)
todo_mesh(
    "mesh_cache_affinity_failover",
    "cache affinity after a node failover",
    "follow-up turns keep landing on the engine that holds their prefix after the node that routed them dies "
    "(the prefix index is gossiped)",
)
