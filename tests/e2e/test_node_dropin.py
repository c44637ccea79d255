"""End to end: a node as a drop-in for vLLM / SGLang / SMG users (issue 18: routes, admin, metrics, model
identity). Each test starts real mock engines and a real ``smg-node`` on loopback, stopped by pid.

Shapes checked against: SMG's worker spec and WorkerListResponse (lightseekorg/smg
``protocols/worker_spec.rs``: ``total``, ``stats.by_type``, ``model_id``, ``worker_type``,
``connection_mode``, ``runtime_type``, ``is_healthy``, ``priority``, ``cost``, ``load``;
``FlushCacheResult``, ``WorkerLoadsResult``), SGLang's ``/generate`` (sgl-project/sglang
``python/sglang/srt/entrypoints/http_server.py``: ``text``, ``output_ids``, ``meta_info`` with
``finish_reason {"type": "length", "length": n}``) and vLLM's ``/version`` and ``/v1/models/{id}``
(vllm-project/vllm ``vllm/entrypoints/openai/api_server.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shepherd.mock_engine.tokenizer_zip import build_tokenizer_zip
from tests.e2e import node_fixtures
from tests.e2e.node_procs import free_port, http_status, running_node, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_node_tools import byte_tokenizer

http = node_fixtures.http
MSGS: list[Any] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def engine_tokenizer() -> Iterator[Path]:
    """The byte-level tokenizer with Qwen3's chat template beside it: what the engine serves (the node
    gets both only through GetTokenizer)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = byte_tokenizer(Path(tmp) / "served")
        shutil.copy(node_fixtures.QWEN3_TEMPLATE, d / "chat_template.jinja")
        yield d


def rpc_calls(engine: MockEngineProc, name: str) -> int:
    stats: dict[str, Any] = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()
    return int(stats["rpc_calls"].get(name, 0))


