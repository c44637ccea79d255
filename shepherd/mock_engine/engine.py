"""The engine core shared by every surface (SGLang gRPC, vLLM gRPC, OpenAI HTTP).

``EngineCore.start(request)`` runs the synchronous part of a request (faults, validation, output
plan, admission) and returns a ``Run``; ``Run.events()`` streams ``EngineChunk`` / ``EngineComplete``
(the node's wire-independent types) with the latencies of the scheduler's timing model, and
``Run.close()`` (always call it, in a ``finally``) frees the request's slot however the stream
ended: a client that goes away is treated as an abort. In zero-latency mode nothing sleeps: chunks
are produced as fast as the consumer takes them, ``stream_interval`` tokens at a time (the first
token alone, as engines send it at once). The core's configuration is ``engine_config.EngineConfig``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from shepherd.mock_engine.cache import PrefixCache
from shepherd.mock_engine.engine_config import EngineConfig
from shepherd.mock_engine.faults import FaultInjector, Faults
from shepherd.mock_engine.kv_events import KvEventLog
from shepherd.mock_engine.outputs import (
    FINISH_ABORT,
    FINISH_LENGTH,
    PARAGRAPH,
    OutputModel,
    SamplePlan,
    ScriptedResponse,
    ScriptQueue,
)
from shepherd.mock_engine.pd_check import PrefillLog
from shepherd.mock_engine.requests import MockRequest, MockRpcError
from shepherd.mock_engine.scheduler import (
    RUNNING,
    WAITING,
    AdmissionError,
    LoadSnapshot,
    Scheduler,
    SeqGroup,
)
from shepherd.mock_engine.stats import MockStats
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent, PromptChunk


class TokenizerLike(Protocol):
    """What the mock needs of ``shepherd.tokens.tokenizer.Tokenizer``."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Run:
    """One request in flight. Iterate ``events()`` once; call ``close()`` when done (idempotent)."""

    __slots__ = ("_core", "_emitted", "_wake", "aborted", "finished", "group", "plans", "req")

    def __init__(self, core: EngineCore, req: MockRequest, group: SeqGroup, plans: list[SamplePlan]) -> None:
        self._core = core
        self.req = req
        self.group = group
        self.plans = plans
        self.aborted = False
        self.finished = False
        self._wake: asyncio.Future[None] | None = None
        self._emitted = [0] * len(plans)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def _stopped(self) -> bool:
        """Whether the run was aborted (a method, so type narrowing does not survive awaits)."""
        return self.aborted

    def abort(self) -> None:
        self.aborted = True
        self.wakeup()

    def wakeup(self) -> None:
        fut = self._wake
        if fut is not None and not fut.done():
            fut.set_result(None)

    def close(self) -> None:
        """End the request wherever it is; a run that did not finish counts as cancelled by the client."""
        if not self.finished:
            stats = self._core.stats
            stats.cancelled.append(self.req.request_id)
            if not self.aborted:
                stats.aborted.append(self.req.request_id)
            self.aborted = True
            self._end(None)

    async def _block(self, delay: float | None) -> None:
        """Wait ``delay`` seconds (forever if None) or until woken (abort, admission)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(delay, _resolve, fut) if delay is not None else None
        self._wake = fut
        try:
            await fut
        finally:
            self._wake = None
            if handle is not None:
                handle.cancel()

    def _on_step(self, when: float) -> float:
        """``when``, or with ``decode_steps="batch"`` the engine's first decode step at or after it: a step
        every base inter-token latency (``decode_ms_per_token`` times the slow factor, without the batch
        slowdown, so the step clock does not move as requests come and go) from the engine's start. Every
        running request's token of a step is due at the same instant (the timers fire in one loop turn and
        the lean server writes what they yield together); with a slowdown, a request's next token waits for
        the first step after its longer inter-token latency."""
        core = self._core
        if core.config.decode_steps != "batch":
            return when
        sched = core.scheduler
        period = sched.config.decode_s_per_token * sched.slow_factor
        if period <= 0:
            return when
        epoch = core.step_epoch
        return epoch + math.ceil((when - epoch) / period - 1e-9) * period

    async def _sleep_until(self, when: float) -> None:
        when = self._on_step(when)
        delay = when - self._core.clock()
        if delay > 0 and not self.aborted:
            await self._block(delay)

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0 and not self.aborted:
            await self._block(seconds)

    def _end(self, outputs: list[tuple[int, ...]] | None) -> None:
        if not self.finished:
            self.finished = True
            self._core._run_ended(self, outputs, sum(self._emitted))

    def _abort_completes(self, done: Sequence[bool] = ()) -> list[EngineComplete]:
        """Completes with finish_reason "abort" for every sample not yet complete; ends the run."""
        g = self.group
        out = [
            EngineComplete(
                index=i,
                finish_reason=FINISH_ABORT,
                prompt_tokens=len(g.prompt),
                completion_tokens=self._emitted[i],
                cached_tokens=g.cached_tokens,
            )
            for i in range(len(self.plans))
            if not (done and done[i])
        ]
        self._end(None)
        return out

    async def events(self) -> AsyncIterator[EngineEvent]:
        core = self._core
        group = self.group
        while group.state == WAITING and not self._stopped():
            await self._block(None)  # woken by the core when admitted
        if core.injector.faults.hang_before_first_token:
            # until aborted, or until the fault is cleared (then the request goes on: an engine whose
            # first token came late); the setting is looked at again every 50 ms
            while not self._stopped() and core.injector.faults.hang_before_first_token:
                await self._block(0.05)
        faults = core.injector.faults
        zero = core.config.zero_latency
        if not zero and group.first_token_at is not None:
            await self._sleep_until(group.first_token_at)
        if self._stopped():
            for c in self._abort_completes():
                yield c
            return
        if self.req.stream:
            async for ev in self._stream(zero, faults.stall_after_tokens, faults.stall_seconds):
                yield ev
            return
        req = self.req
        plans = self.plans
        longest = max((len(p.token_ids) for p in plans), default=0)
        if not zero and longest > 1:
            # (until a time, not for a while: with batch steps the answer too comes on a decode step)
            await self._sleep_until(core.clock() + (longest - 1) * core.scheduler.itl())
        if faults.stall_after_tokens is not None and longest >= faults.stall_after_tokens:
            await self._sleep(faults.stall_seconds)
        if self._stopped():
            for c in self._abort_completes():
                yield c
            return
        for i, p in enumerate(plans):
            self._emitted[i] = len(p.token_ids)
        self._end([p.token_ids for p in plans])
        outputs = core.outputs
        kv_params = core.kv_transfer_params(req, group)
        plp = outputs.prompt_logprobs(group.prompt, req.prompt_logprobs)
        for i, p in enumerate(plans):
            ids = p.token_ids
            yield EngineComplete(
                index=i,
                finish_reason=p.finish_reason,
                prompt_tokens=len(group.prompt),
                completion_tokens=len(ids),
                cached_tokens=group.cached_tokens,
                output_ids=ids,
                matched_token_id=p.matched_token_id,
                logprobs=outputs.logprobs(ids, 0, req.top_logprobs) if req.logprobs else (),
                kv_transfer_params_json=kv_params,
                prompt_logprobs=plp,
            )

    async def _stream(self, zero: bool, stall_at: int | None, stall_s: float) -> AsyncIterator[EngineEvent]:
        """Drive ``_stream_steps``, sleeping where it says."""
        for item in self._stream_steps(zero, stall_at, stall_s):
            if isinstance(item, _Until):
                await self._sleep_until(item.when)
            elif isinstance(item, _Pause):
                await self._sleep(item.seconds)
            else:
                yield item

    def _stream_steps(
        self, zero: bool, stall_at: int | None, stall_s: float
    ) -> Iterator[EngineEvent | _Until | _Pause]:
        """The stream as a plain generator: chunks in lockstep over the samples, ``stream_interval``
        tokens each (the first token alone), interleaved with the waits the timing model asks for
        (``_Until`` a time, ``_Pause`` for a stall); after each wait it checks for an abort."""
        core = self._core
        group = self.group
        req = self.req
        plans = self.plans
        outputs = core.outputs
        itl = core.scheduler.itl
        prompt_tokens = len(group.prompt)
        cached = group.cached_tokens
        kv_params = core.kv_transfer_params(req, group)
        want_lp = req.logprobs
        top_n = req.top_logprobs
        # the prompt's logprobs ride on each choice's first chunk (vLLM's servicer: is_first_chunk)
        plp = outputs.prompt_logprobs(group.prompt, req.prompt_logprobs)
        interval = max(1, req.stream_interval or core.config.stream_interval)
        emitted = self._emitted
        n = len(plans)
        done = [False] * n
        remaining = n
        pos = 0
        step = 1
        due = group.first_token_at or 0.0
        stalled = stall_at is None
        while remaining:
            end = pos + step
            if not zero:
                yield _Until(due)
                if self._stopped():
                    break
            for i in range(n):
                if done[i]:
                    continue
                p = plans[i]
                ids = p.token_ids
                total = len(ids)
                if pos < total:
                    piece = ids[pos:end]
                    emitted[i] = count = pos + len(piece)
                    lps = outputs.logprobs(piece, pos, top_n) if want_lp else ()
                    if plp is not None and pos == 0:
                        yield PromptChunk(i, piece, prompt_tokens, count, cached, lps, plp)
                    else:
                        yield EngineChunk(
                            index=i,
                            token_ids=piece,
                            prompt_tokens=prompt_tokens,
                            completion_tokens=count,
                            cached_tokens=cached,
                            logprobs=lps,
                        )
                if end >= total:
                    done[i] = True
                    remaining -= 1
                    if not remaining:
                        self._end([q.token_ids for q in plans])
                    yield EngineComplete(
                        index=i,
                        finish_reason=p.finish_reason,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=total,
                        cached_tokens=cached,
                        matched_token_id=p.matched_token_id,
                        kv_transfer_params_json=kv_params,
                    )
            if self._stopped():
                break
            pos = end
            step = interval
            if not zero:
                due += step * itl()
            if not stalled and pos >= (stall_at or 0):
                stalled = True
                yield _Pause(stall_s)
                if self._stopped():
                    break
        if self._stopped() and not self.finished:
            yield from self._abort_completes(done)

    def take_ready(self) -> list[EngineEvent] | None:
        """Every event of a stream at once, when nothing can make it wait: zero latency, admitted,
        no hang or stall fault. None otherwise (iterate ``events()``). The run ends here."""
        core = self._core
        faults = core.injector.faults
        if (
            not core.config.zero_latency
            or self.group.state != RUNNING
            or self.finished
            or faults.hang_before_first_token
            or faults.stall_after_tokens is not None
            or not self.req.stream
        ):
            return None
        out: list[EngineEvent] = []
        for item in self._stream_steps(True, None, 0.0):
            assert not isinstance(item, _Until | _Pause)  # zero latency and no stall: nothing waits
            out.append(item)
        return out


@dataclass(frozen=True, slots=True)
class _Until:
    when: float


@dataclass(frozen=True, slots=True)
class _Pause:
    seconds: float


class EngineCore:
    """Scheduler + cache + output model + faults + stats + KV event log of one mock engine."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: TokenizerLike,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        exit_process: Callable[[int], None] = os._exit,
        corpus_text: str = PARAGRAPH,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        self.wallclock = wallclock
        self._exit = exit_process
        self.started_at = wallclock()
        self.step_epoch = clock()  # decode steps (``decode_steps="batch"``) count from here
        self.cache = PrefixCache(config.cache_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(), self.cache)
        eos = tokenizer.eos_token_ids
        self.eos_token_id = eos[0] if eos else 0
        self.outputs = OutputModel(
            tokenizer.encode(" " + corpus_text.strip(), add_special_tokens=False),
            self.eos_token_id,
            seed=config.seed,
            default_len=config.output_len,
            vocab_size=tokenizer.vocab_size,
            context_length=config.context_length,
        )
        self.scripts = ScriptQueue()
        self.injector = FaultInjector(config.faults, config.seed)
        self.scheduler.slow_factor = config.faults.slow_factor
        self.stats = MockStats()
        self.kv_log = KvEventLog()
        self.grpc_port = 0
        self.http_port = 0  # also the PD bootstrap port of a prefill-role engine
        self.prefills = PrefillLog()  # what a prefill-role engine saw (see pd_check)
        self._runs: dict[str, list[Run]] = {}
        self._waiting_runs: dict[SeqGroup, Run] = {}
        self.last_receive_time = 0.0

    # ---- requests ------------------------------------------------------------------------------

    def start(self, req: MockRequest) -> Run:
        """Admit a request (or queue it). Raises MockRpcError for injected errors and invalid input."""
        stats = self.stats
        stats.requests_received += 1
        stats.last_request_id = req.request_id
        self.last_receive_time = self.wallclock()
        verdict = self.injector.on_request()
        if verdict == "crash":
            print("mock engine: crash fault, exiting", file=sys.stderr, flush=True)
            self._exit(1)
            raise MockRpcError("UNAVAILABLE", "crashed")  # only reached with an injected exit_process
        if verdict is not None:
            stats.errors_injected += 1
            raise MockRpcError(verdict, f"injected fault ({verdict})")
        cfg = self.config
        prompt = req.prompt
        if req.n < 1:
            stats.rejected += 1
            raise MockRpcError("INVALID_ARGUMENT", "n must be >= 1")
        room = cfg.context_length - len(prompt)
        if not prompt or room <= 0:
            stats.rejected += 1
            raise MockRpcError(
                "INVALID_ARGUMENT",
                f"prompt has {len(prompt)} tokens; the context length is {cfg.context_length}"
                if prompt
                else "empty prompt",
            )
        spec = req.spec
        limit = spec.max_new_tokens
        if cfg.role == "prefill":  # the prefill side of a PD pair produces the first token only
            limit = 1 if limit is None else min(limit, 1)
        if limit is None:
            natural = max(cfg.output_len, spec.min_new_tokens) + (0 if spec.ignore_eos else 1)
            if natural > room:
                limit = room
        elif limit > room:
            limit = room
        if limit != spec.max_new_tokens:
            spec = dataclasses.replace(spec, max_new_tokens=limit)
        scripted: ScriptedResponse | None = None
        if len(self.scripts):
            text = req.prompt_text or self.tokenizer.decode(prompt, skip_special_tokens=False)
            scripted = self.scripts.take(text)
        plans = [self.outputs.plan(prompt, spec, i, scripted) for i in range(req.n)]
        skip_prefill = cfg.role == "decode" and (req.kv_transfer_params_json is not None or req.disaggregated)
        now = self.clock()
        try:
            group = self.scheduler.submit(
                req.request_id, prompt, [len(p.token_ids) for p in plans], now, skip_prefill=skip_prefill
            )
        except AdmissionError as e:
            stats.rejected += 1
            raise MockRpcError("INVALID_ARGUMENT", str(e)) from e
        self._changed()
        if cfg.role == "prefill":
            self.prefills.record(req)
        run = Run(self, req, group, plans)
        runs = self._runs.get(req.request_id)
        if runs is None:
            self._runs[req.request_id] = [run]
        else:
            runs.append(run)
        if group.state == WAITING:
            self._waiting_runs[group] = run
        return run

    def abort(self, request_id: str, *, prefix: bool = False) -> bool:
        """Abort every live run of ``request_id`` (recorded in the stats either way). ``prefix``: of every
        request whose id starts with it, as SGLang's scheduler matches an Abort (``req.rid.startswith``);
        each one aborted is recorded under its own id."""
        if prefix:
            ids = [rid for rid in self._runs if rid.startswith(request_id)]
        else:
            ids = [request_id] if self._runs.get(request_id) else []
        if not ids:
            self.stats.abort_unmatched.append(request_id)
            return False
        for rid in ids:
            self.stats.aborted_by_rpc.append(rid)
            self.stats.aborted.append(rid)
            for run in list(self._runs.get(rid, ())):
                run.abort()
        return True

    def _run_ended(self, run: Run, outputs: list[tuple[int, ...]] | None, generated: int) -> None:
        now = self.clock()
        group = run.group
        self._waiting_runs.pop(group, None)
        if outputs is None:
            admitted = self.scheduler.abort(group, now, max(generated, 0))
        else:
            admitted = self.scheduler.finish(group, now, outputs)
            self.stats.completed += 1
            if group.first_token_at is not None:
                self.stats.ttft_model_s.append(group.first_token_at - group.submitted_at)
        for g in admitted:
            waiter = self._waiting_runs.pop(g, None)
            if waiter is not None:
                waiter.wakeup()
        runs = self._runs.get(run.request_id)
        if runs is not None:
            with contextlib.suppress(ValueError):
                runs.remove(run)
            if not runs:
                del self._runs[run.request_id]
        self._changed()

    def _changed(self) -> None:
        events = self.cache.drain_events()
        log = self.kv_log
        if events:
            log.publish(events, self.wallclock())
        if log.subscriber_count:
            log.load_changed()

    # ---- queries and control -------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        return sum(len(r) for r in self._runs.values())

    def loads(self) -> LoadSnapshot:
        return self.scheduler.loads(self.clock())

    def set_faults(self, faults: Faults) -> None:
        self.injector.set(faults)
        self.scheduler.slow_factor = faults.slow_factor

    def add_script(
        self, text: str, match: str = "", times: int = 1, finish_reason: str | None = None
    ) -> None:
        if finish_reason not in (None, "stop", FINISH_LENGTH):
            raise ValueError("finish_reason must be 'stop' or 'length'")
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if finish_reason in (None, "stop"):
            ids += (self.eos_token_id,)
        self.scripts.add(
            ScriptedResponse(ids, match=match, times=times, finish_reason=finish_reason, text=text)
        )

    def flush_cache(self) -> bool:
        ok = self.scheduler.flush_cache()
        self._changed()
        return ok

    def kv_transfer_params(self, req: MockRequest, group: SeqGroup) -> str | None:
        """What a prefill-role engine hands the decode side (vLLM NIXL-style), else None."""
        if self.config.role != "prefill":
            return None
        return json.dumps(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.config.engine_id,
                "remote_host": self.config.host,
                "remote_port": self.grpc_port,
                "remote_bootstrap_port": self.http_port,  # the mock's stand-in for the NIXL handshake
                "remote_request_id": req.request_id,
                "remote_block_ids": list(range(len(group.prompt) // self.cache.block_size)),
            }
        )

    def stats_json(self) -> dict[str, object]:
        out = self.stats.to_json()
        cs = self.cache.stats()
        out["active"] = self.active_requests
        out["cache"] = {
            "block_size": cs.block_size,
            "capacity_blocks": cs.capacity_blocks,
            "blocks_cached": cs.hashed_blocks,
            "blocks_used": cs.used_blocks,
            "blocks_evictable": cs.evictable_blocks,
            "blocks_private": cs.private_blocks,
            "lookup_tokens": cs.lookup_tokens,
            "hit_tokens": cs.hit_tokens,
            "hit_rate": cs.hit_rate,
            "stored_blocks_total": cs.stored_blocks_total,
            "evicted_blocks_total": cs.evicted_blocks_total,
        }
        out["kv_events"] = {
            "last_sequence_number": self.kv_log.last_sequence_number,
            "subscribers": self.kv_log.subscriber_count,
        }
        out["faults"] = self.injector.faults.to_json()
        out["scripted_pending"] = self.scripts.snapshot()
        return out
