"""gRPC statuses -> ``EngineError``: the one table both engine transports map through.

The lean HTTP/2 client reads a status number from the trailers (or derives one from a reset, an HTTP
status, a lost connection); the grpcio client gets a ``grpc.StatusCode``: both end in ``engine_error``,
so a failure means the same to dispatch (retry, circuit breaker, the client's status) whichever
transport saw it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from shepherd.proto.engine_types import EngineError, EngineTimeout, EngineUnavailable, ServerInfo

__all__ = [
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "MAX_DETAILS",
    "OK",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "SGLANG_HEALTH_MIN_TIMEOUT_S",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "bounded_details",
    "engine_error",
    "health_timeout",
    "sglang_context",
]

# gRPC status codes (numbers as on the wire; names as grpc.StatusCode's)
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
ABORTED = 10
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
# worth another worker (before the first token): the engine is down, overloaded, gave up on a race, or
# failed inside (INTERNAL, UNKNOWN, DATA_LOSS: a server error, as SMG retries a 5xx); not the request's
# own faults (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE...), nor its deadline
_RETRYABLE = frozenset({UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN, DATA_LOSS})


# the most of an engine's status text an error carries: a servicer (or a man in the middle) may put 60 KB
# in grpc-message, which would fill logs and every client's error, and costs the error's later scans
# (the node's address scrubbing) time growing with its square
MAX_DETAILS = 512


def bounded_details(details: str) -> str:
    """``details`` cut to ``MAX_DETAILS`` characters, saying how many were left out."""
    if len(details) <= MAX_DETAILS:
        return details
    return f"{details[:MAX_DETAILS]}... ({len(details) - MAX_DETAILS} more characters)"


def engine_error(code: int, details: str) -> EngineError:
    """The ``EngineError`` for a gRPC status ``code`` (a number outside the table counts as UNKNOWN);
    the status text bounded (``MAX_DETAILS``)."""
    if not 0 <= code < len(_NAMES):
        code = UNKNOWN
    name = _NAMES[code]
    detail = bounded_details(details) or name
    if code == DEADLINE_EXCEEDED:
        return EngineTimeout(f"engine timed out: {detail}")
    if code == UNAVAILABLE:
        return EngineUnavailable(f"engine unavailable: {detail}")
    if code == INVALID_ARGUMENT:
        return EngineError(f"engine rejected the request: {detail}", code="invalid_request", retryable=False)
    if code == UNIMPLEMENTED:  # the servicer lacks the call (vLLM's entrypoint: GetLoads, KV events)
        return EngineError(f"engine error ({name}): {detail}", code="unimplemented", retryable=False)
    if code == RESOURCE_EXHAUSTED:
        if "larger than max" in detail:  # gRPC's message size limit: the request's size, on every worker
            msg = f"engine rejected the request: {detail}"
            return EngineError(msg, code="invalid_request", retryable=False)
        # overloaded: another worker may take it; every one overloaded: the client's 503 with Retry-After
        return EngineError(f"engine overloaded ({name}): {detail}", code="engine_overloaded", retryable=True)
    return EngineError(f"engine error ({name}): {detail}", retryable=code in _RETRYABLE)


# SGLang's HealthCheck (SMG's servicer) sleeps 1 s before it first looks for the scheduler's answer, then
# polls every second: a shorter deadline fails every healthy SGLang worker. A check of an SGLang worker
# waits at least this long, whatever the configured timeout.
SGLANG_HEALTH_MIN_TIMEOUT_S = 2.5


def health_timeout(kind: str, configured: float) -> float:
    """The HealthCheck deadline for a worker of ``kind``: the configured one, raised for SGLang to
    ``SGLANG_HEALTH_MIN_TIMEOUT_S`` (see there)."""
    if kind == "sglang" and configured < SGLANG_HEALTH_MIN_TIMEOUT_S:
        return SGLANG_HEALTH_MIN_TIMEOUT_S
    return configured


async def sglang_context(kind: str, server_info: Callable[[], Awaitable[ServerInfo]]) -> ServerInfo | None:
    """What ``decode_model_info`` reads the context from besides GetModelInfo (SGLang reports its KV pool
    as max_context_length): an SGLang worker's GetServerInfo; a server without it (SGLang's early
    in-tree server) says nothing of the context, only that max_context_length is the KV pool. None for
    the other kinds."""
    if kind != "sglang":
        return None
    try:
        return await server_info()
    except EngineError:
        return ServerInfo(kind="sglang")
