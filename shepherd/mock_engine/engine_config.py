"""The mock engine's configuration: ``EngineConfig`` (model and tokenizer, cache and batch sizes, the
timing model, output length, PD role, faults), checked when it is made, and the ``SchedulerConfig`` it
implies (zero-latency mode zeroes the timing model). ``ROLES``: the PD roles an engine can play.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shepherd.mock_engine.faults import Faults
from shepherd.mock_engine.scheduler import SchedulerConfig

__all__ = ["DECODE_STEPS", "ROLES", "EngineConfig"]

ROLES = ("both", "prefill", "decode")
DECODE_STEPS = ("request", "batch")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "qwen3"
    tokenizer_path: str = ""
    seed: int = 0
    block_size: int = 16
    cache_blocks: int = 8192
    max_running: int = 64
    context_length: int = 32_768
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 5.0
    decode_slowdown: float = 0.5  # inter-token latency is up to (1 + this) times longer with a full batch
    zero_latency: bool = False
    output_len: int = 32
    stream_interval: int = 1
    # "request": each request's tokens on its own clock, from its first token; "batch": on the engine's
    # step clock (a step every base inter-token latency), every running request's token at the same step,
    # as SGLang's and vLLM's schedulers emit a whole decode batch per forward pass
    decode_steps: str = "request"
    role: str = "both"
    pd_wait_s: float = 5.0  # a decode-role engine waits this long for its prefill side to know the request
    host: str = "127.0.0.1"
    engine_id: str = "mock-0"
    embedding_dim: int = 64  # the length of the vectors Embed and /v1/embeddings return
    embedding_model: bool = False  # GetModelInfo reports is_generation=False (an embedding model)
    # GetModelInfo's default_sampling_params_json, verbatim (the model's sampling defaults; "": none)
    default_sampling_params_json: str = ""
    # as SGLang started with --skip-tokenizer-init: GetServerInfo says so, min_new_tokens is refused
    skip_tokenizer_init: bool = False
    faults: Faults = dataclasses.field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if self.decode_steps not in DECODE_STEPS:
            raise ValueError(f"decode_steps must be one of {DECODE_STEPS}")
        for name in (
            "block_size",
            "cache_blocks",
            "max_running",
            "context_length",
            "stream_interval",
            "embedding_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("output_len", "prefill_us_per_token", "decode_ms_per_token", "decode_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def scheduler_config(self) -> SchedulerConfig:
        zero = self.zero_latency
        return SchedulerConfig(
            max_running=self.max_running,
            context_length=self.context_length,
            prefill_s_per_token=0.0 if zero else self.prefill_us_per_token * 1e-6,
            decode_s_per_token=0.0 if zero else self.decode_ms_per_token * 1e-3,
            decode_slowdown=self.decode_slowdown,
        )
