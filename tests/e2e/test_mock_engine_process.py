"""End to end: ``smg-mock-engine`` as a real process on loopback, driven through gRPC and HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto import (
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)
from smg_grpc_proto.generated import common_pb2

from shepherd.tokens.tokenizer import Tokenizer
from tests.e2e.procs import MockEngineProc, start_mock_engine

SGL = sglang_scheduler_pb2
VLLM = vllm_engine_pb2
PROMPT = list(range(1000, 1064))  # 64 tokens = 4 blocks


@pytest.fixture(scope="module", params=["grpcio", "lean"])
def engine(request: pytest.FixtureRequest) -> Iterator[MockEngineProc]:
    """One engine per gRPC server implementation; every test runs against both."""
    args = ("--decode-ms-per-token", "2", "--output-len", "12", "--max-running", "8")
    with start_mock_engine(*args, "--grpc-server", request.param) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from shepherd.node.config import EMBEDDED_MODEL_DIR

    return Tokenizer.load(EMBEDDED_MODEL_DIR)


@pytest.fixture()
async def channel(engine: MockEngineProc) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(engine.grpc_target)
    try:
        yield ch
    finally:
        await ch.close()


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the shared engine: no scripted responses, no faults."""
    yield
    if "engine" in request.fixturenames:
        engine: MockEngineProc = request.getfixturevalue("engine")
        httpx.delete(engine.http_url + "/mock/responses", timeout=5)
        faults = {"error_rate": 0.0, "stall_after_tokens": None}
        httpx.post(engine.http_url + "/mock/faults", json=faults, timeout=5)


def stats(engine: MockEngineProc) -> dict[str, Any]:
    r = httpx.get(engine.http_url + "/mock/stats", timeout=5)
    out: dict[str, Any] = r.json()
    return out


async def control(engine: MockEngineProc, method: str, path: str, body: object = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=engine.http_url, timeout=5) as http:
        return await http.request(method, path, json=body)


def vllm_request(rid: str, *, stream: bool = False, **sampling: Any) -> Any:
    return VLLM.GenerateRequest(
        request_id=rid,
        tokenized=VLLM.TokenizedInput(input_ids=PROMPT),
        sampling_params=VLLM.SamplingParams(**sampling),
        stream=stream,
    )


def sgl_request(
    rid: str,
    *,
    stream: bool,
    max_new: int | None = None,
    prompt: list[int] | None = None,
    ignore_eos: bool = False,
    n: int = 1,
) -> Any:
    sp = SGL.SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        n=n,
        ignore_eos=ignore_eos,
        skip_special_tokens=True,
    )
    if max_new is not None:
        sp.max_new_tokens = max_new
    return SGL.GenerateRequest(
        request_id=rid,
        tokenized=SGL.TokenizedInput(input_ids=PROMPT if prompt is None else prompt),
        sampling_params=sp,
        stream=stream,
    )


async def test_sglang_generate_stream_and_non_stream(channel: grpc.aio.Channel) -> None:
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    msgs = [m async for m in stub.Generate(sgl_request("s1", stream=True))]
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    completes = [m.complete for m in msgs if m.HasField("complete")]
    assert all(m.request_id == "s1" for m in msgs)
    assert len(completes) == 1 and msgs[-1].HasField("complete")
    done = completes[0]
    assert done.finish_reason == "stop" and done.completion_tokens == 13 and done.prompt_tokens == 64
    assert sum(len(c.token_ids) for c in chunks) == 13 and chunks[-1].completion_tokens == 13
    assert chunks[-1].token_ids[-1] == done.matched_token_id  # EOS, included in the output
    streamed = [t for c in chunks for t in c.token_ids]
    whole = [m async for m in stub.Generate(sgl_request("s2", stream=False))]
    assert len(whole) == 1 and whole[0].HasField("complete")
    assert list(whole[0].complete.output_ids) == streamed  # deterministic: same prompt, same output
    assert whole[0].complete.cached_tokens == 63  # the prompt is cached now (one token recomputed)
    capped = [m async for m in stub.Generate(sgl_request("s3", stream=False, max_new=5))]
    assert capped[0].complete.finish_reason == "length" and len(capped[0].complete.output_ids) == 5


