"""One request must neither freeze a node's event loop nor pin its memory (real node and mock engine,
on loopback, stopped by pid).

- A JSON schema is bounded before anything looks at it (400 naming the parameter), an unknown model
  is a 404 before its schemas are validated, and a heavy schema within the bounds is meta-validated
  off the event loop: ``/liveness`` keeps answering while it is.
- Requests with distinct big stop strings, logit_bias maps, template kwargs and routing keys leave
  the node's memory (VmRSS) where it was: they are refused at parse (or hashed: routing keys) and
  nothing keyed by their content is kept.

No timed assertion: the checks are statuses, counts of liveness answers seen while a request was in
flight, and a generous RSS bound; the client timeout (30 s) only keeps a regression from hanging.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import qwen3_flags
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MSGS: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]

# the shared module-scoped fixtures (tests/e2e/node_fixtures.py), by their names
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        *("--decode-ms-per-token", "1", "--output-len", "4", "--context-length", "4096"),
        *("--tokenizer", str(tokenizer_dir)),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """A node with the default settings (16 MiB bodies, the tokenizer pool on), one model."""
    with running_node(*qwen3_flags(engine, tokenizer_dir), "--policy", "manual") as n:
        yield n


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def grid_schema(n: int, salt: str = "") -> dict[str, Any]:
    """n x n properties: ~2n^2 JSON values (n=90: ~16k, ~200 kB; n=700: ~1M, ~6 MB)."""
    inner = {f"q{j}": {"type": "string"} for j in range(n)}
    return {
        "type": "object",
        "description": salt,
        "properties": {f"p{i}": {"type": "object", "properties": inner} for i in range(n)},
    }


def chat_rf(model: str, schema: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": MSGS,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, f"{r.status_code}: {r.text[:400]}"
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


class LivenessPoller:
    """Polls /liveness from a thread; ``answered_between(a, b)`` counts answers completed in (a, b)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                r = c.get(self.url + "/liveness")
                if r.status_code == 200:
                    self.done.append(time.monotonic())
                self._stop.wait(0.005)

    def __enter__(self) -> LivenessPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(35)

    def answered_between(self, a: float, b: float) -> int:
        return sum(1 for t in list(self.done) if a < t < b)


def test_a_huge_schema_is_refused_by_its_size_before_validation(node: NodeProc, http: httpx.Client) -> None:
    """~2M JSON values (~9 MB): minutes of meta-validation on the event loop before the bounds; now a
    400 naming the parameter, for a model that exists and for one that does not, within the client
    timeout."""
    body = chat_rf("qwen3", grid_schema(700))
    err = assert_error(http.post(node.url + "/v1/chat/completions", json=body), 400)
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "schema_too_large"
    body["model"] = "no-such-model"
    assert_error(http.post(node.url + "/v1/chat/completions", json=body), 400)
    tools = [{"type": "function", "function": {"name": "f", "parameters": grid_schema(700)}}]
    r = http.post(
        node.url + "/v1/chat/completions", json={"model": "qwen3", "messages": MSGS, "tools": tools}
    )
    assert assert_error(r, 400)["param"] in ("tools", "tools.0.function.parameters")


def test_an_unknown_model_is_a_404_before_its_schema_is_validated(node: NodeProc, http: httpx.Client) -> None:
    """A schema within the bounds that is not a schema at all: the unknown model is what is reported
    (the meta-validation that would find the problem does not run)."""
    bad = grid_schema(60)
    bad["properties"]["p0"]["type"] = "no-such-type"
    assert_error(http.post(node.url + "/v1/chat/completions", json=chat_rf("no-such-model", bad)), 404)
    err = assert_error(http.post(node.url + "/v1/chat/completions", json=chat_rf("qwen3", bad)), 400)
    assert err["param"] == "response_format.json_schema.schema"


def test_liveness_answers_while_a_heavy_schema_is_validated(node: NodeProc, http: httpx.Client) -> None:
    """~16k JSON values within the bounds (~0.5-1 s of meta-validation, distinct each time: no cache):
    validated off the event loop, so liveness probes keep being answered while the request is in
    flight (on the loop they all waited for it: at most the one already sent got through)."""
    with LivenessPoller(node.url) as poller:
        for _ in range(200):  # bounded: until the poller runs
            if poller.done:
                break
            time.sleep(0.01)
        seen = []
        for i in range(3):
            body = chat_rf("qwen3", grid_schema(90, salt=f"{i}-{time.monotonic_ns()}"))
            a = time.monotonic()
            r = http.post(node.url + "/v1/chat/completions", json=body)
            b = time.monotonic()
            assert r.status_code == 200, r.text[:400]
            seen.append(poller.answered_between(a, b))
    print("liveness answers while in flight:", seen)
    assert max(seen) >= 5, seen


