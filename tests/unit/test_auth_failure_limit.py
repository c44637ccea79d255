"""Guessing credentials is rate-limited per client address: after ``auth.failure_limit`` failed credentials
within ``auth.failure_window_secs`` (default 20 per 10 s) the address is answered 429 with ``Retry-After``
in the route's envelope (OpenAI's, Anthropic's on ``/v1/messages``) without its credential being looked
at, until the bucket refills. Only distinct presented credentials that fail count (not a missing one,
nor a stale key retried); successes are never counted nor delayed; the remembered addresses are
bounded; IPv6 counts per /64. And a bootstrap key read from an
environment variable that is shorter than 32 characters is warned about at start (never its value).

The limiter's arithmetic runs on a fake clock; the middleware in an aiohttp app (in process); a real
node refusing a guesser: ``tests/e2e/test_security_defaults.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shepherd.auth import middleware as auth
from shepherd.auth.config import AuthConfigError, auth_config
from shepherd.auth.middleware import FailureLimiter
from shepherd.proto.addresses import client_key

pytestmark = pytest.mark.timeout(60)

ADMIN = "sk-smg-failure-limit-admin-key-000000000000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the limiter ---------------------------------------------------------------------------------------


def test_a_bucket_per_address_refilled_over_the_window() -> None:
    clock = Clock()
    lim = FailureLimiter(20, 10.0, clock=clock)
    for i in range(19):
        lim.failed("10.0.0.1", f"guess-{i}")
    assert lim.blocked("10.0.0.1") is None  # 19 of 20
    lim.failed("10.0.0.1", "guess-19")
    assert lim.blocked("10.0.0.1") == 1  # 20 within the window: one token comes back in 0.5 s
    assert lim.blocked("10.0.0.2") is None  # another address is not concerned
    clock.now += 0.5
    assert lim.blocked("10.0.0.1") is None  # one more try
    lim.failed("10.0.0.1", "guess-20")
    assert lim.blocked("10.0.0.1") is not None
    clock.now += 10.0
    assert lim.blocked("10.0.0.1") is None and len(lim) == 0  # full again: forgotten


def test_retry_after_covers_the_wait() -> None:
    clock = Clock()
    lim = FailureLimiter(3, 60.0, clock=clock)  # one token every 20 s
    for i in range(3):
        lim.failed("h", f"g{i}")
    assert lim.blocked("h") == 20
    clock.now += 19.5
    assert lim.blocked("h") == 1


def test_the_addresses_remembered_are_bounded() -> None:
    lim = FailureLimiter(2, 10.0, max_clients=100, clock=Clock())
    for i in range(1000):
        lim.failed(f"10.0.{i // 256}.{i % 256}", "k")
    assert len(lim) == 100
    lim.failed("10.9.9.9", "a")
    lim.failed("10.9.9.9", "b")
    assert lim.blocked("10.9.9.9") is not None and len(lim) == 100


def test_the_same_bad_credential_again_costs_nothing() -> None:
    """A client retrying a stale key is no guesser: behind a shared address it must not lock others out."""
    lim = FailureLimiter(3, 600.0, clock=Clock())
    for _ in range(100):
        lim.failed("10.0.0.1", "Bearer sk-smg-stale")
    assert lim.blocked("10.0.0.1") is None
    for i in range(2):
        lim.failed("10.0.0.1", f"Bearer sk-smg-guess-{i}")
    assert lim.blocked("10.0.0.1") is not None
    # a guess seen more than RECENT distinct credentials ago counts again
    clock = Clock()
    lim2 = FailureLimiter(100, 600.0, clock=clock)
    for i in range(FailureLimiter.RECENT + 1):
        lim2.failed("h", f"g{i}")
    lim2.failed("h", "g0")
    assert lim2._tokens("h", clock()) == 100 - (FailureLimiter.RECENT + 2)


def test_ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    assert client_key("::ffff:10.0.0.1") == client_key("10.0.0.1") == "10.0.0.1"
    assert client_key(None) == ""
    lim = FailureLimiter(2, 10.0, clock=Clock())
    lim.failed("2001:db8::1", "a")
    lim.failed("2001:db8::2", "b")
    assert lim.blocked("2001:db8::3") is not None


def test_the_settings() -> None:
    cfg = auth_config({"mode": "api_key"})
    assert (cfg.failure_limit, cfg.failure_window_secs) == (20, 10.0)
    cfg = auth_config({"mode": "api_key", "failure_limit": 5, "failure_window_secs": 60})
    assert (cfg.failure_limit, cfg.failure_window_secs) == (5, 60)
    for bad in (
        {"failure_limit": -1},
        {"failure_limit": "5"},
        {"failure_limit": True},
        {"failure_window_secs": 0},
        {"failure_window_secs": "10"},
    ):
        with pytest.raises(AuthConfigError):
            auth_config({"mode": "api_key", **bad})


# ---- in the middleware ---------------------------------------------------------------------------------


async def ok(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps({"ok": True}), content_type="application/json")


Factory = Callable[..., Any]


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Factory]:
    monkeypatch.setenv("T_FAIL_ADMIN_KEY", ADMIN)
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(**extra: Any) -> TestClient[web.Request, web.Application]:
        app = web.Application()
        app.add_routes(
            [
                web.get("/v1/models", ok),
                web.post("/v1/messages", ok),
                web.get("/workers", ok),
                web.get("/health", ok),
            ]
        )
        auth.install(app, auth_config({"mode": "api_key", "admin_key_env": "T_FAIL_ADMIN_KEY", **extra}))
        c = TestClient(TestServer(app))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def bearer(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


async def test_a_guesser_gets_429_and_then_even_a_good_key_does(client: Factory) -> None:
    c = await client(failure_limit=5, failure_window_secs=600)
    for i in range(5):
        r = await c.get("/v1/models", headers=bearer(f"sk-smg-guess-{i}"))
        assert r.status == 401, i
    r = await c.get("/v1/models", headers=bearer("sk-smg-guess-6"))
    body = await r.json()
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1, body
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "auth_rate_limited"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    # the credential is not looked at: a valid one waits too, on every authenticated plane
    r = await c.get("/v1/models", headers=bearer(ADMIN))
    assert r.status == 429
    r = await c.get("/workers", headers=bearer(ADMIN))
    assert r.status == 429
    # Anthropic's envelope on the Messages API
    r = await c.post("/v1/messages", headers={"x-api-key": "sk-smg-guess-7"}, data=b"{}")
    body = await r.json()
    assert r.status == 429 and "Retry-After" in r.headers, body
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    # the probes are public: never limited
    assert (await c.get("/health")).status == 200


async def test_successes_and_missing_credentials_are_not_counted(client: Factory) -> None:
    c = await client(failure_limit=3, failure_window_secs=600)
    for _ in range(50):
        assert (await c.get("/v1/models", headers=bearer(ADMIN))).status == 200
        assert (await c.get("/v1/models")).status == 401  # no credential: nothing guessed
    for _ in range(50):  # the same bad key again and again: one failure
        assert (await c.get("/v1/models", headers=bearer("sk-smg-stale"))).status == 401
    assert (await c.get("/v1/models", headers=bearer("sk-smg-wrong"))).status == 401
    assert (await c.get("/v1/models", headers=bearer(ADMIN))).status == 200  # 2 of 3: still served
    assert (await c.get("/v1/models", headers={"x-api-key": "sk-smg-wrong-2"})).status == 401
    assert (await c.get("/v1/models", headers=bearer(ADMIN))).status == 429


async def test_the_default_limit_and_turning_it_off(client: Factory) -> None:
    c = await client()
    codes = [(await c.get("/v1/models", headers=bearer(f"sk-smg-g{i}"))).status for i in range(21)]
    assert codes == [401] * 20 + [429]
    off = await client(failure_limit=0)
    codes = [(await off.get("/v1/models", headers=bearer(f"sk-smg-g{i}"))).status for i in range(40)]
    assert set(codes) == {401}


# ---- a short bootstrap key -------------------------------------------------------------------------------


def test_a_short_key_from_the_environment_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("T_SHORT_KEY", "hunter2-short")
    monkeypatch.setenv("T_LONG_KEY", "x" * 32)
    with caplog.at_level(logging.WARNING, logger="shepherd.auth"):
        auth.build_state(auth_config({"mode": "api_key", "admin_key_env": ["T_SHORT_KEY", "T_LONG_KEY"]}))
    warned = [r.getMessage() for r in caplog.records if "T_SHORT_KEY" in r.getMessage()]
    assert len(warned) == 1 and "13 characters" in warned[0] and "32" in warned[0], caplog.text
    assert "T_LONG_KEY" not in caplog.text and "hunter2" not in caplog.text
