"""The PROXY protocol header parser (``shepherd.node.http.proxy_protocol``): HAProxy's specification's
shapes, any split of the bytes, and hostile input refused (never another exception, never more than
``MAX_HEADER`` bytes read)."""

from __future__ import annotations

import contextlib
import ipaddress
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.auth.certs import write_dev_pki
from shepherd.node.http.proxy_protocol import MAX_HEADER, ProxyError, ProxyHeader, parse

SIG = b"\r\n\r\n\x00\r\nQUIT\n"


def v2(src: str, dst: str, cmd: int = 1, tlvs: bytes = b"", proto: int = 1) -> bytes:
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    fam = 1 if a.version == 4 else 2
    body = a.packed + b.packed + struct.pack(">HH", 51000, 443) + tlvs
    return SIG + bytes([0x20 | cmd, fam << 4 | proto]) + struct.pack(">H", len(body)) + body


CASES = [
    (b"PROXY TCP4 192.0.2.7 198.51.100.1 51000 443\r\n", "192.0.2.7"),
    (b"PROXY TCP6 2001:db8::7 2001:db8::1 51000 443\r\n", "2001:db8::7"),
    (b"PROXY UNKNOWN\r\n", None),
    (b"PROXY UNKNOWN ffff:f::1 ffff:f::2 1 2\r\n", None),
    (v2("192.0.2.7", "198.51.100.1"), "192.0.2.7"),
    (v2("2001:db8::7", "2001:db8::1", tlvs=b"\x04\x00\x02ab"), "2001:db8::7"),  # a TLV: skipped
    (v2("192.0.2.7", "198.51.100.1", cmd=0), None),  # LOCAL: the balancer's own health check
    (SIG + b"\x21\x00\x00\x00", None),  # UNSPEC
]


@pytest.mark.parametrize(("header", "client"), CASES)
def test_headers_of_the_specification(header: bytes, client: str | None) -> None:
    rest = b"GET / HTTP/1.1\r\n\r\n"
    assert parse(header + rest) == ProxyHeader(client, len(header))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES), st.data())
def test_any_prefix_asks_for_more(case: tuple[bytes, str | None], data: st.DataObject) -> None:
    header = case[0]
    cut = data.draw(st.integers(0, len(header) - 1))
    assert parse(header[:cut]) is None


BAD = [
    b"GET / HTTP/1.1\r\n\r\n",  # no header at all
    b"PROXY TCP4 192.0.2.7 198.51.100.1 51000\r\n",  # a field missing
    b"PROXY TCP4 2001:db8::7 198.51.100.1 51000 443\r\n",  # v6 under TCP4
    b"PROXY TCP4 192.0.2.7 198.51.100.1 051000 443\r\n",  # a leading zero
    b"PROXY TCP4 192.0.2.7 198.51.100.1 +5100 443\r\n",
    b"PROXY TCP4 192.0.2.7 198.51.100.1 70000 443\r\n",
    b"PROXY UDP4 192.0.2.7 198.51.100.1 1 2\r\n",
    b"PROXY TCP4 " + b"1" * 120,  # no CRLF within 107 bytes
    b"PROXX ",
    SIG[:11] + b"X",
    SIG + b"\x11\x11\x00\x0c" + b"\x00" * 12,  # version 1 in a v2 header
    SIG + b"\x22\x11\x00\x0c" + b"\x00" * 12,  # command 2
    SIG + b"\x21\x11\x00\x04" + b"\x00" * 4,  # too short for IPv4 addresses
    SIG + b"\x21\x12\x00\x0c" + b"\x00" * 12,  # a datagram relay
    SIG + b"\x21\x11\xff\xff",  # 64 KiB of TLVs announced: refused before they are read
    SIG + b"\x21\x41\x00\x00",  # family 4: not the specification's
    SIG + b"\x21\x10\x00\x0c" + b"\x00" * 12,  # IPv4 with an unspecified protocol
    SIG + b"\x21\x31\x00\x00",  # unix, without its 216 bytes of paths
    b"PROXY TCP6 fe80::1%eth0 fe80::2 1 2\r\n",  # a scope id: free text into logs
]


@pytest.mark.parametrize("data", BAD)
def test_what_is_not_a_header_is_refused(data: bytes) -> None:
    with pytest.raises(ProxyError):
        parse(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300) | st.builds(lambda b: b"PROXY " + b, st.binary(max_size=120)))
