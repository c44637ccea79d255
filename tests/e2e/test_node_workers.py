"""End to end: worker behaviour of a node — retry elsewhere, HTTP relay, vLLM detection, worker admin,
timeouts with engine aborts, mid-stream failures, graceful shutdown."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import http_status, running_node, start_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MSGS: list[Any] = [{"role": "user", "content": "Say something."}]


def stats(engine: MockEngineProc) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()
    return out


def wait_aborted(engine: MockEngineProc, prefix: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(
            str(a).partition(".")[2].startswith(prefix) for a in stats(engine)["aborted"]
        ):  # (token first)
            return True
        time.sleep(0.05)
    return False


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED"])
def test_retry_on_other_worker_and_circuit_breaker(code: str) -> None:
    """A server error before the first token (the engine down, failing inside, overloaded) goes to
    another worker: the client never sees it."""
    with (
        start_mock_engine("--zero-latency", "--error-rate", "1.0", "--error-code", code) as bad,
        start_mock_engine("--zero-latency") as good,
        running_node(
            "--worker-urls",
            f"grpc://{bad.grpc_target}",
            f"grpc://{good.grpc_target}",
            "--model-id",
            "qwen3",
            "--cb-failure-threshold",
            "2",
        ) as node,
    ):
        c = sdk(node.url)
        for _ in range(6):
            r = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=3)
            assert r.choices[0].message.content
        workers = httpx.get(node.url + "/workers", timeout=5).json()["workers"]
        by_url = {w["url"]: w for w in workers}
        # a failing worker's circuit opens; an overloaded one is busy, not broken: its circuit stays closed
        want = "closed" if code == "RESOURCE_EXHAUSTED" else "open"
        assert by_url[f"grpc://{bad.grpc_target}"]["circuit"] == want
        assert stats(good)["requests_received"] >= 6
        metrics = httpx.get(node.url + "/metrics", timeout=5).text
        assert "smg_engine_retries_total" in metrics


def test_an_overloaded_fleet_is_a_503_with_retry_after() -> None:
    with (
        start_mock_engine("--zero-latency", "--error-rate", "1.0", "--error-code", "RESOURCE_EXHAUSTED") as e,
        running_node("--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3") as node,
    ):
        body = {"model": "qwen3", "messages": MSGS, "max_tokens": 3}
        r = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "engine_overloaded"


def test_health_says_unhealthy_while_every_circuit_is_open() -> None:
    with (
        start_mock_engine("--zero-latency", "--error-rate", "1.0", "--error-code", "INTERNAL") as e,
        running_node(
            "--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3", "--cb-failure-threshold", "2"
        ) as node,
    ):
        assert http_status(node.url + "/health") == 200  # its checks pass: healthy until calls fail
        body = {"model": "qwen3", "messages": MSGS, "max_tokens": 3}
        for _ in range(2):
            assert httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30).status_code == 502
        # the circuit is open: nothing can be served, whatever the health checks say
        assert http_status(node.url + "/health") == 503
        assert http_status(node.url + "/readiness") == 503
        assert httpx.get(node.url + "/health", timeout=5).json()["workers"] == {"total": 1, "healthy": 0}


def test_an_answer_ending_on_eos_sends_the_engine_no_abort() -> None:
    """The gateway sees EOS in a chunk before the engine's Complete: the engine ends the request
    itself, so no Abort goes out for it (one per answer, before); a stop string the engine never saw
    still aborts it."""
    with (
        start_mock_engine("--decode-ms-per-token", "2", "--output-len", "12") as e,
        running_node("--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3") as node,
    ):
        c = sdk(node.url)
        for _ in range(3):
            stream = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=200, stream=True)
            assert list(stream)[-1].choices[0].finish_reason == "stop"
        got = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=200, stop=["zz-never"])
        assert got.choices[0].finish_reason == "stop"
        assert stats(e)["rpc_calls"].get("sglang.Abort", 0) == 0
        text = httpx.get(node.url + "/metrics", timeout=5).text
        assert 'smg_engine_aborts_total{model="qwen3",reason="stop"}' not in text, text
        # a stop string: the engine would go on, so the gateway aborts it
        cut = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=200, stop=[" "], stream=True)
        assert [ch.choices[0].finish_reason for ch in cut if ch.choices][-1] == "stop"
        deadline = time.monotonic() + 10
        while stats(e)["rpc_calls"].get("sglang.Abort", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats(e)["rpc_calls"].get("sglang.Abort", 0) == 1


def test_vllm_service_detected_and_http_relay() -> None:
    with start_mock_engine("--zero-latency", "--engine", "vllm") as engine:
        with running_node("--worker-urls", f"grpc://{engine.grpc_target}", "--model-id", "qwen3") as node:
            w = httpx.get(node.url + "/workers", timeout=5).json()["workers"][0]
            assert w["kind"] == "vllm"
            r = sdk(node.url).chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
            assert r.usage is not None and r.usage.completion_tokens == 4
        with running_node("--worker-urls", engine.http_url, "--model-id", "qwen3") as relay:
            c = sdk(relay.url)
            r = c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4)
            assert r.choices[0].message.content
            text = "".join(
                ch.choices[0].delta.content or ""
                for ch in c.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=4, stream=True)
                if ch.choices
            )
            assert text


def test_worker_admin_lifecycle() -> None:
    with (
        start_mock_engine("--zero-latency") as engine,
        running_node("--model-id", "qwen3", wait_ready=False) as node,
    ):
        assert http_status(node.url + "/readiness") == 503  # no worker yet
        r = httpx.post(node.url + "/workers", json={"url": f"grpc://{engine.grpc_target}"}, timeout=15)
        assert r.status_code == 202, r.text
        wid = r.json()["id"]
        assert http_status(node.url + "/readiness") == 200
        assert sdk(node.url).chat.completions.create(model="qwen3", messages=MSGS, max_tokens=2).choices
        assert httpx.get(node.url + f"/workers/{wid}", timeout=5).json()["healthy"] is True
        assert httpx.delete(node.url + f"/workers/{wid}", timeout=5).status_code == 202
        assert httpx.get(node.url + "/workers", timeout=5).json()["workers"] == []
        with pytest.raises(openai.APIStatusError) as ei:
            sdk(node.url).chat.completions.create(model="qwen3", messages=MSGS, max_tokens=2)
        assert ei.value.status_code == 503


def test_workers_added_through_the_api_outlive_a_restart(tmp_path: Any) -> None:
    """A worker added through the API, then weighted, is there again after the node restarts on its
    data directory, gracefully or killed; once removed, it stays removed. (They lived in memory only: a
    rolling restart dropped them for good.)"""
    flags = ("--model-id", "qwen3", "--data-dir", str(tmp_path / "data"))
    with start_mock_engine("--zero-latency") as engine, start_mock_engine("--zero-latency") as other:
        url, url2 = f"grpc://{engine.grpc_target}", f"grpc://{other.grpc_target}"
        with running_node(*flags, wait_ready=False) as node:
            wid = httpx.post(node.url + "/workers", json={"url": url}, timeout=15).json()["id"]
            r = httpx.post(node.url + "/add_worker", params={"url": url2}, timeout=15)  # SMG's older route
            assert r.status_code == 202, r.text
            r = httpx.patch(node.url + f"/workers/{wid}", json={"priority": 7}, timeout=5)
            assert r.status_code == 200, r.text
            port = node.port
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with running_node(*flags, port=port) as node:  # (ready: its journaled workers are back)
                got = {w["url"]: w for w in httpx.get(node.url + "/workers", timeout=5).json()["workers"]}
                assert set(got) == {url, url2} and got[url]["priority"] == 7, got
                assert sdk(node.url).chat.completions.create(model="qwen3", messages=MSGS, max_tokens=2)
                if sig == signal.SIGKILL:
                    assert httpx.delete(node.url + f"/workers/{wid}", timeout=5).status_code == 202
                node.stop(sig)
        with running_node(*flags, port=port) as node:
            left = {w["url"] for w in httpx.get(node.url + "/workers", timeout=5).json()["workers"]}
            assert left == {url2}


def test_timeout_before_first_token_aborts_engine() -> None:
    with (
        start_mock_engine("--zero-latency", "--hang-before-first-token") as engine,
        running_node(
            "--worker-urls",
            f"grpc://{engine.grpc_target}",
            "--model-id",
            "qwen3",
            "--request-timeout-secs",
            "1",
        ) as node,
    ):
        rid = f"hang-{time.time_ns()}"
        r = httpx.post(
            node.url + "/v1/chat/completions",
            json={"model": "qwen3", "messages": MSGS, "max_tokens": 4},
            headers={"x-request-id": rid},
            timeout=30,
        )
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "engine_timeout"
        # the engine saw the gateway's Abort for this very request (the hung run is not left to time out)
        assert wait_aborted(engine, rid), stats(engine)["aborted"]
        assert stats(engine)["active"] == 0


def test_mid_stream_failure_is_an_sse_error_event() -> None:
    with (
        start_mock_engine("--zero-latency", "--stall-after-tokens", "3", "--stall-seconds", "30") as engine,
        running_node(
            "--worker-urls",
            f"grpc://{engine.grpc_target}",
            "--model-id",
            "qwen3",
            "--request-timeout-secs",
            "1.5",
        ) as node,
    ):
        body = {"model": "qwen3", "messages": MSGS, "max_tokens": 20, "stream": True}
        lines = []
        with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])
        assert err["error"]["code"] == "engine_timeout"
        assert sum('"content"' in ln for ln in lines) >= 2  # the tokens before the stall arrived
        deadline = time.monotonic() + 10
        while stats(engine)["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats(engine)["active"] == 0  # nothing leaked on the engine


def test_graceful_shutdown_drains_in_flight() -> None:
    with start_mock_engine("--decode-ms-per-token", "20") as engine:
        node = start_node("--worker-urls", f"grpc://{engine.grpc_target}", "--model-id", "qwen3")
        try:
            result: dict[str, Any] = {}

            def long_request() -> None:
                body = {"model": "qwen3", "messages": MSGS, "max_tokens": 60, "ignore_eos": True}
                r = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30)
                result["status"] = r.status_code
                result["body"] = r.json()

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.monotonic() + 10
            while stats(engine)["active"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            node.proc.send_signal(signal.SIGTERM)
            saw_draining = False
            while node.proc.poll() is None and time.monotonic() < deadline + 20:
                if http_status(node.url + "/readiness", timeout=0.5) == 503:
                    saw_draining = True
                time.sleep(0.02)
            t.join(timeout=30)
            assert saw_draining
            assert result["status"] == 200
            assert result["body"]["usage"]["completion_tokens"] == 60
            assert node.proc.wait(timeout=20) == 0
        finally:
            node.stop(signal.SIGKILL)


def test_cache_aware_policy_keeps_a_conversation_on_its_engine() -> None:
    with (
        start_mock_engine("--zero-latency") as e1,
        start_mock_engine("--zero-latency") as e2,
        running_node(
            "--worker-urls",
            f"grpc://{e1.grpc_target}",
            f"grpc://{e2.grpc_target}",
            "--model-id",
            "qwen3",
            "--policy",
            "cache_aware",
        ) as node,
    ):
        c = sdk(node.url)
        long_system = "You are a meticulous assistant who answers in full sentences. " * 20
        msgs: list[Any] = [
            {"role": "system", "content": long_system},
            {"role": "user", "content": "First question?"},
        ]
        for turn in range(4):
            r = c.chat.completions.create(model="qwen3", messages=msgs, max_tokens=4)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"Follow-up {turn}?"},
            ]
        counts = sorted([stats(e1)["requests_received"], stats(e2)["requests_received"]])
        assert counts == [0, 4]
