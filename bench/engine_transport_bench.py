"""CPU per engine request: grpcio (grpc.aio) vs the lean HTTP/2 transport (H2EngineClient).

Starts ``smg-mock-engine --zero-latency`` pinned to core 0, then for each transport variant runs a
worker process pinned to core 1 (a fresh process per variant: grpcio reads GRPC_EXPERIMENTS once) that
measures, with ``time.process_time`` (every thread of the process), the client CPU per request for a
non-stream Generate (one response message) and a 32-token stream (stream_interval 1: one message per
token), at concurrency 1 and 32. Also context switches per request (getrusage, all threads).

    .venv/bin/python bench/engine_transport_bench.py                 # full table
    .venv/bin/python bench/engine_transport_bench.py --requests 200 --variants grpcio,h2
    .venv/bin/python bench/engine_transport_bench.py --paced 1       # 1 ms per token: a read per message
    .venv/bin/python bench/engine_transport_bench.py --micro         # frame parsing: ours vs h2 (hyper)
    .venv/bin/python bench/engine_transport_bench.py --gateway       # Gateway.open_stream path, in-process
    .venv/bin/python bench/engine_transport_bench.py --codec         # GenerateRequest: message vs bytes

``--gateway`` measures the node's whole engine path per request in one process, without sockets:
``Gateway.pick`` + ``open_stream`` (GenerateRequest encoding, ``H2EngineClient.generate_batches``,
HTTP/2 framing), the response parsed and decoded into engine events, ``EngineStream.close``; a fake
in-process server answers each call with pre-built frames (its own small cost is included). Prompts
are real qwen3 ChatML renders with their pieces (shared system prompt, a user message new to every
request, ~235 ids), as the tokenizer's caches hand them over.

Prints figures only; no asserts. Machines are shared and noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

READY = re.compile(r"mock engine ready grpc=(\S+):(\d+) http=(\S+):(\d+)")

# grpcio 1.85 accepts these experiment names (checked: an unknown name logs "Unknown experiment")
NO_EVENT_ENGINE = ",".join(
    f"-event_engine_{x}" for x in ("client", "listener", "callback_cq", "for_all_other_endpoints")
)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "grpcio": ("grpcio", {}),
    "grpcio-noee": ("grpcio", {"GRPC_EXPERIMENTS": NO_EVENT_ENGINE}),
    "h2": ("h2", {}),
    "h2-direct": ("h2-direct", {}),  # without write coalescing (a transport.write per frame batch)
}


# ---------------------------------------------------------------------------------------------- worker


def _make_client(transport: str, target: str, kind: str) -> Any:
    if transport == "grpcio":
        from shepherd.node.engines.grpcio import GrpcEngineClient

        return GrpcEngineClient(f"{kind}://{target}", target, kind)
    from shepherd.node.engines.h2 import H2EngineClient

    return H2EngineClient(f"{kind}://{target}", target, kind, coalesce_writes=transport != "h2-direct")


async def _scenario(client: Any, stream: bool, conc: int, n: int, tokens: int) -> dict[str, float]:
    from shepherd.proto.engine_types import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True, stream_interval=1)
    ids = list(range(1000, 1250))  # a 250-token prompt
    counter = 0
    msgs = 0

    async def one() -> None:
        nonlocal counter, msgs
        counter += 1
        req = GenerateRequest(f"b{counter}", ids, sampling, stream=stream)
        async for _ev in client.generate(req, timeout=30.0):
            msgs += 1

    async def worker(count: int) -> None:
        for _ in range(count):
            await one()

    async def run(total: int) -> None:
        per = [total // conc + (1 if i < total % conc else 0) for i in range(conc)]
        await asyncio.gather(*(worker(c) for c in per if c))

    await run(max(conc * 4, 20))  # warm-up: connection, HPACK tables, protobuf, caches
    msgs = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    c0 = time.process_time()
    w0 = time.perf_counter()
    await run(n)
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    csw = (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw)
    return {
        "cpu_us_req": cpu / n * 1e6,
        "cpu_us_msg": cpu / max(1, msgs) * 1e6,
        "msgs_req": msgs / n,
        "csw_req": csw / n,
        "req_s": n / wall,
    }


async def _worker_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    client = _make_client(args.transport, args.target, args.kind)
    out: list[dict[str, Any]] = []
    try:
        for stream in (False, True):
            for conc in args.concurrency:
                n = args.requests if stream else args.requests * 2
                r = await _scenario(client, stream, conc, n, args.tokens)
                out.append({"stream": stream, "conc": conc, "n": n, **r})
    finally:
        await client.close()
    return out


def worker(args: argparse.Namespace) -> None:
    if args.loop == "uvloop":
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    else:
        runner = asyncio.run
    res = runner(_worker_main(args))
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------- driver


def _taskset(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


def start_engine(kind: str, paced_ms: float | None = None) -> tuple[subprocess.Popen[bytes], str, Path]:
    fd, name = tempfile.mkstemp(prefix="bench-mock-engine-", suffix=".log")
    os.close(fd)
    log = Path(name)
    argv = [
        *_taskset(0),
        str(Path(sys.executable).parent / "smg-mock-engine"),
        *(
            ["--zero-latency"]
            if paced_ms is None
            else ["--decode-ms-per-token", str(paced_ms), "--prefill-us-per-token", "0"]
        ),
        "--engine",
        kind,
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--max-running",
        "256",
    ]
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = READY.search(log.read_text(errors="replace"))
        if m:
            return proc, f"127.0.0.1:{m.group(2)}", log
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise SystemExit(f"mock engine did not start:\n{log.read_text(errors='replace')}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def run_variant(name: str, target: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    transport, extra_env = VARIANTS[name]
    env = {**os.environ, **extra_env}
    argv = [
        *_taskset(1),
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--transport",
        transport,
        "--target",
        target,
        "--kind",
        args.kind,
        "--loop",
        args.loop,
        "--requests",
        str(args.requests),
        "--tokens",
        str(args.tokens),
        "--concurrency",
        ",".join(str(c) for c in args.concurrency),
    ]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rows: list[dict[str, Any]] = json.loads(line[7:])
            return rows
    raise SystemExit(f"worker {name} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")


def main_driver(args: argparse.Namespace) -> None:
    proc, target, log = start_engine(args.kind, args.paced)
    runs: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    try:
        for _ in range(args.rounds):  # variants interleaved, so a noisy spell hits them alike
            for name in args.variants:
                for r in run_variant(name, target, args):
                    runs.setdefault((name, r["stream"], r["conc"]), []).append(r)
    finally:
        stop(proc)
        log.unlink(missing_ok=True)
    engine_mode = "--zero-latency" if args.paced is None else f"--decode-ms-per-token {args.paced}"
    print(
        f"\nclient CPU per request (median of {args.rounds} interleaved rounds; range of CPU µs/req), "
        f"mock engine {engine_mode} ({args.kind}) on core 0, client on core 1, loop={args.loop}, "
        f"{args.tokens}-token outputs, 250-token prompts"
    )
    print(
        f"{'transport':<12} {'scenario':<11} {'conc':>4} {'reqs':>5} {'CPU µs/req':>11} {'range':>11} "
        f"{'CPU µs/msg':>10} {'msgs/req':>8} {'csw/req':>7} {'req/s':>6}"
    )
    for (name, stream, conc), rs in runs.items():
        cpu = sorted(r["cpu_us_req"] for r in rs)
        scen = "stream" if stream else "non-stream"
        print(
            f"{name:<12} {scen:<11} {conc:>4} {rs[0]['n']:>5} {_median(cpu):>11.0f} "
            f"{f'{cpu[0]:.0f}-{cpu[-1]:.0f}':>11} {_median([r['cpu_us_msg'] for r in rs]):>10.1f} "
            f"{_median([r['msgs_req'] for r in rs]):>8.1f} {_median([r['csw_req'] for r in rs]):>7.1f} "
            f"{_median([r['req_s'] for r in rs]):>6.0f}"
        )


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


# ---------------------------------------------------------------------------------------------- micro


def micro(reps: int) -> None:
    """Client-side parsing of one 32-message response stream: ours vs the h2 (hyper) state machine."""
    from smg_grpc_proto import sglang_scheduler_pb2 as sg

    from shepherd.node.engines import h2_frames as ours
    from shepherd.node.engines.h2_conn import H2Connection
    from shepherd.node.engines.h2_stream import GrpcStream, grpc_message

    msgs = [
        sg.GenerateResponse(
            request_id="r",
            chunk=sg.GenerateStreamChunk(token_ids=[i + 100], prompt_tokens=250, completion_tokens=i),
        ).SerializeToString()
        for i in range(32)
    ]
    # table-neutral blocks (static-table index and plain literals), as a warm gRPC server sends them
    hdr = b"\x88" + ours.hpack_literal(31, b"application/grpc")
    trl = ours.hpack_literal(b"grpc-status", b"0")

    def server_bytes(sid: int) -> bytes:
        out = [ours.frame(ours.HEADERS, ours.FLAG_END_HEADERS, sid, hdr)]
        out += [ours.frame(ours.DATA, 0, sid, grpc_message(m)) for m in msgs]
        out.append(ours.frame(ours.HEADERS, ours.FLAG_END_HEADERS | ours.FLAG_END_STREAM, sid, trl))
        return b"".join(out)

    class Listener:
        def on_settings(self) -> None: ...
        def on_stream_closed(self) -> None: ...
        def on_goaway(self) -> None: ...
        def on_ping_ack(self, payload: bytes) -> None: ...
        def on_fatal(self, message: str) -> None: ...

    loop = asyncio.new_event_loop()
    sink: list[bytes] = []
    conn = H2Connection(sink.append, Listener())
    conn.start()
    conn.receive(ours.settings_frame({}))
    block = ours.RequestHeaders("127.0.0.1:1").block("/x/Generate", 5.0)
    # one read per message (worst case: a wake-up per token) and one read for the whole stream
    for label, split in (("one read per frame", True), ("one read per stream", False)):
        t0 = time.process_time()
        for _ in range(reps):
            s = GrpcStream(loop)
            conn.open_stream(s, block, b"\0\0\0\0\0")
            data = server_bytes(s.stream_id)
            if split:
                off = 0
                while off < len(data):
                    ln = int.from_bytes(data[off : off + 3], "big") + 9
                    conn.receive(data[off : off + ln])
                    off += ln
            else:
                conn.receive(data)
            s.messages.clear()
        ours_us = (time.process_time() - t0) / reps * 1e6

        h2_us = _h2_library_us(server_bytes, split, reps)
        assert conn.failed is None, conn.failed
        theirs = (
            "h2 not installed"
            if h2_us is None
            else f"h2 {h2_us:7.1f} µs/stream ({h2_us / 32:5.2f}/msg; events only, no gRPC message parsing)"
        )
        print(f"{label:<20}: ours {ours_us:7.1f} µs/stream ({ours_us / 32:5.2f}/msg)   {theirs}")
    loop.close()


def _h2_library_us(server_bytes: Callable[[int], bytes], split: bool, reps: int) -> float | None:
    """The same response through the ``h2`` package's state machine (optional: not a dependency)."""
    try:
        h2config: Any = importlib.import_module("h2.config")
        h2connection: Any = importlib.import_module("h2.connection")
        h2events: Any = importlib.import_module("h2.events")
    except ImportError:
        return None
    from shepherd.node.engines import h2_frames as ours

    hc = h2connection.H2Connection(h2config.H2Configuration(client_side=True, header_encoding=None))
    hc.initiate_connection()
    hc.receive_data(ours.settings_frame({}))
    hc.data_to_send()
    t0 = time.process_time()
    for _ in range(reps):
        sid = hc.get_next_available_stream_id()
        hc.send_headers(
            sid, [(":method", "POST"), (":scheme", "http"), (":path", "/x/Generate"), (":authority", "a")]
        )
        hc.send_data(sid, b"\0\0\0\0\0", end_stream=True)
        data = server_bytes(sid)
        chunks = []
        if split:
            off = 0
            while off < len(data):
                ln = int.from_bytes(data[off : off + 3], "big") + 9
                chunks.append(data[off : off + ln])
                off += ln
        else:
            chunks.append(data)
        for c in chunks:
            for ev in hc.receive_data(c):
                if isinstance(ev, h2events.DataReceived):
                    hc.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        hc.data_to_send()
    return (time.process_time() - t0) / reps * 1e6


