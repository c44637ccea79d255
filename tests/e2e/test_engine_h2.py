"""H2EngineClient end to end: against ``smg-mock-engine`` (a real process) and in-process grpc.aio servers.

Wherever it can, a test runs the same call through GrpcEngineClient and asserts the same outcome: the two
transports must be interchangeable.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto import vllm_engine_pb2_grpc as vl_grpc

from shepherd.node.engines import h2_frames
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineClient,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineTimeout,
    EngineUnavailable,
    GenerateRequest,
    SamplingParams,
)
from tests.e2e.procs import MockEngineProc, start_mock_engine

PROMPT = list(range(2000, 2040))


def request(
    rid: str, tokens: int = 8, stream: bool = True, n: int = 1, prompt: list[int] = PROMPT
) -> GenerateRequest:
    return GenerateRequest(
        rid,
        prompt,
        SamplingParams(max_new_tokens=tokens, stream_interval=1, n=n, ignore_eos=True),
        stream=stream,
    )


async def collect(client: Any, req: GenerateRequest, timeout: float | None = 30.0) -> list[EngineEvent]:
    return [ev async for ev in client.generate(req, timeout=timeout)]


def flushed(engine: MockEngineProc) -> None:
    """Empty the mock's prefix cache, so two runs of one request report the same cached_tokens."""
    httpx.post(engine.http_url + "/mock/flush_cache", timeout=5).raise_for_status()


def outcome(exc: BaseException) -> tuple[type[BaseException], str, bool]:
    assert isinstance(exc, EngineError)
    return type(exc), exc.code, exc.retryable


# ---------------------------------------------------------------------------------------------- mock engine


@pytest.fixture(scope="module")
def engine() -> Iterator[MockEngineProc]:
    with start_mock_engine("--decode-ms-per-token", "2", "--output-len", "16", "--max-running", "128") as e:
        yield e


@pytest.fixture(autouse=True)
def _reset_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        e: MockEngineProc = request.getfixturevalue("engine")
        httpx.post(e.http_url + "/mock/faults", json={"error_rate": 0.0}, timeout=5)


@contextlib.asynccontextmanager
async def clients(
    target: str, kind: str | None = None
) -> AsyncIterator[tuple[H2EngineClient, GrpcEngineClient]]:
    h = H2EngineClient(f"grpc://{target}", target, kind)
    g = GrpcEngineClient(f"grpc://{target}", target, kind)
    try:
        yield h, g
    finally:
        await h.close()
        await g.close()


async def wait_for_stat(engine: MockEngineProc, key: str, rid: str) -> bool:
    async with httpx.AsyncClient() as http:
        for _ in range(100):
            stats = (await http.get(engine.http_url + "/mock/stats", timeout=5)).json()
            if rid in stats[key]:
                return True
            await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_streaming_generate_matches_grpcio(engine: MockEngineProc, kind: str) -> None:
    async with clients(engine.grpc_target, kind) as (h, g):
        flushed(engine)
        got = await collect(h, request(f"s-{kind}", tokens=8))
        flushed(engine)
        want = await collect(g, request(f"s-{kind}", tokens=8))

    # the h2 client merges messages that arrive in one read (grpcio yields each): compare what the
    # stream says, not how it was cut
    def tokens(evs: list[EngineEvent]) -> list[int]:
        return [t for e in evs if isinstance(e, EngineChunk) for t in e.token_ids]

    assert tokens(got) == tokens(want) and len(tokens(got)) == 8
    assert got[-1] == want[-1]
    assert isinstance(got[-1], EngineComplete) and got[-1].completion_tokens == 8


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_non_stream_with_two_choices(engine: MockEngineProc, kind: str) -> None:
    async with clients(engine.grpc_target, kind) as (h, g):
        flushed(engine)
        got = await collect(h, request(f"n2-{kind}", tokens=6, stream=False, n=2))
        flushed(engine)
        want = await collect(g, request(f"n2-{kind}", tokens=6, stream=False, n=2))
    assert got == want
    # SMG's SGLang servicer numbers no choice without streaming (the mock imitates it): both say 0
    assert sorted(e.index for e in got) == ([0, 0] if kind == "sglang" else [0, 1])
    assert all(isinstance(e, EngineComplete) and len(e.output_ids) == 6 for e in got)


