"""CPU per chat request through the whole node, in one process, without sockets: streamed or not.

The node's real pieces: the lean HTTP server (``_Conn`` over httptools), the aiohttp app's middlewares
and ``/v1/chat/completions`` handler, the tokenizer service (inline encodes of ~250-token qwen3 ChatML
prompts, every user message new), the gateway's routing and the lean HTTP/2 engine client. Only the
sockets are fakes: each HTTP connection's transport collects what the node writes, and the engine's
transport (tests/fake_h2_engine.py) answers each Generate call, on the next loop turn, with pre-built
frames as the mock engine sends them.

Workloads (those of ``smg-bench gateway``):

- ``chat``: non-streamed, as the zero-latency mock engine answers it (one ``GenerateComplete`` holding
  every output id, then the OK trailers, in one read); the node writes head and body at once.
- ``stream``: SGLang chunks of one token each, then the complete and the OK trailers, in the scenarios
  (``--scenarios``) ``burst`` (the whole answer in one read, as the zero-latency mock engine delivers
  it) and ``paced`` (one read per token, one loop turn apart: an engine whose tokens come with an
  inter-token latency; each token is one SSE write).

    .venv/bin/python bench/node_path_bench.py --workload chat     # c=32, best of 5 rounds of 2000
    .venv/bin/python bench/node_path_bench.py --workload chat --rounds 7 --reps 3000
    .venv/bin/python bench/node_path_bench.py --workload stream   # both scenarios, c=32
    .venv/bin/python bench/node_path_bench.py --workload stream --scenarios burst --rounds 7 --reps 2000
    .venv/bin/python bench/node_path_bench.py --workload chat --profile   # cProfile (chat or burst rounds)
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.out \\
        .venv/bin/python bench/node_path_bench.py --workload stream --callgrind --scenarios burst \\
        --reps 400 --rounds 1
        # instructions of the measured rounds only (/tmp/cg.out.1 "totals:" / reps): deterministic, so
        # two trees compare exactly on a noisy machine (run under PYTHONHASHSEED=0); or ``--pause S``
        # and ``callgrind_control -i on PID`` by hand

CPU µs per request is ``time.process_time`` over a round / requests (best of ``--rounds``); it includes
the fakes' own small cost (printed apart). Prints figures only; no asserts on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_h2_engine import HEAD, FakeTransport, canned_worker, trailers  # noqa: E402

_SID = struct.Struct(">I")


class _HttpClientTransport(FakeTransport):
    """The client side of one HTTP connection: collects the node's writes; ``done`` resolves on the write
    that ends a response: any write (``chunked`` False: head and Content-Length body are written at
    once) or the end of a chunked body."""

    def __init__(self, chunked: bool) -> None:
        super().__init__()
        self.chunked = chunked
        self.done: asyncio.Future[None] | None = None
        self.writes = 0
        self.bytes = 0
        self.last = b""
        self.record: bytearray | None = None  # every byte written, while set

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)
        self.last = data
        if self.record is not None:
            self.record += data
        if (
            (not self.chunked or data.endswith(b"0\r\n\r\n"))
            and self.done is not None
            and not self.done.done()
        ):
            self.done.set_result(None)

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


def _write(path: str, data: bytes) -> None:
    Path(path).write_bytes(data)


def _callgrind(*args: str) -> None:
    """Tell the callgrind running this process (instrumentation on/off, dump)."""
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def _answer_ids(tok: Any, n: int) -> list[int]:
    text = (
        "The capital of France is Paris, a city known for its museums, its cafés and the long walks "
        "along the Seine; visitors often start at the Louvre and end the day near the Eiffel Tower, "
        "where the lights sparkle every hour after dark."
    )
    ids: list[int] = list(tok.encode(text, add_special_tokens=False).ids)
    while len(ids) < n:
        ids += ids
    return ids[:n]


_RID = "chatcmpl-0123456789ab1f.0123456789ab20"


def _complete(tokens: list[int], prompt_tokens: int) -> list[bytes]:
    """A non-streamed answer: one GenerateComplete with every output id."""
    from smg_grpc_proto import sglang_scheduler_pb2 as sg

    complete = sg.GenerateComplete(
        output_ids=tokens,
        finish_reason="length",
        prompt_tokens=prompt_tokens,
        completion_tokens=len(tokens),
        cached_tokens=64,
    )
    return [sg.GenerateResponse(request_id=_RID, complete=complete).SerializeToString()]


def _chunks(tokens: list[int], prompt_tokens: int) -> list[bytes]:
    """A streamed answer: a chunk of one token each, then the complete."""
    from smg_grpc_proto import sglang_scheduler_pb2 as sg

    msgs = [
        sg.GenerateResponse(
            request_id=_RID,
            chunk=sg.GenerateStreamChunk(
                token_ids=[t],
                prompt_tokens=prompt_tokens,
                completion_tokens=i + 1,
                cached_tokens=64 if i == 0 else 0,
            ),
        ).SerializeToString()
        for i, t in enumerate(tokens)
    ]
    complete = sg.GenerateComplete(
        finish_reason="length", prompt_tokens=prompt_tokens, completion_tokens=len(tokens)
    )
    msgs.append(sg.GenerateResponse(request_id=_RID, complete=complete).SerializeToString())
    return msgs


class _Replies:
    """Pre-built response frames of ``messages`` (head, a DATA frame each, OK trailers): one read, or
    (``paced``) one read per message; only the stream ids change (patched into a copy per call)."""

    def __init__(self, messages: list[bytes], paced: bool) -> None:
        from shepherd.node.engines import h2_frames as h2
        from shepherd.node.engines.h2_stream import grpc_message

        frames = [h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, 1, HEAD)]
        frames += [h2.frame(h2.DATA, 0, 1, grpc_message(m)) for m in messages]
        frames.append(h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, 1, trailers()))
        if paced:  # headers with the first message, the last with the trailers
            reads = [frames[0] + frames[1], *frames[2:-2], frames[-2] + frames[-1]]
        else:
            reads = [b"".join(frames)]
        self.reads: list[tuple[bytes, list[int]]] = []
        for r in reads:
            offs = []
            off = 0
            while off < len(r):
                offs.append(off + 5)
                off += 9 + int.from_bytes(r[off : off + 3], "big")
            self.reads.append((r, offs))

    def __call__(self, sid: int) -> list[bytes]:
        out = []
        pack = _SID.pack_into
        for r, offs in self.reads:
            b = bytearray(r)
            for o in offs:
                pack(b, o, sid)
            out.append(bytes(b))
        return out


def _tracing_on(ratio: str) -> Any:
    """Tracing on as ``--otlp-traces-endpoint`` turns it on, at sampling ratio ``ratio``
    (``traceidratio``), with the OTLP gRPC exporter's encoding (``otlp_wire``: the request's bytes as the
    node's exporter sends them) but no socket: the spans are made, queued, batched and encoded by the
    exporter thread. Returns the provider's ``force_flush``."""
    import random

    from opentelemetry.sdk.trace.export import SpanExportResult

    from shepherd.node.observe import otlp_wire, tracing

    random.seed(0)  # the SDK's trace ids (and so the ratio sampler's choices): the same every run
    os.environ["OTEL_TRACES_SAMPLER"] = "traceidratio"
    os.environ["OTEL_TRACES_SAMPLER_ARG"] = ratio

    class SinkExporter:
        takes_lean = True  # as the node's gRPC exporter: the lean spans encoded as they are

        def __init__(self) -> None:
            self.grpc = otlp_wire.lean_grpc_exporter(endpoint="http://127.0.0.1:9")
            self.bytes = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.bytes += len(self.grpc._translate_data(spans))  # the request's bytes, as gRPC sends them
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None: ...

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    tracing._exporter = lambda s: SinkExporter()
    tracing.setup(tracing.TraceSettings("http://127.0.0.1:9", "grpc"), "bench")
    return lambda: tracing._provider.force_flush()