def test_any_bytes_parse_refuse_or_ask_for_more_within_the_bound(data: bytes) -> None:
    try:
        got = parse(data)
    except ProxyError:
        return
    if got is None:
        assert len(data) < MAX_HEADER
    else:
        assert 0 < got.length <= min(len(data), MAX_HEADER)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"proxy_protocol_from": ["lb.example"]}, "not an IP address or a CIDR"),
        ({"proxy_protocol_from": ["::ffff:10.0.0.1"]}, "IPv4-mapped"),
        ({"proxy_protocol_from": "10.0.0.0/8", "http_server": "aiohttp"}, "http_server lean"),
        ({"max_connections_per_client": 4, "http_server": "aiohttp"}, "http_server lean"),
        ({"max_connections_per_client": -1}, "must be >= 0"),
    ],
)
def test_the_settings_are_checked(values: dict[str, object], says: str, tmp_path: Path) -> None:
    from shepherd.node.config import ConfigError, build_config  # (the node's config: these tests only)

    with pytest.raises(ConfigError, match=says):
        build_config({"worker_urls": ["grpc://127.0.0.1:1"], **values}, {})
    ok = build_config({"proxy_protocol_from": "10.0.0.0/8", "max_connections_per_client": 8}, {})
    assert ok.proxy_protocol_from == ("10.0.0.0/8",) and ok.max_connections_per_client == 8
    files = write_dev_pki(tmp_path, ["node"])["node"]  # with TLS on the client port too (the header first)
    tls = {"tls_cert_file": str(files.cert), "tls_key_file": str(files.key)}
    assert build_config({"proxy_protocol_from": "10.0.0.1", **tls}, {}).proxy_protocol_from == ("10.0.0.1",)


async def test_connections_waiting_for_their_header_count_and_close_with_the_server() -> None:
    """A balancer's connections still bringing their header hold descriptors: they count against the
    connection cap, and a server that stops closes them (a header after that is not served)."""
    import asyncio  # (these tests alone run a server)

    from aiohttp import web

    from shepherd.node.http.server import LeanServer

    async def ok(_r: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/x", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    srv = LeanServer(app, max_body=1024, max_connections=2, proxy_from=["127.0.0.1"])
    await srv.start("127.0.0.1", 0)
    try:
        waiting = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert len(srv.cap.waiting) == 2
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        assert (await asyncio.wait_for(r.read(), 5)).startswith(b"HTTP/1.1 503")  # past the cap
        w.close()
        await srv.shutdown(timeout=0.5)
        hdr = b"PROXY TCP4 192.0.2.7 127.0.0.1 1000 80\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n"
        for r, w in waiting:
            with contextlib.suppress(ConnectionError):
                w.write(hdr)
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed, not served
            w.close()
        assert not srv.cap.waiting and not srv.conns
    finally:
        await srv.shutdown(timeout=0.1)
        await runner.cleanup()


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(CASES),
    st.binary(min_size=1, max_size=300),
    st.lists(st.integers(1, 40), max_size=6),
)
def test_the_tls_listener_reads_the_header_and_not_a_byte_more(
    case: tuple[bytes, str | None], tail: bytes, cuts: list[int]
) -> None:
    """With TLS after the header, the reader takes exactly the header off the socket whatever the bytes
    that follow (a ClientHello, here any bytes) and however they arrive: the TLS stack reads the rest."""
    import asyncio  # (this test alone runs a loop)
    import socket

    from shepherd.node.http.server import read_proxy_header

    header, client = case
    data = header + b"\x16\x03\x01" + tail
    pieces, at = [], 0
    for c in cuts:  # the first pieces as drawn, then the rest at once
        pieces.append(data[at : at + c])
        at += c
    pieces.append(data[at:])

    async def run() -> tuple[ProxyHeader, bytes]:
        a, b = socket.socketpair()
        with a, b:
            a.setblocking(False)
            loop = asyncio.get_running_loop()

            async def send() -> None:
                for p in pieces:
                    if p:
                        b.sendall(p)
                        await asyncio.sleep(0.001)

            sender = loop.create_task(send())
            got = await asyncio.wait_for(read_proxy_header(loop, a), 10)
            await sender
            b.shutdown(socket.SHUT_WR)
            rest = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(a, 65536), 10):  # bounded: EOF
                rest += chunk
            return got, rest

    got, rest = asyncio.run(run())
    assert got == ProxyHeader(client, len(header))
    assert rest == data[len(header) :]


