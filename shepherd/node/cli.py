"""``smg-node``: run a gateway node. Flags mirror ``smg launch`` where the concept is the same."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smg-node", description="Shepherd gateway node")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a node")
    s.add_argument("--config", help="YAML file with the same settings (flags override it)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument(
        "--worker-urls",
        nargs="+",
        metavar="URL",
        help="engines: grpc://h:p (SGLang or vLLM, detected), sglang://h:p, vllm://h:p, http://h:p (relay)",
    )
    s.add_argument(
        "--policy", help="round_robin (default), random, power_of_two, least_load, cache_aware, ..."
    )
    s.add_argument(
        "--model-path", help="dir with tokenizer.json(.xz) + tokenizer_config.json (default: embedded qwen3)"
    )
    s.add_argument("--tokenizer-path", dest="model_path_alias", help="alias of --model-path")
    s.add_argument("--model-id", help="model name served to clients (default: the model dir's name)")
    s.add_argument("--chat-template", help="a .jinja file overriding the tokenizer's template")
    s.add_argument("--tokenizer-workers", type=int, help="tokenizer pool processes (0: all inline)")
    s.add_argument("--tokenizer-inline-max-chars", type=int)
    s.add_argument(
        "--max-payload-size", dest="max_body_bytes", type=int, help="largest request body in bytes"
    )
    s.add_argument("--request-timeout-secs", type=float)
    s.add_argument("--retry-max-retries", dest="max_retries", type=int)
    s.add_argument("--health-check-interval-secs", type=float)
    s.add_argument("--health-check-timeout-secs", type=float)
    s.add_argument("--health-failure-threshold", type=int)
    s.add_argument("--health-success-threshold", type=int)
    s.add_argument("--cb-failure-threshold", type=int)
    s.add_argument("--cb-success-threshold", type=int)
    s.add_argument("--cb-timeout-duration-secs", type=float)
    s.add_argument("--load-poll-interval-secs", type=float)
    s.add_argument("--shutdown-grace-period-secs", dest="shutdown_grace_secs", type=float)
    s.add_argument("--sse-keepalive-secs", type=float)
    s.add_argument("--stream-interval", type=int, help="ask engines for this many tokens per stream message")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "warn", "error"])
    return p


def config_from_args(argv: list[str]) -> Any:
    from shepherd.node.config import build_config, load_yaml

    args = _parser().parse_args(argv)
    values = vars(args)
    values.pop("command")
    file_values = load_yaml(values.pop("config")) if values.get("config") else {}
    values.pop("config", None)
    alias = values.pop("model_path_alias")
    if alias and not values.get("model_path"):
        values["model_path"] = alias
    if values.get("log_level") == "warn":
        values["log_level"] = "warning"
    return build_config(file_values, values)


def main(argv: list[str] | None = None) -> None:
    # grpcio reads its experiments at import: the poller-based engine costs fewer wake-ups per message
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    from shepherd.node.config import ConfigError

    try:
        cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"smg-node: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from shepherd.node.app import serve

    try:
        import uvloop

        uvloop.run(serve(cfg))
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep the node usable without it
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
