"""What the node says to an engine and what it hears back, independent of the wire.

Engine clients (gRPC SGLang, gRPC vLLM, a lean HTTP/2 transport, ...) all translate between these
types and their own protocol, so the request pipeline never sees a protobuf.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


def worker_id(url: str) -> str:
    """A worker's id, the same on every node (and in the benchmarks): 12 hex digits of its URL's SHA-1."""
    return hashlib.sha1(url.encode()).hexdigest()[:12]


class EngineError(Exception):
    """An engine failed a call. ``retryable`` when no output was produced and another worker may try."""

    def __init__(self, message: str, *, code: str = "engine_error", retryable: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused, reset, DNS...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_unavailable", retryable=True)


class EngineTimeout(EngineError):
    """The engine did not answer within the deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_timeout", retryable=False)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Every field explicit: proto3 zero defaults are not the semantic defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # single-token stop strings as their token ids (SGLang: added to ``stop_token_ids``, so the engine
    # stops there; the gateway's stop matcher still decides what the client sees)
    stop_string_ids: tuple[int, ...] = ()
    # the request's stop strings (vLLM: its ``stop``, so the engine stops generating; the output keeps
    # them, ``include_stop_str_in_output``, and the gateway's stop matcher trims)
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    stream_interval: int | None = None
    # structured output constraint: at most one of these
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings (vLLM: its choice constraint; SGLang: EBNF)
    json_object: bool = False  # any JSON object (vLLM: json_object; SGLang: the schema {"type":"object"})


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingParams
    stream: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    text: str = ""  # the rendered prompt, for reference only (engines get ids)
    # PD disaggregation (SGLang bootstrap) and vLLM KV transfer, relayed verbatim
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    kv_transfer_params_json: str | None = None
    # SGLang's require_reasoning: the request thinks first (a reasoning parser active, thinking on), so a
    # grammar constraint applies after the reasoning (SGLang's grammar manager); vLLM has no such field
    require_reasoning: bool = False
    # the output tokens the node allows each choice: the client's max_tokens, else what the context
    # leaves. Never sent to SGLang or vLLM (``sampling.max_new_tokens`` unset: their own bound applies);
    # the gateway's bound on what it reads, and the bound of engines that require one (TensorRT-LLM, MLX)
    token_limit: int | None = None
    # the prompt's logprobs, with this many alternatives per position (None: not asked, no engine cost):
    # SGLang's return_logprob from position 0 (logprob_start_len 0), vLLM's prompt_logprobs
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's logprobs as an engine returns them (SGLang's and vLLM's ``InputLogProbs``), in flat
    arrays (a 100k-token prompt with 20 alternatives is 2M pairs: no object per pair). Position ``i``:
    token ``token_ids[i]``, its logprob ``logprobs[i]`` (None: none, as for the first token), its
    alternatives ``top_ids`` / ``top_values`` from ``top_starts[i]`` to ``top_starts[i + 1]`` (SGLang's
    are the top k; vLLM's servicer lists the prompt token first, then the best others)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float | None]
    top_starts: Sequence[int] = (0,)
    top_ids: Sequence[int] = ()
    top_values: Sequence[float] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    def top(self, i: int) -> list[tuple[int, float]]:
        """Position ``i``'s alternatives, best first as the engine sent them (none past the last start)."""
        starts = self.top_starts
        if i + 1 >= len(starts):
            return []
        a, b = starts[i], starts[i + 1]
        return list(zip(self.top_ids[a:b], self.top_values[a:b], strict=True))


@dataclass(slots=True)
class EngineChunk:
    """New output tokens of choice ``index`` (streaming)."""

    index: int
    token_ids: Sequence[int]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: Sequence[TokenLogprob] = ()


@dataclass(slots=True)
class PromptChunk(EngineChunk):
    """A chunk that also carries the prompt's logprobs (the first of a stream that asked for them). A
    class of its own: ``EngineChunk`` keeps exactly the six slots the C decoder fills (``_varint``'s
    ``lone_chunk``), and a plain chunk is never one of these."""

    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class EngineComplete:
    """Choice ``index`` finished. ``output_ids`` holds all tokens for non-stream calls, else may be empty."""

    index: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_ids: Sequence[int] = ()
    matched_token_id: int | None = None
    matched_stop_str: str | None = None
    logprobs: Sequence[TokenLogprob] = ()
    kv_transfer_params_json: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when asked (GenerateRequest.prompt_logprobs)


EngineEvent = EngineChunk | EngineComplete


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A model's sampling defaults as its engine reports them (GetModelInfo's
    ``default_sampling_params_json``: SGLang's generation_config and ``--preferred-sampling-params``,
    vLLM's ``get_diff_sampling_param()``): what a request that leaves the field unset gets. None: not
    given. The same five fields SMG applies (``SamplingDefaults`` in its worker/sampling_defaults.rs)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The fields given (for display)."""
        out: dict[str, float | int] = {}
        for k in SAMPLING_DEFAULT_FIELDS:
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    served_model_name: str = ""
    model_path: str = ""
    max_context_length: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    is_generation: bool = True  # False: an embedding model (the engine's GetModelInfo says so)
    # the engine's KV pool in tokens when its GetModelInfo reports that in place of the context window
    # (SGLang's servicers fill ``max_context_length`` from ``max_total_num_tokens``): a capacity figure,
    # never a context length; 0: not reported
    kv_capacity_tokens: int = 0
    # the model's sampling defaults (None: the engine reports none, or nothing usable)
    sampling_defaults: SamplingDefaults | None = None
    # an SGLang worker started with --skip-tokenizer-init (its GetServerInfo's server_args): it refuses
    # min_new_tokens (INVALID_ARGUMENT), so the node answers a request with min_tokens a 400 itself
    skip_tokenizer_init: bool = False


@dataclass(slots=True)
class EmbedResult:
    """One input's embedding, as the engine's Embed RPC returns it."""

    embedding: list[float]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ServerInfo:
    kind: str  # "sglang" | "vllm" | "http"
    version: str = ""
    active_requests: int = 0
    max_total_num_tokens: int = 0  # the KV pool (SGLang): a capacity figure
    context_length: int = 0  # the model's context window, when the server says (SGLang's server_args)
    skip_tokenizer_init: bool = False  # SGLang's server_args: started with --skip-tokenizer-init
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine reports about its own load (GetLoads), summed over DP ranks."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    max_total_tokens: int = 0
    token_usage: float = 0.0
    waiting_uncached_tokens: int = 0
    max_running: int = 0
    cache_hit_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class KvBlocksStored:
    """KV event: the engine cached consecutive blocks of one chain after block ``parent_hash`` (None:
    at the start of a sequence). ``token_ids`` holds every block's tokens, in order. Hashes are the
    engine's own (opaque: the node names blocks from their tokens)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class KvBlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCacheCleared:
    pass


KvCacheEvent = KvBlocksStored | KvBlocksRemoved | KvCacheCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One message of SubscribeKvEvents. ``load_only``: a load record (or heartbeat) without events,
    repeating the last sequence number sent. ``load`` is the engine's load when it sent the batch;
    ``load.max_total_tokens`` is 0 when the record did not carry the engine's telemetry. ``events`` is a
    tuple, or the message's bytes as a sequence (``kv_codec.WireEvents``: applied in C by the KV feed)."""

    sequence_number: int
    events: Sequence[KvCacheEvent] = ()
    load: EngineLoad | None = None
    load_only: bool = False


@runtime_checkable
class EmbedClient(Protocol):
    """An engine client with the Embed RPC (the gRPC clients; not the HTTP relay)."""

    url: str

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        """The embedding of ``ids``. Raises EngineError."""
        ...


class EngineClient(Protocol):
    """One client per worker, reused; methods are safe to call concurrently."""

    url: str
    kind: str

    def generate(self, req: GenerateRequest, timeout: float | None = None) -> AsyncIterator[EngineEvent]:
        """Stream events until every choice has an EngineComplete. Raises EngineError."""
        ...

    def generate_batches(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[list[EngineEvent]]:
        """``generate``, grouped: each item holds every event that had already arrived."""
        ...

    async def abort(self, request_id: str, reason: str = "") -> None: ...

    async def health_check(self, timeout: float = 2.0) -> bool: ...

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        """GetModelInfo (an SGLang engine's GetServerInfo too: ``sglang_context``), each call within
        ``timeout``. Raises EngineError."""
        ...

    async def server_info(self, timeout: float = 5.0) -> ServerInfo: ...

    async def loads(self) -> EngineLoad: ...

    def confirm_alive(self, timeout: float) -> None:
        """The worker just failed its health checks (healthy -> unhealthy): check at once that the engine
        still answers on the connections where calls are in flight, and fail those calls
        (``EngineUnavailable``) when it does not within ``timeout`` seconds, rather than waiting for the
        transport's keepalive. The lean HTTP/2 client sends one HTTP/2 PING per connection with open
        streams (an engine alive but busy answers it at once); clients that cannot ping (grpcio, the HTTP
        relay) do nothing. Returns at once."""
        ...

    def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        """SubscribeKvEvents from ``start_seq`` (0: live events only; n > 0: the engine replays what it
        still holds from batch n on). Runs until the engine ends it; raises EngineError."""
        ...

    async def close(self) -> None: ...
