"""End to end: the control (admin) plane is secure by default, attacked on real ``smg-node`` processes.

What each test reproduces, and what the node must now do:

- a node that would serve an unauthenticated control plane on an address other machines reach refuses
  to start (exit 2, a configuration error naming ``--insecure-admin``); with ``--insecure-admin`` it
  starts, says so loudly in its log and in ``/health``;
- a web page in a browser cannot drive a node on localhost: a ``text/plain`` POST to ``/admin/keys``
  (no CORS preflight) is a 415, a foreign ``Origin`` or ``Sec-Fetch-Site: cross-site`` a 403, and a
  ``Host`` that is not the loopback listener's (DNS rebinding) a 403; no key is minted by any of them;
- auth on the data plane alone protects the control plane too (it follows the data plane's mode), and
  ``/metrics`` is a control route;
- with an admin listener, the control routes answer there and are a 404 on the client port (and the
  data routes a 404 on the admin listener);
- ``/v1/models`` shows no filesystem path; ``x-smg-target-worker`` is for admins only; the worker's
  address never reaches a client in an error message (the engines name workers by id; the error
  middleware scrubs addresses out of any engine text too: ``tests/unit/test_api_error_messages.py``).

Every process is stopped by its pid, also when a test fails; every wait is a bounded poll.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shepherd.auth.keys import hash_key
from tests.e2e.node_procs import BIN, NodeProc, free_port, running_node, start_node
from tests.e2e.procs import start_mock_engine

pytestmark = pytest.mark.timeout(180)

ADMIN_KEY = "sk-smg-e2e-admin-plane-" + os.urandom(12).hex()
JSON = {"Content-Type": "application/json"}
EVIL = "http://evil.example"


def node_args(*extra: str) -> list[str]:
    return ["--model-id", "qwen3", "--tokenizer-workers", "0", *extra]


def keys_listed(url: str, headers: dict[str, str] | None = None) -> list[str]:
    r = httpx.get(url + "/admin/keys", headers=headers or {}, timeout=10)
    assert r.status_code == 200, r.text
    return [k["id"] for k in r.json()["data"]]


def envelope_code(r: httpx.Response) -> str | None:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    code: str | None = body["error"]["code"]
    return code


# ---- start-up ------------------------------------------------------------------------------------


def test_refuses_to_start_with_an_open_control_plane_on_a_reachable_address(tmp_path: Path) -> None:
    for extra in ([], ["--admin-host", "0.0.0.0", "--admin-port", str(free_port())]):
        argv = [str(BIN / "smg-node"), "serve", "--host", "0.0.0.0", "--port", str(free_port()), *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        assert proc.returncode == 2, (out, err)
        text = err.decode()
        assert "configuration error" in text and "--insecure-admin" in text and "0.0.0.0" in text, text


def test_insecure_admin_starts_loudly() -> None:
    with running_node(*node_args("--host", "0.0.0.0", "--insecure-admin"), wait_ready=False) as node:
        health = httpx.get(node.url + "/health", timeout=10).json()
        assert health["insecure_admin"] is True
        assert "INSECURE ADMIN" in node.log()
    with running_node(*node_args(), wait_ready=False) as node:  # loopback: nothing to confess
        assert "insecure_admin" not in httpx.get(node.url + "/health", timeout=10).json()


# ---- browsers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def open_node() -> Iterator[NodeProc]:
    """The default posture: auth off, loopback; a UI origin allowed on the control plane."""
    with running_node(
        *node_args("--admin-allowed-origins", "https://ui.example:8443"), wait_ready=False
    ) as node:
        yield node


def test_a_web_page_cannot_mint_an_admin_key(open_node: NodeProc) -> None:
    url, port = open_node.url, open_node.port
    body = b'{"name": "pwned", "role": "admin"}'
    before = keys_listed(url)
    attacks = [
        # the reported attack: a simple (no-preflight) POST from a page, via DNS rebinding
        ({"Content-Type": "text/plain", "Origin": EVIL, "Host": f"evil.example:{port}"}, 403),
        ({"Content-Type": "text/plain"}, 415),  # no Origin at all (old browsers, forms): still no JSON type
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({}, 415),  # no Content-Type
        ({**JSON, "Origin": EVIL}, 403),
        ({**JSON, "Origin": "null"}, 403),  # sandboxed iframes, file:// pages
        ({**JSON, "Sec-Fetch-Site": "cross-site"}, 403),
        ({**JSON, "Sec-Fetch-Site": "same-site"}, 403),  # another port of localhost is the same site
        ({**JSON, "Host": f"evil.example:{port}"}, 403),  # DNS rebinding: the name is not ours
    ]
    with httpx.Client(timeout=10) as http:
        for headers, status in attacks:
            r = http.post(url + "/admin/keys", content=body, headers=headers)
            assert r.status_code == status, (headers, r.status_code, r.text)
            assert "key" not in r.json(), headers
            assert envelope_code(r) in (
                "unsupported_media_type",
                "cross_origin_refused",
                "cross_site_refused",
                "host_not_allowed",
            )
        # GETs and DELETEs too: reading the control plane cross-site is refused
        r = http.get(url + "/workers", headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        r = http.get(url + "/admin/keys", headers={"Host": "rebound.attacker.test"})
        assert r.status_code == 403 and envelope_code(r) == "host_not_allowed"
        r = http.post(url + "/workers", content=b'{"url": "grpc://10.9.9.9:1"}', headers={"Origin": EVIL})
        assert r.status_code in (403, 415)
        assert keys_listed(url) == before, "a refused request minted a key"

        # what is allowed: non-browser clients, the loopback names, and the configured UI origin
        for headers in (
            {**JSON},
            {**JSON, "Host": f"localhost:{port}"},
            {**JSON, "Host": f"127.0.0.1:{port}"},
            {"Content-Type": "application/json; charset=utf-8", "Sec-Fetch-Site": "same-origin"},
            {"Content-Type": "application/merge-patch+json"},
            {**JSON, "Origin": "https://ui.example:8443", "Sec-Fetch-Site": "cross-site"},
            {**JSON, "Sec-Fetch-Site": "none"},  # typed into the address bar
        ):
            r = http.post(url + "/admin/keys", content=b'{"name": "ok"}', headers=headers)
            assert r.status_code == 201, (headers, r.text)


def test_json_routes_need_a_json_content_type(open_node: NodeProc) -> None:
    """The data plane too: a 415 in the OpenAI envelope, as vLLM answers (the SDKs send JSON)."""
    chat = b'{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    with httpx.Client(timeout=10) as http:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = http.post(
                open_node.url + "/v1/chat/completions", content=chat, headers={"Content-Type": ctype}
            )
            assert r.status_code == 415 and envelope_code(r) == "unsupported_media_type", r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = http.post(open_node.url + "/v1/tokenize", content=b'{"prompt": "hi"}')
        assert r.status_code == 415
        r = http.post(
            open_node.url + "/v1/tokenize",
            content=b'{"prompt": "hi"}',
            headers={"Content-Type": "Application/JSON; charset=UTF-8"},
        )
        assert r.status_code == 200 and r.json()["count"] >= 1


# ---- auth on the data plane protects the control plane ------------------------------------------


@pytest.fixture(scope="module")
def keyed_node() -> Iterator[NodeProc]:
    """Only ``--auth-data-plane api_key`` given (the reported configuration)."""
    node = start_node(
        *node_args("--auth-data-plane", "api_key", "--auth-admin-key-sha256", hash_key(ADMIN_KEY)),
        wait_ready=False,
    )
    try:
        yield node
    finally:
        node.stop()


def test_data_plane_auth_alone_protects_the_control_plane(keyed_node: NodeProc) -> None:
    url = keyed_node.url
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(timeout=10) as http:
        r = http.post(url + "/admin/keys", json={"name": "anon", "role": "admin"})
        assert r.status_code == 401 and "key" not in r.json()
        for path in ("/workers", "/admin/keys", "/metrics"):
            assert http.get(url + path).status_code == 401, path
        m = http.get(url + "/metrics", headers=admin)
        assert m.status_code == 200 and "smg_requests_total" in m.text
        r = http.post(url + "/admin/keys", json={"name": "u", "role": "user"}, headers=admin)
        assert r.status_code == 201, r.text
        user = {"Authorization": f"Bearer {r.json()['key']}"}
        assert http.get(url + "/admin/keys", headers=user).status_code == 403

        # /v1/models: the model's name, never the tokenizer's path on this machine
        models = http.get(url + "/v1/models", headers=user).json()["data"]
        assert models and all("/" not in str(v) for m in models for v in m.values()), models
        assert models[0]["root"] == "qwen3"

        # x-smg-target-worker (bypasses health checks and the circuit breaker) is for admins only
        chat = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = http.post(url + "/v1/chat/completions", json=chat, headers={**user, "x-smg-target-worker": "w"})
        assert r.status_code == 403 and envelope_code(r) == "target_worker_forbidden"
        r = http.post(url + "/v1/chat/completions", json=chat, headers={**admin, "x-smg-target-worker": "w"})
        assert r.status_code == 400, r.text  # honoured for an admin: no such worker


# ---- the admin listener ----------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["lean", "aiohttp"])
def test_admin_listener_serves_the_control_plane_and_the_client_port_does_not(server: str) -> None:
    admin_port = free_port()
    args = node_args("--admin-port", str(admin_port), "--http-server", server)
    with running_node(*args, wait_ready=False) as node:
        admin = f"http://127.0.0.1:{admin_port}"
        assert f"admin=http://127.0.0.1:{admin_port}" in node.log()
        with httpx.Client(timeout=10) as http:
            for method, path in (
                ("GET", "/admin/keys"),
                ("POST", "/admin/keys"),
                ("GET", "/workers"),
                ("POST", "/workers"),
                ("DELETE", "/workers/x"),
                ("GET", "/metrics"),
                ("GET", "/mesh/members"),
            ):
                r = http.request(method, node.url + path, json={"name": "x"})
                assert r.status_code == 404, (method, path, r.status_code)
            assert http.get(node.url + "/v1/models").status_code == 200
            assert http.get(admin + "/v1/models").status_code == 404
            r = http.post(admin + "/v1/chat/completions", json={"model": "qwen3", "messages": []})
            assert r.status_code == 404
            for base in (node.url, admin):
                assert http.get(base + "/liveness").status_code == 200
            assert http.get(admin + "/workers").status_code == 200
            assert "smg_requests_total" in http.get(admin + "/metrics").text
            r = http.post(admin + "/admin/keys", json={"name": "from-admin-port"})
            assert r.status_code == 201, r.text
            r = http.post(admin + "/admin/keys", json={"name": "x"}, headers={"Origin": EVIL})
            assert r.status_code == 403  # the browser guard holds on the admin listener too


# ---- worker addresses stay out of client errors ---------------------------------------------------


def test_worker_address_not_in_client_errors() -> None:
    engine = start_mock_engine("--zero-latency")
    node: NodeProc | None = None
    try:
        node = start_node(
            *node_args(
                "--worker-urls",
                f"grpc://127.0.0.1:{engine.grpc_port}",
                "--health-check-interval-secs",
                "600",
                "--retry-max-retries",
                "0",
            )
        )
        chat = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(node.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        engine.stop(signal.SIGKILL)  # the worker is still healthy in the node's view: the call fails
        r = httpx.post(node.url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code in (502, 503, 504), r.text
        assert f":{engine.grpc_port}" not in r.text and "127.0.0.1" not in r.text, r.text
    finally:
        if node is not None:
            node.stop()
        engine.stop()
