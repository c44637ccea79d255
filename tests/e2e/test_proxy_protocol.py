"""End to end: a node behind a real HAProxy in TCP mode that sends the PROXY protocol header (v2 and v1),
with ``--proxy-protocol-from`` naming the balancer and ``--max-connections-per-client 2``.

Behind a balancer without the header every client has the balancer's address: one client holding
connections (or failing authentication) would count against all. Here HAProxy relays clients that
connect from different loopback addresses (127.0.0.5, .6, .7) and connects to the node from 127.0.0.9:
the node must count each client by the address the header names (a third connection of .5 is a 429, .6
is still served), close a connection from the balancer's address that brings no header, serve other
addresses as before, and not read a header a non-balancer sends (no client may claim an address).

Loopback only; every process (the node, HAProxy) stopped by its pid, also on failure; bounded waits.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shepherd.auth.certs import TlsFiles, write_dev_pki
from tests.e2e.logs import log_file
from tests.e2e.node_procs import NodeProc, free_port, start_node

pytestmark = pytest.mark.timeout(120)

BALANCER = "127.0.0.9"  # HAProxy's source address towards the node (the one --proxy-protocol-from names)
REQUEST = b"GET /liveness HTTP/1.1\r\nHost: node\r\n\r\n"


@contextlib.contextmanager
def proxied_node(*args: str, tls: ssl.SSLContext | None = None) -> Iterator[NodeProc]:
    """A node that reads PROXY headers from ``BALANCER`` and serves two connections a client; stopped by
    its pid."""
    n = start_node(
        *("--proxy-protocol-from", f"{BALANCER}/32", "--max-connections-per-client", "2", *args),
        wait_ready=False,
        tls=tls,
    )
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProc]:
    with proxied_node() as n:
        yield n


@pytest.fixture(scope="module")
def haproxy(node: NodeProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    with run_haproxy(node.port, tmp_path_factory.mktemp("haproxy")) as ports:
        yield ports


@contextlib.contextmanager
def run_haproxy(node_port: int, tmp: Path) -> Iterator[dict[str, int]]:
    """HAProxy in TCP mode in front of ``node_port``: one frontend sending PROXY v2 headers, one v1 (their
    ports by version), connecting from ``BALANCER``; stopped by its pid."""
    exe = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if exe is None:  # (tests.services installs it: `make test` never gets here without it)
        pytest.fail("haproxy is not installed: python -m tests.services install")
    ports = {"v2": free_port(), "v1": free_port()}
    cfg = tmp / "haproxy.cfg"
    lines = [
        "global",
        "    maxconn 256",
        "defaults",
        "    mode tcp",
        "    timeout connect 2s",
        "    timeout client 30s",
        "    timeout server 30s",
    ]
    for v, port in ports.items():
        send = "send-proxy-v2" if v == "v2" else "send-proxy"
        lines += [
            f"frontend f_{v}",
            f"    bind 127.0.0.1:{port}",
            f"    default_backend b_{v}",
            f"backend b_{v}",
            f"    server n 127.0.0.1:{node_port} {send} source {BALANCER}",
        ]
    cfg.write_text("\n".join(lines) + "\n")
    log = log_file("haproxy-")
    with Path(log).open("wb") as out:
        proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # bounded: until both frontends accept
            if proc.poll() is not None:
                pytest.fail(f"haproxy exited: {Path(log).read_text()[-2000:]}")
            try:
                for port in ports.values():
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield ports
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def connect(port: int, source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def ask(s: socket.socket, request: bytes = REQUEST) -> bytes:
    """Send one request; the response's head and what came with it ('' if the connection closed)."""
    s.sendall(request)
    out = b""
    while b"\r\n\r\n" not in out:  # bounded: the socket's timeout, and the peer's close
        try:
            part = s.recv(65536)
        except ConnectionResetError:
            return out
        if not part:
            return out
        out += part
    return out


