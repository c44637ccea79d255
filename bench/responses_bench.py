"""What a stored Responses follow-up costs next to the same conversation sent as chat completions.

For each history backend it starts a zero-latency mock engine and one node (``--history-backend``),
builds a ``previous_response_id`` chain of T-1 turns, then sends K follow-ups on its last response
(branches of the same chain: each one rebuilds the whole T-turn history from storage and stores a new
response) and K chat completions carrying the same T turns as messages. It prints, per backend and
chain length: client latency p50/p99 (ms), node CPU ms per request (the node's process tree, from
/proc, over the K requests), the difference, and the storage writes per response (the node's
``smg_history_ops_total{kind="writes"}``). With ``--mesh`` it also starts a second node meshed with
the first (each on its own SQLite file) and sends the follow-ups of a chain stored on node A to node
B: the latency difference against the same follow-ups on A is the cross-node fetch (p50/p99).

PostgreSQL and Redis come from ``tests/services.py`` (installed from Debian packages when missing,
started on private ports and directories, stopped by pid).

    .venv/bin/python bench/responses_bench.py                                  # all backends, T=10,50
    .venv/bin/python bench/responses_bench.py --backends memory,sqlite --turns 10 --followups 50
    .venv/bin/python bench/responses_bench.py --backends sqlite --mesh

Prints figures only; no asserts on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shepherd.loadgen.procs import ProcessGroup, free_port  # noqa: E402
from shepherd.loadgen.procstat import TreeCpuTracker  # noqa: E402
from shepherd.loadgen.targets import extract_tokenizer, mock_engine_spec, node_spec  # noqa: E402

MODEL = "qwen3"
MAX_OUT = 16


class Client:
    """One keep-alive HTTP/1.1 connection to a node."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read()
        dt = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {raw[:300]!r}")
        out: dict[str, Any] = json.loads(raw)
        return dt, out

    def metric(self, name: str, label: str = "") -> float | None:
        """The sum of the samples of ``name`` whose labels hold ``label`` (None: no such sample)."""
        self.conn.request("GET", "/metrics")
        resp = self.conn.getresponse()
        text = resp.read().decode()
        total = None
        for line in text.splitlines():
            if line.startswith(name) and label in line:
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        self.conn.close()


def _text_of(resp: dict[str, Any]) -> str:
    for item in resp.get("output", []):
        if item.get("type") == "message":
            return "".join(p.get("text", "") for p in item.get("content", []))
    return ""


def _user(turn: int) -> str:
    return f"Turn {turn}: tell me one more fact about the history of the number {turn * 7}."