async def test_vllm_generate_stream_non_stream_and_logprobs(channel: grpc.aio.Channel) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    sp = VLLM.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=6, n=2, logprobs=2)
    req = VLLM.GenerateRequest(
        request_id="v1", tokenized=VLLM.TokenizedInput(input_ids=PROMPT), sampling_params=sp, stream=True
    )
    msgs = [m async for m in stub.Generate(req)]
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for m in msgs:
        if m.HasField("chunk"):
            by_index[m.chunk.index].extend(m.chunk.token_ids)
            assert len(m.chunk.output_logprobs.top_logprobs) == len(m.chunk.token_ids)
            assert all(len(t.token_ids) == 2 for t in m.chunk.output_logprobs.top_logprobs)
    completes = sorted((m.complete for m in msgs if m.HasField("complete")), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1] and all(c.finish_reason == "length" for c in completes)
    assert all(len(v) == 6 for v in by_index.values()) and by_index[0] != by_index[1]
    req2 = vllm_request("v2", max_tokens=4)
    whole = [m async for m in stub.Generate(req2)]
    assert len(whole) == 1 and len(whole[0].complete.output_ids) == 4


async def test_abort_mid_stream_is_seen_in_stats(channel: grpc.aio.Channel, engine: MockEngineProc) -> None:
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    call = stub.Generate(sgl_request("to-abort", stream=True, max_new=2000, ignore_eos=True))
    seen = 0
    last: Any = None
    async for m in call:
        last = m
        if m.HasField("chunk"):
            seen += 1
            if seen == 3:
                resp = await stub.Abort(SGL.AbortRequest(request_id="to-abort", reason="test"))
                assert resp.success
    assert last is not None and last.HasField("complete") and last.complete.finish_reason == "abort"
    assert last.complete.completion_tokens < 2000
    s = stats(engine)
    assert "to-abort" in s["aborted"] and "to-abort" in s["aborted_by_rpc"]
    assert s["rpc_calls"]["sglang.Abort"] >= 1


async def test_cancelled_stream_frees_the_slot_and_loads_follow(
    channel: grpc.aio.Channel, engine: MockEngineProc
) -> None:
    sgl = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = sgl.Generate(sgl_request("to-cancel", stream=True, max_new=5000, ignore_eos=True))
    async for m in call:
        if m.HasField("chunk"):
            break
    loads = await sgl.GetLoads(SGL.GetLoadsRequest(include=["all"]))
    assert loads.loads[0].num_running_reqs >= 1 and loads.aggregate.total_running_reqs >= 1
    assert loads.loads[0].num_used_tokens > 0 and loads.loads[0].max_running_requests == 8
    vloads = await vllm.GetLoads(VLLM.GetLoadsRequest())
    assert vloads.loads[0].num_running_reqs >= 1
    call.cancel()
    for _ in range(200):  # bounded: up to ~10 s
        if "to-cancel" in stats(engine)["cancelled"]:
            break
        await asyncio.sleep(0.05)
    assert "to-cancel" in stats(engine)["cancelled"]
    loads = await sgl.GetLoads(SGL.GetLoadsRequest())
    assert loads.loads[0].num_running_reqs == 0 and stats(engine)["active"] == 0


async def test_kv_events_show_stored_blocks(channel: grpc.aio.Channel) -> None:
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    fresh = list(range(70_000, 70_048))  # 3 blocks never seen before
    subscribe = common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=0, load_records_before_first_batch=True
    )
    events = stub.SubscribeKvEvents(subscribe)
    stream = events.__aiter__()
    async with asyncio.timeout(10):
        hello = await stream.__anext__()  # a load record numbered 0: the subscription is registered
    assert hello.sequence_number == 0 and hello.load.load_only and not hello.events
    [m async for m in stub.Generate(sgl_request("kv", stream=False, prompt=fresh))]
    stored: list[Any] = []
    seqs: list[int] = []
    async with asyncio.timeout(10):
        async for batch in stream:
            if batch.load.load_only:
                continue
            seqs.append(batch.sequence_number)
            assert batch.load.max_running_requests == 8
            stored += [ev.stored for ev in batch.events if ev.HasField("stored")]
            if any(list(b.token_ids) == fresh[:16] for s in stored for b in s.blocks):
                break
    events.cancel()
    first = next(s for s in stored if any(list(b.token_ids) == fresh[:16] for b in s.blocks))
    assert not first.HasField("parent_block_hash") and first.blocks[0].block_size == 16
    assert [list(b.token_ids) for b in first.blocks] == [fresh[0:16], fresh[16:32], fresh[32:48]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # a resumed subscription replays the history from a sequence number
    replay = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=seqs[0]))
    async with asyncio.timeout(10):
        async for batch in replay:
            assert batch.sequence_number == seqs[0]
            break
    replay.cancel()