def test_distinct_big_inputs_do_not_pin_memory(node: NodeProc, http: httpx.Client) -> None:
    """Distinct multi-MB stop strings (to the model and to no model), logit_bias maps, template kwargs
    and long routing keys: 400s (routing keys: served, held as digests), and the node's RSS does not
    grow with them (before the bounds: every stop string stayed in the sampling memo, ~3 MB each)."""
    url = node.url + "/v1/chat/completions"

    def attack(i: int) -> None:
        big = 3 << 20
        for model in ("qwen3", "no-such-model"):
            stop = {"model": model, "messages": MSGS, "stop": [f"{i}-{model}-" + "s" * big]}
            assert_error(http.post(url, json=stop), 400, "stop")
        bias = {str(1000 * i + j): 1 for j in range(5000)}
        assert_error(http.post(url, json={"model": "qwen3", "messages": MSGS, "logit_bias": bias}), 400)
        kwargs: dict[str, Any] = {"enable_thinking": False, "note": f"{i}" + "k" * (1 << 20)}
        body: dict[str, Any] = {"model": "qwen3", "messages": MSGS, "chat_template_kwargs": kwargs}
        assert_error(http.post(url, json=body), 400, "chat_template_kwargs")
        headers = {"x-smg-routing-key": f"{i}-" + "r" * 7000}
        r = http.post(url, json={"model": "qwen3", "messages": MSGS, "max_tokens": 1}, headers=headers)
        assert r.status_code == 200, r.text[:300]

    for i in range(5):  # warm-up: the buffers a request of this size needs anyway
        attack(-1 - i)
    before = rss_mb(node.pid)
    for i in range(40):
        attack(i)
    after = rss_mb(node.pid)
    print(f"RSS {before:.0f} -> {after:.0f} MB")
    assert node.proc.poll() is None
    assert after - before < 64, f"RSS {before:.0f} -> {after:.0f} MB"


def peak_mb_after(pid: int, call: Any) -> tuple[float, float, Any]:
    """``call()``'s result, with the process's RSS before it and its peak RSS during it (the peak reset
    first: ``/proc/PID/clear_refs`` 5), in MB."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = rss_mb(pid)
    got = call()
    with open(f"/proc/{pid}/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    return before, peak, got


def test_a_whole_answer_with_many_choices_and_logprobs_holds_little_more_than_itself(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """``n`` 64, 500 tokens each and 20 alternatives per token, not streamed: a ~40 MB chat answer. The
    node's peak on a fresh node stays under 5x the answer (each choice's logprobs serialized as it is
    built: ~4x, with the engine's entries and the body; as dicts all at once: 6.5x, and 1.38 GB for n
    128 and 1,000 tokens). A completions answer with the echoed prompt's logprobs goes the same way:
    whole, in order."""
    with running_node(*qwen3_flags(engine, tokenizer_dir), "--policy", "manual") as n:
        for path, extra in (
            ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 20}),
            ("/v1/completions", {"prompt": "hi", "logprobs": 5, "echo": True}),
        ):
            body = {"model": "qwen3", "n": 64, "max_tokens": 500, "ignore_eos": True, **extra}

            def call(body: dict[str, Any] = body, path: str = path) -> httpx.Response:
                return http.post(n.url + path, json=body, timeout=120)

            before, peak, r = peak_mb_after(n.pid, call)
            assert r.status_code == 200, r.text[:300]
            size = len(r.content) / 2**20
            choices = r.json()["choices"]
            assert len(choices) == 64
            lps = choices[-1]["logprobs"]
            if "content" in lps:
                assert len(lps["content"]) == 500 and len(lps["content"][0]["top_logprobs"]) == 20
            else:  # the echoed prompt's tokens, then the output's
                assert len(lps["tokens"]) > 500 and lps["token_logprobs"][0] is None
            print(f"{path}: answer {size:.1f} MB, RSS {before:.0f} -> peak {peak:.0f} MB")
            if "content" in lps:
                assert peak - before < 5 * size, f"{path}: answer {size:.1f} MB, {before:.0f} -> {peak:.0f}"


def test_bodies_cut_off_mid_upload_are_released(node: NodeProc) -> None:
    """Ten connections each send a 15 MB chat body but its last byte, then close: what they sent goes
    with them (it sat in the connection's reference cycles until the collector's oldest generation ran,
    tens of thousands of requests later: +15 MB of RSS a cut upload)."""
    host, port = "127.0.0.1", node.port
    body = b'{"model":"qwen3","messages":[{"role":"user","content":"' + b"x" * (15 << 20) + b'"}]}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def cut() -> None:
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(head + body[:-1])
            time.sleep(0.2)  # (read by the node before the close)

    cut()  # warm-up: the buffers a body of this size needs anyway
    before = rss_mb(node.pid)
    for _ in range(10):
        cut()
    time.sleep(0.5)
    after = rss_mb(node.pid)
    print(f"RSS {before:.0f} -> {after:.0f} MB")
    assert http_ok(node)
    assert after - before < 60, f"RSS {before:.0f} -> {after:.0f} MB after 10 cut 15 MB uploads"


def http_ok(node: NodeProc) -> bool:
    return httpx.get(node.url + "/liveness", timeout=10).status_code == 200
