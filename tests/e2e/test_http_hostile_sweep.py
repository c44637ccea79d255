"""A hostile client against the node's lean HTTP/1.1 front (``shepherd/node/http``), end to end: a real
mock engine and real nodes on loopback (ports in 42000-42999), raw sockets. What a sweep of malformed,
slow and surprising clients found, each checked here so it stays fixed:

- a request with ``Upgrade`` (``curl --http2`` sends ``Upgrade: h2c`` with every request, POSTs included)
  lost its body: httptools ends an upgrade request at its head, so a chat request came in empty (400).
  The server declines the upgrade and reads the body; nothing after it is parsed as a request.
- protocol-level refusals (malformed framing, too many or too large header fields, a URL too long) of a
  request to the Messages API were in the OpenAI envelope: they are in Anthropic's.
- a request head larger than ``Limits.max_head`` passed when it ended in the read that crossed the limit.
- with an open-files limit below ``max_client_connections``, idle connections took every descriptor and
  new clients were reset without an answer: the cap now stays within the limit (a 503 in the envelope).
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.logs import log_file
from tests.e2e.node_procs import BIN, NodeProc, http_status, reserved_port, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_hostile_inputs import raw_exchange

MSGS: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
CHAT_BODY = json.dumps({"model": "qwen3", "messages": MSGS, "max_tokens": 3}).encode()
UPGRADE = (
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)
CANARY = b"GET /v1/hidden-canary HTTP/1.1\r\nHost: x\r\n\r\n"


def free_port_in_range(avoid: set[int]) -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


_TAKEN: set[int] = set()


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    grpc, http = free_port_in_range(_TAKEN), free_port_in_range(_TAKEN)
    with start_mock_engine(
        *("--grpc-port", str(grpc), "--http-port", str(http), "--model", "qwen3"),
        *("--decode-ms-per-token", "1", "--output-len", "16"),
    ) as e:
        yield e


def node_flags(engine: MockEngineProc) -> tuple[str, ...]:
    return ("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--tokenizer-workers", "0")


@pytest.fixture(scope="module")
def node(engine: MockEngineProc) -> Iterator[NodeProc]:
    with running_node(
        *node_flags(engine), "--max-payload-size", "100000", port=free_port_in_range(_TAKEN)
    ) as n:
        yield n


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data``, read until the server closes (or ``timeout`` of silence)."""
    return raw_exchange(port, data, timeout)


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``raw`` (Content-Length framed, as the node's answers to these requests are)."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw[:300]
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status == 100:
            raw = rest
            continue
        n = int(headers["content-length"])
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def assert_healthy(node: NodeProc, engine: MockEngineProc) -> None:
    """The node alive, serving, no traceback in its log, no engine request left running."""
    assert node.proc.poll() is None, node.log()[-3000:]
    r = httpx.post(node.url + "/v1/chat/completions", content=CHAT_BODY, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 200, r.text
    active = -1
    for _ in range(100):  # bounded: aborts travel in the background
        active = httpx.get(f"{engine.http_url}/mock/stats", timeout=10).json()["active"]
        if active == 0:
            break
        time.sleep(0.05)
    assert active == 0
    assert "Traceback" not in node.log(), node.log()[-3000:]


# ---- Upgrade: declined, the body read ---------------------------------------------------------------------


def chat_head(framing: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + UPGRADE
        + framing
        + b"\r\n"
    )


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


@pytest.mark.parametrize(
    "parts",
    [
        [chat_head(b"Content-Length: %d\r\n" % len(CHAT_BODY)) + CHAT_BODY + CANARY],
        [chat_head(b"Content-Length: %d\r\n" % len(CHAT_BODY)), CHAT_BODY[:7], CHAT_BODY[7:] + CANARY],
        [chat_head(b"Transfer-Encoding: chunked\r\n") + chunked(CHAT_BODY) + CANARY],
        [
            chat_head(b"Transfer-Encoding: chunked\r\n"),
            chunked(CHAT_BODY)[:9],
            chunked(CHAT_BODY)[9:] + CANARY,
        ],
    ],
    ids=["content-length", "content-length-split", "chunked", "chunked-split"],
)
def test_upgrade_request_keeps_its_body(parts: list[bytes], node: NodeProc, engine: MockEngineProc) -> None:
    """What ``curl --http2 -d ... http://node/v1/chat/completions`` sends: answered as HTTP/1.1 with the
    body read (it was answered 400, "The request body is empty"); what follows the body is not a request."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(0.05)  # separate reads (not a timing assertion: any split is valid)
        raw = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                raw += chunk
    got = responses(raw)
    assert [status for status, _, _ in got] == [200], raw[:400]  # one answer: the canary never ran
    _, headers, body = got[0]
    assert headers.get("connection") == "close"
    assert orjson.loads(body)["object"] == "chat.completion"
    assert_healthy(node, engine)


def test_upgrade_request_body_over_the_limit(node: NodeProc, engine: MockEngineProc) -> None:
    big = b'{"x": "' + b"a" * 200_000 + b'"}'
    got = responses(exchange(node.port, chat_head(b"Transfer-Encoding: chunked\r\n") + chunked(big) + CANARY))
    assert [s for s, _, _ in got] == [413]
    assert orjson.loads(got[0][2])["error"]["code"] == "body_too_large"
    assert_healthy(node, engine)


# ---- protocol-level refusals in the Messages API's envelope ------------------------------------------------

MESSAGES = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (MESSAGES + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (MESSAGES + b"Transfer-Encoding: gzip\r\n\r\n", 400),
        (MESSAGES + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", 431),
        (MESSAGES + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /v1/messages/count_tokens?" + b"q" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"POST http://h/v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ],
    ids=["bad-chunk", "transfer-encoding", "many-fields", "huge-field", "long-url", "absolute-form"],
)
def test_messages_api_protocol_errors_use_its_envelope(
    data: bytes, status: int, node: NodeProc, engine: MockEngineProc
) -> None:
    got = responses(exchange(node.port, data))
    assert [s for s, _, _ in got] == [status]
    err = orjson.loads(got[0][2])
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"]
    assert_healthy(node, engine)


def test_other_routes_keep_the_openai_envelope(node: NodeProc, engine: MockEngineProc) -> None:
    data = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    got = responses(exchange(node.port, data))
    assert [s for s, _, _ in got] == [400]
    assert orjson.loads(got[0][2])["error"]["code"] == "bad_http_request"


def test_an_http_version_other_than_1_x_is_a_505(node: NodeProc, engine: MockEngineProc) -> None:
    got = responses(exchange(node.port, b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"))  # (was served)
    assert [s for s, _, _ in got] == [505]
    assert orjson.loads(got[0][2])["error"]["code"] == "http_version"
    for line in (b"GET /health HTTP/3.0", b"GET /health HTTP/1.9"):  # refused, by the parser or here
        got = responses(exchange(node.port, line + b"\r\nHost: x\r\n\r\n"))
        assert [s for s, _, _ in got] in ([400], [505]), line
    assert [s for s, _, _ in responses(exchange(node.port, b"GET /health HTTP/1.0\r\n\r\n"))] == [200]
    assert_healthy(node, engine)


# ---- the head limit ---------------------------------------------------------------------------------------


def test_head_over_the_limit_in_one_write(node: NodeProc, engine: MockEngineProc) -> None:
    """100 fields of 2.7 KB (each within the field limit, within the field count): a head of ~270 KB, over
    ``max_head`` (256 KiB), sent at once. It was served when it ended in the read that crossed the limit."""
    fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 2700) for i in range(100))
    data = b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n"
    assert 256 * 1024 < len(data) < 300 * 1024
    got = responses(exchange(node.port, data))
    assert [s for s, _, _ in got] == [431]
    assert orjson.loads(got[0][2])["error"]["code"] == "headers_too_large"
    assert_healthy(node, engine)


# ---- the connection cap and the open-files limit ----------------------------------------------------------


def _low_nofile() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


@contextlib.contextmanager
def node_with_few_fds(engine: MockEngineProc) -> Iterator[NodeProc]:
    port = free_port_in_range(_TAKEN)
    log_path = log_file("smg-node-nofile-")
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(
            [str(BIN / "smg-node"), "serve", "--host", "127.0.0.1", "--port", str(port), *node_flags(engine)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_low_nofile,
        )
    n = NodeProc(proc, port, log_path)
    try:
        for _ in range(600):  # bounded: ready within a minute
            if proc.poll() is not None:
                raise RuntimeError(f"smg-node exited with {proc.returncode}:\n{n.log()}")
            if http_status(n.url + "/readiness") == 200:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"smg-node not ready:\n{n.log()}")
        yield n
    finally:
        n.stop(signal.SIGTERM)


def test_connection_cap_stays_within_the_open_files_limit(engine: MockEngineProc) -> None:
    """``ulimit -n 256`` and the default cap (10000): 300 idle connections took every descriptor and a
    client was reset with no answer. The cap is now below the limit: the client gets the 503 envelope,
    and once the idle connections go the node serves again."""
    with node_with_few_fds(engine) as n:
        idle: list[socket.socket] = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", n.port), timeout=10)
                idle.append(s)
            r = httpx.post(n.url + "/v1/chat/completions", content=CHAT_BODY, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "too_many_connections"
        finally:
            for s in idle:
                s.close()
        ok = 0
        for _ in range(100):  # bounded: the node notices the closed connections in the background
            with contextlib.suppress(httpx.HTTPError):
                ok = httpx.get(n.url + "/health", timeout=10).status_code
            if ok == 200:
                break
            time.sleep(0.05)
        assert ok == 200
        assert_healthy(n, engine)
        assert "serving at most" in n.log()
