"""TLS certificate reload on SIGHUP, with the certificate given by flags (no configuration file): a real node
on loopback serves a self-signed certificate the test made with ``cryptography``; the files are replaced, the
node gets SIGHUP (periodic checks off), and new connections see the new certificate while a connection
opened before keeps the old one and the node keeps serving. A SIGHUP with a broken pair keeps the old one.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.e2e.node_procs import NodeProc, free_port, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine


def self_signed(common_name: str) -> tuple[bytes, bytes, int]:
    """(certificate PEM, key PEM, serial number) of a fresh self-signed certificate for 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem, serial


def install(directory: Path, cert_pem: bytes, key_pem: bytes) -> None:
    """Replace the pair atomically, key first (a reader never sees a half-written file)."""
    for name, data in (("key.pem", key_pem), ("cert.pem", cert_pem)):
        (directory / f"{name}.tmp").write_bytes(data)
        os.replace(directory / f"{name}.tmp", directory / name)


def open_tls(port: int) -> ssl.SSLSocket:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed: the test reads the certificate, it does not trust it
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return ctx.wrap_socket(raw)


def peer_serial(s: ssl.SSLSocket) -> int:
    der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def served_serial(port: int) -> int | None:
    """The serial of the certificate a new connection sees (None: no TLS answer yet)."""
    try:
        with open_tls(port) as s:
            return peer_serial(s)
    except (OSError, ssl.SSLError):
        return None


def wait_for(cond: Callable[[], bool], what: str, node: NodeProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded
        if cond():
            return
        if node.proc.poll() is not None:
            pytest.fail(f"the node exited ({node.proc.returncode}) waiting for {what}:\n{node.log()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout} s\n{node.log()[-3000:]}")


def http_over(s: ssl.SSLSocket, path: str) -> bytes:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    return s.recv(65536)


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--zero-latency") as e:
        yield e


def test_sighup_reloads_the_tls_certificate_given_by_flags(engine: MockEngineProc, tmp_path: Path) -> None:
    cert1, key1, serial1 = self_signed("first")
    install(tmp_path, cert1, key1)
    port = free_port()
    node = spawn_node(
        "serve",
        *("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3"),
        *("--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")),
        *("--tls-reload-interval-secs", "0"),  # no periodic check: only SIGHUP reloads
        port=port,
    )
    try:
        wait_for(lambda: served_serial(port) == serial1, "the first certificate", node)
        before = open_tls(port)  # a connection made before the reload
        try:
            assert peer_serial(before) == serial1
            cert2, key2, serial2 = self_signed("second")
            assert serial2 != serial1
            install(tmp_path, cert2, key2)
            # the files changed but nothing reloads them yet (no periodic check): still the first
            assert served_serial(port) == serial1
            node.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: served_serial(port) == serial2, "the new certificate after SIGHUP", node)
            # the old connection keeps its session and is still served
            assert peer_serial(before) == serial1
            assert http_over(before, "/liveness").startswith(b"HTTP/1.1 200")
        finally:
            before.close()
        # a broken pair (a certificate without its key) is refused on SIGHUP: the current one stays
        cert3, _key3, _serial3 = self_signed("third")
        (tmp_path / "cert.pem").write_bytes(cert3)
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "TLS certificate reload failed" in node.log(), "the refused reload", node)
        assert served_serial(port) == serial2
        with open_tls(port) as s:
            assert http_over(s, "/liveness").startswith(b"HTTP/1.1 200")
        assert node.proc.poll() is None
    finally:
        node.stop()
