"""TLS material for the mesh: a development CA, node certificates, mTLS contexts, peer identity.

A node's identity is its *name*, carried in its certificate as a URI SAN
``spiffe://shepherd/node/<name>`` (plus a DNS SAN ``<name>`` and IP SANs). The TCP sync trusts
``peer_identity()`` of the verified peer certificate, never a name the peer claims in its payload.

``generate_ca`` / ``generate_node_cert`` are for development and tests (EC P-256, ECDSA-SHA256);
production deployments bring their own CA and only use the context builders and ``peer_identity``.
``generate_client_cert`` makes client certificates for the client port's mTLS identities
(``shepherd.auth.client_cert``: CN, OU, O and SANs as a rule matches them).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shepherd.auth.files import write_atomic

__all__ = [
    "IDENTITY_URI_PREFIX",
    "CertError",
    "PemPair",
    "TlsFiles",
    "certificate_identity",
    "client_context",
    "generate_ca",
    "generate_client_cert",
    "generate_node_cert",
    "identity_uri",
    "load_ca",
    "peer_identity",
    "pem_fingerprint",
    "server_context",
    "validate_node_name",
    "write_dev_pki",
]

IDENTITY_URI_PREFIX = "spiffe://shepherd/node/"
_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})$")


class CertError(ValueError):
    """Bad certificate material, or a peer certificate without a usable node identity."""


@dataclass(frozen=True)
class PemPair:
    """A certificate and its private key, PEM encoded."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a node's certificate, private key and the CA bundle it trusts."""

    cert: Path
    key: Path
    ca: Path


def validate_node_name(name: str) -> str:
    """Return ``name`` if it can be a node identity (1-63 of ``[A-Za-z0-9._-]``, starting alnum)."""
    if not _NAME_RE.match(name):
        raise CertError(f"invalid node name {name!r}: 1-63 characters of [A-Za-z0-9._-], starting alnum")
    return name


def identity_uri(name: str) -> str:
    return IDENTITY_URI_PREFIX + validate_node_name(name)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def generate_ca(common_name: str = "shepherd development CA", *, days: int = 365) -> PemPair:
    """A self-signed EC P-256 CA allowed to sign end-entity certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return PemPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def load_ca(ca: PemPair) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(ca.cert_pem)
    key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError("the CA key must be an EC key")
    return cert, key


def generate_node_cert(
    ca: PemPair,
    name: str,
    *,
    ips: Sequence[str] = ("127.0.0.1", "::1"),
    dns_names: Sequence[str] = (),
    days: int = 365,
) -> PemPair:
    """A node certificate signed by ``ca``: SANs = identity URI, DNS ``name`` (+ ``dns_names``), ``ips``.

    Usable both as a TLS server and a TLS client certificate (the mesh is mTLS both ways).
    """
    validate_node_name(name)
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(identity_uri(name)),
        x509.DNSName(name),
    ]
    sans.extend(x509.DNSName(d) for d in dns_names if d != name)
    sans.extend(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)
    name_attrs = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf_cert(ca, name_attrs, sans, usages, days)


def _leaf_cert(
    ca: PemPair,
    name_attrs: list[x509.NameAttribute[str]],
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    days: int,
) -> PemPair:
    """A P-256 end-entity certificate signed by ``ca``: ``name_attrs`` as its subject, extended key
    usages ``usages``, the SANs (none: no SAN extension), valid from five minutes ago for ``days``."""
    ca_cert, ca_key = load_ca(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(name_attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return PemPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def generate_client_cert(
    ca: PemPair,
    common_name: str,
    *,
    ous: Sequence[str] = (),
    org: str | None = None,
    dns_names: Sequence[str] = (),
    uris: Sequence[str] = (),
    emails: Sequence[str] = (),
    days: int = 365,
) -> PemPair:
    """A TLS client certificate (extended key usage clientAuth only) signed by ``ca``: subject CN
    ``common_name`` with the organizational units ``ous`` and organization ``org``, SANs as given."""
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if org is not None:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    attrs.extend(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou) for ou in ous)
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    sans.extend(x509.UniformResourceIdentifier(u) for u in uris)
    sans.extend(x509.RFC822Name(e) for e in emails)
    return _leaf_cert(ca, attrs, sans, [ExtendedKeyUsageOID.CLIENT_AUTH], days)


def pem_fingerprint(cert_pem: bytes) -> str:
    """Lowercase hex SHA-256 of a PEM certificate's DER form (``auth.client_cert.fingerprints`` keys)."""
    try:
        der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    except ValueError as e:
        raise CertError(f"no usable certificate: {e}") from None
    return hashlib.sha256(der).hexdigest()


