"""Memory of a node and its tokenizer pool, process by process, beside SMG on the same model.

Starts a mock engine (zero latency) and, on the embedded qwen3 tokenizer, ``smg-node serve`` (with its
tokenizer pool) and optionally SMG (``bench/.peers/smg``), warms each with the same requests (chat with
long prompts, so that the pool encodes too), and prints each process's RSS, PSS, USS (private pages)
and shared pages from ``/proc/PID/smaps_rollup``. PSS counts a page shared by n processes as 1/n in
each, so the PSS of a node's processes adds up to what the node really costs the host.

    .venv/bin/python bench/memory_bench.py                      # node (2 tokenizer workers) + smg
    .venv/bin/python bench/memory_bench.py --node-args "--tokenizer-workers 4" --no-smg
    .venv/bin/python bench/memory_bench.py --soak 1800 --every 60   # the curve under churning chats

``--soak S`` then keeps a closed loop of multi-turn conversations (every conversation new) on the node for
S seconds and prints the node's total RSS / PSS every ``--every`` seconds (with the main process's PSS and
USS and a worker's mean).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shepherd.loadgen.client import LoadSpec, run_load_sync
from shepherd.loadgen.http1 import RequestTemplate
from shepherd.loadgen.procs import ProcessGroup, free_port
from shepherd.loadgen.procstat import host_line, tree_pids
from shepherd.loadgen.prompts import (
    ChatShape,
    ConversationSource,
    PromptConfig,
    PromptFactory,
    load_qwen3_tokenizer,
)
from shepherd.loadgen.targets import (
    extract_tokenizer,
    mock_engine_spec,
    node_spec,
    peer_installed,
    smg_spec,
)

MODEL = "qwen3"


@dataclass(frozen=True, slots=True)
class Mem:
    pid: int
    name: str
    rss_kb: int
    pss_kb: int
    uss_kb: int
    shared_kb: int


def read_mem(pid: int) -> Mem | None:
    """RSS, PSS, USS and shared kB of ``pid`` from smaps_rollup (None if it is gone)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1])
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            comm = f.read().strip()
    except OSError:
        return None
    return Mem(
        pid=pid,
        name=comm,
        rss_kb=fields.get("Rss", 0),
        pss_kb=fields.get("Pss", 0),
        uss_kb=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        shared_kb=fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0),
    )


def tree_mem(root: int) -> list[Mem]:
    out = []
    for pid in tree_pids(root):
        m = read_mem(pid)
        if m is not None:
            out.append(m)
    return out


def _mb(kb: int) -> str:
    return f"{kb / 1024:.1f}"


def format_rows(label: str, mems: Sequence[Mem]) -> list[str]:
    lines = []
    for i, m in enumerate(mems):
        role = "main" if i == 0 else f"child {i}"
        lines.append(
            f"{label:<8} {role:<9} {m.pid:>8} {m.name:<16} {_mb(m.rss_kb):>8} {_mb(m.pss_kb):>8} "
            f"{_mb(m.uss_kb):>8} {_mb(m.shared_kb):>8}"
        )
    tot_rss = sum(m.rss_kb for m in mems)
    tot_pss = sum(m.pss_kb for m in mems)
    tot_uss = sum(m.uss_kb for m in mems)
    lines.append(
        f"{label:<8} {'total':<9} {len(mems):>8} {'processes':<16} {_mb(tot_rss):>8} {_mb(tot_pss):>8} "
        f"{_mb(tot_uss):>8} {'':>8}"
    )
    return lines


HEADER = (
    f"{'gateway':<8} {'process':<9} {'pid':>8} {'comm':<16} {'RSS MB':>8} {'PSS MB':>8} {'USS MB':>8} "
    f"{'shr MB':>8}"
)


def warm(port: int, factory: PromptFactory, requests: int, start: int, stream: bool) -> int:
    """``requests`` chat requests, four turns per conversation; returns the next conversation index."""
    template = RequestTemplate("127.0.0.1", port, "/v1/chat/completions", ())
    shape = ChatShape(model=MODEL, max_tokens=64, stream=stream)
    source = ConversationSource(factory, template, shape, turns=4, window=16, start_index=start)
    spec = LoadSpec(
        host="127.0.0.1",
        port=port,
        concurrency=8,
        duration_s=600.0,
        warmup_s=0.0,
        max_requests=requests,
        stream=stream,
        timeout_s=60.0,
    )
    result = run_load_sync(spec, source)
    if result.ok < requests // 2:
        print(
            f"warning: only {result.ok} of {requests} warm-up requests OK: {dict(result.errors)}", flush=True
        )
    return source.next_index


