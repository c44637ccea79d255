"""Node CPU per request of the Anthropic Messages API against chat completions, same workload, one run.

Starts a zero-latency mock engine (32 output tokens a request) and one node on the embedded qwen3
tokenizer, then sends N streamed requests of each API in turn (alternating rounds, best round kept) with
the same user message, and prints node CPU ms per request (the node's process tree, from /proc) and the
client's p50/p99 latency. Both answers come from the same engine output through the same output
pipeline (detokenizer, stops, parsers); what differs is the request schema and the event encoder.

    .venv/bin/python bench/messages_bench.py                  # 3 rounds of 300 streamed requests each
    .venv/bin/python bench/messages_bench.py --requests 500 --rounds 5

Prints figures only; no asserts on speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import sys
import tempfile
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
OUTPUT = 32
PROMPT = "Tell me about the history of the printing press in Europe, briefly, in plain words."

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat completions": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": OUTPUT,
            "stream": True,
        },
    ),
    "anthropic messages": (
        "/v1/messages",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": OUTPUT,
            "stream": True,
        },
    ),
}


def run(conn: http.client.HTTPConnection, path: str, body: dict[str, Any], n: int) -> list[float]:
    data = json.dumps(body).encode()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        lat.append(time.perf_counter() - t0)
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {raw[:300]!r}")
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="smg-messages-bench-") as tmp:
        work = Path(tmp)
        model_dir = extract_tokenizer(work / "model")
        with ProcessGroup(work / "logs") as procs:
            gport, hport, port = free_port(), free_port(), free_port()
            spec = mock_engine_spec(gport, hport, cpus=None, tokenizer_dir=model_dir)
            spec = dataclasses.replace(spec, argv=(*spec.argv, "--output-len", str(OUTPUT)))
            procs.start(spec)
            extra = ("--model-id", MODEL, "--tokenizer-workers", "0")
            node = procs.start(node_spec(port, gport, model_dir, cpus=None, extra=extra))
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            best: dict[str, tuple[float, list[float]]] = {}
            for path, body in CASES.values():
                run(conn, path, body, 20)  # warm-up
            for _ in range(args.rounds):
                for name, (path, body) in CASES.items():
                    tracker = TreeCpuTracker(node.pid)
                    c0 = tracker.sample(with_rss=False).cpu_seconds
                    lat = run(conn, path, body, args.requests)
                    cpu = (tracker.sample(with_rss=False).cpu_seconds - c0) * 1000 / args.requests
                    if name not in best or cpu < best[name][0]:
                        best[name] = (cpu, lat)
            conn.close()
    print(
        f"messages_bench {time.strftime('%Y-%m-%d %H:%M')}: streamed, {OUTPUT} output tokens, "
        f"best of {args.rounds} rounds of {args.requests}"
    )
    for name, (cpu, lat) in best.items():
        s = sorted(lat)
        p50, p99 = s[len(s) // 2] * 1000, s[min(len(s) - 1, int(0.99 * len(s)))] * 1000
        print(f"  {name:<20} node CPU {cpu:6.3f} ms/req   p50 {p50:6.2f} ms   p99 {p99:6.2f} ms")


if __name__ == "__main__":
    main()
