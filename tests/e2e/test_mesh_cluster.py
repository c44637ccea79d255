"""End to end: a mesh of 3 real ``smg-node`` processes on loopback sharing 2 mock engines.

A starts with engine 1 (``serve --mesh-port``); B joins through A, C through B and A (``smg-node
join``). Security as in production: a CA, node certificates and a key file made in a temp dir and
passed with ``--mesh-cert/--mesh-key/--mesh-ca/--mesh-keyring-file``. Short SWIM intervals so that a
crash is detected in a second or two. No KV events (``--no-kv-events``): what a node knows of the
engines' caches comes from the routing decisions, its own and the others' through the mesh. Every
wait is a bounded poll; the tests run in file order on one cluster (the last one kills a node), and
every process is stopped by its pid, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shepherd.auth.certs import TlsFiles, write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.proto.engine_types import worker_id
from tests.e2e.node_procs import NodeProc, http_status, reserved_port, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

pytestmark = pytest.mark.timeout(180)

MODEL = "qwen3"
NAMES = ("a", "b", "c")
FAST = (
    "--mesh-probe-interval",
    "0.25",
    "--mesh-gossip-interval",
    "0.05",
    "--mesh-push-pull-interval",
    "3",
)


def request(
    url: str, body: Any = None, method: str | None = None, headers: dict[str, str] | None = None
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"content-type": "application/json", **(headers or {})}, method=method
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (the deadline only guards against a hang: nothing is timed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


@dataclass
class Cluster:
    nodes: dict[str, NodeProc]
    mesh_ports: dict[str, int]
    engines: list[MockEngineProc]

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def members(self, name: str) -> dict[str, str]:
        rows = request(self.url(name) + "/mesh/members")["members"]
        return {m["name"]: m["state"] for m in rows}

    def worker_urls(self, name: str) -> set[str]:
        return {w["url"] for w in request(self.url(name) + "/workers")["workers"]}

    def engine_url(self, i: int) -> str:
        return f"grpc://{self.engines[i].grpc_target}"

    def alive(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.proc.poll() is None]


def mesh_flags(name: str, mesh_port: int, tls: TlsFiles, keyring: Path) -> list[str]:
    """A mesh node's own flags: its mesh port and name, its certificate, the CA and key file, and the
    short SWIM intervals (``FAST``)."""
    return [
        "--mesh-port", str(mesh_port), "--mesh-name", name,
        "--mesh-cert", str(tls.cert), "--mesh-key", str(tls.key), "--mesh-ca", str(tls.ca),
        "--mesh-keyring-file", str(keyring), *FAST,
    ]  # fmt: skip


def spawn(command: str, *args: str, port: int) -> NodeProc:
    return spawn_node(command, *args, port=port, log_prefix="smg-mesh-node-")


def mesh_pki(
    tmp_path_factory: pytest.TempPathFactory, names: tuple[str, ...]
) -> tuple[dict[str, TlsFiles], Path]:
    """A dev CA with a certificate for each of ``names``, and a key file with one fresh key."""
    pki = tmp_path_factory.mktemp("mesh-pki")
    files = write_dev_pki(pki, names)
    keyring = pki / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    return files, keyring


def start_engines(engines: list[MockEngineProc], n: int) -> None:
    """Start ``n`` zero-latency mock engines side by side, each added to ``engines`` (which its owner
    stops) as soon as it is up."""
    with ThreadPoolExecutor(n) as ex:
        futures = [ex.submit(start_mock_engine, "--zero-latency") for _ in range(n)]
        engines.extend(f.result() for f in futures)


def wait_nodes_up(nodes: dict[str, NodeProc], path: str = "/liveness") -> None:
    """Wait until each node answers ``path`` with 200; a node that exits meanwhile fails with its log."""
    for name, node in nodes.items():
        wait_for(
            lambda node=node: node.proc.poll() is not None or http_status(node.url + path) == 200,  # type: ignore[misc]
            f"node {name} up",
            timeout=90,
        )
        if node.proc.poll() is not None:
            raise RuntimeError(f"node {name} exited:\n{node.log()}")


@contextlib.contextmanager
def cluster_procs(names: tuple[str, ...]) -> Iterator[Cluster]:
    """An empty ``Cluster`` with a reserved mesh port per name: the caller starts its engines and nodes
    into it; on exit every one of them is stopped by its pid, also on failure."""
    cluster = Cluster({}, {n: reserved_port() for n in names}, [])
    try:
        yield cluster
    finally:
        for node in cluster.nodes.values():
            node.stop(signal.SIGKILL if node.proc.poll() is None else signal.SIGTERM, timeout=10)
        for e in cluster.engines:
            e.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    files, keyring = mesh_pki(tmp_path_factory, NAMES)
    with cluster_procs(NAMES) as c:
        nodes, mesh_ports = c.nodes, c.mesh_ports

        def flags(name: str) -> list[str]:
            return [
                "--model-id", MODEL, "--policy", "cache_aware", "--tokenizer-workers", "0",
                "--health-check-interval-secs", "1", "--no-kv-events",
                *mesh_flags(name, mesh_ports[name], files[name], keyring),
            ]  # fmt: skip

        seed = f"127.0.0.1:{mesh_ports['a']}"
        # b and c start at once (their seeds are retried until a answers), the engines beside them
        nodes["b"] = spawn("join", seed, *flags("b"), port=reserved_port())
        nodes["c"] = spawn("join", f"127.0.0.1:{mesh_ports['b']}", seed, *flags("c"), port=reserved_port())
        start_engines(c.engines, 2)
        e1 = f"grpc://{c.engines[0].grpc_target}"
        nodes["a"] = spawn("serve", *flags("a"), "--worker-urls", e1, port=reserved_port())
        wait_nodes_up(nodes)
        yield c


def test_nodes_join_and_learn_the_workers(cluster: Cluster) -> None:
    for name in NAMES:
        wait_for(lambda name=name: cluster.members(name) == dict.fromkeys(NAMES, "alive"), f"{name}: 3 alive")  # type: ignore[misc]
    e1 = cluster.engine_url(0)
    for name in NAMES:
        wait_for(lambda name=name: cluster.worker_urls(name) == {e1}, f"{name} lists engine 1")  # type: ignore[misc]
    st = request(cluster.url("c") + "/mesh/state")
    assert st["node"] == "c" and st["members"]["alive"] == 3
    (w,) = st["workers"]
    assert (w["url"], w["owner"], w["local"]) == (e1, "a", True)
    # (503 until c has seen the worker healthy: the probe answers, the loop waits)
    wait_for(lambda: http_status(cluster.url("c") + "/readiness") == 200, "c ready")
    metrics = urllib.request.urlopen(cluster.url("c") + "/metrics", timeout=10).read().decode()
    assert 'smg_mesh_members{state="alive"} 3.0' in metrics
    assert "smg_mesh_gossip_bytes_total" in metrics


def test_worker_registered_on_a_serves_through_c(cluster: Cluster) -> None:
    e2 = cluster.engine_url(1)
    request(cluster.url("a") + "/workers", {"url": e2, "model_id": MODEL})
    wait_for(lambda: e2 in cluster.worker_urls("c"), "c lists engine 2")
    before = request(cluster.engines[1].http_url + "/mock/stats")["requests_received"]
    wait_for(
        lambda: any(
            w["url"] == e2 and w["healthy"] for w in request(cluster.url("c") + "/workers")["workers"]
        ),
        "engine 2 healthy on c",
    )
    r = request(
        cluster.url("c") + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hello through c"}], "max_tokens": 4},
        headers={"x-smg-target-worker": worker_id(e2)},
    )
    assert r["choices"][0]["message"]["content"]
    assert request(cluster.engines[1].http_url + "/mock/stats")["requests_received"] == before + 1


def served_by(cluster: Cluster, send: Callable[[], Any]) -> tuple[int, Any]:
    """Run one request (nothing else runs meanwhile) and tell which engine served it."""
    before = [request(e.http_url + "/mock/stats")["requests_received"] for e in cluster.engines]
    out = send()
    after = [request(e.http_url + "/mock/stats")["requests_received"] for e in cluster.engines]
    (engine,) = [k for k, (x, y) in enumerate(zip(before, after, strict=True)) if y > x]
    return engine, out


def test_follow_up_turn_on_another_node_hits_its_prefix(cluster: Cluster) -> None:
    e2 = cluster.engine_url(1)
    for name in NAMES:
        wait_for(lambda name=name: e2 in cluster.worker_urls(name), f"{name} lists engine 2")  # type: ignore[misc]
    # every node's index holds every node's routing decisions (no KV events: only the mesh tells them)
    follow_ups_hit_on_another_node(cluster, NAMES, 6)


@contextlib.contextmanager
def index_pair(
    tmp_path_factory: pytest.TempPathFactory,
    *flags: str,
    log_prefix: str,
    worker_urls: Sequence[str] = (),
) -> Iterator[Cluster]:
    """Two nodes ``a`` and ``b`` meshed on loopback (production security), ``cache_aware`` over two mock
    engines (or ``worker_urls``, the caller's), with ``flags`` (the index replication under test); every
    process stopped by its pid."""
    names = ("a", "b")
    files, keyring = mesh_pki(tmp_path_factory, names)
    with cluster_procs(names) as c:
        if not worker_urls:
            start_engines(c.engines, 2)
        urls = list(worker_urls) or [c.engine_url(i) for i in range(2)]

        def node_flags(name: str) -> list[str]:
            return [
                "--model-id", MODEL, "--policy", "cache_aware", "--tokenizer-workers", "0",
                "--health-check-interval-secs", "1", *flags,
                "--worker-urls", *urls, *mesh_flags(name, c.mesh_ports[name], files[name], keyring),
            ]  # fmt: skip

        c.nodes["a"] = spawn_node("serve", *node_flags("a"), port=reserved_port(), log_prefix=log_prefix)
        seed = f"127.0.0.1:{c.mesh_ports['a']}"
        c.nodes["b"] = spawn_node("join", seed, *node_flags("b"), port=reserved_port(), log_prefix=log_prefix)
        wait_nodes_up(c.nodes)
        yield c


def follow_ups_hit_on_another_node(
    cluster: Cluster, names: tuple[str, ...], conversations: int, held: str = "blocks"
) -> None:
    """Conversation i's first turn goes to node ``names[i % len(names)]``; once every node's index holds
    all the first turns (``held``: their blocks, or ``turn_ends``: one for each first turn another node
    served), its follow-up, sent to the next node, goes to the engine that served the first turn and hits
    its cache."""
    convs = []
    for i in range(conversations):
        system = {"role": "system", "content": f"Conversation {i}. " + "You answer in detail. " * 40}
        msgs = [system, {"role": "user", "content": f"Question {i}: " + "tell me more " * 20}]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 8}
        url = cluster.url(names[i % len(names)]) + "/v1/chat/completions"
        engine, r = served_by(cluster, lambda url=url, body=body: request(url, body))  # type: ignore[misc]
        convs.append((i, msgs, r, engine))
    for name in names:
        if held == "blocks":
            need = sum(r["usage"]["prompt_tokens"] // 16 for _, _, r, _ in convs)
        else:
            need = sum(names[i % len(names)] != name for i, _, _, _ in convs)
        wait_for(
            lambda name=name, need=need: (
                request(cluster.url(name) + "/mesh/state")["index"][MODEL][held] >= need
            ),  # type: ignore[misc]
            f"{name}'s index",
        )
    for i, msgs, r, engine in convs:
        follow = [*msgs, r["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        body = {"model": MODEL, "messages": follow, "max_tokens": 8}
        url = cluster.url(names[(i + 1) % len(names)]) + "/v1/chat/completions"  # not the first turn's node
        engine2, r2 = served_by(cluster, lambda url=url, body=body: request(url, body))  # type: ignore[misc]
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert engine2 == engine, (i, engine, engine2)
        assert cached >= (r["usage"]["prompt_tokens"] // 16) * 16, (i, cached, r["usage"])


def test_removed_anywhere_is_removed_everywhere(cluster: Cluster) -> None:
    extra = "grpc://127.0.0.1:9"  # nothing listens there: registered, never healthy
    request(cluster.url("b") + "/workers", {"url": extra, "model_id": MODEL})
    for name in NAMES:
        wait_for(lambda name=name: extra in cluster.worker_urls(name), f"{name} lists the extra worker")  # type: ignore[misc]
    request(cluster.url("c") + f"/workers/{worker_id(extra)}", method="DELETE")
    for name in NAMES:
        wait_for(lambda name=name: extra not in cluster.worker_urls(name), f"{name} dropped it")  # type: ignore[misc]


def test_killed_node_is_detected_and_its_workers_cleaned_up(cluster: Cluster) -> None:
    extra = "grpc://127.0.0.1:7"  # owned by b (registered through it)
    request(cluster.url("b") + "/workers", {"url": extra, "model_id": MODEL})
    for name in ("a", "c"):
        wait_for(lambda name=name: extra in cluster.worker_urls(name), f"{name} lists b's worker")  # type: ignore[misc]
    cluster.nodes["b"].stop(signal.SIGKILL)
    for name in ("a", "c"):
        wait_for(lambda name=name: cluster.members(name).get("b") == "dead", f"{name} sees b dead")  # type: ignore[misc]
        wait_for(lambda name=name: extra not in cluster.worker_urls(name), f"{name} dropped b's worker")  # type: ignore[misc]
    # the workers a owns stay; the survivors still serve
    assert cluster.engine_url(0) in cluster.worker_urls("c")
    r = request(
        cluster.url("c") + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4},
    )
    assert r["choices"][0]["message"]["content"]
