"""End to end: a security sweep of the node's administrative surface and defaults, on real processes.

What each test reproduces, and what the node must now do:

- the route matrix of a node with API keys: every control route (workers, keys, reload, mesh, metrics,
  SGLang / SMG operations) is a 401 without a credential and a 403 with a user key, the data routes a
  401 without one, the probes public, and none of the engine-control routes of vLLM / SGLang
  (``/abort_request``, ``/start_profile``, ``/update_weights_from_disk``...) is served;
- ``smg-node certs`` (and the mesh's development PKI, which shares the writer) never writes a private
  key through a stale or planted ``<name>.tmp``: before, a world-readable ``ca-key.pem.tmp`` left its
  mode on the CA's key, and a ``<name>-key.pem.tmp`` symlink made the node's key land wherever it
  pointed;
- SGLang's ``/generate`` refuses a ``rid`` that is no request id (a newline, a NUL, a bidi override: it
  reaches the engine, its logs and its abort calls) with a 400 naming ``rid``; before, it was passed on;
- ``/health_generate`` (a probe outside admission: no rate limit applies) runs once at a time: callers
  arriving while it runs share its answer; before, each caller cost the engines one generation, so any
  data-plane caller could pin as many engine slots as it opened connections.

Ports are taken in 46000-46999; every process is stopped by its pid, also when a test fails; every wait
is a bounded poll and nothing is timed.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.node_procs import BIN, NodeProc, env, reserved_port, start_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

pytestmark = pytest.mark.timeout(180)

ADMIN_KEY = "sk-smg-e2e-sweep-admin-" + os.urandom(12).hex()
JSON = {"Content-Type": "application/json"}
_rng = random.Random()


def sweep_port() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


@dataclass
class Setup:
    engine: MockEngineProc
    node: NodeProc
    user_key: str

    @property
    def url(self) -> str:
        return self.node.url

    def engine_stats(self) -> dict[str, Any]:
        r = httpx.get(self.engine.http_url + "/mock/stats", timeout=10)
        assert r.status_code == 200, r.text
        stats: dict[str, Any] = r.json()
        return stats

    def generates(self) -> int:
        return int(self.engine_stats()["rpc_calls"].get("sglang.Generate", 0))

    def faults(self, **values: Any) -> None:
        r = httpx.post(self.engine.http_url + "/mock/faults", json=values, timeout=10)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    """A mock engine and a node with API keys on both planes (a bootstrap admin key, a minted user key)."""
    engine = start_mock_engine(
        "--grpc-port", str(sweep_port()), "--http-port", str(sweep_port()), "--model", "qwen3"
    )
    node: NodeProc | None = None
    try:
        with env({"SWEEP_ADMIN_KEY": ADMIN_KEY}):
            node = start_node(
                "--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3",
                "--tokenizer-workers", "0", "--auth-mode", "api_key",
                "--auth-admin-key-env", "SWEEP_ADMIN_KEY",
                port=sweep_port(),
            )  # fmt: skip
        r = httpx.post(
            node.url + "/admin/keys",
            json={"name": "sweep-user", "role": "user"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        assert r.status_code == 201, r.text
        yield Setup(engine, node, r.json()["key"])
    finally:
        if node is not None:
            node.stop()
        engine.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **JSON}


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err: dict[str, Any] = body["error"]
    return err


# ---- the route matrix --------------------------------------------------------------------------------

CONTROL = [
    ("GET", "/metrics"),
    ("GET", "/workers"),
    ("POST", "/workers"),
    ("GET", "/workers/any"),
    ("PUT", "/workers/any"),
    ("PATCH", "/workers/any"),
    ("DELETE", "/workers/any"),
    ("DELETE", "/workers?url=grpc://127.0.0.1:1"),
    ("GET", "/admin/keys"),
    ("POST", "/admin/keys"),
    ("GET", "/admin/keys/any"),
    ("DELETE", "/admin/keys/any"),
    ("POST", "/admin/reload"),
    ("GET", "/mesh/members"),
    ("GET", "/mesh/state"),
    ("POST", "/flush_cache"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/get_loads"),
    ("POST", "/add_worker?url=http://169.254.169.254:80"),
    ("GET", "/list_workers"),
    ("POST", "/remove_worker?url=grpc://127.0.0.1:1"),
]
DATA = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/generate"),
    ("GET", "/get_server_info"),
    ("GET", "/server_info"),
    ("GET", "/get_model_info"),
    ("GET", "/health_generate"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("GET", "/v1/responses/resp_0"),
    ("GET", "/v1/conversations/conv_0"),
]
# engine-control routes of vLLM / SGLang a gateway does not serve (nothing to abort, profile or reload)
NOT_SERVED = [
    ("POST", "/abort_request"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/collective_rpc"),
    ("POST", "/sleep"),
    ("GET", "/debug/pprof"),
    ("POST", "/v1/load_lora_adapter"),
]


def test_every_control_route_needs_an_admin_credential(setup: Setup) -> None:
    before = httpx.get(setup.url + "/workers", headers=bearer(ADMIN_KEY), timeout=10).json()["total"]
    with httpx.Client(timeout=30) as http:
        for method, path in CONTROL:
            r = http.request(method, setup.url + path, headers=JSON, content=b"{}")
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert error_of(r)["code"] == "missing_credentials"
            r = http.request(method, setup.url + path, headers=bearer(setup.user_key), content=b"{}")
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            assert error_of(r)["code"] == "insufficient_role"
            r = http.request(method, setup.url + path, headers=bearer("sk-smg-" + "x" * 43), content=b"{}")
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", (method, path)
        for method, path in DATA:
            r = http.request(method, setup.url + path, headers=JSON, content=b"{}")
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            r = http.request(method, setup.url + path, headers=bearer(setup.user_key), content=b"{}")
            assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)
        for method, path in NOT_SERVED:
            r = http.request(method, setup.url + path, headers=bearer(ADMIN_KEY), content=b"{}")
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        for path in ("/health", "/liveness", "/readiness", "/ping"):  # the probes: public
            assert http.get(setup.url + path).status_code == 200, path
        # no worker was added by any refused call (the SSRF attempt at the metadata address included)
        after = http.get(setup.url + "/workers", headers=bearer(ADMIN_KEY)).json()["total"]
        assert after == before
        # no CORS: a browser page on another origin reads nothing
        r = http.options(
            setup.url + "/v1/models",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in r.headers


# ---- development PKI files ---------------------------------------------------------------------------


def test_certs_never_write_a_key_through_a_planted_tmp_file(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    out.mkdir()
    # a stale world-readable temporary file where the CA's key is written first...
    stale = out / "ca-key.pem.tmp"
    stale.write_bytes(b"stale")
    stale.chmod(0o644)
    # ... and a symlink where the node's key is: the key must not land at its target
    leak = tmp_path / "leak"
    (out / "node-a-key.pem.tmp").symlink_to(leak)
    proc = subprocess.run(
        [str(BIN / "smg-node"), "certs", "--out", str(out), "--nodes", "node-a"],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    for name in ("ca-key.pem", "node-a-key.pem"):
        key = out / name
        assert not key.is_symlink(), name
        mode = stat.S_IMODE(key.stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
        assert b"PRIVATE KEY" in key.read_bytes(), name
    assert not leak.exists() or b"PRIVATE KEY" not in leak.read_bytes(), "the key was written through a link"
    assert not list(out.glob("*.tmp")), list(out.glob("*.tmp"))


# ---- /generate's rid -------------------------------------------------------------------------------------


def test_generate_refuses_a_rid_that_is_no_request_id(setup: Setup) -> None:
    body: dict[str, Any] = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    with httpx.Client(timeout=30) as http:
        for rid in ("a\nInjected log line", "nul\x00byte", "bidi\u202eevil", "", "r" * 129, 7, ["a"]):
            r = http.post(setup.url + "/generate", json={**body, "rid": rid}, headers=bearer(setup.user_key))
            assert r.status_code == 400, (rid, r.status_code, r.text)
            assert error_of(r)["param"] == "rid", r.text
        last = setup.engine_stats()["last_request_id"] or ""
        assert all(c.isprintable() for c in last), repr(last)
        # a request id a client means: kept, in the engine's request id after the call's own token
        r = http.post(
            setup.url + "/generate", json={**body, "rid": "my-rid-1"}, headers=bearer(setup.user_key)
        )
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["id"] == "my-rid-1"
        assert setup.engine_stats()["last_request_id"].partition(".")[2] == "my-rid-1"
        r = http.post(setup.url + "/generate", json=body, headers=bearer(setup.user_key))  # none: a fresh one
        assert r.status_code == 200 and r.json()["meta_info"]["id"].startswith("gen-"), r.text


# ---- /health_generate ----------------------------------------------------------------------------------


def test_health_generate_probes_once_for_concurrent_callers(setup: Setup) -> None:
    callers = 12
    setup.faults(slow_factor=100_000)  # the probe's prefill now takes a while: the callers overlap it
    try:
        before = setup.generates()

        def call(_: int) -> int:
            with httpx.Client(timeout=60) as c:
                return c.get(setup.url + "/health_generate", headers=bearer(setup.user_key)).status_code

        with ThreadPoolExecutor(callers) as pool:
            statuses = list(pool.map(call, range(callers)))
        assert statuses == [200] * callers, statuses
        ran = setup.generates() - before
        # every caller answered healthy; the engine saw a handful of probes at most, not one per caller
        assert 1 <= ran <= 3, ran
    finally:
        setup.faults(slow_factor=1.0)
    r = httpx.get(setup.url + "/health_generate", headers=bearer(setup.user_key), timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "healthy", r.text
    assert r.json()["request_id"] == r.headers["x-request-id"]


def _head_then_some_body(url: str, headers: str, declared: int, sent: int) -> bytes:
    """A POST whose head declares ``declared`` body bytes of which ``sent`` are sent; what the node answers
    before the rest (b"" if nothing within 15 s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as s:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{headers}Content-Length: {declared}\r\n\r\n"
        )
        s.sendall(head.encode() + b" " * sent)
        try:
            return s.recv(4096)
        except TimeoutError:
            return b""


def test_an_unauthenticated_callers_body_is_not_buffered(setup: Setup) -> None:
    """A caller the node refuses (no credential, an unknown key) is answered 401 at its head: the node does
    not wait for (and hold) a body up to --max-payload-size first. A valid key's body is read as before."""
    for headers in ("", "Authorization: Bearer sk-not-a-key\r\n", "x-api-key: nope\r\n"):
        got = _head_then_some_body(setup.url, headers, 8 << 20, 64 << 10)
        assert got.startswith(b"HTTP/1.1 401"), (headers, got[:200])
        assert b"WWW-Authenticate" in got or b"www-authenticate" in got
    body = b'{"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = httpx.post(
        setup.url + "/v1/chat/completions",
        content=body,
        headers={**JSON, **bearer(setup.user_key)},
        timeout=30,
    )
    assert r.status_code == 200, r.text
