"""End to end: a node reloads its configuration file without a restart (``shepherd.node.api.reload``).

A real node (``spawn_node``) on two mock engines: the file's workers, rate limit and API keys change,
then SIGHUP (and ``POST /admin/reload``) applies them while the node serves; a broken file is refused
(a log line, a 422 saying why) and the node keeps serving with the configuration it had. SIGHUP also
still reloads the client port's TLS certificate (same handler)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509

from shepherd.auth.certs import generate_ca, generate_node_cert
from shepherd.auth.keys import hash_key
from shepherd.node.config import EMBEDDED_MODEL_DIR
from tests.e2e.node_procs import NodeProc, free_port, http_status, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

pytestmark = pytest.mark.timeout(180)

ADMIN = "sk-smg-reload-admin-" + os.urandom(8).hex()
USER1 = "sk-smg-reload-user1-" + os.urandom(8).hex()
USER2 = "sk-smg-reload-user2-" + os.urandom(8).hex()
MSGS: list[Any] = [{"role": "user", "content": "Say something."}]


def config(
    engines: list[MockEngineProc], rpm: int, users: dict[str, str], policy: str = "round_robin"
) -> str:
    urls = ", ".join(f'"grpc://127.0.0.1:{e.grpc_port}"' for e in engines)
    keys = "".join(
        f"\n    - {{name: {name}, role: user, sha256: {hash_key(key)}}}" for name, key in users.items()
    )
    return f"""
models:
  - {{name: qwen3, model_path: "{EMBEDDED_MODEL_DIR}", worker_urls: [{urls}], policy: {policy}}}
rate_limits:
  - {{tenant: "*", rpm: {rpm}}}
auth:
  mode: api_key
  admin_key_sha256: [{hash_key(ADMIN)}]
  keys:{keys}