def settled(http: httpx.Client, url: str) -> str:
    """The node's /metrics once its in-flight count is back to 0 (what a request spawns, an engine
    abort, has been counted by then)."""
    deadline = time.monotonic() + 15
    page = ""
    while time.monotonic() < deadline:
        page = http.get(url + "/metrics").text
        if metric(page, "smg_in_flight_requests") == 0.0:
            break
        time.sleep(0.1)
    return page


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in a Prometheus text page (None: absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def test_model_identity_and_tokenizer_from_the_engine(engine_tokenizer: Path, http: httpx.Client) -> None:
    """No --model-path: the served name from GetModelInfo, tokenizer + chat template from GetTokenizer
    (asked of one worker, verified by sha256, cached on disk and reused on restart); an alias renames."""
    expected_sha = build_tokenizer_zip(engine_tokenizer).sha256
    tok_flags = ("--tokenizer", str(engine_tokenizer), "--model", "org/served-model", "--zero-latency")
    with (
        tempfile.TemporaryDirectory() as cache,
        start_mock_engine(*tok_flags) as e1,
        start_mock_engine(*tok_flags) as e2,
    ):
        urls = ("--worker-urls", f"grpc://{e1.grpc_target}", f"grpc://{e2.grpc_target}")
        with running_node(*urls, "--tokenizer-cache-dir", cache) as node:
            models = http.get(node.url + "/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["org/served-model"]
            one = http.get(node.url + "/v1/models/org/served-model")
            assert one.status_code == 200 and one.json()["id"] == "org/served-model"
            # the engine's byte-level tokenizer, not the embedded Qwen3 one: one id per byte
            toks = http.post(node.url + "/v1/tokenize", json={"prompt": "hello"}).json()
            assert toks["count"] == 5
            # the chat template came with it: chat renders (Qwen3's markers, one token each here)
            sdk = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
            r = sdk.chat.completions.create(model="org/served-model", messages=MSGS, max_tokens=3)
            assert r.choices[0].message.content is not None and r.model == "org/served-model"
            rendered = http.post(node.url + "/v1/tokenize", json={"messages": MSGS}).json()["tokens"]
            assert 50_000 > len(rendered) > len("Say something.")
        # one worker of the model was asked; the zip is on disk under its verified sha256
        assert rpc_calls(e1, "sglang.GetTokenizer") + rpc_calls(e2, "sglang.GetTokenizer") == 1
        zip_path = Path(cache) / f"{expected_sha}.zip"
        assert hashlib.sha256(zip_path.read_bytes()).hexdigest() == expected_sha
        assert (Path(cache) / expected_sha / "chat_template.jinja").is_file()
        # a restart reuses the cache (no second GetTokenizer); the alias is what clients send and see
        with running_node(
            *urls, "--tokenizer-cache-dir", cache, "--model-alias", "mine=org/served-model"
        ) as node:
            models = http.get(node.url + "/v1/models").json()["data"]
            assert [(m["id"], m["root"]) for m in models] == [("mine", "org/served-model")]
            got = http.post(
                node.url + "/v1/completions", json={"model": "mine", "prompt": "ab", "max_tokens": 2}
            )
            assert got.status_code == 200, got.text
            assert http.get(node.url + "/v1/models/org/served-model").status_code == 404
        assert rpc_calls(e1, "sglang.GetTokenizer") + rpc_calls(e2, "sglang.GetTokenizer") == 1
        # a corrupted cached zip fails its sha256: fetched again, not used
        zip_path.write_bytes(b"not the zip")
        with running_node(*urls, "--tokenizer-cache-dir", cache) as node:
            assert http.post(node.url + "/v1/tokenize", json={"prompt": "hello"}).json()["count"] == 5
        assert rpc_calls(e1, "sglang.GetTokenizer") + rpc_calls(e2, "sglang.GetTokenizer") == 2
        assert hashlib.sha256(zip_path.read_bytes()).hexdigest() == expected_sha


def test_a_node_started_before_its_engine_waits_for_the_model(
    engine_tokenizer: Path, http: httpx.Client
) -> None:
    """Compose and Kubernetes start the node while the engine still loads its weights: the node waits
    for a worker to say what it serves (``--worker-startup-timeout-secs``), not settling on the
    embedded default model."""
    grpc_port = free_port()
    node = spawn_node(
        "serve", "--worker-urls", f"grpc://127.0.0.1:{grpc_port}", "--worker-startup-timeout-secs", "120",
        port=free_port(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30.0  # the node asks, nobody answers: its port says it is alive
        while time.monotonic() < deadline and http_status(node.url + "/liveness") != 200:
            time.sleep(0.1)
        assert node.proc.poll() is None, node.log()
        assert http.get(node.url + "/liveness").json() == {"status": "alive"}
        assert http_status(node.url + "/readiness") == 503 and http_status(node.url + "/health") == 503
        chat = http.post(node.url + "/v1/chat/completions", json={"model": "m", "messages": MSGS})
        assert chat.status_code == 503 and chat.headers["retry-after"] == "5", chat.text
        assert chat.json()["error"]["code"] == "starting"
        msg = http.post(node.url + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSGS})
        assert msg.status_code == 529 and msg.json()["error"]["type"] == "overloaded_error", msg.text
        tok_flags = ("--tokenizer", str(engine_tokenizer), "--model", "org/late-model", "--zero-latency")
        with start_mock_engine(*tok_flags, "--grpc-port", str(grpc_port)):
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and http_status(node.url + "/readiness") != 200:
                time.sleep(0.2)
            models = http.get(node.url + "/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["org/late-model"], node.log()
            assert http.post(node.url + "/v1/tokenize", json={"prompt": "hello"}).json()["count"] == 5
        assert "waiting for a gRPC worker" in node.log() or "did not answer" in node.log()
    finally:
        node.stop()


def test_an_engine_slow_to_give_its_model_is_heard_at_the_start(
    engine_tokenizer: Path, http: httpx.Client
) -> None:
    """GetServerInfo and GetModelInfo 2 s each (an engine under heavy load), three calls (kind, model,
    context): over the first ask's 5 s, within the next one's longer deadline. The start takes the
    engine's model, not the embedded one (which it would settle on at ``--worker-startup-timeout-secs``
    were every ask as short)."""
    tok_flags = ("--tokenizer", str(engine_tokenizer), "--model", "org/slow-model", "--zero-latency")
    with (
        tempfile.TemporaryDirectory() as cache,
        start_mock_engine(*tok_flags, "--info-delay-seconds", "2") as e,
        running_node(
            *("--worker-urls", f"grpc://{e.grpc_target}", "--tokenizer-cache-dir", cache),
            *("--worker-startup-timeout-secs", "40"),
            timeout=120.0,
        ) as node,
    ):
        models = http.get(node.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["org/slow-model"], node.log()
        assert http.post(node.url + "/v1/tokenize", json={"prompt": "hello"}).json()["count"] == 5


def test_model_path_overrides_the_engine(engine_tokenizer: Path, http: httpx.Client) -> None:
    with (
        tempfile.TemporaryDirectory() as cache,
        start_mock_engine("--tokenizer", str(engine_tokenizer), "--model", "served", "--zero-latency") as e,
    ):
        with running_node(
            "--worker-urls",
            f"grpc://{e.grpc_target}",
            "--tokenizer-cache-dir",
            cache,
            "--model-path",
            str(engine_tokenizer),
            "--model-id",
            "local",
        ) as node:
            assert [m["id"] for m in http.get(node.url + "/v1/models").json()["data"]] == ["local"]
        assert rpc_calls(e, "sglang.GetTokenizer") == 0
        assert not any(Path(cache).iterdir())


def test_models_by_id_and_the_openai_404(http: httpx.Client) -> None:
    with (
        start_mock_engine("--zero-latency") as e,
        running_node("--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3") as node,
    ):
        sdk = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
        m = sdk.models.retrieve("qwen3")
        assert m.id == "qwen3" and m.object == "model"
        with pytest.raises(openai.NotFoundError) as err:
            sdk.models.retrieve("gpt-9")
        body = err.value.response.json()
        assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert err.value.response.headers["x-smg-gateway-ms"]
        assert err.value.response.headers["x-request-id"]


def test_smg_admin_json_for_workers(http: httpx.Client) -> None:
    """SMG's WorkerListResponse and worker spec on /workers (list, add, get, update, delete), on the
    admin listener only (the client port 404s the control routes)."""
    admin_port = free_port()
    with (
        start_mock_engine("--zero-latency") as a,
        start_mock_engine("--zero-latency", "--engine", "vllm") as b,
        running_node(
            "--worker-urls", f"grpc://{a.grpc_target}", "--model-id", "qwen3", "--admin-port", str(admin_port)
        ) as node,
    ):
        admin = f"http://127.0.0.1:{admin_port}"
        assert http.get(node.url + "/workers").status_code == 404
        assert http.post(node.url + "/flush_cache").status_code == 404
        assert http.get(node.url + "/get_loads").status_code == 404
        listed = http.get(admin + "/workers").json()
        assert listed["total"] == 1
        assert listed["stats"] == {
            "total_workers": 1,
            "healthy_workers": 1,
            "total_models": 1,
            "total_load": 0,
            "by_type": {"regular": 1, "prefill": 0, "decode": 0},
            "prefill_count": 0,  # (smg 1.13's server's)
            "decode_count": 0,
            "regular_count": 1,
        }
        w = listed["workers"][0]
        assert (w["model_id"], w["worker_type"], w["connection_mode"]) == ("qwen3", "regular", "grpc")
        assert (w["runtime_type"], w["is_healthy"], w["priority"], w["cost"]) == ("sglang", True, 50, 1.0)
        assert isinstance(w["load"], int) and w["url"] == f"grpc://{a.grpc_target}" and w["healthy"] is True
        # SMG's spec: runtime_type names the engine's protocol (no detection), weights and labels kept
        spec = {
            "url": f"grpc://{b.grpc_target}",
            "model_id": "qwen3",
            "worker_type": "regular",
            "runtime_type": "vllm",
            "priority": 80,
            "cost": 0.5,
            "labels": {"zone": "a"},
        }
        added = http.post(admin + "/workers", json=spec)
        assert added.status_code == 202, added.text
        got = added.json()
        assert got["success"] is True and got["worker"]["runtime_type"] == "vllm"
        assert (got["priority"], got["cost"], got["labels"]) == (80, 0.5, {"zone": "a"})
        assert got["url"] == f"vllm://{b.grpc_target}"
        wid = got["id"]
        assert http.get(admin + f"/workers/{wid}").json()["priority"] == 80
        assert added.headers["Location"] == f"/workers/{wid}" and got["worker_id"] == wid
        # the same URL again (smg: WORKER_ALREADY_EXISTS): a 409, and its weights are left as they are
        again = http.post(admin + "/workers", json={**spec, "priority": 5, "labels": {"zone": "z"}})
        assert again.status_code == 409 and again.json()["error"]["code"] == "worker_exists", again.text
        assert wid in again.json()["error"]["message"]
        kept = http.get(admin + f"/workers/{wid}").json()
        assert (kept["priority"], kept["labels"]) == (80, {"zone": "a"})
        upd = http.put(admin + f"/workers/{wid}", json={"priority": 10, "labels": {"zone": "b"}})
        assert upd.status_code == 200 and upd.json()["worker"]["priority"] == 10
        assert upd.json()["labels"] == {"zone": "b"} and upd.json()["cost"] == 0.5
        assert http.get(admin + "/workers").json()["total"] == 2
        # the same engine under another spelling is the worker it is already (409, nothing added)
        host, _, port = a.grpc_target.rpartition(":")
        for alias in (f"sglang://{a.grpc_target}", f"grpc://0x7f000001:{port}", f"grpc://127.1:{port}"):
            twin = http.post(admin + "/workers", json={"url": alias, "model_id": "qwen3"})
            assert twin.status_code == 409 and twin.json()["error"]["code"] == "worker_exists", twin.text
        assert host == "127.0.0.1" and http.get(admin + "/workers").json()["total"] == 2
        # refused with 400 naming the field
        bad = http.post(admin + "/workers", json={**spec, "worker_type": "prefill"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "worker_type"
        bad = http.post(admin + "/workers", json={**spec, "runtime_type": "tgi"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "runtime_type"
        bad = http.post(admin + "/workers", json={**spec, "chat_template": "x.jinja"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
        bad = http.put(admin + f"/workers/{wid}", json={"url": "grpc://x:1"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
        bad = http.put(admin + f"/workers/{wid}", json={"cost": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cost"
        # SMG's /get_loads and /flush_cache on the admin listener
        loads = http.get(admin + "/get_loads").json()
        assert loads["total_workers"] == 2 and {x["worker_id"] for x in loads["loads"]} == {w["id"], wid}
        flushed = http.post(admin + "/flush_cache")
        assert flushed.status_code == 200, flushed.text
        assert len(flushed.json()["successful"]) == 2 and flushed.json()["failed"] == []
        assert rpc_calls(a, "sglang.FlushCache") == 1 and rpc_calls(b, "vllm.FlushCache") == 1
        assert http.post(admin + "/reset_prefix_cache").status_code == 200  # vLLM's name for it
        assert http.post(node.url + "/reset_prefix_cache").status_code == 404
        gone = http.delete(admin + f"/workers/{wid}")
        assert gone.status_code == 202 and gone.json()["success"] is True
        assert gone.json()["worker"]["id"] == wid and gone.json()["deleted"] == wid  # SMG's shape
        assert http.get(admin + "/workers").json()["total"] == 1
        # SMG's older query-string admin, on the admin listener too
        legacy = f"grpc://{b.grpc_target}"
        assert http.get(node.url + "/list_workers").status_code == 404
        added = http.post(admin + "/add_worker", params={"url": legacy, "runtime_type": "vllm"})
        assert added.status_code == 202 and added.json()["success"] is True, added.text
        assert f"vllm://{b.grpc_target}" in http.get(admin + "/list_workers").json()["urls"]
        nameless = http.post(admin + "/remove_worker")
        assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "url", nameless.text
        removed = http.post(admin + "/remove_worker", params={"url": f"vllm://{b.grpc_target}"})
        assert removed.status_code == 202 and removed.json()["success"] is True
        assert http.get(admin + "/list_workers").json()["urls"] == [f"grpc://{a.grpc_target}"]
        # every change to the workers is in the log: what, on what, by whom, from where
        audit = [ln for ln in node.log().splitlines() if "shepherd.audit" in ln]
        assert sum("worker added" in ln for ln in audit) == 2, audit
        assert sum("worker removed" in ln for ln in audit) == 2, audit
        assert sum("worker updated" in ln for ln in audit) == 1, audit
        assert all("by anonymous (none) from 127.0.0.1" in ln for ln in audit), audit


def test_routes_scripts_probe(http: httpx.Client) -> None:
    """/version, /ping, /get_model_info, /get_server_info, /generate (SGLang native, text and
    input_ids, streamed and not), /health_generate."""
    with (
        start_mock_engine("--zero-latency") as e,
        running_node("--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3") as node,
    ):
        u = node.url
        assert http.get(u + "/version").json()["version"]
        assert http.get(u + "/ping").status_code == 200
        info = http.get(u + "/get_model_info").json()
        assert info["model_path"] == "qwen3" and info["is_generation"] is True
        server = http.get(u + "/get_server_info").json()
        assert server["version"] and server["served_model_name"] == "qwen3"
        assert http.get(u + "/health_generate").status_code == 200
        assert rpc_calls(e, "sglang.Abort") == 0  # its one token ends the engine's request: nothing to abort
        g = http.post(u + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        assert g.status_code == 200, g.text
        body = g.json()
        assert len(body["output_ids"]) == 4 and isinstance(body["text"], str) and body["text"]
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert body["meta_info"]["completion_tokens"] == 4 and body["meta_info"]["prompt_tokens"] >= 1
        assert g.headers["x-smg-gateway-ms"] and g.headers["x-request-id"]
        events: list[str] = []
        with http.stream(
            "POST",
            u + "/generate",
            json={"input_ids": [9707, 11], "sampling_params": {"max_new_tokens": 3}, "stream": True},
        ) as s:
            events.extend(line[6:] for line in s.iter_lines() if line.startswith("data: "))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(x) for x in events[:-1]]
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert len(chunks[-1]["output_ids"]) == 3 and chunks[-1]["text"].startswith(chunks[0]["text"])
        bad = http.post(u + "/generate", json={"text": "x", "sampling_params": {"regex": "a+"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex"
        bad = http.post(u + "/generate", json={"sampling_params": {}})
        assert bad.status_code == 400
        # errors name /generate's own fields, and a field of the wrong type is refused, not read as empty
        for body, param in (
            ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
            ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
            ({"input_ids": [-1]}, "input_ids"),
            ({"text": "x", "sampling_params": []}, "sampling_params"),
            ({"text": "x", "stream": ""}, "stream"),
        ):
            bad = http.post(u + "/generate", json=body)
            err = bad.json()["error"]
            assert bad.status_code == 400 and err["param"] == param, (body, err)
            assert "'max_tokens'" not in err["message"] and "'prompt'" not in err["message"], err


def test_metrics_and_headers_on_every_answer(http: httpx.Client) -> None:
    """In flight counts only inference requests; a client disconnect is its own abort reason with the
    model label; x-smg-gateway-ms and x-request-id on errors, relays and non-generation routes."""
    with (
        start_mock_engine("--decode-ms-per-token", "100") as e,
        running_node("--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3") as node,
        running_node("--worker-urls", e.http_url, "--model-id", "qwen3") as relay,
    ):
        u = node.url
        assert http.get(u + "/health").json()["in_flight"] == 0
        assert metric(http.get(u + "/metrics").text, "smg_in_flight_requests") == 0.0
        answers = [
            http.get(u + "/v1/models"),
            http.get(u + "/health"),
            http.get(u + "/nowhere"),  # 404
            http.post(u + "/v1/chat/completions", json={"model": "qwen3"}),  # 400
            http.post(u + "/v1/messages", json={"model": "qwen3"}),  # 400, Anthropic's envelope
            http.post(relay.url + "/v1/chat/completions", json={"model": "qwen3", "messages": MSGS}),
            http.post(relay.url + "/v1/chat/completions", json={"model": "nope", "messages": MSGS}),
        ]
        assert [a.status_code for a in answers] == [200, 200, 404, 400, 400, 200, 404]
        for a in answers:
            assert float(a.headers["x-smg-gateway-ms"]) >= 0, a.request.url
            assert a.headers["x-request-id"], a.request.url
        assert answers[4].json()["type"] == "error"
        mine = http.get(u + "/v1/models", headers={"x-request-id": "probe-1"})
        assert mine.headers["x-request-id"] == "probe-1"
        with http.stream(
            "POST",
            relay.url + "/v1/chat/completions",
            json={"model": "qwen3", "messages": MSGS, "max_tokens": 3, "stream": True},
        ) as s:
            assert s.headers["x-smg-gateway-ms"] and s.headers["x-request-id"]
            s.read()
        # a client that goes away mid-stream: aborted as client_disconnect, under its model
        with (
            httpx.Client(timeout=30) as c,
            c.stream(
                "POST",
                u + "/v1/chat/completions",
                json={"model": "qwen3", "messages": MSGS, "max_tokens": 200, "stream": True},
            ) as s,
        ):
            for line in s.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break
        deadline = time.monotonic() + 15
        got = busy = None
        while time.monotonic() < deadline:  # the handler's cancellation lands shortly after the close
            page = http.get(u + "/metrics").text
            got = metric(page, "smg_engine_aborts_total", reason="client_disconnect", model="qwen3")
            busy = metric(page, "smg_in_flight_requests")
            if got and busy == 0.0:
                break
            time.sleep(0.1)
        assert got == 1.0 and busy == 0.0, page
        assert metric(page, "smg_engine_aborts_total", reason="stop") is None


def test_sse_keepalive_before_the_first_token(http: httpx.Client) -> None:
    """A long prefill (the mock's 0.1 s per prompt token, ~40 tokens) with a 0.2 s keep-alive: the
    headers and keep-alive comments arrive before the first token."""
    with (
        start_mock_engine("--prefill-us-per-token", "100000") as e,
        running_node(
            "--worker-urls", f"grpc://{e.grpc_target}", "--model-id", "qwen3", "--sse-keepalive-secs", "0.2"
        ) as node,
    ):
        lines: list[str] = []
        with http.stream(
            "POST",
            node.url + "/v1/completions",
            json={
                "model": "qwen3",
                "prompt": "one two three four five " * 8,
                "max_tokens": 2,
                "stream": True,
            },
        ) as s:
            assert s.status_code == 200
            lines.extend(line for line in s.iter_lines() if line)
        first_data = next(i for i, x in enumerate(lines) if x.startswith("data: "))
        assert first_data >= 2, lines[:5]
        assert all(x == ": keep-alive" for x in lines[:first_data])
        assert lines[-1] == "data: [DONE]"


def test_tokenizer_from_a_vllm_engine_over_grpcio(engine_tokenizer: Path, http: httpx.Client) -> None:
    """The same through vLLM's service and the grpcio transport, a dead worker listed first (the workers
    are asked at once: the first to answer gives the model)."""
    with (
        tempfile.TemporaryDirectory() as cache,
        start_mock_engine(
            "--engine", "vllm", "--tokenizer", str(engine_tokenizer), "--model", "v-model", "--zero-latency"
        ) as e,
        running_node(
            "--worker-urls",
            f"grpc://127.0.0.1:{free_port()}",
            f"grpc://{e.grpc_target}",
            "--engine-transport",
            "grpcio",
            "--tokenizer-cache-dir",
            cache,
        ) as node,
    ):
        assert [m["id"] for m in http.get(node.url + "/v1/models").json()["data"]] == ["v-model"]
        assert http.post(node.url + "/v1/tokenize", json={"prompt": "hello"}).json()["count"] == 5
        assert rpc_calls(e, "vllm.GetTokenizer") == 1
