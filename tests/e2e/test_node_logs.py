"""End to end: a real node with ``--log-format json --access-log`` (and debug level): every line is one
JSON object, the lines of a request carry its request id and trace id, and no credential a client or the
configuration handed the node ever reaches the log (API keys in Authorization / x-api-key headers and in
a query string, a key the admin API minted, the bootstrap admin key from its environment variable).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import qwen3_flags
from tests.e2e.node_procs import start_node
from tests.e2e.procs import start_mock_engine

pytestmark = pytest.mark.timeout(180)

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

ADMIN_KEY = "sk-smg-e2e-logs-admin-" + os.urandom(8).hex()


def test_json_logs_carry_ids_and_never_secrets(tokenizer_dir: Path, http: httpx.Client) -> None:
    trace_id = os.urandom(16).hex()
    wrong = "sk-smg-not-a-real-key-" + os.urandom(6).hex()
    in_query = "q-secret-" + os.urandom(6).hex()
    os.environ["SMG_E2E_LOGS_ADMIN_KEY"] = ADMIN_KEY
    try:
        with start_mock_engine("--zero-latency", "--output-len", "4", "--tokenizer", str(tokenizer_dir)) as e:
            node = start_node(
                *qwen3_flags(e, tokenizer_dir),
                *("--tokenizer-workers", "0", "--log-level", "debug", "--log-format", "json", "--access-log"),
                *("--auth-mode", "api_key", "--auth-admin-key-env", "SMG_E2E_LOGS_ADMIN_KEY"),
            )
            try:
                admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
                made = http.post(
                    node.url + "/admin/keys", json={"name": "logs", "tenant": "t"}, headers=admin
                )
                assert made.status_code == 201, made.text
                user_key = made.json()["key"]
                body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                headers = {
                    "x-api-key": user_key,
                    "x-request-id": "req-logs-1",
                    "traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01",
                }
                r = http.post(node.url + "/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                bad = http.get(node.url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"})
                assert bad.status_code == 401
                q = http.get(node.url + f"/v1/models?api_key={in_query}", headers=admin)
                assert q.status_code == 200
            finally:
                node.stop()
            log = node.log()
    finally:
        os.environ.pop("SMG_E2E_LOGS_ADMIN_KEY", None)
    for secret in (ADMIN_KEY, user_key, wrong, in_query):
        assert secret not in log
    lines = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
    others = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("{")]
    assert all(ln.startswith("smg-node listening") for ln in others), others  # the ready line only
    mine = [d for d in lines if d.get("request_id") == "req-logs-1"]
    assert mine, "no line of the request"
    assert all(d.get("trace_id") == trace_id for d in mine)
    access = [d for d in mine if d["logger"] == "shepherd.access"]
    assert len(access) == 1
    assert access[0]["method"] == "POST" and access[0]["path"] == "/v1/chat/completions"
    assert access[0]["status"] == 200 and access[0]["duration_ms"] > 0
    queried = [d for d in lines if d["logger"] == "shepherd.access" and d["path"].startswith("/v1/models?")]
    assert queried and "***" in queried[0]["path"]
