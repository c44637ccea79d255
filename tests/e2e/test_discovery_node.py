"""Kubernetes discovery end to end: real ``smg-node`` processes find mock engines as pods of a local API
server stand-in (tests/kube_standin.py; each pod's IP 127.0.0.1, its engine's gRPC port in the
``smg.ai/worker-ports`` annotation) through ``$KUBECONFIG``, and route to them; readiness flips and
deletions take them out. In a 2-node mesh only one node runs discovery and the other routes to the
discovered workers too (the registry replicates them)."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from shepherd.auth.certs import write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.proto.engine_types import worker_id
from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, http_status, reserved_port, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_mesh_cluster import mesh_flags, request, wait_for
from tests.kube_standin import KubeApiStandIn, make_pod

tokenizer_dir = node_fixtures.tokenizer_dir
MODEL = "qwen3"
LABELS = {"app": "engine", "tier": "gpu"}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[MockEngineProc]]:
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(start_mock_engine, "--zero-latency") for _ in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) != 2:
            raise RuntimeError("a mock engine did not start")
        yield started
    finally:
        for e in started:
            e.stop()


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApiStandIn]:
    """The stand-in, and ``$KUBECONFIG`` pointing at it for the nodes this test spawns."""
    with KubeApiStandIn() as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig", namespace="ml")))
        yield server


def engine_pod(name: str, engine: MockEngineProc, *, ready: bool = True) -> dict[str, Any]:
    port = engine.grpc_target.rpartition(":")[2]
    return make_pod(
        name, namespace="ml", labels=LABELS, annotations={"smg.ai/worker-ports": port}, ready=ready
    )


def node_flags(tokenizer_dir: Path) -> list[str]:
    return [
        "--model-id", MODEL, "--model-path", str(tokenizer_dir), "--chat-template", str(QWEN3_TEMPLATE),
        "--tokenizer-workers", "0", "--health-check-interval-secs", "1", "--no-kv-events",
    ]  # fmt: skip


DISCOVERY = [
    "--service-discovery",
    "--selector",
    "app=engine",
    "tier=gpu",
    "--service-discovery-namespace",
    "ml",
]


def up(node: NodeProc) -> None:
    wait_for(
        lambda: node.proc.poll() is not None or http_status(node.url + "/liveness") == 200, "node up", 90
    )
    if node.proc.poll() is not None:
        raise RuntimeError(f"node exited:\n{node.log()}")


def workers(node: NodeProc) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in request(node.url + "/workers")["workers"]}


def received(engine: MockEngineProc) -> int:
    n: int = request(engine.http_url + "/mock/stats")["requests_received"]
    return n


def chat(node: NodeProc, text: str, target: str | None = None) -> str:
    """One chat completion; its finish reason (the mock engine's text may decode to nothing)."""
    headers = {"x-smg-target-worker": worker_id(target)} if target else None
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    r = request(node.url + "/v1/chat/completions", body, headers=headers)
    reason: str = r["choices"][0]["finish_reason"]
    return reason


def stop_all(nodes: list[NodeProc]) -> None:
    for n in nodes:
        n.stop(signal.SIGKILL if n.proc.poll() is None else signal.SIGTERM, timeout=10)


def test_a_node_routes_to_the_pods_it_discovers(
    api: KubeApiStandIn, engines: list[MockEngineProc], tokenizer_dir: Path
) -> None:
    e0, e1 = engines
    u0, u1 = (f"grpc://{e.grpc_target}" for e in engines)
    api.put_pod(engine_pod("engine-0", e0))
    api.put_pod(engine_pod("engine-1", e1, ready=False))  # not ready: not a worker yet
    api.put_pod(make_pod("db-0", namespace="ml", labels={"app": "db"}))  # not selected
    node = spawn_node("serve", *node_flags(tokenizer_dir), *DISCOVERY, port=reserved_port())
    try:
        up(node)
        wait_for(lambda: workers(node) == {u0: True}, "engine-0 discovered and healthy")
        wait_for(lambda: http_status(node.url + "/readiness") == 200, "ready")  # 503 until then
        before = received(e0)
        assert chat(node, "hello pod") in ("length", "stop")
        assert received(e0) == before + 1
        # engine-1 turns ready: added; engine-0 turns unready: removed at once (not after health checks)
        api.put_pod(engine_pod("engine-1", e1))
        wait_for(lambda: workers(node).get(u1) is True, "engine-1 added when ready")
        api.put_pod(engine_pod("engine-0", e0, ready=False))
        wait_for(lambda: u0 not in workers(node), "engine-0 removed when unready")
        before = received(e1)
        assert chat(node, "only engine 1 now") in ("length", "stop")
        assert received(e1) == before + 1
        # deleted: gone; the watch was one stream all along (no relist, no error)
        api.delete_pod("engine-1", namespace="ml")
        wait_for(lambda: workers(node) == {}, "engine-1 removed when deleted")
        assert (
            len(api.list_requests()) == 1 and api.list_requests()[0]["labelSelector"] == "app=engine,tier=gpu"
        )
        # counted once the registry's remove returned: the worker list can show it gone a moment before
        wait_for(
            lambda: (
                'smg_discovery_events_total{event="removed"} 2.0'
                in urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
            ),
            "both removals counted",
        )
        metrics = urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
        assert 'smg_discovery_events_total{event="added"} 2.0' in metrics
        # the API server drops the watch: the node resumes it from the last version and keeps up
        assert api.drop_watches() == 1
        api.put_pod(engine_pod("engine-0", e0))
        wait_for(lambda: workers(node) == {u0: True}, "engine-0 back after the dropped watch")
        assert len(api.list_requests()) == 1
    finally:
        stop_all([node])
    assert "Kubernetes discovery: pods in namespace 'ml'" in node.log()


def test_in_a_mesh_one_discovering_node_is_enough(
    api: KubeApiStandIn, engines: list[MockEngineProc], tokenizer_dir: Path, tmp_path: Path
) -> None:
    e0, _ = engines
    u0 = f"grpc://{e0.grpc_target}"
    files = write_dev_pki(tmp_path / "pki", ["a", "b"])
    keyring = tmp_path / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    ports = {n: reserved_port() for n in ("a", "b")}
    nodes: list[NodeProc] = []
    try:
        a_flags = [*node_flags(tokenizer_dir), *mesh_flags("a", ports["a"], files["a"], keyring), *DISCOVERY]
        nodes.append(spawn_node("serve", *a_flags, port=reserved_port()))
        # b runs no discovery, and has no API server to ask: only the mesh tells it of workers
        env_kube = os.environ.pop("KUBECONFIG")
        try:
            b_flags = [*node_flags(tokenizer_dir), *mesh_flags("b", ports["b"], files["b"], keyring)]
            nodes.append(spawn_node("join", f"127.0.0.1:{ports['a']}", *b_flags, port=reserved_port()))
        finally:
            os.environ["KUBECONFIG"] = env_kube
        a, b = nodes
        up(a)
        up(b)
        wait_for(lambda: len(request(b.url + "/mesh/members")["members"]) == 2, "b joined a")
        api.put_pod(engine_pod("engine-0", e0))
        wait_for(lambda: workers(a).get(u0) is True, "a discovered engine-0")
        wait_for(lambda: workers(b).get(u0) is True, "b learned engine-0 through the mesh")
        before = received(e0)
        assert chat(b, "through the node that does not watch pods", target=u0) in ("length", "stop")
        assert received(e0) == before + 1
        api.delete_pod("engine-0", namespace="ml")
        wait_for(lambda: u0 not in workers(b), "b dropped engine-0 when its pod was deleted")
        assert "Kubernetes discovery" not in b.log()
    finally:
        stop_all(nodes)


@pytest.fixture(scope="module")
def pd_engines() -> Iterator[list[MockEngineProc]]:
    """A prefill-role and a decode-role mock engine (as in tests/e2e/test_node_pd.py)."""
    with ThreadPoolExecutor(2) as ex:
        futures = [
            ex.submit(start_mock_engine, "--zero-latency", "--role", "prefill"),
            ex.submit(start_mock_engine, "--zero-latency", "--role", "decode", "--pd-wait-s", "0.5"),
        ]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) != 2:
            raise RuntimeError("a PD mock engine did not start")
        yield started
    finally:
        for e in started:
            e.stop()


