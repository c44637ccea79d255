"""DNS seeds end to end: real nodes in the chaos harness's network namespaces join through
``dns:shepherd-mesh.ns.svc:39527``, served by a real DNS server (dnsmasq, installed by chaos/install.sh)
in a namespace of its own, the way a Kubernetes headless service lists its pods.

1. the name does not resolve yet: the nodes (``smg-node join dns:...``) keep retrying, alone;
2. the name gets the nodes' A records (and an AAAA one nobody answers at): they find each other;
3. a new node starts with no seed at all (a restarted service's new pod that came up alone) and the
   name lists it: the others, resolving again while the mesh is small, bring it in.

Needs root, network namespaces and dnsmasq. Without them it is skipped with the reason, unless CI=true:
then it installs the packages (chaos/install.sh) and must run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.fleet import http_call
from chaos.netns import Host, Network, run_in_netns
from chaos.procs import HostProcess
from chaos.run import INSTALL_SCRIPT, preflight
from chaos.spec import BIN, SMALL_MODEL_DIR

IN_CI = os.environ.get("CI", "").lower() == "true"
NAME = "shepherd-mesh.ns.svc"
MESH_PORT = 39527
NODE_PORT = 30000
UNREACHABLE_V6 = "fd00:213::99"  # an AAAA record of the name: resolved, dialled, never answers
NETNS_ETC = Path("/etc/netns")

pytestmark = pytest.mark.timeout(240)


def _ready_or_skip() -> None:
    if IN_CI and os.geteuid() == 0:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True, timeout=600)
    reason = preflight()
    if reason is None and shutil.which("dnsmasq") is None:
        reason = "dnsmasq is not installed (run chaos/install.sh as root)"
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI=true but the DNS seed test cannot run: {reason}")
    pytest.skip(f"DNS seed test unavailable: {reason}")


class Dns:
    """dnsmasq answering for ``NAME`` from a hosts file the test rewrites (SIGHUP reloads it)."""

    def __init__(self, host: Host, root: Path) -> None:
        self.hosts = root / "mesh.hosts"
        self.hosts.write_text("")
        argv = [
            shutil.which("dnsmasq") or "dnsmasq",
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts}",
            f"--listen-address={host.ip}",
            "--bind-interfaces",
            "--port=53",
            "--local-ttl=0",
            "--user=root",  # reads the hosts file under the test's private tmp dir
            "--pid-file=",
            "--log-queries",
            "--log-facility=-",
        ]
        self.proc = HostProcess("dnsmasq", host.ns, argv, root / "dnsmasq.log")

    def publish(self, records: list[str]) -> None:
        self.hosts.write_text("".join(f"{ip} {NAME}\n" for ip in records))
        self.proc.send(signal.SIGHUP)


class Nodes:
    def __init__(self, net: Network, dns: Host, root: Path) -> None:
        self.net, self.dns, self.root = net, dns, root
        self.procs: dict[str, HostProcess] = {}
        self.hosts: dict[str, Host] = {}

    def start(self, name: str, index: int, seeds: list[str]) -> None:
        host = self.net.add_host(name, index)
        etc = NETNS_ETC / host.ns  # `ip netns exec` mounts this resolv.conf over /etc/resolv.conf
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(f"nameserver {self.dns.ip}\noptions timeout:1 attempts:2\n")
        command = ["join", *seeds] if seeds else ["serve"]
        argv = [
            str(BIN / "smg-node"),
            *command,
            *("--host", "0.0.0.0", "--port", str(NODE_PORT), "--insecure-admin"),
            *("--model-path", str(SMALL_MODEL_DIR), "--tokenizer-workers", "0", "--log-level", "info"),
            *("--mesh-port", str(MESH_PORT), "--mesh-name", name, "--mesh-bind", host.ip),
            *("--mesh-dev-pki", str(self.root / "pki"), "--mesh-dns-refresh-interval", "2"),
        ]
        proc = HostProcess(name, host.ns, argv, self.root / f"{name}.log")
        self.procs[name], self.hosts[name] = proc, host
        proc.start()

    def get(self, name: str, path: str) -> Any:
        url = f"http://{self.hosts[name].ip}:{NODE_PORT}{path}"
        status, body = run_in_netns(self.dns.ns, lambda: http_call("GET", url, timeout=2.0))
        return body if status == 200 else None

    def members(self, name: str) -> dict[str, str]:
        body = self.get(name, "/mesh/members")
        rows = body.get("members") if isinstance(body, dict) else body
        return {m["name"]: m["state"] for m in rows} if isinstance(rows, list) else {}

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.log_tail(3000)}" for n, p in self.procs.items())


def wait_for(cond: Callable[[], bool], timeout: float, what: str, nodes: Nodes) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        for n, p in nodes.procs.items():
            if not p.alive():
                pytest.fail(f"{n} exited waiting for {what}:\n{nodes.logs()}")
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout} s\n{nodes.logs()}")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Network, Dns, Nodes]]:
    _ready_or_skip()
    net = Network("d" + secrets.token_hex(2)[:3])
    dns: Dns | None = None
    nodes: Nodes | None = None
    try:
        net.create()
        dns_host = net.add_host("dns", 2)
        dns = Dns(dns_host, tmp_path)
        dns.proc.start()
        nodes = Nodes(net, dns_host, tmp_path)
        yield net, dns, nodes
    finally:
        for p in nodes.procs.values() if nodes is not None else ():
            p.stop(timeout=10.0)
        if dns is not None:
            dns.proc.stop(timeout=5.0)
        for h in nodes.hosts.values() if nodes is not None else ():
            shutil.rmtree(NETNS_ETC / h.ns, ignore_errors=True)
        net.close()


def test_nodes_join_through_a_dns_name(world: tuple[Network, Dns, Nodes]) -> None:
    _, dns, nodes = world
    seed = f"dns:{NAME}:{MESH_PORT}"
    nodes.start("node-1", 11, [seed])
    nodes.start("node-2", 12, [seed])
    wait_for(lambda: all(nodes.members(n) for n in ("node-1", "node-2")), 60.0, "the nodes answer", nodes)

    # 1. the name does not resolve yet: each node retries, alone
    def failed_resolving(n: str) -> bool:
        st = nodes.get(n, "/mesh/state")
        d = (st or {}).get("runtime", {}).get("dns_seeds") or {}
        return int(d.get("resolve_failures", 0)) >= 2

    wait_for(lambda: all(failed_resolving(n) for n in ("node-1", "node-2")), 30.0, "retries", nodes)
    assert nodes.members("node-1") == {"node-1": "alive"}
    assert nodes.members("node-2") == {"node-2": "alive"}

    # 2. the name lists both nodes (A) and an address nobody answers at (AAAA): they find each other
    dns.publish([nodes.hosts["node-1"].ip, nodes.hosts["node-2"].ip, UNREACHABLE_V6])
    pair = {"node-1": "alive", "node-2": "alive"}
    joined_s = wait_for(
        lambda: nodes.members("node-1") == pair and nodes.members("node-2") == pair, 45.0, "joined", nodes
    )

    # the node whose resolution succeeded first joined the other, which may not have resolved since (it
    # is joined now and re-resolves only every refresh interval): one of them holds every record
    def resolved_every_record(n: str) -> bool:
        d = ((nodes.get(n, "/mesh/state") or {}).get("runtime", {}).get("dns_seeds")) or {}
        addresses = d.get("addresses") or []
        wanted = (f"{UNREACHABLE_V6}:{MESH_PORT}", f"{nodes.hosts['node-1'].ip}:{MESH_PORT}")
        return all(a in addresses for a in wanted)  # every AAAA record too

    wait_for(lambda: any(resolved_every_record(n) for n in ("node-1", "node-2")), 30.0, "A and AAAA", nodes)

    # 3. a new node comes up alone (no seed) and the name lists it: the small mesh re-resolves, finds it
    nodes.start("node-3", 13, [])
    wait_for(lambda: nodes.members("node-3") == {"node-3": "alive"}, 60.0, "node-3 up, alone", nodes)
    dns.publish([h.ip for h in nodes.hosts.values()])
    trio = {"node-1": "alive", "node-2": "alive", "node-3": "alive"}
    found_s = wait_for(lambda: all(nodes.members(n) == trio for n in trio), 45.0, "node-3 found", nodes)
    print(f"joined {joined_s:.1f} s after the records appeared; node-3 found after {found_s:.1f} s")
    queries = dns.proc.log_tail(1_000_000)
    assert f"query[A] {NAME}" in queries and f"query[AAAA] {NAME}" in queries  # both record types asked
