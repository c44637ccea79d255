#!/usr/bin/env python3
"""The checks of ``make compose-test`` (docker/compose-test.sh) against a running docker-compose fleet.

Standard library only (runs with any host ``python3`` >= 3.9). Phases, each bounded:

1. ready: the load balancer answers ``GET /v1/models``, HAProxy sees every node UP and (unless
   ``--no-mesh``) every node's ``GET /mesh/members`` lists all nodes alive;
2. traffic: ``--requests`` chat completions through the load balancer spread over ``--duration`` seconds
   (every ``--stream-every``-th streamed), each retried once on failure; ``--stop-at`` seconds in, the
   ``--stop-cmd`` (``docker stop`` / ``docker kill`` of one node) runs in the background;
3. notice: HAProxy's status of the stopped node and the other nodes' ``/mesh/members`` are polled until
   the stopped node is out of the pool (DOWN) and seen dead or left by every other node.

Before the traffic, with ``--direct`` (a node's own client port): the load balancer adds no latency.
``--ttft-requests`` streamed requests, one at a time, alternate between the load balancer and the node
directly; the median time to the first content chunk through the LB must be within ``--ttft-margin-ms``
of the direct one (HAProxy without ``option http-no-delay`` merges small packets: measured +100 ms).

Prints a report and one ``RESULT {json}`` line; exit status 0 only if every request succeeded (with its
one retry), the load balancer took the node out and every other node saw it dead or left.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import io
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

GONE = ("dead", "left")


ADMIN_KEY = ""  # the nodes' admin key (--admin-key): /mesh/members is on their authenticated admin listener


def http_json(url: str, timeout: float = 3.0, admin: bool = False) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if admin and ADMIN_KEY else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def haproxy_status(stats_url: str, backend: str) -> dict[str, dict[str, str]]:
    """Server name -> its CSV row in HAProxy's stats (``status``, ``stot``, ``wretr``, ``wredis``...)."""
    with urllib.request.urlopen(stats_url, timeout=3.0) as r:
        text = r.read().decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {row["svname"]: row for row in rows if row.get("pxname") == backend}


def members(url: str) -> dict[str, str]:
    """Member name -> state, as one node sees the mesh."""
    return {m["name"]: m["state"] for m in http_json(url + "/mesh/members", admin=True)["members"]}


# ---- traffic ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    attempts: int
    errors: list[str] = field(default_factory=list)
    latency_s: float = 0.0
    stream: bool = False


