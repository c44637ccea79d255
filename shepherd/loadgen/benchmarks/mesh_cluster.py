"""The processes of ``smg-bench mesh``: mock engines and ``smg-node`` processes on loopback.

``Setup`` holds what every process shares (the mock engines, a development PKI in a temp dir, the
mesh's probe settings) and builds their command lines: every node routes to all engines with
``cache_aware``, meshed (``--mesh-port``, ``smg-node join`` its seeds) or alone. ``Cluster`` grows
meshed nodes n0, n1, ... (n0 and n1 the seeds), kills and restarts them, and waits until the members
see each other alive. ``http_request``, ``get_json`` and ``wait_until`` are the plain HTTP and polling
helpers the measurements use.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shepherd.loadgen.procs import ManagedProcess, ProcessGroup, ProcSpec, free_port
from shepherd.loadgen.targets import console_script

__all__ = ["MODEL", "Cluster", "Procs", "Setup", "Slot", "get_json", "http_request", "wait_until"]

MODEL = "qwen3"


# ---- HTTP --------------------------------------------------------------------------------------------


def http_request(
    port: int, method: str, path: str, body: Any = None, timeout: float = 10.0
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else orjson.dumps(body)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    return resp.status, json.loads(raw) if raw else None


def get_json(port: int, path: str) -> Any:
    status, data = http_request(port, "GET", path)
    if status != 200:
        raise RuntimeError(f"GET {path} on port {port}: HTTP {status}")
    return data


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 120.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except (OSError, RuntimeError, ValueError):
            pass  # a node not up yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(step)


# ---- processes ---------------------------------------------------------------------------------------


@dataclass
class Slot:
    name: str
    http: int
    mesh: int
    proc: ManagedProcess | None = None


class Procs(ProcessGroup):
    """A ``ProcessGroup`` that can start several processes before waiting for any."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.started: list[ManagedProcess] = []

    def __enter__(self) -> Procs:
        return self

    def launch(self, spec: ProcSpec) -> ManagedProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = ManagedProcess(spec, self.log_dir)
        self.started.append(proc)
        proc.start()
        return proc

    def stop_all(self) -> None:
        super().stop_all()
        while self.started:
            proc = self.started.pop()
            with contextlib.suppress(Exception):
                proc.stop()


@dataclass
class Setup:
    group: Procs
    model_dir: Path
    pki: Path
    engines: list[tuple[int, int]]  # (grpc, http)
    probe_interval: float | None
    kv_events: bool
    suspicion_mult: int | None = None

    def engine_spec(self, i: int) -> ProcSpec:
        grpc, http_port = self.engines[i]
        argv = [
            *console_script("smg-mock-engine", "shepherd.mock_engine.cli"),
            "--grpc-port", str(grpc), "--http-port", str(http_port), "--model", MODEL,
            "--tokenizer", str(self.model_dir), "--seed", "0",
            "--decode-ms-per-token", "1", "--cache-blocks", "32768", "--max-running", "256",
        ]  # fmt: skip
        return ProcSpec(name=f"engine-{i}", argv=tuple(argv), ready_port=http_port, ready_path="/health")

    def node_spec(self, slot: Slot, seeds: Sequence[Slot], meshed: bool = True) -> ProcSpec:
        argv = [
            *console_script("smg-node", "shepherd.node.cli"),
            "join" if seeds and meshed else "serve",
            *([f"127.0.0.1:{s.mesh}" for s in seeds] if meshed else []),
            "--host", "127.0.0.1", "--port", str(slot.http),
            "--worker-urls", *(f"grpc://127.0.0.1:{g}" for g, _ in self.engines),
            "--model-path", str(self.model_dir), "--model-id", MODEL,
            "--policy", "cache_aware", "--tokenizer-workers", "0", "--log-level", "warning",
        ]  # fmt: skip
        if not self.kv_events:
            argv.append("--no-kv-events")
        if meshed:
            argv += ["--mesh-port", str(slot.mesh), "--mesh-name", slot.name, "--mesh-dev-pki", str(self.pki)]
            if self.probe_interval is not None:
                argv += ["--mesh-probe-interval", str(self.probe_interval)]
            if self.suspicion_mult is not None:
                argv += ["--mesh-suspicion-mult", str(self.suspicion_mult)]
        return ProcSpec(
            name=slot.name,
            argv=tuple(argv),
            ready_port=slot.http,
            ready_path="/readiness",
            ready_timeout_s=240,
        )

    def start(self, specs: Sequence[ProcSpec]) -> list[ManagedProcess]:
        """Start ``specs`` at once, then wait until all are ready (readiness polled in threads; the
        processes are forked by this thread: their parent-death signal follows the forking thread)."""
        procs = [self.group.launch(spec) for spec in specs]
        if procs:
            with ThreadPoolExecutor(len(procs)) as ex:
                list(ex.map(ManagedProcess.wait_ready, procs))
        return procs


class Cluster:
    """Meshed nodes n0, n1, ...; n0 (and n1) are the seeds of the others."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.slots: list[Slot] = []

    def seeds(self, slot: Slot) -> list[Slot]:
        return [s for s in self.slots[:2] if s is not slot]

    def grow(self, n: int) -> None:
        new = [Slot(f"n{i}", free_port(), free_port()) for i in range(len(self.slots), n)]
        self.slots += new
        procs = self.setup.start([self.setup.node_spec(s, self.seeds(s)) for s in new])
        for s, p in zip(new, procs, strict=True):
            s.proc = p
        self.wait_converged()

    def members(self, slot: Slot) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in get_json(slot.http, "/mesh/members")["members"]}

    def wait_converged(self) -> None:
        names = {s.name for s in self.slots}

        def ok() -> bool:
            return all(
                {k for k, m in self.members(s).items() if m["state"] == "alive"} == names for s in self.slots
            )

        wait_until(ok, f"{len(names)} nodes to see each other alive")

    def kill(self, slot: Slot) -> float:
        assert slot.proc is not None
        t = time.time()
        os.kill(slot.proc.pid, signal.SIGKILL)
        slot.proc.stop(grace_s=2)  # reaps it
        return t

    def restart(self, slot: Slot) -> None:
        (slot.proc,) = self.setup.start([self.setup.node_spec(slot, self.seeds(slot))])
        self.wait_converged()
