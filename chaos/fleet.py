"""A fleet on one machine: mock engines, Shepherd nodes and HAProxy, each in its own network namespace.

    10.213.0.2   lb        HAProxy :8080, health checks GET /readiness on every node
    10.213.0.3   client    the load generator and the harness's control calls
    10.213.0.11+ node-N    smg-node :30000 (worker URLs: every engine), optionally behind a delay proxy
    10.213.0.31+ engine-N  smg-mock-engine gRPC :50051, HTTP :18001 (/mock/faults)

The harness process stays in the root namespace; every HTTP call it makes runs in a thread that entered the
client namespace, so its traffic, like the load generator's, only crosses the suite's own bridge.
``Fleet`` is a context manager; ``close()`` also runs from ``atexit`` and stops every process by pid, then
deletes the namespaces (links and iptables rules go with them).

The mesh: with ``FleetSpec.mesh`` the nodes get ``mesh_args()`` (``--mesh-port``, the first node as the
seed to join through, a dev PKI shared in the run dir) and ``Fleet.mesh_members()`` reads
``GET /mesh/members`` (``chaos.mesh_watch`` polls it on every node); nothing else changes for the scenarios.
"""

from __future__ import annotations

import atexit
import contextlib
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from chaos import lb as lbmod
from chaos.delay_proxy import set_delay
from chaos.faults import Firewall
from chaos.netns import Host, Network, run_in_netns
from chaos.procs import HostProcess, rss_bytes, wait_until
from chaos.spec import (
    BIN,
    CLIENT_INDEX,
    ENGINE_BASE,
    LB_INDEX,
    NODE_BASE,
    PROXY_CONTROL_PORT,
    PROXY_PORT,
    REPO,
    FleetSpec,
    MeshPlace,
    mesh_args,
    mesh_available,
)

__all__ = ["Fleet", "FleetError", "FleetSpec", "Member", "MeshPlace", "mesh_args", "mesh_available"]


class FleetError(RuntimeError):
    """The fleet could not be built or brought back to health; the message points at the logs."""


def http_call(
    method: str, url: str, body: Any = None, timeout: float = 2.0
) -> tuple[int, Any]:  # status 0: no answer
    data = None if body is None else orjson.dumps(body)
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = int(r.status)
    except urllib.error.HTTPError as e:
        raw = e.read()
        status = int(e.code)
    except (OSError, ValueError):
        return 0, None
    try:
        return status, orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return status, raw.decode(errors="replace")


@dataclass
class Member:
    """A node or an engine of the fleet."""

    name: str
    index: int
    host: Host
    proc: HostProcess
    spare: bool = False
    proxy: HostProcess | None = None


