"""Node configuration: frozen dataclasses, built from embedded defaults, a YAML file and CLI flags.

YAML keys are the CLI flag names in snake_case (``worker_urls``, ``model_path``, ``policy``, ...), plus a
``models`` list for several models behind one node::

    port: 30000
    worker_urls: [grpc://10.0.0.5:50051]
    models:
      - name: qwen3
        model_path: /models/qwen3
        worker_urls: [grpc://10.0.0.6:50051]
        policy: round_robin
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shepherd.policies.simple import POLICY_NAMES

EMBEDDED_MODEL_DIR = Path(__file__).parent / "assets" / "qwen3"

WORKER_SCHEMES = ("grpc", "sglang", "vllm", "http", "https")


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    model_path: str
    worker_urls: tuple[str, ...] = ()
    chat_template: str | None = None
    policy: str | None = None  # None: the node's policy
    context_length: int | None = None  # None: from the engine, else the tokenizer


@dataclass(frozen=True, slots=True)
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    worker_urls: tuple[str, ...] = ()
    model_path: str | None = None
    model_id: str | None = None
    chat_template: str | None = None
    policy: str = "round_robin"
    engine_transport: str = "h2"  # "h2" (lean asyncio HTTP/2 gRPC client) or "grpcio"
    models: tuple[ModelConfig, ...] = ()
    tokenizer_workers: int = 2
    tokenizer_inline_max_chars: int | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    request_timeout_secs: float = 600.0
    max_retries: int = 2
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 2.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    cb_failure_threshold: int = 5
    cb_success_threshold: int = 2
    cb_timeout_duration_secs: float = 10.0
    load_poll_interval_secs: float = 2.0
    shutdown_grace_secs: float = 30.0
    sse_keepalive_secs: float = 15.0
    stream_interval: int | None = None
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict)

    def model_configs(self) -> tuple[ModelConfig, ...]:
        """The models this node serves: the ``models`` list, else one model from the top-level flags."""
        if self.models:
            return self.models
        path = self.model_path or str(EMBEDDED_MODEL_DIR)
        name = self.model_id or Path(path).name
        return (
            ModelConfig(
                name=name, model_path=path, worker_urls=self.worker_urls, chat_template=self.chat_template
            ),
        )


def check_worker_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ConfigError(f"worker URL {url!r} must look like grpc://host:port or http://host:port")
    if scheme not in WORKER_SCHEMES:
        raise ConfigError(
            f"worker URL {url!r}: unknown scheme {scheme!r} (use one of {', '.join(WORKER_SCHEMES)})"
        )
    return url


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(NodeConfig)}


def _coerce_model(raw: Any) -> ModelConfig:
    if not isinstance(raw, dict) or "name" not in raw or "model_path" not in raw:
        raise ConfigError("each entry of 'models' needs at least 'name' and 'model_path'")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown keys in model {raw.get('name')!r}: {sorted(unknown)}")
    urls = tuple(check_worker_url(str(u)) for u in raw.get("worker_urls", ()))
    return ModelConfig(**{**raw, "worker_urls": urls})


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> NodeConfig:
    """Defaults < YAML file < CLI overrides (only keys whose value is not None)."""
    fields = _fields()
    values: dict[str, Any] = {}
    for source in (file_values, {k: v for k, v in overrides.items() if v is not None}):
        for key, val in source.items():
            if key not in fields or key == "extra":
                raise ConfigError(f"unknown configuration key {key!r}")
            values[key] = val
    if "worker_urls" in values:
        values["worker_urls"] = tuple(check_worker_url(str(u)) for u in values["worker_urls"])
    if "models" in values:
        values["models"] = tuple(_coerce_model(m) for m in values["models"])
    try:
        cfg = NodeConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if cfg.policy not in POLICY_NAMES:
        raise ConfigError(f"policy {cfg.policy!r} is unknown (one of {', '.join(POLICY_NAMES)})")
    if cfg.engine_transport not in ("h2", "grpcio"):
        raise ConfigError(f"engine_transport {cfg.engine_transport!r}: use 'h2' or 'grpcio'")
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"port {cfg.port} out of range")
    if cfg.tokenizer_workers < 0:
        raise ConfigError("tokenizer_workers must be >= 0")
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