@pytest.mark.parametrize("data", [b"\x16\x03\x01\x02\x00\x01", b"PROXY TCP4 " + b"9" * 200, b""])
def test_the_tls_listener_refuses_what_is_not_a_header(data: bytes) -> None:
    import asyncio  # (this test alone runs a loop)
    import socket

    from shepherd.node.http.server import read_proxy_header

    async def run() -> None:
        a, b = socket.socketpair()
        with a, b:
            a.setblocking(False)
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)  # (an empty connection: closed before its header)
            with pytest.raises(ProxyError):
                await asyncio.wait_for(read_proxy_header(asyncio.get_running_loop(), a), 10)

    asyncio.run(run())


@contextlib.asynccontextmanager
async def _tls_server(tmp_path: Path, **server: Any) -> AsyncIterator[tuple[Any, ssl.SSLContext]]:
    """A lean server over TLS (a dev CA's certificate) with ``/who`` (the client's address) and
    ``/hello``, and a client context trusting it; stopped after."""
    from aiohttp import web

    from shepherd.node.http.server import LeanServer

    async def who(r: web.Request) -> web.Response:
        return web.json_response({"remote": r.remote})

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    files = write_dev_pki(tmp_path, ["node"])["node"]
    client = ssl.create_default_context(cafile=str(files.ca))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(files.cert, files.key)
    app = web.Application()
    app.router.add_get("/who", who)
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    srv = LeanServer(app, max_body=1024, **server)
    await srv.start("127.0.0.1", 0, ssl_context=server_tls)
    try:
        yield srv, client
    finally:
        await srv.shutdown(timeout=0.1)
        await runner.cleanup()


async def test_the_tls_listener_serves_counts_and_closes_with_the_server(tmp_path: Path) -> None:
    """With TLS: a balancer's connection is served over TLS once its header is read, as the client it
    names; those still bringing their header count against the cap (one past it is closed unanswered);
    a server that stops closes them."""
    import asyncio  # (these tests alone run a server)
    import socket

    async with _tls_server(tmp_path, max_connections=3, proxy_from=["127.0.0.1"]) as (srv, client):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"PROXY TCP4 192.0.2.7 127.0.0.1 1000 443\r\n")
        r, w = await asyncio.open_connection(sock=s, ssl=client, server_hostname="127.0.0.1")
        w.write(b"GET /who HTTP/1.1\r\nHost: a\r\n\r\n")
        head = await asyncio.wait_for(r.readuntil(b"192.0.2.7"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        waiting = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(2)]
        for _ in range(100):  # bounded: until both are accepted
            if len(srv.cap.waiting) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(srv.cap.waiting) == 2
        r3, w3 = await asyncio.open_connection("127.0.0.1", srv.port)  # past the cap
        assert await asyncio.wait_for(r3.read(), 5) == b""
        w3.close()
        assert srv.cap.refused == 1
        await srv.shutdown(timeout=0.5)
        for r2, w2 in waiting:
            assert await asyncio.wait_for(r2.read(), 5) == b""  # closed, not served
            w2.close()
        assert not srv.cap.waiting
        w.close()


@pytest.mark.parametrize("proxied", [False, True], ids=["tls", "proxy-then-tls"])
async def test_a_tls_handshake_that_never_comes_is_closed(tmp_path: Path, proxied: bool) -> None:
    """A connection that opens and sends nothing of its handshake (after its PROXY header, when it comes
    from a balancer) is closed after ``Limits.tls_handshake_secs``, not asyncio's minute; a client that
    does shake hands is served as before."""
    import asyncio  # (these tests alone run a server)

    from shepherd.node.http.limits import Limits

    header = b"PROXY TCP4 192.0.2.7 127.0.0.1 1000 443\r\n" if proxied else b""
    limits = Limits(tls_handshake_secs=0.3)
    async with _tls_server(tmp_path, limits=limits, proxy_from=["127.0.0.1"] if proxied else []) as (
        srv,
        client,
    ):
        r, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(header)
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed, well before 60 s
        w.close()
        r2, w2 = await asyncio.open_connection("127.0.0.1", srv.port)
        w2.write(header)
        await w2.drain()
        await w2.start_tls(client, server_hostname="127.0.0.1")
        w2.write(b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (await asyncio.wait_for(r2.readuntil(b"hello"), 10)).startswith(b"HTTP/1.1 200")
        w2.close()
