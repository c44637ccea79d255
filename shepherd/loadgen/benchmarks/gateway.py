"""``smg-bench gateway``: a gateway's overhead over a mock engine, beside references.

By default the mock engine has zero latency and bursts every token at once (the node merges them
into one batch); ``--decode-ms-per-token`` paces it as a real engine does (one message per
``--stream-interval`` tokens, that many ms apart), and ``--turns`` sends multi-turn conversations
whose mean rendered prompt is ``--prompt-tokens``. The table gives the gateway's CPU per request and
per output token.

For each workload (non-stream chat; streaming chat) and each concurrency, the same closed-loop load
goes to every target in turn: ``direct`` (the mock engine's own OpenAI HTTP surface: the reference),
``node`` (``smg-node serve`` over gRPC to the mock) and optional peers (``smg``: the Rust original
over gRPC; ``litellm``: an HTTP relay to the mock). The mock engine and the load generator share
one CPU, the gateway under test gets the other (``taskset``), as PEERS.md measured. The steady
figure is the gateway's CPU per request: all of its processes, from /proc, over the window.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shepherd.loadgen.benchmarks import Benchmark
from shepherd.loadgen.client import LoadSpec, WindowHooks, run_load_sync
from shepherd.loadgen.http1 import RequestTemplate
from shepherd.loadgen.procs import ProcessFailed, ProcessGroup, free_port, parse_cpu_list, pin_self
from shepherd.loadgen.procstat import TreeCpuTracker, TreeSample, host_line
from shepherd.loadgen.prompts import (
    ChatRequestSource,
    ChatShape,
    ConversationSource,
    PromptConfig,
    PromptFactory,
    load_qwen3_tokenizer,
)
from shepherd.loadgen.report import RunRow, format_table, row_from_result
from shepherd.loadgen.sse import SseParser, StreamCheck, check_completion
from shepherd.loadgen.targets import (
    KNOWN_PEERS,
    LITELLM_KEY,
    PEERS_SETUP,
    Target,
    extract_tokenizer,
    litellm_config,
    litellm_spec,
    mock_engine_spec,
    node_spec,
    peer_installed,
    smg_spec,
)

MODEL = "qwen3"
WORKLOADS = ("chat", "stream")
OWN_TARGETS = ("direct", "node")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _int_csv(text: str) -> list[int]:
    try:
        values = [int(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=_int_csv, default=[32, 128], help="comma list (default 32,128)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each window (default 2)")
    p.add_argument("--requests", type=int, default=None, help="also end a window after N measured requests")
    p.add_argument("--prompt-tokens", type=int, default=250, help="rendered prompt size (default 250)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens, ignore_eos (default 32)")
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=0.0,
        help="pace the mock engine: ms between decode steps (default 0: zero latency, one burst)",
    )
    p.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per engine message (default 1, as SGLang)"
    )
    p.add_argument(
        "--engine-steps",
        choices=("request", "batch"),
        default="request",
        help="paced: each request's tokens on a clock of its own (request, the default), or every running "
        "request's token at the engine's decode step (batch: one forward pass a step, as SGLang and vLLM)",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="turns per conversation: each resends the history; the mean prompt is --prompt-tokens",
    )
    p.add_argument(
        "--repeat-ratio",
        type=float,
        default=0.0,
        help="fraction of requests repeating a message from a fixed pool (default 0: all distinct)",
    )
    p.add_argument("--pool-size", type=int, default=64, help="distinct messages in that pool (default 64)")
    p.add_argument("--workloads", default="chat,stream", help="comma list of chat,stream")
    p.add_argument("--targets", default="direct,node", help="comma list of direct,node")
    p.add_argument("--peers", default="", help="comma list of smg,litellm (installed on first use)")
    p.add_argument("--engine-cpus", default="0", help="CPUs of the mock engine and load generator")
    p.add_argument("--gateway-cpus", default="1", help="CPUs of the gateway under test")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the rows and settings to this file")
    p.add_argument("--node-args", default="", help="extra smg-node serve flags (one string, shell-split)")
    p.add_argument("--log-dir", type=Path, help="keep process logs here (default: a removed temp dir)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every (workload, concurrency) this many times, the targets' order reversed each "
        "round, and print node/peer CPU ratios per round with their median (default 1)",
    )


@dataclass(frozen=True, slots=True)
class Settings:
    concurrency: tuple[int, ...]
    duration_s: float
    warmup_s: float
    max_requests: int | None
    prompt: PromptConfig
    max_tokens: int
    workloads: tuple[str, ...]
    targets: tuple[str, ...]
    peers: tuple[str, ...]
    engine_cpus: str | None
    gateway_cpus: str | None
    timeout_s: float
    node_args: tuple[str, ...] = ()
    decode_ms_per_token: float = 0.0
    stream_interval: int = 1
    turns: int = 1
    rounds: int = 1
    engine_steps: str = "request"


def settings_from_args(args: argparse.Namespace) -> Settings:
    workloads = tuple(_csv(args.workloads))
    targets = tuple(_csv(args.targets))
    peers = tuple(_csv(args.peers))
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"smg-bench gateway: unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    for t in targets:
        if t not in OWN_TARGETS:
            raise SystemExit(f"smg-bench gateway: unknown target {t!r} (known: {', '.join(OWN_TARGETS)})")
    for peer in peers:
        if peer not in KNOWN_PEERS:
            raise SystemExit(f"smg-bench gateway: unknown peer {peer!r} (known: {', '.join(KNOWN_PEERS)})")
    engine_cpus, gateway_cpus = _pinning(args)
    return Settings(
        concurrency=tuple(args.concurrency),
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_requests=args.requests,
        prompt=PromptConfig(
            prompt_tokens=args.prompt_tokens,
            repeat_ratio=args.repeat_ratio,
            pool_size=args.pool_size,
            seed=args.seed,
        ),
        max_tokens=args.max_tokens,
        workloads=workloads,
        targets=targets,
        peers=peers,
        engine_cpus=engine_cpus,
        gateway_cpus=gateway_cpus,
        node_args=tuple(shlex.split(args.node_args)),
        timeout_s=args.timeout,
        decode_ms_per_token=max(0.0, args.decode_ms_per_token),
        stream_interval=max(1, args.stream_interval),
        turns=max(1, args.turns),
        rounds=max(1, args.rounds),
        engine_steps=args.engine_steps,
    )


def _pinning(args: argparse.Namespace) -> tuple[str | None, str | None]:
    if args.no_pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    available = os.sched_getaffinity(0)
    engine = [c for c in parse_cpu_list(args.engine_cpus) if c in available]
    gateway = [c for c in parse_cpu_list(args.gateway_cpus) if c in available]
    if not engine or not gateway:
        print(
            f"note: CPUs {args.engine_cpus}/{args.gateway_cpus} not all available; not pinning",
            file=sys.stderr,
        )
        return None, None
    return ",".join(map(str, engine)), ",".join(map(str, gateway))


# -- checking a target by hand before loading it -----------------------------------------------


def probe(target: Target, body: bytes, stream: bool, timeout_s: float = 30.0) -> str | None:
    """Send one request; None when the answer is a well-formed completion, else what went wrong."""
    conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json", **dict(target.headers)}
        conn.request("POST", target.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as e:
        return f"request failed: {e}"
    finally:
        conn.close()
    if resp.status != 200:
        return f"HTTP {resp.status}: {data[:300]!r}"
    if not stream:
        kind, _ = check_completion(data)
        return None if kind is None else f"{kind}: {data[:300]!r}"
    check = StreamCheck()
    for payload in SseParser().feed(data + b"\n\n"):
        check.on_event(payload)
    kind = check.verdict()
    return None if kind is None else f"{kind}: {data[:300]!r}"


# -- one measurement ----------------------------------------------------------------------------


class _Sampler:
    """Samples the gateway's and the engine's process trees at the window's edges (and each second)."""

    def __init__(self, gateway_pid: int | None, engine_pid: int) -> None:
        self.gateway = TreeCpuTracker(gateway_pid) if gateway_pid is not None else None
        self.engine = TreeCpuTracker(engine_pid)
        self.start: tuple[TreeSample | None, TreeSample] | None = None
        self.end: tuple[TreeSample | None, TreeSample] | None = None
        self._ticks = 0

    def _both(self, with_rss: bool) -> tuple[TreeSample | None, TreeSample]:
        gw = self.gateway.sample(with_rss=with_rss) if self.gateway is not None else None
        return gw, self.engine.sample(with_rss=False)

    def on_start(self) -> None:
        self.start = self._both(with_rss=False)

    def on_tick(self) -> None:
        self._ticks += 1
        if self._ticks % 4 == 0:  # once a second: catch processes that exit mid-window
            self._both(with_rss=False)

    def on_end(self) -> None:
        self.end = self._both(with_rss=True)

    def hooks(self) -> WindowHooks:
        return WindowHooks(on_start=self.on_start, on_tick=self.on_tick, on_end=self.on_end)

    def deltas(self) -> tuple[float | None, TreeSample | None, float | None]:
        """(gateway CPU s over the window, the gateway tree at its end, engine CPU s over the window)."""
        if self.start is None or self.end is None:
            return None, None, None
        gw0, eng0 = self.start
        gw1, eng1 = self.end
        engine_cpu = eng1.cpu_seconds - eng0.cpu_seconds
        if gw0 is None or gw1 is None:
            return None, None, engine_cpu
        return gw1.cpu_seconds - gw0.cpu_seconds, gw1, engine_cpu


