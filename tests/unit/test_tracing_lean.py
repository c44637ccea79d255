"""shepherd.node.observe.tracing's lean request path: the root sampling decision made from the trace id's
low bits before any span exists (``_root_bound``), a request the sampler leaves out without trace headers
running with no span or context (nothing to pass on), one with an incoming ``traceparent`` passing it on
(sampled or not), a sampled one's SERVER span and the ``traceparent`` the engine gets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.sdk.trace import sampling

from shepherd.node.engines.h2_frames import hpack_literal
from shepherd.node.observe import tracing


def test_the_root_decision_is_a_bound_on_the_trace_ids_low_bits() -> None:
    assert tracing._root_bound(sampling.ALWAYS_ON) == 1 << 64
    assert tracing._root_bound(sampling.ALWAYS_OFF) == 0
    ratio = sampling.TraceIdRatioBased(0.25)
    assert tracing._root_bound(ratio) == ratio.bound
    assert tracing._root_bound(sampling.ParentBasedTraceIdRatio(0.25)) == ratio.bound
    assert tracing._root_bound(sampling.ParentBased(sampling.ALWAYS_OFF)) == 0
    # the bound decides as the SDK's sampler does, for ids on either side of it
    for tid in (ratio.bound - 1, ratio.bound, (7 << 64) | (ratio.bound - 1), (7 << 64) | ratio.bound):
        sampled = ratio.should_sample(None, tid, "x").decision is sampling.Decision.RECORD_AND_SAMPLE
        assert ((tid & ((1 << 64) - 1)) < tracing._root_bound(ratio)) is sampled

    class Custom(sampling.Sampler):
        def should_sample(self, *a: Any, **k: Any) -> sampling.SamplingResult:
            return sampling.SamplingResult(sampling.Decision.RECORD_AND_SAMPLE)

        def get_description(self) -> str:
            return "custom"

    assert tracing._root_bound(Custom()) == -1
    assert tracing._child_sampled(ratio) and tracing._child_sampled(sampling.ParentBasedTraceIdRatio(0.1))
    assert not tracing._child_sampled(Custom())
    off_children = sampling.ParentBased(sampling.ALWAYS_ON, local_parent_sampled=sampling.ALWAYS_OFF)
    assert not tracing._child_sampled(off_children)


@pytest.fixture
def lean(monkeypatch: pytest.MonkeyPatch) -> list[tracing._Span]:
    """The lean path on (as ``setup`` turns it on with the W3C propagator), spans ended into a list."""
    ended: list[tracing._Span] = []
    for name, value in {
        "ENABLED": True,
        "_LEAN": True,
        "_W3C": True,
        "_EMIT": ended.append,
        "_QUEUE": (),
        "_QUEUE_MAX": 1 << 20,
        "_DIRECT": False,
        "_CHILD_SAMPLED": False,
    }.items():
        monkeypatch.setattr(tracing, name, value)
    return ended


def _sampler(monkeypatch: pytest.MonkeyPatch, s: sampling.Sampler) -> None:
    decide = tracing._decider(s)
    assert decide is not None
    monkeypatch.setattr(tracing, "_DECIDE", decide)
    monkeypatch.setattr(tracing, "_ROOT_BOUND", tracing._root_bound(s))


class _Route:  # as aiohttp's route objects: hashable, with the resource it serves
    resource = SimpleNamespace(canonical="/v1/chat/completions")


_ROUTE = _Route()


def _request(headers: dict[str, str]) -> Any:
    route = _ROUTE
    return SimpleNamespace(
        match_info=SimpleNamespace(route=route),
        headers=CIMultiDictProxy(CIMultiDict(headers)),
        method="POST",
        path="/v1/chat/completions",
        secure=False,
        remote="10.0.0.7",
    )


def _serve(headers: dict[str, str]) -> dict[str, Any]:
    """One request through the middleware; what its handler saw."""
    seen: dict[str, Any] = {}

    async def handler(request: Any) -> Any:
        seen["current"] = tracing._CURRENT.get()
        seen["block"] = tracing.grpc_header_block(hpack_literal)
        seen["stage"] = tracing.stage("route")
        return SimpleNamespace(status=200, headers={"x-request-id": "chatcmpl-1"})

    async def main() -> None:
        await tracing.server_span(_request(headers), handler)

    asyncio.run(main())
    return seen


def test_a_request_left_out_without_trace_headers_passes_an_unsampled_context_on(
    lean: list[tracing._Span], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the SDK does: a non-recording root with its ids, its context sent on with the sampled flag off
    (an engine's parent-based sampler drops its side too), no attributes, nothing exported."""
    _sampler(monkeypatch, sampling.TraceIdRatioBased(0))
    seen = _serve({})
    span = seen["current"][0]
    assert not span.recording and span.trace_id and span.parent == 0 and not span.attrs
    want = f"00-{span.trace_id:032x}-{span.span_id:016x}-00".encode()
    assert seen["block"] == hpack_literal(b"traceparent", want) and seen["stage"] is tracing.NOOP
    assert lean == []


