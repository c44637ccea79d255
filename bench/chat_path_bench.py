"""CPU per NON-streamed chat request through the whole node, in one process, without sockets.

The non-stream twin of ``stream_path_bench.py`` (the ``chat`` workload of ``smg-bench gateway``): the lean
HTTP server (``_Conn`` over httptools), the aiohttp app's middlewares and ``/v1/chat/completions``
handler, the tokenizer service (inline encodes of ~250-token qwen3 ChatML prompts, every user message
new), the gateway's routing and the lean HTTP/2 engine client. Only the sockets are fakes: each HTTP
connection's transport collects what the node writes, and the engine's transport answers each Generate
call, on the next loop turn, with pre-built frames as the zero-latency mock engine sends a non-streamed
answer (one ``GenerateComplete`` holding every output id, then the OK trailers, in one read).

    .venv/bin/python bench/chat_path_bench.py                     # c=32, best of 5 rounds of 2000
    .venv/bin/python bench/chat_path_bench.py --rounds 7 --reps 3000
    .venv/bin/python bench/chat_path_bench.py --profile           # cProfile of the rounds

CPU µs per request is ``time.process_time`` over a round / requests (best of ``--rounds``); it includes
the fakes' own small cost (printed apart). Prints figures only; no asserts on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_SID = struct.Struct(">I")


class _HttpClientTransport:
    """The client side of one HTTP connection: collects the node's writes; ``done`` resolves on the
    write that completes a response (head and Content-Length body)."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] | None = None
        self.writes = 0
        self.bytes = 0
        self.last = b""
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)
        self.last = data
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