@dataclass
class _Run:
    settings: Settings
    factory: PromptFactory
    engine_pid: int
    next_index: int

    def measure(self, workload: str, target: Target, concurrency: int) -> RunRow:
        s = self.settings
        stream = workload == "stream"
        shape = ChatShape(model=MODEL, max_tokens=s.max_tokens, stream=stream)
        template = RequestTemplate(target.host, target.port, target.path, target.headers)
        # every run continues the message sequence, so no run meets messages an earlier run sent
        source: ChatRequestSource | ConversationSource
        if s.turns > 1:
            source = ConversationSource(
                self.factory,
                template,
                shape,
                turns=s.turns,
                window=2 * concurrency,
                start_index=self.next_index,
            )
        else:
            source = ChatRequestSource(self.factory, template, shape, start_index=self.next_index)
        sampler = _Sampler(target.gateway_pid, self.engine_pid)
        spec = LoadSpec(
            host=target.host,
            port=target.port,
            concurrency=concurrency,
            duration_s=s.duration_s,
            warmup_s=s.warmup_s,
            max_requests=s.max_requests,
            stream=stream,
            timeout_s=s.timeout_s,
        )
        result = run_load_sync(spec, source, sampler.hooks())
        self.next_index = source.next_index
        gw_cpu, gw_end, eng_cpu = sampler.deltas()
        return row_from_result(
            workload,
            target.name,
            result,
            gateway_cpu_s=gw_cpu,
            gateway_rss_kb=None if gw_end is None else gw_end.rss_kb,
            gateway_pss_kb=None if gw_end is None else gw_end.pss_kb,
            gateway_processes=0 if gw_end is None else len(gw_end.live_pids),
            engine_cpu_s=eng_cpu,
            output_tokens=s.max_tokens,
        )


