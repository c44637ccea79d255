"""Counters the mock keeps for tests (served as JSON by ``GET /mock/stats``)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

JsonDict = dict[str, object]


class MockStats:
    """What the engine saw. Lists of ids are bounded (the most recent ``keep``)."""

    def __init__(self, keep: int = 256) -> None:
        self.requests_received = 0
        self.completed = 0
        self.errors_injected = 0
        self.rejected = 0
        self._keep = keep
        self.aborted: deque[str] = deque(maxlen=keep)  # ended early: by an Abort RPC or a cancelled stream
        self.aborted_by_rpc: deque[str] = deque(maxlen=keep)  # an Abort RPC hit a live request
        self.cancelled: deque[str] = deque(maxlen=keep)  # the client dropped the stream (or HTTP connection)
        self.abort_unmatched: deque[str] = deque(maxlen=keep)  # an Abort RPC for no live request
        self.rpc_calls: Counter[str] = Counter()
        self.last_request_kind = ""
        self.last_request_id = ""
        # converted lazily (a protobuf -> dict conversion per request would cost more than the request)
        self.last_sampling_params: Callable[[], JsonDict] | None = None
        self.last_disaggregated_params: Callable[[], JsonDict] | None = None
        self.last_kv_transfer_params_json: str | None = None
        self.disaggregated_requests = 0
        # per completed request, the time from its arrival to its first token in the timing model (queue +
        # prefill): what routing changes, free of the host's scheduling noise
        self.ttft_model_s: deque[float] = deque(maxlen=4096)
        # structured-output constraints received: {"request_id", "kind", "value"}, most recent last
        self.constraints: deque[JsonDict] = deque(maxlen=keep)
        # W3C trace context received with generation calls (gRPC metadata, HTTP headers):
        # {"request_id", "traceparent", "tracestate"}, most recent last; only calls that carried one
        self.trace_contexts: deque[JsonDict] = deque(maxlen=keep)
        # every generation request received, most recent last: {"request_id", "kind", "sampling_params"
        # (converted when shown), "require_reasoning"} (SGLang's field; None for vLLM)
        self.requests: deque[tuple[str, str, Callable[[], JsonDict], bool | None]] = deque(maxlen=keep)

    def reset(self) -> None:
        self.__init__(self._keep)  # type: ignore[misc]

    def count_rpc(self, name: str) -> None:
        self.rpc_calls[name] += 1

    def record_trace(self, request_id: str, metadata: Any) -> None:
        """Note the ``traceparent`` / ``tracestate`` among a call's metadata (gRPC invocation metadata or
        HTTP headers: pairs, or a mapping), if it carried one."""
        pairs = metadata.items() if hasattr(metadata, "items") else metadata or ()
        tp = ts = None
        for k, v in pairs:
            key = k.lower() if isinstance(k, str) else k
            if key == "traceparent":
                tp = v
            elif key == "tracestate":
                ts = v
        if tp is not None:
            self.trace_contexts.append({"request_id": request_id, "traceparent": tp, "tracestate": ts})

    def record_request(
        self,
        request_id: str,
        kind: str,
        sampling_params: Callable[[], JsonDict],
        require_reasoning: bool | None,
    ) -> None:
        self.requests.append((request_id, kind, sampling_params, require_reasoning))

    def record_constraint(self, request_id: str, sampling_params: Any) -> None:
        """Note the ``oneof constraint`` of a SamplingParams message (SGLang or vLLM), if one is set."""
        kind = sampling_params.WhichOneof("constraint")
        if kind is None:
            return
        value = getattr(sampling_params, kind)
        if kind == "choice":
            value = list(value.choices)
        self.constraints.append({"request_id": request_id, "kind": kind, "value": value})

    def to_json(self) -> JsonDict:
        return {
            "requests_received": self.requests_received,
            "completed": self.completed,
            "errors_injected": self.errors_injected,
            "rejected": self.rejected,
            "aborted": list(self.aborted),
            "aborted_by_rpc": list(self.aborted_by_rpc),
            "cancelled": list(self.cancelled),
            "abort_unmatched": list(self.abort_unmatched),
            "rpc_calls": dict(self.rpc_calls),
            "last_request_kind": self.last_request_kind,
            "last_request_id": self.last_request_id,
            "last_sampling_params": None
            if self.last_sampling_params is None
            else self.last_sampling_params(),
            "last_disaggregated_params": (
                None if self.last_disaggregated_params is None else self.last_disaggregated_params()
            ),
            "last_kv_transfer_params_json": self.last_kv_transfer_params_json,
            "disaggregated_requests": self.disaggregated_requests,
            "ttft_model_ms": [round(t * 1000.0, 3) for t in self.ttft_model_s],
            "constraints": list(self.constraints),
            "trace_contexts": list(self.trace_contexts),
            "requests": [
                {"request_id": rid, "kind": kind, "sampling_params": sp(), "require_reasoning": rr}
                for rid, kind, sp, rr in self.requests
            ],
        }
