"""The load balancer in front of the fleet: HAProxy, its configuration and its runtime (stats) socket.

The configuration is what a careful operator would run in front of Shepherd nodes: active health checks on
``GET /readiness`` (a draining node answers 503 and leaves the pool), ``leastconn`` balancing, connection
retries with ``option redispatch`` (a retry goes to another server) and layer-7 retries on an empty
response, a response timeout or a 503 (the node that failed never answered, so the request is replayed on
another node). With ``fail_open`` every node is also an unchecked backup, used only when checks have
marked every node down. Timeouts are short because the suite's requests are short; ``timeout server`` is an
*inactivity* timeout, so long streams are not cut while tokens flow.
"""

from __future__ import annotations

import csv
import io
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PANIC_SUFFIX = "-panic"


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    address: str  # ip:port


@dataclass(frozen=True, slots=True)
class LbConfig:
    bind: str  # ip:port the clients use
    backends: tuple[Backend, ...]
    stats_socket: str
    check_path: str = "/readiness"
    check_inter_ms: int = 500
    check_fastinter_ms: int = 250
    check_timeout_ms: int = 2000
    fall: int = 2
    rise: int = 2
    connect_timeout_ms: int = 1000
    server_timeout_ms: int = 5000
    client_timeout_ms: int = 30000
    retries: int = 3
    retry_on: tuple[str, ...] = ("conn-failure", "empty-response", "response-timeout", "503")
    balance: str = "leastconn"
    maxconn: int = 4096
    # Fail open ("panic mode"): each node is also declared as an unchecked backup server, so when health
    # checks mark *every* node down (heavy packet loss also drops the checks) requests are still tried on
    # the nodes instead of all getting HAProxy's own 503. Backups are unused while any node is up.
    fail_open: bool = True
    extra_backend_lines: tuple[str, ...] = field(default=())

    @property
    def health_check_timeout_s(self) -> float:
        return self.check_timeout_ms / 1000.0


def render_haproxy(cfg: LbConfig) -> str:
    """The haproxy.cfg text for ``cfg`` (pure)."""
    lines = [
        "global",
        f"    maxconn {cfg.maxconn}",
        "    nbthread 1",
        f"    stats socket {cfg.stats_socket} mode 600 level admin",
        "    log stdout format raw local0 notice",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option dontlognull",
        # forward each SSE chunk at once: without it HAProxy merges small packets and streamed TTFT
        # through the balancer measured 150 ms p50 against 50 ms direct (issue 21)
        "    option http-no-delay",
        f"    timeout connect {cfg.connect_timeout_ms}ms",
        f"    timeout client {cfg.client_timeout_ms}ms",
        f"    timeout server {cfg.server_timeout_ms}ms",
        f"    timeout check {cfg.check_timeout_ms}ms",
        "    timeout http-request 10s",
        "    timeout http-keep-alive 10s",
        "    timeout queue 5s",
        f"    retries {cfg.retries}",
        "    option redispatch 1",
        f"    retry-on {' '.join(cfg.retry_on)}",
        "",
        "frontend fleet",
        f"    bind {cfg.bind}",
        "    default_backend nodes",
        "",
        "backend nodes",
        f"    balance {cfg.balance}",
        f"    option httpchk GET {cfg.check_path}",
        "    http-check expect status 200",
        f"    default-server check inter {cfg.check_inter_ms}ms fastinter {cfg.check_fastinter_ms}ms "
        f"downinter {cfg.check_inter_ms}ms fall {cfg.fall} rise {cfg.rise}",
        *(f"    {line}" for line in cfg.extra_backend_lines),
        *(f"    server {b.name} {b.address}" for b in cfg.backends),
        *(["    option allbackups"] if cfg.fail_open else []),
        *(
            f"    server {b.name}{PANIC_SUFFIX} {b.address} backup no-check"
            for b in cfg.backends
            if cfg.fail_open
        ),
        "",
    ]
    return "\n".join(lines)


def write_config(cfg: LbConfig, path: Path) -> Path:
    path.write_text(render_haproxy(cfg))
    return path


def haproxy_argv(config_path: Path) -> list[str]:
    """Run in the foreground (``-db``), one process; stopped by pid (SIGTERM: hard stop, SIGUSR1: soft)."""
    return ["haproxy", "-db", "-f", str(config_path)]


def runtime_command(sock_path: str, command: str, timeout: float = 2.0) -> str:
    """One command on HAProxy's runtime API (a unix socket: reachable from any network namespace)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(command.encode() + b"\n")
        chunks: list[bytes] = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


@dataclass(frozen=True, slots=True)
class ServerStat:
    name: str
    status: str  # UP, DOWN, MAINT, "UP 1/2" (going down), "DOWN 1/2" (coming up), no check: "no check"
    sessions_total: int  # stot: requests sent to it (HTTP mode: one per request)
    current: int  # scur
    check_status: str
    downtime_s: int

    @property
    def up(self) -> bool:
        return self.status.startswith("UP")


def parse_show_stat(text: str, backend: str = "nodes") -> dict[str, ServerStat]:
    """Parse ``show stat`` CSV into the servers of ``backend`` (pure)."""
    body = text.lstrip("# ")
    out: dict[str, ServerStat] = {}
    for row in csv.DictReader(io.StringIO(body)):
        if row.get("pxname") != backend or row.get("svname") in ("FRONTEND", "BACKEND", None):
            continue
        name = row["svname"]
        out[name] = ServerStat(
            name=name,
            status=row.get("status", ""),
            sessions_total=_int(row.get("stot")),
            current=_int(row.get("scur")),
            check_status=row.get("check_status", ""),
            downtime_s=_int(row.get("downtime")),
        )
    return out


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def server_stats(sock_path: str, backend: str = "nodes") -> dict[str, ServerStat]:
    return parse_show_stat(runtime_command(sock_path, "show stat"), backend)


def backends_for(names_addrs: Sequence[tuple[str, str]]) -> tuple[Backend, ...]:
    return tuple(Backend(n, a) for n, a in names_addrs)
