"""PD disaggregation: a prefill pool and a decode pool, each with its own policy.

Two protocols, chosen by the engines' kind (both pools are of one kind):

- **SGLang** (bootstrap): the node picks a prefill and a decode worker, draws a bootstrap room and
  sends the same request, with ``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (its
  bootstrap server: given with ``--prefill URL PORT``, else 8998) and ``bootstrap_room``, to *both at
  once*; the decode engine pulls the KV cache from the prefill engine by room. The client streams
  from the decode side; the prefill side's answer (its first token) is drained in the background.
- **vLLM** (KV transfer): the prefill worker first gets the request with ``max_tokens`` 1 and
  ``kv_transfer_params {"do_remote_decode": true}``; the KV transfer parameters it returns (where the
  cache is, which blocks) are relayed to the decode worker with the original request.

A failure before the decode side's first token is retried on other workers (both pools), as a plain
request is; whatever the outcome, an engine request that is no longer wanted is aborted. With tracing on,
each engine call (the prefill half and the decode half, each retry its own) is a GenAI CLIENT span with
its worker's ``server.address`` / ``server.port`` and ``shepherd.pd.role``; the route stage is an event
with both picks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import urllib.parse
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from shepherd.node.config import NodeConfig, cache_aware_config
from shepherd.node.dispatch.kv_feed import KvFeed
from shepherd.node.dispatch.stream import EngineStream
from shepherd.node.dispatch.workers import (
    Worker,
    WorkerRegistry,
    client_error,
    no_healthy_worker,
    pick_worker,
)
from shepherd.node.engines.http import HttpRelayClient
from shepherd.node.metrics import NodeMetrics
from shepherd.node.observe import tracing
from shepherd.node.observe.tracing import EngineCall
from shepherd.policies.base import Policy
from shepherd.policies.simple import make_policy
from shepherd.proto.engine_types import (
    EngineClient,
    EngineComplete,
    EngineError,
    EngineEvent,
    GenerateRequest,
    worker_id,
)

log = logging.getLogger("shepherd.pd")

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
VLLM_PREFILL_PARAMS = json.dumps(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)


def bootstrap_room(rng: random.Random) -> int:
    """A fresh room (the proto's field is an int32: non-negative, below 2**31)."""
    return rng.randrange(1 << 31)


def url_host(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname
    return host or "127.0.0.1"


@dataclass(frozen=True, slots=True)
class PdPair:
    prefill: Worker
    decode: Worker


class Dispatcher(Protocol):
    """What PD dispatch uses of the gateway that owns it (``shepherd.node.dispatch.gateway.Gateway``)."""

    cfg: NodeConfig
    metrics: NodeMetrics
    registry: WorkerRegistry
    kv_feed: KvFeed

    def abort_in_background(self, w: Worker, request_id: str, reason: str) -> None: ...


# the attribute a PD half's engine error carries: the id of the worker that failed it (``_settle``)
PD_FAILED = "shepherd_pd_failed_worker"


class PdRouter:
    """The node's PD dispatch; the gateway hands every generate request of a PD node to ``open_stream``."""

    def __init__(self, gw: Dispatcher, *, seed: int | None = None) -> None:
        cfg = gw.cfg
        self.gw = gw
        ca = cache_aware_config(cfg)
        self.prefill_policy: Policy = make_policy(cfg.prefill_policy or cfg.policy, cache_aware=ca)
        self.decode_policy: Policy = make_policy(cfg.decode_policy or cfg.policy, cache_aware=ca)
        ports = cfg.prefill_bootstrap_ports or (None,) * len(cfg.prefill_urls)
        self.bootstrap_ports: dict[str, int] = {
            worker_id(u): p or DEFAULT_BOOTSTRAP_PORT for u, p in zip(cfg.prefill_urls, ports, strict=True)
        }
        self.prefill_ids = frozenset(worker_id(u) for u in cfg.prefill_urls)
        self.decode_ids = frozenset(worker_id(u) for u in cfg.decode_urls)
        self._rng = random.Random(seed)

    def join_pool(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        """Put the worker of ``url`` in the ``prefill`` or ``decode`` pool at run time (Kubernetes
        discovery), before it is added to the registry (the pool's policy learns of it then)."""
        wid = worker_id(url)
        if role == "prefill":
            self.prefill_ids = self.prefill_ids | {wid}
            self.bootstrap_ports[wid] = bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        elif role == "decode":
            self.decode_ids = self.decode_ids | {wid}
        else:
            raise ValueError(f"PD pool {role!r}: prefill or decode")

    def leave_pool(self, url: str) -> None:
        """Take the worker of ``url`` out of its pool (after it left the registry)."""
        wid = worker_id(url)
        self.prefill_ids = self.prefill_ids - {wid}
        self.decode_ids = self.decode_ids - {wid}
        self.bootstrap_ports.pop(wid, None)

    def role_of(self, wid: str) -> str:
        """The role of a worker: ``prefill`` or ``decode`` (its pool's), else ``regular``."""
        return "prefill" if wid in self.prefill_ids else "decode" if wid in self.decode_ids else "regular"

    def policy_of(self, w: Worker) -> Policy | None:
        """The policy of the pool the worker is in (None: in neither)."""
        if w.id in self.prefill_ids:
            return self.prefill_policy
        if w.id in self.decode_ids:
            return self.decode_policy
        return None

    def pick_pair(
        self, model: str, tried_p: set[str], tried_d: set[str], ids: Sequence[int], key: str | None
    ) -> PdPair | None:
        gw = self.gw
        gw.kv_feed.poll_fresh()  # (a meshed node's KV-event streams: read if their last read is stale)
        p = pick_worker(gw.registry, model, tried_p, ids, key, self.prefill_policy, only=self.prefill_ids)
        if p is None:
            return None
        d = pick_worker(gw.registry, model, tried_d, ids, key, self.decode_policy, only=self.decode_ids)
        if d is None:
            p.breaker.release()  # a half-open prefill worker's trial was not used
            return None
        return PdPair(p, d)

    async def open_stream(self, model: str, gen: GenerateRequest, routing_key: str | None) -> EngineStream:
        """Both halves of ``gen``; the decode side's stream once its first event is in."""
        gw = self.gw
        tried_p: set[str] = set()
        tried_d: set[str] = set()
        last_error: EngineError | None = None
        for attempt in range(gw.cfg.max_retries + 1):
            with tracing.stage("route") as rt:  # an event with both pools' choices (tracing on)
                pair = self.pick_pair(model, tried_p, tried_d, gen.input_ids, routing_key)
                rt.routed(self.decode_policy, pair.decode if pair is not None else None)
                if pair is not None:
                    rt.set("shepherd.route.prefill_worker", str(pair.prefill.url))
            if pair is None:
                if last_error is not None:
                    raise last_error
                raise no_healthy_worker(
                    f"No healthy prefill and decode workers are available for model '{model}'."
                )
            if attempt > 0:  # (counted when it is sent: a re-pick that finds no pair is no retry)
                gw.metrics.retries.inc()
                tracing.event("retry", {"shepherd.retry.attempt": attempt})
            req = gen if attempt == 0 else replace(gen, request_id=f"{gen.request_id}-r{attempt}")
            try:
                if _kind(pair.prefill) == "vllm":
                    return await self._vllm(pair, req, model, attempt)
                return await self._sglang(pair, req, model, attempt)
            except EngineError as e:
                last_error = client_error(e, pair.prefill, pair.decode)  # what a client may read
                if not e.retryable:
                    raise last_error from None
                # the half that failed is not tried again; its partner may serve with another one (a pool
                # of one worker is the usual shape of one side); a failure of neither known: both
                failed = getattr(e, PD_FAILED, None)
                if failed != pair.decode.id:
                    tried_p.add(pair.prefill.id)
                if failed != pair.prefill.id:
                    tried_d.add(pair.decode.id)
                if attempt < gw.cfg.max_retries:
                    log.info("PD request %s: retrying on other workers after: %s", gen.request_id, e)
        assert last_error is not None
        raise last_error

    # ---- SGLang: both halves at once, with a bootstrap room ----------------------------------------

    async def _sglang(self, pair: PdPair, gen: GenerateRequest, model: str, attempt: int) -> EngineStream:
        gw = self.gw
        p, d = pair.prefill, pair.decode
        req = replace(
            gen,
            bootstrap_host=url_host(p.url),
            bootstrap_port=self.bootstrap_ports.get(p.id, DEFAULT_BOOTSTRAP_PORT),
            bootstrap_room=bootstrap_room(self._rng),
        )
        timeout = gw.cfg.request_timeout_secs
        pcall = _engine_call(model, req, p, attempt, "prefill")  # the CLIENT spans (tracing on)
        dcall = _engine_call(model, req, d, attempt, "decode")
        p.in_flight += 1
        prefill_task = asyncio.create_task(self._drain_prefill(p, req, timeout, pcall))
        d.in_flight += 1
        agen = _batches(d, req, timeout)
        first_task = asyncio.create_task(_first(agen, dcall))
        prefill_error: BaseException | None = None
        try:
            done, _ = await asyncio.wait({prefill_task, first_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.exception() is not None and not first_task.done():
                # the prefill half failed first: the decode half would wait for its KV cache in vain
                prefill_error = cast(BaseException, prefill_task.exception())
                raise prefill_error
            first = await first_task
        except BaseException as e:
            if (
                prefill_error is None
                and not isinstance(e, asyncio.CancelledError)  # (a cancel stays a cancel)
                and prefill_task.done()
                and not prefill_task.cancelled()
            ):
                # (both ended in one wake-up: the prefill's failure is the cause, its error the one raised)
                prefill_error = prefill_task.exception()
            d.in_flight -= 1
            first_task.cancel()
            with contextlib.suppress(BaseException):
                await first_task
            if dcall is not None and e is prefill_error:  # given up with its prefill half
                dcall.end("cancelled")
            elif dcall is not None:  # the decode half failed
                dcall.fail(e)
            gw.abort_in_background(d, req.request_id, "cancelled")
            with contextlib.suppress(Exception):
                await agen.aclose()
            if not prefill_task.done():
                prefill_task.cancel()
            if prefill_error is not None and prefill_error is not e:
                self._settle(d, e, blame=False)
                raise prefill_error from None  # (its PD_FAILED names the prefill worker)
            if isinstance(e, StopAsyncIteration):
                gw.registry.record_result(d, False)
                raise EngineError("decode engine closed the stream without output") from None
            self._settle(d, e, blame=e is not prefill_error)
            raise
        gw.registry.record_result(d, True)
        return self._stream(d, req.request_id, agen, first, prefill_task, dcall)

    async def _drain_prefill(
        self, p: Worker, req: GenerateRequest, timeout: float, call: EngineCall | None
    ) -> None:
        """The prefill half: read it to its end (its output is the decode side's business); ``call`` its
        CLIENT span (tracing on), current while the call is sent, ended with it."""
        gw = self.gw
        completed = False
        agen = _batches(p, req, timeout)
        try:
            if call is not None:
                completed = any(isinstance(ev, EngineComplete) for ev in await call.first(anext(agen)))
            async for batch in agen:
                completed = completed or any(isinstance(ev, EngineComplete) for ev in batch)
            gw.registry.record_result(p, True)
        except StopAsyncIteration:  # no batch at all (only with a span: else the loop ends)
            gw.registry.record_result(p, True)
        except BaseException as e:
            if call is not None:
                call.fail(e)
            self._settle(p, e)
            raise
        finally:
            if call is not None:
                call.end(None if completed else "cancelled")
            p.in_flight -= 1
            if not completed:
                gw.abort_in_background(p, req.request_id, "cancelled")
            with contextlib.suppress(Exception):
                await agen.aclose()

    # ---- vLLM: prefill first, its KV transfer parameters to the decode side ------------------------

    async def _vllm(self, pair: PdPair, gen: GenerateRequest, model: str, attempt: int) -> EngineStream:
        gw = self.gw
        p, d = pair.prefill, pair.decode
        timeout = gw.cfg.request_timeout_secs
        preq = replace(
            gen,
            sampling=replace(gen.sampling, max_new_tokens=1, min_new_tokens=0, n=1),
            stream=False,
            logprobs=False,
            top_logprobs=0,
            kv_transfer_params_json=VLLM_PREFILL_PARAMS,
        )
        pcall = _engine_call(model, preq, p, attempt, "prefill")  # its CLIENT span (tracing on)
        p.in_flight += 1
        kv: str | None = None
        completed = False
        pgen = _batches(p, preq, timeout)
        try:
            batches = [await (anext(pgen) if pcall is None else pcall.first(anext(pgen)))]
            batches += [batch async for batch in pgen]
            for ev in (ev for batch in batches for ev in batch):
                if isinstance(ev, EngineComplete):
                    completed = True
                    kv = kv or ev.kv_transfer_params_json
        except StopAsyncIteration:  # no answer at all (kv stays None)
            pass
        except BaseException as e:
            if pcall is not None:
                pcall.fail(e)
            self._settle(p, e)
            raise
        finally:
            if pcall is not None:
                pcall.end(None if completed else "cancelled")
            p.in_flight -= 1
            if not completed:
                gw.abort_in_background(p, preq.request_id, "cancelled")
            with contextlib.suppress(Exception):
                await pgen.aclose()
        if kv is None:
            gw.registry.record_result(p, False)
            raise EngineError(
                f"prefill worker {p.url} returned no kv_transfer_params (is it a KV producer?)",
                retryable=False,
            )
        gw.registry.record_result(p, True)
        dreq = replace(gen, kv_transfer_params_json=kv)
        dcall = _engine_call(model, dreq, d, attempt, "decode")
        d.in_flight += 1
        agen = _batches(d, dreq, timeout)
        try:
            first = await (anext(agen) if dcall is None else dcall.first(anext(agen)))
        except BaseException as e:
            if dcall is not None:
                dcall.fail(e)
            d.in_flight -= 1
            gw.abort_in_background(d, dreq.request_id, "cancelled")
            with contextlib.suppress(Exception):
                await agen.aclose()
            if isinstance(e, StopAsyncIteration):
                gw.registry.record_result(d, False)
                raise EngineError("decode engine closed the stream without output") from None
            self._settle(d, e)
            raise
        gw.registry.record_result(d, True)
        return self._stream(d, dreq.request_id, agen, first, None, dcall)

    def _settle(self, w: Worker, e: BaseException, *, blame: bool = True) -> None:
        """A send to ``w`` ended early with ``e``: a failure of the worker if the engine failed it (and
        ``blame``: the error then names it, ``PD_FAILED``, so that a retry avoids that worker and not
        its partner), else (cancelled, the request refused as invalid) its half-open trial is given back."""
        if blame and isinstance(e, EngineError) and e.code != "invalid_request":
            self.gw.registry.record_result(w, False)
            setattr(e, PD_FAILED, w.id)
        else:
            w.breaker.release()

    # ---- both ----------------------------------------------------------------------------------------

    def _stream(
        self,
        d: Worker,
        request_id: str,
        agen: AsyncGenerator[list[EngineEvent], None],
        first: list[EngineEvent],
        prefill_task: asyncio.Task[None] | None,
        call: EngineCall | None,
    ) -> EngineStream:
        def on_close() -> None:
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()  # the client is gone: the prefill half is aborted too

        if prefill_task is not None:
            prefill_task.add_done_callback(_retrieve)
        return EngineStream(self.gw, d, request_id, agen, first, on_close=on_close, trace=call)


async def _first(agen: AsyncGenerator[list[EngineEvent], None], call: EngineCall | None) -> list[EngineEvent]:
    return await (anext(agen) if call is None else call.first(anext(agen)))


def _engine_call(model: str, req: GenerateRequest, w: Worker, attempt: int, role: str) -> EngineCall | None:
    """The CLIENT span of one half's engine call (tracing on, the request sampled), else None."""
    if not tracing.ENABLED:
        return None
    return tracing.engine_call(model, req.request_id, req.sampling, w.url, _kind(w), attempt, pd_role=role)


def _kind(w: Worker) -> str:
    return str(w.client.kind)


def _batches(w: Worker, req: GenerateRequest, timeout: float) -> AsyncGenerator[list[EngineEvent], None]:
    client = w.client
    if isinstance(client, HttpRelayClient):  # config forbids it; kept as a clear error
        raise EngineError(f"PD worker {w.id} is an HTTP worker", retryable=False)
    engine: EngineClient = client
    return cast(AsyncGenerator[list[EngineEvent], None], engine.generate_batches(req, timeout=timeout))


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("PD prefill half ended with: %s", task.exception())