# -- the whole benchmark ------------------------------------------------------------------------


def _ensure_peers(peers: Sequence[str]) -> None:
    missing = [p for p in peers if not peer_installed(p)]
    if not missing:
        return
    print(f"installing peers {', '.join(missing)} with {PEERS_SETUP} ...", file=sys.stderr)
    subprocess.run(["bash", str(PEERS_SETUP), *missing], check=True)


def _header(settings: Settings, factory: PromptFactory, counted_with: str) -> list[str]:
    if settings.turns > 1:
        conv = ConversationSource(
            factory,
            RequestTemplate("127.0.0.1", 1, "/", ()),
            ChatShape(model=MODEL, max_tokens=settings.max_tokens),
            turns=settings.turns,
            window=1,
        )
        samples = [conv.rendered_prompt_tokens(c, t) for c in range(8) for t in range(settings.turns)]
    else:
        samples = [factory.rendered_prompt_tokens(settings.prompt.pool_size + i) for i in range(50)]
    mean_tokens = sum(samples) / len(samples)
    pin = (
        f"mock engine + load generator on CPU {settings.engine_cpus}, gateway on CPU {settings.gateway_cpus}"
        if settings.engine_cpus is not None
        else "not pinned"
    )
    cfg = settings.prompt
    if settings.turns > 1:
        repeats = (
            f"{settings.turns}-turn conversations (each turn resends the history; rendered prompts "
            f"{min(samples)}-{max(samples)} tokens)"
        )
    elif cfg.repeat_ratio > 0:
        repeats = f"{cfg.repeat_ratio:.0%} of requests repeat one of {cfg.pool_size} pooled messages"
    else:
        repeats = "every user message distinct (no run repeats another's)"
    return [
        f"smg-bench gateway — {time.strftime('%Y-%m-%d %H:%M')}, {host_line()}",
        f"pinning: {pin}",
        f"prompts: shared system prompt ({factory.system_tokens} tokens) + user message; rendered prompt "
        f"{mean_tokens:.0f} tokens mean ({counted_with}); {repeats}",
        f"workloads: chat = non-stream; stream = SSE with usage; both max_tokens {settings.max_tokens}, "
        "ignore_eos",
        "engine: "
        + (
            f"paced, {settings.decode_ms_per_token:g} ms per decode step, one message per "
            f"{settings.stream_interval} token(s), "
            + (
                "every running request's token at the engine's step (batch steps)"
                if settings.engine_steps == "batch"
                else "each request on a clock of its own"
            )
            if settings.decode_ms_per_token > 0
            else f"zero latency (every token at once, one message per {settings.stream_interval} token(s))"
        )
        + "; gw CPU us/tok = gateway CPU per request / output tokens",
        f"each run: closed loop, {settings.warmup_s:g} s warm-up, then {settings.duration_s:g} s"
        + (f" or {settings.max_requests} requests" if settings.max_requests else "")
        + "; CPU ms/req = process-tree CPU (/proc) over the window / OK requests; gw = gateway, "
        "eng = mock engine, lg = load generator",
        "OK = HTTP 200 and a well-formed completion (streams: JSON chunks, content, data: [DONE])",
    ]


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.peers:
        _ensure_peers(settings.peers)
    if settings.engine_cpus is not None:
        pin_self(parse_cpu_list(settings.engine_cpus))
    count = load_qwen3_tokenizer()
    factory = PromptFactory(settings.prompt, count)
    header = _header(settings, factory, "qwen3 tokenizer" if count else "estimated: no tokenizer")
    print("\n".join(header), flush=True)

    rows: list[RunRow] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="smg-bench-") as tmp:
        tmp_path = Path(tmp)
        log_dir = args.log_dir if args.log_dir is not None else tmp_path / "logs"
        with ProcessGroup(log_dir) as group:
            targets, engine_pid = _start_all(group, settings, tmp_path, skipped)
            runner = _Run(settings, factory, engine_pid, next_index=settings.prompt.pool_size)
            _sanity_check(targets, runner, skipped)
            for workload in settings.workloads:
                workload_rows: list[RunRow] = []
                for concurrency in settings.concurrency:
                    for rnd in range(settings.rounds):
                        # the order reversed each round: neither side always runs first (warmer or
                        # colder host, the engine's state after the other's run)
                        for target in targets if rnd % 2 == 0 else targets[::-1]:
                            if f"{target.name}/{workload}" in skipped:
                                continue
                            _progress(f"{workload} c={concurrency} {target.name} (round {rnd + 1}) ...")
                            row = runner.measure(workload, target, concurrency)
                            workload_rows.append(row)
                            rows.append(row)
                            time.sleep(0.5)  # let the previous run's connections wind down
                print(f"\n{_workload_title(workload, settings)}", flush=True)
                print(format_table(workload_rows), flush=True)
                if settings.rounds > 1:
                    print("\n".join(ratio_lines(workload_rows)), flush=True)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", flush=True)
    if args.json is not None:
        _write_json(args.json, header, settings, rows, skipped)
    return 0 if not skipped else 1


