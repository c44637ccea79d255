"""MLX workers through a real node, against ``fake_mlx`` (SMG's MLX servicer played back message by
message: lightseekorg/smg ``grpc_servicer/smg_grpc_servicer/mlx/servicer.py``; SMG's client of it and the
requests it refuses: lightseekorg/smg ``crates/grpc_client/src/mlx_engine.rs``).

One fake serves two worker URLs of one model: ``mlx://`` (the kind by scheme) and ``grpc://`` (the kind
found by GetServerInfo, after SGLang's, vLLM's and TensorRT-LLM's answered UNIMPLEMENTED).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from shepherd.proto.engine_requests import fold_seed
from tests.contract.fake_mlx import FakeMlx, start_fake_mlx
from tests.contract.fake_service_thread import reply_ids, tokenizer
from tests.contract.node_over_fake import (
    MODEL,
    chat,
    chat_stream,
    finish_reasons,
    node_over,
    streamed_text,
    wait_for,
    workers,
)
from tests.e2e.node_procs import NodeProc
from tests.e2e.test_node_tools import byte_tokenizer

REPLY = "Hello from MLX."


FAKE = (start_fake_mlx, "mlx")


@pytest.fixture
def node(served: tuple[FakeMlx, NodeProc]) -> NodeProc:
    return served[1]


def test_both_urls_are_mlx_workers_grpc_by_get_server_info(fake: FakeMlx, node: NodeProc) -> None:
    ws = workers(node)
    assert sorted(w["url"].partition("://")[0] for w in ws) == ["grpc", "mlx"]
    for w in ws:
        assert w["kind"] == "mlx", w
        assert w["healthy"] is True
        assert w["max_context_length"] == 40960


def test_chat_without_streaming_maps_sampling(fake: FakeMlx, node: NodeProc) -> None:
    r = chat(
        node,
        max_tokens=30,
        temperature=0.2,
        top_p=0.8,
        min_p=0.1,
        seed=(1 << 40) + 5,
        frequency_penalty=0.3,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        logit_bias={"7": -100},
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert (c["message"]["content"], c["finish_reason"]) == (REPLY, "stop")
    assert r.json()["usage"]["completion_tokens"] == len(reply_ids(REPLY)) + 1  # and EOS
    req = fake.requests[-1]
    sp = req.sampling_params
    assert req.stream is False
    assert req.WhichOneof("input") == "tokenized"
    assert sp.max_tokens == 30
    assert sp.temperature == pytest.approx(0.2)
    assert sp.top_p == pytest.approx(0.8)
    assert sp.top_k == 0  # unset: every token (ours -1)
    assert sp.min_p == pytest.approx(0.1)
    assert sp.seed == fold_seed((1 << 40) + 5) != 5  # int32: a 64-bit seed mixed in
    assert sp.frequency_penalty == pytest.approx(0.3)
    assert sp.presence_penalty == pytest.approx(0.4)
    assert sp.repetition_penalty == pytest.approx(1.2)
    assert dict(sp.logit_bias) == {7: -100.0}
    assert not sp.HasField("logprobs")


def test_stream(fake: FakeMlx, node: NodeProc) -> None:
    status, events, done = chat_stream(node)
    assert status == 200 and done
    assert streamed_text(events) == REPLY
    assert finish_reasons(events) == {0: "stop"}
    assert events[-1]["usage"]["completion_tokens"] == len(reply_ids(REPLY)) + 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"n": 2}, "n > 1"),
        ({"n": 2, "stream": True}, "n > 1"),
        ({"response_format": {"type": "json_object"}}, "structured outputs"),
        ({"min_tokens": 3}, "min_tokens"),
    ],
)
def test_what_mlx_cannot_honour_is_a_400_naming_it(
    fake: FakeMlx, node: NodeProc, body: dict[str, Any], field: str
) -> None:
    r = chat(node, **body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert "MLX" in r.json()["error"]["message"]
    assert not fake.requests  # refused before the engine saw it


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_the_gateways_work(fake: FakeMlx, node: NodeProc, stream: bool) -> None:
    fake.script.reply = "Hello world. STOP here and more"
    if stream:
        status, events, done = chat_stream(node, stop=["STOP"])
        assert status == 200 and done
        assert (streamed_text(events), finish_reasons(events)) == ("Hello world. ", {0: "stop"})
    else:
        r = chat(node, stop=["STOP"])
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert (c["message"]["content"], c["finish_reason"]) == ("Hello world. ", "stop")
    assert not fake.requests[-1].sampling_params.stop_token_ids  # the engine never sees the string


@pytest.mark.parametrize("stream", [False, True])
def test_length_cut(fake: FakeMlx, node: NodeProc, stream: bool) -> None:
    fake.script.reply = "one two three four five six seven"
    want = tokenizer().decode(reply_ids(fake.script.reply)[:4])
    if stream:
        status, events, done = chat_stream(node, max_tokens=4)
        assert status == 200 and done
        assert (streamed_text(events), finish_reasons(events)) == (want, {0: "length"})
    else:
        r = chat(node, max_tokens=4)
        c = r.json()["choices"][0]
        assert (c["message"]["content"], c["finish_reason"]) == (want, "length")
    assert fake.requests[-1].sampling_params.max_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_without_top_ask_for_one_and_show_none(fake: FakeMlx, node: NodeProc, stream: bool) -> None:
    if stream:
        status, events, _ = chat_stream(node, logprobs=True)
        assert status == 200
        entries = [
            e
            for ev in events
            for c in ev.get("choices", [])
            for e in ((c.get("logprobs") or {}).get("content") or [])
        ]
    else:
        r = chat(node, logprobs=True)
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) >= len(reply_ids(REPLY))
    assert entries[0]["logprob"] == pytest.approx(-0.5)
    assert all(e["top_logprobs"] == [] for e in entries)
    assert fake.requests[-1].sampling_params.logprobs == 1  # the servicer sends none for 0


def test_top_logprobs(fake: FakeMlx, node: NodeProc) -> None:
    r = chat(node, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    assert fake.requests[-1].sampling_params.logprobs == 3


def test_engine_abort_without_output_is_a_502(fake: FakeMlx, node: NodeProc) -> None:
    fake.script.abort_after = 0  # the stream ends OK, without a complete
    r = chat(node)
    assert r.status_code == 502, r.text
    assert "aborted" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_engine_abort_before_the_first_token_is_retried(fake: FakeMlx, node: NodeProc, stream: bool) -> None:
    fake.script.abort_calls = 1
    if stream:
        status, events, done = chat_stream(node)
        assert status == 200 and done
        assert streamed_text(events) == REPLY
    else:
        r = chat(node)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY
    first, second = fake.requests[-2:]
    assert second.request_id != first.request_id  # the retry: the same request under a new id


def test_engine_abort_mid_stream_is_an_sse_error(fake: FakeMlx, node: NodeProc) -> None:
    fake.script.abort_after = 3
    status, events, _ = chat_stream(node)
    assert status == 200
    assert streamed_text(events) == tokenizer().decode(reply_ids(REPLY)[:3])
    assert "error" in events[-1], events[-1]
    assert not finish_reasons(events)


def test_engine_error_is_a_502(fake: FakeMlx, node: NodeProc) -> None:
    fake.script.fail_after = 0
    r = chat(node)
    assert r.status_code == 502, r.text


def test_engine_error_mid_stream_is_an_sse_error(fake: FakeMlx, node: NodeProc) -> None:
    fake.script.fail_after = 2
    status, events, _ = chat_stream(node)
    assert status == 200
    assert "error" in events[-1], events[-1]
    assert not finish_reasons(events)


def test_health_check(fake: FakeMlx, node: NodeProc) -> None:
    fake.script.healthy = False
    assert wait_for(lambda: not any(w["healthy"] for w in workers(node)))
    fake.script.healthy = True
    assert wait_for(lambda: all(w["healthy"] for w in workers(node)))


def test_tokenizer_from_a_grpc_worker_detected_as_mlx(tmp_path: Path) -> None:
    """No --model-path: a ``grpc://`` worker found to be MLX (by GetServerInfo) is asked for GetTokenizer
    (SMG's MLX servicer serves it) and the node tokenizes with what it sent, not the embedded Qwen3."""
    fake, server = start_fake_mlx()
    try:
        fake.model_dir = byte_tokenizer(tmp_path / "served")
        cache = ("--tokenizer-cache-dir", str(tmp_path / "cache"))
        with node_over(f"grpc://127.0.0.1:{server.port}", extra=cache) as node:
            r = httpx.post(node.url + "/v1/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["count"] == len("hello")  # the byte tokenizer: one id per byte
        assert fake.tokenizer_calls == 1
    finally:
        server.stop()
