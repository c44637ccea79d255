"""End to end: ``smg-node serve --procs 2``: two event-loop processes on one port, meshed on loopback.

A connection lands on one process (SO_REUSEPORT); ``GET /mesh/members`` on a keep-alive connection says
which (``node``), and the requests after it on that connection go to the same process. Checked: both
processes accept on the port, a worker added through the admin API on one is routable on both (the
first worker deleted, so that it is the only one), a rate limit holds across both, a killed process is
started again, and SIGTERM to the parent stops every process.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shepherd.node.config import EMBEDDED_MODEL_DIR
from tests.e2e.node_procs import NodeProc, free_port, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

START_S = 240.0  # two nodes starting at once on a loaded 2-core machine
RPM = 6


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Conn:
    """One keep-alive connection: one process of the node."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        status, body = self.call("GET", "/mesh/members")
        assert status == 200, body
        self.node: str = body["node"]
        self.members = body["members"]

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        self.http.request(method, path, body=data, headers=hdrs)
        resp = self.http.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return resp.status, parsed

    def close(self) -> None:
        self.http.close()


def connections(port: int, per_node: int, limit: int = 400) -> dict[str, list[Conn]]:
    """Open connections until each of the two processes holds ``per_node`` of them (bounded)."""
    by_node: dict[str, list[Conn]] = {}
    spare: list[Conn] = []
    for _ in range(limit):
        c = Conn(port)
        got = by_node.setdefault(c.node, [])
        (got if len(got) < per_node else spare).append(c)
        if len(by_node) == 2 and all(len(v) >= per_node for v in by_node.values()):
            break
    for c in spare:
        c.close()
    assert len(by_node) == 2, f"connections reached only {sorted(by_node)}"
    assert all(len(v) >= per_node for v in by_node.values()), {k: len(v) for k, v in by_node.items()}
    return by_node


def close_all(by_node: dict[str, list[Conn]]) -> None:
    for conns in by_node.values():
        for c in conns:
            c.close()


_TENANTS = iter(range(1_000_000))


def chat(conn: Conn, tenant: str | None = None) -> tuple[int, Any]:
    """One chat request; by default as a tenant of its own (each tenant has RPM requests a minute)."""
    tenant = tenant if tenant is not None else f"tenant-{next(_TENANTS)}"
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, got = conn.call("POST", "/v1/chat/completions", body, {"x-smg-tenant": tenant})
    return int(status), got


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MockEngineProc, MockEngineProc]]:
    with start_mock_engine("--zero-latency") as a, start_mock_engine("--zero-latency") as b:
        yield a, b


@pytest.fixture(scope="module")
def node(engines: tuple[MockEngineProc, MockEngineProc]) -> Iterator[NodeProc]:
    first, _ = engines
    port = free_port()
    n = spawn_node(
        "serve",
        "--worker-urls",
        f"grpc://127.0.0.1:{first.grpc_port}",
        "--model-path",
        str(EMBEDDED_MODEL_DIR),
        "--model-id",
        "qwen3",
        "--tokenizer-workers",
        "0",
        "--rate-limit-rpm",
        str(RPM),
        "--auth-trust-tenant-header",
        "--procs",
        "2",
        port=port,
    )
    try:
        deadline = time.monotonic() + START_S
        seen: set[str] = set()
        while time.monotonic() < deadline and len(seen) < 2:
            assert n.proc.poll() is None, n.log()
            with contextlib.suppress(OSError, AssertionError, http.client.HTTPException):
                c = Conn(port)
                c.close()
                if sum(1 for m in c.members if m["state"] == "alive") == 2:
                    seen.add(c.node)
            time.sleep(0.2)
        assert len(seen) == 2, f"both processes not up in {START_S}s (saw {seen}):\n{n.log()}"
        yield n
    finally:
        pids = children(n.pid)
        n.stop(timeout=60.0)
        for pid in pids:  # the parent kills what its drain left; belt and braces for a failed test
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_both_processes_serve_on_one_port(node: NodeProc) -> None:
    by_node = connections(node.port, per_node=2)
    try:
        assert len(children(node.pid)) == 2
        for name, conns in by_node.items():
            assert name.endswith(("-p0", "-p1"))
            for c in conns:
                status, body = chat(c)
                assert status == 200, body
                assert body["choices"][0]["message"]["content"]
    finally:
        close_all(by_node)