def ratio_lines(rows: Sequence[RunRow], ours: str = "node") -> list[str]:
    """Per concurrency and peer: our gateway CPU per request over the peer's, round by round (the
    i-th run of each, in order), their median, and the pooled ratio (each side's CPU over its requests,
    those rounds together)."""
    out: list[str] = []
    for conc in sorted({r.concurrency for r in rows}):
        mine = [r for r in rows if r.concurrency == conc and r.target == ours]
        peers = sorted({r.target for r in rows if r.concurrency == conc and r.target != ours})
        for peer in peers:
            theirs = [r for r in rows if r.concurrency == conc and r.target == peer]
            pairs = [
                (a, b)
                for a, b in zip(mine, theirs, strict=False)
                if b.gateway_cpu_ms > 0 and not math.isnan(a.gateway_cpu_ms)
            ]
            if not pairs:
                continue
            ratios = [a.gateway_cpu_ms / b.gateway_cpu_ms for a, b in pairs]
            each = " ".join(f"{x:.2f}" for x in ratios)
            # (over the rounds that give a ratio: both sides' figures from the same windows)
            pooled = _pooled_cpu_ms([a for a, _ in pairs]) / _pooled_cpu_ms([b for _, b in pairs])
            out.append(
                f"c={conc} {ours}/{peer} CPU per request: {each} (median {statistics.median(ratios):.2f}, "
                f"pooled {pooled:.2f})"
            )
    return out


def _pooled_cpu_ms(rows: Sequence[RunRow]) -> float:
    """CPU ms per request over runs together (each weighted by its requests; ``ratio_lines`` hands it
    the runs that have a figure): less moved by one noisy window than a median of three ratios."""
    total = sum(r.ok for r in rows)
    return sum(r.gateway_cpu_ms * r.ok for r in rows) / total if total else math.nan


