"""``smg-mock-engine``: a stand-in inference engine (SGLang and vLLM gRPC services + OpenAI HTTP).

Prints ``mock engine ready grpc=HOST:PORT http=HOST:PORT pid=PID`` once serving (ports may be given
as 0 to let the OS pick), and exits cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from shepherd.mock_engine.engine import EngineCore
from shepherd.mock_engine.engine_config import DECODE_STEPS, ROLES, EngineConfig
from shepherd.mock_engine.faults import ERROR_CODES, Faults
from shepherd.mock_engine.grpc_services import GRPC_IMPLS, start_grpc_server
from shepherd.mock_engine.http_api import build_app
from shepherd.tokens.tokenizer import Tokenizer

try:
    import uvloop

    HAVE_UVLOOP = True
except ImportError:  # pragma: no cover - uvloop is a dependency; without it the mock runs on asyncio's loop
    HAVE_UVLOOP = False

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "tokens" / "assets" / "qwen3"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smg-mock-engine",
        description="A faithful stand-in for an inference engine: SGLang/vLLM gRPC services and the OpenAI "
        "HTTP surface over a simulated prefix KV cache and scheduler.",
    )
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    p.add_argument("--http-port", type=int, default=18001, help="HTTP port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="qwen3", help="served model name")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer directory")
    p.add_argument(
        "--engine", choices=("sglang", "vllm", "both"), default="both", help="gRPC services to serve"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=8192, help="KV pool size in blocks")
    p.add_argument("--max-running", type=int, default=64, help="concurrency limit (running sequences)")
    p.add_argument("--context-length", type=int, default=32_768)
    p.add_argument("--prefill-us-per-token", type=float, default=20.0, help="prefill time per uncached token")
    p.add_argument("--decode-ms-per-token", type=float, default=5.0, help="decode inter-token latency")
    p.add_argument(
        "--decode-slowdown",
        type=float,
        default=0.5,
        help="with a full batch the inter-token latency is (1 + this) times the base (linear in running)",
    )
    p.add_argument("--zero-latency", action="store_true", help="no sleeps at all (benchmarks)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens before EOS when no max is given")
    p.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per chunk when the request sets none"
    )
    p.add_argument(
        "--decode-steps",
        choices=DECODE_STEPS,
        default="request",
        help="request: each request's tokens on a clock of its own; batch: every running request's token "
        "at the engine's decode step (one every base inter-token latency), as SGLang and vLLM step a batch",
    )
    p.add_argument("--role", choices=ROLES, default="both", help="PD disaggregation role")
    p.add_argument(
        "--pd-wait-s",
        type=float,
        default=5.0,
        help="decode role: how long to wait for the prefill engine to know a request before failing it",
    )
    p.add_argument(
        "--error-rate", type=float, default=0.0, help="fraction of requests failed before any token"
    )
    p.add_argument("--error-code", choices=ERROR_CODES, default="UNAVAILABLE")
    p.add_argument("--stall-after-tokens", type=int, default=None)
    p.add_argument("--stall-seconds", type=float, default=0.0)
    p.add_argument("--slow-factor", type=float, default=1.0, help="multiply every latency")
    p.add_argument("--crash-after-requests", type=int, default=None, help="os._exit when request n+1 arrives")
    p.add_argument("--hang-before-first-token", action="store_true")
    p.add_argument(
        "--info-delay-seconds", type=float, default=0.0, help="GetModelInfo and GetServerInfo answer so late"
    )
    p.add_argument(
        "--grpc-server",
        choices=GRPC_IMPLS,
        default=os.environ.get("SMG_MOCK_GRPC_SERVER", "auto"),
        help="gRPC server: grpcio (grpc.aio, as real engines), lean (a light HTTP/2 server, for benchmarks), "
        "auto (lean with --zero-latency, else grpcio); default from $SMG_MOCK_GRPC_SERVER, else auto",
    )
    p.add_argument("--embedding-dim", type=int, default=64, help="length of the Embed / embeddings vectors")
    p.add_argument(
        "--embedding-model",
        action="store_true",
        help="report an embedding model (GetModelInfo is_generation=false); Embed is served either way",
    )
    p.add_argument(
        "--default-sampling-params",
        default="",
        help="GetModelInfo's default_sampling_params_json (the model's sampling defaults), verbatim",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="as SGLang with --skip-tokenizer-init: reported in GetServerInfo, min_new_tokens refused",
    )
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    faults = Faults(
        error_rate=args.error_rate,
        error_code=args.error_code,
        stall_after_tokens=args.stall_after_tokens,
        stall_seconds=args.stall_seconds,
        slow_factor=args.slow_factor,
        crash_after_requests=args.crash_after_requests,
        hang_before_first_token=args.hang_before_first_token,
        info_delay_seconds=args.info_delay_seconds,
    )
    return EngineConfig(
        model=args.model,
        tokenizer_path=str(Path(args.tokenizer).resolve()),
        seed=args.seed,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        max_running=args.max_running,
        context_length=args.context_length,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        decode_slowdown=args.decode_slowdown,
        zero_latency=args.zero_latency,
        output_len=args.output_len,
        stream_interval=args.stream_interval,
        decode_steps=args.decode_steps,
        role=args.role,
        pd_wait_s=args.pd_wait_s,
        host=args.host,
        engine_id=f"mock-{os.getpid()}",
        embedding_dim=args.embedding_dim,
        embedding_model=args.embedding_model,
        default_sampling_params_json=args.default_sampling_params,
        skip_tokenizer_init=args.skip_tokenizer_init,
        faults=faults,
    )


async def serve(
    config: EngineConfig, grpc_port: int, http_port: int, engines: Sequence[str], grpc_impl: str = "auto"
) -> None:
    tokenizer = Tokenizer.load(config.tokenizer_path, name=config.model)
    core = EngineCore(config, tokenizer)
    server, bound_grpc = await start_grpc_server(core, config.host, grpc_port, engines, grpc_impl)
    # handler_cancellation: a client that disconnects cancels its handler, which frees the request's slot
    runner = web.AppRunner(
        build_app(core, tokenizer), access_log=None, handle_signals=False, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, http_port, reuse_address=True)
    await site.start()
    bound_http = http_port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound_http = int(addr[1])
            break
    core.http_port = bound_http
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = config.host
    print(
        f"mock engine ready grpc={host}:{bound_grpc} http={host}:{bound_http} pid={os.getpid()}", flush=True
    )
    try:
        await stop.wait()
    finally:
        await server.stop(grace=0.5)
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"smg-mock-engine: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    engines = ("sglang", "vllm") if args.engine == "both" else (args.engine,)
    if HAVE_UVLOOP and not args.no_uvloop:
        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, args.grpc_port, args.http_port, engines, args.grpc_server))


if __name__ == "__main__":
    main()