@pytest.mark.parametrize("flags", ["00", "01"])
def test_an_incoming_context_goes_on_to_the_engine_sampled_or_not(
    lean: list[tracing._Span], monkeypatch: pytest.MonkeyPatch, flags: str
) -> None:
    _sampler(monkeypatch, sampling.ParentBasedTraceIdRatio(0))
    tid, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    seen = _serve({"traceparent": f"00-{tid}-{parent}-{flags}"})
    span = seen["current"][0]
    assert span.trace_id == int(tid, 16) and span.parent == int(parent, 16) and span.remote
    want = f"00-{tid}-{span.span_id:016x}-{flags}".encode()
    assert seen["block"] == hpack_literal(b"traceparent", want)
    if flags == "01":  # sampled: the SERVER span ended with its attributes
        assert lean == [span] and span.attrs["http.response.status_code"] == 200
    else:
        assert lean == [] and seen["stage"] is tracing.NOOP


def test_a_sampled_root_request_has_its_server_span_and_passes_it_on(
    lean: list[tracing._Span], monkeypatch: pytest.MonkeyPatch
) -> None:
    _sampler(monkeypatch, sampling.TraceIdRatioBased(1.0))
    seen = _serve({"x-request-id": "client-7"})
    span = seen["current"][0]
    assert lean == [span] and span.parent == 0 and span.trace_id and span.recording
    assert span.name == "POST /v1/chat/completions" and span.kind == tracing._SERVER
    assert span.attrs == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "client.address": "10.0.0.7",
        "shepherd.request.id": "chatcmpl-1",  # the answer's id wins over the client's
        "http.response.status_code": 200,
    }
    want = f"00-{span.trace_id:032x}-{span.span_id:016x}-01".encode()
    assert seen["block"] == hpack_literal(b"traceparent", want)
    # an encoder that does not write the value as it is still gets the value to write
    huff: list[bytes] = []

    def reversing(name: bytes, value: bytes) -> bytes:
        huff.append(value)
        return b"<" + value[::-1] + b">"

    token = tracing._CURRENT.set((span, None))
    try:
        got = tracing.grpc_header_block(reversing)
    finally:
        tracing._CURRENT.reset(token)
    assert got == b"<" + want[::-1] + b">" and huff[-1] == want


def test_the_cache_counters_a_stage_reads_one_model_or_several() -> None:
    """``TokenizerService.cache_counters`` (what the render stage reads before and after itself): the
    same counters with one model (read as they are) as summed over several."""
    from shepherd.tokens.service import TokenizerService  # not at the top: loads the tokenizers
    from tests.unit.test_tokenizer_shared import llama, qwen3  # not at the top: loads the tokenizers

    async def main() -> None:
        one = TokenizerService({"qwen3": qwen3()}, workers=0)
        two = TokenizerService({"qwen3": qwen3(), "llama": llama()}, workers=0)
        await one.start()
        await two.start()
        try:
            before1, before2 = one.cache_counters(), two.cache_counters()
            text = "the counters a traced stage reads, test_tracing_lean"
            tok = one.get("qwen3")  # the same tokenizer in both services
            assert tok is two.get("qwen3") and len(tok.templates) == 1
            tok.encode(text)
            tok.encode(text)
            tpl = next(iter(tok.templates.values()))
            tpl.misses += 2  # as two renders the template could not serve from its cache
            after1, after2 = one.cache_counters(), two.cache_counters()
            tpl.misses -= 2
        finally:
            await one.close()
            await two.close()
        moved1 = [a - b for a, b in zip(after1, before1, strict=True)]
        moved2 = [a - b for a, b in zip(after2, before2, strict=True)]
        assert moved1 == moved2
        assert moved1[1] == 2 and moved1[2] >= 1 and moved1[3] >= 1  # render misses; L0: a miss, a hit
        c = tok.cache
        assert after1[2:] == (c.exact_hits, c.exact_misses, c.segment_hits, c.segment_misses)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "operation"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "text_completion"),
        ("/generate", "text_completion"),  # SGLang's raw prompt: a text completion, not a chat
        ("/v1/embeddings", "embeddings"),
    ],
)
def test_a_routes_genai_operation(path: str, operation: str) -> None:
    """The GenAI operation of a route (``gen_ai.operation.name``, the CLIENT span's name and the GenAI
    metrics' attribute), from the semantic conventions' values."""

    class Route:
        resource = SimpleNamespace(canonical=path)

    request = SimpleNamespace(match_info=SimpleNamespace(route=Route()))
    assert tracing._route_of(request) == (path, operation)  # type: ignore[arg-type]