def write_dev_pki(
    out_dir: str | os.PathLike[str],
    names: Iterable[str],
    *,
    ca_dir: str | os.PathLike[str] | None = None,
    ips: Sequence[str] = ("127.0.0.1", "::1"),
) -> dict[str, TlsFiles]:
    """Write a development CA and one certificate per node name.

    The CA is read from ``ca_dir`` (``ca.pem`` + ``ca-key.pem``) if it exists there, else created there
    (``ca_dir`` defaults to ``out_dir``). Node files: ``<out>/<name>.pem`` and ``<out>/<name>-key.pem``
    (mode 0600); directories made here are 0700 (``files.write_atomic``). Returns the paths per node name.
    """
    out = Path(out_dir)
    ca_path = Path(ca_dir) if ca_dir is not None else out
    ca_cert_file, ca_key_file = ca_path / "ca.pem", ca_path / "ca-key.pem"
    if ca_cert_file.exists() and ca_key_file.exists():
        ca = PemPair(ca_cert_file.read_bytes(), ca_key_file.read_bytes())
        load_ca(ca)
    else:
        ca = generate_ca()
        write_atomic(ca_cert_file, ca.cert_pem, private=False)
        write_atomic(ca_key_file, ca.key_pem, private=True)
    result: dict[str, TlsFiles] = {}
    for name in names:
        pair = generate_node_cert(ca, name, ips=ips)
        files = TlsFiles(cert=out / f"{name}.pem", key=out / f"{name}-key.pem", ca=ca_cert_file)
        write_atomic(files.cert, pair.cert_pem, private=False)
        write_atomic(files.key, pair.key_pem, private=True)
        result[name] = files
    return result


def _harden(ctx: ssl.SSLContext, files: TlsFiles) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(certfile=str(files.cert), keyfile=str(files.key))
    ctx.load_verify_locations(cafile=str(files.ca))
    return ctx


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """TLS 1.3-only server context that requires and verifies a client certificate from the CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.num_tickets = 0  # one exchange per connection: no session resumption, no ticket bytes
    return _harden(ctx, files)


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """TLS 1.3-only client context presenting the node certificate and verifying the server's.

    Host names are not checked (peers are dialled by address); the caller compares
    ``peer_identity()`` of the connection with the node it meant to reach.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    return _harden(ctx, files)


def certificate_identity(cert_pem: bytes) -> str:
    """The node name in a PEM certificate (its single identity URI SAN); ``CertError`` if none."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as e:
        raise CertError(f"no usable certificate: {e}") from None
    names = [
        u[len(IDENTITY_URI_PREFIX) :]
        for u in san.get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(IDENTITY_URI_PREFIX)
    ]
    if len(names) != 1:
        raise CertError(f"certificate must hold exactly one {IDENTITY_URI_PREFIX}<name> URI SAN")
    return validate_node_name(names[0])


def peer_identity(ssl_object: Any) -> str:
    """The node name in the verified peer certificate of a TLS connection (``ssl.SSLObject`` or
    ``ssl.SSLSocket``): its single ``spiffe://shepherd/node/<name>`` URI SAN. Raises ``CertError``."""
    if ssl_object is None:
        raise CertError("not a TLS connection")
    cert = ssl_object.getpeercert()
    if not cert:
        raise CertError("no verified peer certificate")
    names = [
        value[len(IDENTITY_URI_PREFIX) :]
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and isinstance(value, str) and value.startswith(IDENTITY_URI_PREFIX)
    ]
    if len(names) != 1:
        raise CertError(f"peer certificate must hold exactly one {IDENTITY_URI_PREFIX}<name> URI SAN")
    return validate_node_name(names[0])
