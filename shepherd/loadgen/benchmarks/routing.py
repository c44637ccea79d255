"""``smg-bench routing``: routing quality on a multi-turn chat trace, policy beside policy and beside smg.

A seeded trace (``loadgen.trace``: many users, a few long shared system prompts, several turns each
with think time, answers appended to the history) is replayed with its timing through one gateway
to N mock engines that model what routing changes: prefill time per *uncached* token, decode
inter-token latency, a paged prefix cache of bounded capacity, a running limit with a queue. The
same engines serve every target in turn, their caches flushed in between; the engines' outputs
depend on the prompt only, so every target replays the same conversations.

Per target: the engines' prefix-cache hit rate (cached ÷ prompt tokens over the run, from
``/mock/stats``), TTFT and end-to-end latency (p50, p99) as a streaming client sees them, and the
balance (the busiest engine's requests ÷ the mean). Targets: ``smg-node serve --policy P`` for each
policy asked, and ``smg launch --policy cache_aware`` (the Rust original, from ``bench/.peers``). Every
request carries its user as ``x-smg-routing-key``: ``--policies consistent_hashing`` is then the perfect
user partition, the trace's hit-rate ceiling (other policies ignore the header).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from shepherd.loadgen.benchmarks import Benchmark
from shepherd.loadgen.procs import ProcessFailed, ProcessGroup, ProcSpec, free_port, http_get_status
from shepherd.loadgen.procstat import TreeCpuTracker, host_line
from shepherd.loadgen.sse import SseParser
from shepherd.loadgen.stats import Distribution
from shepherd.loadgen.targets import (
    PEERS_SETUP,
    console_script,
    extract_tokenizer,
    gateway_spec,
    peer_installed,
    smg_metrics_args,
)
from shepherd.loadgen.trace import Conversation, Trace, TraceConfig, generate_trace

MODEL = "qwen3"
POLICIES = ("round_robin", "least_load", "prefix_hash", "cache_aware")


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        choices=("routing", "fleet"),
        default="routing",
        help="routing: 150 users, 4-12 turns, 4 system prompts of 700-1,500 tokens, think 1 s; fleet: 200 "
        "users over 2 min, 4-8 turns, 3 system prompts of ~1,500 tokens, think 8 s (issue 21's shape)",
    )
    p.add_argument("--requests", type=int, default=None, help="trace size in requests (default: the shape's)")
    p.add_argument("--engines", type=int, default=4, help="mock engines (default 4)")
    p.add_argument("--policies", default=",".join(POLICIES), help="our policies, comma list")
    p.add_argument("--peers", default="smg", help="peer gateways: smg (cache_aware), or '' for none")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--arrival-s", type=float, default=None, help="users arrive over this window")
    p.add_argument(
        "--think-s", type=float, default=None, help="mean think time between turns (default: the shape's)"
    )
    p.add_argument("--prefill-us-per-token", type=float, default=150.0, help="engine prefill cost")
    p.add_argument("--decode-ms-per-token", type=float, default=4.0, help="engine inter-token latency")
    p.add_argument("--cache-blocks", type=int, default=4096, help="engine KV pool, 16-token blocks")
    p.add_argument("--max-running", type=int, default=16, help="engine running limit (then a queue)")
    p.add_argument("--engine-grpc-server", default="lean", choices=("lean", "grpcio"))
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    p.add_argument(
        "--mesh",
        type=int,
        default=1,
        help="N > 1: each target is N gateways (ours meshed, smg with --enable-mesh) behind HAProxy "
        "(roundrobin, http-no-delay): every request to the next gateway",
    )
    p.add_argument("--node-args", default="", help="extra smg-node serve flags (one string, shell-split)")
    p.add_argument("--smg-args", default="", help="extra smg launch flags (one string, shell-split)")
    p.add_argument("--json", type=Path, help="write the rows and settings to this file")
    p.add_argument("--log-dir", type=Path, help="keep process logs here (default: a removed temp dir)")


# ---- engines -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnginePorts:
    grpc: int
    http: int

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc}"


def engine_spec(i: int, ports: EnginePorts, args: argparse.Namespace, model_dir: Path) -> ProcSpec:
    argv = [
        *console_script("smg-mock-engine", "shepherd.mock_engine.cli"),
        "--grpc-port",
        str(ports.grpc),
        "--http-port",
        str(ports.http),
        "--model",
        MODEL,
        "--tokenizer",
        str(model_dir),
        "--seed",
        "0",  # the same on every engine: an answer depends on the prompt only
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        "--decode-ms-per-token",
        str(args.decode_ms_per_token),
        "--cache-blocks",
        str(args.cache_blocks),
        "--max-running",
        str(args.max_running),
        "--grpc-server",
        args.engine_grpc_server,
    ]
    return ProcSpec(name=f"engine-{i}", argv=tuple(argv), ready_port=ports.http, ready_path="/health")


def start_engines(group: ProcessGroup, specs: Sequence[ProcSpec], timeout_s: float = 120.0) -> None:
    """Start every engine, then wait for all (they load their tokenizers in parallel). Started from this
    thread: a child's parent-death signal follows the thread that started it."""
    procs = [(group.start(replace(s, ready_port=None)), s) for s in specs]
    deadline = time.monotonic() + timeout_s
    for proc, spec in procs:
        while http_get_status("127.0.0.1", spec.ready_port or 0, spec.ready_path) != 200:
            if not proc.alive():
                raise ProcessFailed(f"{spec.name} exited during start-up:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{spec.name} not ready after {timeout_s:.0f} s:\n{proc.log_tail()}")
            time.sleep(0.1)


