"""Embeddings throughput: the node's /v1/embeddings (gRPC Embed, and relayed to an HTTP worker) next to
the mock engine's own HTTP /v1/embeddings, in one run.

It starts a zero-latency mock engine (``--embedding-model``) and two nodes: one with the engine's gRPC
service as its worker (Embed), one with the engine's HTTP surface (relay). For each batch size B it
sends R requests of B short texts from C client threads (keep-alive HTTP/1.1 connections) to each
target, and prints inputs/s, request latency p50/p99 and, for the nodes, node CPU per input (the
node's process tree, from /proc, over the measured requests).

    .venv/bin/python bench/embeddings_bench.py                       # B=1,32; R=400; C=8
    .venv/bin/python bench/embeddings_bench.py --batch 1,8,64 --requests 1000 --clients 16

Prints figures only; no asserts on speed. The client threads share one Python process: at high rates
the client, not the node, may be the limit (compare the targets, not the absolute numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shepherd.loadgen.procs import ProcessGroup, free_port  # noqa: E402
from shepherd.loadgen.procstat import TreeCpuTracker  # noqa: E402
from shepherd.loadgen.targets import extract_tokenizer, mock_engine_spec, node_spec  # noqa: E402

MODEL = "qwen3"


def _texts(b: int, salt: int) -> list[str]:
    return [f"Embedding input {salt}-{i}: a short sentence about the number {i * 7}." for i in range(b)]


def _worker(port: int, bodies: list[bytes], lat: list[float], errors: list[str]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        for data in bodies:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/embeddings", body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            lat.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors.append(f"{resp.status}: {raw[:200]!r}")
                return
    finally:
        conn.close()


def run(port: int, pid: int | None, batch: int, requests: int, clients: int) -> dict[str, float]:
    """R requests of ``batch`` texts from ``clients`` threads; inputs/s, latency, CPU ms per input."""
    bodies = [
        json.dumps({"model": MODEL, "input": _texts(batch, r), "encoding_format": "base64"}).encode()
        for r in range(requests)
    ]
    warm: list[float] = []
    errors: list[str] = []
    _worker(port, bodies[: min(20, requests)], warm, errors)  # warm caches and connections
    lats: list[list[float]] = [[] for _ in range(clients)]
    threads = [
        threading.Thread(target=_worker, args=(port, bodies[i::clients], lats[i], errors))
        for i in range(clients)
    ]
    tracker = TreeCpuTracker(pid) if pid is not None else None
    cpu0 = tracker.sample(with_rss=False).cpu_seconds if tracker else 0.0
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = tracker.sample(with_rss=False).cpu_seconds if tracker else 0.0
    if errors:
        raise RuntimeError(f"port {port}: {errors[0]}")
    lat = sorted(x for xs in lats for x in xs)
    inputs = requests * batch
    return {
        "inputs_s": inputs / wall,
        "p50": lat[len(lat) // 2] * 1000,
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
        "cpu_us": (cpu1 - cpu0) * 1e6 / inputs if tracker else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,32", help="inputs per request")
    ap.add_argument("--requests", type=int, default=400, help="R: measured requests per target and batch")
    ap.add_argument("--clients", type=int, default=8, help="C: client threads")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="smg-embeddings-bench-") as tmp:
        work = Path(tmp)
        model_dir = extract_tokenizer(work / "model")
        with ProcessGroup(work / "logs") as procs:
            gport, hport = free_port(), free_port()
            spec = mock_engine_spec(gport, hport, cpus=None, tokenizer_dir=model_dir)
            procs.start(dataclasses.replace(spec, argv=(*spec.argv, "--embedding-model")))
            common = ("--model-id", MODEL, "--tokenizer-workers", "0")
            grpc_port, relay_port = free_port(), free_port()
            grpc_node = procs.start(node_spec(grpc_port, gport, model_dir, cpus=None, extra=common))
            relay_extra = (*common, "--worker-urls", f"http://127.0.0.1:{hport}")
            relay_node = procs.start(node_spec(relay_port, gport, model_dir, cpus=None, extra=relay_extra))
            print(
                f"embeddings_bench {time.strftime('%Y-%m-%d %H:%M')}: R={args.requests} requests per case, "
                f"C={args.clients} client threads, zero-latency mock, 64-float vectors, base64",
                flush=True,
            )
            targets: list[tuple[str, int, Any]] = [
                ("mock HTTP /v1/embeddings", hport, None),
                ("node -> gRPC Embed", grpc_port, grpc_node.pid),
                ("node -> HTTP relay", relay_port, relay_node.pid),
            ]
            for b in (int(x) for x in args.batch.split(",")):
                print(f"batch {b}:")
                for label, port, pid in targets:
                    m = run(port, pid, b, args.requests, args.clients)
                    cpu = f"node CPU {m['cpu_us']:7.1f} us/input" if pid is not None else ""
                    print(
                        f"  {label:<26} {m['inputs_s']:9.0f} inputs/s  p50 {m['p50']:7.2f} ms  "
                        f"p99 {m['p99']:7.2f} ms  {cpu}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