def build_chain(c: Client, turns: int) -> tuple[str, list[dict[str, str]]]:
    """A chain of ``turns`` responses; its last id and the same history as chat messages."""
    prev: str | None = None
    messages: list[dict[str, str]] = []
    for t in range(turns):
        body: dict[str, Any] = {"model": MODEL, "input": _user(t), "max_output_tokens": MAX_OUT}
        if prev is not None:
            body["previous_response_id"] = prev
        _, r = c.post("/v1/responses", body)
        prev = str(r["id"])
        messages += [{"role": "user", "content": _user(t)}, {"role": "assistant", "content": _text_of(r)}]
    assert prev is not None
    return prev, messages


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def measure(c: Client, node_pid: int, requests: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    tracker = TreeCpuTracker(node_pid)
    cpu0 = tracker.sample(with_rss=False).cpu_seconds
    lat = [c.post(path, body)[0] for path, body in requests]
    cpu1 = tracker.sample(with_rss=False).cpu_seconds
    return {
        "p50": _pct(lat, 0.5),
        "p99": _pct(lat, 0.99),
        "mean": statistics.fmean(lat) * 1000,
        "cpu_ms": (cpu1 - cpu0) * 1000 / len(requests),
    }


def followups(prev: str, turns: int, k: int) -> list[tuple[str, dict[str, Any]]]:
    body = {"model": MODEL, "input": _user(turns), "max_output_tokens": MAX_OUT, "previous_response_id": prev}
    return [("/v1/responses", dict(body)) for _ in range(k)]


def chats(messages: list[dict[str, str]], turns: int, k: int) -> list[tuple[str, dict[str, Any]]]:
    body = {
        "model": MODEL,
        "messages": [*messages, {"role": "user", "content": _user(turns)}],
        "max_tokens": MAX_OUT,
    }
    return [("/v1/chat/completions", dict(body)) for _ in range(k)]


@contextlib.contextmanager
def backend_url(backend: str, work: Path) -> Iterator[str | None]:
    """The ``--history-url`` of a backend (PostgreSQL and Redis started for the run, stopped after)."""
    if backend == "memory":
        yield None
    elif backend == "sqlite":
        yield f"sqlite:///{work / 'history.db'}"
    else:
        from tests import services  # not at the top: only the server backends need it

        services.install()
        service = services.postgres_service() if backend == "postgres" else services.redis_service()
        with service as svc:
            yield svc.url


def _row(label: str, m: dict[str, float]) -> str:
    return f"  {label:<26} p50 {m['p50']:7.2f} ms  p99 {m['p99']:7.2f} ms  node CPU {m['cpu_ms']:6.2f} ms/req"


def run_backend(backend: str, turns: list[int], k: int, model_dir: Path, work: Path) -> None:
    with backend_url(backend, work) as url, ProcessGroup(work / f"logs-{backend}") as procs:
        gport, hport, port = free_port(), free_port(), free_port()
        procs.start(mock_engine_spec(gport, hport, cpus=None, tokenizer_dir=model_dir))
        extra = ["--model-id", MODEL, "--history-backend", backend, "--tokenizer-workers", "0"]
        if url is not None:
            extra += ["--history-url", url]
        node = procs.start(node_spec(port, gport, model_dir, cpus=None, extra=tuple(extra)))
        c = Client(port)
        try:
            for t in turns:
                prev, messages = build_chain(c, t - 1)
                c.post("/v1/responses", followups(prev, t - 1, 1)[0][1])  # warm the caches once
                c.post("/v1/chat/completions", chats(messages, t - 1, 1)[0][1])
                w0 = c.metric("smg_history_ops_total", 'kind="writes"')
                r = measure(c, node.pid, followups(prev, t - 1, k))
                w1 = c.metric("smg_history_ops_total", 'kind="writes"')
                ch = measure(c, node.pid, chats(messages, t - 1, k))
                writes = f"{(w1 - w0) / k:.1f}" if w0 is not None and w1 is not None else "n/a"
                print(f"{backend}, {t}-turn chain, {k} follow-ups each:")
                print(_row("responses follow-up", r))
                print(_row("chat completions", ch))
                print(
                    f"  {'added by responses':<26} p50 {r['p50'] - ch['p50']:+7.2f} ms  "
                    f"p99 {r['p99'] - ch['p99']:+7.2f} ms  node CPU {r['cpu_ms'] - ch['cpu_ms']:+6.2f} ms/req"
                    f"  storage writes/response {writes}",
                    flush=True,
                )
        finally:
            c.close()


def run_mesh(k: int, model_dir: Path, work: Path) -> None:
    pki = work / "pki"
    with ProcessGroup(work / "logs-mesh") as procs:
        gport, hport = free_port(), free_port()
        procs.start(mock_engine_spec(gport, hport, cpus=None, tokenizer_dir=model_dir))
        ports, nodes = [], []
        mesh_ports = [free_port(), free_port()]
        for i in range(2):
            port = free_port()
            extra = [
                "--model-id",
                MODEL,
                "--history-backend",
                "sqlite",
                "--history-url",
                f"sqlite:///{work / f'node{i}.db'}",
                "--tokenizer-workers",
                "0",
                "--mesh-port",
                str(mesh_ports[i]),
                "--mesh-name",
                f"bench-{i}",
                "--mesh-dev-pki",
                str(pki),
            ]
            if i == 1:
                extra += ["--mesh-seeds", f"127.0.0.1:{mesh_ports[0]}"]
            nodes.append(procs.start(node_spec(port, gport, model_dir, cpus=None, extra=tuple(extra))))
            ports.append(port)
        a, b = Client(ports[0]), Client(ports[1])
        try:
            for _ in range(100):  # bounded: until B lists A as alive
                b.conn.request("GET", "/mesh/members")
                resp = b.conn.getresponse()
                body = resp.read()
                if resp.status == 200 and body.count(b'"alive"') >= 2:
                    break
                time.sleep(0.1)
            prev, _ = build_chain(a, 9)
            a.post("/v1/responses", followups(prev, 9, 1)[0][1])
            b.post("/v1/responses", followups(prev, 9, 1)[0][1])
            on_a = measure(a, nodes[0].pid, followups(prev, 9, k))
            on_b = measure(b, nodes[1].pid, followups(prev, 9, k))
            print(f"sqlite mesh of 2, 10-turn chain stored on A, {k} follow-ups each:")
            print(_row("follow-up on the owner A", on_a))
            print(_row("follow-up on B (fetch)", on_b))
            print(
                f"  {'cross-node fetch':<26} p50 {on_b['p50'] - on_a['p50']:+7.2f} ms  "
                f"p99 {on_b['p99'] - on_a['p99']:+7.2f} ms",
                flush=True,
            )
        finally:
            a.close()
            b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="memory,sqlite,postgres,redis")
    ap.add_argument("--turns", default="10,50", help="chain lengths (the follow-up is turn T)")
    ap.add_argument("--followups", type=int, default=100, help="K: measured requests per case")
    ap.add_argument("--mesh", action="store_true", help="also the cross-node fetch (2 nodes, SQLite)")
    args = ap.parse_args()
    turns = [int(t) for t in args.turns.split(",")]
    with tempfile.TemporaryDirectory(prefix="smg-responses-bench-") as tmp:
        work = Path(tmp)
        model_dir = extract_tokenizer(work / "model")
        print(f"responses_bench {time.strftime('%Y-%m-%d %H:%M')}, max_output_tokens {MAX_OUT}", flush=True)
        for backend in args.backends.split(","):
            run_backend(backend.strip(), turns, args.followups, model_dir, work)
        if args.mesh:
            run_mesh(args.followups, model_dir, work)


if __name__ == "__main__":
    main()