def soak(
    port: int, node_pid: int, factory: PromptFactory, seconds: float, every: float, start: int, conc: int
) -> None:
    print(f"\nsoak: multi-turn conversations (every one new), c={conc}, {seconds:g} s", flush=True)
    print(
        f"{'t s':>6} {'requests':>9} {'RSS MB':>8} {'PSS MB':>8} {'main PSS':>9} {'main USS':>9} "
        f"{'worker PSS':>10} {'worker USS':>10}",
        flush=True,
    )
    t0 = time.monotonic()
    done = 0
    index = start
    while True:
        mems = tree_mem(node_pid)
        rss = sum(m.rss_kb for m in mems)
        pss = sum(m.pss_kb for m in mems)
        elapsed = time.monotonic() - t0
        main, workers = (mems[0], mems[1:]) if mems else (None, [])
        per = (  # the main process's PSS and USS, then the workers' mean
            f"{_mb(main.pss_kb) if main else '-':>9} {_mb(main.uss_kb) if main else '-':>9} "
            f"{_mb(sum(m.pss_kb for m in workers) // max(1, len(workers))):>10} "
            f"{_mb(sum(m.uss_kb for m in workers) // max(1, len(workers))):>10}"
        )
        print(f"{elapsed:>6.0f} {done:>9} {_mb(rss):>8} {_mb(pss):>8} {per}", flush=True)
        if elapsed >= seconds:
            return
        template = RequestTemplate("127.0.0.1", port, "/v1/chat/completions", ())
        shape = ChatShape(model=MODEL, max_tokens=64, stream=True)
        source = ConversationSource(factory, template, shape, turns=4, window=2 * conc, start_index=index)
        spec = LoadSpec(
            host="127.0.0.1",
            port=port,
            concurrency=conc,
            duration_s=min(every, seconds - elapsed),
            warmup_s=0.0,
            stream=True,
            timeout_s=60.0,
        )
        result = run_load_sync(spec, source)
        done += result.ok
        index = source.next_index


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="warm-up requests per gateway (default 400)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="mean rendered prompt (default 2000)")
    p.add_argument("--node-args", default="", help="extra smg-node serve flags (one string, shell-split)")
    p.add_argument("--no-smg", action="store_true", help="do not measure SMG")
    p.add_argument("--soak", type=float, default=0.0, help="then soak the node this many seconds")
    p.add_argument("--every", type=float, default=60.0, help="soak: seconds between samples")
    p.add_argument("--soak-concurrency", type=int, default=16, help="soak: requests in flight (default 16)")
    args = p.parse_args(argv)

    factory = PromptFactory(PromptConfig(prompt_tokens=args.prompt_tokens), load_qwen3_tokenizer())
    print(
        f"memory_bench — {time.strftime('%Y-%m-%d %H:%M')}, {host_line()}; model {MODEL} (embedded "
        f"tokenizer); after {args.requests} chat requests "
        f"(4-turn conversations, ~{args.prompt_tokens}-token prompts, half streamed); node flags: "
        f"{args.node_args or '(defaults)'}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="smg-mem-") as tmp:
        tmp_path = Path(tmp)
        with ProcessGroup(tmp_path / "logs") as group:
            model_dir = extract_tokenizer(tmp_path / MODEL)
            grpc_port, http_port = free_port(), free_port()
            group.start(
                mock_engine_spec(grpc_port, http_port, cpus=None, model=MODEL, tokenizer_dir=model_dir)
            )
            node_port = free_port()
            node = group.start(
                node_spec(
                    node_port, grpc_port, model_dir, cpus=None, extra=tuple(shlex.split(args.node_args))
                )
            )
            index = warm(node_port, factory, args.requests // 2, 1000, stream=False)
            index = warm(node_port, factory, args.requests // 2, index, stream=True)
            time.sleep(1.0)
            lines = [HEADER, *format_rows("node", tree_mem(node.pid))]
            if not args.no_smg and peer_installed("smg"):
                smg_port = free_port()
                smg = group.start(
                    smg_spec(smg_port, grpc_port, model_dir, cpus=None, metrics_port=free_port())
                )
                warm(smg_port, factory, args.requests // 2, 1000, stream=False)
                warm(smg_port, factory, args.requests // 2, index, stream=True)
                time.sleep(1.0)
                lines += format_rows("smg", tree_mem(smg.pid))
            elif not args.no_smg:
                lines.append("smg: not installed (bench/peers/setup.sh smg)")
            print("\n".join(lines), flush=True)
            if args.soak > 0:
                conc = args.soak_concurrency
                soak(node_port, node.pid, factory, args.soak, args.every, index + 100_000, conc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