async def test_detect_and_metadata_calls_match_grpcio(engine: MockEngineProc) -> None:
    async with clients(engine.grpc_target) as (h, g):
        assert await h.detect() == await g.detect() == "sglang"
        assert await h.health_check() and await g.health_check()
        assert await h.model_info() == await g.model_info()
        assert (await h.server_info()).version == (await g.server_info()).version
        assert (await h.loads()).max_total_tokens == (await g.loads()).max_total_tokens


async def test_64_concurrent_streams_share_one_connection(engine: MockEngineProc) -> None:
    async with clients(engine.grpc_target, "sglang") as (h, _):
        results = await asyncio.gather(*(collect(h, request(f"c{i}", tokens=12)) for i in range(64)))
        assert h.connects == 1
    for evs in results:
        assert sum(len(e.token_ids) for e in evs if isinstance(e, EngineChunk)) == 12
        assert isinstance(evs[-1], EngineComplete)


async def test_aclose_mid_stream_cancels_on_the_server(engine: MockEngineProc) -> None:
    async with clients(engine.grpc_target, "sglang") as (h, _):
        gen = h.generate(request("cancel-aclose", tokens=2000), timeout=30)
        seen = 0
        async for _ev in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()  # type: ignore[attr-defined]
        assert await wait_for_stat(engine, "cancelled", "cancel-aclose")
        # the connection is still good
        assert isinstance((await collect(h, request("after-cancel", tokens=2)))[-1], EngineComplete)


async def test_task_cancel_mid_stream_cancels_on_the_server(engine: MockEngineProc) -> None:
    async with clients(engine.grpc_target, "vllm") as (h, _):
        first = asyncio.Event()

        async def consume() -> None:
            async for _ev in h.generate(request("cancel-task", tokens=2000), timeout=30):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_for_stat(engine, "cancelled", "cancel-task")


async def test_abort_rpc_ends_a_running_request(engine: MockEngineProc) -> None:
    async with clients(engine.grpc_target, "sglang") as (h, _):
        gen = h.generate(request("to-abort", tokens=2000), timeout=30)
        events: list[EngineEvent] = [await gen.__anext__()]
        await h.abort("to-abort", "test")
        with contextlib.suppress(EngineError):
            events += [ev async for ev in gen]
        assert await wait_for_stat(engine, "aborted_by_rpc", "to-abort")
        assert sum(isinstance(e, EngineChunk) for e in events) < 2000


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"])
async def test_server_error_status_maps_like_grpcio(engine: MockEngineProc, code: str) -> None:
    async with httpx.AsyncClient() as http:
        faults = {"error_rate": 1.0, "error_code": code}
        (await http.post(engine.http_url + "/mock/faults", json=faults, timeout=5)).raise_for_status()
    async with clients(engine.grpc_target, "sglang") as (h, g):
        with pytest.raises(EngineError) as got:
            await collect(h, request(f"err-{code}"))
        with pytest.raises(EngineError) as want:
            await collect(g, request(f"err-{code}"))
    assert outcome(got.value) == outcome(want.value)
    assert str(got.value) == str(want.value)


# ----------------------------------------------------------------------------------- in-process servers


