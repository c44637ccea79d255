"""End to end, on real nodes: the relay to OpenAI HTTP workers when the worker misbehaves: no answer
within ``--request-timeout-secs`` (504, not retried), a stream cut in the middle of an event (a clean SSE
error the openai SDK raises as an ``APIError``), answers SMG's HTTP router retries (429, 5xx: another
worker, ``Retry-After`` passed on), and a client gone during a half-open circuit's trial (the trial
freed, so the worker is tried again); ``x-smg-target-worker`` on relayed requests.

The workers are small aiohttp apps in a thread of this process (``Worker``), with handler cancellation
on, so that they see the node's connection close; every node is stopped by pid."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.threaded_app import ThreadedApp

pytestmark = pytest.mark.timeout(120)

MSGS = [{"role": "user", "content": "hi"}]
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "qwen3",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _chunk(text: str) -> bytes:
    c = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "qwen3",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(c) + b"\n\n"


class Worker(ThreadedApp):
    """An OpenAI HTTP worker stand-in on loopback, in a thread with its own event loop; ``mode`` says how
    it answers generation requests, ``hits`` counts them, ``gone`` counts those whose client (the node)
    closed the connection before the answer ended."""

    handler_cancellation = True

    def __init__(self) -> None:
        super().__init__()
        self.mode = "ok"
        self.hits = 0
        self.gone = 0

    async def _handle(self, r: web.Request) -> web.StreamResponse:
        if r.path == "/health":
            return web.Response(status=200)
        if r.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "qwen3", "max_model_len": 4096}]})
        if r.method != "POST":  # the node's reads of /v1/loads
            return web.json_response({"loads": []})
        await r.read()
        self.hits += 1
        try:
            return await self._answer(r, self.mode)
        except asyncio.CancelledError:
            self.gone += 1
            raise

    async def _answer(self, r: web.Request, mode: str) -> web.StreamResponse:
        if mode == "hold":  # an answer that does not come (bounded: the test never waits this long)
            await asyncio.sleep(60)
        if mode in ("429", "500", "503"):
            err = {"error": {"message": "busy", "type": "server_error", "param": None, "code": int(mode)}}
            return web.json_response(err, status=int(mode), headers={"Retry-After": "7"})
        if mode == "cut-mid-event":  # one whole event, half of the next, then the connection reset
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(r)
            second = _chunk("world")
            await resp.write(_chunk("hello") + second[: len(second) // 2])
            assert r.transport is not None
            r.transport.abort()
            return resp
        return web.json_response(COMPLETION)


@pytest.fixture()
def workers() -> Iterator[list[Worker]]:
    ws = [Worker().start(), Worker().start()]
    try:
        yield ws
    finally:
        for w in ws:
            w.stop()


def chat(node: NodeProc, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    body = {"model": "qwen3", "messages": MSGS, **kw}
    return httpx.post(node.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def wait_for(cond: Any, what: str, bound: float = 15.0) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_worker_without_an_answer_in_the_request_timeout_is_a_504_not_retried(
    workers: list[Worker],
) -> None:
    """``--request-timeout-secs`` bounds a relayed request as it bounds an engine call: the client gets
    504 ``engine_timeout`` (not the worker's answer a minute later, nor a retry elsewhere)."""
    a, b = workers
    a.mode = b.mode = "hold"
    flags = ("--model-id", "qwen3", "--tokenizer-workers", "0", "--request-timeout-secs", "1")
    with running_node("--worker-urls", a.url, b.url, *flags) as node:
        r = chat(node)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "engine_timeout"
        assert a.hits + b.hits == 1  # the worker has the request: another one is not asked
        assert a.url not in r.text and b.url not in r.text


def test_a_stream_cut_mid_event_ends_with_a_clean_sse_error(workers: list[Worker]) -> None:
    """The worker's half event is not relayed: the error event follows whole events only, so the
    openai SDK reads the text so far, then raises ``APIError`` (not a ``JSONDecodeError``)."""
    a, _ = workers
    a.mode = "cut-mid-event"
    with running_node("--worker-urls", a.url, "--model-id", "qwen3", "--tokenizer-workers", "0") as node:
        with httpx.stream(
            "POST",
            node.url + "/v1/chat/completions",
            json={"model": "qwen3", "messages": MSGS, "stream": True},
            timeout=30,
        ) as r:
            raw = b"".join(r.iter_raw())
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[0] == _chunk("hello").rstrip(b"\n"), raw
        assert b'"error"' in events[1] and events[2] == b"data: [DONE]", raw
        assert len(events) == 3, raw
        c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
        got: list[str] = []
        stream = c.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="stream failed"):
            got.extend(ch.choices[0].delta.content or "" for ch in stream)
        assert got == ["hello"]


