"""The JWKS / OIDC discovery fetch (``HttpFetch``, the real aiohttp client) against a real HTTP server
on loopback that sends its body in pieces, with a pause between them: the whole document is read (up to
the size cap), so a JWKS that arrives in two TCP segments still verifies tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from shepherd.auth.config import JwtConfig
from shepherd.auth.jwks import FetchError, HttpFetch, JwksSource
from shepherd.auth.jwt_verify import JwtError, JwtVerifier
from tests.unit.test_auth_jwt import AUD, ISS, Signer

Server = Callable[[bytes, int], Awaitable[str]]


@pytest.fixture
async def chunked_server() -> AsyncIterator[Server]:
    """``await serve(body, pieces)``: a URL answering 200 with ``body`` cut in ``pieces`` writes, each
    flushed, 50 ms apart (Content-Length framing, as most issuers send it)."""
    servers: list[asyncio.Server] = []

    async def serve(body: bytes, pieces: int) -> str:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await r.readuntil(b"\r\n\r\n")
                w.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                )
                step = -(-len(body) // pieces)
                for i in range(0, len(body), step):
                    w.write(body[i : i + step])
                    await w.drain()
                    await asyncio.sleep(0.05)  # the next piece is a later TCP segment
            finally:
                w.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(srv)
        return f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/jwks"

    yield serve
    for s in servers:
        s.close()
        await s.wait_closed()


async def test_a_jwks_sent_in_two_chunks_verifies_tokens(chunked_server: Server) -> None:
    signer = Signer("k1")
    body = json.dumps({"keys": [signer.jwk()]}).encode()
    url = await chunked_server(body, 2)
    fetch = HttpFetch(timeout=10)
    try:
        assert await fetch(url) == {"keys": [signer.jwk()]}
        cfg = JwtConfig(issuer=ISS, audience=(AUD,), jwks_url=url)
        verifier = JwtVerifier(cfg, [], JwksSource(cfg, fetch))
        v = await verifier.verify(signer.token(tenant="team-a"))
        assert v.principal.subject == "alice" and v.principal.tenant == "team-a"
    finally:
        await fetch.close()


async def test_many_chunks_and_the_size_cap(chunked_server: Server) -> None:
    signer = Signer("k1", "EC")
    body = json.dumps({"keys": [signer.jwk()], "pad": "x" * 3000}).encode()
    fetch = HttpFetch(timeout=10)
    small = HttpFetch(timeout=10, max_bytes=2000)
    try:
        assert (await fetch(await chunked_server(body, 7)))["keys"] == [signer.jwk()]
        with pytest.raises(FetchError, match="larger than 2000"):  # over the cap, however it arrives
            await small(await chunked_server(body, 7))
    finally:
        await fetch.close()
        await small.close()


async def test_tenant_claims_are_bounded(chunked_server: Server) -> None:
    signer = Signer("k1")
    url = await chunked_server(json.dumps({"keys": [signer.jwk()]}).encode(), 1)
    fetch = HttpFetch(timeout=10)
    try:
        cfg = JwtConfig(issuer=ISS, audience=(AUD,), jwks_url=url)
        verifier = JwtVerifier(cfg, [], JwksSource(cfg, fetch))
        for bad in ("t" * 129, "a\nb", "\x00", 5, ["a"], {"x": 1}):
            with pytest.raises(JwtError) as e:
                await verifier.verify(signer.token(tenant=bad))
            assert e.value.code == "invalid_tenant_claim", bad
        assert (await verifier.verify(signer.token(tenant="t" * 128))).principal.tenant == "t" * 128
        assert (await verifier.verify(signer.token(tenant=""))).principal.tenant == "default"
    finally:
        await fetch.close()


async def test_an_https_issuer_s_keys_are_never_taken_over_plain_http() -> None:
    """An HTTPS issuer whose discovery document points its jwks_uri at plain HTTP: the keys are not
    fetched (anyone on the path could hand out signing keys), and tokens find no key."""
    signer = Signer("k1")
    asked: list[str] = []

    async def fetch(url: str) -> object:
        asked.append(url)
        if url.endswith("/.well-known/openid-configuration"):
            return {"issuer": ISS, "jwks_uri": ISS.replace("https://", "http://") + "/jwks"}
        return {"keys": [signer.jwk()]}

    assert ISS.startswith("https://")
    cfg = JwtConfig(issuer=ISS, audience=(AUD,))
    verifier = JwtVerifier(cfg, [], JwksSource(cfg, fetch))
    with pytest.raises(JwtError) as e:
        await verifier.verify(signer.token())
    assert e.value.code == "unknown_key"
    assert asked == [ISS + "/.well-known/openid-configuration"]