def test_pd_pools_from_prefill_and_decode_selectors(
    api: KubeApiStandIn, pd_engines: list[MockEngineProc], tokenizer_dir: Path
) -> None:
    prefill, decode = pd_engines
    pre_port, dec_port = (e.grpc_target.rpartition(":")[2] for e in pd_engines)
    # the prefill pod's bootstrap port in SGLang's annotation (the mock's bootstrap server: its HTTP port)
    api.put_pod(
        make_pod(
            "prefill-0",
            namespace="ml",
            labels={"app": "engine", "role": "prefill"},
            annotations={"smg.ai/worker-ports": pre_port, "sglang.ai/bootstrap-port": str(prefill.http_port)},
        )
    )
    api.put_pod(
        make_pod(
            "decode-0",
            namespace="ml",
            labels={"app": "engine", "role": "decode"},
            annotations={"smg.ai/worker-ports": dec_port},
        )
    )
    flags = [
        "--pd-disaggregation", "--service-discovery", "--service-discovery-namespace", "ml",
        "--service-discovery-protocol", "sglang",
        "--prefill-selector", "app=engine", "role=prefill", "--decode-selector", "app=engine", "role=decode",
    ]  # fmt: skip
    node = spawn_node("serve", *node_flags(tokenizer_dir), *flags, port=reserved_port())
    try:
        up(node)
        wait_for(lambda: len([h for h in workers(node).values() if h]) == 2, "both PD workers healthy")
        before = request(decode.http_url + "/mock/stats")["disaggregated_requests"]
        assert chat(node, "disaggregated through discovery") in ("length", "stop")
        sd = request(decode.http_url + "/mock/stats")
        assert sd["disaggregated_requests"] == before + 1
        assert sd["last_disaggregated_params"]["bootstrap_port"] == prefill.http_port
        # the prefill pod goes: no pair left, the node says so instead of sending a half request
        api.delete_pod("prefill-0", namespace="ml")
        wait_for(lambda: len(workers(node)) == 1, "prefill worker removed")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = urllib.request.Request(
            node.url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(r, timeout=30)
        assert e.value.code == 503
    finally:
        stop_all([node])
