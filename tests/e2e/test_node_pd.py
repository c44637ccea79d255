"""End to end: PD disaggregation — SGLang style (bootstrap room to both halves at once) through a node
process, vLLM style (prefill first, its KV transfer parameters to decode) through an in-process
gateway; mock engines in the prefill and decode roles check that the two halves match."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import httpx
import openai
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as SGL
from smg_grpc_proto import sglang_scheduler_pb2_grpc

from shepherd.node.cli import config_from_args
from shepherd.node.config import ConfigError, build_config
from shepherd.node.dispatch.gateway import Gateway
from shepherd.proto.engine_types import EngineComplete, EngineError, GenerateRequest, SamplingParams
from tests.e2e.node_procs import running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

MODEL = "qwen3"


def stats(engine: MockEngineProc) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(engine.http_url + "/mock/stats", timeout=5).json()
    return out


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MockEngineProc, MockEngineProc]]:
    """A prefill-role and a decode-role mock engine, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(start_mock_engine, "--zero-latency", "--role", "prefill"),
            pool.submit(start_mock_engine, "--zero-latency", "--role", "decode", "--pd-wait-s", "0.5"),
        ]
    started = [f.result() for f in futs if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(err for f in futs if (err := f.exception()) is not None)
        yield started[0], started[1]
    finally:
        for eng in started:
            eng.stop()


@pytest.fixture(scope="module")
def prefill(engines: tuple[MockEngineProc, MockEngineProc]) -> MockEngineProc:
    return engines[0]


@pytest.fixture(scope="module")
def decode(engines: tuple[MockEngineProc, MockEngineProc]) -> MockEngineProc:
    return engines[1]


# ---- configuration ---------------------------------------------------------------------------------


def test_pd_flags() -> None:
    cfg = config_from_args(
        [
            "serve",
            "--pd-disaggregation",
            "--prefill",
            "grpc://127.0.0.1:1",
            "9001",
            "--prefill",
            "grpc://127.0.0.1:2",
            "--decode",
            "grpc://127.0.0.1:3",
            "--prefill-policy",
            "cache_aware",
            "--decode-policy",
            "least_load",
        ]
    )
    assert cfg.prefill_urls == ("grpc://127.0.0.1:1", "grpc://127.0.0.1:2")
    assert cfg.prefill_bootstrap_ports == (9001, None) and cfg.decode_urls == ("grpc://127.0.0.1:3",)
    assert (cfg.prefill_policy, cfg.decode_policy) == ("cache_aware", "least_load")
    assert cfg.model_configs()[0].worker_urls == (*cfg.prefill_urls, *cfg.decode_urls)
    gw = Gateway(cfg)
    assert gw.pd is not None and type(gw.pd.prefill_policy).__name__ == "CacheAware"
    assert type(gw.pd.decode_policy).__name__ == "LeastLoad"


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"pd_disaggregation": True, "prefill_urls": ["grpc://a:1"]}, "at least one prefill and one decode"),
        ({"decode_urls": ["grpc://a:1"]}, "need pd_disaggregation"),
        (
            {"pd_disaggregation": True, "prefill_urls": ["http://a:1"], "decode_urls": ["grpc://b:1"]},
            "needs gRPC engines",
        ),
        (
            {"pd_disaggregation": True, "prefill_urls": ["grpc://a:1"], "decode_urls": ["grpc://a:1"]},
            "both pools",
        ),
        ({"prefill_policy": "fastest"}, "prefill_policy 'fastest' is unknown"),
    ],
)
def test_pd_config_errors(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(values, {})


# ---- SGLang style, through a node process ----------------------------------------------------------


def test_sglang_bootstrap_through_the_node(prefill: MockEngineProc, decode: MockEngineProc) -> None:
    before_p, before_d = stats(prefill), stats(decode)
    with running_node(
        "--pd-disaggregation",
        "--prefill",
        f"sglang://{prefill.grpc_target}",
        str(prefill.http_port),  # the mock's bootstrap server is its HTTP surface
        "--decode",
        f"sglang://{decode.grpc_target}",
        "--model-id",
        MODEL,
        "--prefill-policy",
        "cache_aware",
    ) as node:
        c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
        msgs: Any = [{"role": "user", "content": "Tell me about disaggregated serving."}]
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens == 12
        chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    sp, sd = stats(prefill), stats(decode)
    assert sp["requests_received"] - before_p["requests_received"] == 2
    assert sd["requests_received"] - before_d["requests_received"] == 2
    assert sd["disaggregated_requests"] - before_d["disaggregated_requests"] == 2
    room_p, room_d = sp["last_disaggregated_params"], sd["last_disaggregated_params"]
    assert room_p == room_d and room_p["bootstrap_host"] == "127.0.0.1"
    assert room_p["bootstrap_port"] == prefill.http_port and 0 <= room_p["bootstrap_room"] < 2**31


# ---- vLLM style, in process ------------------------------------------------------------------------


async def gateway(prefill_url: str, decode_url: str, bootstrap: str | None = None) -> Gateway:
    argv = ["serve", "--pd-disaggregation", "--prefill", prefill_url]
    argv += [bootstrap] if bootstrap else []
    argv += ["--decode", decode_url, "--model-id", MODEL, "--tokenizer-workers", "0"]
    gw = Gateway(config_from_args(argv))
    await gw.start()
    return gw


async def run(gw: Gateway, rid: str, ids: list[int], out: int) -> list[int]:
    s = await gw.open_stream(
        MODEL, GenerateRequest(rid, ids, SamplingParams(max_new_tokens=out, ignore_eos=True))
    )
    got: list[int] = []
    try:
        async for batch in s.batches():
            for ev in batch:
                if isinstance(ev, EngineComplete):
                    s.completed = True
                else:
                    got += ev.token_ids
    finally:
        await s.close()
    return got


async def test_vllm_kv_transfer_params_are_relayed(prefill: MockEngineProc, decode: MockEngineProc) -> None:
    gw = await gateway(f"vllm://{prefill.grpc_target}", f"vllm://{decode.grpc_target}")
    try:
        ids = list(range(1000, 1100))
        out = await run(gw, "pd-vllm-1", ids, 9)
        assert len(out) == 9
    finally:
        await gw.close()
    sp, sd = await asyncio.to_thread(stats, prefill), await asyncio.to_thread(stats, decode)
    asked = json.loads(sp["last_kv_transfer_params_json"])
    assert asked["do_remote_decode"] is True and sp["last_sampling_params"]["max_tokens"] == 1
    relayed = json.loads(sd["last_kv_transfer_params_json"])
    assert relayed["do_remote_prefill"] is True and relayed["remote_request_id"] == "pd-vllm-1"
    assert relayed["remote_bootstrap_port"] == prefill.http_port


async def test_a_wrong_bootstrap_port_fails_clearly(prefill: MockEngineProc, decode: MockEngineProc) -> None:
    gw = await gateway(f"sglang://{prefill.grpc_target}", f"sglang://{decode.grpc_target}", bootstrap="1")
    try:
        with pytest.raises(
            EngineError, match=r"bootstrap room \d+ is unknown to the prefill engine at 127.0.0.1:1"
        ):
            await run(gw, "pd-bad", list(range(50)), 4)
    finally:
        await gw.close()


# ---- the decode engine's own checks ----------------------------------------------------------------


async def test_decode_engine_rejects_requests_that_do_not_match_a_prefill(
    prefill: MockEngineProc, decode: MockEngineProc
) -> None:
    def req(rid: str, ids: list[int], room: int | None) -> Any:
        r = SGL.GenerateRequest(request_id=rid, tokenized=SGL.TokenizedInput(input_ids=ids), stream=False)
        r.sampling_params.CopyFrom(SGL.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
        if room is not None:
            r.disaggregated_params.CopyFrom(
                SGL.DisaggregatedParams(
                    bootstrap_host="127.0.0.1", bootstrap_port=prefill.http_port, bootstrap_room=room
                )
            )
        return r

    async with (
        grpc.aio.insecure_channel(prefill.grpc_target) as pch,
        grpc.aio.insecure_channel(decode.grpc_target) as dch,
    ):
        p = sglang_scheduler_pb2_grpc.SglangSchedulerStub(pch)
        d = sglang_scheduler_pb2_grpc.SglangSchedulerStub(dch)
        [m async for m in p.Generate(req("ok", list(range(40)), 4242))]
        assert [m async for m in d.Generate(req("ok", list(range(40)), 4242))]  # the same prompt and room
        cases = [
            (req("other-prompt", list(range(41)), 4242), "computed another prompt"),
            (req("unknown-room", list(range(40)), 777), "bootstrap room 777 is unknown"),
            (req("no-params", list(range(40)), None), "neither bootstrap parameters"),
        ]
        for r, message in cases:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                [m async for m in d.Generate(r)]
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and message in (
                ei.value.details() or ""
            )


def test_a_failing_prefill_is_retried_on_another_with_the_same_decode(
    prefill: MockEngineProc, decode: MockEngineProc
) -> None:
    """Two prefill workers and one decode (pools of uneven size, the usual shape): a prefill that fails
    is not tried again, its decode partner serves with the other prefill (both used to be excluded: the
    retry found no pair and the client got the 502). A worker of the pools' other kind, or a URL already
    in another role, is refused."""
    faults = prefill.http_url + "/mock/faults"
    with (
        start_mock_engine("--zero-latency", "--role", "prefill") as spare,
        running_node(
            *("--pd-disaggregation", "--model-id", MODEL, "--tokenizer-workers", "0"),
            *("--prefill", f"vllm://{prefill.grpc_target}", str(prefill.http_port)),
            *("--prefill", f"vllm://{spare.grpc_target}", str(spare.http_port)),
            *("--decode", f"vllm://{decode.grpc_target}", "--health-check-interval-secs", "1"),
        ) as node,
    ):
        httpx.post(faults, json={"error_rate": 1.0}, timeout=5).raise_for_status()
        try:
            c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
            msgs: Any = [{"role": "user", "content": "retry me"}]
            for _ in range(4):
                r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
                assert r.choices[0].message.content
        finally:
            httpx.post(faults, json={"error_rate": 0.0}, timeout=5).raise_for_status()
        assert stats(spare)["requests_received"] >= 4
        # the same URL in another role: 409, not "already registered"
        again = {"url": f"vllm://{spare.grpc_target}", "worker_type": "decode"}
        r2 = httpx.post(node.url + "/workers", json=again, timeout=30)
        assert r2.status_code == 409 and r2.json()["error"]["code"] == "worker_exists", r2.text
        with start_mock_engine("--zero-latency", "--role", "decode", "--engine", "sglang") as other:
            body = {"url": f"grpc://{other.grpc_target}", "worker_type": "decode"}
            r3 = httpx.post(node.url + "/workers", json=body, timeout=30)
            assert r3.status_code == 400 and r3.json()["error"]["code"] == "engine_kind_mismatch", r3.text
            names = [w["url"] for w in httpx.get(node.url + "/workers", timeout=10).json()["workers"]]
            assert not any(other.grpc_target in u for u in names)


def test_a_node_whose_prefill_pool_is_down_is_not_ready(decode: MockEngineProc) -> None:
    """A healthy decode worker alone serves nothing, nor does a regular gRPC worker beside the pools
    (every generation goes to a prefill and a decode worker): /readiness, /health and /ping say so (they
    said ready while every request was a 503)."""
    with (
        socket.socket() as hole,  # bound, not listening: the prefill pool's only worker refuses
        start_mock_engine("--zero-latency") as regular,
    ):
        hole.bind(("127.0.0.1", 0))
        dead = f"vllm://127.0.0.1:{hole.getsockname()[1]}"
        with running_node(
            *("--pd-disaggregation", "--model-id", MODEL, "--tokenizer-workers", "0", "--prefill", dead),
            *("--decode", f"vllm://{decode.grpc_target}", "--health-check-interval-secs", "1"),
            wait_ready=False,
        ) as node:
            workers = httpx.get(node.url + "/workers", timeout=10).json()["workers"]
            assert [w["is_healthy"] for w in workers if w["worker_type"] == "decode"] == [True], workers
            for _ in range(2):  # the pools alone, then with a healthy regular worker beside them
                assert httpx.get(node.url + "/readiness", timeout=5).status_code == 503
                assert httpx.get(node.url + "/health", timeout=5).status_code == 503
                assert httpx.get(node.url + "/ping", timeout=5).status_code == 503
                body = {"url": f"vllm://{regular.grpc_target}"}
                assert httpx.post(node.url + "/workers", json=body, timeout=30).status_code in (202, 409)