def _http(port: int, method: str, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=b"" if method == "POST" else None)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    return resp.status, json.loads(data) if data else None


@dataclass(frozen=True, slots=True)
class EngineStats:
    requests: int
    lookup_tokens: int
    hit_tokens: int
    ttft_model_ms: tuple[float, ...] = ()  # since the last reset (see ``reset``)

    def minus(self, other: EngineStats) -> EngineStats:
        return EngineStats(
            self.requests - other.requests,
            self.lookup_tokens - other.lookup_tokens,
            self.hit_tokens - other.hit_tokens,
            self.ttft_model_ms,
        )


def engine_stats(port: int) -> EngineStats:
    _, s = _http(port, "GET", "/mock/stats")
    cache = s["cache"]
    ttft = tuple(float(x) for x in s.get("ttft_model_ms") or ())
    return EngineStats(
        int(s["requests_received"]), int(cache["lookup_tokens"]), int(cache["hit_tokens"]), ttft
    )


def reset(ports: Sequence[EnginePorts]) -> None:
    """Empty every engine's prefix cache and reset its counters (waits for stragglers to leave)."""
    for p in ports:
        for _ in range(200):  # bounded: up to ~20 s for stragglers (aborted streams) to leave
            status, _ = _http(p.http, "POST", "/mock/flush_cache")
            if status == 200:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"engine on port {p.http} never went idle for a cache flush")
        _http(p.http, "DELETE", "/mock/stats")


# ---- gateways ------------------------------------------------------------------------------------


def node_spec(
    port: int, engines: Sequence[EnginePorts], policy: str, model_dir: Path, extra: Sequence[str]
) -> ProcSpec:
    urls = [e.url for e in engines]
    return gateway_spec(
        "node", f"node-{policy}", port, urls, model_dir, policy, ["--model-id", MODEL, *extra]
    )


def smg_spec(port: int, engines: Sequence[EnginePorts], model_dir: Path, extra: Sequence[str]) -> ProcSpec:
    urls = [e.url for e in engines]
    return gateway_spec(
        "smg", "smg", port, urls, model_dir, "cache_aware", [*smg_metrics_args(free_port()), *extra]
    )


