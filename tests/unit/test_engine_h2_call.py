"""A Generate call over the lean HTTP/2 client, against an in-process fake server (no sockets): what the
consumer sees (batches, end, errors) and what the server sees (the request bytes, RST_STREAM on close),
and the gateway's stream and worker choice around it."""

from __future__ import annotations

import asyncio
import gc
import struct
from collections.abc import AsyncGenerator, Callable
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import Worker, pick_worker
from shepherd.node.engines import h2_frames as h2
from shepherd.node.engines.h2 import GenerateCall, H2EngineClient
from shepherd.node.engines.h2_stream import grpc_message
from shepherd.node.engines.http import HttpRelayClient
from shepherd.proto.engine_requests import sglang_generate
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineTimeout,
    GenerateRequest,
    SamplingParams,
)
from tests import fake_h2_engine as fake
from tests.fake_h2_engine import HEAD, FakeTransport, connect, trailers
from tests.unit.test_engine_h2_frames import parse_frames


class FakeServer(FakeTransport):
    """The peer of one H2Protocol: records the frames the client writes; the test sends frames back."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.frames: list[tuple[int, int, int, bytes]] = []  # (type, flags, stream id, payload)
        self.proto = connect(self, loop)

    def write(self, data: bytes) -> None:
        self.frames += parse_frames(data)

    # the test's side
    def requests(self) -> list[tuple[int, bytes]]:
        """(stream id, request body without its gRPC prefix) of every call sent so far."""
        return [(sid, p[5:]) for t, _f, sid, p in self.frames if t == h2.DATA]

    def resets(self) -> list[int]:
        return [sid for t, _f, sid, _p in self.frames if t == h2.RST_STREAM]

    def send(self, sid: int, *messages: bytes, status: int | None = None, head: bool = True) -> None:
        out = h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, sid, HEAD) if head else b""
        out += b"".join(h2.frame(h2.DATA, 0, sid, grpc_message(m)) for m in messages)
        if status is not None:
            out += h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, sid, trailers(status))
        self.proto.data_received(out)


def client_on(server: FakeServer) -> H2EngineClient:
    return fake.client_on(server.proto)


def chunk(ids: list[int], completion: int) -> bytes:
    return bytes(
        sg.GenerateResponse(
            request_id="r", chunk=sg.GenerateStreamChunk(token_ids=ids, completion_tokens=completion)
        ).SerializeToString()
    )


def complete(ids: list[int], reason: str = "stop") -> bytes:
    return bytes(
        sg.GenerateResponse(
            request_id="r", complete=sg.GenerateComplete(output_ids=ids, finish_reason=reason)
        ).SerializeToString()
    )


def request(rid: str = "r1", ids: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(rid, ids if ids is not None else [1, 2, 3], SamplingParams(max_new_tokens=4))


async def flush() -> None:
    for _ in range(3):  # the client's coalesced writes leave on the next loop turns
        await asyncio.sleep(0)


async def test_batches_then_end_and_the_request_bytes() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call = client_on(server).generate_batches(request(), timeout=30)
    first = asyncio.ensure_future(call.__anext__())
    await flush()
    [(sid, body)] = server.requests()
    assert sg.GenerateRequest.FromString(body) == sglang_generate(request())
    server.send(sid, chunk([5], 1), chunk([6], 2))
    batch = await first
    assert [list(e.token_ids) for e in batch if isinstance(e, EngineChunk)] == [[5, 6]]  # merged
    nxt = asyncio.ensure_future(call.__anext__())
    await asyncio.sleep(0)
    server.send(sid, complete([5, 6, 7]), status=0, head=False)
    (done,) = await nxt
    assert isinstance(done, EngineComplete) and list(done.output_ids) == [5, 6, 7]
    with pytest.raises(StopAsyncIteration):
        await call.__anext__()
    with pytest.raises(StopAsyncIteration):  # and it stays ended
        await call.__anext__()
    await call.aclose()
    await flush()
    assert server.resets() == []  # ended by the server: nothing to cancel


async def test_error_status_is_raised_after_the_messages() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call = client_on(server).generate_batches(request(), timeout=30)
    first = asyncio.ensure_future(call.__anext__())
    await flush()
    [(sid, _)] = server.requests()
    server.send(sid, status=4)  # DEADLINE_EXCEEDED, before any message
    with pytest.raises(EngineTimeout):
        await first
    with pytest.raises(StopAsyncIteration):
        await call.__anext__()


async def _opened(server: FakeServer) -> tuple[GenerateCall, int]:
    """A Generate call whose first batch (one chunk) has been taken, and its stream id."""
    call = client_on(server).generate_batches(request(), timeout=30)
    first = asyncio.ensure_future(call.__anext__())
    await flush()
    [(sid, _)] = server.requests()
    server.send(sid, chunk([5], 1))
    await first
    return call, sid


@pytest.mark.parametrize("how", ["aclose", "cancel", "drop"])
async def test_giving_up_early_resets_the_stream(how: str) -> None:
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    if how == "aclose":
        await call.aclose()
    elif how == "cancel":  # the consumer's task is cancelled while it waits
        waiting = asyncio.ensure_future(call.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    else:  # dropped without closing: the engine's request is freed all the same
        del call
        gc.collect()
    await flush()
    assert server.resets() == [sid]


async def test_generate_flattens_and_closes() -> None:
    server = FakeServer(asyncio.get_running_loop())
    gen = cast(AsyncGenerator[EngineEvent, None], client_on(server).generate(request(), timeout=30))
    first = asyncio.ensure_future(anext(gen))
    await flush()
    [(sid, _)] = server.requests()
    server.send(sid, chunk([5], 1), chunk([6], 2))
    assert isinstance(await first, EngineChunk)
    await gen.aclose()
    await flush()
    assert server.resets() == [sid]


def worker(wid: str, client: object, *, healthy: bool = True, model: str = "m") -> Worker:
    return Worker(
        id=wid,
        url=f"grpc://{wid}:1",
        model=model,
        client=client,  # type: ignore[arg-type]
        health=HealthTracker(healthy=healthy, checked=True),
        breaker=CircuitBreaker(failure_threshold=1, success_threshold=1, open_secs=10),
    )


async def test_gateway_stream_yields_the_first_batch_then_the_engines() -> None:
    server = FakeServer(asyncio.get_running_loop())
    gw = Gateway(build_config({}, {"policy": "round_robin"}))
    w = worker("w0", client_on(server))
    gw.registry.workers[w.id] = w
    opening = asyncio.ensure_future(gw.open_stream("m", request()))
    await flush()
    [(sid, _)] = server.requests()
    server.send(sid, chunk([5], 1))
    es = await opening
    assert w.in_flight == 1
    later = asyncio.ensure_future(anext(aiter(es.batches())))
    got: list[list[EngineEvent]] = [await later]
    server.send(sid, complete([5, 6]), status=0, head=False)
    got += [batch async for batch in es.batches()]
    assert [type(b[0]).__name__ for b in got] == ["EngineChunk", "EngineComplete"]
    es.completed = True
    await es.close("done")
    await es.close("done")  # idempotent
    assert w.in_flight == 0 and not server.proto.conn.streams


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from(["closed", "open", "cooled"]), st.booleans(), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.sets(st.integers(0, 5)),
    st.booleans(),
    st.none() | st.sets(st.integers(0, 5)),
    st.sets(st.integers(0, 5)),
)
def test_pick_chooses_among_what_the_registry_calls_routable(
    specs: list[tuple[bool, str, bool, bool]],
    excluded: set[int],
    http: bool,
    only: set[int] | None,
    gated: set[int],
) -> None:
    """The one-pass filter in ``pick`` keeps exactly ``registry.routable`` of the wanted kind."""
    gw = Gateway(build_config({}, {"policy": "random"}))
    clock = Clock()
    gw.registry.clock = clock
    gw.registry.gate = lambda wid: int(wid[1:]) not in gated
    for i, (healthy, breaker, is_http, other_model) in enumerate(specs):
        client: object = HttpRelayClient(f"http://w{i}:1") if is_http else H2EngineClient("grpc://x:1", "x:1")
        w = worker(f"w{i}", client, healthy=healthy, model="other" if other_model else "m")
        if breaker != "closed":
            w.breaker.record_failure(clock.now - (20 if breaker == "cooled" else 0))
        gw.registry.workers[w.id] = w
    exclude = {f"w{i}" for i in excluded}
    allowed = None if only is None else {f"w{i}" for i in only}
    want = {
        w.id
        for w in gw.registry.routable("m", exclude)
        if w.is_http == http and (allowed is None or w.id in allowed)
    }
    picks: set[str] = set()
    for _ in range(30):
        chosen = pick_worker(gw.registry, "m", exclude, [], None, gw.policy_for("m"), http=http, only=allowed)
        if chosen is None:
            break
        picks.add(chosen.id)
        chosen.breaker.release()
    assert picks <= want and (not want or picks)


async def test_deadlines_expire_silent_calls_and_forget_finished_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # deterministic: timeouts no loop turn can reach in real time, and the loop's clock moved past them by
    # the test (asyncio's timers and the client's deadline groups both read loop.time())
    loop = asyncio.get_running_loop()
    real_time = loop.time
    skew = [0.0]
    monkeypatch.setattr(loop, "time", lambda: real_time() + skew[0])
    server = FakeServer(loop)
    client = client_on(server)
    quick = client.generate_batches(request("quick"), timeout=30.0)
    silent = client.generate_batches(request("silent"), timeout=30.0)
    other = client.generate_batches(request("other"), timeout=30.5)  # another timeout: its own group
    got = [asyncio.ensure_future(c.__anext__()) for c in (quick, silent, other)]
    await flush()
    (sid_quick, _), (sid_silent, _), (sid_other, _) = server.requests()
    server.send(sid_quick, complete([1]), status=0)
    assert isinstance((await got[0])[0], EngineComplete)
    await flush()
    assert not got[1].done() and not got[2].done()  # nothing expires before its deadline
    skew[0] = 30.2  # past the first group's deadline only
    await flush()
    assert got[1].done() and not got[2].done()
    with pytest.raises(EngineTimeout):
        await got[1]
    skew[0] = 31.0  # past the second's
    with pytest.raises(EngineTimeout):
        await asyncio.wait_for(got[2], 10)
    await flush()
    assert sorted(server.resets()) == sorted([sid_silent, sid_other])
    # one group per timeout seen (a health check's 5 s must not push generation onto a timer per call)
    assert sorted(client._deadlines) == [30.0, 30.5]
    assert all(len(d) == 0 for d in client._deadlines.values())


async def test_varying_timeouts_fall_back_to_a_timer_each() -> None:
    server = FakeServer(asyncio.get_running_loop())
    client = client_on(server)
    calls = [client.generate_batches(request(f"c{i}"), timeout=5.0 + i / 100) for i in range(12)]
    got = [asyncio.ensure_future(c.__anext__()) for c in calls]
    await flush()
    assert len(client._deadlines) <= 8
    for sid, _ in server.requests():
        server.send(sid, complete([1]), status=0)
    for fut in got:
        assert isinstance((await fut)[0], EngineComplete)


def _taker(got: list[list[EngineEvent]], stop: bool) -> Callable[[list[EngineEvent]], bool]:
    """A ``push`` consumer that records each batch and answers ``stop``."""

    def take(batch: list[EngineEvent]) -> bool:
        got.append(batch)
        return stop

    return take


def _ids(batches: list[list[EngineEvent]]) -> list[list[int]]:
    return [[t for e in b if isinstance(e, EngineChunk) for t in e.token_ids] for b in batches]


async def test_push_hands_each_arrival_to_take_at_once_then_the_end() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    got: list[list[EngineEvent]] = []

    def take(batch: list[EngineEvent]) -> bool:
        got.append(batch)
        return any(isinstance(e, EngineComplete) for e in batch)

    pushed = call.push(take)
    server.send(sid, chunk([6], 2), head=False)
    assert _ids(got) == [[6]]  # in the connection's own callback: no loop turn, no task step
    server.send(sid, chunk([7], 3), chunk([8], 4), head=False)
    assert _ids(got) == [[6], [7, 8]]  # messages of one read: one batch
    assert not pushed.done()
    server.send(sid, complete([5, 6, 7, 8]), status=0, head=False)
    assert pushed.done() and pushed.result() is None
    assert isinstance(got[-1][0], EngineComplete)
    with pytest.raises(StopAsyncIteration):
        await call.__anext__()
    await call.aclose()
    await flush()
    assert server.resets() == []


async def test_push_hands_back_when_take_stops_and_later_messages_wait() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    got: list[list[EngineEvent]] = []
    pushed = call.push(_taker(got, True))  # stop at the first batch (a paused client)
    server.send(sid, chunk([6], 2), head=False)
    assert pushed.done() and _ids(got) == [[6]]
    server.send(sid, chunk([7], 3), head=False)  # not pushed any more: queued for __anext__
    assert _ids(got) == [[6]]
    assert _ids([await call.__anext__()]) == [[7]]
    server.send(sid, chunk([8], 4), head=False)
    again = call.push(_taker(got, False))  # what is already queued is taken at once
    assert _ids(got) == [[6], [8]] and not again.done()
    server.send(sid, chunk([9], 5), head=False)
    assert _ids(got) == [[6], [8], [9]] and not again.done()
    await call.aclose()
    await flush()
    assert server.resets() == [sid]  # closed before its end: cancelled on the engine


async def test_a_paused_consumer_holds_its_streams_credit_until_it_takes_again() -> None:
    """A client that stops reading (``take`` stops: its transport is full) leaves the answer's messages
    queued; past ``GENERATE_BACKLOG_BYTES`` of them the stream gets no more credit, so the engine stops
    sending that answer instead of the node holding all of it; once the consumer takes them (pushed again,
    or ``__anext__``), the held credit goes out."""
    from shepherd.node.engines.h2 import GENERATE_BACKLOG_BYTES  # (this test's bound)

    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    got: list[list[EngineEvent]] = []
    call.push(_taker(got, True))
    server.send(sid, chunk([6], 2), head=False)  # the client's transport is full from here on
    big = chunk(list(range(3_000)), 3)  # ~9 kB a message (within a frame)
    credited: list[int] = []

    def stream_credit() -> int:
        ups = [f for f in server.frames if f[0] == h2.WINDOW_UPDATE and f[2] == sid]
        credited.append(len(ups))
        return len(ups)

    before = stream_credit()
    n = 0
    while n * len(big) < 2 * GENERATE_BACKLOG_BYTES:  # bounded: past the bound
        server.send(sid, big, head=False)
        n += 1
    await flush()
    held = stream_credit()  # (a credit a quarter stream window until the bound: a few)
    assert held <= before + GENERATE_BACKLOG_BYTES // (h2.STREAM_WINDOW // 4) + 1
    for _ in range(n):  # an engine that ignored its window: no more credit for it either
        server.send(sid, big, head=False)
    await flush()
    assert stream_credit() == held  # held once the backlog passed the bound
    stream = call._stream
    assert stream is not None and stream.credit_held
    pushed = call.push(_taker(got, False))  # the client drained: everything queued is taken
    assert not pushed.done() and len(got) > 1
    await flush()  # (the connection's writes go out at the end of the loop turn)
    assert stream_credit() > credited[-2]  # and the credit held goes to the engine
    assert [stream.credit_held] == [False]
    await call.aclose()


async def test_a_consumer_that_paused_after_taking_everything_is_not_left_waiting() -> None:
    """The generation loop's order with a slow client: a batch taken, the write waits (the engine fills
    the queue past the bound: credit held), then push takes a slice of the queue and pauses again; after
    the drain ``__anext__`` takes the rest, a slice at a time, then waits for more. Once everything queued
    was taken the held credit must have gone out: an engine that keeps to its window sends again and the
    wait ends."""
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    big = chunk(list(range(3_000)), 3)
    frame_bytes = len(big) + 5
    window = [h2.STREAM_WINDOW]  # the engine's view of the stream's window
    seen = [0]

    def engine_sends() -> int:  # an engine that keeps to the stream window
        for f in server.frames[seen[0] :]:
            if f[0] == h2.WINDOW_UPDATE and f[2] == sid:
                window[0] += struct.unpack(">I", f[3])[0]
        seen[0] = len(server.frames)
        sent = 0
        while window[0] >= frame_bytes:  # bounded by the window
            server.send(sid, big, head=False)
            window[0] -= frame_bytes
            sent += 1
        return sent

    engine_sends()
    await flush()
    engine_sends()
    await flush()
    stream = call._stream
    assert stream is not None and stream.credit_held and window[0] < frame_bytes  # the engine is stopped
    pushed = call.push(_taker([], True))  # a slice of the queue, and the client pauses again
    assert pushed.done() and stream.messages and stream.credit_held  # the rest queued: no credit yet
    while stream.messages:  # bounded: each batch takes at least one queued message
        assert _ids([await call.__anext__()])[0]
    nxt = asyncio.ensure_future(call.__anext__())
    for _ in range(20):  # bounded: the engine gets its credit back and sends
        engine_sends()
        await flush()
        if nxt.done():
            break
    assert nxt.done() and _ids([nxt.result()])[0]
    await call.aclose()


async def test_a_backlog_is_taken_a_slice_at_a_time() -> None:
    """What a paused client left queued (up to the stream window: megabytes) is decoded and taken in
    batches of at most ``BATCH_MAX_BYTES`` of messages, by push and by ``__anext__``: the client's answer
    is formatted and written a slice at a time, each after its transport drained, never all at once."""
    from shepherd.node.engines.h2 import BATCH_MAX_BYTES  # (this test's bound)

    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    got: list[list[EngineEvent]] = []
    call.push(_taker(got, True))
    server.send(sid, chunk([6], 2), head=False)  # the client's transport is full from here on
    big = chunk(list(range(3_000)), 3)  # ~9 kB a message
    queued = 4 * BATCH_MAX_BYTES // len(big) + 1
    for _ in range(queued):
        server.send(sid, big, head=False)
    await flush()
    stream = call._stream
    assert stream is not None and len(stream.messages) == queued
    most = max(1, BATCH_MAX_BYTES // len(big))  # messages a batch may hold
    pushed = call.push(_taker(got, True))  # the client drained once, and is full again
    assert pushed.done() and got[-1]
    taken = [queued - len(stream.messages)]  # messages per batch
    while stream.messages:  # bounded: each batch takes at least one message
        left = len(stream.messages)
        assert await call.__anext__()
        taken.append(left - len(stream.messages))
    assert sum(taken) == queued and all(1 <= k <= most for k in taken), taken
    await call.aclose()


async def test_push_passes_on_what_take_raises_and_an_error_status() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)

    def bad(batch: list[EngineEvent]) -> bool:
        raise ValueError("consumer failed")

    pushed = call.push(bad)
    server.send(sid, chunk([6], 2), head=False)
    with pytest.raises(ValueError, match="consumer failed"):
        await pushed
    got: list[list[EngineEvent]] = []
    server.send(sid, chunk([7], 3), head=False)
    assert got == []  # the listener is gone
    pushed = call.push(_taker(got, False))
    assert _ids(got) == [[7]] and not pushed.done()  # the queued message first
    server.send(sid, status=13, head=False)  # INTERNAL: the push ends, the status comes from __anext__
    await pushed
    with pytest.raises(EngineError):
        await call.__anext__()
    server.send(sid, chunk([8], 4), head=False)  # (after the end: ignored)


async def test_push_stops_taking_once_its_consumer_is_cancelled() -> None:
    server = FakeServer(asyncio.get_running_loop())
    call, sid = await _opened(server)
    got: list[list[EngineEvent]] = []
    waiting = asyncio.ensure_future(call.push(_taker(got, False)))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    server.send(sid, chunk([6], 2), head=False)
    assert got == []
    await call.aclose()
    await flush()
    assert server.resets() == [sid]
