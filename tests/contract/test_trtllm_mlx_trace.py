"""The trace context reaches TensorRT-LLM and MLX workers as it reaches SGLang and vLLM ones: a request
through a real node with tracing on (an OTLP gRPC receiver the test starts, ``tests/e2e/otlp_receiver.py``)
makes a CLIENT span per engine call, and the worker's Generate call carries that span's ``traceparent``
(and the client's ``tracestate``) in its gRPC metadata, over both transports (the lean HTTP/2 client and
grpcio). The dialect fakes (``fake_trtllm``: NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/smg/servicer.py``;
``fake_mlx``: lightseekorg/smg's MLX servicer) record the metadata of every Generate call they get."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.contract.fake_mlx import start_fake_mlx
from tests.contract.fake_service_thread import ServerThread
from tests.contract.fake_trtllm import start_fake_trtllm
from tests.contract.node_over_fake import MODEL, node_over
from tests.e2e.node_procs import env
from tests.e2e.otlp_receiver import CLIENT, FAST_EXPORT, SERVER, OtlpReceiver, in_trace

pytestmark = pytest.mark.timeout(240)

FAKES: dict[str, Callable[[], tuple[Any, ServerThread]]] = {
    "trtllm": start_fake_trtllm,
    "mlx": start_fake_mlx,
}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
@pytest.mark.parametrize("kind", sorted(FAKES))
def test_the_engine_call_carries_its_client_spans_context(
    kind: str, transport: str, receiver: OtlpReceiver
) -> None:
    fake, server = FAKES[kind]()
    try:
        flags = ("--otlp-traces-endpoint", receiver.endpoint, "--engine-transport", transport)
        url = f"{kind}://127.0.0.1:{server.port}"
        with env(FAST_EXPORT), node_over(url, extra=flags) as n:
            trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
            rid = f"req-{kind}-{transport}"
            headers = {
                "traceparent": f"00-{trace_id}-{client_span}-01",
                "tracestate": "vendor=1",
                "x-request-id": rid,
            }
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "trace me"}],
                "max_tokens": 8,
                "stream": True,
            }
            r = httpx.post(n.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            assert "[DONE]" in r.text
            spans = receiver.wait(
                lambda s: (
                    any(x.kind == CLIENT for x in in_trace(s, trace_id))
                    and any(x.kind == SERVER for x in in_trace(s, trace_id))
                ),
                "the request's SERVER and CLIENT spans",
            )
    finally:
        server.stop()
    mine = in_trace(spans, trace_id)
    (call,) = [s for s in mine if s.kind == CLIENT]
    (route,) = [s for s in mine if s.kind == SERVER]
    assert route.parent_id == client_span and call.parent_id == route.span_id
    assert call.name == f"chat {MODEL}"
    assert call.attributes["gen_ai.provider.name"] == kind
    assert call.attributes["server.port"] == server.port
    got = [(tp, ts) for r_id, tp, ts in fake.trace_contexts if r_id.partition(".")[2].startswith(rid)]
    assert got == [(f"00-{trace_id}-{call.span_id}-01", "vendor=1")], fake.trace_contexts
