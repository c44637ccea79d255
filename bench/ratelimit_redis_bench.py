"""The cost of one admission with Redis as the rate-limit counter store, beside the mesh backend's.

    .venv/bin/python bench/ratelimit_redis_bench.py [--n 5000] [--concurrency 32] [--timeout 5]

Starts a private redis-server on loopback (tests.services; ``python -m tests.services install`` when it
is missing), then per case admits and settles ``--n`` requests of one tenant under two rules (the
tenant's rpm + tpm + max_concurrent, and its (tenant, model) tpm), limits high enough that all are
admitted, and prints: wall time per admission (p50 / p99 when one at a time), the node process's CPU
per admission (user + system: acquire + settle, the settlements' pipelined batches included; on loopback the
kernel's TCP work for both ends is mostly charged to the sender), redis-server's CPU per admission
(/proc utime + stime), and Redis's own count (INFO commandstats: script calls and their microseconds
per admission, admission and settlement: the least noisy figure here). A redis-py PING's cost on the
same connection first, as the unit the client's figures compare with. Cases: the mesh backend (no I/O), Redis
one request at a time, Redis with ``--concurrency`` requests in flight, and the fallback rule (Redis
marked down). A print, not a test: the figures depend on the machine and its load (the load average
is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from shepherd.node.api.admission import Admission  # noqa: E402
from shepherd.node.config import RateLimitRule  # noqa: E402
from tests.services import redis_service  # noqa: E402

RULES = (
    RateLimitRule("bench", None, 10**9, 10**12, 10**6),
    RateLimitRule("bench", "m", None, 10**12, None),
)
TICKS = os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def mesh_case(n: int) -> tuple[float, float]:
    a = Admission(RULES, node="n0", gen=1)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        a.admit("bench", "m", 100, 100).settle(150)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


async def ping_case(url: str, n: int) -> tuple[float, float, float]:
    r = aioredis.Redis.from_url(url)
    for _ in range(200):
        await r.ping()
    c0, t0 = os.times(), time.perf_counter()
    for _ in range(n):
        await r.ping()
    wall, c1 = time.perf_counter() - t0, os.times()
    await r.aclose()
    return wall / n, (c1.user - c0.user) / n, (c1.system - c0.system) / n


async def redis_case(
    url: str, pid: int, n: int, concurrency: int, timeout: float, down: bool = False
) -> dict[str, float]:
    redis = {"url": url, "prefix": f"bench{uuid.uuid4().hex[:8]}:", "timeout": timeout, "lease": 30.0}
    a = Admission(RULES, node="n0", gen=1, redis=redis)
    assert a.backend is not None
    await a.start()
    for _ in range(200):  # warm: connections made, script loaded
        (await a.admit_async("bench", "m", 100, 100)).settle(150)
    await a.backend.flush()
    if down:
        a.backend.up = False  # the fallback rule, as while Redis is unreachable (no probe started)
    lat: list[float] = []

    async def one() -> None:
        t = time.perf_counter()
        ticket = await a.admit_async("bench", "m", 100, 100)
        lat.append(time.perf_counter() - t)
        ticket.settle(150)

    async def worker(k: int) -> None:
        for _ in range(k):
            await one()

    info = aioredis.Redis.from_url(url)
    await info.config_resetstat()
    r0, c0, t0 = proc_cpu(pid), os.times(), time.perf_counter()
    per, extra = divmod(n, concurrency)
    await asyncio.gather(*(worker(per + (1 if i < extra else 0)) for i in range(concurrency)))
    await a.backend.flush()
    wall = time.perf_counter() - t0
    c1 = os.times()
    stats = await info.info("commandstats")
    await info.aclose()
    ev = stats.get("cmdstat_evalsha", {})  # the scripts (inner commands are counted apart)
    calls, usec = int(ev.get("calls", 0)), float(ev.get("usec", 0.0))
    out = {
        "wall_per": wall / n,
        "user_per": (c1.user - c0.user) / n,
        "sys_per": (c1.system - c0.system) / n,
        "calls_per": calls / n,
        "usec_per": usec / n,
        "redis_cpu_per": (proc_cpu(pid) - r0) / n,
        "p50": statistics.median(lat),
        "p99": sorted(lat)[int(len(lat) * 0.99)],
        "fallbacks": float(a.backend.fallbacks),
    }
    await a.close()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--timeout", type=float, default=5.0, help="the Redis call bound (high: measure, not fall back)"
    )
    args = ap.parse_args()
    print(f"load average before: {loadavg()}")
    wall, cpu = mesh_case(args.n)
    with redis_service() as svc:
        pw, pu, ps = await ping_case(svc.url, args.n)
    print(f"redis-py PING, one at a time: wall {pw * 1e6:.1f}us, user+sys {pu * 1e6:.1f}+{ps * 1e6:.1f}us")
    print(
        f"{'case':<26} {'wall/adm':>9} {'p50':>7} {'p99':>8} {'node user+sys/adm':>18} {'redis CPU/adm':>13} "
        f"{'scripts, usec/adm':>18}"
    )
    print(f"{'mesh (no I/O)':<26} {wall * 1e6:>7.1f}us {'':>7} {'':>8} {cpu * 1e6:>16.1f}us")
    with redis_service() as svc:
        for name, conc, down in (
            ("redis, 1 at a time", 1, False),
            (f"redis, {args.concurrency} in flight", args.concurrency, False),
            ("fallback (redis down)", 1, True),
        ):
            r = await redis_case(svc.url, svc.pid, args.n, conc, args.timeout, down)
            print(
                f"{name:<26} {r['wall_per'] * 1e6:>7.1f}us {r['p50'] * 1e6:>5.0f}us {r['p99'] * 1e6:>6.0f}us "
                f"{r['user_per'] * 1e6:>8.1f}+{r['sys_per'] * 1e6:>5.1f}us "
                f"{r['redis_cpu_per'] * 1e6:>11.1f}us "
                f"{r['calls_per']:>10.2f}, {r['usec_per']:>5.1f}  fallbacks {r['fallbacks']:.0f}"
            )
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    asyncio.run(main())