# each version its own client addresses: the node sees a closed connection of the version before as
# closed a moment after the client does (HAProxy relays the close), and a count still held would be a 429
CLIENTS = {"v2": ("127.0.0.5", "127.0.0.6"), "v1": ("127.0.0.7", "127.0.0.8")}


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_each_client_is_counted_by_the_address_its_header_names(
    node: NodeProc, haproxy: dict[str, int], version: str
) -> None:
    port = haproxy[version]
    one, two = CLIENTS[version]
    held = [connect(port, one) for _ in range(2)]
    try:
        for s in held:  # two keep-alive connections of .5: served, and kept open
            assert ask(s).startswith(b"HTTP/1.1 200"), version
        third = connect(port, one)
        with third:
            answer = ask(third)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"too_many_client_connections" in answer or b"Retry-After" in answer
        with connect(port, two) as other:  # another client: its own count
            assert ask(other).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # bounded: the node sees .5's connections close, then serves it
        with connect(port, one) as again:
            if ask(again).startswith(b"HTTP/1.1 200"):
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"{one} was not served again once its connections closed")


def test_the_balancer_address_without_a_header_is_closed(node: NodeProc) -> None:
    with connect(node.port, BALANCER) as s:
        assert ask(s) == b""  # closed without an answer: it is not a client


def test_others_are_served_as_before_and_cannot_claim_an_address(node: NodeProc) -> None:
    with connect(node.port, "127.0.0.2") as s:
        assert ask(s).startswith(b"HTTP/1.1 200")
    spoof = b"PROXY TCP4 10.1.2.3 127.0.0.1 1234 80\r\n" + REQUEST
    with connect(node.port, "127.0.0.2") as s:  # not a balancer: its "header" is a malformed request
        assert ask(s, spoof).startswith(b"HTTP/1.1 400")


# -- TLS on the client port: the balancer passes the client's TLS through, its PROXY header first --


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["node"])["node"]


@pytest.fixture(scope="module")
def client_tls(pki: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca))


@pytest.fixture(scope="module")
def tls_node(pki: TlsFiles, client_tls: ssl.SSLContext) -> Iterator[NodeProc]:
    with proxied_node("--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key), tls=client_tls) as n:
        yield n


@pytest.fixture(scope="module")
def tls_haproxy(tls_node: NodeProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    with run_haproxy(tls_node.port, tmp_path_factory.mktemp("haproxy-tls")) as ports:
        yield ports


def connect_tls(port: int, source: str, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    return ctx.wrap_socket(connect(port, source), server_hostname="127.0.0.1")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_tls_clients_behind_the_balancer_are_counted_by_their_header(
    tls_node: NodeProc, tls_haproxy: dict[str, int], client_tls: ssl.SSLContext, version: str
) -> None:
    """The handshake (and every byte after the header) reaches the TLS stack whole: served over TLS, and
    each client counted by the address its header names."""
    port = tls_haproxy[version]
    held = [connect_tls(port, "127.0.0.5", client_tls) for _ in range(2)]
    try:
        for s in held:
            assert ask(s).startswith(b"HTTP/1.1 200"), version
        with connect_tls(port, "127.0.0.5", client_tls) as third:
            answer = ask(third)
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        with connect_tls(port, "127.0.0.6", client_tls) as other:
            assert ask(other).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()


def test_tls_from_the_balancer_without_a_header_is_closed(
    tls_node: NodeProc, client_tls: ssl.SSLContext
) -> None:
    """A ClientHello where the header should be is not a header: the connection closes, unserved."""
    try:
        s = connect_tls(tls_node.port, BALANCER, client_tls)
    except (ssl.SSLError, OSError):  # the handshake cut short: closed without an answer
        return
    with s:
        assert ask(s) == b""


def test_tls_clients_that_are_not_balancers_are_served_directly(
    tls_node: NodeProc, client_tls: ssl.SSLContext
) -> None:
    with connect_tls(tls_node.port, "127.0.0.2", client_tls) as s:
        assert ask(s).startswith(b"HTTP/1.1 200")
    spoof = b"PROXY TCP4 10.1.2.3 127.0.0.1 1234 80\r\n"
    with connect(tls_node.port, "127.0.0.2") as raw:  # a header from anyone else is a bad TLS record
        raw.sendall(spoof)
        with contextlib.suppress(ConnectionResetError):
            assert b"HTTP/1.1 200" not in raw.recv(4096)