def gateways(
    kind: str,
    policy: str,
    engines: Sequence[EnginePorts],
    model_dir: Path,
    extra: Sequence[str],
    n: int,
    tmp: Path,
) -> list[ProcSpec]:
    """One gateway, or ``n`` in one mesh (ours: a development PKI in ``tmp``; smg: its mesh server)."""
    ports = [free_port() for _ in range(n)]
    mesh_ports = [free_port() for _ in range(n)]
    out = []
    for i, port in enumerate(ports):
        mesh: list[str] = []
        if n > 1 and kind == "node":
            mesh = [
                "--mesh-port", str(mesh_ports[i]), "--mesh-name", f"node-{i + 1}",
                "--mesh-dev-pki", str(tmp / f"pki-{policy}"),
                *(["--mesh-seeds", f"127.0.0.1:{mesh_ports[0]}"] if i else []),
            ]  # fmt: skip
        elif n > 1:
            mesh = [
                "--enable-mesh", "--mesh-host", "127.0.0.1", "--mesh-port", str(mesh_ports[i]),
                "--mesh-server-name", f"smg-{i + 1}",
                *(["--mesh-peer-urls", f"127.0.0.1:{mesh_ports[0]}"] if i else []),
            ]  # fmt: skip
        if kind == "node":
            spec = node_spec(port, engines, policy, model_dir, [*extra, *mesh])
        else:
            spec = smg_spec(port, engines, model_dir, [*extra, *mesh])
        out.append(replace(spec, name=f"{spec.name}-{i + 1}") if n > 1 else spec)
    return out


_HAPROXY_HEAD = (
    "global", "    maxconn 4096",
    "defaults", "    mode http", "    option http-no-delay", "    timeout connect 2s",
    "    timeout client 300s", "    timeout server 300s",
    "frontend fleet", "    default_backend gateways",
)  # fmt: skip
_HAPROXY_BACKEND = ("backend gateways", "    balance roundrobin")


def lb_spec(port: int, backends: Sequence[int], tmp: Path) -> ProcSpec:
    """HAProxy in front of ``backends``: roundrobin (each request to the next gateway), each SSE chunk
    forwarded at once (``option http-no-delay``; without it streamed TTFT grows by tens of ms)."""
    if shutil.which("haproxy") is None:
        raise SystemExit(
            "haproxy is not installed: `bash chaos/install.sh` (as root) installs it (Debian package)"
        )
    cfg = tmp / f"haproxy-{port}.cfg"
    servers = [f"    server g{i} 127.0.0.1:{b}" for i, b in enumerate(backends)]
    cfg.write_text(
        "\n".join([*_HAPROXY_HEAD, f"    bind 127.0.0.1:{port}", *_HAPROXY_BACKEND, *servers]) + "\n"
    )
    return ProcSpec(
        name=f"haproxy-{port}",
        argv=("haproxy", "-db", "-f", str(cfg)),
        ready_port=port,
        ready_path="/readiness",
        ready_timeout_s=30,
    )


# ---- the replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    ttft_s: float
    e2e_s: float
    error: str = ""
    user: int = -1
    turn: int = -1
    sent_s: float = 0.0  # from the start of the replay


