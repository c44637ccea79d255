"""The mock engine's scheduler (fake clock), output model and engine core (zero-latency, no network)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mock_engine.cache import BlockStored, PrefixCache
from shepherd.mock_engine.engine import EngineCore
from shepherd.mock_engine.engine_config import EngineConfig
from shepherd.mock_engine.faults import Faults
from shepherd.mock_engine.outputs import OutputModel, OutputSpec, ScriptedResponse, ScriptQueue
from shepherd.mock_engine.requests import MockRequest, MockRpcError
from shepherd.mock_engine.scheduler import (
    RUNNING,
    WAITING,
    AdmissionError,
    Scheduler,
    SchedulerConfig,
    SeqGroup,
)
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent

BS = 16
PREFILL = 1e-3  # seconds per uncached token (large, to make the arithmetic readable)
DECODE = 0.01


def sched(max_running: int = 4, cache_blocks: int = 256, **kw: float) -> Scheduler:
    cfg = SchedulerConfig(
        max_running=max_running,
        context_length=4096,
        prefill_s_per_token=PREFILL,
        decode_s_per_token=DECODE,
        **kw,
    )
    return Scheduler(cfg, PrefixCache(cache_blocks, BS))


def prompt(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# ---- scheduler ------------------------------------------------------------------------------------


def test_prefill_time_is_proportional_to_uncached_tokens() -> None:
    s = sched()
    p1 = prompt(0, 320)
    g1 = s.submit("a", p1, [10], now=0.0)
    assert g1.state == RUNNING and g1.cached_tokens == 0
    assert g1.first_token_at == pytest.approx(320 * PREFILL)
    s.finish(g1, now=1.0, outputs=[prompt(5000, 10)])
    p2 = p1 + prompt(9000, 160)  # same 20 blocks, then new text
    g2 = s.submit("b", p2, [10], now=2.0)
    assert g2.cached_tokens == 320 and g2.uncached_tokens == 160
    assert g2.first_token_at == pytest.approx(2.0 + 160 * PREFILL)
    s.finish(g2, now=3.0)
    g3 = s.submit("c", p1, [10], now=4.0)  # fully cached: one token is still computed
    assert g3.cached_tokens == 319 and g3.first_token_at == pytest.approx(4.0 + PREFILL)


def test_prefills_are_serialized_on_one_lane() -> None:
    s = sched()
    g1 = s.submit("a", prompt(0, 100), [5], now=0.0)
    g2 = s.submit("b", prompt(1000, 200), [5], now=0.0)
    assert g1.first_token_at == pytest.approx(0.1)
    assert g2.first_token_at == pytest.approx(0.1 + 0.2)


def test_concurrency_limit_queues_and_admits_in_order() -> None:
    s = sched(max_running=2)
    groups = [s.submit(str(i), prompt(i * 1000, 40), [8], now=0.0) for i in range(4)]
    assert [g.state for g in groups] == [RUNNING, RUNNING, WAITING, WAITING]
    load = s.loads(0.0)
    assert load.running == 2 and load.waiting == 2 and load.waiting_uncached_tokens == 80
    admitted = s.finish(groups[0], now=1.0)
    assert admitted == [groups[2]] and groups[2].state == RUNNING
    assert groups[2].first_token_at == pytest.approx(1.0 + 40 * PREFILL)
    s.abort(groups[3], now=1.0)  # aborting a waiting request removes it
    load = s.loads(1.0)
    assert load.running == 2 and load.waiting == 0 and load.waiting_uncached_tokens == 0


def test_kv_budget_holds_requests_until_blocks_free() -> None:
    s = sched(max_running=8, cache_blocks=10)
    big = s.submit("big", prompt(0, 100), [60], now=0.0)  # 10 blocks
    assert big.state == RUNNING
    small = s.submit("small", prompt(5000, 16), [4], now=0.0)
    assert small.state == WAITING
    load = s.loads(0.0)
    assert load.used_tokens == 160 and load.token_usage == pytest.approx(1.0)
    assert s.finish(big, now=0.5) == [small]
    assert s.loads(0.5).used_tokens == 2 * BS
    with pytest.raises(AdmissionError):
        s.submit("huge", prompt(0, 200), [10], now=1.0)  # more than the whole pool
    with pytest.raises(AdmissionError):
        s.submit("long", prompt(0, 4000), [200], now=1.0)  # over the context


def test_loads_report_usage_hit_rate_throughput_and_pending_prefill() -> None:
    s = sched(max_running=4)
    g = s.submit("a", prompt(0, 64), [32], now=0.0)
    load = s.loads(0.01)
    assert load.running == 1 and load.used_tokens == 6 * BS and load.prefill_pending_tokens == 64
    assert load.max_total_tokens == 256 * BS and load.utilization == 0.25
    s.finish(g, now=1.0, outputs=[prompt(7000, 32)])
    g2 = s.submit("b", prompt(0, 64), [32], now=2.0)
    load = s.loads(2.0)
    assert load.cache_hit_rate == pytest.approx(64 / 128)
    assert load.gen_throughput == pytest.approx(32 / 10.0)
    s.abort(g2, now=3.0)
    assert s.loads(20.0).gen_throughput == 0.0  # out of the window
    assert s.loads(20.0).used_tokens == 0


def test_decode_latency_grows_modestly_with_running() -> None:
    s = sched(max_running=4, decode_slowdown=0.5)
    assert s.itl() == pytest.approx(DECODE)
    for i in range(4):
        s.submit(str(i), prompt(i * 100, 20), [4], now=0.0)
    assert s.itl() == pytest.approx(DECODE * 1.5)
    s.slow_factor = 2.0
    assert s.itl() == pytest.approx(DECODE * 3.0)


def test_kv_events_follow_scheduling() -> None:
    s = sched(cache_blocks=64)
    g = s.submit("a", prompt(0, 40), [30], now=0.0)
    stored = [e for e in s.cache.drain_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2  # the prompt's full blocks
    s.finish(g, now=1.0, outputs=[prompt(100, 30)])
    stored = [e for e in s.cache.drain_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2  # 70 tokens -> 4 full blocks in all
    assert stored[0].parent_hash is not None


def test_n_samples_take_n_slots_and_share_the_prompt() -> None:
    s = sched(max_running=4)
    g = s.submit("a", prompt(0, 64), [8, 8, 8], now=0.0)
    assert g.state == RUNNING and s.running_seqs == 3
    assert len(s.cache) == 4
    assert s.submit("b", prompt(1000, 16), [8, 8], now=0.0).state == WAITING
    s.finish(g, 1.0)
    assert s.running_seqs == 2


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 80), st.integers(0, 20)), max_size=40),
    max_running=st.integers(1, 4),
)
def test_queue_invariants(ops: list[tuple[int, int, int]], max_running: int) -> None:
    s = sched(max_running=max_running, cache_blocks=24)
    live: list[SeqGroup] = []
    now = 0.0
    for kind, plen, out in ops:
        now += 0.1
        if kind == 0 or not live:
            with contextlib.suppress(AdmissionError):
                live.append(s.submit(f"r{now}", prompt(plen * 7, plen), [out], now))
        elif kind == 1:
            s.finish(live.pop(0), now)
        else:
            s.abort(live.pop(), now)
        assert s.running_seqs <= max(max_running, 1)
        assert s.running_seqs == sum(g.n for g in live if g.state == RUNNING)
        assert s.waiting_seqs == sum(g.n for g in live if g.state == WAITING)
        assert s.cache.used_blocks <= s.cache.capacity_blocks
        if s.waiting_seqs:
            assert s.running_seqs > 0  # nothing waits on an idle engine
    for g in live:
        s.abort(g, now)
    assert s.cache.used_blocks == 0 and s.running_seqs == 0


# ---- output model ---------------------------------------------------------------------------------

CORPUS = tuple(range(1000, 1100))
EOS = 2


def model(seed: int = 0, default_len: int = 12) -> OutputModel:
    return OutputModel(CORPUS, EOS, seed=seed, default_len=default_len, vocab_size=5000)


def test_output_is_deterministic_under_a_seed() -> None:
    p = prompt(0, 50)
    a = model(seed=1).plan(p, OutputSpec(), 0)
    assert a == model(seed=1).plan(p, OutputSpec(), 0)
    # a different seed, sample, prompt or request seed moves the start (each pair may collide: 1/100)
    assert len({model(seed=s).plan(p, OutputSpec(), 0) for s in range(6)}) > 1
    assert len({model(seed=1).plan(p, OutputSpec(), i) for i in range(6)}) > 1
    assert len({model(seed=1).plan(prompt(i, 50), OutputSpec(), 0) for i in range(6)}) > 1
    assert len({model(seed=1).plan(p, OutputSpec(seed=s), 0) for s in range(6)}) > 1
    greedy = OutputSpec(greedy=True)
    assert model().plan(p, greedy, 0) == model().plan(p, greedy, 3)


def test_output_is_the_same_in_every_process() -> None:
    """The plan must not depend on per-process hash randomization (str hashes, hash(None) in 3.11)."""
    import subprocess
    import sys

    code = (
        "from shepherd.mock_engine.outputs import OutputModel, OutputSpec;"
        "m = OutputModel(tuple(range(1000, 1100)), 2, seed=7);"
        "print(m.plan(tuple(range(50)), OutputSpec(), 1).token_ids[:3], "
        "m.plan(tuple(range(50)), OutputSpec(seed=3), 0).token_ids[:3])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        for _ in range(2)
    }
    assert len(outs) == 1


def test_output_walks_the_corpus_and_ends_with_eos() -> None:
    plan = model(default_len=12).plan(prompt(0, 9), OutputSpec(), 0)
    assert len(plan.token_ids) == 13 and plan.token_ids[-1] == EOS
    assert plan.finish_reason == "stop" and plan.matched_token_id == EOS
    body = plan.token_ids[:-1]
    assert all(b - a in (1, -99) for a, b in itertools.pairwise(body))  # consecutive, cyclic


def test_max_tokens_ignore_eos_min_tokens_and_stop_ids() -> None:
    m = model(default_len=12)
    p = prompt(0, 9)
    capped = m.plan(p, OutputSpec(max_new_tokens=5), 0)
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length" and capped.matched_token_id is None
    exact = m.plan(p, OutputSpec(max_new_tokens=12), 0)
    assert len(exact.token_ids) == 12 and exact.finish_reason == "length"
    roomy = m.plan(p, OutputSpec(max_new_tokens=100), 0)
    assert len(roomy.token_ids) == 13 and roomy.finish_reason == "stop"
    long = m.plan(p, OutputSpec(max_new_tokens=100, ignore_eos=True), 0)
    assert len(long.token_ids) == 100 and EOS not in long.token_ids and long.finish_reason == "length"
    minimum = m.plan(p, OutputSpec(min_new_tokens=30), 0)
    assert len(minimum.token_ids) == 31 and minimum.token_ids[-1] == EOS
    free = m.plan(p, OutputSpec(), 0).token_ids
    stop_id = free[4]
    stopped = m.plan(p, OutputSpec(stop_token_ids=frozenset({stop_id})), 0)
    assert stopped.token_ids == free[:5] and stopped.finish_reason == "stop"
    assert stopped.matched_token_id == stop_id
    late = m.plan(p, OutputSpec(stop_token_ids=frozenset({stop_id}), min_new_tokens=8, max_new_tokens=200), 0)
    assert stop_id not in late.token_ids[:8]


def test_scripted_responses_first_match_and_times() -> None:
    q = ScriptQueue()
    q.add(ScriptedResponse((5, 6, EOS), match="weather", times=2, text="sunny"))
    q.add(ScriptedResponse((7, EOS), match="", text="anything"))
    assert q.take("what is the weather") is not None
    first = q.take("weather again")
    assert first is not None and first.text == "sunny"
    other = q.take("weather a third time")
    assert other is not None and other.text == "anything"
    assert q.take("x") is None and len(q) == 0
    m = model()
    plan = m.plan(prompt(0, 9), OutputSpec(), 0, ScriptedResponse((5, 6, EOS)))
    assert plan.token_ids == (5, 6, EOS) and plan.finish_reason == "stop"
    cut = m.plan(prompt(0, 9), OutputSpec(max_new_tokens=2), 0, ScriptedResponse((5, 6, EOS)))
    assert cut.token_ids == (5, 6) and cut.finish_reason == "length"


def test_fake_logprobs_are_deterministic_with_top_alternatives() -> None:
    m = model()
    a = m.logprobs([1001, 1002], 0, 3)
    assert a == m.logprobs([1001, 1002], 0, 3)
    assert all(len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob) for lp in a)
    assert all(lp.logprob < 0 and lp.top[1][1] < lp.top[0][1] for lp in a)


def test_faults_update_validates() -> None:
    f = Faults().updated({"error_rate": 1, "stall_after_tokens": 3, "slow_factor": 2})
    assert f.error_rate == 1.0 and f.stall_after_tokens == 3 and f.slow_factor == 2.0
    assert f.updated({"stall_after_tokens": None}).stall_after_tokens is None
    for bad in ({"nope": 1}, {"error_rate": 2.0}, {"error_rate": "x"}, {"hang_before_first_token": 1}):
        with pytest.raises(ValueError):
            Faults().updated(bad)


# ---- engine core (zero latency, fake tokenizer) ---------------------------------------------------


class CharTokenizer:
    eos_token_ids = (3,)
    vocab_size = 512

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 500 + 10 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 10) for i in ids if i >= 10)


def core(**kw: object) -> EngineCore:
    settings: dict[str, object] = {
        "zero_latency": True,
        "output_len": 10,
        "cache_blocks": 64,
        "max_running": 2,
    }
    settings.update(kw)
    cfg = EngineConfig(**settings)  # type: ignore[arg-type]
    exits: list[int] = []
    return EngineCore(cfg, CharTokenizer(), exit_process=exits.append)


async def collect(run_events: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    return [ev async for ev in run_events]


def req(rid: str, n_prompt: int = 40, **kw: object) -> MockRequest:
    return MockRequest(request_id=rid, prompt=prompt(100, n_prompt), **kw)  # type: ignore[arg-type]


async def test_core_stream_chunks_and_complete() -> None:
    c = core()
    run = c.start(req("a", stream_interval=4))
    try:
        events = await collect(run.events())
    finally:
        run.close()
    chunks = [e for e in events if isinstance(e, EngineChunk)]
    completes = [e for e in events if isinstance(e, EngineComplete)]
    assert [len(ch.token_ids) for ch in chunks] == [1, 4, 4, 2]  # first token alone, then the interval
    assert [ch.completion_tokens for ch in chunks] == [1, 5, 9, 11]
    assert len(completes) == 1 and completes[0].finish_reason == "stop" and completes[0].matched_token_id == 3
    assert completes[0].completion_tokens == 11 and not completes[0].output_ids
    assert c.stats.completed == 1 and c.active_requests == 0 and c.loads().running == 0


async def test_core_non_stream_n2_and_determinism() -> None:
    c = core()
    run = c.start(req("a", stream=False, n=2, spec=OutputSpec(max_new_tokens=6)))
    events = await collect(run.events())
    run.close()
    assert [type(e) for e in events] == [EngineComplete, EngineComplete]
    a, b = events
    assert isinstance(a, EngineComplete) and isinstance(b, EngineComplete)
    assert len(a.output_ids) == 6 and a.finish_reason == "length" and a.output_ids != b.output_ids
    again = core().start(req("x", stream=False, n=2, spec=OutputSpec(max_new_tokens=6)))
    events2 = await collect(again.events())
    assert [e.output_ids for e in events2 if isinstance(e, EngineComplete)] == [a.output_ids, b.output_ids]


async def test_core_abort_ends_stream_with_abort_and_frees_slot() -> None:
    c = core(stream_interval=1)
    run = c.start(req("victim", spec=OutputSpec(max_new_tokens=50, ignore_eos=True)))
    seen: list[EngineEvent] = []
    async for ev in run.events():
        seen.append(ev)
        if len(seen) == 3:
            assert c.abort("victim")
    run.close()
    last = seen[-1]
    assert isinstance(last, EngineComplete) and last.finish_reason == "abort"
    assert last.completion_tokens == 3
    assert list(c.stats.aborted) == ["victim"] and c.loads().running == 0 and c.active_requests == 0
    assert not c.abort("victim") and list(c.stats.abort_unmatched) == ["victim"]


async def test_core_consumer_cancel_frees_slot_and_admits_waiting() -> None:
    c = core()  # max_running 2
    runs = [c.start(req(f"r{i}", n_prompt=20 + i, spec=OutputSpec(max_new_tokens=20))) for i in range(3)]
    assert c.loads().running == 2 and c.loads().waiting == 1
    waiter = asyncio.ensure_future(collect(runs[2].events()))
    await asyncio.sleep(0)
    it = runs[0].events().__aiter__()
    await it.__anext__()
    runs[0].close()  # the client went away mid-stream
    events = await asyncio.wait_for(waiter, 5)
    runs[2].close()
    assert isinstance(events[-1], EngineComplete) and events[-1].finish_reason == "stop"
    assert list(c.stats.cancelled) == ["r0"]
    runs[1].close()
    assert c.loads().running == 0 and c.loads().waiting == 0 and c.cache.used_blocks == 0


async def test_core_faults_error_and_crash() -> None:
    c = core()
    c.set_faults(Faults(error_rate=1.0, error_code="INTERNAL"))
    with pytest.raises(MockRpcError) as ei:
        c.start(req("e"))
    assert ei.value.code == "INTERNAL" and c.stats.errors_injected == 1 and c.loads().running == 0
    exits: list[int] = []
    c2 = EngineCore(
        EngineConfig(zero_latency=True, faults=Faults(crash_after_requests=1)),
        CharTokenizer(),
        exit_process=exits.append,
    )
    c2.start(req("ok")).close()
    with pytest.raises(MockRpcError):
        c2.start(req("boom"))
    assert exits == [1]


async def test_core_scripted_response_by_prompt_match() -> None:
    c = core()
    c.add_script("hi!", match="needle")
    plain = await collect(c.start(req("a", stream=False)).events())
    assert isinstance(plain[0], EngineComplete) and len(plain[0].output_ids) == 11
    r = MockRequest(request_id="b", prompt=tuple(CharTokenizer().encode("a needle here")), stream=False)
    events = await collect(c.start(r).events())
    done = events[0]
    assert isinstance(done, EngineComplete)
    assert CharTokenizer().decode(done.output_ids) == "hi!" and done.output_ids[-1] == 3
    assert len(c.scripts) == 0


async def test_core_publishes_kv_events_and_prefix_hits() -> None:
    c = core()
    sub = c.kv_log.subscribe(0)
    first = await collect(c.start(req("a", n_prompt=64, stream=False)).events())
    batches = sub.take()
    assert batches and batches[0].sequence_number == 1
    assert any(isinstance(e, BlockStored) for b in batches for e in b.events)
    second = await collect(c.start(req("b", n_prompt=64, stream=False)).events())
    assert isinstance(first[0], EngineComplete) and first[0].cached_tokens == 0
    assert isinstance(second[0], EngineComplete) and second[0].cached_tokens == 63
    sub.close()


async def test_core_rejects_bad_requests() -> None:
    c = core(context_length=100)
    with pytest.raises(MockRpcError) as ei:
        c.start(req("long", n_prompt=150))
    assert ei.value.code == "INVALID_ARGUMENT"
    with pytest.raises(MockRpcError):
        c.start(MockRequest(request_id="empty", prompt=()))
    run = c.start(req("clamped", n_prompt=95, spec=OutputSpec(max_new_tokens=50), stream=False))
    events = await collect(run.events())
    assert isinstance(events[0], EngineComplete) and len(events[0].output_ids) == 5
    assert events[0].finish_reason == "length"


async def test_core_stall_and_hang_faults_hold_until_aborted() -> None:
    c = core()
    c.set_faults(Faults(stall_after_tokens=2, stall_seconds=60.0))
    run = c.start(req("stall", spec=OutputSpec(max_new_tokens=20, ignore_eos=True), stream_interval=1))
    got: list[EngineEvent] = []
    blocked = asyncio.Event()

    async def consume() -> None:
        async for ev in run.events():
            got.append(ev)
            if len(got) == 2:
                blocked.set()

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(blocked.wait(), 5)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(got) == 2  # stalled after two tokens
    c.abort("stall")
    await asyncio.wait_for(task, 5)
    assert isinstance(got[-1], EngineComplete) and got[-1].finish_reason == "abort"
    c.set_faults(Faults(hang_before_first_token=True))
    hung = c.start(req("hang"))
    task2 = asyncio.ensure_future(collect(hung.events()))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task2.done() and c.loads().running == 1
    c.abort("hang")
    events = await asyncio.wait_for(task2, 5)
    assert [type(e) for e in events] == [EngineComplete] and c.loads().running == 0


async def test_core_pd_roles() -> None:
    prefill = core(role="prefill")
    prefill.grpc_port = 50051
    events = await collect(
        prefill.start(req("pd", stream=False, spec=OutputSpec(max_new_tokens=50))).events()
    )
    done = events[0]
    assert isinstance(done, EngineComplete) and len(done.output_ids) == 1 and done.finish_reason == "length"
    assert done.kv_transfer_params_json is not None and '"remote_port": 50051' in done.kv_transfer_params_json
    decode = core(role="decode", zero_latency=False, prefill_us_per_token=1000.0)
    run = decode.start(req("pd", n_prompt=64, kv_transfer_params_json=done.kv_transfer_params_json))
    assert run.group.uncached_tokens == 0 and run.group.first_token_at == run.group.admitted_at
    run.close()
    plain = decode.start(MockRequest(request_id="plain", prompt=prompt(5000, 64)))
    g = plain.group
    assert g.uncached_tokens == 64 and g.first_token_at is not None and g.admitted_at is not None
    assert g.first_token_at - g.admitted_at == pytest.approx(64 * 1e-3)  # computed, not measured
    plain.close()


async def test_core_take_ready_equals_the_event_stream() -> None:
    spec = OutputSpec(max_new_tokens=9)
    streamed = await collect(core().start(req("a", n=2, stream_interval=4, spec=spec)).events())
    c = core()
    run = c.start(req("a", n=2, stream_interval=4, spec=spec))
    ready = run.take_ready()
    assert ready == streamed and run.finished and c.loads().running == 0
    c.set_faults(Faults(stall_after_tokens=3, stall_seconds=1.0))
    stalling = c.start(req("b", spec=spec))
    assert stalling.take_ready() is None  # a stall must wait: use events()
    stalling.close()


def _stepped_times(
    steps: str, starts: Sequence[float], slowdown: float = 0.0, stream: bool = True
) -> list[list[float]]:
    """The clock times at which each request's chunks (``stream``; else its one answer) come out of a
    paced core (20 ms a token, prefill ~0, ``slowdown``), requests started at ``starts``: the waits move
    a fake clock instead of sleeping."""
    now = [0.0]
    c = EngineCore(
        EngineConfig(
            output_len=6,
            cache_blocks=64,
            max_running=8,
            decode_ms_per_token=20.0,
            decode_slowdown=slowdown,
            prefill_us_per_token=1.0,
            decode_steps=steps,
        ),
        CharTokenizer(),
        clock=lambda: now[0],
    )

    async def block(self: object, delay: float | None) -> None:
        assert delay is not None and delay >= 0
        now[0] += delay

    async def one(i: int, at: float) -> list[float]:
        now[0] = at
        run = c.start(req(f"r{i}", n_prompt=20 + i, stream=stream))
        kind = EngineChunk if stream else EngineComplete
        try:
            return [now[0] async for ev in run.events() if isinstance(ev, kind)]
        finally:
            run.close()

    async def main() -> list[list[float]]:
        return [await one(i, at) for i, at in enumerate(starts)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("shepherd.mock_engine.engine.Run._block", block)
        return asyncio.run(main())


def test_batch_steps_put_every_request_on_the_engine_step_clock() -> None:
    """``decode_steps="batch"``: each token of every request comes at a multiple of the inter-token
    latency (one decode step for the whole batch), whenever the request started; "request": each
    request's tokens keep its own phase (its first token's time plus whole steps)."""
    starts = [1.0031, 1.0117, 1.0249]
    batch = _stepped_times("batch", starts)
    own = _stepped_times("request", starts)
    for times in batch:
        assert len(times) >= 6
        assert all(abs(t / 0.02 - round(t / 0.02)) < 1e-6 for t in times), times
        assert all(round((b - a) / 0.02, 6) == 1.0 for a, b in itertools.pairwise(times))
    for start, times in zip(starts, batch, strict=True):
        assert start <= times[0] < start + 0.02 + 0.001  # the first step after the (short) prefill
    phases = {round(times[0] % 0.02, 6) for times in own}
    assert len(phases) == 3  # three clocks of their own
    for times in own:
        assert all(round((b - a) / 0.02, 6) == 1.0 for a, b in itertools.pairwise(times))
    # with the batch slowdown (a longer latency while others run) the steps stay on the same clock: a
    # token waits for the first step after its latency
    for times in _stepped_times("batch", starts, slowdown=0.5):
        assert all(abs(t / 0.02 - round(t / 0.02)) < 1e-6 for t in times), times
        assert all(round((b - a) / 0.02, 6) in (1.0, 2.0) for a, b in itertools.pairwise(times))
    # a non-streamed answer comes on a step too (its last token's), whatever the latency
    answers = _stepped_times("batch", starts, slowdown=0.5, stream=False)
    assert all(len(times) == 1 and abs(times[0] / 0.02 - round(times[0] / 0.02)) < 1e-6 for times in answers)
