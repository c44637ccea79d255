"""Development CA and node certificates; mTLS contexts; peer identity from the verified certificate."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from shepherd.auth.certs import (
    CertError,
    TlsFiles,
    client_context,
    generate_ca,
    generate_node_cert,
    identity_uri,
    peer_identity,
    server_context,
    validate_node_name,
    write_dev_pki,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    out = tmp_path_factory.mktemp("pki")
    files = write_dev_pki(out, ["alpha", "beta"])
    files.update({f"evil-{k}": v for k, v in write_dev_pki(out / "evil", ["alpha"]).items()})
    return files


def test_node_cert_fields() -> None:
    ca = generate_ca()
    pair = generate_node_cert(ca, "node-1", dns_names=["node-1.mesh.local"])
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    cert.verify_directly_issued_by(ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://shepherd/node/node-1"]
    assert san.get_values_for_type(x509.DNSName) == ["node-1", "node-1.mesh.local"]
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_node_names_validated() -> None:
    assert validate_node_name("a.b_c-1") == "a.b_c-1"
    assert identity_uri("n1") == "spiffe://shepherd/node/n1"
    for bad in ("", "-x", "a/b", "a b", "x" * 64, "ü"):
        with pytest.raises(CertError):
            validate_node_name(bad)
    with pytest.raises(CertError):
        generate_node_cert(generate_ca(), "bad/name")


def test_write_dev_pki_reuses_ca_and_keeps_keys_private(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    first = write_dev_pki(tmp_path / "a", ["n1"], ca_dir=ca_dir)
    ca_pem = (ca_dir / "ca.pem").read_bytes()
    second = write_dev_pki(tmp_path / "b", ["n2"], ca_dir=ca_dir)
    assert (ca_dir / "ca.pem").read_bytes() == ca_pem
    assert first["n1"].ca == second["n2"].ca
    for files in (first["n1"], second["n2"]):
        assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
        assert files.cert.exists()
    assert stat.S_IMODE((ca_dir / "ca-key.pem").stat().st_mode) == 0o600


async def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str | None, str]:
    """Run one TLS exchange on loopback; returns (identity seen by the server or None, client result)."""
    seen: list[str | None] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(peer_identity(writer.get_extra_info("ssl_object")))
            writer.write(b"ok\n")
            await writer.drain()
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server, ssl_handshake_timeout=5)
    port = srv.sockets[0].getsockname()[1]
    result: str
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            server_id = peer_identity(writer.get_extra_info("ssl_object"))
            line = await reader.readline()
            writer.close()
            result = f"{server_id}:{line.decode().strip()}" if line else "eof"
    except (ssl.SSLError, ConnectionError, OSError) as e:
        result = f"error:{type(e).__name__}"
    finally:
        srv.close()
        await asyncio.sleep(0.05)  # let the server side finish its handshake callback
    return (seen[0] if seen else None), result


async def test_mtls_handshake_with_good_certs(pki: dict[str, TlsFiles]) -> None:
    ident, result = await _handshake(server_context(pki["alpha"]), client_context(pki["beta"]))
    assert ident == "beta"
    assert result == "alpha:ok"
    ctx = server_context(pki["alpha"])
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_context(pki["beta"]).verify_mode == ssl.CERT_REQUIRED


async def test_client_from_foreign_ca_refused(pki: dict[str, TlsFiles]) -> None:
    # same name, other CA: its certificate must not be trusted
    foreign = pki["evil-alpha"]
    client = client_context(TlsFiles(cert=foreign.cert, key=foreign.key, ca=pki["beta"].ca))
    ident, result = await _handshake(server_context(pki["beta"]), client)
    assert ident is None
    assert result.startswith("error") or result == "eof"


async def test_client_without_certificate_refused(pki: dict[str, TlsFiles]) -> None:
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.load_verify_locations(cafile=str(pki["alpha"].ca))
    server = server_context(pki["alpha"])

    async def run() -> tuple[str | None, str]:
        seen: list[str | None] = []

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append("called")
            writer.close()

        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server, ssl_handshake_timeout=5)
        port = srv.sockets[0].getsockname()[1]
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
                try:
                    line = await reader.readline()
                    res = "eof" if not line else "data"
                except (ssl.SSLError, ConnectionError) as e:
                    res = f"error:{type(e).__name__}"
                writer.close()
        finally:
            srv.close()
        return (seen[0] if seen else None), res

    ident, result = await run()
    assert ident is None  # the server callback never ran
    assert result != "data"


async def test_server_from_foreign_ca_refused_by_client(pki: dict[str, TlsFiles]) -> None:
    foreign = pki["evil-alpha"]
    server = server_context(TlsFiles(cert=foreign.cert, key=foreign.key, ca=pki["alpha"].ca))
    ident, result = await _handshake(server, client_context(pki["beta"]))
    assert ident is None
    assert result.startswith("error")


def test_peer_identity_requires_a_verified_cert() -> None:
    class NoCert:
        def getpeercert(self) -> dict[str, object]:
            return {}

    class TwoIds:
        def getpeercert(self) -> dict[str, object]:
            return {
                "subjectAltName": (
                    ("URI", "spiffe://shepherd/node/a"),
                    ("URI", "spiffe://shepherd/node/b"),
                )
            }

    class DnsOnly:
        def getpeercert(self) -> dict[str, object]:
            return {"subjectAltName": (("DNS", "a"),)}

    for obj in (None, NoCert(), TwoIds(), DnsOnly()):
        with pytest.raises(CertError):
            peer_identity(obj)


def test_cli_certs_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shepherd.node.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["certs", "--out", str(tmp_path / "out"), "--nodes", "n1, n2", "--ca-dir", str(tmp_path / "ca")])
    assert exc.value.code == 0
    assert "n1: cert=" in capsys.readouterr().out
    for f in ("out/n1.pem", "out/n1-key.pem", "out/n2.pem", "ca/ca.pem", "ca/ca-key.pem"):
        assert (tmp_path / f).exists()
    ctx = server_context(
        TlsFiles(tmp_path / "out/n1.pem", tmp_path / "out/n1-key.pem", tmp_path / "ca/ca.pem")
    )
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(SystemExit) as exc:
        main(["certs", "--out", str(tmp_path / "bad"), "--nodes", "no/slash"])
    assert exc.value.code == 2


def test_certificate_identity(pki: dict[str, TlsFiles]) -> None:
    from shepherd.auth.certs import certificate_identity

    assert certificate_identity(pki["alpha"].cert.read_bytes()) == "alpha"
    with pytest.raises(CertError):
        certificate_identity(pki["alpha"].ca.read_bytes())  # the CA has no node identity
    with pytest.raises(CertError):
        certificate_identity(b"not a certificate")
