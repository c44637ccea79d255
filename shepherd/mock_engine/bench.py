"""Measure the mock engine's own CPU per request (it must stay cheaper than the gateway under test).

    python -m shepherd.mock_engine.bench [--requests 2000] [--concurrency 16] [--engine-args "..."]

Starts ``smg-mock-engine --zero-latency`` on free loopback ports (once per gRPC server implementation:
lean, grpcio), drives it over gRPC (SGLang service) and over HTTP, and prints the engine process's CPU
microseconds per request (user + system, from /proc/<pid>/stat) for: non-stream, a 32-token stream
(1 token per message), and the same stream with ``stream_interval`` 4. The load generator runs in
this process. A command that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

SGL = sglang_scheduler_pb2
TICK = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def mock_engine(*args: str) -> Iterator[tuple[int, int, int]]:
    """Run ``smg-mock-engine`` on OS-picked ports; yields (pid, grpc port, http port); stops it by pid."""
    exe = Path(sys.executable).parent / "smg-mock-engine"
    with tempfile.NamedTemporaryFile(prefix="mock-bench-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(
            [str(exe), "--grpc-port", "0", "--http-port", "0", *args], stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            m = re.search(r"grpc=\S+:(\d+) http=\S+:(\d+)", log_path.read_text(errors="replace"))
            if m:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mock engine failed to start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        yield proc.pid, int(m.group(1)), int(m.group(2))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log_path.unlink(missing_ok=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def request(rid: str, prompt: list[int], *, stream: bool, tokens: int, interval: int | None) -> object:
    sp = SGL.SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        n=1,
        ignore_eos=True,
        max_new_tokens=tokens,
    )
    if interval is not None:
        sp.stream_interval = interval
    return SGL.GenerateRequest(
        request_id=rid, tokenized=SGL.TokenizedInput(input_ids=prompt), sampling_params=sp, stream=stream
    )


async def drive(total: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        async with sem:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(total)))
    return time.perf_counter() - t0


async def measure(
    pid: int, total: int, concurrency: int, one: Callable[[int], Awaitable[None]], repeat: int = 1
) -> tuple[float, float, float]:
    """(requests/s, engine CPU µs/request: best, median) over ``repeat`` rounds of ``total`` requests.

    The best round is the figure least disturbed by other load on a shared machine.
    """
    await drive(min(200, total), concurrency, one)  # warm-up
    rates: list[float] = []
    cpus: list[float] = []
    for _ in range(repeat):
        c0 = cpu_seconds(pid)
        elapsed = await drive(total, concurrency, one)
        cpus.append((cpu_seconds(pid) - c0) / total * 1e6)
        rates.append(total / elapsed)
    cpus.sort()
    return max(rates), cpus[0], cpus[len(cpus) // 2]


async def run(args: argparse.Namespace) -> None:
    extra = shlex.split(args.engine_args)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    print(f"{args.requests} requests per case, concurrency {args.concurrency}, prompt {len(prompt)} tokens")
    print(f"{'case':<44} {'req/s':>8} {'CPU µs/req best':>16} {'median':>8}")
    for impl in args.grpc_servers.split(","):
        with mock_engine("--zero-latency", "--grpc-server", impl, *extra) as (pid, grpc_port, http_port):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            cases = (
                ("non-stream", False, None),
                ("stream 32 tokens, 1/msg", True, None),
                ("stream 32 tokens, 4/msg", True, 4),
            )
            for name, stream, interval in cases:

                async def one(
                    i: int, stream: bool = stream, interval: int | None = interval, stub: Any = stub
                ) -> None:
                    req = request(f"r{i}", prompt, stream=stream, tokens=32, interval=interval)
                    async for _ in stub.Generate(req):
                        pass

                rate, best, median = await measure(pid, args.requests, args.concurrency, one, args.repeat)
                print(f"{'grpc[' + impl + '] ' + name:<44} {rate:>8.0f} {best:>16.0f} {median:>8.0f}")
            await channel.close()
            if impl != args.grpc_servers.split(",")[0]:
                continue
            body_ns = {"model": "qwen3", "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
            async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http:
                for name, body in (
                    ("non-stream", body_ns),
                    ("stream 32 tokens", {**body_ns, "stream": True}),
                ):

                    async def post(i: int, body: dict[str, object] = body) -> None:
                        async with http.post("/v1/completions", json=body) as r:
                            await r.read()

                    rate, best, median = await measure(
                        pid, args.requests, args.concurrency, post, args.repeat
                    )
                    print(f"{'http /v1/completions ' + name:<44} {rate:>8.0f} {best:>16.0f} {median:>8.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=1000, help="requests per round")
    p.add_argument("--repeat", type=int, default=5, help="rounds per case (best and median reported)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=250)
    p.add_argument("--engine-args", default="", help="extra smg-mock-engine arguments")
    p.add_argument("--grpc-servers", default="lean,grpcio", help="gRPC server implementations to measure")
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
