"""End to end, on real nodes: what a worker URL can make a node do (SSRF through HTTP workers), the HTTP
relay's answers (content types, caps, redirects, encodings), worker addresses kept out of client errors,
the add-worker probe budget, and the cap on client connections (lean and aiohttp fronts).

The OpenAI HTTP worker is a small aiohttp app in a thread of this process (``Upstream``): its behaviour
is switched per test (``mode``) and it records what it was asked. Every node is stopped by pid."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.e2e.node_procs import NodeProc, free_port, running_node
from tests.e2e.threaded_app import ThreadedApp

pytestmark = pytest.mark.timeout(180)

MSGS = [{"role": "user", "content": "hi"}]
SECRET = "s3cr3t-internal-payload"
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "qwen3",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class Upstream(ThreadedApp):
    """An OpenAI HTTP worker stand-in on loopback, in a thread with its own event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "ok"
        self.hits: list[tuple[str, str, dict[str, str]]] = []

    async def _handle(self, r: web.Request) -> web.StreamResponse:
        self.hits.append((r.method, r.path, dict(r.headers)))
        if r.path == "/health":
            return web.Response(status=200)
        if r.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "qwen3", "max_model_len": 4096}]})
        if r.path == "/internal":
            return web.json_response({"secret": SECRET})
        await r.read()
        mode = self.mode
        if mode == "html":
            return web.Response(text=f"<html>{SECRET}</html>", content_type="text/html")
        if mode == "redirect":
            raise web.HTTPTemporaryRedirect("/internal")
        if mode in ("gzip", "gzip-always"):
            body = orjson.dumps(COMPLETION)
            if mode == "gzip-always" or "gzip" in r.headers.get("Accept-Encoding", ""):
                return web.Response(
                    body=gzip.compress(body),
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                )
            return web.Response(body=body, content_type="application/json")
        if mode == "huge":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 200 << 20
            await resp.prepare(r)
            await resp.write(b'{"pad": "' + b"x" * 1000)
            return resp  # the declared length is never sent: the node must not wait for it
        if mode == "disconnect":
            assert r.transport is not None
            r.transport.close()
            return web.Response()
        return web.json_response(COMPLETION)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    u = Upstream().start()
    try:
        yield u
    finally:
        u.stop()


@pytest.fixture()
def up(upstream: Upstream) -> Iterator[Upstream]:
    upstream.mode = "ok"
    upstream.hits.clear()
    yield upstream
    upstream.mode = "ok"


@pytest.fixture(scope="module")
def relay_node(upstream: Upstream) -> Iterator[NodeProc]:
    with running_node(
        *("--worker-urls", upstream.url, "--model-id", "qwen3", "--tokenizer-workers", "0"),
        *("--cb-failure-threshold", "100000"),  # the failures these tests provoke must not open it
    ) as n:
        yield n


def chat(node: NodeProc, **kw: Any) -> httpx.Response:
    body = {"model": "qwen3", "messages": MSGS, **kw}
    return httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30)