async def test_scripted_response(
    channel: grpc.aio.Channel, engine: MockEngineProc, tokenizer: Tokenizer
) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = await control(engine, "POST", "/mock/responses", {"text": text, "match": "weather in Paris"})
    assert r.status_code == 200 and r.json()["pending"][0]["remaining"] == 1
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    other = [m async for m in stub.Generate(sgl_request("plain", stream=False))]
    assert tokenizer.decode(other[0].complete.output_ids) != text  # no match: not consumed
    prompt = tokenizer.encode("What is the weather in Paris?")
    msgs = [m async for m in stub.Generate(sgl_request("scripted", stream=True, prompt=prompt))]
    ids = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text + "<|im_end|>"
    assert msgs[-1].complete.finish_reason == "stop"
    assert (await control(engine, "GET", "/mock/responses")).json()["pending"] == []


async def test_error_fault_fails_before_first_token(
    channel: grpc.aio.Channel, engine: MockEngineProc
) -> None:
    r = await control(engine, "POST", "/mock/faults", {"error_rate": 1.0, "error_code": "INTERNAL"})
    assert r.status_code == 200 and r.json()["error_rate"] == 1.0
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    req = vllm_request("err", stream=True, max_tokens=3)
    got: list[Any] = []
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        got += [m async for m in stub.Generate(req)]
    assert ei.value.code() == grpc.StatusCode.INTERNAL and got == []
    bad = await control(engine, "POST", "/mock/faults", {"error_rate": 7})
    assert bad.status_code == 400 and "error" in bad.json()


async def test_info_rpcs_tokenizer_and_recorded_params(
    channel: grpc.aio.Channel, engine: MockEngineProc, tokenizer: Tokenizer
) -> None:
    sgl = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    info = await sgl.GetModelInfo(SGL.GetModelInfoRequest())
    assert info.served_model_name == "qwen3" and info.max_context_length == 32768
    assert (
        list(info.eos_token_ids) == list(tokenizer.eos_token_ids) and info.vocab_size == tokenizer.vocab_size
    )
    vinfo = await vllm.GetModelInfo(VLLM.GetModelInfoRequest())
    assert vinfo.served_model_name == "qwen3"
    server = await sgl.GetServerInfo(SGL.GetServerInfoRequest())
    assert server.server_type == "grpc" and server.sglang_version == "mock"
    vserver = await vllm.GetServerInfo(VLLM.GetServerInfoRequest())
    assert vserver.server_type == "vllm-grpc" and vserver.max_num_seqs == 8
    assert (await sgl.HealthCheck(SGL.HealthCheckRequest())).healthy
    data = b""
    digest = ""
    async for chunk in vllm.GetTokenizer(common_pb2.GetTokenizerRequest()):
        data += chunk.data
        digest = chunk.sha256 or digest
    assert hashlib.sha256(data).hexdigest() == digest
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    [m async for m in sgl.Generate(sgl_request("params", stream=False, max_new=2))]
    s = stats(engine)
    assert s["last_request_kind"] == "sglang"
    params = s["last_sampling_params"]
    assert params["temperature"] == 1.0 and params["top_k"] == -1 and params["max_new_tokens"] == 2
    assert params["min_p"] == 0.0  # every field is listed, set or not