def test_rate_limit_holds_across_processes(node: NodeProc) -> None:
    by_node = connections(node.port, per_node=RPM + 2)
    try:
        admitted = {name: 0 for name in by_node}
        limited = 0
        # alternate between the processes: each alone would admit RPM of its RPM + 2
        for i in range(RPM + 2):
            for name, conns in by_node.items():
                status, body = chat(conns[i], tenant="limited-tenant")
                if status == 200:
                    admitted[name] += 1
                else:
                    assert status == 429, body
                    limited += 1
        total = sum(admitted.values())
        assert 0 < total <= RPM, admitted
        assert limited == 2 * (RPM + 2) - total
    finally:
        close_all(by_node)


def test_worker_added_on_one_process_is_routable_on_both(
    node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc]
) -> None:
    first, second = engines
    by_node = connections(node.port, per_node=1)
    (a,), (b,) = by_node.values()
    try:
        status, body = a.call(
            "POST", "/workers", {"url": f"grpc://127.0.0.1:{second.grpc_port}", "model_id": "qwen3"}
        )
        assert status in (200, 201, 202), body
        status, listed = a.call("GET", "/workers")
        old = [w for w in listed["workers"] if w["url"] == f"grpc://127.0.0.1:{first.grpc_port}"]
        assert len(old) == 1, listed
        status, body = a.call("DELETE", f"/workers/{old[0]['id']}")
        assert status in (200, 202, 204), body
        want = [f"grpc://127.0.0.1:{second.grpc_port}"]
        deadline = time.monotonic() + 30.0
        urls: list[str] = []
        while time.monotonic() < deadline:  # the mesh replicates the registry to the other process
            status, listed = b.call("GET", "/workers")
            urls = [w["url"] for w in listed["workers"]]
            healthy = all(w["healthy"] for w in listed["workers"])
            if urls == want and healthy:
                break
            time.sleep(0.1)
        assert urls == want, f"{b.node} still lists {urls}"
        for c in (a, b):  # both route to the added worker, the only one left
            for _ in range(3):
                status, got = chat(c)
                assert status == 200, (c.node, got)
    finally:
        close_all(by_node)


def _requests_by_proc(conn: Conn) -> dict[str, float]:
    """``smg_requests_total`` of chat completions with status 200, per ``proc`` label, from one scrape."""
    conn.http.request("GET", "/metrics")
    text = conn.http.getresponse().read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            labels = smp.labels
            if smp.name == "smg_requests_total" and (labels.get("route"), labels.get("status")) == (
                "/v1/chat/completions",
                "200",
            ):
                out[labels["proc"]] = out.get(labels["proc"], 0.0) + smp.value
    return out


def test_metrics_show_every_process_whichever_answers(node: NodeProc) -> None:
    by_node = connections(node.port, per_node=1)
    (a,), (b,) = by_node.values()
    try:
        before = _requests_by_proc(a)
        served = {a.node: 0, b.node: 0}
        for c, n in ((a, 3), (b, 1)):
            for _ in range(n):
                status, got = chat(c)
                assert status == 200, got
                served[c.node] += 1
        want = {name[-1]: before.get(name[-1], 0.0) + k for name, k in served.items()}
        # a scrape on either process: both processes' series, each under its proc label, the same figures
        assert _requests_by_proc(a) == want
        assert _requests_by_proc(b) == want
    finally:
        close_all(by_node)


def test_a_killed_process_is_started_again_and_sigterm_stops_all(node: NodeProc) -> None:
    before = children(node.pid)
    assert len(before) == 2
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + START_S
    now: list[int] = before
    while time.monotonic() < deadline:
        now = children(node.pid)
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(0.2)
    assert len(now) == 2 and before[0] not in now, now
    seen: set[str] = set()
    while time.monotonic() < deadline and len(seen) < 2:  # the new one serves again
        with contextlib.suppress(OSError, AssertionError, http.client.HTTPException):
            c = Conn(node.port)
            c.close()
            seen.add(c.node)
        time.sleep(0.1)
    assert len(seen) == 2, seen
    assert node.stop(timeout=60.0) == 0, node.log()
    for pid in now:
        assert not alive(pid), f"process {pid} outlived the parent's SIGTERM"