def assert_envelope(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- 1. SSRF through worker URLs -------------------------------------------------------------------


@pytest.mark.parametrize("tail", ["/internal#", "#", "?", "/internal", "/internal?x=1"])
def test_admin_api_refuses_worker_urls_with_more_than_host_and_port(
    tail: str, relay_node: NodeProc, up: Upstream
) -> None:
    r = httpx.post(relay_node.url + "/workers", json={"url": up.url + tail, "model_id": "qwen3"}, timeout=30)
    assert_envelope(r, 400, "invalid_worker_url")
    workers = httpx.get(relay_node.url + "/workers", timeout=5).json()["workers"]
    assert [w["url"] for w in workers] == [up.url]
    assert not any(h[1] == "/internal" for h in up.hits)


def test_worker_allow_refuses_workers_on_the_admin_api_and_in_the_config() -> None:
    up = Upstream().start()  # its own: nothing else dials it
    try:
        with running_node("--model-id", "qwen3", "--worker-allow", "10.0.0.0/8", wait_ready=False) as node:
            r = httpx.post(node.url + "/workers", json={"url": up.url, "model_id": "qwen3"}, timeout=30)
            assert_envelope(r, 400, "worker_not_allowed")
            assert httpx.get(node.url + "/workers", timeout=5).json()["workers"] == []
        assert up.hits == []  # never dialed
        args = ("--worker-urls", up.url, "--model-id", "qwen3", "--worker-allow", "10.0.0.0/8")
        with pytest.raises(RuntimeError, match="worker_allow"), running_node(*args):
            pass
        assert up.hits == []
    finally:
        up.stop()


def test_relay_passes_only_json_and_sse(relay_node: NodeProc, up: Upstream) -> None:
    assert chat(relay_node).json()["choices"][0]["message"]["content"] == "hello"
    up.mode = "html"
    r = chat(relay_node)
    assert_envelope(r, 502, "bad_worker_response")
    assert SECRET not in r.text
    r = chat(relay_node, stream=True)
    assert_envelope(r, 502, "bad_worker_response")
    assert SECRET not in r.text


def test_relay_does_not_follow_redirects(relay_node: NodeProc, up: Upstream) -> None:
    up.mode = "redirect"
    r = chat(relay_node)
    assert_envelope(r, 502, "bad_worker_response")
    assert SECRET not in r.text
    assert not any(h[1] == "/internal" for h in up.hits)


def test_relay_answer_is_size_capped(relay_node: NodeProc, up: Upstream) -> None:
    up.mode = "huge"
    r = chat(relay_node)
    assert_envelope(r, 502, "bad_worker_response")


# ---- 2. encodings ------------------------------------------------------------------------------------


def test_relay_asks_for_identity_and_refuses_an_encoded_answer(relay_node: NodeProc, up: Upstream) -> None:
    up.mode = "gzip"  # gzips when asked to
    r = chat(relay_node)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello"
    posts = [h for h in up.hits if h[0] == "POST"]
    assert posts and posts[-1][2].get("Accept-Encoding") == "identity"
    up.mode = "gzip-always"  # gzips whatever it is asked: not relayed as a corrupt body
    assert_envelope(chat(relay_node), 502, "bad_worker_response")


# ---- 4. worker addresses stay out of client-facing errors ---------------------------------------------


def test_relay_errors_do_not_name_the_worker_url(relay_node: NodeProc, up: Upstream) -> None:
    up.mode = "disconnect"
    r = chat(relay_node)
    assert r.status_code in (502, 503), r.text
    assert str(up.port) not in r.text and "127.0.0.1" not in r.text


def test_grpc_errors_do_not_name_the_worker_address() -> None:
    dead = free_port()
    with running_node("--model-id", "qwen3", "--tokenizer-workers", "0", wait_ready=False) as node:
        url = f"grpc://127.0.0.1:{dead}"
        add = httpx.post(node.url + "/workers", json={"url": url, "model_id": "qwen3"}, timeout=30)
        assert add.status_code == 202, add.text
        wid = add.json()["id"]
        r = httpx.post(
            node.url + "/v1/chat/completions",
            json={"model": "qwen3", "messages": MSGS, "max_tokens": 2},
            headers={"x-smg-target-worker": wid},
            timeout=30,
        )
        assert r.status_code in (502, 503), r.text
        assert str(dead) not in r.text and "127.0.0.1" not in r.text
        assert url in httpx.get(node.url + "/workers", timeout=5).text  # the control plane shows it


# ---- 1. the add-worker answer is no port scanner ----------------------------------------------------


def test_adds_of_workers_that_fail_their_first_check_are_rate_limited() -> None:
    with running_node(
        "--model-id",
        "qwen3",
        "--tokenizer-workers",
        "0",
        "--health-check-timeout-secs",
        "0.5",
        wait_ready=False,
    ) as node:
        statuses = []
        for i in range(30):  # bounded: the budget's burst is 20
            r = httpx.post(
                node.url + "/workers",
                json={"url": f"http://127.0.0.{i + 2}:{free_port()}", "model_id": "qwen3"},
                timeout=30,
            )
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert_envelope(r, 429, "worker_probe_rate_limited")
                assert int(r.headers["Retry-After"]) >= 1
                break
            assert r.status_code == 202 and r.json()["healthy"] is False
            assert set(r.json()) >= {"id", "url", "healthy"} and "error" not in r.json()
        # the burst, and what the budget refilled meanwhile (a slow host's adds take a while each)
        assert statuses[-1] == 429 and 20 <= statuses.count(202) < 30


# ---- 3. the client-connection cap -------------------------------------------------------------------


def _open(port: int) -> socket.socket:
    """A keep-alive connection the node has accepted and served (``/liveness`` once)."""
    for _ in range(100):  # bounded: connections of the readiness probes may still be closing
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
        got = s.recv(65536)
        if got.startswith(b"HTTP/1.1 200"):
            return s
        s.close()
        time.sleep(0.05)
    raise AssertionError("no connection was accepted")


@pytest.mark.parametrize("front", ["lean", "aiohttp"])
def test_client_connections_past_the_cap_are_refused(front: str) -> None:
    with running_node(
        "--model-id", "qwen3", "--tokenizer-workers", "0", "--max-client-connections", "3",
        "--http-server", front, wait_ready=False,
    ) as node:  # fmt: skip
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(_open(node.port)) for _ in range(3)]
            extra = socket.create_connection(("127.0.0.1", node.port), timeout=10)
            with extra:
                got = b""
                while True:  # bounded: the node closes the connection after its answer
                    part = extra.recv(65536)
                    if not part:
                        break
                    got += part
            assert got.startswith(b"HTTP/1.1 503"), got
            assert b"too_many_connections" in got
            held.pop().close()
        metrics = ""
        for _ in range(100):  # bounded: the closed connections leave the node's count on its next turn
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(node.url + "/metrics", timeout=5)
                if r.status_code == 200:
                    metrics = r.text
                    break
            time.sleep(0.05)
        assert "smg_http_connections_refused_total 1.0" in metrics
