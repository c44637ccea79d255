"""The suite's private network: one network namespace per host, veth pairs to a bridge in its own namespace.

Nothing is created in the root namespace: each veth pair is created with one end directly in the host's
namespace (named ``eth0`` there) and the other in the bridge's namespace, so deleting the namespaces removes
every link, address and iptables rule the suite made. Every namespace is named ``smgc-<run>-<role>``, which
``chaos.cleanup`` uses to find leftovers of a run that died.

A thread may *enter* a namespace (``enter_netns``): the sockets it creates afterwards live there. The harness
runs its control code and load generator in threads inside the client namespace, so its traffic only goes
between namespaces it created.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

PREFIX = "smgc-"
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
DEFAULT_SUBNET = "10.213.0.0/24"
BRIDGE = "br0"

T = TypeVar("T")


class CommandError(RuntimeError):
    """A command the harness ran failed; the message holds its output."""


def sh(argv: Sequence[str], *, timeout: float = 15.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (no shell), bounded in time; raise CommandError with its output when ``check`` fails."""
    try:
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise CommandError(f"timed out after {timeout}s: {' '.join(argv)}") from e
    except FileNotFoundError as e:
        raise CommandError(f"not found: {argv[0]}") from e
    if check and res.returncode != 0:
        raise CommandError(
            f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip() or res.stdout.strip()}"
        )
    return res


def ns_path(name: str) -> Path:
    return NETNS_DIR / name


def ns_exists(name: str) -> bool:
    return ns_path(name).exists()


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix``."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def ns_pids(name: str) -> list[int]:
    """Pids of the processes in namespace ``name`` (empty when it is gone)."""
    res = sh(["ip", "netns", "pids", name], check=False, timeout=10.0)
    return [int(tok) for tok in res.stdout.split() if tok.isdigit()]


def add_ns(name: str) -> None:
    sh(["ip", "netns", "add", name])
    sh(["ip", "-n", name, "link", "set", "lo", "up"])


def delete_ns(name: str) -> None:
    if ns_exists(name):
        sh(["ip", "netns", "delete", name], check=False)


_libc: ctypes.CDLL | None = None


def enter_netns(name: str) -> None:
    """Move the *calling thread* into network namespace ``name`` (setns(2)); other threads are unaffected."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(ns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in_netns(name: str, fn: Callable[[], T], *, thread_name: str = "smgc-ns") -> T:
    """Run ``fn()`` in a new thread that entered namespace ``name``; return its result or raise its error."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            enter_netns(name)
            box["result"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    th = threading.Thread(target=body, name=thread_name, daemon=True)
    th.start()
    th.join()
    if "error" in box:
        err = box["error"]
        assert isinstance(err, BaseException)
        raise err
    return box["result"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the suite cannot build its network here, or None when it can (root, ``ip``, netns, veth)."""
    if os.geteuid() != 0:
        return "the chaos suite needs root (network namespaces, iptables)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed: run chaos/install.sh"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        add_ns(probe)
        sh(["ip", "-n", probe, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"])
    except CommandError as e:
        return f"network namespaces or veth pairs are not available: {e}"
    finally:
        delete_ns(probe)
    return None


@dataclass(frozen=True, slots=True)
class Host:
    """A host of the test network: its namespace and its address on the bridge."""

    name: str
    ns: str
    ip: str


class Network:
    """A bridge in namespace ``smgc-<run>-br`` and hosts attached to it, each in its own namespace.

    A context manager: leaving it deletes every namespace it created (and with them their links and rules).
    """

    def __init__(self, run_id: str, subnet: str = DEFAULT_SUBNET) -> None:
        self.run_id = run_id
        self.net = ipaddress.ip_network(subnet)
        self.bridge_ns = f"{PREFIX}{run_id}-br"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._lock = threading.Lock()
        self._next_port = 0

    def ns_name(self, role: str) -> str:
        return f"{PREFIX}{self.run_id}-{role}"

    def create(self) -> None:
        add_ns(self.bridge_ns)
        self._namespaces.append(self.bridge_ns)
        sh(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
        sh(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])

    def add_host(self, name: str, host_index: int) -> Host:
        """A new namespace ``smgc-<run>-<name>`` whose ``eth0`` has address ``subnet[host_index]``."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        ip = str(self.net[host_index])
        ns = self.ns_name(name)
        add_ns(ns)
        with self._lock:
            self._namespaces.append(ns)
            self._next_port += 1
            port = f"p{self._next_port}"
        sh(
            [
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.bridge_ns,
            ]
        )
        sh(["ip", "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE])
        sh(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
        sh(["ip", "-n", ns, "addr", "add", f"{ip}/{self.net.prefixlen}", "dev", "eth0"])
        sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        host = Host(name=name, ns=ns, ip=ip)
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Delete every namespace this network created (processes inside must be stopped first)."""
        for ns in reversed(self._namespaces):
            delete_ns(ns)
        self._namespaces.clear()
        self.hosts.clear()

    def __enter__(self) -> Network:
        self.create()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
