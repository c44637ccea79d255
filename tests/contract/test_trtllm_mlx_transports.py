"""The TensorRT-LLM and MLX clients over both transports (the lean HTTP/2 one and grpcio), without a node:
the URL scheme and GetServerInfo detection pick the client (``dispatch.workers.make_client``,
``engines.kinds.settle_kind``), against the dialect fakes (``fake_trtllm``: NVIDIA/TensorRT-LLM
``tensorrt_llm/grpc/smg/servicer.py``; ``fake_mlx``: lightseekorg/smg
``grpc_servicer/smg_grpc_servicer/mlx/servicer.py``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import replace
from typing import cast

import pytest

from shepherd.node.dispatch.workers import make_client
from shepherd.node.engines.kinds import settle_kind
from shepherd.node.engines.mlx import MlxEngineClient
from shepherd.node.engines.trtllm import TrtllmEngineClient
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    GenerateRequest,
    KvBlocksStored,
    KvEventBatch,
    SamplingParams,
)
from shepherd.proto.mlx_codec import mlx_generate
from shepherd.proto.trtllm_codec import trtllm_generate
from tests.contract.fake_mlx import FakeMlx, start_fake_mlx
from tests.contract.fake_service_thread import ServerThread, reply_ids
from tests.contract.fake_trtllm import FakeTrtllm, start_fake_trtllm, trtllm_kv_batch

TRANSPORTS = ["h2", "grpcio"]


@pytest.fixture(scope="module")
def trt() -> Iterator[tuple[FakeTrtllm, ServerThread]]:
    fake, server = start_fake_trtllm()
    try:
        yield fake, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mlx() -> Iterator[tuple[FakeMlx, ServerThread]]:
    fake, server = start_fake_mlx()
    try:
        yield fake, server
    finally:
        server.stop()


def _req(stream: bool, n: int = 1, max_new: int = 32) -> GenerateRequest:
    return GenerateRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=max_new, n=n), stream=stream)


async def _events(client: object, req: GenerateRequest) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    async for batch in client.generate_batches(req, timeout=10):  # type: ignore[attr-defined]
        out.extend(batch)
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_trtllm_scheme_and_detection(trt: tuple[FakeTrtllm, ServerThread], transport: str) -> None:
    fake, server = trt
    by_scheme = make_client(f"trtllm://127.0.0.1:{server.port}", transport)
    base = make_client(f"grpc://127.0.0.1:{server.port}", transport)
    assert isinstance(by_scheme, TrtllmEngineClient)
    assert base.kind == "unknown"
    detected = await settle_kind(base, 5.0)  # type: ignore[arg-type]
    assert isinstance(detected, TrtllmEngineClient) and detected.kind == "trtllm"
    try:
        for client in (by_scheme, detected):
            assert await client.health_check(2.0) is True
            info = await client.model_info()
            assert (info.max_context_length, info.vocab_size) == (8192, 151936)
            ids = reply_ids(fake.script.replies[0])
            evs = await _events(client, _req(stream=True, n=2))
            chunks = [e for e in evs if isinstance(e, EngineChunk)]
            completes = [e for e in evs if isinstance(e, EngineComplete)]
            for i in (0, 1):
                got = [t for c in chunks if c.index == i for t in c.token_ids]
                assert got[: len(ids)] == ids
            # streamed: the cumulative output_token_ids of each complete are not passed on again
            assert sorted(c.index for c in completes) == [0, 1]
            assert all(not c.output_ids and c.finish_reason == "stop" for c in completes)
            evs = await _events(client, _req(stream=False))
            assert len(evs) == 1 and isinstance(evs[0], EngineComplete)
            assert list(evs[0].output_ids)[: len(ids)] == ids
    finally:
        await by_scheme.close()
        await detected.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_trtllm_kv_events(trt: tuple[FakeTrtllm, ServerThread], transport: str) -> None:
    fake, server = trt
    toks = list(range(100, 164))
    fake.kv_batches = [
        trtllm_kv_batch(1, 7, [(2**63 + 5, toks[:32]), (11, toks[32:])], None),
        trtllm_kv_batch(2, 8, [(12, list(range(200, 232)))], parent=11),
    ]
    client = make_client(f"trtllm://127.0.0.1:{server.port}", transport)
    assert isinstance(client, TrtllmEngineClient)
    got = []
    try:
        stream = cast(AsyncGenerator[KvEventBatch, None], client.subscribe_kv_events())
        async for batch in stream:  # bounded: the fake sends two, then stays open
            got.append(batch)
            if len(got) == 2:
                break
        await stream.aclose()
        assert [b.sequence_number for b in got] == [1, 2]
        first, second = (b.events[0] for b in got)
        assert isinstance(first, KvBlocksStored) and isinstance(second, KvBlocksStored)
        assert first.block_hashes == (5 - 2**63, 11) and first.parent_hash is None
        assert (first.token_ids, first.block_size) == (tuple(toks), 32)
        assert (second.block_hashes, second.parent_hash, second.block_size) == ((12,), 11, 32)
        fake.kv_unimplemented = True  # the servicer version that lacks it: the feed is told UNIMPLEMENTED
        with pytest.raises(EngineError) as e:
            async for _ in client.subscribe_kv_events():
                pass
        assert "UNIMPLEMENTED" in str(e.value)  # the KV feed stops on it
    finally:
        fake.kv_unimplemented = False
        fake.kv_batches = []
        await client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mlx_scheme_and_detection(mlx: tuple[FakeMlx, ServerThread], transport: str) -> None:
    fake, server = mlx
    by_scheme = make_client(f"mlx://127.0.0.1:{server.port}", transport)
    detected = await settle_kind(make_client(f"grpc://127.0.0.1:{server.port}", transport), 5.0)  # type: ignore[arg-type]
    assert isinstance(by_scheme, MlxEngineClient)
    assert isinstance(detected, MlxEngineClient)
    try:
        for client in (by_scheme, detected):
            assert await client.health_check(2.0) is True
            load = await client.loads()  # GetServerInfo's active_requests: none now
            assert load.running == 0
            evs = await _events(client, _req(stream=True))
            assert [t for e in evs if isinstance(e, EngineChunk) for t in e.token_ids][:3] == reply_ids(
                fake.script.reply
            )[:3]
            with pytest.raises(EngineError) as e:
                await _events(client, _req(stream=True, n=2))
            assert e.value.code == "invalid_request" and "n > 1" in str(e.value)
            with pytest.raises(EngineError) as e:
                async for _ in client.subscribe_kv_events():
                    pass
            assert "UNIMPLEMENTED" in str(e.value)
            with pytest.raises(EngineError) as e:
                await client.embed("e1", [1, 2, 3])
            assert e.value.code == "invalid_request" and "embeddings" in str(e.value)
    finally:
        await by_scheme.close()
        await detected.close()


def test_what_each_engine_cannot_carry_is_refused_naming_it() -> None:
    base = GenerateRequest("r", [1], SamplingParams(max_new_tokens=4))
    sglang_pd = replace(base, bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=7)
    vllm_pd = replace(base, kv_transfer_params_json="{}")
    for req in (sglang_pd, vllm_pd):
        for encode in (lambda r: trtllm_generate(r, 16), mlx_generate):
            with pytest.raises(EngineError) as e:
                encode(req)
            assert e.value.code == "invalid_request" and "PD disaggregation" in str(e.value)
    biased = replace(base, sampling=SamplingParams(max_new_tokens=4, logit_bias=((3, 1.5),)))
    with pytest.raises(EngineError, match="logit_bias"):
        trtllm_generate(biased, 0)  # no vocabulary size reported
    with pytest.raises(EngineError, match="outside the vocabulary"):
        trtllm_generate(biased, 3)
    assert list(trtllm_generate(biased, 5).embedding_bias) == [0.0, 0.0, 0.0, 1.5, 0.0]
    assert dict(mlx_generate(biased).sampling_params.logit_bias) == {3: 1.5}


async def test_a_worker_serving_no_known_service_is_refused() -> None:
    server = ServerThread(lambda s: None)  # a gRPC server with no service at all
    server.start()
    try:
        client = make_client(f"grpc://127.0.0.1:{server.port}")
        with pytest.raises(EngineError) as e:
            await settle_kind(client, 5.0)  # type: ignore[arg-type]
        assert "none of SGLang's, vLLM's, TensorRT-LLM's or MLX's" in str(e.value)
        await client.close()
    finally:
        server.stop()