def _workload_title(workload: str, settings: Settings) -> str:
    size = f"~{settings.prompt.prompt_tokens}-token prompt, {settings.max_tokens} tokens out"
    if workload == "chat":
        return f"== chat (non-stream), {size}"
    return f"== stream, {size} (SSE)"


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def _start_all(
    group: ProcessGroup, settings: Settings, tmp: Path, skipped: dict[str, str]
) -> tuple[list[Target], int]:
    model_dir = extract_tokenizer(tmp / MODEL)
    grpc_port, http_port = free_port(), free_port()
    engine_spec = mock_engine_spec(
        grpc_port,
        http_port,
        cpus=settings.engine_cpus,
        model=MODEL,
        tokenizer_dir=model_dir,
        decode_ms_per_token=settings.decode_ms_per_token,
        stream_interval=settings.stream_interval,
        decode_steps=settings.engine_steps,
    )
    engine = group.start(engine_spec)
    targets: list[Target] = []
    if "direct" in settings.targets:
        targets.append(Target("direct", "127.0.0.1", http_port, None))

    starters: list[tuple[str, Callable[[], Target]]] = []
    if "node" in settings.targets:

        def start_node() -> Target:
            port = free_port()
            proc = group.start(
                node_spec(
                    port,
                    grpc_port,
                    model_dir,
                    cpus=settings.gateway_cpus,
                    extra=settings.node_args,
                )
            )
            return Target("node", "127.0.0.1", port, proc.pid)

        starters.append(("node", start_node))
    if "smg" in settings.peers:

        def start_smg() -> Target:
            port = free_port()
            spec = smg_spec(port, grpc_port, model_dir, cpus=settings.gateway_cpus, metrics_port=free_port())
            proc = group.start(spec)
            return Target("smg", "127.0.0.1", port, proc.pid)

        starters.append(("smg", start_smg))
    if "litellm" in settings.peers:

        def start_litellm() -> Target:
            port = free_port()
            cfg = tmp / "litellm.yaml"
            cfg.write_text(litellm_config(http_port, MODEL), encoding="utf-8")
            proc = group.start(litellm_spec(port, cfg, cpus=settings.gateway_cpus))
            auth = (("Authorization", f"Bearer {LITELLM_KEY}"),)
            return Target("litellm", "127.0.0.1", port, proc.pid, headers=auth)

        starters.append(("litellm", start_litellm))
    for name, start in starters:
        _progress(f"starting {name} ...")
        try:
            targets.append(start())
        except (ProcessFailed, OSError) as e:
            for workload in settings.workloads:
                skipped[f"{name}/{workload}"] = _first_line(str(e))
            print(f"could not start {name}: {e}", file=sys.stderr, flush=True)
    return targets, engine.pid


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _sanity_check(targets: Sequence[Target], runner: _Run, skipped: dict[str, str]) -> None:
    """One request of each workload per target: a target that answers wrongly is not measured."""
    for target in targets:
        for workload in runner.settings.workloads:
            key = f"{target.name}/{workload}"
            if key in skipped:
                continue
            stream = workload == "stream"
            shape = ChatShape(model=MODEL, max_tokens=runner.settings.max_tokens, stream=stream)
            template = RequestTemplate(target.host, target.port, target.path, target.headers)
            source = ChatRequestSource(runner.factory, template, shape, start_index=runner.next_index)
            body = source.body_of(runner.next_index)
            runner.next_index += 1
            problem = probe(target, body, stream, timeout_s=runner.settings.timeout_s)
            if problem is not None:
                skipped[key] = problem
                print(f"{key}: {problem}", file=sys.stderr, flush=True)


def _write_json(
    path: Path, header: Sequence[str], settings: Settings, rows: Sequence[RunRow], skipped: dict[str, str]
) -> None:
    doc = {
        "benchmark": "gateway",
        "header": list(header),
        "settings": {
            "concurrency": list(settings.concurrency),
            "duration_s": settings.duration_s,
            "warmup_s": settings.warmup_s,
            "max_requests": settings.max_requests,
            "prompt_tokens": settings.prompt.prompt_tokens,
            "repeat_ratio": settings.prompt.repeat_ratio,
            "pool_size": settings.prompt.pool_size,
            "max_tokens": settings.max_tokens,
            "decode_ms_per_token": settings.decode_ms_per_token,
            "stream_interval": settings.stream_interval,
            "engine_steps": settings.engine_steps,
            "turns": settings.turns,
            "rounds": settings.rounds,
            "engine_cpus": settings.engine_cpus,
            "gateway_cpus": settings.gateway_cpus,
        },
        "rows": [r.to_json() for r in rows],
        "skipped": skipped,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


BENCHMARK = Benchmark(
    name="gateway",
    help="gateway overhead over a mock engine, burst or paced (direct, node, peers)",
    add_arguments=add_arguments,
    run=run,
)