# ---------------------------------------------------------------------------------------------- gateway path


def _prompts(count: int) -> list[Any]:
    """Real prompt ids (PromptIds, with their pieces): qwen3 ChatML, one system prompt, distinct users."""
    from shepherd.loadgen.prompts import SYSTEM_PROMPT, PromptConfig, PromptFactory
    from shepherd.tokens.tokenizer import Tokenizer

    tok = Tokenizer.load(ROOT / "shepherd" / "tokens" / "assets" / "qwen3")
    pf = PromptFactory(PromptConfig())
    out = []
    for i in range(count):
        text = (
            f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{pf.user_message(i)}"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        out.append(tok.encode(text))
    return out


async def _gateway_path(
    reps: int, rounds: int, tokens: int, kind: str, scenarios: list[str], profile: bool
) -> None:
    from smg_grpc_proto import sglang_scheduler_pb2 as sg
    from smg_grpc_proto import vllm_engine_pb2 as vl

    from shepherd.node.config import build_config
    from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
    from shepherd.node.dispatch.gateway import Gateway
    from shepherd.node.dispatch.workers import Worker
    from shepherd.node.engines import h2_frames as h2
    from shepherd.node.engines.h2_stream import grpc_message
    from shepherd.proto.engine_types import EngineComplete, GenerateRequest, SamplingParams
    from shepherd.proto.prompt_ids import PromptIds
    from tests.fake_h2_engine import HEAD, canned_engine, trailers

    loop = asyncio.get_running_loop()
    pb: Any = vl if kind == "vllm" else sg
    out_ids = list(range(1000, 1000 + tokens))
    rid = {"request_id": "chatcmpl-0123456789abcdef0123"} if kind == "sglang" else {}
    complete = pb.GenerateResponse(
        **rid,
        complete=pb.GenerateComplete(
            output_ids=out_ids, finish_reason="length", prompt_tokens=235, completion_tokens=tokens
        ),
    ).SerializeToString()
    chunks = [
        pb.GenerateResponse(
            **rid,
            chunk=pb.GenerateStreamChunk(token_ids=[t], prompt_tokens=235, completion_tokens=i + 1),
        ).SerializeToString()
        for i, t in enumerate(out_ids)
    ]
    end = pb.GenerateResponse(
        **rid,
        complete=pb.GenerateComplete(finish_reason="length", prompt_tokens=235, completion_tokens=tokens),
    ).SerializeToString()
    ok = trailers()
    mode = {"stream": False}

    def reply(sid: int) -> list[bytes]:
        hf = h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, sid, HEAD)
        tf = h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, sid, ok)
        if not mode["stream"]:
            return [hf + h2.frame(h2.DATA, 0, sid, grpc_message(complete)) + tf]
        reads = [hf + h2.frame(h2.DATA, 0, sid, grpc_message(chunks[0]))]
        reads += [h2.frame(h2.DATA, 0, sid, grpc_message(c)) for c in chunks[1:]]
        reads.append(h2.frame(h2.DATA, 0, sid, grpc_message(end)) + tf)
        return reads

    client, proto = canned_engine(loop, reply, max_streams=1000, kind=kind)
    gw = Gateway(build_config({}, {"policy": "round_robin"}))
    w = Worker(
        id="w0",
        url=client.url,
        model="qwen3",
        client=client,
        health=HealthTracker(healthy=True, checked=True),
        breaker=CircuitBreaker(),
    )
    gw.registry.workers[w.id] = w
    prompts = _prompts(64)
    counter = 0

    def prompt(i: int) -> Any:
        """A prompt whose user message is new (as in a fleet: the system prompt repeats, the last user
        turn does not): one of the real prompts, its user piece renamed (same ids, a text not seen)."""
        base = prompts[i % len(prompts)]
        shape = tuple((f"{t}#{i}" if t.startswith("user") else t, n) for t, n in base.shape)
        return PromptIds(base, shape)

    async def one() -> None:
        nonlocal counter
        counter += 1
        # a fresh SamplingParams per request, as the handlers build it
        sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=tokens, ignore_eos=True)
        gen = GenerateRequest(f"chatcmpl-{counter:028x}", prompt(counter), sampling, stream=mode["stream"])
        es = await gw.open_stream("qwen3", gen)
        try:
            async for batch in es.batches():
                if any(type(ev) is EngineComplete for ev in batch):
                    es.completed = True
                    break
        finally:
            await es.close("done")

    async def run(n: int, conc: int) -> None:
        per = [n // conc + (1 if i < n % conc else 0) for i in range(conc)]

        async def worker(k: int) -> None:
            for _ in range(k):
                await one()

        await asyncio.gather(*(worker(k) for k in per if k))

    print(
        f"gateway engine path, in-process fake {kind} server: CPU µs per request "
        f"(best of {rounds} rounds of {reps}; {tokens}-token outputs, ~235-id prompts)"
    )
    prof: Any = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    for stream in (False, True):
        if ("stream" if stream else "non-stream") not in scenarios:
            continue
        mode["stream"] = stream
        for conc in (1, 32):
            await run(200, conc)  # warm-up
            best = float("inf")
            for _ in range(rounds):
                if prof is not None:
                    prof.enable()
                t0 = time.process_time()
                await run(reps, conc)
                best = min(best, (time.process_time() - t0) / reps * 1e6)
                if prof is not None:
                    prof.disable()
            label = f"stream ({tokens} reads)" if stream else "non-stream"
            print(f"  {label:<18} conc {conc:>3}: {best:7.1f} µs/req")
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    assert w.in_flight == 0 and not proto.conn.streams, "requests left open"
    await client.close()


def codec_micro(reps: int) -> None:
    """GenerateRequest encoding, interleaved in one process: the protobuf message (``sglang_generate(req)
    .SerializeToString()``, what the h2 client sent before) vs ``sglang_generate_bytes``; single-turn
    chats (a new user message each) and an 8-turn conversation whose earlier turns recur."""
    from shepherd.proto.engine_requests import sglang_generate, sglang_generate_bytes
    from shepherd.proto.engine_types import GenerateRequest, SamplingParams
    from shepherd.proto.prompt_ids import PromptIds

    prompts = _prompts(64)

    def single(i: int) -> Any:
        base = prompts[i % len(prompts)]
        return PromptIds(base, tuple((f"{t}#{i}" if t.startswith("user") else t, n) for t, n in base.shape))

    sys_shape = prompts[0].shape[:4]  # BOS marker, <|im_start|>, the system prompt, \n<|im_start|>
    sys_ids = list(prompts[0][: sum(n for _, n in sys_shape)])
    by_text: dict[str, list[int]] = {}

    def seg(text: str, n: int) -> list[int]:  # a piece's ids: the same list for the same text, as L1 has it
        return by_text.setdefault(text, [(zlib.crc32(text.encode()) + j * 7919) % 150_000 for j in range(n)])

    def multi(i: int) -> Any:
        """Request i: turn i % 8 of conversation i // 8 (earlier turns recur, the last user turn is new)."""
        conv, turn = divmod(i, 8)
        shape = list(sys_shape)
        ids = list(sys_ids)
        for k in range(turn + 1):
            user = f"user\n(conversation {conv}, turn {k})<|im_end|>"
            ids += [*seg(user, 160), 198, 151644]
            shape += [(user, 160), ("\n<|im_start|>", 2)]
            if k < turn:
                answer = f"assistant\n(answer {conv}.{k})<|im_end|>"
                ids += [*seg(answer, 60), 198, 151644]
                shape += [(answer, 60), ("\n<|im_start|>", 2)]
        shape.append(("assistant\n", 2))
        ids += [77091, 198]
        return PromptIds(ids, tuple(shape))

    for label, make in (("single-turn", single), ("8-turn conversations", multi)):
        best = {"message": float("inf"), "bytes": float("inf")}
        start = 0
        n_ids = 0.0
        for _ in range(5):
            for name, fn in (
                ("message", lambda r: sglang_generate(r).SerializeToString()),
                ("bytes", sglang_generate_bytes),
            ):
                # requests never seen before (a user turn repeated by the bench would be a piece seen twice)
                reqs = [
                    GenerateRequest(
                        f"chatcmpl-{i:028x}", make(i), SamplingParams(temperature=0.7, max_new_tokens=32)
                    )
                    for i in range(start, start + reps)
                ]
                start += reps
                n_ids = sum(len(r.input_ids) for r in reqs) / len(reqs)
                t0 = time.process_time()
                for r in reqs:
                    fn(r)
                best[name] = min(best[name], (time.process_time() - t0) / len(reqs) * 1e6)
                same = (sglang_generate_bytes(r) == sglang_generate(r).SerializeToString() for r in reqs)
                assert all(same)
        print(
            f"{label:<22} ({n_ids:6.0f} ids/request): message {best['message']:6.1f} µs   "
            f"bytes {best['bytes']:6.1f} µs   (best of 5 interleaved rounds of {reps})"
        )


def gateway_path(args: argparse.Namespace) -> None:
    main = _gateway_path(
        args.requests * 5, args.rounds * 2 - 1, args.tokens, args.kind, args.scenarios, args.profile
    )
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="h2", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="sglang", choices=("sglang", "vllm"))
    ap.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    ap.add_argument("--requests", type=int, default=400, help="stream requests per scenario (non-stream: 2x)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    ap.add_argument(
        "--paced",
        type=float,
        default=None,
        metavar="MS",
        help="engine decode time per token instead of --zero-latency (tokens then arrive one read each)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (median reported)")
    ap.add_argument("--micro", action="store_true", help="only the frame-parsing micro benchmark")
    ap.add_argument("--micro-reps", type=int, default=2000)
    ap.add_argument("--gateway", action="store_true", help="only the in-process Gateway.open_stream path")
    ap.add_argument(
        "--scenarios", type=lambda s: s.split(","), default=["non-stream", "stream"], help="with --gateway"
    )
    ap.add_argument("--profile", action="store_true", help="with --gateway: cProfile the measured rounds")
    ap.add_argument("--codec", action="store_true", help="only GenerateRequest encoding: message vs bytes")
    args = ap.parse_args()
    if args.worker:
        worker(args)
    elif args.micro:
        micro(args.micro_reps)
    elif args.gateway:
        gateway_path(args)
    elif args.codec:
        codec_micro(args.requests * 5)
    else:
        main_driver(args)


if __name__ == "__main__":
    main()
