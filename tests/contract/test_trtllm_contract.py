"""TensorRT-LLM workers through a real node, against ``fake_trtllm`` (TensorRT-LLM's own servicer played
back message by message: NVIDIA/TensorRT-LLM ``tensorrt_llm/grpc/smg/servicer.py``; SMG's client of it:
lightseekorg/smg ``crates/grpc_client/src/trtllm_service.rs``).

One fake serves two worker URLs of one model: ``trtllm://`` (the kind by scheme) and ``grpc://`` (the kind
found by GetServerInfo); every request lands on the same fake, whichever worker the node picks.
"""

from __future__ import annotations

import json

import pytest
from smg_grpc_proto import trtllm_service_pb2 as tr

from tests.contract.fake_service_thread import reply_ids
from tests.contract.fake_trtllm import FakeTrtllm, start_fake_trtllm
from tests.contract.node_over_fake import (
    chat,
    chat_stream,
    finish_reasons,
    node_over,
    streamed_text,
    wait_for,
    workers,
)
from tests.e2e.node_procs import NodeProc, reserved_port

FAKE = (start_fake_trtllm, "trtllm")


@pytest.fixture
def node(served: tuple[FakeTrtllm, NodeProc]) -> NodeProc:
    return served[1]


def test_both_urls_are_trtllm_workers_grpc_by_get_server_info(fake: FakeTrtllm, node: NodeProc) -> None:
    ws = workers(node)
    assert sorted(w["url"].partition("://")[0] for w in ws) == ["grpc", "trtllm"]
    for w in ws:
        assert w["kind"] == "trtllm", w
        assert w["healthy"] is True
        assert w["max_context_length"] == 8192  # GetModelInfo's max_seq_len (prompt and output)
    # no GetLoads in the service: said UNIMPLEMENTED once, then the node's own in-flight count
    assert wait_for(lambda: all(w.get("engine_loads") is False for w in workers(node)))


