"""Client-facing error messages never carry a worker's address: the real error middleware in an
in-process app, fed engine errors whose text names the worker (an engine's own error detail can, and
gRPC's connect failures do: ``ipv4:10.1.2.3:50051``). The whole text stays in the node's log."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from shepherd.node.api.common import GATEWAY, error_middleware, public_engine_message
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.metrics import NodeMetrics
from shepherd.proto.engine_types import EngineError, EngineTimeout, EngineUnavailable

WORKER = "http://inference-7.internal.example:8000"
ERRORS: list[EngineError] = [
    EngineUnavailable(
        f"HTTP worker {WORKER} unreachable: Cannot connect to host inference-7.internal.example:8000"
    ),
    EngineUnavailable(
        "engine unavailable: failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.1.2.3:50051: Failed to connect to remote host: Connection refused"
    ),
    EngineTimeout("engine timed out: deadline exceeded talking to [fd00::17]:50051"),
    EngineError("engine error (INTERNAL): upstream grpc://10.1.2.3:50051 reset the stream"),
    EngineError("engine rejected the request: prompt from 192.168.7.7 too long", code="invalid_request"),
]
LEAKS = ("inference-7", "10.1.2.3", "fd00::17", "192.168.7.7", "8000", "50051")


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: e.code)
async def test_engine_errors_reach_clients_without_addresses(
    err: EngineError, caplog: pytest.LogCaptureFixture
) -> None:
    workers = {"w1": SimpleNamespace(url=WORKER)}
    gw = SimpleNamespace(metrics=NodeMetrics(), in_flight=0, registry=SimpleNamespace(workers=workers))

    async def fail(request: web.Request) -> web.Response:
        raise err

    app = web.Application(middlewares=[error_middleware])
    app[GATEWAY] = cast(Gateway, gw)
    app.add_routes([web.post("/v1/chat/completions", fail)])
    caplog.set_level(logging.WARNING)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/v1/chat/completions", json={})
        body = await r.json()
    assert r.status in (400, 502, 504) and body["error"]["code"] == err.code
    text = body["error"]["message"]
    assert "<worker>" in text and not any(leak in text for leak in LEAKS), text
    if r.status != 400:
        assert str(err) in caplog.text  # the operator keeps the detail


def test_plain_text_is_left_alone() -> None:
    msg = "engine rejected the request: max_tokens 9000 exceeds 8192 at 12:30"
    assert public_engine_message(msg) == msg


def test_a_history_store_failure_names_the_store_not_where_it_is() -> None:
    """A store's driver says where it is (a path, an address): the client gets which store and when to
    retry, the rest stays in the log."""
    from shepherd.node.api.common import history_unavailable
    from shepherd.storage.types import StorageUnavailable

    err = history_unavailable(
        StorageUnavailable("SQLite /var/lib/shepherd/history.db: database or disk is full"), "history"
    )
    assert err.status == 503 and err.headers.get("Retry-After") == "1"
    assert "/var/lib" not in err.message and "history" in err.message
    err = history_unavailable(
        StorageUnavailable("Redis unavailable: Error 111 connecting to 10.0.0.9:6379"), "x"
    )
    assert "10.0.0.9" not in err.message