async def test_pd_parameters_are_recorded(channel: grpc.aio.Channel, engine: MockEngineProc) -> None:
    sgl = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    req = sgl_request("pd-sgl", stream=False, max_new=2)
    req.disaggregated_params.CopyFrom(
        SGL.DisaggregatedParams(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=7)
    )
    [m async for m in sgl.Generate(req)]
    assert stats(engine)["last_disaggregated_params"]["bootstrap_room"] == 7
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    kv = json.dumps({"do_remote_prefill": True, "remote_block_ids": [1, 2]})
    vreq = vllm_request("pd-vllm", max_tokens=2)
    vreq.kv_transfer_params_json = kv
    [m async for m in vllm.Generate(vreq)]
    s = stats(engine)
    assert s["last_kv_transfer_params_json"] == kv and s["disaggregated_requests"] >= 2


async def test_http_surface(engine: MockEngineProc) -> None:
    async with httpx.AsyncClient(base_url=engine.http_url, timeout=10) as http:
        assert (await http.get("/health")).status_code == 200
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["qwen3"]
        msgs = [{"role": "user", "content": "Tell me about the river."}]
        r = await http.post(
            "/v1/chat/completions", json={"model": "qwen3", "messages": msgs, "max_tokens": 8}
        )
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
        text = body["choices"][0]["message"]["content"]
        streamed = ""
        usage = None
        lines = []
        req = {
            "model": "qwen3",
            "messages": msgs,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", "/v1/chat/completions", json=req) as resp:
            lines += [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                streamed += c["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
        assert streamed == text and usage is not None and usage["completion_tokens"] == 8
        comp = await http.post("/v1/completions", json={"model": "qwen3", "prompt": "Once", "max_tokens": 3})
        assert comp.json()["object"] == "text_completion" and comp.json()["usage"]["completion_tokens"] == 3
        loads = (await http.get("/v1/loads")).json()
        assert loads["loads"][0]["max_running_requests"] == 8
        missing = await http.post("/v1/chat/completions", json={"model": "nope", "messages": msgs})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_http_client_disconnect_frees_the_slot(engine: MockEngineProc) -> None:
    body = {"prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=engine.http_url, timeout=10) as http:
        headers = {"x-request-id": "http-gone"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
    for _ in range(200):  # bounded: up to ~10 s
        if "http-gone" in (await control(engine, "GET", "/mock/stats")).json()["cancelled"]:
            break
        await asyncio.sleep(0.05)
    s = (await control(engine, "GET", "/mock/stats")).json()
    assert "http-gone" in s["cancelled"] and s["active"] == 0


async def test_zero_latency_lean_streams_whole_requests_at_once() -> None:
    with start_mock_engine("--zero-latency", "--output-len", "7") as e:  # auto: the lean server
        async with grpc.aio.insecure_channel(e.grpc_target) as ch:
            sgl = sglang_scheduler_pb2_grpc.SglangSchedulerStub(ch)
            req = sgl_request("z1", stream=True, n=2)
            req.sampling_params.stream_interval = 3
            msgs = [m async for m in sgl.Generate(req)]
            sizes = [len(m.chunk.token_ids) for m in msgs if m.HasField("chunk") and m.chunk.index == 0]
            assert sizes == [1, 3, 3, 1]  # 7 tokens + EOS, the first token alone
            completes = [m.complete for m in msgs if m.HasField("complete")]
            assert sorted(c.index for c in completes) == [0, 1] and all(
                c.finish_reason == "stop" for c in completes
            )
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            vmsgs = [
                m async for m in vllm.Generate(vllm_request("z2", stream=True, max_tokens=5, logprobs=1))
            ]
            assert [len(m.chunk.output_logprobs.token_ids) for m in vmsgs if m.HasField("chunk")] == [1] * 5
            assert vmsgs[-1].complete.finish_reason == "length"


def test_crash_fault_exits_the_process() -> None:
    with start_mock_engine("--zero-latency", "--crash-after-requests", "1") as e:
        url = e.http_url + "/v1/completions"
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        e.proc.wait(timeout=10)
        assert e.proc.returncode == 1


def test_sigterm_exits_cleanly() -> None:
    e = start_mock_engine("--zero-latency", "--engine", "vllm")
    try:
        assert e.alive()
    finally:
        assert e.stop() == 0
    assert "Traceback" not in e.log()
