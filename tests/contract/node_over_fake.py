"""What the TensorRT-LLM and MLX contract tests share: a real ``smg-node`` (``spawn_node``) over a dialect
fake's port, always stopped by pid, and the client side (chat calls, SSE parsing, bounded waits)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.e2e.node_procs import NodeProc, free_port, http_status, spawn_node

MODEL = "qwen3"


@contextmanager
def node_over(*worker_urls: str, extra: tuple[str, ...] = (), ready: bool = True) -> Iterator[NodeProc]:
    """A node serving ``MODEL`` from ``worker_urls`` (the embedded Qwen3 tokenizer), ready when yielded
    (``ready`` False: live, its workers maybe not healthy)."""
    port = free_port()
    node = spawn_node(
        "serve",
        *("--worker-urls", *worker_urls, "--model-id", MODEL),
        *("--health-check-interval-secs", "0.5", "--health-failure-threshold", "2"),
        *("--health-success-threshold", "1", "--cb-failure-threshold", "1000"),
        *extra,
        port=port,
    )
    try:
        deadline = time.monotonic() + 90
        path = "/readiness" if ready else "/liveness"
        while http_status(node.url + path) != 200:  # bounded by the deadline
            if node.proc.poll() is not None:
                raise RuntimeError(f"smg-node exited with {node.proc.returncode}:\n{node.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg-node not ready in 90 s:\n{node.log()}")
            time.sleep(0.1)
        yield node
    finally:
        node.stop(signal.SIGTERM)


def chat(node: NodeProc, text: str = "Hi", **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 64, **body}
    return httpx.post(node.url + "/v1/chat/completions", json=payload, timeout=30)


def chat_stream(node: NodeProc, text: str = "Hi", **body: Any) -> tuple[int, list[dict[str, Any]], bool]:
    """(status, the SSE events' JSON objects, whether ``[DONE]`` ended it)."""
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    events: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", node.url + "/v1/chat/completions", json=payload, timeout=30) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()], False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
    return r.status_code, events, done


def streamed_text(events: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in events for c in e.get("choices", []) if c["index"] == index
    )


def finish_reasons(events: list[dict[str, Any]]) -> dict[int, str]:
    return {
        c["index"]: c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")
    }


def workers(node: NodeProc) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = httpx.get(node.url + "/workers", timeout=5).json()["workers"]
    return got


def wait_for(what: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded
        if what():
            return True
        time.sleep(0.1)
    return what()
