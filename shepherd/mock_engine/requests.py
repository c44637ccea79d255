"""A generate request as the mock's engine core takes it, and the error a request fails with.

Independent of the surface a request came through (SGLang gRPC, vLLM gRPC, OpenAI HTTP): the
surfaces build ``MockRequest`` and map ``MockRpcError`` to their own status; ``engine`` runs it and
``pd_check`` verifies a decode-role request against its prefill side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shepherd.mock_engine.outputs import OutputSpec


class MockRpcError(Exception):
    """A request fails with a status (names as in ``grpc.StatusCode``: UNAVAILABLE, INTERNAL...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class MockRequest:
    """A generate request, independent of the surface it came through."""

    request_id: str
    prompt: tuple[int, ...]
    spec: OutputSpec = dataclasses.field(default_factory=OutputSpec)
    n: int = 1
    stream: bool = True
    stream_interval: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # the prompt's logprobs, this many alternatives (None: not asked)
    prompt_text: str = ""
    kv_transfer_params_json: str | None = None  # vLLM PD (decode side receives it)
    disaggregated: bool = False  # SGLang bootstrap parameters were present
    bootstrap_host: str | None = None  # SGLang PD: the prefill engine's bootstrap server and the room
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