@dataclass(eq=False)
class Fleet:
    spec: FleetSpec
    run_dir: Path
    run_id: str = field(default_factory=lambda: secrets.token_hex(2))
    net: Network = field(init=False)
    firewall: Firewall = field(default_factory=Firewall)
    lb_host: Host | None = None
    client: Host | None = None
    lb_proc: HostProcess | None = None
    lb_cfg: lbmod.LbConfig | None = None
    nodes: list[Member] = field(default_factory=list)
    engines: list[Member] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    # RSS samples of every node process over the fleet's life: (node, pid) -> [(time, bytes)]
    rss_log: dict[tuple[str, int], list[tuple[float, int]]] = field(default_factory=dict)
    _closed: bool = False

    def __post_init__(self) -> None:
        self.net = Network(self.run_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    # ---- building --------------------------------------------------------------------------------------

    def start(self) -> Fleet:
        _OPEN.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        spec = self.spec
        self.net.create()
        self.lb_host = self.net.add_host("lb", LB_INDEX)
        self.client = self.net.add_host("client", CLIENT_INDEX)
        for j in range(spec.engines):
            host = self.net.add_host(f"engine-{j + 1}", ENGINE_BASE + j)
            argv = [
                str(BIN / "smg-mock-engine"),
                "--host",
                "0.0.0.0",
                "--grpc-port",
                str(spec.engine_grpc_port),
                "--http-port",
                str(spec.engine_http_port),
                "--seed",
                str(j),
                *spec.model_args(engine=True),
                *spec.engine_args,
            ]
            proc = HostProcess(host.name, host.ns, argv, self.run_dir / f"{host.name}.log")
            self.engines.append(Member(host.name, j, host, proc))
        worker_urls = [f"grpc://{e.host.ip}:{spec.engine_grpc_port}" for e in self.engines]
        for i in range(spec.total_nodes):
            host = self.net.add_host(f"node-{i + 1}", NODE_BASE + i)
            self.nodes.append(self._node_member(i, host, worker_urls))
        for e in self.engines:
            e.proc.start()
        for e in self.engines:
            self._wait_engine(e)
        for n in self.active_nodes():
            n.proc.start()
            if n.proxy is not None:
                n.proxy.start()
        for n in self.active_nodes():
            self._wait_node(n)
        self._start_lb()
        if not self.wait_lb_all_up(timeout=30.0):
            raise FleetError(f"HAProxy did not see every node up: {self.lb_stats()}; logs in {self.run_dir}")

    def _node_member(self, i: int, host: Host, worker_urls: list[str]) -> Member:
        spec = self.spec
        first = f"{self.net.net[NODE_BASE]}:{spec.mesh_port}"
        place = MeshPlace(host.name, host.ip, () if i == 0 else (first,), str(self.run_dir / "mesh-pki"))
        argv = [
            str(BIN / "smg-node"),
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(spec.node_port),
            # the fleet lives in its own network namespaces and the suite reads /mesh/members from the
            # client host without credentials: an unauthenticated control plane there, said out loud
            "--insecure-admin",
            "--worker-urls",
            *worker_urls,
            "--policy",
            spec.policy,
            *spec.model_args(engine=False),
            *spec.node_args,
            *mesh_args(spec, place),
        ]
        proc = HostProcess(
            host.name, host.ns, argv, self.run_dir / f"{host.name}.log", env=dict(spec.node_env)
        )
        proxy = None
        if i in spec.delay_proxy_nodes:
            proxy = HostProcess(
                f"{host.name}-proxy",
                host.ns,
                [
                    sys.executable,
                    "-m",
                    "chaos.delay_proxy",
                    "--listen",
                    f"{host.ip}:{PROXY_PORT}",
                    "--target",
                    f"127.0.0.1:{spec.node_port}",
                    "--control",
                    f"{host.ip}:{PROXY_CONTROL_PORT}",
                ],
                self.run_dir / f"{host.name}-proxy.log",
                env={"PYTHONPATH": str(REPO)},
            )
        return Member(host.name, i, host, proc, spare=i >= spec.nodes, proxy=proxy)

    def _start_lb(self) -> None:
        assert self.lb_host is not None
        spec = self.spec
        backends = []
        for n in self.nodes:
            port = PROXY_PORT if n.proxy is not None else spec.node_port
            backends.append(lbmod.Backend(n.name, f"{n.host.ip}:{port}"))
        self.lb_cfg = lbmod.LbConfig(
            bind=f"{self.lb_host.ip}:{spec.lb_port}",
            backends=tuple(backends),
            stats_socket=str(self.run_dir / "haproxy.sock"),
            check_timeout_ms=spec.lb_check_timeout_ms,
            check_inter_ms=spec.lb_check_inter_ms,
            server_timeout_ms=spec.lb_server_timeout_ms,
        )
        cfg_path = lbmod.write_config(self.lb_cfg, self.run_dir / "haproxy.cfg")
        self.lb_proc = HostProcess(
            "lb", self.lb_host.ns, lbmod.haproxy_argv(cfg_path), self.run_dir / "lb.log"
        )
        self.lb_proc.start()
        sock = Path(self.lb_cfg.stats_socket)
        if (
            not wait_until(lambda: sock.exists() or not self.lb_proc_alive(), 15.0)
            or not self.lb_proc_alive()
        ):
            raise FleetError(f"HAProxy did not start: {self.lb_proc.log_tail()}")

    def lb_proc_alive(self) -> bool:
        return self.lb_proc is not None and self.lb_proc.alive()

    # ---- addresses and calls ------------------------------------------------------------------------

    @property
    def lb_url(self) -> str:
        assert self.lb_host is not None
        return f"http://{self.lb_host.ip}:{self.spec.lb_port}"

    @property
    def client_ns(self) -> str:
        assert self.client is not None
        return self.client.ns

    def node_url(self, n: Member) -> str:
        return f"http://{n.host.ip}:{self.spec.node_port}"

    def engine_url(self, e: Member) -> str:
        return f"http://{e.host.ip}:{self.spec.engine_http_port}"

    def call(self, method: str, url: str, body: Any = None, timeout: float = 2.0) -> tuple[int, Any]:
        """An HTTP call made from the client namespace."""
        return run_in_netns(self.client_ns, lambda: http_call(method, url, body, timeout))

    def active_nodes(self) -> list[Member]:
        return [n for n in self.nodes if not n.spare]

    def node(self, name_or_index: str | int) -> Member:
        if isinstance(name_or_index, int):
            return self.nodes[name_or_index]
        return next(n for n in self.nodes if n.name == name_or_index)

    def mark(self, what: str) -> float:
        now = time.monotonic()
        self.events.append((now, what))
        return now

    # ---- readiness -------------------------------------------------------------------------------------

    def _wait_engine(self, e: Member, timeout: float | None = None) -> None:
        limit = timeout or self.spec.start_timeout_s

        def ready() -> bool:
            tail = e.proc.log_tail(20000).rpartition("=== start")[2]
            return "mock engine ready" in tail or not e.proc.alive()

        if not wait_until(ready, limit, 0.1) or not e.proc.alive():
            raise FleetError(f"{e.name} did not start:\n{e.proc.log_tail()}")

    def node_ready(self, n: Member) -> bool:
        status, _ = self.call("GET", self.node_url(n) + "/readiness", timeout=1.0)
        return status == 200

    def _wait_node(self, n: Member, timeout: float | None = None) -> None:
        limit = timeout or self.spec.start_timeout_s
        if not wait_until(lambda: not n.proc.alive() or self.node_ready(n), limit, 0.2) or not n.proc.alive():
            raise FleetError(f"{n.name} did not become ready:\n{n.proc.log_tail()}")
        n.proc.ready_start = n.proc.starts

    def lb_stats(self) -> dict[str, lbmod.ServerStat]:
        if self.lb_cfg is None or not self.lb_proc_alive():
            return {}
        try:
            return lbmod.server_stats(self.lb_cfg.stats_socket)
        except OSError:
            return {}

    def wait_lb(self, name: str, up: bool, timeout: float) -> float | None:
        """Wait until HAProxy sees ``name`` up (or down); seconds waited, or None on timeout."""
        t0 = time.monotonic()

        def seen() -> bool:
            st = self.lb_stats().get(name)
            return st is not None and st.up == up and st.status in ("UP", "DOWN")

        return round(time.monotonic() - t0, 3) if wait_until(seen, timeout, 0.05) else None

    def wait_lb_all_up(self, timeout: float) -> bool:
        names = {n.name for n in self.active_nodes()}

        def all_up() -> bool:
            stats = self.lb_stats()
            return all(name in stats and stats[name].status == "UP" for name in names)

        return wait_until(all_up, timeout, 0.1)

    # ---- faults on processes -------------------------------------------------------------------------

    def crash_node(self, n: Member) -> float:
        at = self.mark(f"SIGKILL {n.name}")
        n.proc.kill()
        return at

    def start_node(self, n: Member, env: Mapping[str, str] | None = None, wait: bool = True) -> None:
        self.mark(f"start {n.name}" + (f" with {dict(env)}" if env else ""))
        n.proc.start(extra_env=env)
        if n.proxy is not None and not n.proxy.alive():
            n.proxy.start()
        if wait:
            self._wait_node(n)
            self.mark(f"{n.name} ready")

    def terminate_node(self, n: Member, timeout: float = 20.0) -> int | None:
        """SIGTERM: the node drains (readiness 503, in-flight requests finish) and exits."""
        self.mark(f"SIGTERM {n.name}")
        code = n.proc.stop(timeout=timeout)
        self.mark(f"{n.name} exited ({code})")
        return code

    def pause(self, m: Member) -> float:
        at = self.mark(f"SIGSTOP {m.name}")
        m.proc.pause()
        return at

    def resume(self, m: Member) -> None:
        m.proc.resume()
        self.mark(f"SIGCONT {m.name}")

    def crash_engine(self, e: Member) -> float:
        at = self.mark(f"SIGKILL {e.name}")
        e.proc.kill()
        return at

    def start_engine(self, e: Member) -> None:
        self.mark(f"start {e.name}")
        e.proc.start()
        self._wait_engine(e)
        self.mark(f"{e.name} ready")

    def engine_faults(self, e: Member, faults: Mapping[str, Any]) -> Any:
        status, body = self.call("POST", self.engine_url(e) + "/mock/faults", dict(faults))
        if status != 200:
            raise FleetError(f"/mock/faults on {e.name}: {status} {body}")
        self.mark(f"{e.name} faults {dict(faults)}")
        return body

    def engine_stats(self, e: Member) -> dict[str, Any]:
        status, body = self.call("GET", self.engine_url(e) + "/mock/stats")
        return body if status == 200 and isinstance(body, dict) else {}

    def set_node_delay(self, n: Member, delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Latency on the LB -> node path (each direction), through the node's delay proxy."""
        if n.proxy is None:
            raise FleetError(f"{n.name} has no delay proxy (FleetSpec.delay_proxy_nodes)")
        target = (n.host.ip, PROXY_CONTROL_PORT)
        run_in_netns(self.client_ns, lambda: set_delay(target, delay_ms, jitter_ms))
        self.mark(f"{n.name} link delay {delay_ms} ms (+{jitter_ms} jitter)")

    def node_rss(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            pid = n.proc.pid
            if pid is not None and n.proc.alive():
                rss = rss_bytes(pid)
                if rss is not None:
                    out[n.name] = rss
        return out

    # ---- mesh ------------------------------------------------------------------------------------------

    def mesh_members(self, n: Member) -> Any:
        """``GET /mesh/members`` of node ``n`` (the mesh's membership view)."""
        if not self.spec.mesh:
            raise FleetError("this fleet was built without the mesh (FleetSpec.mesh)")
        status, body = self.call("GET", self.node_url(n) + "/mesh/members")
        if status != 200:
            raise FleetError(f"/mesh/members on {n.name}: {status}")
        return body

    # ---- back to health, teardown ------------------------------------------------------------------

    def reset(self, timeout: float = 60.0) -> None:
        """Heal every fault and bring every process back, so the next scenario starts from a healthy fleet."""
        self.firewall.heal_all()
        for m in [*self.engines, *self.nodes]:
            if m.proc.paused:
                m.proc.resume()
        for e in self.engines:
            if not e.proc.alive():
                self.start_engine(e)
        for e in self.engines:
            self.call("POST", self.engine_url(e) + "/mock/faults", _NO_FAULTS)
        for n in self.nodes:
            if n.spare and n.proc.alive():
                n.proc.stop()
            if n.proxy is not None:
                if not n.proxy.alive():
                    n.proxy.start()
                with contextlib.suppress(Exception):
                    self.set_node_delay(n, 0.0)
        stale_env = [n for n in self.active_nodes() if n.proc.alive() and n.proc.starts and _had_env(n)]
        for n in stale_env:  # a node restarted with libfaketime gets a plain restart
            n.proc.stop()
        for n in self.active_nodes():
            if not n.proc.alive():
                self.start_node(n, wait=False)
        for n in self.active_nodes():
            self._wait_node(n, timeout)
        if not self.wait_lb_all_up(timeout):
            raise FleetError(f"fleet not healthy after reset: {self.lb_stats()}")
        self.events.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = [self.lb_proc] if self.lb_proc else []
        for n in self.nodes:
            procs += [p for p in (n.proxy, n.proc) if p is not None]
        procs += [e.proc for e in self.engines]
        for p in procs:  # stop them all at once, wait after: SIGCONT + SIGTERM, then SIGKILL
            if p.alive():
                p.resume()
                p.send(signal.SIGTERM)
        for p in procs:
            p.stop(timeout=8.0)
        self.firewall.heal_all()
        self.net.close()
        _OPEN.discard(self)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_NO_FAULTS = {
    "error_rate": 0.0,
    "stall_after_tokens": None,
    "stall_seconds": 0.0,
    "slow_factor": 1.0,
    "crash_after_requests": None,
    "hang_before_first_token": False,
}


def _had_env(n: Member) -> bool:
    """Was the running process started with extra environment (libfaketime)? Read from its log header."""
    header = n.proc.log_tail(20000).rpartition("=== start")[2].split("\n", 1)[0]
    return "LD_PRELOAD=" in header


_OPEN: set[Fleet] = set()
_OPEN_LOCK = threading.Lock()


def _close_all() -> None:
    with _OPEN_LOCK:
        for fleet in list(_OPEN):
            with contextlib.suppress(Exception):
                fleet.close()


atexit.register(_close_all)


@contextlib.contextmanager
def running_fleet(spec: FleetSpec, run_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(spec, run_dir)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()
