"""The node's HTTP/1.1 front end, end to end: one mock engine and two real nodes, one on the lean server
(``--http-server lean``, the default) and one on aiohttp's, driven by the openai SDK, httpx and raw
sockets. What a client sees must not depend on the server: answers, streams, SSE keep-alive comments,
envelopes and aborts on disconnect. The lean server's own behaviours (keep-alive with pipelining,
``Expect: 100-continue``, HTTP/1.0, gzip bodies, graceful shutdown with a stream in flight) are checked
on real connections."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import NodeProc, running_node, start_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MSGS: list[Any] = [{"role": "user", "content": "Tell me a story."}]
SERVERS = ("lean", "aiohttp")


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "2", "--output-len", "24") as e:
        yield e


def node_args(engine: MockEngineProc, server: str) -> tuple[str, ...]:
    return (
        *("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3"),
        *("--tokenizer-workers", "0", "--sse-keepalive-secs", "0.2", "--http-server", server),
    )


@pytest.fixture(scope="module")
def nodes(engine: MockEngineProc) -> Iterator[dict[str, NodeProc]]:
    with (
        running_node(*node_args(engine, "lean")) as lean,
        running_node(*node_args(engine, "aiohttp")) as aio,
    ):
        yield {"lean": lean, "aiohttp": aio}


@pytest.fixture(autouse=True)
def _clean_faults(engine: MockEngineProc) -> Iterator[None]:
    yield
    faults = {"error_rate": 0.0, "stall_after_tokens": None, "stall_seconds": 0.0}
    httpx.post(f"{engine.http_url}/mock/faults", json=faults, timeout=5)


def sdk(node: NodeProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def in_flight(node: NodeProc) -> int:
    """Requests the node still handles (bounded polling: disconnects are noticed asynchronously)."""
    n = 0
    for _ in range(100):
        n = int(httpx.get(node.url + "/health", timeout=5).json()["in_flight"])  # /health is not counted
        if n == 0:
            break
        time.sleep(0.05)
    return n


# ---- the same answers from both servers ---------------------------------------------------------------


def test_both_servers_give_the_same_answers(nodes: dict[str, NodeProc]) -> None:
    got: dict[str, tuple[str, str]] = {}
    for name, node in nodes.items():
        c = sdk(node)
        full = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=12, seed=5)
        chunks = list(
            c.chat.completions.create(
                model="qwen3",
                messages=MSGS,
                max_tokens=12,
                seed=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12, name
        got[name] = (full.choices[0].message.content or "", streamed)
    assert got["lean"] == got["aiohttp"]
    assert got["lean"][0] == got["lean"][1]


@pytest.mark.parametrize("server", SERVERS)
def test_headers_and_envelopes(nodes: dict[str, NodeProc], server: str) -> None:
    url = nodes[server].url
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "qwen3", "messages": MSGS, "max_tokens": 2},
        headers={"x-request-id": "front-1"},
        timeout=30,
    )
    waited_ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200 and r.headers["x-request-id"] == "front-1"
    # the node's own time before dispatch: milliseconds with 3 decimals, > 0, within what the client waited
    gateway_ms = r.headers["x-smg-gateway-ms"]
    assert re.fullmatch(r"\d+\.\d{3}", gateway_ms), gateway_ms
    assert 0 < float(gateway_ms) < waited_ms
    assert r.headers["content-type"].startswith("application/json")
    assert int(r.headers["content-length"]) == len(r.content)
    nf = httpx.get(url + "/v1/nothing", timeout=10)
    assert nf.status_code == 404 and nf.json()["error"]["type"] == "not_found_error"
    na = httpx.get(url + "/v1/chat/completions", timeout=10)
    assert na.status_code == 405 and na.headers["allow"] == "POST" and na.json()["error"]["message"]
    big = httpx.post(
        url + "/v1/tokenize",
        content=b" " * (17 * 1024 * 1024),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("server", SERVERS)
def test_sse_keepalive_comments_during_a_stall(
    nodes: dict[str, NodeProc], engine: MockEngineProc, server: str
) -> None:
    faults = {"stall_after_tokens": 2, "stall_seconds": 1.0}
    assert httpx.post(f"{engine.http_url}/mock/faults", json=faults, timeout=5).status_code < 300
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 6, "stream": True}
    r = httpx.post(nodes[server].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert b": keep-alive\n\n" in r.content
    assert r.content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("server", SERVERS)
def test_disconnect_mid_stream_aborts_the_engine_request(
    nodes: dict[str, NodeProc], engine: MockEngineProc, server: str
) -> None:
    rid = f"front-{server}-{time.time_ns()}"
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        nodes[server].url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": rid},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content"' in line:
                break
    for _ in range(200):  # bounded polling: the abort travels in the background
        stats = httpx.get(f"{engine.http_url}/mock/stats", timeout=5).json()
        if any(str(a).partition(".")[2].startswith(rid) for a in stats["aborted"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine never saw an abort for the disconnected request")
    assert in_flight(nodes[server]) == 0


# ---- the lean server on raw connections -------------------------------------------------------------


def recv_response(s: socket.socket, buf: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """One Content-Length response from ``buf`` + the socket: (status, headers, body, what follows)."""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, "closed before a response head"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        assert chunk, "closed inside a body"
        rest += chunk
    return status, headers, rest[:n], rest[n:]


def chat_request(body: bytes, *extra: str) -> bytes:
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: t",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


BODY = json.dumps({"model": "qwen3", "messages": MSGS, "max_tokens": 3}).encode()


def test_keep_alive_with_pipelined_requests(nodes: dict[str, NodeProc]) -> None:
    with socket.create_connection(("127.0.0.1", nodes["lean"].port), timeout=30) as s:
        s.sendall(b"GET /liveness HTTP/1.1\r\nHost: t\r\n\r\n" + chat_request(BODY) + chat_request(BODY))
        buf = b""
        got = []
        for _ in range(3):
            status, headers, body, buf = recv_response(s, buf)
            got.append((status, headers, body))
        assert [g[0] for g in got] == [200, 200, 200]
        assert json.loads(got[0][2]) == {"status": "alive"}
        assert json.loads(got[1][2])["object"] == "chat.completion"
        s.sendall(b"GET /liveness HTTP/1.1\r\nHost: t\r\n\r\n")  # the connection is still open
        assert recv_response(s, buf)[0] == 200


def test_expect_100_continue_with_a_large_body(nodes: dict[str, NodeProc]) -> None:
    """What curl does with a body over 1 KB: the head, a wait for ``100 Continue``, then the body."""
    long = [{"role": "user", "content": "word " * 5000}]  # 25 KB
    body = json.dumps({"model": "qwen3", "messages": long, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", nodes["lean"].port), timeout=30) as s:
        req = chat_request(body, "Expect: 100-continue")
        s.sendall(req[: -len(body)])
        interim = s.recv(1024)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, _, answer, _ = recv_response(s, b"")
        assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] > 4000


def test_http_10_and_gzip_bodies(nodes: dict[str, NodeProc]) -> None:
    with socket.create_connection(("127.0.0.1", nodes["lean"].port), timeout=30) as s:
        s.sendall(b"GET /liveness HTTP/1.0\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):  # HTTP/1.0 without keep-alive: the server closes
            out += chunk
        assert out.startswith(b"HTTP/1.0 200 OK\r\n") and out.endswith(b'{"status":"alive"}')
    gz = gzip.compress(BODY)
    r = httpx.post(
        nodes["lean"].url + "/v1/chat/completions",
        content=gz,
        headers={"content-encoding": "gzip", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_graceful_shutdown_lets_a_stream_finish(engine: MockEngineProc) -> None:
    """SIGTERM with a stream in flight: readiness goes 503, the stream ends with [DONE], the node exits 0."""
    node = start_node(*node_args(engine, "lean"))
    try:
        body = {"model": "qwen3", "messages": MSGS, "max_tokens": 300, "ignore_eos": True, "stream": True}
        started = threading.Event()
        out: dict[str, bytes] = {}

        def stream() -> None:
            with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=30) as r:
                parts = []
                for chunk in r.iter_raw():
                    parts.append(chunk)
                    started.set()
                out["raw"] = b"".join(parts)

        t = threading.Thread(target=stream)
        t.start()
        try:
            assert started.wait(30)
            node.proc.send_signal(signal.SIGTERM)
        finally:
            t.join(60)
        assert out["raw"].endswith(b"data: [DONE]\n\n")
        assert node.proc.wait(timeout=30) == 0
    finally:
        node.stop(signal.SIGKILL)


def test_when_the_grace_is_over_what_is_left_ends_with_its_error(engine: MockEngineProc) -> None:
    """SIGTERM with a 2 s grace and answers that would take longer: while draining, answers close their
    connections (``Connection: close``: the client's next request goes to another node); when the grace
    is over, a stream under way ends with its in-band error and its body's end (chat: the error event then
    [DONE]; Messages: ``event: error``), a request not yet answered gets a 503 ``server_shutting_down``,
    and every engine call is aborted; the node exits 0."""
    node = start_node(*node_args(engine, "lean"), "--shutdown-grace-period-secs", "2")
    # every answer stalls after its first tokens for longer than the grace
    stall = {"stall_after_tokens": 2, "stall_seconds": 30.0}
    httpx.post(f"{engine.http_url}/mock/faults", json=stall, timeout=5).raise_for_status()
    long = {"model": "qwen3", "messages": MSGS, "max_tokens": 64}
    out: dict[str, Any] = {}
    started = threading.Barrier(4, timeout=30)

    def stream(key: str, path: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", node.url + path, json=body, timeout=60) as r:
            parts: list[bytes] = []
            for chunk in r.iter_raw():  # bounded: the grace, then the error and the body's end
                if not parts:
                    started.wait()
                parts.append(chunk)
            out[key] = b"".join(parts)

    def whole() -> None:
        with httpx.Client(timeout=60) as c:
            c.get(node.url + "/v1/models")  # (the connection is up before the signal)
            started.wait()
            out["whole"] = c.post(node.url + "/v1/chat/completions", json=long)

    threads = [
        threading.Thread(target=stream, args=("chat", "/v1/chat/completions", {**long, "stream": True})),
        threading.Thread(target=stream, args=("messages", "/v1/messages", {**long, "stream": True})),
        threading.Thread(target=whole),
    ]
    try:
        for t in threads:
            t.start()
        started.wait()
        for _ in range(400):  # bounded: the three are at the engine (stalled there)
            if httpx.get(f"{engine.http_url}/mock/stats", timeout=5).json()["active"] >= 3:
                break
            time.sleep(0.05)
        node.proc.send_signal(signal.SIGTERM)
        for _ in range(400):  # bounded: the node is draining (its readiness says so)
            if httpx.get(node.url + "/readiness", timeout=5).status_code == 503:
                break
            time.sleep(0.05)
        during = httpx.get(node.url + "/v1/models", timeout=10)  # while draining: answered, then closed
        assert during.status_code == 200 and during.headers["connection"] == "close"
        for t in threads:
            t.join(60)
        chat, messages, resp = out["chat"], out["messages"], out["whole"]
        assert b'"code":"server_shutting_down"' in chat and chat.endswith(b"data: [DONE]\n\n"), chat[-300:]
        assert b"event: error" in messages and b"shutting down" in messages, messages[-300:]
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down", resp.text
        assert node.proc.wait(timeout=30) == 0
        for _ in range(100):  # bounded: the aborts reach the engine
            if httpx.get(engine.http_url + "/mock/stats", timeout=5).json()["active"] == 0:
                break
            time.sleep(0.05)
        assert httpx.get(engine.http_url + "/mock/stats", timeout=5).json()["active"] == 0
    finally:
        node.stop(signal.SIGKILL)


@pytest.mark.parametrize("server", SERVERS)
def test_cors_is_off_by_default_and_on_for_the_listed_origins(engine: MockEngineProc, server: str) -> None:
    """``--cors-allowed-origins``: a preflight from a listed origin is answered 204 before authentication
    (the headers it asked for echoed, Authorization among them); every answer to it (whole, streamed,
    an error) carries Access-Control-Allow-Origin; an origin not listed, the control plane and a node
    without the flag get none (the browser refuses)."""
    app, other = "https://app.example", "https://evil.example"
    preflight = {
        "Origin": app,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 4}
    key = "sk-cors-e2e-" + "k" * 24
    with (
        running_node(*node_args(engine, server)) as off,
        running_node(
            *node_args(engine, server),
            *("--cors-allowed-origins", app, "--auth-mode", "api_key"),
            *("--auth-admin-key-sha256", hashlib.sha256(key.encode()).hexdigest()),
        ) as on,
        httpx.Client(timeout=30) as c,
    ):
        r = c.options(off.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = c.options(on.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == app and r.headers["vary"] == "Origin"
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "POST" in r.headers["access-control-allow-methods"]
        auth = {"Origin": app, "Authorization": f"Bearer {key}"}
        r = c.post(on.url + "/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        with c.stream(
            "POST", on.url + "/v1/chat/completions", json={**body, "stream": True}, headers=auth
        ) as s:
            assert s.status_code == 200 and s.headers["access-control-allow-origin"] == app
            assert s.read().endswith(b"data: [DONE]\n\n")
        r = c.post(on.url + "/v1/chat/completions", json={**body, "model": "nope"}, headers=auth)
        assert r.status_code == 404 and r.headers["access-control-allow-origin"] == app
        r = c.post(on.url + "/v1/chat/completions", json=body, headers={"Origin": app})  # no key: 401
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == app
        r = c.post(on.url + "/v1/chat/completions", json=body, headers={**auth, "Origin": other})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options(on.url + "/v1/chat/completions", headers={**preflight, "Origin": other})
        assert "access-control-allow-origin" not in r.headers
        r = c.options(on.url + "/admin/keys", headers=preflight)  # the control plane: never
        assert "access-control-allow-origin" not in r.headers
