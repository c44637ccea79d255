"""The processes a gateway benchmark runs: the mock engine and the gateways put in front of it.

Each ``*_spec`` function returns a ``ProcSpec`` (argv, CPU pinning, readiness probe); ``Target``
says where the load goes and which process tree is the gateway's. Peers (the Rust ``smg``, LiteLLM)
run from their own venvs under ``bench/.peers/`` made by ``bench/peers/setup.sh``.
"""

from __future__ import annotations

import lzma
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shepherd.loadgen.procs import ProcSpec

QWEN3_ASSETS = Path(__file__).resolve().parent.parent / "tokens" / "assets" / "qwen3"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
PEERS_SETUP = REPO_ROOT / "bench" / "peers" / "setup.sh"
LITELLM_KEY = "sk-smg-bench"
KNOWN_PEERS = ("smg", "litellm")


@dataclass(frozen=True, slots=True)
class Target:
    """Where a run sends its load. ``gateway_pid`` is None for the direct (engine-only) reference."""

    name: str
    host: str
    port: int
    gateway_pid: int | None
    headers: tuple[tuple[str, str], ...] = ()
    path: str = "/v1/chat/completions"


def peers_dir() -> Path:
    override = os.environ.get("SMG_BENCH_PEERS_DIR")
    return Path(override) if override else REPO_ROOT / "bench" / ".peers"


def console_script(name: str, module: str) -> list[str]:
    """argv prefix for one of our console scripts: the venv's script, else ``python -m module``."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    found = shutil.which(name)
    if found:
        return [found]
    return [sys.executable, "-m", module]


# A real model dir has an HF config.json. smg 1.13.0 looks for it on every request (its multimodal
# config cache stays cold without one) and then, about once in 30 requests, stalls one for 5 s.
MODEL_CONFIG = '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}\n'


def extract_tokenizer(dest: Path, source: Path = QWEN3_ASSETS) -> Path:
    """A model dir for every target: ``tokenizer.json`` uncompressed (peers cannot read ``.xz``),
    ``tokenizer_config.json``, and a minimal ``config.json`` unless the source has one."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name.endswith(".json.xz"):
            (dest / item.name[: -len(".xz")]).write_bytes(lzma.decompress(item.read_bytes()))
        elif item.is_file():
            shutil.copyfile(item, dest / item.name)
    if not (dest / "config.json").exists():
        (dest / "config.json").write_text(MODEL_CONFIG, encoding="utf-8")
    return dest


def mock_engine_spec(
    grpc_port: int,
    http_port: int,
    *,
    cpus: str | None,
    model: str = "qwen3",
    tokenizer_dir: Path | None = None,
    decode_ms_per_token: float = 0.0,
    stream_interval: int = 1,
    decode_steps: str = "request",
) -> ProcSpec:
    """The mock engine: zero latency (tokens in one burst) unless ``decode_ms_per_token`` paces it,
    one message per ``stream_interval`` tokens, a fixed inter-token time (no batch slowdown), each
    request's tokens on a clock of its own or (``decode_steps="batch"``) on the engine's decode steps."""
    argv = [
        *console_script("smg-mock-engine", "shepherd.mock_engine.cli"),
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--model",
        model,
        "--max-running",
        "4096",  # never the mock's queue: the benchmark measures the gateway
        "--stream-interval",
        str(stream_interval),
    ]
    if decode_ms_per_token > 0:
        # the light HTTP/2 server: grpc.aio would spend the shared engine core on 10^4 messages/s
        argv += ["--decode-ms-per-token", str(decode_ms_per_token), "--decode-slowdown", "0"]
        argv += ["--decode-steps", decode_steps]
        argv += ["--grpc-server", "lean"]
    else:
        argv.append("--zero-latency")
    if tokenizer_dir is not None:
        argv += ["--tokenizer", str(tokenizer_dir)]
    return ProcSpec(
        name="mock-engine",
        argv=tuple(argv),
        cpus=cpus,
        ready_port=http_port,
        ready_path="/health",
        ready_timeout_s=60.0,
    )


def gateway_spec(
    gateway: Literal["node", "smg"],
    name: str,
    port: int,
    worker_urls: Sequence[str],
    model_dir: Path,
    policy: str,
    extra: Sequence[str] = (),
    *,
    cpus: str | None = None,
) -> ProcSpec:
    """A gateway in front of ``worker_urls``: ours (``gateway="node"``, ``smg-node serve``) or the Rust
    original (``"smg"``, ``smg launch``), on 127.0.0.1:``port``, routing by ``policy``, logging warnings
    only, then ``extra``. Ours takes smg's flags, so one argv serves both; only the command and the
    spelling of the log level differ."""
    if gateway == "node":
        head, level = [*console_script("smg-node", "shepherd.node.cli"), "serve"], "warning"
    else:
        head, level = [str(peers_dir() / "smg" / "bin" / "smg"), "launch"], "warn"
    argv = [
        *head,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--model-path",
        str(model_dir),
        "--policy",
        policy,
        "--log-level",
        level,
        *extra,
    ]
    return ProcSpec(
        name=name,
        argv=tuple(argv),
        cpus=cpus,
        ready_port=port,
        ready_path="/readiness",
        ready_timeout_s=90.0,
    )


def smg_metrics_args(metrics_port: int) -> tuple[str, ...]:
    """smg's metrics listener on 127.0.0.1:``metrics_port``: its default, 0.0.0.0:29000, is one a second
    smg on the host would clash on."""
    return ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port))


def node_spec(
    port: int, grpc_port: int, model_dir: Path, *, cpus: str | None, extra: tuple[str, ...] = ()
) -> ProcSpec:
    url = f"grpc://127.0.0.1:{grpc_port}"
    return gateway_spec("node", "node", port, [url], model_dir, "round_robin", extra, cpus=cpus)


def smg_spec(port: int, grpc_port: int, model_dir: Path, *, cpus: str | None, metrics_port: int) -> ProcSpec:
    url = f"grpc://127.0.0.1:{grpc_port}"
    metrics = smg_metrics_args(metrics_port)
    return gateway_spec("smg", "smg", port, [url], model_dir, "round_robin", metrics, cpus=cpus)


def litellm_config(http_port: int, model: str = "qwen3") -> str:
    """A LiteLLM proxy config relaying ``model`` to the mock engine's OpenAI HTTP surface."""
    return (
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: http://127.0.0.1:{http_port}/v1\n"
        "      api_key: x\n"
        "litellm_settings:\n"
        "  drop_params: false\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
    )


def litellm_spec(port: int, config_path: Path, *, cpus: str | None) -> ProcSpec:
    exe = peers_dir() / "litellm" / "bin" / "litellm"
    argv = [str(exe), "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", "1"]
    return ProcSpec(
        name="litellm",
        argv=tuple(argv),
        cpus=cpus,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
        ready_port=port,
        ready_path="/health/liveliness",
        ready_timeout_s=180.0,
    )


def peer_installed(name: str) -> bool:
    exe = {"smg": "smg", "litellm": "litellm"}[name]
    return (peers_dir() / name / "bin" / exe).exists()
