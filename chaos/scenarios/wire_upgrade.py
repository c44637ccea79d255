"""A rolling upgrade across mesh protocol versions (``shepherd.proto.wire_version``), under load.

``mesh_wire_upgrade`` replaces the nodes of a 3-node mesh one by one (SIGTERM: drain, leave, exit) with a
build that speaks the next minor version: the same code started with ``SHEPHERD_TEST_WIRE_NEXT=1``, which
sends minor + 1, an extra trailing field in every array and an extra message type in every packet (and
state payload) it can fit. Then it rolls back the same way, so the fleet ends as it began (and the
downgrade is a rolling upgrade the other way: the older node reads the newer one's packets).

While two versions share the mesh, every node must accept the other's datagrams and push-pulls (no
version refusal anywhere), the older nodes must have skipped the newer one's unknown messages (counted),
nobody may be declared dead (a restart is a graceful leave), the replicated state must converge (every
node lists the same workers, with the same owners, in ``GET /mesh/state``) and the LB must lose no
request (a client with one retry).
"""

from __future__ import annotations

import time
from typing import Any

from chaos.fleet import Fleet, Member
from chaos.mesh_watch import MeshWatch, all_alive
from chaos.report import ScenarioResult
from chaos.scenarios.base import Traffic, scenario
from chaos.scenarios.mesh import BASELINE_S, CONVERGE_BOUND_S, MESH3
from shepherd.proto import wire_version

NEXT_ENV = {wire_version.TEST_NEXT_ENV: "1"}
THIS = f"{wire_version.MAJOR}.{wire_version.MINOR}"
NEXT = f"{wire_version.MAJOR}.{wire_version.MINOR + 1}"
STEP_CONVERGE_S = 30.0  # one node back -> every view all alive again (bounded; the figure is reported)
STATE_CONVERGE_S = 20.0  # every node lists the same workers (registry gossip + a push-pull round)


def mesh_state(fleet: Fleet, n: Member) -> dict[str, Any] | None:
    status, body = fleet.call("GET", fleet.node_url(n) + "/mesh/state", timeout=2.0)
    return body if status == 200 and isinstance(body, dict) else None


def _workers(state: dict[str, Any]) -> list[tuple[str, str, str]]:
    return sorted((w["id"], w["url"], w["owner"]) for w in state.get("workers", []))


def _states(fleet: Fleet) -> dict[str, dict[str, Any] | None]:
    return {n.name: mesh_state(fleet, n) for n in fleet.active_nodes()}


def _converged(fleet: Fleet) -> tuple[bool, dict[str, dict[str, Any] | None]]:
    """Every node answers and lists the same (non-empty) workers with the same owners."""
    states = _states(fleet)
    lists = [_workers(s) for s in states.values() if s is not None]
    ok = len(lists) == len(states) and bool(lists[0]) and all(w == lists[0] for w in lists)
    return ok, states


def _wait_converged(fleet: Fleet, timeout: float) -> tuple[float | None, dict[str, dict[str, Any] | None]]:
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        ok, states = _converged(fleet)
        if ok:
            return round(time.monotonic() - t0, 2), states
        if time.monotonic() >= deadline:
            return None, states
        time.sleep(0.5)


def _runtime(state: dict[str, Any] | None) -> dict[str, Any]:
    rt = state.get("runtime") if state is not None else None
    return rt if isinstance(rt, dict) else {}


def _roll(
    fleet: Fleet, watch: MeshWatch, tr: Traffic, names: list[str], env: dict[str, str] | None, label: str
) -> tuple[list[float | None], list[int | None], dict[str, dict[str, Any] | None]]:
    """Restart every node in turn with ``env``; after each, the views' convergence time. Returns those,
    the exit codes, and every node's ``/mesh/state`` while the versions were mixed (after the first)."""
    converge: list[float | None] = []
    codes: list[int | None] = []
    mixed: dict[str, dict[str, Any] | None] = {}
    for i, n in enumerate(fleet.active_nodes()):
        codes.append(fleet.terminate_node(n))
        # the LB lets go of the old process first: the new one's memory is sampled from when it is UP
        fleet.wait_lb(n.name, up=False, timeout=15.0)
        fleet.start_node(n, env=env)
        fleet.wait_lb(n.name, up=True, timeout=20.0)
        converge.append(watch.wait(all_alive(names), timeout=STEP_CONVERGE_S))
        tr.mark(f"{label}: {n.name} replaced, views all alive after {converge[-1]} s")
        if i == 0:
            tr.sleep(2.0)  # a few gossip rounds and a push-pull or two across the versions
            mixed = _states(fleet)
    return converge, codes, mixed


