"""Auth cost per request, in process: prints CPU µs per call (process time, best of 5 runs:
steadier than wall time on a shared machine).

    PYTHONPATH=. .venv/bin/python bench/auth_bench.py

- authenticate (api_key / cached jwt): Authenticator.authenticate_now on a data route: header, sha256 of the
  key + store lookup + checks, or the verified-token LRU hit;
- jwt cold RS256 / ES256: a full verification (header, key select, signature, claims), cache off;
- middleware: the aiohttp auth middleware around a no-op handler, over the handler alone (route plane
  lookup, headers, principal put on the request). With auth off the middleware is not installed: 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from shepherd.auth.config import AuthConfig, JwtConfig
from shepherd.auth.jwks import keys_from_jwks
from shepherd.auth.jwt_verify import JwtVerifier
from shepherd.auth.keys import MemoryKeyStore, create_key
from shepherd.auth.middleware import Authenticator, make_middleware
from tests.unit.test_auth_jwt import ISS, Signer, jwks_of


def best_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(min(n, 500)):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t) / n * 1e6)
    return best


async def abest_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(min(n, 500)):
        await fn()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(n):
            await fn()
        best = min(best, (time.process_time() - t) / n * 1e6)
    return best


async def main() -> None:
    store = MemoryKeyStore()
    for i in range(10_000):
        create_key(store, f"k{i}")
    key, _ = create_key(store, "bench")
    rsa_s, ec_s = Signer("r"), Signer("e", "EC")
    jcfg = JwtConfig(issuer=ISS, audience=("smg",))
    keys = keys_from_jwks(jwks_of(rsa_s, ec_s))
    cold = JwtVerifier(dataclasses.replace(jcfg, cache_size=0), keys, None)
    a = Authenticator(
        AuthConfig(data_plane="both", control_plane="both", jwt=jcfg), store, JwtVerifier(jcfg, keys, None)
    )
    tok_r, tok_e = rsa_s.token(), ec_s.token()
    hk = {"Authorization": f"Bearer {key}"}
    hj = {"Authorization": f"Bearer {tok_r}"}
    await a.authenticate("data", hj)  # verified once: cached from now on
    body = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "Say something. " * 16}]})
    ref = best_us(lambda: orjson.loads(body), 50_000)
    print(f"reference: orjson.loads of a 300-byte chat body {ref:6.2f} µs")
    print(f"authenticate api_key        {best_us(lambda: a.authenticate_now('data', hk), 50_000):8.2f} µs")
    print(f"authenticate jwt (cached)   {best_us(lambda: a.authenticate_now('data', hj), 50_000):8.2f} µs")
    print(f"jwt cold verify RS256       {await abest_us(lambda: cold.verify(tok_r), 1_000):8.2f} µs")
    print(f"jwt cold verify ES256       {await abest_us(lambda: cold.verify(tok_e), 1_000):8.2f} µs")

    resp = web.Response()

    async def handler(request: web.Request) -> web.StreamResponse:
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    mw = make_middleware(a)

    async def run(headers: dict[str, str], wrapped: bool) -> float:
        req = make_mocked_request("POST", "/v1/chat/completions", headers=headers, app=app)
        req._match_info = await app.router.resolve(req)
        if wrapped:
            return await abest_us(lambda: mw(req, handler), 50_000)
        return await abest_us(lambda: handler(req), 50_000)

    base = await run(hk, False)
    print(f"middleware + api_key        {await run(hk, True) - base:8.2f} µs over the handler")
    print(f"middleware + jwt (cached)   {await run(hj, True) - base:8.2f} µs over the handler")


asyncio.run(main())
