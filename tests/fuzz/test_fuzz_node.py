"""Fuzz targets through a real node (``smg-node`` on loopback, the lean HTTP server, a mock engine):

- request bodies for ``/v1/chat/completions``, ``/v1/completions`` (and ``/v1/responses`` once the node
  serves it) built by json_strategies.py: the status is never 500 (nor any 5xx but the engine's own
  503/504), a 4xx carries the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``, a 200
  is a completion, a stream ends with ``[DONE]`` and any error event in it is an envelope that is not an
  internal error;
- raw request streams (http_strategies.py) against the node's own routes and middlewares (auth headers,
  ``X-Request-Id`` echoed, content encodings, the body limit): well-formed answers, no 500, no hang.

After each target: the node process is alive, answers a real generation, has no request in flight, the
engine has no request left active, and the node's log holds no traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import qwen3_flags
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.fuzz import json_strategies as js
from tests.fuzz.http_strategies import request_stream
from tests.fuzz.httpwire import ENVELOPE_KEYS, converse, reference_parse
from tests.fuzz.profiles import Budget, fuzz_settings, run_bounded

LIMIT = 256 * 1024  # --max-payload-size
JSON = {"content-type": "application/json"}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
NODE_PATHS = [
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/models",
    b"/liveness",
    b"/readiness",
    b"/health",
    b"/v1/tokenize",
    b"/workers",
    b"/workers/w1",
    b"/metrics",
    b"/",
    b"/v1/nothing",
]

# the shared module-scoped fixtures (tests/e2e/node_fixtures.py), by their names
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        *(
            "--zero-latency",
            "--output-len",
            "4",
            "--context-length",
            "1024",
            "--tokenizer",
            str(tokenizer_dir),
        )
    ) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    with running_node(
        *qwen3_flags(engine, tokenizer_dir),
        *("--tokenizer-workers", "0", "--max-payload-size", str(LIMIT), "--request-timeout-secs", "20"),
    ) as n:
        yield n


# ---- invariants ----------------------------------------------------------------------------------


def assert_envelope(status: int, body: bytes, what: str) -> dict[str, Any]:
    d = orjson.loads(body)
    assert isinstance(d, dict) and set(d) == {"error"}, f"{what}: {status} {body[:300]!r}"
    err = d["error"]
    assert isinstance(err, dict) and set(err) == ENVELOPE_KEYS, f"{what}: {err}"
    assert isinstance(err["message"], str) and err["message"], f"{what}: {err}"
    assert isinstance(err["type"], str) and err["type"], f"{what}: {err}"
    return err


def check_answer(r: httpx.Response, what: str) -> None:
    assert r.status_code != 500, f"{what}: 500 for client input: {r.text[:800]}"
    assert 200 <= r.status_code < 600, f"{what}: status {r.status_code}"
    assert r.status_code < 500 or r.status_code in (502, 503, 504), f"{what}: {r.status_code} {r.text[:500]}"
    ctype = r.headers.get("content-type", "")
    if r.status_code >= 400:
        assert ctype.startswith("application/json"), f"{what}: {r.status_code} {ctype} {r.text[:300]}"
        err = assert_envelope(r.status_code, r.content, what)
        assert err["type"] != "internal_error", f"{what}: {err}"
        return
    if ctype.startswith("text/event-stream") and "/v1/responses" in what:
        # the Responses API's stream: typed events, no [DONE]; it ends with a terminal event
        events = [orjson.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert events, f"{what}: an empty stream"
        last = events[-1]
        assert last.get("type") in TERMINAL, f"{what}: the stream ends with {str(last)[:300]}"
        for ev in events:
            if ev.get("type") in ("error", "response.failed"):
                err = ev.get("error") or (ev.get("response") or {}).get("error") or ev
                assert err.get("code") not in ("internal", "internal_error"), f"{what}: {ev}"
        return
    if ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: stream ends {events[-3:]}"
        for ev in events[:-1]:
            d = orjson.loads(ev)
            if isinstance(d, dict) and "error" in d:
                err = assert_envelope(200, ev.encode(), what)
                assert err["type"] != "internal_error" and err.get("code") != "internal", f"{what}: {err}"
        return
    d = r.json()
    assert isinstance(d, dict) and d.get("object") in ("chat.completion", "text_completion", "response"), (
        f"{what}: {r.text[:300]}"
    )


def settle(engine: MockEngineProc, http: httpx.Client) -> int:
    active = -1
    for _ in range(100):  # bounded: aborts travel in the background
        active = int(http.get(f"{engine.http_url}/mock/stats").json()["active"])
        if active == 0:
            break
        time.sleep(0.05)
    return active


def in_flight(node: NodeProc, http: httpx.Client) -> int:
    n = -1
    for _ in range(100):  # bounded: closed connections are noticed asynchronously
        n = int(http.get(node.url + "/health").json()["in_flight"])  # /health does not count itself
        if n == 0:
            break
        time.sleep(0.05)
    return n


def assert_intact(node: NodeProc, engine: MockEngineProc, http: httpx.Client, since: int) -> None:
    """After a target: alive, serving, nothing in flight or left active, no traceback logged since
    ``since`` (the log's length when the target started)."""
    assert node.proc.poll() is None, f"the node exited:\n{node.log()[-3000:]}"
    r = http.post(node.url + "/v1/completions", json={"model": "qwen3", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert in_flight(node, http) == 0, "requests left in flight"
    assert settle(engine, http) == 0, "engine requests left active"
    log = node.log()[since:]
    assert "Traceback" not in log, f"the node logged a traceback:\n{log[-4000:]}"


def run_target(
    check: Callable[[], None], budget: Budget, node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Run one ``@given`` target within its budget, then ``assert_intact`` (a traceback logged while it
    ran fails it)."""
    since = len(node.log())
    run_bounded(check, budget)
    assert_intact(node, engine, http, since)


def post_all(node: NodeProc, http: httpx.Client, path: str, value: Any) -> None:
    raw = js.as_json(value)
    r = http.post(node.url + path, content=raw, headers=JSON)
    check_answer(r, f"POST {path} {raw[:300]!r}")


# ---- targets -------------------------------------------------------------------------------------


def test_fuzz_node_chat(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, fuzz_budget: Budget
) -> None:
    @fuzz_settings(ci_examples=100)
    @given(js.body(js.CHAT, js.CHAT_CORE))
    @example({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    @example({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True})
    @example({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**70})
    @example(
        {
            "model": "qwen3",
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"a": [[[[1]]]]},
        }
    )
    def check(value: Any) -> None:
        post_all(node, http, "/v1/chat/completions", value)

    run_target(check, fuzz_budget, node, engine, http)


def test_fuzz_node_completions(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, fuzz_budget: Budget
) -> None:
    @fuzz_settings(ci_examples=100)
    @given(js.body(js.COMPLETION, js.COMPLETION_CORE))
    @example({"model": "qwen3", "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 3})
    @example({"model": "qwen3", "prompt": [[1, 2], [3]], "n": 2, "stream": True})
    @example({"model": "qwen3", "prompt": [2**31, 5]})
    def check(value: Any) -> None:
        post_all(node, http, "/v1/completions", value)

    run_target(check, fuzz_budget, node, engine, http)


def test_fuzz_node_responses(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, fuzz_budget: Budget
) -> None:
    probe = http.post(node.url + "/v1/responses", json={"model": "qwen3", "input": "hi"})
    if probe.status_code in (404, 405):
        pytest.skip("the node does not serve /v1/responses")

    @fuzz_settings(ci_examples=80)
    @given(js.body(js.RESPONSES, js.RESPONSES_CORE))
    @example({"model": "qwen3", "input": "hi", "max_output_tokens": 2})
    def check(value: Any) -> None:
        post_all(node, http, "/v1/responses", value)

    run_target(check, fuzz_budget, node, engine, http)


def test_fuzz_node_raw_http(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, fuzz_budget: Budget
) -> None:
    @fuzz_settings(ci_examples=80)
    @given(request_stream(NODE_PATHS, "smuggled"))
    @example(b"GET /v1/nothing%ff HTTP/1.1\r\nHost: t\r\n\r\n")
    @example(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Request-Id: \xff\xfe\r\n\r\n")
    def check(data: bytes) -> None:
        out = converse(node.port, data, wait_close=False)  # the node lingers 5 s on a refused body
        ref = reference_parse(data)
        for i, r in enumerate(out.responses):
            what = f"answer {i} to {data[:400]!r}"
            assert r.status != 500, f"{what}: 500: {r.body[:500]!r}"
            assert 200 <= r.status <= 599, f"{what}: {r.status}"
            is_head = i < len(ref.heads) and ref.heads[i].method == "HEAD"
            if r.status >= 400 and r.body and not is_head:
                r.error()
        assert node.proc.poll() is None, f"the node exited:\n{node.log()[-3000:]}"

    run_target(check, fuzz_budget, node, engine, http)