class Sglang(sg_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """Behaviour chosen by the request id: ``tokens:N:DELAY``, ``sleep:S``, ``error:MSG``, ``echo`` (``#x``
    suffixes are ignored)."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rid = request.request_id
        mode, _, arg = rid.split("#")[0].partition(":")
        try:
            if mode == "sleep":
                await asyncio.sleep(float(arg))
            elif mode == "error":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, arg)
            elif mode == "echo":
                ids = list(request.tokenized.input_ids)
                yield sg.GenerateResponse(
                    request_id=rid, complete=sg.GenerateComplete(finish_reason="stop", output_ids=ids)
                )
                return
            n, _, delay = arg.partition(":")
            for i in range(int(n or 4)):
                yield sg.GenerateResponse(
                    request_id=rid, chunk=sg.GenerateStreamChunk(token_ids=[i], completion_tokens=i + 1)
                )
                if delay:
                    await asyncio.sleep(float(delay))
            yield sg.GenerateResponse(request_id=rid, complete=sg.GenerateComplete(finish_reason="length"))
        except (asyncio.CancelledError, GeneratorExit):
            # cancelled while awaiting, or closed at a ``yield`` (grpc.aio closes the generator when the
            # client's RST_STREAM lands while a message is being sent): either way the call ended under it
            self.cancelled.append(rid)
            raise

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return sg.GetServerInfoResponse(sglang_version="inproc")

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return sg.HealthCheckResponse(healthy=True)


class Vllm(vl_grpc.VllmEngineServicer):  # type: ignore[misc]
    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return vl.GetServerInfoResponse(active_requests=0, server_type="inproc")

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield vl.GenerateResponse(chunk=vl.GenerateStreamChunk(token_ids=[7]))
        yield vl.GenerateResponse(complete=vl.GenerateComplete(finish_reason="stop"))


async def serve(
    address: str = "127.0.0.1:0", *, vllm_only: bool = False, options: list[tuple[str, Any]] | None = None
) -> tuple[grpc.aio.Server, int, Sglang]:
    server = grpc.aio.server(options=options or [])
    servicer = Sglang()
    if vllm_only:
        vl_grpc.add_VllmEngineServicer_to_server(Vllm(), server)
    else:
        sg_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port, servicer


@pytest.fixture()
async def inproc() -> AsyncIterator[tuple[str, Sglang]]:
    server, port, servicer = await serve()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)


async def test_deadline_exceeded_maps_to_timeout_and_cancels(inproc: tuple[str, Sglang]) -> None:
    target, servicer = inproc
    async with clients(target, "sglang") as (h, g):
        with pytest.raises(EngineTimeout):
            await collect(h, request("sleep:30"), timeout=0.3)
        with pytest.raises(EngineTimeout):
            await collect(g, request("sleep:30"), timeout=0.3)
    for _ in range(500):  # the server notices the RST_STREAM / its own deadline soon; bounded wait
        if servicer.cancelled.count("sleep:30") == 2:
            break
        await asyncio.sleep(0.02)
    assert servicer.cancelled == ["sleep:30", "sleep:30"]


async def test_error_details_survive_percent_encoding(inproc: tuple[str, Sglang]) -> None:
    target, _ = inproc
    async with clients(target, "sglang") as (h, g):
        rid = "error:bad prompt ü 100% wrong"
        with pytest.raises(EngineError) as got:
            await collect(h, request(rid))
        with pytest.raises(EngineError) as want:
            await collect(g, request(rid))
    assert outcome(got.value) == outcome(want.value) == (EngineError, "invalid_request", False)
    assert str(got.value) == str(want.value)
    assert "bad prompt ü 100% wrong" in str(got.value)


async def test_large_request_and_response_cross_flow_control_windows(inproc: tuple[str, Sglang]) -> None:
    target, _ = inproc
    ids = list(range(100_000, 300_000))  # ~600 KB each way: many windows' worth
    async with clients(target, "sglang") as (h, _):
        got = await collect(h, request("echo", stream=False, prompt=ids))
        assert isinstance(got[0], EngineComplete) and list(got[0].output_ids) == ids
        # several at once share the connection window
        many = await asyncio.gather(
            *(collect(h, request("echo", stream=False, prompt=ids[:50_000])) for _ in range(6))
        )
    assert all(list(evs[0].output_ids) == ids[:50_000] for evs in many if isinstance(evs[0], EngineComplete))


async def test_max_concurrent_streams_queues_calls() -> None:
    server, port, _ = await serve(options=[("grpc.max_concurrent_streams", 3)])
    try:
        async with clients(f"127.0.0.1:{port}", "sglang") as (h, _):
            results = await asyncio.gather(*(collect(h, request(f"tokens:5:0.01#{i}")) for i in range(12)))
            assert h.connects == 1
        assert all(isinstance(evs[-1], EngineComplete) and len(evs) == 6 for evs in results)
    finally:
        await server.stop(None)


async def test_goaway_lets_running_streams_finish() -> None:
    server, port, _ = await serve()
    try:
        async with clients(f"127.0.0.1:{port}", "sglang") as (h, _):
            gen = h.generate(request("tokens:10:0.05"), timeout=30)
            events: list[EngineEvent] = [await gen.__anext__()]
            stopping = asyncio.create_task(server.stop(grace=10))  # GOAWAY, then waits for running calls
            events += [ev async for ev in gen]
            await stopping
            assert len(events) == 11 and isinstance(events[-1], EngineComplete)
            with pytest.raises(EngineUnavailable):
                await collect(h, request("tokens:1"))
    finally:
        await server.stop(None)


async def test_server_restart_reconnects() -> None:
    server, port, _ = await serve()
    target = f"127.0.0.1:{port}"
    client = H2EngineClient(f"grpc://{target}", target, "sglang")
    try:
        assert isinstance((await collect(client, request("tokens:2")))[-1], EngineComplete)
        await server.stop(None)
        with pytest.raises(EngineUnavailable):
            await collect(client, request("tokens:2"))
        server, _, _ = await serve(target)
        result: list[EngineEvent] = []
        for _ in range(100):  # calls fail fast during the back-off, then one reconnects
            try:
                result = await collect(client, request("tokens:2"))
                break
            except EngineUnavailable:
                await asyncio.sleep(0.05)
        assert result and isinstance(result[-1], EngineComplete)
        assert client.connects == 2
    finally:
        await client.close()
        await server.stop(None)


async def test_connection_lost_mid_stream_is_unavailable() -> None:
    server, port, _ = await serve()
    target = f"127.0.0.1:{port}"
    try:
        async with clients(target, "sglang") as (h, _):
            gen = h.generate(request("tokens:1000:0.01"), timeout=30)
            await gen.__anext__()
            await server.stop(None)
            with pytest.raises(EngineUnavailable):
                async for _ev in gen:
                    pass
    finally:
        await server.stop(None)


async def test_detect_falls_back_to_vllm() -> None:
    server, port, _ = await serve(vllm_only=True)
    try:
        async with clients(f"127.0.0.1:{port}") as (h, g):
            assert await h.detect() == await g.detect() == "vllm"
            got = await collect(h, request("v"))
            assert got == await collect(g, request("v"))
            assert isinstance(got[0], EngineChunk) and list(got[0].token_ids) == [7]
    finally:
        await server.stop(None)


async def test_unreachable_engine_is_unavailable() -> None:
    server, port, _ = await serve()
    await server.stop(None)
    async with clients(f"127.0.0.1:{port}", "sglang") as (h, g):
        with pytest.raises(EngineUnavailable):
            await collect(h, request("x"))
        with pytest.raises(EngineUnavailable):
            await collect(g, request("x"))
        assert not await h.health_check(timeout=0.5)


async def test_unix_socket_target() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "engine.sock"
        server, _, _ = await serve(f"unix:{path}")
        try:
            async with clients(f"unix:{path}", "sglang") as (h, _):
                assert isinstance((await collect(h, request("tokens:3")))[-1], EngineComplete)
        finally:
            await server.stop(None)


async def test_keepalive_detects_a_silent_server() -> None:
    """A server that accepted the connection and then went silent (no PING ack): the call fails."""
    pings = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal pings
        writer.write(h2_frames.settings_frame({}))
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readexactly(len(h2_frames.PREFACE))
            for _ in range(1000):
                head = await reader.readexactly(9)
                await reader.readexactly(int.from_bytes(head[:3], "big"))
                pings += head[3] == h2_frames.PING
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client: EngineClient = H2EngineClient(
        "grpc://silent", f"127.0.0.1:{port}", "sglang", keepalive_s=0.1, keepalive_timeout_s=0.2
    )
    try:
        with pytest.raises(EngineUnavailable, match="keepalive"):
            await asyncio.wait_for(collect(client, request("never"), timeout=None), 20)
        assert pings
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