def test_chat_without_streaming_maps_sampling_and_reads_the_complete(
    fake: FakeTrtllm, node: NodeProc
) -> None:
    r = chat(
        node,
        max_tokens=40,
        temperature=0.3,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=-7,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        repetition_penalty=1.1,
        min_tokens=2,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hello from TensorRT-LLM."
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(reply_ids("Hello from TensorRT-LLM.")) + 1  # and EOS
    req = fake.requests[-1]
    assert req.streaming is False
    assert req.max_tokens == 40
    sc = req.sampling_config
    assert sc.num_return_sequences == 1
    assert sc.temperature == pytest.approx(0.3)
    assert sc.top_p == pytest.approx(0.9)
    assert sc.top_k == 20
    assert sc.min_p == pytest.approx(0.05)
    assert sc.seed == (1 << 64) - 7  # uint64
    assert sc.min_tokens == 2
    assert sc.frequency_penalty == pytest.approx(0.1)
    assert sc.presence_penalty == pytest.approx(0.2)
    assert sc.repetition_penalty == pytest.approx(1.1)
    assert req.include_stop_token_in_output is True
    assert req.output_config.exclude_input_from_output is True
    assert not req.output_config.HasField("logprobs")
    assert not req.stop  # stop strings are the node's own work


def test_stream_takes_the_chunks_not_the_cumulative_complete(fake: FakeTrtllm, node: NodeProc) -> None:
    status, events, done = chat_stream(node)
    assert status == 200 and done
    assert streamed_text(events) == "Hello from TensorRT-LLM."  # no token twice (the complete repeats all)
    assert finish_reasons(events) == {0: "stop"}
    assert events[-1]["usage"]["completion_tokens"] == len(reply_ids("Hello from TensorRT-LLM.")) + 1
    assert fake.requests[-1].streaming is True


@pytest.mark.parametrize("stream", [False, True])
def test_n_2_gives_each_sequence_its_choice(fake: FakeTrtllm, node: NodeProc, stream: bool) -> None:
    fake.script.replies = ["Alpha one.", "Beta two, longer."]
    if stream:
        status, events, done = chat_stream(node, n=2)
        assert status == 200 and done
        assert [streamed_text(events, 0), streamed_text(events, 1)] == ["Alpha one.", "Beta two, longer."]
        assert finish_reasons(events) == {0: "stop", 1: "stop"}
    else:
        r = chat(node, n=2)
        assert r.status_code == 200, r.text
        got = {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
        assert got == {0: "Alpha one.", 1: "Beta two, longer."}
    assert fake.requests[-1].sampling_config.num_return_sequences == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(fake: FakeTrtllm, node: NodeProc, stream: bool) -> None:
    fake.script.replies = ["Hello world. STOP here and more, " + "and more " * 40]
    if stream:
        # still generating when the node has its answer, even on a loaded machine (~9 s of steps: the
        # node cancels after ~5 of them; a cancel that comes after the last step cannot be seen)
        fake.script.step_delay = 0.1
        status, events, done = chat_stream(node, stop=["STOP"], max_tokens=200)
        assert status == 200 and done
        assert streamed_text(events) == "Hello world. "
        assert finish_reasons(events) == {0: "stop"}
        # the node is done with it: the call is cancelled at once (RST_STREAM), and Abort is sent
        rid = fake.requests[-1].request_id
        assert wait_for(lambda: rid in fake.cancelled and rid in fake.aborts, timeout=10), (
            rid in fake.cancelled,
            rid in fake.aborts,
        )
    else:
        r = chat(node, stop=["STOP"])
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert (c["message"]["content"], c["finish_reason"]) == ("Hello world. ", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_length_cut(fake: FakeTrtllm, node: NodeProc, stream: bool) -> None:
    fake.script.replies = ["one two three four five six seven"]
    want = tr_decode(reply_ids("one two three four five six seven")[:3])
    if stream:
        status, events, done = chat_stream(node, max_tokens=3)
        assert status == 200 and done
        assert (streamed_text(events), finish_reasons(events)) == (want, {0: "length"})
    else:
        r = chat(node, max_tokens=3)
        c = r.json()["choices"][0]
        assert (c["message"]["content"], c["finish_reason"]) == (want, "length")
        assert r.json()["usage"]["completion_tokens"] == 3
    assert fake.requests[-1].max_tokens == 3


def tr_decode(ids: list[int]) -> str:
    from tests.contract.fake_service_thread import tokenizer  # not at the top: the tokenizer loads once

    return tokenizer().decode(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_their_top_lists(fake: FakeTrtllm, node: NodeProc, stream: bool) -> None:
    n_tokens = len(reply_ids("Hello from TensorRT-LLM."))
    if stream:
        status, events, _ = chat_stream(node, logprobs=True, top_logprobs=2)
        assert status == 200
        entries = [
            e
            for ev in events
            for c in ev.get("choices", [])
            for e in ((c.get("logprobs") or {}).get("content") or [])
        ]
    else:
        r = chat(node, logprobs=True, top_logprobs=2)
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) >= n_tokens
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert entries[0]["logprob"] == pytest.approx(-0.25)
    assert fake.requests[-1].output_config.logprobs == 2


def test_structured_output_becomes_a_guide(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.replies = ['{"a": 1}']
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = chat(node, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    g = fake.requests[-1].guided_decoding
    assert g.guide_type == tr.GuidedDecodingParams.GUIDE_TYPE_JSON_SCHEMA
    assert json.loads(g.guide) == schema


def test_logit_bias_becomes_an_embedding_bias_of_the_vocabulary(fake: FakeTrtllm, node: NodeProc) -> None:
    r = chat(node, logit_bias={"42": 5.0})
    assert r.status_code == 200, r.text
    bias = fake.requests[-1].embedding_bias
    assert len(bias) == 151936  # GetModelInfo's vocab_size
    assert bias[42] == 5.0 and sum(bias) == 5.0


def test_engine_error_before_output_is_a_502(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.fail_after = 0
    r = chat(node)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "server_error"


def test_engine_error_mid_stream_is_an_sse_error(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.fail_after = 2
    status, events, _ = chat_stream(node)
    assert status == 200
    assert "error" in events[-1], events[-1]  # the error event (then [DONE]), after the tokens sent
    assert not finish_reasons(events)


def test_engine_abort_is_a_5xx_not_a_finish(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.cancel_after = 2
    r = chat(node)
    assert r.status_code == 502, r.text
    assert "cancelled" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_engine_abort_before_the_first_token_is_retried(
    fake: FakeTrtllm, node: NodeProc, stream: bool
) -> None:
    fake.script.cancel_calls = 1
    if stream:
        status, events, done = chat_stream(node)
        assert status == 200 and done
        assert streamed_text(events) == "Hello from TensorRT-LLM."
    else:
        r = chat(node)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "Hello from TensorRT-LLM."
    first, second = fake.requests[-2:]
    assert second.request_id != first.request_id  # the retry: the same request under a new id


def test_engine_abort_mid_stream_is_an_sse_error(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.cancel_after = 3
    status, events, _ = chat_stream(node)
    assert status == 200
    assert streamed_text(events) == tr_decode(reply_ids("Hello from TensorRT-LLM.")[:3])
    assert "error" in events[-1], events[-1]
    assert not finish_reasons(events)


def test_health_check_reads_the_status_text(fake: FakeTrtllm, node: NodeProc) -> None:
    fake.script.health = "RuntimeError: Executor is unhealthy"
    assert wait_for(lambda: not any(w["healthy"] for w in workers(node)))
    fake.script.health = "OK"
    assert wait_for(lambda: all(w["healthy"] for w in workers(node)))


def test_a_grpc_worker_found_trtllm_late_gets_its_kv_feed_on_the_new_client() -> None:
    """The worker is down when the node starts (its kind unknown, its KV feed started on the first
    client); once it answers, GetServerInfo says TensorRT-LLM and the feed follows the new client."""
    port = reserved_port()
    with node_over(f"grpc://127.0.0.1:{port}", extra=("--policy", "cache_aware"), ready=False) as node:
        assert wait_for(lambda: len(workers(node)) == 1)
        assert workers(node)[0]["healthy"] is False
        fake, server = start_fake_trtllm(port)
        try:
            assert wait_for(lambda: workers(node)[0]["kind"] == "trtllm" and workers(node)[0]["healthy"])
            assert wait_for(lambda: fake.kv_subscriptions >= 1)
            r = chat(node)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "Hello from TensorRT-LLM."
        finally:
            server.stop()