def test_answers_smg_retries_go_to_another_worker(workers: list[Worker]) -> None:
    """A 503 or 500 (or 429) from one worker is tried on another, as SMG's HTTP router does; with no
    other worker left, the last answer is relayed with its ``Retry-After``."""
    a, b = workers
    flags = ("--model-id", "qwen3", "--tokenizer-workers", "0", "--cb-failure-threshold", "100000")
    with running_node("--worker-urls", a.url, b.url, *flags) as node:
        for mode in ("503", "500", "429"):
            a.mode, b.mode = mode, "ok"
            for _ in range(4):  # whichever the policy picks first
                r = chat(node)
                assert r.status_code == 200, (mode, r.text)
            assert a.hits >= 1
        a.mode = b.mode = "429"
        r = chat(node)
        assert r.status_code == 429, r.text
        assert r.headers.get("Retry-After") == "7"


def _send_raw(port: int) -> socket.socket:
    body = orjson.dumps({"model": "qwen3", "messages": MSGS})
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_a_client_gone_during_a_half_open_trial_frees_the_circuit(workers: list[Worker]) -> None:
    """The circuit is open; its first request after the cool-down is the half-open trial. That client
    goes away before the worker answers: the trial is released (nothing was learnt of the worker), so
    the next requests reach the worker again, rather than 503 for good."""
    a, _ = workers
    flags = ("--model-id", "qwen3", "--tokenizer-workers", "0")
    cb = ("--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "0.2")
    with running_node("--worker-urls", a.url, *flags, *cb) as node:
        a.mode = "500"
        assert chat(node).status_code == 500  # its circuit opens
        a.mode = "hold"
        deadline = time.monotonic() + 15
        while True:  # the trial: a request the worker gets (before the cool-down, a 503 from the node)
            assert time.monotonic() < deadline, "the trial never reached the worker"
            hits = a.hits
            s = _send_raw(node.port)
            s.settimeout(0.05)
            answered = False
            while a.hits == hits and not answered:
                with contextlib.suppress(TimeoutError):
                    answered = bool(s.recv(4096))
            if a.hits > hits:
                break
            s.close()
        s.close()  # the client goes away during the trial
        wait_for(lambda: a.gone >= 1, "the node did not close the worker's request")
        a.mode = "ok"
        wait_for(lambda: chat(node).status_code == 200, "the worker was never tried again")


def test_the_target_worker_header_routes_relayed_requests(workers: list[Worker]) -> None:
    """``x-smg-target-worker`` (a worker's id or URL) sends a relayed request to that worker, as it does
    an engine call; one that is not a worker of the model is a 400, sent nowhere."""
    a, b = workers
    with running_node(
        "--worker-urls", a.url, b.url, "--model-id", "qwen3", "--tokenizer-workers", "0"
    ) as node:
        ids = {w["url"]: w["id"] for w in httpx.get(node.url + "/workers", timeout=10).json()["workers"]}
        for target in (ids[b.url], b.url):
            for _ in range(3):
                r = chat(node, headers={"x-smg-target-worker": target})
                assert r.status_code == 200, r.text
        assert (a.hits, b.hits) == (0, 6)
        r = chat(node, headers={"x-smg-target-worker": "nope"})
        assert r.status_code == 400, r.text
        assert (a.hits, b.hits) == (0, 6)