class _EngineTransport:
    """The engine side of the HTTP/2 connection: every request HEADERS frame is answered, on the next
    loop turn, by ``reply(stream id)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reply: Any) -> None:
        self.loop = loop
        self.reply = reply
        self.proto: Any = None
        self.closing = False

    def write(self, data: bytes) -> None:
        from shepherd.node import h2_conn as h2

        off = len(h2.PREFACE) if data.startswith(h2.PREFACE) else 0
        n = len(data)
        received = 0
        while n - off >= 9:
            length = int.from_bytes(data[off : off + 3], "big")
            ftype = data[off + 3]
            if ftype == h2.HEADERS:
                sid = int.from_bytes(data[off + 5 : off + 9], "big") & 0x7FFFFFFF
                self.loop.call_soon(self._deliver, self.reply(sid))
            elif ftype == h2.DATA:
                received += length
            off += 9 + length
        if received:  # credit the connection window back, as a server does
            self.loop.call_soon(self._deliver, h2.window_update_frame(0, received))

    def _deliver(self, data: bytes) -> None:
        if not self.closing:
            self.proto.data_received(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


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


class _Reply:
    """Pre-built response frames of a non-streamed answer; only the stream ids change."""

    def __init__(self, tokens: list[int], prompt_tokens: int) -> None:
        from smg_grpc_proto import sglang_scheduler_pb2 as sg

        from shepherd.node import h2_conn as h2
        from shepherd.node.engine_h2 import grpc_message

        rid = "chatcmpl-0123456789ab1f.0123456789ab20"
        msg = sg.GenerateResponse(
            request_id=rid,
            complete=sg.GenerateComplete(
                output_ids=tokens,
                finish_reason="length",
                prompt_tokens=prompt_tokens,
                completion_tokens=len(tokens),
                cached_tokens=64,
            ),
        ).SerializeToString()
        head = b"\x88" + h2.hpack_literal(31, b"application/grpc")
        trailers = h2.hpack_literal(b"grpc-status", b"0")
        frames = [
            h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, 1, head),
            h2.frame(h2.DATA, 0, 1, grpc_message(msg)),
            h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, 1, trailers),
        ]
        self.read = b"".join(frames)
        self.offs = []
        off = 0
        while off < len(self.read):
            self.offs.append(off + 5)
            off += 9 + int.from_bytes(self.read[off : off + 3], "big")

    def __call__(self, sid: int) -> bytes:
        b = bytearray(self.read)
        pack = _SID.pack_into
        for o in self.offs:
            pack(b, o, sid)
        return bytes(b)


async def _main(args: argparse.Namespace) -> None:
    from shepherd.loadgen.http1 import RequestTemplate
    from shepherd.loadgen.prompts import ChatRequestSource, ChatShape, PromptConfig, PromptFactory
    from shepherd.node import gc_tuning
    from shepherd.node import h2_conn as h2
    from shepherd.node.app import build_app
    from shepherd.node.circuit_breaker import CircuitBreaker, HealthTracker
    from shepherd.node.config import build_config
    from shepherd.node.engine_h2 import H2EngineClient
    from shepherd.node.gateway import Gateway
    from shepherd.node.http_server import LeanServer, _Conn
    from shepherd.node.workers import Worker

    loop = asyncio.get_running_loop()
    gw = Gateway(build_config({}, {"policy": "round_robin", "tokenizer_workers": 0}))
    await gw.tokenizers.start()
    model = gw.model_names()[0]
    tok = gw.tokenizer(model)
    reply = _Reply(_answer_ids(tok.hf, args.tokens), 254)

    client = H2EngineClient("grpc://127.0.0.1:1", "127.0.0.1:1", "sglang")
    proto = h2.H2Protocol(loop, keepalive_s=0)
    etr = _EngineTransport(loop, reply)
    etr.proto = proto
    proto.connection_made(etr)  # type: ignore[arg-type]
    proto.data_received(h2.settings_frame({h2.SETTINGS_MAX_CONCURRENT_STREAMS: 4096}))
    client._proto = proto
    w = Worker(
        id="w0",
        url=client.url,
        model=model,
        client=client,
        health=HealthTracker(healthy=True, checked=True),
        breaker=CircuitBreaker(),
    )
    gw.registry.workers[w.id] = w
    app = build_app(gw)
    srv = LeanServer(app, max_body=gw.cfg.max_body_bytes)
    gc_tuning.settle(gw.cfg.gc_gen0_threshold)  # as the node does once started

    factory = PromptFactory(PromptConfig(prompt_tokens=250), lambda s: len(tok.hf.encode(s).ids))
    template = RequestTemplate("127.0.0.1", 8000, "/v1/chat/completions")
    source = ChatRequestSource(
        factory, template, ChatShape(model=model, max_tokens=args.tokens, stream=False)
    )
    bodies = [source.body_of(i) for i in range(100_000, 100_000 + args.reps * (args.rounds + 1) + 400)]
    requests = [template.render(b) for b in bodies]
    nxt = {"i": 0}

    conns = []
    for _ in range(args.concurrency):
        t = _HttpClientTransport()
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

    # check one answer: a 200 with a chat.completion body
    c0, t0 = conns[0]
    await one(c0, t0)
    assert t0.last.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in t0.last, t0.last[:600]
    if args.show:
        print(t0.last.decode())

    prof: Any = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    print(
        f"node non-stream chat path, in-process (lean HTTP server + app + H2 engine client, fake sockets): "
        f"CPU µs per request, best of {args.rounds} rounds of {args.reps}, c={args.concurrency}, "
        f"{args.tokens} tokens"
    )
    await run(300)  # warm-up
    if args.pause:  # e.g. for ``callgrind_control -i on PID`` (valgrind --instr-atstart=no): exact counts
        print("READY", flush=True)
        await asyncio.sleep(args.pause)
    best = float("inf")
    results = []
    writes0 = sum(t.writes for _, t in conns)
    for _ in range(args.rounds):
        if prof is not None:
            prof.enable()
        t_start = time.process_time()
        await run(args.reps)
        us = (time.process_time() - t_start) / args.reps * 1e6
        if prof is not None:
            prof.disable()
        results.append(us)
        best = min(best, us)
    writes = (sum(t.writes for _, t in conns) - writes0) / (args.reps * args.rounds)
    t_start = time.process_time()
    for sid in range(1, 2001, 2):
        reply(sid)
    fake = (time.process_time() - t_start) / 1000 * 1e6
    rs = " ".join(f"{r:.0f}" for r in results)
    print(
        f"  chat  : best {best:7.1f} µs/req  (rounds {rs}; fake engine {fake:.1f} µs of it; "
        f"{writes:.1f} HTTP writes/req)"
    )
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_rows)
    assert w.in_flight == 0 and not proto.conn.streams, "requests left open"
    await client.close()
    await gw.tokenizers.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=60)
    p.add_argument("--show", action="store_true", help="print one response")
    p.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after the warm-up")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