async def _turn(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    timeout_s: float,
    user: int = -1,
) -> tuple[Sample, str]:
    body = orjson.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    )
    loop = asyncio.get_running_loop()
    sent = loop.time()
    first = math.nan
    parts: list[str] = []
    done = False
    try:
        async with session.post(
            url,
            data=body,
            # the user as routing key: consistent_hashing on it is the perfect user partition (the ceiling)
            headers={"Content-Type": "application/json", "x-smg-routing-key": f"user-{user}"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return Sample(math.nan, loop.time() - sent, f"http_{resp.status}"), ""
            sse = SseParser()
            async for chunk in resp.content.iter_any():
                now = loop.time()
                for payload in sse.feed(chunk):
                    if payload == b"[DONE]":
                        done = True
                        continue
                    obj = orjson.loads(payload)
                    for choice in obj.get("choices") or ():
                        delta = choice.get("delta") or {}
                        # a gateway with a reasoning parser on (smg for qwen3) may call the answer reasoning
                        text = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                        if text:
                            if math.isnan(first):
                                first = now
                            parts.append(text)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return Sample(math.nan, loop.time() - sent, type(e).__name__), ""
    end = loop.time()
    if not done or not parts:
        return Sample(math.nan, end - sent, "no_done" if not done else "empty"), ""
    return Sample(first - sent, end - sent), "".join(parts)


async def _conversation(
    session: aiohttp.ClientSession,
    url: str,
    trace: Trace,
    conv: Conversation,
    t0: float,
    samples: list[Sample],
    timeout_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + conv.start_s - loop.time()))
    messages = [{"role": "system", "content": trace.system_prompts[conv.system]}]
    for i, turn in enumerate(conv.turns):
        if turn.think_s > 0:
            await asyncio.sleep(turn.think_s)
        messages.append({"role": "user", "content": turn.user_text})
        sent = loop.time() - t0
        sample, answer = await _turn(session, url, messages, turn.max_tokens, timeout_s, conv.user)
        sample.user, sample.turn, sample.sent_s = conv.user, i, sent
        samples.append(sample)
        if sample.error:
            return  # the conversation cannot go on without its answer
        messages.append({"role": "assistant", "content": answer})


async def replay(port: int, trace: Trace, timeout_s: float) -> tuple[list[Sample], float]:
    """Every conversation of ``trace`` against the gateway on ``port``; (samples, wall seconds)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(
            *(_conversation(session, url, trace, c, t0, samples, timeout_s) for c in trace.conversations)
        )
        wall = asyncio.get_running_loop().time() - t0
    return samples, wall


# ---- one target ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    target: str
    requests: int
    errors: dict[str, int]
    not_sent: int
    wall_s: float
    hit_rate: float
    prefill_tokens: int  # prompt tokens the engines computed (not from cache)
    ttft_ms: Distribution
    e2e_ms: Distribution
    engine_ttft_ms: Distribution  # arrival to first token in the engines' timing model (queue + prefill)
    per_engine: tuple[int, ...]
    gateway_cpu_ms: float  # per OK request, the gateway's process tree
    note: str = ""

    @property
    def imbalance(self) -> float:
        total = sum(self.per_engine)
        return max(self.per_engine) / (total / len(self.per_engine)) if total else math.nan

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["imbalance"] = self.imbalance
        return out


def measure(
    name: str,
    port: int,
    gateway_pids: Sequence[int],
    trace: Trace,
    engines: Sequence[EnginePorts],
    timeout_s: float,
    note: str = "",
) -> Row:
    before = [engine_stats(e.http) for e in engines]
    cpus = [TreeCpuTracker(pid) for pid in gateway_pids]
    cpu0 = sum(c.sample(with_rss=False).cpu_seconds for c in cpus)
    samples, wall = asyncio.run(replay(port, trace, timeout_s))
    cpu1 = sum(c.sample(with_rss=False).cpu_seconds for c in cpus)
    after = [engine_stats(e.http) for e in engines]
    delta = [a.minus(b) for a, b in zip(after, before, strict=True)]
    lookup = sum(d.lookup_tokens for d in delta)
    hits = sum(d.hit_tokens for d in delta)
    ok = [s for s in samples if not s.error]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    return Row(
        target=name,
        requests=len(ok),
        errors=errors,
        not_sent=trace.requests - len(samples),
        wall_s=wall,
        hit_rate=hits / lookup if lookup else math.nan,
        prefill_tokens=lookup - hits,
        ttft_ms=Distribution.of(s.ttft_s for s in ok).scaled(1000.0),
        e2e_ms=Distribution.of(s.e2e_s for s in ok).scaled(1000.0),
        engine_ttft_ms=Distribution.of(t for d in delta for t in d.ttft_model_ms),
        per_engine=tuple(d.requests for d in delta),
        gateway_cpu_ms=(cpu1 - cpu0) * 1000.0 / len(ok) if ok else math.nan,
        note=note,
    )


# ---- report --------------------------------------------------------------------------------------


def format_rows(rows: Sequence[Row]) -> str:
    head = (
        f"{'target':<18} {'ok':>5} {'err':>3} {'hit rate':>8} {'prefill':>7} {'TTFT p50':>8} {'p99':>7} "
        f"{'E2E p50':>7} {'p99':>6} {'engTTFT p50':>11} {'p99':>6} {'busiest':>7} {'gw CPU':>7}  per engine"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        err = sum(r.errors.values()) + r.not_sent
        et = r.engine_ttft_ms
        lines.append(
            f"{r.target:<18} {r.requests:>5} {err:>3} {r.hit_rate:>8.3f} {r.prefill_tokens / 1e6:>6.2f}M "
            f"{r.ttft_ms.p50:>6.0f}ms {r.ttft_ms.p99:>5.0f}ms {r.e2e_ms.p50:>5.0f}ms {r.e2e_ms.p99:>4.0f}ms "
            f"{et.p50:>9.0f}ms {et.p99:>4.0f}ms {r.imbalance:>6.2f}x {r.gateway_cpu_ms:>5.1f}ms  "
            f"{'/'.join(map(str, r.per_engine))}"
        )
    return "\n".join(lines)


def verdict(rows: Sequence[Row]) -> list[str]:
    """The bar: our cache_aware's TTFT p50 at least 30% under least_load's, busiest engine <= 1.5x mean."""
    by = {r.target: r for r in rows}
    ca, ll = by.get("node cache_aware"), by.get("node least_load")
    if ca is None or ll is None:
        return []
    gain = 1.0 - ca.ttft_ms.p50 / ll.ttft_ms.p50 if ll.ttft_ms.p50 else math.nan
    egain = 1.0 - ca.engine_ttft_ms.p50 / ll.engine_ttft_ms.p50 if ll.engine_ttft_ms.p50 else math.nan
    ok_gain = gain >= 0.30
    ok_bal = ca.imbalance <= 1.5
    return [
        f"bar: node cache_aware TTFT p50 {ca.ttft_ms.p50:.1f} ms vs least_load {ll.ttft_ms.p50:.1f} ms: "
        f"{gain:.0%} lower (needs >= 30%): {'PASS' if ok_gain else 'FAIL'}; in the engines' timing model "
        f"{ca.engine_ttft_ms.p50:.1f} vs {ll.engine_ttft_ms.p50:.1f} ms: {egain:.0%} lower",
        f"bar: node cache_aware busiest engine {ca.imbalance:.2f}x the mean (needs <= 1.5x): "
        f"{'PASS' if ok_bal else 'FAIL'}",
    ]


# ---- the whole benchmark -------------------------------------------------------------------------


@dataclass
class _Setup:
    trace: Trace
    engines: list[EnginePorts] = field(default_factory=list)


FLEET_SHAPE = TraceConfig(
    users=200,
    turns_min=4,
    turns_max=8,
    system_prompts=3,
    system_tokens_min=1400,
    system_tokens_max=1600,
    system_zipf=0.0,
    user_tokens_min=40,
    user_tokens_max=200,
    answer_tokens_min=40,
    answer_tokens_max=160,
    arrival_s=120.0,
    think_s=8.0,
    think_max_s=48.0,
)


def _trace_of(args: argparse.Namespace) -> Trace:
    if args.shape == "fleet":
        cfg = replace(FLEET_SHAPE, seed=args.seed)
        if args.think_s is not None:
            cfg = replace(cfg, think_s=args.think_s, think_max_s=6 * args.think_s)
        if args.requests is not None:
            cfg = cfg.scaled(args.requests)
    else:
        think = 1.0 if args.think_s is None else args.think_s
        cfg = TraceConfig(seed=args.seed, think_s=think).scaled(args.requests or 1200)
    if args.arrival_s is not None:
        cfg = replace(cfg, arrival_s=args.arrival_s)
    return generate_trace(cfg)


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    policies = _csv(args.policies)
    peers = _csv(args.peers)
    for p in peers:
        if p != "smg":
            raise SystemExit(f"smg-bench routing: unknown peer {p!r} (known: smg)")
    if "smg" in peers and not peer_installed("smg"):
        print(f"installing smg with {PEERS_SETUP} ...", file=sys.stderr)
        subprocess.run(["bash", str(PEERS_SETUP), "smg"], check=True)
    trace = _trace_of(args)
    header = [
        f"smg-bench routing — {time.strftime('%Y-%m-%d %H:%M')}, {host_line()}",
        f"trace: {trace.summary()}",
        f"engines: {args.engines} mock engines, prefill {args.prefill_us_per_token:g} µs per uncached token, "
        f"decode {args.decode_ms_per_token:g} ms per token, KV pool {args.cache_blocks} blocks of 16 tokens, "
        f"{args.max_running} running then a queue; caches flushed before each target",
        "each target replays the whole trace with its timing (streaming chat, answers appended to the "
        "history); hit rate = cached / prompt tokens on the engines; TTFT and E2E as the client sees them;",
        "engTTFT = arrival to first token in the engines' timing model (queue + prefill: free of host CPU "
        "noise); busiest = the busiest engine's requests / the mean; gw CPU = gateway CPU ms per request",
    ]
    print("\n".join(header), flush=True)
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    node_extra = shlex.split(args.node_args)
    smg_extra = shlex.split(args.smg_args)
    with tempfile.TemporaryDirectory(prefix="smg-bench-routing-") as tmp:
        tmp_path = Path(tmp)
        log_dir = args.log_dir if args.log_dir is not None else tmp_path / "logs"
        model_dir = extract_tokenizer(tmp_path / MODEL)
        with ProcessGroup(log_dir) as group:
            engines = [EnginePorts(free_port(), free_port()) for _ in range(args.engines)]
            _progress(f"starting {len(engines)} mock engines ...")
            start_engines(group, [engine_spec(i, e, args, model_dir) for i, e in enumerate(engines)])
            targets: list[tuple[str, list[ProcSpec]]] = [
                (
                    f"node {policy}",
                    gateways("node", policy, engines, model_dir, node_extra, args.mesh, tmp_path),
                )
                for policy in policies
            ]
            if "smg" in peers:
                targets.append(
                    (
                        "smg cache_aware",
                        gateways("smg", "", engines, model_dir, smg_extra, args.mesh, tmp_path),
                    )
                )
            for name, specs in targets:
                if args.mesh > 1:
                    name = f"{name} x{args.mesh}"
                reset(engines)
                _progress(f"{name}: starting ...")
                procs = []
                try:
                    for spec in specs:
                        procs.append(group.start(spec))  # noqa: PERF401 (stopped if a later one fails)
                    if args.mesh > 1:
                        lb = lb_spec(free_port(), [sp.ready_port or 0 for sp in specs], tmp_path)
                        procs.append(group.start(lb))
                except (ProcessFailed, OSError) as e:
                    skipped[name] = str(e).strip().splitlines()[0]
                    print(f"could not start {name}: {e}", file=sys.stderr, flush=True)
                    for proc in procs:
                        proc.stop()
                    continue
                port = procs[-1].spec.ready_port or 0
                if args.mesh > 1:
                    time.sleep(3.0)  # the mesh joins (gossip converges in about a second on loopback)
                _progress(f"{name}: replaying {trace.requests} requests ...")
                gw_pids = [proc.pid for proc in procs[: len(specs)]]
                row = measure(name, port, gw_pids, trace, engines, args.timeout)
                rows.append(row)
                _progress(
                    f"{name}: hit rate {row.hit_rate:.3f}, TTFT p50 {row.ttft_ms.p50:.1f} ms, "
                    f"busiest {row.imbalance:.2f}x, {row.wall_s:.0f} s"
                )
                for proc in reversed(procs):
                    proc.stop()
    print("\n" + format_rows(rows), flush=True)
    for line in verdict(rows):
        print(line, flush=True)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", flush=True)
    if args.json is not None:
        doc = {
            "benchmark": "routing",
            "header": header,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [r.to_json() for r in rows],
            "skipped": skipped,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    return 0 if not skipped else 1


BENCHMARK = Benchmark(
    name="routing",
    help="routing quality on a multi-turn chat trace: hit rate, TTFT, balance per policy, beside smg",
    add_arguments=add_arguments,
    run=run,
    in_all=False,
)