async def _main(args: argparse.Namespace) -> None:
    from shepherd.loadgen.http1 import RequestTemplate
    from shepherd.loadgen.prompts import ChatRequestSource, ChatShape, PromptConfig, PromptFactory
    from shepherd.node import gc_tuning
    from shepherd.node.app import build_app
    from shepherd.node.config import build_config
    from shepherd.node.dispatch.gateway import Gateway
    from shepherd.node.http.connection import _Conn
    from shepherd.node.http.server import LeanServer

    stream = args.workload == "stream"
    scenarios: list[str] = args.scenarios.split(",") if stream else ["chat"]
    loop = asyncio.get_running_loop()
    flush = _tracing_on(args.trace_ratio) if args.trace_ratio is not None else None
    gw = Gateway(build_config({}, {"policy": "round_robin", "tokenizer_workers": 0}))
    await gw.tokenizers.start()
    model = gw.model_names()[0]
    tok = gw.tokenizer(model)
    ids = _answer_ids(tok.hf, args.tokens)
    if stream:
        replies = {
            "burst": _Replies(_chunks(ids, 254), paced=False),
            "paced": _Replies(_chunks(ids, 254), paced=True),
        }
    else:
        replies = {"chat": _Replies(_complete(ids, 254), paced=False)}
    mode = {"reply": replies[scenarios[0]]}

    w, client, proto = canned_worker(loop, model, lambda sid: mode["reply"](sid), max_streams=4096)
    gw.registry.workers[w.id] = w
    app = build_app(gw)
    srv = LeanServer(app, max_body=gw.cfg.max_body_bytes)
    gc_tuning.settle(gw.cfg.gc_gen0_threshold)  # as the node does once started

    factory = PromptFactory(
        PromptConfig(prompt_tokens=args.prompt_tokens), lambda s: len(tok.hf.encode(s).ids)
    )
    template = RequestTemplate("127.0.0.1", 8000, "/v1/chat/completions")
    source = ChatRequestSource(
        factory, template, ChatShape(model=model, max_tokens=args.tokens, stream=stream)
    )
    bodies = [source.body_of(i) for i in range(100_000, 100_000 + args.reps * (args.rounds + 1) + 400)]
    requests = [template.render(b) for b in bodies]
    nxt = {"i": 0}

    conns = []
    for _ in range(args.concurrency):
        t = _HttpClientTransport(chunked=stream)
        c = _Conn(srv)
        c.connection_made(t)  # type: ignore[arg-type]
        conns.append((c, t))

    async def one(c: Any, t: _HttpClientTransport) -> None:
        i = nxt["i"]
        nxt["i"] = i + 1
        t.done = loop.create_future()
        c.data_received(requests[i % len(requests)])
        await t.done

    async def run(n: int) -> None:
        conc = len(conns)
        per = [n // conc + (1 if i < n % conc else 0) for i in range(conc)]

        async def worker(k: int, c: Any, t: _HttpClientTransport) -> None:
            for _ in range(k):
                await one(c, t)

        await asyncio.gather(*(worker(k, c, t) for k, (c, t) in zip(per, conns, strict=True) if k))

    # check one answer (of the first scenario): a 200 with a chat.completion body, or well-formed SSE
    # with content, usage and [DONE]
    c0, t0 = conns[0]
    t0.record = bytearray()
    await one(c0, t0)
    if stream:
        assert b"data: [DONE]" in t0.last and b'"usage"' in t0.last, t0.last[-300:]
    else:
        assert t0.last.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in t0.last, t0.last[:600]
    if args.show:
        print(t0.record.decode())
    if args.response_to:  # the answer's bytes (head and body), to compare trees
        _write(args.response_to, bytes(t0.record))
    t0.record = None

    prof: Any = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    print(
        f"node {'stream' if stream else 'non-stream chat'} path, in-process (lean HTTP server + app + "
        f"H2 engine client, fake sockets): CPU µs per request, best of {args.rounds} rounds of "
        f"{args.reps}, c={args.concurrency}, {args.tokens} tokens"
    )
    for name in scenarios:
        mode["reply"] = replies[name]
        await run(300)  # warm-up
        if args.pause:  # e.g. for ``callgrind_control -i on PID`` (valgrind --instr-atstart=no)
            print("READY", flush=True)
            await asyncio.sleep(args.pause)
        profiled = prof is not None and (len(scenarios) == 1 or name in ("chat", "burst"))
        best = float("inf")
        results = []
        writes0 = sum(t.writes for _, t in conns)
        if flush is not None:  # the warm-up's spans exported before the measured rounds
            flush()
        if args.callgrind:  # count instructions of the measured rounds only (run under valgrind callgrind)
            _callgrind("-i", "on")
        for _ in range(args.rounds):
            if profiled:
                prof.enable()
            t_start = time.process_time()
            await run(args.reps)
            us = (time.process_time() - t_start) / args.reps * 1e6
            if profiled:
                prof.disable()
            results.append(us)
            best = min(best, us)
        if flush is not None:  # the measured rounds' spans encoded (by the exporter thread) in the count
            flush()
        if args.callgrind:
            _callgrind("-i", "off")
            _callgrind("-d", name)
        writes = (sum(t.writes for _, t in conns) - writes0) / (args.reps * args.rounds)
        # the fakes' own cost: building the engine's reply bytes
        reply = replies[name]
        t_start = time.process_time()
        for sid in range(1, 2001, 2):
            reply(sid)
        fake = (time.process_time() - t_start) / 1000 * 1e6
        rs = " ".join(f"{r:.0f}" for r in results)
        print(
            f"  {name:<6}: best {best:7.1f} µs/req  (rounds {rs}; fake engine {fake:.1f} µs of it; "
            f"{writes:.1f} HTTP writes/req)"
        )
    if prof is not None:
        import pstats

        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.profile_rows)
        if args.dump:
            st.dump_stats(args.dump)
    assert w.in_flight == 0 and not proto.conn.streams, "requests left open"
    await client.close()
    await gw.tokenizers.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("chat", "stream"), required=True)
    p.add_argument("--scenarios", default=None, help="stream: burst,paced (the default), or one of them")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=250, help="rendered prompt size (default 250)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile of the chat or burst rounds (or of the one scenario given)",
    )
    p.add_argument("--profile-rows", type=int, default=None, help="default: 60 (chat), 45 (stream)")
    p.add_argument("--dump", default="", help="with --profile: write the pstats file here")
    p.add_argument("--show", action="store_true", help="print one response")
    p.add_argument(
        "--trace-ratio",
        default=None,
        help="tracing on at this sampling ratio (traceidratio), spans encoded as the OTLP gRPC exporter "
        "does, no socket (default: tracing off)",
    )
    p.add_argument("--response-to", default="", help="write the checked answer's bytes to this file")
    p.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each warm-up")
    p.add_argument(
        "--callgrind",
        action="store_true",
        help="under valgrind --tool=callgrind --instr-atstart=no: instrument the measured rounds only",
    )
    args = p.parse_args()
    if args.workload == "chat" and args.scenarios is not None:
        p.error("--scenarios is for --workload stream")
    if args.scenarios is None:
        args.scenarios = "burst,paced"
    if any(s not in ("burst", "paced") for s in args.scenarios.split(",")):
        p.error(f"--scenarios: burst and/or paced, not {args.scenarios!r}")
    if args.profile_rows is None:
        args.profile_rows = 45 if args.workload == "stream" else 60
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