def chat_once(lb: str, model: str, i: int, stream: bool, timeout: float) -> str | None:
    """One attempt; None on success, else what went wrong."""
    body = {
        "model": model,
        # a few shared prefixes, so that cache_aware has something to route on
        "messages": [
            {"role": "system", "content": f"You are assistant number {i % 5}. Answer briefly."},
            {"role": "user", "content": f"Request {i}: say something about the number {i * 7919 % 1000}."},
        ],
        "max_tokens": 8 + i % 25,
        "stream": stream,
    }
    req = urllib.request.Request(
        lb + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if r.status != 200:
                return f"http {r.status}"
            if not stream:
                data = json.loads(r.read())
                choices = data.get("choices") or []
                if not choices or "message" not in choices[0]:
                    return "no choices"
                return None
            done = False
            chunks = 0
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    return f"stream error: {str(ev['error'])[:80]}"
                chunks += 1
            if not done:
                return f"stream cut after {chunks} chunks"
            if chunks == 0:
                return "empty stream"
            return None
    except urllib.error.HTTPError as e:
        return f"http {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def ttft_once(base: str, model: str, i: int, timeout: float) -> float:
    """Seconds from sending a streamed request to its first content chunk (raises on failure)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"TTFT probe {i}: count to ten."}],
        "max_tokens": 16,
        "stream": True,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    first: float | None = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {str(ev['error'])[:80]}")
            delta = (ev.get("choices") or [{}])[0].get("delta") or {}
            if first is None and (delta.get("content") or delta.get("reasoning_content")):
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError("no content chunk")
    return first


def ttft_check(lb: str, direct: str, model: str, n: int, timeout: float) -> tuple[float, float]:
    """Median TTFT (ms) through the LB and directly, ``n`` requests each, alternating, one at a time."""
    via_lb: list[float] = []
    via_node: list[float] = []
    for i in range(n):
        via_lb.append(ttft_once(lb, model, 2 * i, timeout))
        via_node.append(ttft_once(direct, model, 2 * i + 1, timeout))
    return sorted(via_lb)[n // 2] * 1000, sorted(via_node)[n // 2] * 1000


def chat(lb: str, model: str, i: int, stream: bool, timeout: float) -> Outcome:
    t0 = time.monotonic()
    out = Outcome(ok=False, attempts=0, stream=stream)
    for _ in range(2):  # the request and its one retry
        out.attempts += 1
        err = chat_once(lb, model, i, stream, timeout)
        if err is None:
            out.ok = True
            break
        out.errors.append(err)
    out.latency_s = time.monotonic() - t0
    return out


# ---- watching the stop --------------------------------------------------------------------------------


@dataclass
class Notice:
    stop_issued: float | None = None  # monotonic
    stop_returned: float | None = None
    stop_rc: int | None = None
    stop_output: str = ""
    lb_down: float | None = None
    lb_status: str = ""
    mesh_seen: dict[str, float] = field(default_factory=dict)  # observer -> when it saw the victim gone
    mesh_state: dict[str, str] = field(default_factory=dict)  # observer -> victim's last state there
    poll_errors: int = 0


def run_stop(cmd: str, notice: Notice) -> None:
    notice.stop_issued = time.monotonic()
    try:
        p = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=90)
        notice.stop_rc = p.returncode
        notice.stop_output = (p.stdout + p.stderr).strip()[-200:]
    except subprocess.TimeoutExpired:
        notice.stop_rc = -1
        notice.stop_output = "timed out after 90 s"
    notice.stop_returned = time.monotonic()


def watch(args: argparse.Namespace, nodes: dict[str, str], notice: Notice, stop: threading.Event) -> None:
    observers = {n: u for n, u in nodes.items() if n != args.victim}
    while not stop.is_set():
        if notice.stop_issued is not None:
            now = time.monotonic()
            if notice.lb_down is None:
                try:
                    row = haproxy_status(args.stats, args.backend).get(args.victim, {})
                    notice.lb_status = row.get("status", "?")
                    if notice.lb_status.startswith(("DOWN", "MAINT", "NOLB")):
                        notice.lb_down = now
                except (OSError, ValueError):
                    notice.poll_errors += 1
            if args.mesh:
                for name, url in observers.items():
                    if name in notice.mesh_seen:
                        continue
                    try:
                        st = members(url).get(args.victim, "absent")
                    except (OSError, ValueError, KeyError):
                        notice.poll_errors += 1
                        continue
                    notice.mesh_state[name] = st
                    if st in GONE:
                        notice.mesh_seen[name] = now
        stop.wait(0.1)


# ---- phases -------------------------------------------------------------------------------------------


def wait_ready(args: argparse.Namespace, nodes: dict[str, str]) -> tuple[str, float, float | None]:
    """(model, seconds until the LB answered, seconds until the mesh was whole); SystemExit on timeout."""
    t0 = time.monotonic()
    deadline = t0 + args.ready_timeout
    model = ""
    lb_at: float | None = None
    mesh_at: float | None = None
    last = ""
    while time.monotonic() < deadline:
        try:
            if lb_at is None:
                data = http_json(args.lb + "/v1/models")
                model = data["data"][0]["id"]
                rows = haproxy_status(args.stats, args.backend)
                not_up = [n for n in nodes if not rows.get(n, {}).get("status", "").startswith("UP")]
                if not_up:
                    raise ValueError(f"haproxy: not UP yet: {not_up}")
                lb_at = time.monotonic() - t0
            if args.mesh and mesh_at is None:
                for name, url in nodes.items():
                    view = members(url)
                    alive = sorted(n for n, s in view.items() if s == "alive")
                    if alive != sorted(nodes):
                        raise ValueError(f"{name} sees {view}")
                mesh_at = time.monotonic() - t0
            if lb_at is not None and (mesh_at is not None or not args.mesh):
                return model, lb_at, mesh_at
        except urllib.error.HTTPError as e:
            last = f"http {e.code} from {e.url}"
            if e.code == 404 and "/mesh/" in (e.url or ""):
                raise SystemExit("compose_check: the nodes answer 404 on /mesh/members (mesh off)") from e
        except (OSError, ValueError, KeyError, IndexError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise SystemExit(f"compose_check: not ready after {args.ready_timeout:.0f} s: {last}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lb", required=True, help="load balancer base URL")
    ap.add_argument("--stats", required=True, help="HAProxy stats CSV URL (.../stats;csv)")
    ap.add_argument("--backend", default="nodes", help="HAProxy backend of the nodes")
    ap.add_argument(
        "--node", action="append", default=[], metavar="NAME=URL", help="a node's admin listener URL"
    )
    ap.add_argument(
        "--admin-key",
        default=os.environ.get("SHEPHERD_ADMIN_KEY", ""),
        help="the nodes' admin key (default: $SHEPHERD_ADMIN_KEY)",
    )
    ap.add_argument("--victim", required=True, help="the node stopped under traffic")
    ap.add_argument("--stop-cmd", required=True, help="command that stops it (docker stop ID)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds the requests are spread over")
    ap.add_argument("--stop-at", type=float, default=8.0, help="seconds into the traffic to stop the victim")
    ap.add_argument("--stream-every", type=int, default=3, help="every N-th request is streamed")
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.add_argument("--notice-timeout", type=float, default=40.0, help="after the stop, for LB and mesh")
    ap.add_argument("--no-mesh", dest="mesh", action="store_false", help="the nodes run without the mesh")
    ap.add_argument("--direct", help="one node's client URL: check that the LB adds no latency to TTFT")
    ap.add_argument("--ttft-requests", type=int, default=30)
    ap.add_argument("--ttft-margin-ms", type=float, default=25.0, help="LB median TTFT minus direct, at most")
    args = ap.parse_args(argv)
    global ADMIN_KEY
    ADMIN_KEY = args.admin_key
    nodes = dict(n.split("=", 1) for n in args.node)
    if args.victim not in nodes:
        ap.error(f"--victim {args.victim} is not one of the --node names")

    model, lb_ready, mesh_ready = wait_ready(args, nodes)
    mesh_txt = f", mesh whole (3 alive on every node) after {mesh_ready:.1f} s" if args.mesh else " (no mesh)"
    print(f"compose_check: LB ready after {lb_ready:.1f} s{mesh_txt}; model {model}", flush=True)
    ttft_ok = True
    ttft_txt = "not checked (no --direct)"
    if args.direct:
        lb_ms, node_ms = ttft_check(args.lb, args.direct, model, args.ttft_requests, args.request_timeout)
        ttft_ok = lb_ms - node_ms <= args.ttft_margin_ms
        ttft_txt = (
            f"median {lb_ms:.1f} ms through the LB, {node_ms:.1f} ms direct "
            f"(+{lb_ms - node_ms:.1f} ms, at most {args.ttft_margin_ms:g})"
        )
        print(f"compose_check: streamed TTFT {ttft_txt}: {'ok' if ttft_ok else 'FAIL'}", flush=True)
    before = haproxy_status(args.stats, args.backend)

    notice = Notice()
    stop_watch = threading.Event()
    watcher = threading.Thread(target=watch, args=(args, nodes, notice, stop_watch), daemon=True)
    watcher.start()
    stopper = threading.Thread(target=run_stop, args=(args.stop_cmd, notice), daemon=True)
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    gap = args.duration / max(1, args.requests)
    stop_started = False
    with concurrent.futures.ThreadPoolExecutor(max_workers=96) as pool:
        futures = []
        for i in range(args.requests):
            due = t0 + i * gap
            time.sleep(max(0.0, due - time.monotonic()))
            if not stop_started and due - t0 >= args.stop_at:
                stopper.start()
                stop_started = True
            stream = args.stream_every > 0 and i % args.stream_every == 0
            futures.append(pool.submit(chat, args.lb, model, i, stream, args.request_timeout))
        if not stop_started:
            stopper.start()
        outcomes.extend(f.result() for f in futures)
    traffic_s = time.monotonic() - t0

    # the stop and its notice, bounded
    stopper.join(timeout=100)
    deadline = (notice.stop_issued or time.monotonic()) + args.notice_timeout
    observers = [n for n in nodes if n != args.victim]
    while time.monotonic() < deadline:
        mesh_done = not args.mesh or all(n in notice.mesh_seen for n in observers)
        if notice.lb_down is not None and mesh_done:
            break
        time.sleep(0.1)
    stop_watch.set()
    watcher.join(timeout=5)

    # survivors still see each other alive
    survivors_ok = True
    survivor_views: dict[str, dict[str, str]] = {}
    if args.mesh:
        for n in observers:
            try:
                view = members(nodes[n])
            except (OSError, ValueError, KeyError) as exc:
                view = {"error": str(exc)}
            survivor_views[n] = view
            if any(view.get(o) != "alive" for o in observers):
                survivors_ok = False
    after = haproxy_status(args.stats, args.backend)

    ok = sum(o.ok for o in outcomes)
    failed = len(outcomes) - ok
    retried = sum(o.attempts > 1 for o in outcomes)
    streamed = sum(o.stream for o in outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        for e in o.errors:
            errors[e] = errors.get(e, 0) + 1
    lat = sorted(o.latency_s for o in outcomes)

    def since_stop(t: float | None) -> float | None:
        return None if t is None or notice.stop_issued is None else round(t - notice.stop_issued, 2)

    per_server = {
        s: {
            "sessions": int(after.get(s, {}).get("stot") or 0) - int(before.get(s, {}).get("stot") or 0),
            "status": after.get(s, {}).get("status", "?"),
        }
        for s in nodes
    }
    retries_lb = sum(int(after.get(s, {}).get("wretr") or 0) for s in after)
    redispatches_lb = sum(int(after.get(s, {}).get("wredis") or 0) for s in after)
    result = {
        "sent": len(outcomes),
        "ok": ok,
        "failed": failed,
        "retried_by_client": retried,
        "streamed": streamed,
        "errors": errors,
        "traffic_s": round(traffic_s, 1),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_max_s": round(lat[-1], 3) if lat else None,
        "victim": args.victim,
        "stop_at_s": args.stop_at,
        "stop_cmd_rc": notice.stop_rc,
        "stop_cmd_s": since_stop(notice.stop_returned),
        "lb_noticed_s": since_stop(notice.lb_down),
        "lb_status": notice.lb_status,
        "mesh_noticed_s": {n: since_stop(notice.mesh_seen.get(n)) for n in observers} if args.mesh else None,
        "mesh_victim_state": notice.mesh_state if args.mesh else None,
        "survivors_alive": survivors_ok if args.mesh else None,
        "lb_sessions_per_node": per_server,
        "lb_retries": retries_lb,
        "lb_redispatches": redispatches_lb,
        "lb_ready_s": round(lb_ready, 1),
        "mesh_ready_s": round(mesh_ready, 1) if mesh_ready is not None else None,
    }
    checks = {
        "every request succeeded (one retry allowed)": failed == 0 and len(outcomes) == args.requests,
        "the stop command succeeded": notice.stop_rc == 0,
        "the LB took the stopped node out": notice.lb_down is not None,
    }
    if args.direct:
        checks[f"streamed TTFT through the LB within {args.ttft_margin_ms:g} ms of a direct node"] = ttft_ok
        result["ttft"] = ttft_txt
    if args.mesh:
        checks["every other node saw it dead or left"] = all(n in notice.mesh_seen for n in observers)
        checks["the other nodes still see each other alive"] = survivors_ok

    print(
        f"compose_check: sent {len(outcomes)} ({streamed} streamed) over {traffic_s:.1f} s: ok {ok}, "
        f"failed {failed}, retried by the client {retried}; latency p50 {result['latency_p50_s']} s, "
        f"max {result['latency_max_s']} s"
    )
    if errors:
        print(f"compose_check: attempt errors: {errors}")
    print(
        f"compose_check: {args.stop_cmd!r} at t={args.stop_at:.0f} s returned {notice.stop_rc} after "
        f"{result['stop_cmd_s']} s; LB marked {args.victim} {notice.lb_status or '?'} after "
        f"{result['lb_noticed_s']} s"
    )
    if args.mesh:
        seen = {n: since_stop(notice.mesh_seen.get(n)) for n in observers}
        views = ", ".join(f"{n}: {notice.mesh_state.get(n, '?')} after {seen[n]} s" for n in observers)
        print(f"compose_check: mesh view of {args.victim}: {views}; survivors {survivor_views}")
    print(
        f"compose_check: LB sessions per node during the test: "
        f"{ {s: v['sessions'] for s, v in per_server.items()} }, LB retries {retries_lb}, "
        f"redispatches {redispatches_lb}"
    )
    for name, held in checks.items():
        print(f"compose_check: [{'ok' if held else 'FAIL'}] {name}")
    result["checks"] = checks
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