"""


def wait_for(cond: Callable[[], bool], what: str, node: NodeProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if node.proc.poll() is not None:
            pytest.fail(f"the node exited ({node.proc.returncode}) waiting for {what}:\n{node.log()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout} s\n{node.log()[-3000:]}")


@pytest.fixture(scope="module")
def engines() -> Iterator[list[MockEngineProc]]:
    with (
        start_mock_engine("--output-len", "4") as a,
        start_mock_engine("--output-len", "4") as b,
        start_mock_engine("--output-len", "4") as c,
    ):
        yield [a, b, c]


def url(e: MockEngineProc) -> str:
    return f"grpc://127.0.0.1:{e.grpc_port}"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(http: httpx.Client, key: str) -> httpx.Response:
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 4}
    return http.post("/v1/chat/completions", json=body, headers=bearer(key))


def worker_urls(http: httpx.Client) -> set[str]:
    r = http.get("/workers", headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    return {str(w["url"]) for w in r.json()["workers"]}


def limit_of(http: httpx.Client, key: str) -> str | None:
    r = chat(http, key)
    assert r.status_code == 200, r.text
    got: str | None = r.headers.get("x-ratelimit-limit-requests")
    return got


def test_sighup_and_admin_reload_apply_workers_limits_and_keys(
    engines: list[MockEngineProc], tmp_path: Path
) -> None:
    e1, e2, e3 = engines
    path = tmp_path / "node.yaml"
    path.write_text(config([e1], 1000, {"user1": USER1}))
    port = free_port()
    node = spawn_node("serve", "--config", str(path), port=port)
    try:
        wait_for(lambda: http_status(node.url + "/readiness") == 200, "readiness", node, timeout=120.0)
        with httpx.Client(base_url=node.url, timeout=30) as http:
            assert worker_urls(http) == {url(e1)}
            assert limit_of(http, USER1) == "1000"
            assert chat(http, USER2).status_code == 401

            # 1. workers, rate limit and keys change in the file; SIGHUP
            path.write_text(config([e1, e2], 500, {"user2": USER2}))
            node.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: worker_urls(http) == {url(e1), url(e2)}, "the added worker", node)
            wait_for(lambda: chat(http, USER1).status_code == 401, "user1's key refused", node)
            assert limit_of(http, USER2) == "500"
            assert "config reloaded (SIGHUP)" in node.log()

            # 2. the admin route: the same file again changes nothing; then a worker swapped
            r = http.post("/admin/reload", headers=bearer(ADMIN))
            assert r.status_code == 200, r.text
            assert r.json()["reloaded"] is True and r.json()["changed"] == {}
            path.write_text(config([e2, e3], 500, {"user2": USER2}, policy="cache_aware"))
            r = http.post("/admin/reload", headers=bearer(ADMIN))
            assert r.status_code == 200, r.text
            changed = r.json()["changed"]
            assert [w["url"] for w in changed["workers"]["added"]] == [url(e3)]
            assert [w["url"] for w in changed["workers"]["removed"]] == [url(e1)]
            assert changed["policies"] == {"qwen3": "cache_aware"}
            assert r.json()["restart_required"] == []
            assert worker_urls(http) == {url(e2), url(e3)}
            assert limit_of(http, USER2) == "500"  # served by the new policy
            assert http.post("/admin/reload", headers=bearer(USER2)).status_code in (401, 403)

            # 3. a broken file (a negative rpm; then not YAML): refused, the old config kept
            path.write_text(config([e1], -5, {"user1": USER1}, policy="cache_aware"))
            r = http.post("/admin/reload", headers=bearer(ADMIN))
            assert r.status_code == 422, r.text
            assert r.json()["reloaded"] is False and "rpm" in r.json()["error"]["message"]
            path.write_text("models: [unclosed\n")
            node.proc.send_signal(signal.SIGHUP)
            wait_for(
                lambda: node.log().count("refused, the running configuration is kept") >= 2, "refusal", node
            )
            assert chat(http, USER1).status_code == 401  # still the reloaded keys, not the broken file's
            assert limit_of(http, USER2) == "500"
            assert worker_urls(http) == {url(e2), url(e3)}
            assert node.proc.poll() is None
    finally:
        node.stop()
    assert "Traceback" not in node.log()


def test_a_setting_a_reload_does_not_apply_is_said_at_every_reload(
    engines: list[MockEngineProc], tmp_path: Path
) -> None:
    """``request_timeout_secs`` (what every worker's calls are bounded by, gRPC and HTTP alike, from the
    start) is not reloaded: each reload says it needs a restart, not the first alone."""
    path = tmp_path / "node.yaml"
    head = f'model_path: "{EMBEDDED_MODEL_DIR}"\nworker_urls: ["{url(engines[0])}"]\ntokenizer_workers: 0\n'
    path.write_text(head + "request_timeout_secs: 600\n")
    node = spawn_node("serve", "--config", str(path), port=free_port())
    try:
        wait_for(lambda: http_status(node.url + "/readiness") == 200, "readiness", node, timeout=120.0)
        path.write_text(head + "request_timeout_secs: 5\n")
        with httpx.Client(base_url=node.url, timeout=30) as http:
            for _ in range(2):
                r = http.post("/admin/reload")
                assert r.status_code == 200, r.text
                assert r.json()["restart_required"] == ["request_timeout_secs"], r.text
            assert http.get("/get_server_info").json()["request_timeout_secs"] == 600
    finally:
        node.stop()


def served_serial(port: int) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_sighup_still_reloads_the_tls_certificate(engines: list[MockEngineProc], tmp_path: Path) -> None:
    ca = generate_ca()

    def issue() -> int:
        pair = generate_node_cert(ca, "localhost")
        for name, data in (("cert.pem", pair.cert_pem), ("key.pem", pair.key_pem)):
            (tmp_path / f"{name}.tmp").write_bytes(data)
            os.replace(tmp_path / f"{name}.tmp", tmp_path / name)
        return x509.load_pem_x509_certificate(pair.cert_pem).serial_number

    first = issue()
    path = tmp_path / "node.yaml"
    path.write_text(
        f'model_path: "{EMBEDDED_MODEL_DIR}"\nworker_urls: ["grpc://127.0.0.1:{engines[0].grpc_port}"]\n'
        f'tls_cert_file: "{tmp_path / "cert.pem"}"\ntls_key_file: "{tmp_path / "key.pem"}"\n'
        "tls_reload_interval_secs: 0\n"  # no polling: only SIGHUP reloads
    )
    port = free_port()
    node = spawn_node("serve", "--config", str(path), port=port)
    try:
        wait_for(lambda: _serves_tls(port), "TLS listener", node, timeout=120.0)
        assert served_serial(port) == first
        second = issue()
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: served_serial(port) == second, "the renewed certificate", node)
        assert "config reloaded (SIGHUP)" in node.log()  # the config file too, in the same handler
    finally:
        node.stop()


def _serves_tls(port: int) -> bool:
    try:
        served_serial(port)
        return True
    except (OSError, ssl.SSLError):
        return False
