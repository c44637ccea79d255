"""TLS material: the client port's context and its reload without restart (real handshakes on loopback),
client certificates (mTLS), and the engine client contexts (ALPN h2, grpcio credentials)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from shepherd.auth.certs import PemPair, generate_ca, generate_node_cert
from shepherd.auth.tls import EngineTls, ServerTls, server_context
from shepherd.node.dispatch.workers import make_client
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient


def write(path: Path, data: bytes) -> None:
    """Atomic replace, as a cert manager does (new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = generate_ca()
        (root / "ca.pem").write_bytes(self.ca.cert_pem)
        self.server = self.issue("server")

    def issue(self, name: str) -> PemPair:
        pair = generate_node_cert(self.ca, "localhost", dns_names=("localhost",))
        write(self.root / f"{name}.pem", pair.cert_pem)
        write(self.root / f"{name}-key.pem", pair.key_pem)
        return pair

    def path(self, name: str) -> str:
        return str(self.root / name)

    def client_context(self, cert: str | None = None, alpn: str = "http/1.1") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.path("ca.pem"))
        if cert:
            ctx.load_cert_chain(self.path(f"{cert}.pem"), self.path(f"{cert}-key.pem"))
        ctx.set_alpn_protocols([alpn])
        return ctx


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


@contextlib.asynccontextmanager
async def tls_server(ctx: ssl.SSLContext) -> AsyncIterator[int]:
    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hi")
        await w.drain()
        w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def handshake(port: int, ctx: ssl.SSLContext) -> tuple[int, str | None]:
    """The serial of the certificate the server shows, and the ALPN protocol chosen."""
    r, w = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost"), 10
    )
    try:
        obj = w.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True)
        if await asyncio.wait_for(r.read(), 10) != b"hi":  # TLS 1.3: a refused client cert shows here
            raise ConnectionError("the server closed the connection")
        return x509.load_der_x509_certificate(der).serial_number, obj.selected_alpn_protocol()
    finally:
        w.close()


async def test_reload_swaps_the_certificate_for_new_handshakes(pki: Pki) -> None:
    tls = ServerTls(pki.path("server.pem"), pki.path("server-key.pem"), reload_interval_secs=0)
    assert not tls.reload()  # nothing changed
    async with tls_server(tls.context) as port:
        first, alpn = await handshake(port, pki.client_context())
        assert first == serial(pki.server.cert_pem) and alpn == "http/1.1"
        new = pki.issue("server")
        assert tls.reload() and tls.reloads == 1
        assert (await handshake(port, pki.client_context()))[0] == serial(new.cert_pem)


async def test_half_written_rotation_keeps_the_old_pair_until_the_key_arrives(pki: Pki) -> None:
    tls = ServerTls(pki.path("server.pem"), pki.path("server-key.pem"), reload_interval_secs=0)
    old = serial(pki.server.cert_pem)
    new = generate_node_cert(pki.ca, "localhost")
    write(pki.root / "server.pem", new.cert_pem)  # the certificate first, its key not yet
    assert not tls.reload()
    async with tls_server(tls.context) as port:
        assert (await handshake(port, pki.client_context()))[0] == old
        write(pki.root / "server-key.pem", new.key_pem)
        assert tls.reload()
        assert (await handshake(port, pki.client_context()))[0] == serial(new.cert_pem)


async def test_periodic_watch_reloads_by_itself(pki: Pki) -> None:
    tls = ServerTls(pki.path("server.pem"), pki.path("server-key.pem"), reload_interval_secs=0.02)
    tls.start(sighup=False)
    try:
        pki.issue("server")
        for _ in range(500):  # bounded wait, no timing assertion
            if tls.reloads:
                break
            await asyncio.sleep(0.01)
        assert tls.reloads == 1
    finally:
        await tls.close()


async def test_client_certificates_required_with_a_client_ca(pki: Pki) -> None:
    pki.issue("client")
    ctx = server_context(pki.path("server.pem"), pki.path("server-key.pem"), pki.path("ca.pem"))
    async with tls_server(ctx) as port:
        await handshake(port, pki.client_context("client"))
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await handshake(port, pki.client_context())
        other = generate_ca()  # a client cert from another CA
        foreign = generate_node_cert(other, "localhost")
        write(pki.root / "foreign.pem", foreign.cert_pem)
        write(pki.root / "foreign-key.pem", foreign.key_pem)
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await handshake(port, pki.client_context("foreign"))


async def test_engine_context_speaks_h2_with_a_client_certificate(pki: Pki) -> None:
    pki.issue("gw")
    server = server_context(pki.path("server.pem"), pki.path("server-key.pem"), pki.path("ca.pem"))
    server.set_alpn_protocols(["h2"])
    t = EngineTls(pki.path("ca.pem"), pki.path("gw.pem"), pki.path("gw-key.pem"))
    assert t.ssl_context() is t.ssl_context()  # built once
    async with tls_server(server) as port:
        _, alpn = await handshake(port, t.ssl_context())
        assert alpn == "h2"
    assert isinstance(t.grpc_credentials(), grpc.ChannelCredentials)


async def test_make_client_picks_tls_by_scheme_or_settings(pki: Pki) -> None:
    t = EngineTls(pki.path("ca.pem"))
    clients = [
        make_client("grpcs://127.0.0.1:1"),
        make_client("grpc://127.0.0.1:1", "h2", t),
        make_client("grpcs://127.0.0.1:1", "grpcio", t),
        make_client("grpc://127.0.0.1:1"),
    ]
    try:
        assert isinstance(clients[0], H2EngineClient) and clients[0]._tls is not None
        assert isinstance(clients[1], H2EngineClient) and clients[1]._tls is t.ssl_context()
        assert isinstance(clients[2], GrpcEngineClient)
        assert isinstance(clients[3], H2EngineClient) and clients[3]._tls is None
        assert EngineTls.configured(None, None, None) is None
    finally:
        for c in clients:
            await c.close()
