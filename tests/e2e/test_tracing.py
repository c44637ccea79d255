"""End to end: OpenTelemetry traces of real requests through real ``smg-node`` processes, collected by an
OTLP gRPC receiver the test starts itself (``tests/e2e/otlp_receiver.py``: opentelemetry-proto's
``TraceService`` on ``grpc.aio``, loopback).

What must hold: a request continues the client's ``traceparent`` (SERVER span of the route, child of the
client's span); the engine call is a CLIENT span named ``{gen_ai.operation.name} {gen_ai.request.model}``
with the GenAI attributes, under the SERVER span with the gateway's stages (render and tokenize, route);
the engine receives the CLIENT span's context (gRPC metadata over the lean h2 client and grpcio, HTTP
headers to an HTTP worker; the mock engine records what it got); message contents only on opt-in; a
collector that is down costs the requests nothing and its losses are counted; a Responses retrieve that
another node serves over the mesh continues the same trace on the owner node; the same spans reach an
OTLP/HTTP (protobuf) collector (``OtlpReceiver("http/protobuf")``), configured by flags or ``OTEL_*``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shepherd.auth.certs import write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE, qwen3_flags
from tests.e2e.node_procs import NodeProc, env, free_port, http_status, reserved_port, spawn_node, start_node
from tests.e2e.otlp_receiver import (
    CLIENT,
    FAST_EXPORT,
    SERVER,
    OtlpReceiver,
    ReceivedPoint,
    ReceivedSpan,
    in_trace,
    named,
)
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_mesh_cluster import mesh_flags, wait_for

pytestmark = pytest.mark.timeout(240)

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

MODEL = "qwen3"


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@contextlib.contextmanager
def node(*args: str, extra_env: dict[str, str] | None = None) -> Iterator[NodeProc]:
    with env({**FAST_EXPORT, **(extra_env or {})}):
        n = start_node(*args, timeout=120)  # the deadline only guards against a hang (a loaded machine)
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine("--zero-latency", "--output-len", "8", "--tokenizer", str(tokenizer_dir)) as e:
        yield e


def one(spans: list[ReceivedSpan], name: str, kind: int | None = None) -> ReceivedSpan:
    got = [s for s in named(spans, name) if kind is None or s.kind == kind]
    assert len(got) == 1, (name, [(s.name, s.kind) for s in spans])
    return got[0]


def engine_contexts(http: httpx.Client, engine: MockEngineProc) -> list[dict[str, str | None]]:
    got: list[dict[str, str | None]] = http.get(engine.http_url + "/mock/stats").json()["trace_contexts"]
    return got


@pytest.mark.parametrize(
    ("transport", "capture"), [("h2", False), ("grpcio", True)], ids=["h2", "grpcio-capture"]
)
def test_a_chat_stream_is_one_trace_from_the_client_to_the_engine(
    transport: str,
    capture: bool,
    receiver: OtlpReceiver,
    engine: MockEngineProc,
    tokenizer_dir: Path,
    http: httpx.Client,
) -> None:
    trace_id = os.urandom(16).hex()
    client_span = os.urandom(8).hex()
    rid = f"req-trace-{transport}"
    extra = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"} if capture else {}
    flags = (*qwen3_flags(engine, tokenizer_dir), "--engine-transport", transport, "--tokenizer-workers", "0")
    with node(*flags, "--otlp-traces-endpoint", receiver.endpoint, extra_env=extra) as n:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "the secret word is marmalade"}],
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {
            "traceparent": traceparent(trace_id, client_span),
            "tracestate": "vendor=1",
            "x-request-id": rid,
        }
        r = http.post(n.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        usage_line = [ln for ln in r.text.splitlines() if '"usage"' in ln and '"prompt_tokens"' in ln][-1]
        usage = httpx.Response(200, content=usage_line.removeprefix("data: ")).json()["usage"]
        spans = receiver.wait(
            lambda s: (
                any(x.kind == SERVER for x in in_trace(s, trace_id))
                and any(x.kind == CLIENT for x in in_trace(s, trace_id))
            ),
            "the request's SERVER and CLIENT spans",
        )
    mine = in_trace(spans, trace_id)
    server = one(mine, "POST /v1/chat/completions", SERVER)
    assert server.parent_id == client_span  # the client's trace continued
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.resource["service.name"] == "smg-node"
    call = one(mine, f"chat {MODEL}", CLIENT)
    assert call.parent_id == server.span_id
    a = call.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "sglang"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.seed"] == 7
    assert a["gen_ai.response.id"] == rid
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 8
    assert a["gen_ai.usage.cache_read.input_tokens"] >= 0
    assert a["gen_ai.response.time_to_first_chunk"] >= 0
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == engine.grpc_port
    assert "error.type" not in a and not call.error
    # the gateway's own stages: events on the SERVER span, with their durations and outcomes
    assert server.events[:2] == ["render_tokenize", "route"]
    render = server.event_attributes["render_tokenize"]
    assert render["shepherd.tokenizer.cache"] in ("hit", "miss") and render["shepherd.duration_ms"] >= 0
    route = server.event_attributes["route"]
    assert route["shepherd.route.worker"] == f"grpc://127.0.0.1:{engine.grpc_port}"
    assert route["shepherd.route.policy"] == "CacheAware"  # (the default policy)
    # message contents only when the operator opted in
    if capture:
        assert "marmalade" in server.attributes["gen_ai.input.messages"]
        assert "gen_ai.output.messages" in a
    else:
        assert all("marmalade" not in str(s.attributes) for s in mine)
    # the engine received the CLIENT span's context in its gRPC metadata
    got = [c for c in engine_contexts(http, engine) if str(c["request_id"]).partition(".")[2] == rid]
    assert got and got[-1]["traceparent"] == traceparent(trace_id, call.span_id)
    assert got[-1]["tracestate"] == "vendor=1"


def test_an_http_worker_gets_the_context_in_its_headers(
    receiver: OtlpReceiver, engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    flags = (
        "--worker-urls",
        engine.http_url,
        "--model-id",
        MODEL,
        "--model-path",
        str(tokenizer_dir),
        "--tokenizer-workers",
        "0",
    )
    with node(*flags, "--otlp-traces-endpoint", receiver.endpoint) as n:
        wait_for(lambda: http_status(n.url + "/readiness") == 200, "node ready")
        body = {"model": MODEL, "prompt": "relay me", "max_tokens": 4}
        headers = {"traceparent": traceparent(trace_id, client_span), "x-request-id": "req-relay-1"}
        r = http.post(n.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        spans = receiver.wait(
            lambda s: (
                any(x.kind == CLIENT for x in in_trace(s, trace_id))
                and any(x.kind == SERVER for x in in_trace(s, trace_id))
            ),
            "the relay's spans",
        )
    mine = in_trace(spans, trace_id)
    server = one(mine, "POST /v1/completions", SERVER)
    relay = one(mine, "POST /v1/completions", CLIENT)
    assert server.parent_id == client_span and relay.parent_id == server.span_id
    assert relay.attributes["http.response.status_code"] == 200
    got = [c for c in engine_contexts(http, engine) if c["request_id"] == "req-relay-1"]
    assert got and got[-1]["traceparent"] == traceparent(trace_id, relay.span_id)


@pytest.mark.parametrize("configured_by", ["flags", "env"])
def test_spans_reach_an_http_protobuf_collector(
    configured_by: str, engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """OTLP over HTTP/protobuf (``--otlp-traces-protocol http/protobuf``, or the standard
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): a streamed chat's SERVER
    and CLIENT spans arrive at an OTLP/HTTP receiver with the same tree and attributes as over gRPC."""
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    rid = f"req-trace-http-{configured_by}"
    flags = (*qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0")
    with OtlpReceiver("http/protobuf") as rx:
        if configured_by == "flags":
            on: tuple[str, ...] = (
                "--otlp-traces-endpoint",
                rx.endpoint,
                "--otlp-traces-protocol",
                "http/protobuf",
            )
            extra: dict[str, str] = {}
        else:  # the full URL of the traces endpoint, as the OTLP exporter specification has it
            on = ("--enable-trace",)
            extra = {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.endpoint + "/v1/traces",
            }
        with node(*flags, *on, extra_env=extra) as n:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "over http"}],
                "max_tokens": 8,
                "temperature": 0.5,
                "stream": True,
            }
            headers = {"traceparent": traceparent(trace_id, client_span), "x-request-id": rid}
            r = http.post(n.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            spans = rx.wait(
                lambda s: {x.kind for x in in_trace(s, trace_id)} >= {SERVER, CLIENT},
                "the request's SERVER and CLIENT spans over OTLP/HTTP",
            )
    mine = in_trace(spans, trace_id)
    server = one(mine, "POST /v1/chat/completions", SERVER)
    call = one(mine, f"chat {MODEL}", CLIENT)
    assert server.parent_id == client_span and call.parent_id == server.span_id
    assert server.resource["service.name"] == "smg-node"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.events[:2] == ["render_tokenize", "route"]
    assert server.event_attributes["render_tokenize"]["shepherd.tokenizer.cache"] in ("hit", "miss")
    a = call.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"], a["gen_ai.request.model"]) == (
        "chat", "sglang", MODEL
    )  # fmt: skip
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5) and a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.response.id"] == rid and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] > 0
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == engine.grpc_port
    assert not call.error and not server.error
    got = [c for c in engine_contexts(http, engine) if str(c["request_id"]).partition(".")[2] == rid]
    assert got and got[-1]["traceparent"] == traceparent(trace_id, call.span_id)


def _metric(text: str, line_prefix: str) -> float:
    for ln in text.splitlines():
        if ln.startswith(line_prefix):
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_prefix} in /metrics")


def test_a_collector_that_is_down_costs_requests_nothing_and_losses_are_counted(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    down = free_port()  # nothing listens there
    small = {"OTEL_BSP_MAX_QUEUE_SIZE": "2", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    flags = (*qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0")
    with node(*flags, "--otlp-traces-endpoint", f"127.0.0.1:{down}", extra_env=small) as n:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        for i in range(20):
            r = http.post(n.url + "/v1/chat/completions", json={**body, "stream": i % 2 == 0})
            assert r.status_code == 200, r.text
        text = http.get(n.url + "/metrics").text
        ended = _metric(text, 'smg_trace_spans_total{outcome="ended"}')
        dropped = _metric(text, 'smg_trace_spans_dropped_total{reason="queue_full"}')
        assert ended >= 20 * 2  # SERVER and CLIENT per request
        assert dropped > 0  # the queue (2 spans) overflowed while the exporter waited on the collector
        assert _metric(text, 'smg_trace_spans_total{outcome="exported"}') == 0
        assert _metric(text, "smg_trace_queue_capacity") == 2
        # SIGTERM: the flush gives up after its 5 s and the node exits by itself (it lived on, retrying
        # exports to the collector, until SIGKILL); 60 s leaves room for a slow machine
        assert n.stop(timeout=60) == 0, n.log()[-2000:]


# ---- a mesh hop ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_pair(
    tmp_path_factory: pytest.TempPathFactory,
    receiver: OtlpReceiver,
    engine: MockEngineProc,
    tokenizer_dir: Path,
) -> Iterator[dict[str, NodeProc]]:
    """Two mesh nodes, a and b, each with its own memory history store (shared nothing: a record is on
    the node that made it), both exporting to ``receiver``."""
    names = ("a", "b")
    pki = tmp_path_factory.mktemp("trace-mesh-pki")
    files = write_dev_pki(pki, names)
    keyring = pki / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    ports = {n: reserved_port() for n in names}
    nodes: dict[str, NodeProc] = {}

    def flags(name: str) -> list[str]:
        return [
            *qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0", "--no-kv-events",
            "--otlp-traces-endpoint", receiver.endpoint,
            *mesh_flags(name, ports[name], files[name], keyring),
        ]  # fmt: skip

    try:
        with env(FAST_EXPORT):
            nodes["a"] = spawn_node("serve", *flags("a"), port=reserved_port(), log_prefix="smg-trace-mesh-")
            seed = f"127.0.0.1:{ports['a']}"
            nodes["b"] = spawn_node(
                "join", seed, *flags("b"), port=reserved_port(), log_prefix="smg-trace-mesh-"
            )
        for name, n in nodes.items():
            wait_for(
                lambda n=n: n.proc.poll() is not None or http_status(n.url + "/readiness") == 200,  # type: ignore[misc]
                f"node {name} up",
                timeout=90,
            )
            if n.proc.poll() is not None:
                raise RuntimeError(f"node {name} exited:\n{n.log()}")

        def alive(name: str) -> bool:
            rows = httpx.get(nodes[name].url + "/mesh/members", timeout=10).json()["members"]
            return {m["name"]: m["state"] for m in rows} == dict.fromkeys(names, "alive")

        for name in names:
            wait_for(lambda name=name: alive(name), f"{name}: both alive")  # type: ignore[misc]
        yield nodes
    finally:
        for n in nodes.values():
            n.stop(signal.SIGKILL if n.proc.poll() is None else signal.SIGTERM, timeout=10)


def test_a_mesh_hop_continues_the_same_trace(
    mesh_pair: dict[str, NodeProc], receiver: OtlpReceiver, http: httpx.Client
) -> None:
    a, b = mesh_pair["a"], mesh_pair["b"]
    made = http.post(
        a.url + "/v1/responses", json={"model": MODEL, "input": "remember this", "max_output_tokens": 4}
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    got = http.get(
        b.url + f"/v1/responses/{response_id}", headers={"traceparent": traceparent(trace_id, client_span)}
    )
    assert got.status_code == 200, got.text
    assert got.json()["id"] == response_id  # served by a's store, over the mesh
    spans = receiver.wait(
        lambda s: (
            any(x.kind == SERVER and x.name == "mesh.rpc get_response" for x in in_trace(s, trace_id))
            and any(x.kind == SERVER and x.name.startswith("GET ") for x in in_trace(s, trace_id))
        ),
        "both nodes' spans of the retrieve",
    )
    mine = in_trace(spans, trace_id)
    on_b = [s for s in mine if s.resource.get("service.instance.id") == "b"]
    on_a = [s for s in mine if s.resource.get("service.instance.id") == "a"]
    route = one(on_b, "GET /v1/responses/{response_id}", SERVER)
    assert route.parent_id == client_span
    fetch = one(on_b, "mesh.rpc get_response", CLIENT)
    assert fetch.attributes["server.address"] == "a"
    served = one(on_a, "mesh.rpc get_response", SERVER)
    assert served.parent_id == fetch.span_id  # the owner node continues b's trace
    assert served.attributes["client.address"] == "b"
    stored = one(on_a, "storage get_response")
    assert stored.parent_id == served.span_id and stored.attributes["db.system.name"] == "memory"
    # b's path to the fetch runs through its own spans
    ids = {s.span_id: s for s in on_b}
    up = fetch
    for _ in range(10):  # bounded: the chain to the route's SERVER span is short
        if up.parent_id == route.span_id:
            break
        up = ids[up.parent_id]
    assert up.parent_id == route.span_id


# ---- the GenAI metrics over OTLP ------------------------------------------------------------------------


def test_the_genai_metrics_are_exported_over_otlp(
    receiver: OtlpReceiver, engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """``--otlp-metrics-endpoint`` alone (no traces): each engine call's duration, tokens, time to first
    token and time per output token reach the collector as the GenAI conventions name them."""
    flags = (*qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0")
    with node(
        *flags, "--otlp-metrics-endpoint", receiver.endpoint, extra_env={"OTEL_METRIC_EXPORT_INTERVAL": "200"}
    ) as n:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}], "max_tokens": 8}
        for stream in (True, False):
            r = http.post(n.url + "/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        wanted = {
            "gen_ai.client.operation.duration",
            "gen_ai.client.token.usage",
            "gen_ai.server.time_to_first_token",
            "gen_ai.server.time_per_output_token",
        }

        def have_all(points: list[ReceivedPoint]) -> bool:
            return wanted <= {p.name for p in points if p.count >= 2}

        wait_for(lambda: have_all(receiver.metric_points()), "the four GenAI metrics, both calls")
        text = http.get(n.url + "/metrics").text
    points = [p for p in receiver.metric_points() if p.name in wanted]
    tokens = [p for p in points if p.name == "gen_ai.client.token.usage"]
    last = {p.attributes["gen_ai.token.type"]: p for p in tokens}  # cumulative: the latest per type
    assert last["output"].sum == 16 and last["output"].count == 2
    assert last["input"].sum == 2 * usage["prompt_tokens"]
    a = last["output"].attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.provider.name"] == "sglang" and a["server.port"] == engine.grpc_port
    assert {p.unit for p in points if p.name != "gen_ai.client.token.usage"} == {"s"}
    assert 'smg_trace_spans_total{outcome="ended"} 0.0' in text  # no traces: no spans


def test_a_retry_is_a_second_client_span_and_an_event(
    receiver: OtlpReceiver, engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """A worker that fails the call before its first token: its CLIENT span ends with ``error.type``, the
    call retried on the other worker is a second CLIENT span (``shepherd.retry.attempt`` 1), and the
    SERVER span has a ``retry`` event."""
    with start_mock_engine("--zero-latency", "--output-len", "8", "--tokenizer", str(tokenizer_dir)) as bad:
        http.post(bad.http_url + "/mock/faults", json={"error_rate": 1.0}).raise_for_status()
        workers = (f"grpc://127.0.0.1:{bad.grpc_port}", f"grpc://127.0.0.1:{engine.grpc_port}")
        flags = (
            *qwen3_flags(engine, tokenizer_dir),
            *("--worker-urls", *workers),
            *("--tokenizer-workers", "0", "--policy", "round_robin", "--health-failure-threshold", "100"),
        )
        with node(*flags, "--otlp-traces-endpoint", receiver.endpoint) as n:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 4}
            traces = [os.urandom(16).hex() for _ in range(2)]  # round robin: `bad` comes first at least once
            for tid in traces:
                headers = {"traceparent": traceparent(tid, os.urandom(8).hex())}
                r = http.post(n.url + "/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text  # the retry served it
            spans = receiver.wait(
                lambda s: sum(1 for x in s if x.trace_id in traces and x.kind == SERVER) == 2,
                "both requests' SERVER spans",
            )
    retried = [t for t in traces if len([s for s in in_trace(spans, t) if s.kind == CLIENT]) == 2]
    assert retried, [(s.name, s.trace_id) for s in spans if s.trace_id in traces]
    mine = in_trace(spans, retried[0])
    server = one(mine, "POST /v1/chat/completions", SERVER)
    failed, served = sorted(
        (s for s in mine if s.kind == CLIENT), key=lambda s: s.attributes.get("shepherd.retry.attempt", 0)
    )
    assert failed.error and failed.attributes["error.type"]
    assert failed.attributes["server.port"] == bad.grpc_port
    assert served.attributes["shepherd.retry.attempt"] == 1 and not served.error
    assert served.attributes["server.port"] == engine.grpc_port
    assert failed.parent_id == served.parent_id == server.span_id
    assert "retry" in server.events


# ---- PD disaggregation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_pd_makes_a_client_span_per_half_with_its_workers_address(
    kind: str, receiver: OtlpReceiver, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """A PD request (SGLang: both halves at once with a bootstrap room; vLLM: prefill first, its KV
    transfer parameters to decode) is one CLIENT span per engine call under the SERVER span: the prefill
    half's and the decode half's, each with its worker's ``server.address`` / ``server.port`` and
    ``shepherd.pd.role``; each engine received its own span's context; the decode span has the answer."""
    with (
        start_mock_engine("--zero-latency", "--role", "prefill", "--tokenizer", str(tokenizer_dir)) as pre,
        start_mock_engine(
            "--zero-latency", "--role", "decode", "--pd-wait-s", "0.5", "--tokenizer", str(tokenizer_dir)
        ) as dec,
    ):
        flags = (
            *("--pd-disaggregation", "--prefill", f"{kind}://{pre.grpc_target}", str(pre.http_port)),
            *("--decode", f"{kind}://{dec.grpc_target}", "--model-id", MODEL),
            *("--model-path", str(tokenizer_dir), "--chat-template", str(QWEN3_TEMPLATE)),
            *("--tokenizer-workers", "0"),
        )
        trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
        rid = f"req-pd-{kind}"
        with node(*flags, "--otlp-traces-endpoint", receiver.endpoint) as n:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "split me"}],
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            headers = {"traceparent": traceparent(trace_id, client_span), "x-request-id": rid}
            r = http.post(n.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            spans = receiver.wait(
                lambda s: (
                    sum(1 for x in in_trace(s, trace_id) if x.kind == CLIENT) >= 2
                    and any(x.kind == SERVER for x in in_trace(s, trace_id))
                ),
                "the PD request's SERVER span and both CLIENT spans",
            )
        got_p = [
            c for c in engine_contexts(http, pre) if str(c["request_id"]).partition(".")[2].startswith(rid)
        ]
        got_d = [
            c for c in engine_contexts(http, dec) if str(c["request_id"]).partition(".")[2].startswith(rid)
        ]
    mine = in_trace(spans, trace_id)
    server = one(mine, "POST /v1/chat/completions", SERVER)
    calls = {s.attributes["shepherd.pd.role"]: s for s in mine if s.kind == CLIENT}
    assert sorted(calls) == ["decode", "prefill"] and len([s for s in mine if s.kind == CLIENT]) == 2
    for role, eng in (("prefill", pre), ("decode", dec)):
        call = calls[role]
        assert call.name == f"chat {MODEL}" and call.parent_id == server.span_id
        assert call.attributes["gen_ai.provider.name"] == kind
        assert call.attributes["server.address"] == "127.0.0.1"
        assert call.attributes["server.port"] == eng.grpc_port
        assert not call.error
    decode = calls["decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == 6
    assert decode["gen_ai.response.finish_reasons"] == ["length"]
    assert decode["gen_ai.response.time_to_first_chunk"] >= 0
    if kind == "vllm":  # the prefill half is asked for one token
        assert calls["prefill"].attributes["gen_ai.request.max_tokens"] == 1
    assert server.event_attributes["route"]["shepherd.route.worker"] == f"{kind}://{dec.grpc_target}"
    # each engine got the context of its own half's span
    assert got_p and got_p[-1]["traceparent"] == traceparent(trace_id, calls["prefill"].span_id)
    assert got_d and got_d[-1]["traceparent"] == traceparent(trace_id, calls["decode"].span_id)
