"""What the mesh looks like from one node: ``GET /mesh/members``, ``GET /mesh/state`` and ``smg_mesh_*``.

Both routes are control-plane routes (the auth middleware gives ``/mesh/*`` to the admin role); on a
node without the mesh they answer 404 ``mesh_disabled``.

- ``/mesh/members``: every member this node knows, itself included (name, address, state,
  incarnation, last change as Unix time).
- ``/mesh/state``: the replicated workers (owner, whether this node runs a client for it, the mesh's
  health view), registry counts, prefix-index sizes per model and worker, the control-plane document's
  section sizes, the rate limiter's view of the mesh, the state layer's counters, gossip byte counters
  (sealed, on the wire) and the runtime's (push-pulls, membership events, event-loop lag), and the
  latest registry changes from other nodes with their delta lag (write there -> arrival here).

Metrics: members by state, membership events, gossip bytes and datagrams in/out, dropped datagrams,
index entries waiting to be gossiped, event-loop lag, and ``smg_mesh_delta_lag_seconds`` (time from a
registry write on another node to its arrival here; writes older than 30 s, learnt by a full sync,
are not counted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from shepherd.node.cluster.mesh_node import RATE_LIMIT_COMPONENT, MeshNode
from shepherd.node.http.body import json_response
from shepherd.node.metrics import counter, gauge
from shepherd.proto import wire_version
from shepherd.proto.mesh_messages import MemberState
from shepherd.proto.openai_errors import ApiError

MESH: web.AppKey[MeshNode] = web.AppKey("mesh", MeshNode)

LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _mesh(request: web.Request) -> MeshNode:
    mesh = request.app.get(MESH)
    if mesh is None:
        raise ApiError(
            404, "The mesh is not enabled on this node (start it with --mesh-port).", code="mesh_disabled"
        )
    return mesh


async def members(request: web.Request) -> web.Response:
    mesh = _mesh(request)
    return json_response({"node": mesh.name, "members": mesh.members()})


async def state(request: web.Request) -> web.Response:
    return json_response(describe(_mesh(request)))


def routes() -> list[web.RouteDef]:
    return [web.get("/mesh/members", members), web.get("/mesh/state", state)]


def install(app: web.Application, mesh: MeshNode | None) -> None:
    """The routes (always: 404 without the mesh) and, with a mesh, its metrics."""
    app.add_routes(routes())
    if mesh is not None:
        app[MESH] = mesh
        lag = Histogram(
            "smg_mesh_delta_lag_seconds",
            "Time from a worker registry write on another node to its arrival here",
            buckets=LAG_BUCKETS,
            registry=mesh.gw.metrics.registry,
        )
        mesh.on_delta_lag = lag.observe
        mesh.gw.metrics.add_callback(lambda: collect(mesh))


def describe(mesh: MeshNode) -> dict[str, Any]:
    """``GET /mesh/state``: the replicated state as this node sees it."""
    st = mesh.state
    local = mesh.gw.registry.workers
    workers = []
    for r in sorted(st.workers(), key=lambda r: (r.model, r.url)):
        hv = st.health_view(r.id)
        workers.append(
            {
                "id": r.id,
                "url": r.url,
                "model": r.model,
                "kind": r.kind,
                "owner": r.owner,
                "local": r.id in local,
                "health": {
                    "routable": hv.routable,
                    "healthy_observers": hv.healthy,
                    "unhealthy_observers": hv.unhealthy,
                    "local": hv.local,
                },
            }
        )
    rt = mesh.runtime
    counts: dict[str, int] = {}
    listed = rt.members() if rt is not None else []
    for m in listed:
        counts[m.state] = counts.get(m.state, 0) + 1
    out: dict[str, Any] = {
        "node": mesh.name,
        "address": None if rt is None else f"{rt.address[0]}:{rt.address[1]}",
        "members": {"total": len(listed), **counts},
        "workers": workers,
        "registry": {"live": st.registry.live_count, "tombstones": st.registry.tombstone_count},
        "index": {
            model: {
                "blocks": ix.live_blocks,
                "pending": ix.pending,
                "workers": {w: ix.worker_blocks(w) for w in ix.workers},
                "quiet": sorted(ix.quiet_workers),  # decisions not replicated (their KV events tell all)
                "turn_ends": ix.turn_ends,  # peers' turn ends kept (--mesh-index-replication ends)
            }
            for model, ix in st.indexes.items()
        },
        "index_replication": mesh.index_replication,
        "config": {k: len(v) for k, v in st.config.to_py().items()},
        "components": [n for n in (RATE_LIMIT_COMPONENT,) if st.component(n) is not None],
        "stats": dataclasses.asdict(st.stats),
        "bridge": dataclasses.asdict(mesh.bridge.stats),
        "index_datagrams_out": mesh.index_datagrams_out,
        "recent_deltas": [
            {"worker": w, "writer": by, "op": op, "lag_s": round(lag, 6)}
            for w, by, op, lag in mesh.recent_deltas
        ],
        "join_transfers": mesh.join_transfers,
    }
    if mesh.limiter is not None:
        out["rate_limits"] = {
            "reachable": mesh.limiter.reachable,
            "known": mesh.limiter.cluster_size,
            "keys": mesh.limiter.key_count(),
        }
    if rt is not None:
        rm = rt.metrics
        out["gossip"] = rt.transport_metrics.snapshot()
        out["runtime"] = {
            "joined": rt.swim.joined,
            "incarnation": rt.swim.incarnation,
            "health_multiplier": rt.swim.health,
            "push_pulls_ok": rm.push_pulls_ok,
            "push_pulls_failed": rm.push_pulls_failed,
            "push_pulls_reused": rm.push_pulls_reused,
            "wire_version": "{}.{}".format(*wire_version.speaks()),
            "wire_refused": dict(rm.wire_refused),
            "wire_skipped": rm.wire_skipped,
            "dns_seeds": None
            if rt.dns_seeder is None
            else {
                "seeds": [str(s) for s in rt.dns_seeder.seeds],
                "addresses": [f"{h}:{p}" for h, p in rt.dns_seeder.stats.last_addresses],
                "resolutions": rt.dns_seeder.stats.resolutions,
                "resolve_failures": rt.dns_seeder.stats.resolve_failures,
                "joined_addresses": rt.dns_seeder.stats.joined_addresses,
            },
            "member_events": dict(rm.member_events),
            "loop_lag_last_s": rm.lag_last,
            "loop_lag_max_s": rm.lag_max,
        }
    return out


def collect(mesh: MeshNode) -> list[Any]:
    rt = mesh.runtime
    if rt is None:
        return []
    tm = rt.transport_metrics
    states: dict[str, int] = {s.name.lower(): 0 for s in MemberState}
    for m in rt.members():
        states[m.state] = states.get(m.state, 0) + 1
    dropped = tm.udp_dropped_bad_seal + tm.udp_dropped_oversize + tm.udp_dropped_backpressure
    pending = sum(ix.pending for ix in mesh.state.indexes.values())
    return [
        gauge(
            "smg_mesh_members",
            "Mesh members by state, as this node sees them",
            ["state"],
            [([k], float(v)) for k, v in states.items()],
        ),
        counter(
            "smg_mesh_membership_changes",
            "Membership events seen by this node",
            ["event"],
            [([k], float(v)) for k, v in rt.metrics.member_events.items()],
        ),
        counter(
            "smg_mesh_gossip_bytes",
            "Mesh bytes on the wire (sealed)",
            ["transport", "direction"],
            [
                (["udp", "in"], float(tm.udp_bytes_in)),
                (["udp", "out"], float(tm.udp_bytes_out)),
                (["tcp", "in"], float(tm.tcp_bytes_in)),
                (["tcp", "out"], float(tm.tcp_bytes_out)),
            ],
        ),
        counter(
            "smg_mesh_gossip_packets",
            "Mesh UDP datagrams",
            ["direction"],
            [(["in"], float(tm.udp_packets_in)), (["out"], float(tm.udp_packets_out))],
        ),
        counter(
            "smg_mesh_dropped_packets",
            "Mesh datagrams dropped (bad seal, oversize, backpressure)",
            [],
            [([], float(dropped))],
        ),
        gauge(
            "smg_mesh_index_pending",
            "Prefix-index entries waiting to be gossiped",
            [],
            [([], float(pending))],
        ),
        counter(
            "smg_mesh_wire_refused",
            "Mesh datagrams and frames refused for their protocol version, by reason (wire_version)",
            ["reason"],
            [([r], float(rt.metrics.wire_refused.get(r, 0))) for r in wire_version.REFUSAL_REASONS],
        ),
        counter(
            "smg_mesh_wire_skipped",
            "Mesh messages of a type this version does not know (a newer minor's), skipped",
            [],
            [([], float(rt.metrics.wire_skipped + mesh.state.stats.unknown_skipped))],
        ),
        counter(
            "smg_mesh_replays_refused",
            "Sealed mesh datagrams refused by the replay guard, by reason (a stamp outside the clock window, "
            "one seen before, older than what the guard still remembers of its sender, or none)",
            ["reason"],
            [
                (["outside_window"], float(rt.replay.stats.outside_window)),
                (["duplicate"], float(rt.replay.stats.duplicates)),
                (["too_old"], float(rt.replay.stats.too_old)),
                (["unstamped"], float(rt.replay.stats.unstamped)),
            ],
        ),
        gauge(
            "smg_mesh_loop_lag_seconds",
            "Event-loop lag the mesh measured last (Lifeguard's input)",
            [],
            [([], rt.metrics.lag_last)],
        ),
    ]
