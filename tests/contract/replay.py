"""Replay servers: what each real engine servicer sends, message by message, over real gRPC.

A separate replay server rather than a ``--dialect`` flag on the mock engine: the mock engine models a
scheduler (queues, prefill and decode time, a KV cache, faults) for load and chaos runs, and its wire
is one of many things it does; a contract test needs the opposite: a fixed scheduler outcome (the
tokens of each step, the finish) turned into exactly the messages one servicer's code builds from it,
nothing else. Each dialect below is that translation, read from the servicer's source:

- ``sglang-smg``: SMG's SGLang servicer, lightseekorg/smg
  grpc_servicer/smg_grpc_servicer/sglang/servicer.py (Generate, HealthCheck, GetModelInfo,
  GetServerInfo, SubscribeKvEvents) with grpc_servicer/smg_grpc_servicer/sglang/request_manager.py
  (n > 1: streamed choices carry their index, non-streamed ones are collected and each Complete says
  index 0; a streamed finish is sent as a chunk and again as a Complete carrying the same last delta)
  and grpc_servicer/smg_grpc_servicer/sglang/server.py (``max_context_length`` is the scheduler's
  ``max_total_num_tokens``, the KV pool).
- ``sglang-inproc``: SGLang's in-tree gRPC server, sgl-project/sglang
  python/sglang/srt/entrypoints/grpc_server.py (always streams to its request manager; a finished
  output goes out as a Complete only, carrying its last delta, never as a chunk; ``max_context_length``
  from ``max_total_num_tokens``; no GetLoads, no SubscribeKvEvents).
- ``vllm-smg``: SMG's vLLM servicer, lightseekorg/smg grpc_servicer/smg_grpc_servicer/vllm/servicer.py
  and grpc_servicer/smg_grpc_servicer/vllm/kv_transfer.py (DELTA outputs: every step a chunk per
  choice with its index, a finished choice's Complete repeating its last delta; FINAL_ONLY without
  streaming; KV transfer parameters returned as both the typed ``kv_transfer_params`` and
  ``kv_transfer_params_json``, or the typed field alone in releases before the JSON field).
- ``vllm-entrypoint``: vLLM's own gRPC entrypoint as it was before it took SMG's servicer,
  vllm-project/vllm vllm/entrypoints/grpc_server.py at 94d4b167853fb62ab5e9da17992921d18387b63a (only
  ``outputs[0]``, chunks and a Complete repeating the last delta, ``max_model_len`` as the context; no
  GetLoads, no SubscribeKvEvents: UNIMPLEMENTED).

The scheduler's outcome is a ``Plan`` the test sets before its request (``ReplayServer.plan``); the
server records what it received (``requests``, ``calls``). Servers run grpc's threaded server on
loopback, so a test drives a real node process over them with a plain HTTP client.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto import vllm_engine_pb2_grpc as vl_grpc
from smg_grpc_proto.generated import common_pb2

DIALECTS = ("sglang-smg", "sglang-inproc", "vllm-smg", "vllm-entrypoint")
LOGPROB = -0.5  # every replayed token's logprob


@dataclass
class Choice:
    """One choice as the scheduler produced it: the new token ids of each step, then its finish."""

    deltas: list[list[int]]
    finish: str | None = "stop"  # "stop" | "length" | "abort" | "error"; None: still running (no Complete)
    matched: int | str | None = None

    @property
    def ids(self) -> list[int]:
        return [t for d in self.deltas for t in d]


@dataclass
class Plan:
    """The scheduler's outcome for the next Generate calls (``choices``), or a failure the servicer
    reports as a gRPC status after its messages (``fail``)."""

    choices: list[Choice] = field(default_factory=list)
    cached: int = 0
    fail: tuple[grpc.StatusCode, str] | None = None
    kv_params: dict[str, Any] | None = None  # vLLM PD: what the engine's connector returned
    typed_kv_only: bool = False  # vLLM: a servicer that predates kv_transfer_params_json
    hold_s: float = 0.0  # the stream held open this long after its messages (still queued or running)


PlanFn = Callable[["ReplayServer", Any], Plan]


@dataclass
class EngineFacts:
    """What the servicer reports about the engine (GetModelInfo, GetServerInfo, GetLoads)."""

    context_length: int = 2048  # the model's window (SGLang: --context-length; vLLM: max_model_len)
    kv_pool_tokens: int = 100  # SGLang's max_total_num_tokens
    page_size: int = 1  # SGLang's default
    health_delay_s: float = 0.0  # SMG's SGLang HealthCheck sleeps 1 s before it first looks
    running: int = 3
    # GetModelInfo and GetServerInfo each answer this late (an engine loading, or under heavy load);
    # read while they wait: lowering it answers the calls waiting
    info_delay_s: float = 0.0


def _lp(ids: list[int]) -> Any:
    return sg.OutputLogProbs(
        token_logprobs=[LOGPROB] * len(ids),
        token_ids=ids,
        top_logprobs=[sg.TopLogProbs(values=[LOGPROB], token_ids=[t]) for t in ids],
    )


def _vlp(ids: list[int]) -> Any:
    return vl.OutputLogProbs(
        token_logprobs=[LOGPROB] * len(ids),
        token_ids=ids,
        top_logprobs=[vl.TopLogProbs(values=[LOGPROB], token_ids=[t]) for t in ids],
    )


def _matched(c: Choice) -> dict[str, Any]:
    if isinstance(c.matched, int):
        return {"matched_token_id": c.matched}
    if isinstance(c.matched, str):
        return {"matched_stop_str": c.matched}
    return {}


def _sg_chunk(rid: str, plan: Plan, prompt: int, ids: list[int], done: int, lp: Any, **kw: Any) -> Any:
    """An SGLang GenerateResponse chunk (``done``: its completion_tokens)."""
    return sg.GenerateResponse(
        request_id=rid,
        chunk=sg.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=prompt,
            completion_tokens=done,
            cached_tokens=plan.cached,
            output_logprobs=lp,
            **kw,
        ),
    )


def _sg_complete(
    rid: str, plan: Plan, prompt: int, c: Choice, ids: list[int], done: int, lp: Any, **kw: Any
) -> Any:
    """An SGLang GenerateResponse Complete of choice ``c`` (its matched stop included)."""
    return sg.GenerateResponse(
        request_id=rid,
        complete=sg.GenerateComplete(
            output_ids=ids,
            finish_reason=c.finish,
            prompt_tokens=prompt,
            completion_tokens=done,
            cached_tokens=plan.cached,
            output_logprobs=lp,
            **kw,
            **_matched(c),
        ),
    )


def _vl_chunk(plan: Plan, prompt: int, ids: list[int], **kw: Any) -> Any:
    return vl.GenerateResponse(
        chunk=vl.GenerateStreamChunk(
            token_ids=ids, prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=plan.cached, **kw
        )
    )


def _vl_complete(plan: Plan, prompt: int, c: Choice, ids: list[int], **kw: Any) -> Any:
    return vl.GenerateResponse(
        complete=vl.GenerateComplete(
            output_ids=ids,
            finish_reason=c.finish or "stop",
            prompt_tokens=prompt,
            completion_tokens=len(ids),
            cached_tokens=plan.cached,
            **kw,
        )
    )


# ---- SGLang ---------------------------------------------------------------------------------------


def sglang_smg_messages(req: Any, plan: Plan) -> Iterator[Any]:
    """lightseekorg/smg sglang/servicer.py Generate + request_manager.generate_request."""
    rid = req.request_id
    prompt = len(req.tokenized.input_ids)
    logprobs = req.return_logprob
    n = len(plan.choices)
    if req.stream:
        # streamed: the n generators multiplexed as outputs arrive, each output a chunk (index set from
        # rid_to_index), a finished one followed by a Complete built from the same output dict
        done = [0] * n
        steps = max((len(c.deltas) for c in plan.choices), default=0)
        for step in range(steps):
            for i, c in enumerate(plan.choices):
                if step >= len(c.deltas):
                    continue
                delta = c.deltas[step]
                done[i] += len(delta)
                lp = _lp(delta) if logprobs else None
                yield _sg_chunk(rid, plan, prompt, delta, done[i], lp, index=i)
                if step == len(c.deltas) - 1 and c.finish is not None:
                    yield _sg_complete(rid, plan, prompt, c, delta, done[i], lp, index=i)
        return
    # not streamed: each generator's final output with the accumulated ids; n > 1 comes as a list of
    # outputs that carry no "index" (only the streamed path sets it): every Complete says 0
    for c in plan.choices:
        if c.finish is None:
            continue
        ids = c.ids
        yield _sg_complete(rid, plan, prompt, c, ids, len(ids), _lp(ids) if logprobs else None, index=0)


def sglang_inproc_messages(req: Any, plan: Plan) -> Iterator[Any]:
    """sgl-project/sglang python/sglang/srt/entrypoints/grpc_server.py Generate: the request manager
    always streams; an unfinished output is a chunk, the finished one a Complete only (its last delta,
    ``completion_tokens`` the length of its ids). One choice."""
    rid = req.request_id
    prompt = len(req.tokenized.input_ids)
    logprobs = req.return_logprob
    for c in plan.choices[:1]:
        for step, delta in enumerate(c.deltas):
            lp = _lp(delta) if logprobs else None
            if step < len(c.deltas) - 1 or c.finish is None:
                yield _sg_chunk(rid, plan, prompt, delta, len(delta), lp)
            else:
                yield _sg_complete(rid, plan, prompt, c, delta, len(delta), lp)


# ---- vLLM -----------------------------------------------------------------------------------------


def _kv_fields(plan: Plan) -> dict[str, Any]:
    """smg vllm/kv_transfer.py params_to_response_fields (typed mirror only for a valid host and port)."""
    p = plan.kv_params
    if not p:
        return {}
    out: dict[str, Any] = {}
    host, port = p.get("remote_host", ""), p.get("remote_port", 0)
    if isinstance(host, str) and host and isinstance(port, int) and 1 <= port <= 65535:
        out["kv_transfer_params"] = vl.KvTransferParams(remote_host=host, remote_port=port)
    if not plan.typed_kv_only:
        import json  # not at the top: only the PD scenarios use it

        out["kv_transfer_params_json"] = json.dumps(p)
    return out


def vllm_smg_messages(req: Any, plan: Plan) -> Iterator[Any]:
    """lightseekorg/smg vllm/servicer.py Generate, _chunk_response, _complete_response."""
    prompt = len(req.tokenized.input_ids)
    logprobs = req.sampling_params.HasField("logprobs")
    if req.stream:
        steps = max((len(c.deltas) for c in plan.choices), default=0)
        for step in range(steps):
            for i, c in enumerate(plan.choices):
                if step >= len(c.deltas):
                    continue
                delta = c.deltas[step]
                lp = _vlp(delta) if logprobs else None
                yield _vl_chunk(plan, prompt, delta, output_logprobs=lp, index=i)
                if step == len(c.deltas) - 1 and c.finish is not None:
                    yield _vl_complete(
                        plan, prompt, c, delta, output_logprobs=lp, index=i, **_kv_fields(plan), **_matched(c)
                    )
        return
    for i, c in enumerate(plan.choices):
        if c.finish is None:
            continue
        lp = _vlp(c.ids) if logprobs else None
        yield _vl_complete(
            plan, prompt, c, c.ids, output_logprobs=lp, index=i, **_kv_fields(plan), **_matched(c)
        )


def vllm_entrypoint_messages(req: Any, plan: Plan) -> Iterator[Any]:
    """vllm-project/vllm vllm/entrypoints/grpc_server.py (94d4b16): ``outputs[0]`` only; streamed, a
    chunk per step and, at the end, a Complete with the same last delta."""
    prompt = len(req.tokenized.input_ids)
    for c in plan.choices[:1]:
        if req.stream:
            for step, delta in enumerate(c.deltas):
                yield _vl_chunk(plan, prompt, delta)
                if step == len(c.deltas) - 1 and c.finish is not None:
                    yield _vl_complete(plan, prompt, c, delta)
        elif c.finish is not None:
            yield _vl_complete(plan, prompt, c, c.ids)


MESSAGES: dict[str, Callable[[Any, Plan], Iterator[Any]]] = {
    "sglang-smg": sglang_smg_messages,
    "sglang-inproc": sglang_inproc_messages,
    "vllm-smg": vllm_smg_messages,
    "vllm-entrypoint": vllm_entrypoint_messages,
}


# ---- servicers ------------------------------------------------------------------------------------


class _Base:
    def __init__(self, server: ReplayServer) -> None:
        self.s = server

    def _info_delay(self, context: Any) -> None:
        start = time.monotonic()
        while (  # bounded: by the delay, the call's end or the server's stop
            time.monotonic() - start < self.s.facts.info_delay_s
            and context.is_active()
            and not self.s.stopping.is_set()
        ):
            time.sleep(0.02)

    def _generate(self, request: Any, context: Any) -> Iterator[Any]:
        s = self.s
        s.record("Generate", request)
        plan = s.plan_for(request)
        yield from MESSAGES[s.dialect](request, plan)
        until = time.monotonic() + plan.hold_s
        while context.is_active() and not s.stopping.is_set() and time.monotonic() < until:  # bounded
            time.sleep(0.02)
        if plan.fail is not None:
            context.abort(*plan.fail)


class SglangReplay(_Base, sg_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        return self._generate(request, context)

    def HealthCheck(self, request: Any, context: Any) -> Any:
        self.s.record("HealthCheck", request)
        if self.s.facts.health_delay_s:
            time.sleep(self.s.facts.health_delay_s)  # SMG: ``await asyncio.sleep(1)`` before it looks
        return sg.HealthCheckResponse(healthy=True, message="Health check passed")

    def Abort(self, request: Any, context: Any) -> Any:
        self.s.record("Abort", request)
        return sg.AbortResponse(success=True)

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        self.s.record("GetModelInfo", request)
        self._info_delay(context)
        f = self.s.facts
        return sg.GetModelInfoResponse(
            model_path="replay",
            served_model_name="replay",
            is_generation=True,
            max_context_length=f.kv_pool_tokens,  # server.py: scheduler_info["max_total_num_tokens"]
            max_req_input_len=min(f.context_length, f.kv_pool_tokens) - 6,
            vocab_size=300,
        )

    def GetServerInfo(self, request: Any, context: Any) -> Any:
        self.s.record("GetServerInfo", request)
        self._info_delay(context)
        f = self.s.facts
        args = Struct()
        args.update({"context_length": f.context_length, "page_size": f.page_size})
        info = Struct()
        info.update({"max_total_num_tokens": f.kv_pool_tokens})
        return sg.GetServerInfoResponse(
            server_args=args,
            scheduler_info=info,
            sglang_version="replay",
            server_type="grpc",
            max_total_num_tokens=f.kv_pool_tokens,
        )

    def GetLoads(self, request: Any, context: Any) -> Any:
        self.s.record("GetLoads", request)
        if self.s.dialect == "sglang-inproc":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        f = self.s.facts
        return sg.GetLoadsResponse(
            dp_rank_count=1,
            loads=[sg.SchedulerLoad(num_running_reqs=f.running, max_total_num_tokens=f.kv_pool_tokens)],
        )

    def SubscribeKvEvents(self, request: Any, context: Any) -> Iterator[Any]:
        """SMG: live events only (``start_sequence_number`` is not read), numbered by the ZMQ
        publisher, one BlockStored per page; no load records."""
        self.s.record("SubscribeKvEvents", request)
        if self.s.dialect == "sglang-inproc":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield from self.s.kv_script(request)
        while context.is_active() and not self.s.stopping.is_set():  # stays open, as a live stream does
            time.sleep(0.05)


class VllmReplay(_Base, vl_grpc.VllmEngineServicer):  # type: ignore[misc]
    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        return self._generate(request, context)

    def HealthCheck(self, request: Any, context: Any) -> Any:
        self.s.record("HealthCheck", request)
        return vl.HealthCheckResponse(healthy=True, message="Health")

    def Abort(self, request: Any, context: Any) -> Any:
        self.s.record("Abort", request)
        return vl.AbortResponse()

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        self.s.record("GetModelInfo", request)
        self._info_delay(context)
        return vl.GetModelInfoResponse(
            model_path="replay",
            is_generation=True,
            max_context_length=self.s.facts.context_length,  # model_config.max_model_len
            vocab_size=300,
        )

    def GetServerInfo(self, request: Any, context: Any) -> Any:
        self.s.record("GetServerInfo", request)
        self._info_delay(context)
        return vl.GetServerInfoResponse(server_type="vllm-grpc")

    def GetLoads(self, request: Any, context: Any) -> Any:
        self.s.record("GetLoads", request)
        if self.s.dialect == "vllm-entrypoint":  # not in that servicer: grpc's default answer
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return vl.GetLoadsResponse(loads=[vl.SchedulerLoad(num_running_reqs=self.s.facts.running)])

    def SubscribeKvEvents(self, request: Any, context: Any) -> Iterator[Any]:
        self.s.record("SubscribeKvEvents", request)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield from ()


# ---- the server -----------------------------------------------------------------------------------


class ReplayServer:
    """One dialect's servicer on a loopback port (grpc's threaded server): ``plan`` says what the next
    Generate calls produce, ``kv_script`` what a KV event subscription streams."""

    def __init__(self, dialect: str, facts: EngineFacts | None = None) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: one of {DIALECTS}")
        self.dialect = dialect
        self.facts = facts or EngineFacts()
        self.plan: Plan | PlanFn = Plan([Choice([[65]])])
        self.kv_script: Callable[[Any], list[Any]] = lambda _req: []
        self.requests: list[tuple[str, Any]] = []
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        if dialect.startswith("sglang"):
            sg_grpc.add_SglangSchedulerServicer_to_server(SglangReplay(self), self._server)
        else:
            vl_grpc.add_VllmEngineServicer_to_server(VllmReplay(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def kind(self) -> str:
        return "sglang" if self.dialect.startswith("sglang") else "vllm"

    @property
    def url(self) -> str:
        return f"{self.kind}://127.0.0.1:{self.port}"

    def record(self, method: str, request: Any) -> None:
        with self.lock:
            self.calls[method] += 1
            self.requests.append((method, request))

    def generates(self) -> list[Any]:
        with self.lock:
            return [r for m, r in self.requests if m == "Generate"]

    def plan_for(self, request: Any) -> Plan:
        p = self.plan
        return p if isinstance(p, Plan) else p(self, request)

    def start(self) -> ReplayServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._server.stop(grace=None).wait(5)


def kv_batch(seq: int, *events: Any) -> Any:
    return common_pb2.KvEventBatch(sequence_number=seq, events=list(events))


def kv_pages_stored(hashes: list[int], parent: int | None, tokens: list[int], page: int) -> Any:
    """SMG _convert_kv_event: one KvBlock per page of ``page`` tokens."""
    blocks = [
        common_pb2.KvBlock(block_hash=h, token_ids=tokens[i * page : (i + 1) * page], block_size=page)
        for i, h in enumerate(hashes)
    ]
    stored = common_pb2.KvBlocksStored(blocks=blocks)
    if parent is not None:
        stored.parent_block_hash = parent
    return common_pb2.KvCacheEvent(stored=stored)


def kv_removed(hashes: list[int]) -> Any:
    return common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=hashes))