@scenario(
    "mesh_wire_upgrade",
    f"rolling upgrade of a 3-node mesh to a build speaking wire {NEXT} (extra field and message type), "
    "then back, under load",
    spec=MESH3,
    must_hold=f"nodes of wire {THIS} and {NEXT} share the mesh: no version refused, the older skips the "
    "newer's unknown messages; no false dead (every restart is a leave); after each step every view is "
    "all alive, and every node lists the same workers; a client with one retry loses no request",
)
def mesh_wire_upgrade(fleet: Fleet, result: ScenarioResult) -> None:
    with Traffic(fleet, result) as tr, MeshWatch(fleet) as watch:
        names = [n.name for n in fleet.active_nodes()]
        if watch.wait(all_alive(names), timeout=40.0) is None:
            raise RuntimeError(f"the mesh never converged before the upgrade: {watch.view()}")
        tr.sleep(BASELINE_S)
        start = tr.mark("rolling upgrade begins")
        up_conv, up_codes, mixed_up = _roll(fleet, watch, tr, names, NEXT_ENV, "upgrade")
        upgraded_s, upgraded = _wait_converged(fleet, STATE_CONVERGE_S)
        tr.mark("every node speaks the next minor")
        tr.sleep(2.0)
        down_conv, down_codes, mixed_down = _roll(fleet, watch, tr, names, None, "downgrade")
        back_s, back = _wait_converged(fleet, STATE_CONVERGE_S)
        end = tr.mark("rolled back")
        tr.sleep(1.0)
    result.timeline += [
        (round(c.at - tr.t0, 2), f"{c.observer} sees {c.member} {c.state}") for c in watch.history(start)
    ]
    result.timeline.sort()
    deaths = sorted(f"{o}:{m}" for o, m in watch.marked_dead(start, end) if o != m)
    versions_up = {k: _runtime(s).get("wire_version") for k, s in mixed_up.items()}
    versions_all = {k: _runtime(s).get("wire_version") for k, s in upgraded.items()}
    versions_down = {k: _runtime(s).get("wire_version") for k, s in mixed_down.items()}
    every = [*mixed_up.values(), *upgraded.values(), *mixed_down.values(), *back.values()]
    refused = {k: v for s in every for k, v in _runtime(s).get("wire_refused", {}).items() if v}
    # in the first mixed phase node 1 speaks the next minor: the others skip its extra messages
    older_up = [k for k, v in versions_up.items() if v == THIS]
    skipped_up = {k: _runtime(mixed_up[k]).get("wire_skipped", 0) for k in older_up}
    state_skipped = {k: (s or {}).get("stats", {}).get("unknown_skipped", 0) for k, s in mixed_up.items()}
    decode_errors = {k: (s or {}).get("stats", {}).get("decode_errors") for k, s in back.items()}
    t = result.traffic
    assert t is not None
    steps = up_conv + down_conv
    result.figures.update(
        wire_versions_one_upgraded=str(versions_up),
        wire_versions_all_upgraded=str(versions_all),
        wire_versions_one_downgraded=str(versions_down),
        unknown_messages_skipped_by_older_nodes=str(skipped_up),
        unknown_state_payloads_skipped=str(state_skipped),
        views_all_alive_after_step_s_max=max((s for s in steps if s is not None), default=None),
        state_converged_upgraded_s=upgraded_s,
        state_converged_rolled_back_s=back_s,
        workers_listed=len(_workers(back[names[0]] or {})),
        declared_dead=len(deaths),
        state_decode_errors=str(decode_errors),
        first_attempt_failures=sum(t.first_errors.values()),
    )
    result.check(
        f"one node upgraded: it speaks {NEXT}, the others {THIS}",
        versions_up.get(names[0]) == NEXT and len(older_up) == len(names) - 1,
        str(versions_up),
    )
    result.check(
        f"every node upgraded speaks {NEXT}", set(versions_all.values()) == {NEXT}, str(versions_all)
    )
    result.check(
        f"one node rolled back: it speaks {THIS}, the others {NEXT}",
        versions_down.get(names[0]) == THIS
        and sum(v == NEXT for v in versions_down.values()) == len(names) - 1,
        str(versions_down),
    )
    result.check("no datagram or frame refused for its version", not refused, str(refused))
    result.check(
        "the older nodes skipped the newer one's unknown message types (and nothing else broke)",
        bool(skipped_up) and all(v > 0 for v in skipped_up.values()),
        str(skipped_up),
    )
    result.check(
        f"after each replacement every view is all alive within {STEP_CONVERGE_S:.0f} s",
        all(s is not None for s in steps),
        f"{steps} s (the heal bound of the partition scenarios: {CONVERGE_BOUND_S} s)",
    )
    result.check(
        "the replicated state converged: every node lists the same workers with the same owners",
        upgraded_s is not None and back_s is not None,
        f"upgraded {upgraded_s} s, rolled back {back_s} s",
    )
    result.check("no false dead (every restart was a graceful leave)", not deaths, str(deaths))
    result.check(
        "every node exited cleanly after SIGTERM",
        all(c == 0 for c in up_codes + down_codes),
        str(up_codes + down_codes),
    )
    result.check("a client with one retry loses no request", t.failed == 0, f"failed {t.failed}: {t.errors}")
