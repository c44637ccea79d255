"""Measure the mock engine's own CPU per request (it must stay cheaper than the gateway under test).

    python -m shepherd.mock_engine.bench [--requests 2000] [--concurrency 16] [--engine-args "..."]

Starts ``smg-mock-engine --zero-latency`` on free loopback ports, drives it over gRPC (SGLang service)
and over HTTP, and prints the engine process's CPU microseconds per request (user + system, from
/proc/<pid>/stat) for: non-stream, a 32-token stream (1 token per message), and the same stream with
``stream_interval`` 4. A command that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from collections.abc import Awaitable, Callable

import grpc
from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

SGL = sglang_scheduler_pb2
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def request(rid: str, prompt: list[int], *, stream: bool, tokens: int, interval: int | None) -> object:
    sp = SGL.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, ignore_eos=True, max_new_tokens=tokens
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


async def run(args: argparse.Namespace) -> None:
    from tests.e2e.procs import start_mock_engine

    extra = shlex.split(args.engine_args)
    with start_mock_engine("--zero-latency", *extra) as engine:
        pid = engine.pid
        prompt = list(range(1000, 1000 + args.prompt_tokens))
        channel = grpc.aio.insecure_channel(engine.grpc_target)
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        print(f"mock engine pid {pid}; {args.requests} requests per case, concurrency {args.concurrency}")
        print(f"{'case':<34} {'req/s':>8} {'engine CPU µs/req':>18}")

        async def grpc_case(name: str, stream: bool, tokens: int, interval: int | None) -> None:
            async def one(i: int) -> None:
                async for _ in stub.Generate(request(f"{name}-{i}", prompt, stream=stream, tokens=tokens,
                                                     interval=interval)):  # fmt: skip
                    pass

            await drive(min(200, args.requests), args.concurrency, one)  # warm-up
            c0 = cpu_seconds(pid)
            elapsed = await drive(args.requests, args.concurrency, one)
            used = cpu_seconds(pid) - c0
            print(f"{name:<34} {args.requests / elapsed:>8.0f} {used / args.requests * 1e6:>18.0f}")

        await grpc_case("grpc non-stream (32 tokens)", False, 32, None)
        await grpc_case("grpc stream 32 tokens, 1/msg", True, 32, None)
        await grpc_case("grpc stream 32 tokens, 4/msg", True, 32, 4)
        await channel.close()

        import aiohttp

        body_ns = {"model": "qwen3", "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
        body_s = {**body_ns, "stream": True}
        async with aiohttp.ClientSession(base_url=engine.http_url) as http:

            async def http_case(name: str, body: dict[str, object]) -> None:
                async def one(i: int) -> None:
                    async with http.post("/v1/completions", json=body) as r:
                        await r.read()

                await drive(min(200, args.requests), args.concurrency, one)
                c0 = cpu_seconds(pid)
                elapsed = await drive(args.requests, args.concurrency, one)
                used = cpu_seconds(pid) - c0
                print(f"{name:<34} {args.requests / elapsed:>8.0f} {used / args.requests * 1e6:>18.0f}")

            await http_case("http /v1/completions non-stream", body_ns)
            await http_case("http /v1/completions stream 32", body_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=250)
    p.add_argument("--engine-args", default="", help="extra smg-mock-engine arguments")
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
