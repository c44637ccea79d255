"""Slow readers: what a node holds for clients that read a long streamed answer a trickle at a time.

K clients each ask for a streamed chat answer of ``--tokens`` tokens (the mock engine paced at
``--decode-ms`` a token, its context raised to fit), set a tiny receive buffer, and read ``--read``
bytes every ``--every`` seconds: slow, but never silent long enough for the node's write-stall cut-off.
Printed every period: the node's RSS, what each client has read, and whether the engine has finished
the answers (it should not: past a bounded backlog the node stops giving the engine stream credit, so
the engine waits for the client instead of the node buffering the answer).

    .venv/bin/python bench/slow_reader_bench.py [--clients 10] [--tokens 120000] [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

from shepherd.loadgen.procs import ProcessGroup, ProcSpec, free_port
from shepherd.loadgen.targets import console_script


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def engine_completed(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/mock/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return int(stats.get("completed", 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--tokens", type=int, default=120_000)
    p.add_argument("--decode-ms", type=float, default=0.25)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--read", type=int, default=65_536, help="bytes each client reads per period")
    p.add_argument("--every", type=float, default=15.0, help="seconds between a client's reads")
    a = p.parse_args()
    grpc, engine_http, node_http = free_port(), free_port(), free_port()
    tok = Path(__file__).resolve().parent.parent / "shepherd" / "tokens" / "assets" / "qwen3"
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        engine = [*console_script("smg-mock-engine", "shepherd.mock_engine.cli")]
        engine += ["--grpc-port", str(grpc), "--http-port", str(engine_http), "--model", "qwen3"]
        engine += ["--tokenizer", str(tok), "--decode-ms-per-token", str(a.decode_ms)]
        engine += ["--output-len", str(a.tokens), "--context-length", str(a.tokens + 4096)]
        engine += ["--cache-blocks", "400000", "--max-running", "512"]
        group.start(ProcSpec("engine", tuple(engine), ready_port=engine_http, ready_path="/health"))
        node = [*console_script("smg-node", "shepherd.node.cli"), "serve", "--host", "127.0.0.1"]
        node += ["--port", str(node_http), "--worker-urls", f"grpc://127.0.0.1:{grpc}"]
        node += ["--model-path", str(tok), "--model-id", "qwen3", "--log-level", "warning"]
        proc = group.start(ProcSpec("node", tuple(node), ready_port=node_http, ready_path="/readiness"))
        body = json.dumps(
            {
                "model": "qwen3",
                "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": a.tokens,
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{node_http}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        before = rss_mb(proc.pid)
        print(f"node RSS before: {before:.0f} MB; {a.clients} clients, {a.tokens} tokens each")
        socks = []
        for _ in range(a.clients):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            s.connect(("127.0.0.1", node_http))
            s.sendall(head + body)
            s.setblocking(False)
            socks.append(s)
        read = [0] * a.clients
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < a.duration:  # bounded by --duration
                for i, s in enumerate(socks):
                    got = 0
                    try:
                        while got < a.read:
                            d = s.recv(min(65_536, a.read - got))
                            if not d:
                                break
                            got += len(d)
                    except (BlockingIOError, OSError):
                        pass
                    read[i] += got
                print(
                    f"t={time.monotonic() - t0:5.1f} s  node RSS {rss_mb(proc.pid):6.0f} MB "
                    f"(+{rss_mb(proc.pid) - before:.0f})  read per client ~{sum(read) // a.clients} B  "
                    f"engine answers completed {engine_completed(engine_http)}/{a.clients}",
                    flush=True,
                )
                time.sleep(a.every)
        finally:
            for s in socks:
                s.close()
        time.sleep(3)
        print(f"after the clients closed: node RSS {rss_mb(proc.pid):.0f} MB")


if __name__ == "__main__":
    main()
