"""The node over SGLang's in-tree gRPC server, replayed (tests/contract/replay.py, ``sglang-inproc``).

Read from sgl-project/sglang python/sglang/srt/entrypoints/grpc_server.py: Generate always streams to
its request manager (``stream=True  # Always stream for gRPC``), sends each unfinished output as a
chunk and the finished one as a Complete only, whose ``output_ids`` are its last delta (no chunk
carries them); ``serve_grpc`` fills GetModelInfo's ``max_context_length`` from the scheduler's
``max_total_num_tokens`` (the KV pool); the server has no GetLoads and no SubscribeKvEvents. A real
node process answers every request here.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.contract.nodes import complete, ids, sse_events, streamed_text, text_and_tokens, token_id
from tests.contract.replay import Choice, Plan, ReplayServer
from tests.e2e.node_procs import NodeProc

DIALECT = "sglang-inproc"


@pytest.mark.parametrize("stream", [False, True])
def test_last_delta_only_in_the_complete_is_not_lost(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    engine.plan = Plan([Choice([ids(tok, "hel"), ids(tok, "lo wor"), ids(tok, "ld!")])])
    r = complete(http, node, prompt="hi", stream=stream, logprobs=1)
    assert r.status_code == 200, r.text
    assert text_and_tokens(r, stream) == ("hello world!", "hello world!")
    if not stream:
        assert r.json()["usage"]["completion_tokens"] == len("hello world!")


@pytest.mark.parametrize("stream", [False, True])
def test_generate_keeps_the_last_delta_only_in_the_complete(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    """SGLang's native /generate over the same wire: the tokens of the Complete are the answer's end."""
    engine.plan = Plan([Choice([ids(tok, "hel"), ids(tok, "lo wor"), ids(tok, "ld!")])])
    body = {"model": "m", "text": "hi", "sampling_params": {"max_new_tokens": 32}, "stream": stream}
    r = http.post(node.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    answer = sse_events(r.text)[-1] if stream else r.json()
    assert answer["text"] == "hello world!", answer
    assert answer["output_ids"] == ids(tok, "hello world!"), answer
    assert answer["meta_info"]["completion_tokens"] == len("hello world!"), answer


@pytest.mark.parametrize("stream", [False, True])
def test_last_token_without_text_in_the_complete_keeps_its_logprob(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    # the EOS alone in the Complete (it decodes to no text): its logprob entry is streamed as the
    # answer without streaming has it, one entry per completion token (as vLLM's final chunk carries it)
    eos = token_id(tok, "<|im_end|>")
    engine.plan = Plan([Choice([ids(tok, "hello"), [eos]], matched=eos)])
    r = complete(http, node, prompt="hi", stream=stream, logprobs=1)
    assert r.status_code == 200, r.text
    assert text_and_tokens(r, stream) == ("hello", "hello<|im_end|>")


def test_one_step_answer_in_the_complete_alone(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice([ids(tok, "single")], finish="length")])
    r = complete(http, node, prompt="hi", stream=True)
    ev = sse_events(r.text)
    assert streamed_text(ev) == "single"
    assert [c["finish_reason"] for e in ev for c in e["choices"] if c.get("finish_reason")] == ["length"]


def test_context_window_is_not_the_kv_pool(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice([ids(tok, "ok")])])
    r = complete(http, node, prompt="y" * 300, max_tokens=8)  # > the 100-token KV pool, < 2048
    assert r.status_code == 200, r.text


def test_stop_string_cut_by_the_node(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice([ids(tok, "keep"), ids(tok, " this|drop")])])
    r = complete(http, node, prompt="hi", stop=["|"])
    assert r.json()["choices"][0]["text"] == "keep this"
