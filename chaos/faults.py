"""Network faults between test hosts: partitions, one-way partitions, flapping partitions, packet loss.

All of them are iptables DROP rules inside the *receiving* host's namespace (INPUT chain), matched by source
address, so they only touch traffic between the suite's own hosts. Each rule carries the comment ``smgc``;
``Firewall.heal_all`` removes every rule it added, and deleting a namespace removes whatever is left.

Semantics, for TCP and UDP:
- ``partition(a, b)``: nothing from side a reaches side b and nothing from b reaches a.
- ``one_way(src, dst)``: packets from src are dropped at dst; dst's packets still reach src. UDP (SWIM
  probes) sees a true one-way link; a TCP handshake from either side fails (the SYN or the SYN-ACK is lost).
- ``loss(host, p, sources)``: each packet from ``sources`` (all, when empty) to ``host`` is dropped with
  probability p (``-m statistic --mode random``).
Latency is not here (this kernel has no ``tc netem``): see ``chaos.delay_proxy``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from chaos.netns import Host, run_in_netns, sh

COMMENT = "smgc"


@dataclass(frozen=True, slots=True)
class Rule:
    ns: str
    chain: str
    spec: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.ns}: -A {self.chain} {' '.join(self.spec)}"


class Firewall:
    """The iptables rules the harness added, so any fault can be healed and every rule removed on exit."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self._lock = threading.Lock()

    def add(self, ns: str, chain: str, *spec: str) -> Rule:
        rule = Rule(ns, chain, (*spec, "-m", "comment", "--comment", COMMENT, "-j", "DROP"))
        sh(["ip", "netns", "exec", ns, "iptables", "-w", "5", "-I", chain, *rule.spec])
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule not in self.rules:
                return
            self.rules.remove(rule)
        sh(["ip", "netns", "exec", rule.ns, "iptables", "-w", "5", "-D", rule.chain, *rule.spec], check=False)

    def heal_all(self) -> None:
        for rule in list(self.rules):
            self.remove(rule)


def list_rules(ns: str) -> list[str]:
    """The suite's rules in namespace ``ns`` as ``iptables -S`` prints them."""
    res = sh(["ip", "netns", "exec", ns, "iptables", "-w", "5", "-S"], check=False)
    return [line for line in res.stdout.splitlines() if COMMENT in line]


@dataclass
class Fault:
    """Rules that make up one fault; ``heal()`` removes them (idempotent). A context manager."""

    firewall: Firewall
    description: str
    rules: list[Rule] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def heal(self) -> None:
        for rule in self.rules:
            self.firewall.remove(rule)
        self.rules.clear()

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def __enter__(self) -> Fault:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.heal()


def _names(hosts: Sequence[Host]) -> str:
    return ",".join(h.name for h in hosts)


def one_way(fw: Firewall, src: Sequence[Host], dst: Sequence[Host]) -> Fault:
    """Packets from any host of ``src`` are dropped when they arrive at any host of ``dst``."""
    fault = Fault(fw, f"one-way {_names(src)} -> {_names(dst)} dropped")
    for d in dst:
        for s in src:
            fault.rules.append(fw.add(d.ns, "INPUT", "-s", s.ip))
    return fault


def partition(fw: Firewall, side_a: Sequence[Host], side_b: Sequence[Host]) -> Fault:
    """No packet crosses between ``side_a`` and ``side_b``, either way."""
    fault = one_way(fw, side_a, side_b)
    back = one_way(fw, side_b, side_a)
    fault.rules.extend(back.rules)
    fault.description = f"partition {_names(side_a)} | {_names(side_b)}"
    return fault


def loss(fw: Firewall, hosts: Sequence[Host], probability: float, sources: Sequence[Host] = ()) -> Fault:
    """Each packet arriving at ``hosts`` (from ``sources``; from anywhere when empty) is dropped with
    ``probability``."""
    if not 0.0 < probability <= 1.0:
        raise ValueError("probability must be in (0, 1]")
    p = f"{probability:.4f}"
    fault = Fault(
        fw, f"loss {probability:.0%} into {_names(hosts)}" + (f" from {_names(sources)}" if sources else "")
    )
    stat = ("-m", "statistic", "--mode", "random", "--probability", p)
    for h in hosts:
        if sources:
            for s in sources:
                fault.rules.append(fw.add(h.ns, "INPUT", "-s", s.ip, *stat))
        else:
            fault.rules.append(fw.add(h.ns, "INPUT", "-i", "eth0", *stat))
    return fault


class Flapper:
    """A partition that comes and goes: ``period_s`` partitioned, ``period_s`` healed, ..., for at most
    ``duration_s`` (a background thread; ``stop()`` heals and joins). Counts the flips it made."""

    def __init__(
        self, fw: Firewall, side_a: Sequence[Host], side_b: Sequence[Host], period_s: float, duration_s: float
    ) -> None:
        if period_s <= 0 or duration_s <= 0:
            raise ValueError("period_s and duration_s must be > 0")
        self.fw = fw
        self.side_a = list(side_a)
        self.side_b = list(side_b)
        self.period_s = period_s
        self.duration_s = duration_s
        self.flips = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fault: Fault | None = None

    def start(self) -> Flapper:
        self._thread = threading.Thread(target=self._run, name="smgc-flapper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.duration_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self._fault is None:
                self._fault = partition(self.fw, self.side_a, self.side_b)
            else:
                self._fault.heal()
                self._fault = None
            self.flips += 1
            self._stop.wait(min(self.period_s, max(0.0, deadline - time.monotonic())))
        if self._fault is not None:
            self._fault.heal()
            self._fault = None

    def wait(self) -> None:
        """Wait until the flapping ends by itself (``duration_s`` after start), healed."""
        if self._thread is not None:
            self._thread.join(timeout=self.duration_s + 10.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.duration_s + 10.0)
        if self._fault is not None:
            self._fault.heal()
            self._fault = None

    def __enter__(self) -> Flapper:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# ---- probes: does traffic cross? (used by the primitive checks and the tests) ---------------------------


@contextlib.contextmanager
def tcp_listener(host: Host, port: int) -> Iterator[socket.socket]:
    """A listening TCP socket on ``host`` (created inside its namespace). The kernel completes handshakes
    into the backlog, so connects succeed without an accept loop."""

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.ip, port))
        s.listen(64)
        return s

    sock = run_in_netns(host.ns, make)
    try:
        yield sock
    finally:
        sock.close()


def tcp_connects(src: Host, dst_ip: str, port: int, timeout: float = 0.5) -> bool:
    """Can ``src`` open a TCP connection to ``dst_ip:port`` within ``timeout``?"""

    def attempt() -> bool:
        try:
            with socket.create_connection((dst_ip, port), timeout=timeout):
                return True
        except OSError:
            return False

    return run_in_netns(src.ns, attempt)


def udp_delivers(src: Host, dst: Host, port: int, timeout: float = 0.5, tries: int = 3) -> bool:
    """Does a UDP datagram from ``src`` reach ``dst:port``? (``tries`` datagrams, each waited ``timeout``)."""

    def make_rx() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((dst.ip, port))
        s.settimeout(timeout)
        return s

    def make_tx() -> socket.socket:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    rx = run_in_netns(dst.ns, make_rx)
    tx = run_in_netns(src.ns, make_tx)
    try:
        for i in range(tries):
            tx.sendto(f"smgc-probe-{i}".encode(), (dst.ip, port))
            try:
                data, _ = rx.recvfrom(256)
            except TimeoutError:
                continue
            if data.startswith(b"smgc-probe-"):
                return True
        return False
    finally:
        rx.close()
        tx.close()
