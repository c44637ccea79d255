"""The routes scripts written for vLLM, SGLang and SMG probe, in their shapes: ``/version``, ``/ping``,
``/get_model_info``, ``/get_server_info``, ``/generate`` (SGLang's native generation: text or
``input_ids``, ``sampling_params``, ``stream``; answers with ``text``, ``output_ids`` and
``meta_info``), ``/health_generate``, ``/flush_cache`` and ``/get_loads`` (SMG's ``FlushCacheResult``
and ``WorkerLoadsResult``; both control routes, as the worker URLs they name are).

Shapes read from sgl-project/sglang (``python/sglang/srt/entrypoints/http_server.py``: ``/generate``,
``/get_model_info``, ``/health_generate``, ``/flush_cache``), vllm-project/vllm
(``vllm/entrypoints/openai/api_server.py``: ``/version``, ``/ping``) and lightseekorg/smg
(``protocols/worker_spec.rs``: ``FlushCacheResult``, ``WorkerLoadsResult``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import importlib.metadata
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web

from shepherd.node.api.admin import can_serve
from shepherd.node.api.common import (
    GATEWAY,
    KEEPALIVE_TICKER,
    MODEL_KEY,
    STREAM_KEY,
    admitted,
    model_allowed,
    model_for,
    public_engine_message,
    request_id_of,
    stamp_headers,
)
from shepherd.node.api.generation import (
    CLIENT_DISCONNECT,
    GONE,
    SSE_HEADERS,
    abort_reason,
    closing_engine_call,
    engine_id,
    engine_sampling,
    final_delta_is_new,
    fresh_id,
    single_token_stops,
)
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.stream import EngineStream
from shepherd.node.http.body import json_response, read_json
from shepherd.node.http.types import stream_response
from shepherd.node.metrics import ModelMetrics
from shepherd.node.openai.logprobs import (
    sglang_prompt_logprobs,
    sglang_token_logprobs,
    sglang_top_logprobs,
)
from shepherd.node.openai.requests import MAX_TOP_LOGPROBS, Sampling, _bool, _int, parse_completion
from shepherd.node.openai.sse import KEEPALIVE
from shepherd.node.output.choice import ChoiceState
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    GenerateRequest,
    PromptChunk,
    TokenLogprob,
)
from shepherd.proto.openai_errors import ApiError, bad


def _version() -> str:
    try:
        return importlib.metadata.version("shepherd")
    except importlib.metadata.PackageNotFoundError:
        return "0"


VERSION = _version()


async def version(request: web.Request) -> web.Response:
    """vLLM's ``GET /version``: ``{"version": ...}`` (Shepherd's)."""
    return json_response({"version": VERSION})


async def ping(request: web.Request) -> web.Response:
    """vLLM's ``/ping`` (SageMaker): 200 with an empty body when a worker is healthy, else 503."""
    gw: Gateway = request.app[GATEWAY]
    ok = not gw.draining and can_serve(gw)
    return web.Response(status=200 if ok else 503)


def _model_of(request: web.Request, gw: Gateway, given: object = None) -> str:
    """The model a native route is about: ``given`` (a body's ``model``), else ``?model=``, else the one the
    node serves (several: a 400 naming ``model``)."""
    name = given if given is not None else request.query.get("model")
    if name is None:
        if len(gw.models) != 1:
            raise bad("'model' is required: this node serves several models.", param="model")
        model = next(iter(gw.models))
        model_allowed(request, model)
        return model
    if not isinstance(name, str):
        raise bad("'model' must be a string.", param="model")
    return model_for(request, gw, name)


async def get_model_info(request: web.Request) -> web.Response:
    """SGLang's ``GET /get_model_info`` (never a filesystem path: the served name stands for it)."""
    gw: Gateway = request.app[GATEWAY]
    model = _model_of(request, gw)
    served = gw.served_name(model)
    return json_response(
        {
            "model_path": served,
            "tokenizer_path": served,
            "is_generation": gw.model_kind(model) != "embed",
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
            "max_context_length": gw.context_length(model),
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    """SGLang's ``GET /get_server_info``, as far as a gateway has one: the version, the models, the
    limits it enforces and the engines' loads (``internal_states``)."""
    gw: Gateway = request.app[GATEWAY]
    await gw.registry.loads_for_reading()  # (``internal_states``)
    ws = list(gw.registry.workers.values())
    models = gw.model_names()
    return json_response(
        {
            "version": VERSION,
            "server_type": "shepherd",
            "served_model_name": models[0] if len(models) == 1 else models,
            "models": [{"id": m, "context_length": gw.context_length(m)} for m in models],
            "context_length": gw.context_length(models[0]) if len(models) == 1 else None,
            "policy": gw.cfg.policy,
            "max_retries": gw.cfg.max_retries,
            "request_timeout_secs": gw.cfg.request_timeout_secs,
            "stream_interval": gw.cfg.stream_interval,
            "workers": {"total": len(ws), "healthy": sum(w.health.healthy for w in ws)},
            "internal_states": [
                {
                    "worker_id": w.id,
                    "model": w.model,
                    "num_running_reqs": w.load.running,
                    "num_waiting_reqs": w.load.waiting,
                    "token_usage": w.load.token_usage,
                }
                for w in ws
            ],
        }
    )


async def get_loads(request: web.Request) -> web.Response:
    """SMG's ``GET /get_loads`` (``WorkerLoadsResult``): each worker's load as the engine last reported
    it (running + waiting requests; -1: no report, e.g. an HTTP worker or one not yet polled); with what
    smg 1.13's server answers besides (``timestamp``, ``version``, ``dp_rank_count``, and each load's
    ``dp_rank``, ``num_running_reqs``, ``num_waiting_reqs``, ``token_usage``)."""
    gw: Gateway = request.app[GATEWAY]
    await gw.registry.loads_for_reading()
    loads = []
    ok = 0
    for w in gw.registry.workers.values():
        known = w.initialized and not w.is_http
        ok += known
        loads.append(
            {
                "worker": w.url,
                "worker_id": w.id,
                "worker_type": _worker_type(gw, w.id),
                "load": w.load.running + w.load.waiting if known else -1,
                "dp_rank": 0,
                "num_running_reqs": w.load.running,
                "num_waiting_reqs": w.load.waiting,
                "token_usage": w.load.token_usage,
            }
        )
    return json_response(
        {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": f"shepherd-{VERSION}",
            "dp_rank_count": 1,
            "loads": loads,
            "total_workers": len(loads),
            "successful": ok,
            "failed": len(loads) - ok,
        }
    )


def _worker_type(gw: Gateway, wid: str) -> str:
    pd = gw.pd
    if pd is not None:
        if wid in pd.prefill_ids:
            return "prefill"
        if wid in pd.decode_ids:
            return "decode"
    return "regular"


async def flush_cache(request: web.Request) -> web.Response:
    """``POST /flush_cache`` to every gRPC worker (their FlushCache RPC); SMG's ``FlushCacheResult``.
    200 when every worker flushed, else 500 with the failures (an engine with requests in flight
    refuses, as SGLang's does)."""
    gw: Gateway = request.app[GATEWAY]
    ws = list(gw.registry.workers.values())
    grpc_ws = [w for w in ws if not w.is_http]

    async def one(w: Any) -> tuple[bool, str]:
        flush = getattr(w.client, "flush_cache", None)
        if flush is None:
            return False, f"FlushCache is not supported by {w.client.kind} workers"
        try:
            return await flush()  # type: ignore[no-any-return]
        except (EngineError, TimeoutError, OSError) as e:
            return False, str(e)

    got = await asyncio.gather(*(one(w) for w in grpc_ws))
    successful = [w.url for w, (ok, _) in zip(grpc_ws, got, strict=True) if ok]
    failed = [[w.url, msg or "refused"] for w, (ok, msg) in zip(grpc_ws, got, strict=True) if not ok]
    http_n = len(ws) - len(grpc_ws)
    message = (
        f"Cache flushed on {len(successful)} of {len(grpc_ws)} gRPC workers"
        + (f" ({http_n} HTTP workers not flushed)" if http_n else "")
        + "."
    )
    body = {
        # smg 1.13's server's answer
        "status": "success" if not failed else "partial_success" if successful else "failed",
        "message": message,
        "workers_flushed": len(successful),
        "total_http_workers": http_n,
        "total_grpc_workers": len(grpc_ws),
        "total_zmq_workers_skipped": 0,
        "total_workers": len(ws),
        # SMG's FlushCacheResult
        "successful": successful,
        "failed": failed,
        "http_workers": http_n,
    }
    return json_response(body, 200 if not failed else 500)


# ---- /generate (SGLang native) -------------------------------------------------------------------

# SGLang sampling_params -> the OpenAI completions field that means the same (validated by its parser)
_SAMPLING_KEYS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "n": "n",
    "seed": "seed",
    "sampling_seed": "seed",
    "logit_bias": "logit_bias",
    "no_stop_trim": "include_stop_str_in_output",  # the stop string kept in the text (SGLang's name)
}
# accepted and without effect here: SGLang's own output switches
_SAMPLING_IGNORED = frozenset({"custom_params", "stream_interval"})
_SAMPLING_REFUSED = ("json_schema", "regex", "ebnf", "structural_tag")
# null in SGLang's sampling params is the field unset (its frontend sends every field it knows, null or not)
_SAMPLING_NULLABLE = frozenset({*_SAMPLING_REFUSED, "stop_regex"})
_GENERATE_KEYS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "rid",
        "model",
        "return_logprob",
        "return_text_in_logprobs",
        "logprob_start_len",
        "top_logprobs_num",
    }
)
# SGLang's GenerateReqInput fields that ask for nothing at the values here (their defaults), which its
# clients send on every call: ``sglang.bench_serving`` ``lora_path: null`` and ``logprob_start_len: -1``,
# the frontend's ``RuntimeEndpoint`` ``top_logprobs_num`` and ``logprob_start_len``, SMG parses them all.
# Accepted at these values; any other is a 400 naming the field.
_GENERATE_DEFAULTS: dict[str, tuple[object, ...]] = {
    "token_ids_logprob": (None,),
    "return_hidden_states": (None, False),
    "return_routed_experts": (None, False),
    "log_metrics": (None, True, False),
    "lora_path": (None,),
    "lora_id": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "input_embeds": (None,),
    "modalities": (None,),
    "session_params": (None,),
    "custom_logit_processor": (None,),
    "data_parallel_rank": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    # what a client that serializes a whole GenerateReqInput sends besides (null or false: unset)
    "session_id": (None,),
    "priority": (None,),
    "no_logs": (None, False),
    "background": (None, False),
    "extra_key": (None,),
    "custom_labels": (None,),
    "return_entropy": (None, False),
    "return_bytes": (None, False),
    "conversation_id": (None,),
    "routing_key": (None,),
    "routed_dp_rank": (None,),
    "cache_salt": (None,),
    "require_reasoning": (None, False),
    "return_prompt_token_ids": (None, False),
    "received_time": (None,),
    "max_thinking_tokens": (None,),
}


def _is_default(value: object, defaults: tuple[object, ...]) -> bool:
    """``value`` is one of ``defaults`` by type and value (``0`` is not ``False``, ``1.0`` not ``True``)."""
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


@dataclass(frozen=True, slots=True)
class _LogprobAsk:
    """SGLang's ``return_logprob`` and its companions: the prompt's logprobs from ``start``
    (``logprob_start_len``; -1: none of the prompt's), ``top`` alternatives per position
    (``top_logprobs_num``), each token's text (``return_text_in_logprobs``)."""

    start: int
    top: int
    text: bool


def _logprob_ask(d: dict[str, Any]) -> _LogprobAsk | None:
    """The logprobs a /generate call asks for (None: ``return_logprob`` not true). The companions are
    checked either way, and without ``return_logprob`` ask nothing, as SGLang's."""
    on = _bool(d, "return_logprob", False)
    top = _int(d, "top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS) or 0
    start = _int(d, "logprob_start_len", -1, -1)
    text = _bool(d, "return_text_in_logprobs", False)
    return _LogprobAsk(-1 if start is None else start, top, text) if on else None


def _sampling(d: dict[str, Any]) -> tuple[Sampling, str | list[int], _LogprobAsk | None, bool]:
    """The request's prompt, its sampling (checked by the completions parser), the logprobs it asks and
    whether it asks no output (``max_new_tokens`` 0: SGLang's prefill alone, to warm the cache or to
    score the prompt with ``return_logprob``; its sampling reads ``max_tokens`` 1)."""
    unknown = sorted(
        k
        for k in set(d) - _GENERATE_KEYS
        if k not in _GENERATE_DEFAULTS or not _is_default(d[k], _GENERATE_DEFAULTS[k])
    )
    if unknown:
        raise bad(f"'{unknown[0]}' is not supported on /generate.", param=unknown[0])
    ask = _logprob_ask(d)
    text, ids = d.get("text"), d.get("input_ids")
    if (text is None) == (ids is None):
        raise bad("Exactly one of 'text' and 'input_ids' is required.", param="text")
    if text is not None and not isinstance(text, str):
        raise bad("'text' must be a string.", param="text")
    sp = d.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise bad("'sampling_params' must be an object.", param="sampling_params")
    stream = d.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be a boolean.", param="stream")
    for key in _SAMPLING_REFUSED:
        if sp.get(key) is not None:
            raise bad(
                f"'sampling_params.{key}' is not supported on /generate; use /v1/chat/completions "
                "(response_format) for constrained output.",
                param=f"sampling_params.{key}",
            )
    body: dict[str, Any] = {"prompt": text if text is not None else ids, "stream": bool(stream)}
    for key, val in sp.items():
        if key in _SAMPLING_IGNORED or (val is None and key in _SAMPLING_NULLABLE):
            continue
        mapped = _SAMPLING_KEYS.get(key)
        if mapped is None:
            raise bad(f"'sampling_params.{key}' is not supported.", param=f"sampling_params.{key}")
        if val is not None:
            body[mapped] = val
    stop = body.get("stop")  # SGLang takes an empty stop string (the OpenAI routes refuse it, as vLLM)
    if stop == "" or (isinstance(stop, list) and "" in stop):
        body["stop"] = [x for x in stop if x] if isinstance(stop, list) else None
    body.setdefault("max_tokens", 128)  # SGLang's default
    prefill_only = body["max_tokens"] == 0 and type(body["max_tokens"]) is int
    if prefill_only:
        body["max_tokens"] = 1  # (the engine is asked one token, which is not taken)
    # SGLang takes any temperature from 0 up (OpenAI's parser: at most 2): a hotter one is read as 2, then
    # set as sent
    given = body.get("temperature")
    hot: float | None = None
    if isinstance(given, int | float) and not isinstance(given, bool) and math.isfinite(given) and given > 2:
        hot = float(given)
        body["temperature"] = 2.0
    try:
        req = parse_completion(body)
    except ApiError as e:  # the completions parser's words: said in /generate's (its own field names)
        _native_names(e, "text" if text is not None else "input_ids")
        raise
    if len(req.prompts) != 1:  # (ids nested deeper than a batch's: one list of token ids a prompt)
        raise bad("Each prompt's 'input_ids' must be a list of token ids.", param="input_ids")
    sampling = req.sampling if hot is None else dataclasses.replace(req.sampling, temperature=hot)
    return sampling, req.prompts[0], ask, prefill_only


MAX_GENERATE_SAMPLES = 1024  # a call's prompts x n: each an engine request
# a batched call's fields that may hold one value per prompt (a list of the batch's length), as SGLang's
# ``GenerateReqInput.normalize_batch_and_arguments`` reads them
_PER_PROMPT = (
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


def _samples_of(sp: object) -> int:
    """``n`` of a call's ``sampling_params`` (SGLang's ``parallel_sample_num``): one for every prompt of
    a batch (a list of sampling params: the same ``n`` in each, as SGLang requires)."""
    given = (
        [x.get("n") for x in sp if isinstance(x, dict)]
        if isinstance(sp, list)
        else [sp.get("n") if isinstance(sp, dict) else None]
    )
    if any(v is not None and type(v) is not int for v in given):
        raise bad(
            f"'sampling_params.n' must be an integer from 1 to {MAX_GENERATE_SAMPLES}.",
            param="sampling_params.n",
        )
    ns = {1 if v is None else v for v in given}
    if len(ns) > 1:
        raise bad(
            "'sampling_params.n' must be the same for every prompt of a batch.", param="sampling_params.n"
        )
    n = ns.pop() if ns else 1
    if type(n) is not int or not 1 <= n <= MAX_GENERATE_SAMPLES:
        raise bad(
            f"'sampling_params.n' must be an integer from 1 to {MAX_GENERATE_SAMPLES}.",
            param="sampling_params.n",
        )
    return n


def _split(d: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str | None], int] | None:
    """A batched call (``text`` a list of strings, ``input_ids`` a list of id lists) or one asking more
    than one sample of its prompt (``sampling_params.n``), as SGLang takes them: each prompt as a call
    of its own (its fields, the per-prompt ones taken from their lists), each prompt's ``rid`` (a list
    of the batch's length, or one id suffixed ``_i``), and ``n``. None: a single call of one sample."""
    text, ids = d.get("text"), d.get("input_ids")
    key = "text" if isinstance(text, list) else "input_ids"
    prompts = (
        text
        if isinstance(text, list)
        else ids
        if isinstance(ids, list) and ids and isinstance(ids[0], list)
        else None
    )
    n = _samples_of(d.get("sampling_params"))
    if prompts is None:
        if n == 1:
            return None
        prompts, key = [text if text is not None else ids], ("text" if text is not None else "input_ids")
    elif text is not None and ids is not None:
        raise bad("Exactly one of 'text' and 'input_ids' is required.", param="text")
    if key == "input_ids" and any(
        not isinstance(x, list) or any(isinstance(t, list) for t in x) for x in prompts
    ):
        raise bad("Each prompt's 'input_ids' must be a list of token ids.", param="input_ids")
    size = len(prompts)
    if not size:
        raise bad(f"'{key}' is an empty batch.", param=key)
    if size * n > MAX_GENERATE_SAMPLES:
        raise bad(f"A call's prompts x n may not exceed {MAX_GENERATE_SAMPLES}.", param=key)
    rid = d.get("rid")
    if isinstance(rid, list):
        if len(rid) != size:
            raise bad(f"'rid' holds {len(rid)} ids for a batch of {size} prompts.", param="rid")
        rids: list[str | None] = list(rid)
    elif rid is None or isinstance(rid, str):
        rids = [None if rid is None else f"{rid}_{i}" for i in range(size)]
    else:
        raise bad("'rid' must be a string or a list of strings.", param="rid")
    items = []
    for i, prompt in enumerate(prompts):
        one = dict(d)
        one[key] = prompt
        one.pop("rid", None)
        for name in _PER_PROMPT:
            v = d.get(name)
            if isinstance(v, list):
                if len(v) != size:
                    raise bad(f"'{name}' holds {len(v)} values for a batch of {size} prompts.", param=name)
                one[name] = v[i]
        sp = one.get("sampling_params")
        if isinstance(sp, dict) and "n" in sp:
            one["sampling_params"] = {k: v for k, v in sp.items() if k != "n"}
        items.append(one)
    return items, rids, n


# the completions fields /generate's are read as -> /generate's own names (its errors name those)
_NATIVE_NAMES = {mapped: f"sampling_params.{key}" for key, mapped in _SAMPLING_KEYS.items()} | {
    "seed": "sampling_params.seed",
    "include_stop_str_in_output": "sampling_params.no_stop_trim",
}


def _native_names(e: ApiError, prompt: str) -> None:
    name = prompt if e.param == "prompt" else _NATIVE_NAMES.get(e.param or "")
    if name is None:
        return
    e.message = e.message.replace(f"'{e.param}'", f"'{name}'")
    e.args = (e.message,)
    e.param = name


MAX_RID_CHARS = 128


def _rid(given: object) -> str:
    """The request's ``rid`` (SGLang's): the client's, when given, in the engine's request id (after the
    call's own unique token); else a fresh one. It reaches the engine (its logs, its abort calls): a
    string of 1 to 128 printable characters, else a 400 (a newline, a NUL or a bidi override is no
    request id)."""
    if given is None:
        return fresh_id("gen-")
    if not isinstance(given, str) or not 0 < len(given) <= MAX_RID_CHARS or not given.isprintable():
        raise bad(f"'rid' must be a string of 1 to {MAX_RID_CHARS} printable characters.", param="rid")
    return given


def _meta(rid: str, st: ChoiceState, prompt: int, completion: int, cached: int, t0: float) -> dict[str, Any]:
    reason = st.finish_reason
    if reason is None:
        finish: dict[str, Any] | None = None
    elif reason == "length":
        finish = {"type": "length", "length": completion}
    elif reason == "abort":
        finish = {"type": "abort", "message": "aborted"}
    else:
        finish = {"type": "stop", "matched": st.matched}
    return {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "e2e_latency": time.perf_counter() - t0,
    }


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's ``POST /generate``: a prompt (``text`` or ``input_ids``), ``sampling_params``,
    ``stream``. The answer: ``{"text", "output_ids", "meta_info"}``; streamed, each SSE event carries
    the text and ids so far (SGLang's default, non-incremental), then ``data: [DONE]``. With
    ``return_logprob``: the output's logprobs (and the prompt's from ``logprob_start_len``) in
    ``meta_info`` as SGLang's, whole in every streamed event as its are. A batch (a list of prompts)
    or ``n`` above 1: a list of those answers, prompt by prompt and each prompt's samples in turn;
    streamed, each event is one sample's with its place in that list (``index``), as SGLang's."""
    gw: Gateway = request.app[GATEWAY]
    t0 = time.perf_counter()
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    model = _model_of(request, gw, d.get("model"))
    gw.require_kind(model, "generate")
    if gw.relay_mode(model):
        raise bad(f"Model '{model}' is served by HTTP workers; /generate needs gRPC engines.", param="model")
    split = _split(d)
    if split is None:
        one = await _prepared(gw, model, d, _rid(d.get("rid")))
        samples = [one]
    else:
        items, rids, n = split
        for item in items:  # every prompt's fields checked before any is tokenized
            _sampling(item)
        prompts = await asyncio.gather(
            *(_prepared(gw, model, item, _rid(rid)) for item, rid in zip(items, rids, strict=True))
        )
        samples = [
            p if n == 1 else dataclasses.replace(p, rid=fresh_id("gen-"), sampling=_nth(p.sampling, i))
            for p in prompts
            for i in range(n)
        ]
    request[MODEL_KEY] = model
    mm = gw.metrics.for_model(model, "generate")
    usage = {id(p.ids): _Usage(p.ids) for p in samples}  # what the call used: one prompt each, its samples
    first = samples[0]
    stream = first.sampling.stream
    s = first.sampling
    if split is not None:  # the reservation: every prompt once, n outputs of each (admission: n x prompts)
        n = split[2]
        s = dataclasses.replace(s, n=n, max_tokens=max(p.sampling.max_tokens or 0 for p in samples))

    async def run() -> web.StreamResponse:
        bounds = [_checked(request, gw, model, p) for p in samples]  # every sample's, before any is sent
        tok = gw.tokenizer(model)
        batch = _Batch(request, gw, model, samples, bounds, t0, mm, usage)
        if stream:
            request[STREAM_KEY] = True  # SMG's ``streaming`` label of the request count
        if split is not None:
            return await (_stream_batch(request, batch, tok, t0) if stream else _whole_batch(batch, tok))

        async def one(es: EngineStream, p: _Prepared, job: _Job) -> web.StreamResponse:
            if stream:
                return await _stream(request, es, p.rid, p.sampling, tok, job)
            return await _whole(es, p.rid, p.sampling, tok, job)

        return await batch.run(0, one)

    prompt_tokens = sum(len(u.ids) for u in usage.values())
    return await admitted(request, model, prompt_tokens, s, run, list(usage.values()))


def _nth(s: Sampling, i: int) -> Sampling:
    """Sample ``i``'s sampling of a prompt's ``n``: a seed made ``seed + i``, as vLLM seeds the children of
    a request (``ParentRequest``), so that seeded samples differ."""
    return s if s.seed is None or i == 0 else dataclasses.replace(s, seed=s.seed + i)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One prompt of a /generate call, checked and tokenized: its sampling, ids, the logprobs it asks,
    whether it asks no output (``max_new_tokens`` 0), the field its prompt came in and its ``rid``."""

    sampling: Sampling
    ids: list[int]
    ask: _LogprobAsk | None
    prefill_only: bool
    field: str
    rid: str


async def _prepared(gw: Gateway, model: str, d: dict[str, Any], rid: str) -> _Prepared:
    s, prompt, ask, prefill_only = _sampling(d)
    tok = gw.tokenizer(model)
    prompt_field = "text" if isinstance(prompt, str) else "input_ids"  # (what its context errors name)
    if isinstance(prompt, str):
        gw.check_prompt_chars(model, len(prompt), prompt_field)  # before any tokenizing: bounded work
        ids = await gw.tokenizers.encode(model, prompt)
    else:
        ids = list(prompt)
        if any(t < 0 or t >= tok.vocab_size for t in ids):
            raise bad(
                f"'input_ids' holds an id outside the vocabulary (size {tok.vocab_size}).", param="input_ids"
            )
    if not ids:
        raise bad("The prompt is empty.", param="text")
    if ask is not None and ask.start >= len(ids):
        raise bad(
            f"'logprob_start_len' ({ask.start}) must be lower than the number of prompt tokens ({len(ids)}).",
            param="logprob_start_len",
        )
    return _Prepared(s, ids, ask, prefill_only, prompt_field, rid)


def _checked(request: web.Request, gw: Gateway, model: str, p: _Prepared) -> int:
    """One sample's checks against the model (its context, its engines' facts): the tokens it may get.
    Every sample of a call is checked before any is sent."""
    s = p.sampling
    max_new = gw.check_context(model, len(p.ids), s.max_tokens, param=p.field)
    facts = gw.engine_facts(model, request.headers.get("x-smg-target-worker"))
    if s.min_tokens and facts.skip_tokenizer_init:
        raise bad(
            f"'sampling_params.min_new_tokens' is not supported by model '{model}': its SGLang workers "
            "run with --skip-tokenizer-init, which refuses a minimum output length.",
            param="sampling_params.min_new_tokens",
        )
    return max_new


async def _open(
    request: web.Request,
    gw: Gateway,
    model: str,
    p: _Prepared,
    max_new: int,
    t0: float,
    mm: ModelMetrics,
    usage: _Usage,
) -> tuple[EngineStream, _Job]:
    """The engine call of one sample of a /generate call (``max_new``: ``_checked``'s)."""
    s, ids, ask = p.sampling, p.ids, p.ask
    tok = gw.tokenizer(model)
    h = request.headers
    facts = gw.engine_facts(model, h.get("x-smg-target-worker"))  # the model's sampling defaults
    stops = single_token_stops(tok, s.stop, s.skip_special_tokens) if s.stop else ()
    sp = engine_sampling(s, s.max_tokens, gw.cfg.stream_interval, None, facts.defaults, stops)
    # an id of its own, its unique token first (SGLang aborts by id prefix: generation._engine_id)
    plp = ask.top if ask is not None and ask.start >= 0 else None  # (the whole prompt's: sliced here)
    gen = GenerateRequest(
        engine_id(p.rid),
        ids,
        sp,
        True,
        ask is not None,
        ask.top if ask is not None else 0,
        token_limit=max_new,
        prompt_logprobs=plp,
    )
    lps = _LogprobOut(ask, tok, ids) if ask is not None else None
    job = _Job(ids, t0, 0 if p.prefill_only else max_new, mm, usage.states, lps)
    es = await gw.open_stream(
        model, gen, target=h.get("x-smg-target-worker"), routing_key=h.get("x-smg-routing-key")
    )
    return es, job


@dataclass(frozen=True, slots=True)
class _Usage:
    """The prompt and the choice of a /generate call, as ``admission.tokens_used`` reads them (the rate
    limits' reservation is settled with the real usage)."""

    ids: list[int]
    states: list[ChoiceState] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Job:
    """One /generate call: its prompt, start, the tokens asked for (``limit``), the model's metric
    children for SMG's ``endpoint="generate"`` and where its choice goes (``_Usage.states``)."""

    ids: list[int]
    t0: float
    limit: int
    mm: ModelMetrics
    states: list[ChoiceState] = field(default_factory=list)
    logprobs: _LogprobOut | None = None


class _LogprobOut:
    """The logprob lists of a /generate call's ``meta_info``, as SGLang's (``sglang_*_logprobs``): the
    output's kept serialized as they grow (``take``: each entry once, though a streamed answer repeats
    the lists whole in every event, as SGLang's does), the prompt's from ``logprob_start_len`` once
    the engine sent them (``prompt``)."""

    __slots__ = ("ask", "ids", "prompt_fields", "taken", "text", "tokens", "tops")

    def __init__(self, ask: _LogprobAsk, tok: Any, ids: list[int]) -> None:
        self.ask = ask
        self.ids = ids
        self.text: Callable[[int], str] | None = _token_texts(tok) if ask.text else None
        self.tokens = bytearray()  # the output's entries so far, serialized, without the brackets
        self.tops = bytearray()
        self.taken = 0  # of the choice's logprobs
        self.prompt_fields: dict[str, Any] | None = None if ask.start >= 0 else _NO_PROMPT_LOGPROBS

    def prompt(self, batch: Sequence[EngineEvent]) -> None:
        """The prompt's lists, from the first event of ``batch`` that carries its logprobs."""
        if self.prompt_fields is not None:
            return
        for ev in batch:
            plp = ev.prompt_logprobs if isinstance(ev, PromptChunk | EngineComplete) else None
            if plp is not None:
                ask = self.ask
                tokens, tops = sglang_prompt_logprobs(plp, self.ids, ask.start, ask.top, self.text)
                self.prompt_fields = {
                    "input_token_logprobs": orjson.Fragment(orjson.dumps(tokens)),
                    "input_top_logprobs": orjson.Fragment(orjson.dumps(tops)),
                }
                return

    def take(self, st: ChoiceState) -> None:
        """The choice's logprobs not yet taken, serialized onto the lists."""
        new = st.logprobs[self.taken :]
        if not new:
            return
        self.taken = len(st.logprobs)
        _extend(self.tokens, orjson.dumps(sglang_token_logprobs(new, self.text)))
        if self.ask.top > 0:
            _extend(self.tops, orjson.dumps(sglang_top_logprobs(new, self.ask.top, self.text)))

    def fields(self, st: ChoiceState) -> dict[str, Any]:
        """``meta_info``'s logprob fields as of now (the output's through ``st``'s latest tokens)."""
        self.take(st)
        prompt = self.prompt_fields
        if prompt is None:
            if st.finished:  # an answer whose logprobs miss the prompt's would be silently wrong
                raise EngineError("the engine did not return the prompt's logprobs", retryable=False)
            prompt = _NO_PROMPT_LOGPROBS
        out = {
            "input_token_logprobs": prompt["input_token_logprobs"],
            "output_token_logprobs": orjson.Fragment(b"[" + self.tokens + b"]"),
        }
        if self.ask.top > 0:
            out["input_top_logprobs"] = prompt["input_top_logprobs"]
            out["output_top_logprobs"] = orjson.Fragment(b"[" + self.tops + b"]")
        return out


_NO_PROMPT_LOGPROBS: dict[str, Any] = {"input_token_logprobs": [], "input_top_logprobs": []}


def _extend(acc: bytearray, listed: bytes) -> None:
    """A serialized JSON list's items appended to ``acc``'s (items without their brackets)."""
    if len(listed) > 2:
        if acc:
            acc += b","
        acc += listed[1:-1]


def _token_texts(tok: Any) -> Callable[[int], str]:
    """A token's text as SGLang's ``return_text_in_logprobs`` gives it (the token decoded alone, its
    special tokens kept: ``tokenizer.batch_decode``), remembered for the call."""
    seen: dict[int, str] = {}

    def text(tid: int) -> str:
        got = seen.get(tid)
        if got is None:
            got = seen[tid] = tok.decode([tid], skip_special_tokens=False)
        return got

    return text


async def _drive(es: EngineStream, st: ChoiceState, out: list[int], job: _Job) -> tuple[str, int, int]:
    """Consume the engine stream into ``st`` (``out``: the output ids); yields nothing: see ``_events``."""
    text = []
    prompt = cached = 0
    async for piece, p, c in _events(es, st, out, job):
        text.append(piece)
        prompt, cached = p, c
    return "".join(text), prompt, cached


async def _events(
    es: EngineStream, st: ChoiceState, out: list[int], job: _Job
) -> AsyncIterator[tuple[str, int, int]]:
    """(text delta, prompt tokens, cached tokens) per engine batch until the choice ends. ``out`` gets the
    ids the choice counted (none past a stop or past ``job.limit``, the tokens asked for), as the
    generation loop takes them: a Complete's final delta when no chunk carried it (SGLang's in-tree
    server), an engine sending more than the limit cut there (``length``). The request's TTFT, durations
    and tokens go to ``job.mm`` (SMG's ``endpoint="generate"`` series)."""
    prompt = cached = 0
    seen = False
    got = 0  # chunk tokens received
    last: Sequence[int] = ()  # the last chunk's ids
    t_first = t_last = 0.0
    limit, mm, lps = job.limit, job.mm, job.logprobs
    async for batch in es.batches():
        if lps is not None:
            lps.prompt(batch)
        before = st.tokens
        delta = []
        for ev in batch:
            prompt = max(prompt, ev.prompt_tokens)
            cached = max(cached, ev.cached_tokens)
            if isinstance(ev, EngineChunk):
                seen = True
                got += len(ev.token_ids)
                last = ev.token_ids
                if not st.done():
                    delta.append(_take(st, ev.token_ids, ev.logprobs, out, limit, None))
                continue
            es.completed = True  # the engine ended it: nothing to abort
            if st.finished:
                continue
            new = ev.output_ids and (
                not seen or final_delta_is_new(ev.output_ids, ev.completion_tokens, got, last)
            )
            if not new:
                delta.append(st.end(ev.finish_reason))
            elif not seen:
                delta.append(_take(st, ev.output_ids, ev.logprobs, out, limit, ev.finish_reason))
            else:  # the last tokens came in the Complete only (SGLang's in-tree server)
                delta.append(_take(st, ev.output_ids, ev.logprobs, out, limit, None))
                delta.append(st.end(ev.finish_reason))
        now = time.perf_counter()
        if st.tokens > before:  # TTFT at the first token, then the time per token (chat's ``itl``)
            if t_first:
                mm.itl.observe((now - t_last) / (st.tokens - before))
            else:
                t_first = now
                mm.ttft.observe(now - job.t0)
            t_last = now
        if st.finished:
            mm.e2e.observe(now - job.t0)
            mm.generation.observe(now - (t_first or now))
            mm.prompt_tokens.value += prompt or len(job.ids)
            mm.completion_tokens.value += st.tokens
        yield "".join(delta), prompt, cached
        if st.finished:
            if type(st.matched) is int:  # a token the engine stops at too (EOS, stop_token_ids): no Abort
                es.completed = True
            return
    raise EngineError("the engine ended the stream before the choice finished", retryable=False)


def _take(
    st: ChoiceState,
    ids: Sequence[int],
    logprobs: Sequence[TokenLogprob],
    out: list[int],
    limit: int,
    whole: str | None,
) -> str:
    """Feed ``ids`` to ``st`` (``whole``: the engine's finish reason of an answer sent at once), the ids it
    counted to ``out``; past ``limit`` tokens (an engine sending more than asked) the choice ends there,
    ``length``."""
    runaway = st.tokens + len(ids) > limit
    if runaway:
        ids = ids[: max(limit - st.tokens, 0)]
        logprobs = logprobs[: len(ids)]
    if whole is not None:
        text = st.whole(ids, logprobs, "length" if runaway else whole) if ids else st.end("length")
    else:
        text = st.feed(ids, logprobs) if ids else ""
        if runaway and not st.finished:
            text += st.end("length")
    if ids:
        out.extend(ids[: st.kept])  # not the tokens after a stop (SGLang's ids end there)
    return text


async def _answer(es: EngineStream, rid: str, s: Sampling, tok: Any, job: _Job) -> dict[str, Any]:
    """One sample's whole answer: ``{"text", "output_ids", "meta_info"}``."""
    ids = job.ids
    st = ChoiceState(0, tok, s, ids)
    job.states.append(st)
    out: list[int] = []
    _, prompt, cached = await _drive(es, st, out, job)
    meta = _meta(rid, st, prompt or len(ids), st.tokens, cached, job.t0)
    if job.logprobs is not None:
        meta.update(job.logprobs.fields(st))
    return {"text": st.full_text(), "output_ids": out, "meta_info": meta}


async def _whole(es: EngineStream, rid: str, s: Sampling, tok: Any, job: _Job) -> web.Response:
    body = await _answer(es, rid, s, tok, job)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


class _Batch:
    """The samples of a /generate call (one, or a batch's, or its ``n``), each opened and driven on its own
    (``run``: its engine call opened, worked, closed whatever happens), so that each one's events go out
    as they come, not once every sample has started (an engine runs a few at once, the rest queue).
    ``why``: the abort reason of the samples a sibling's end cancels (the client left, unless a sibling
    failed)."""

    def __init__(
        self,
        request: web.Request,
        gw: Gateway,
        model: str,
        samples: Sequence[_Prepared],
        bounds: Sequence[int],
        t0: float,
        mm: ModelMetrics,
        usage: dict[int, _Usage],
    ) -> None:
        self.request, self.gw, self.model = request, gw, model
        self.samples, self.bounds = samples, bounds
        self.t0, self.mm, self.usage = t0, mm, usage
        self.why = CLIENT_DISCONNECT

    async def run(self, i: int, work: Callable[[EngineStream, _Prepared, _Job], Awaitable[_T]]) -> _T:
        p = self.samples[i]
        usage = self.usage[id(p.ids)]
        es, job = await _open(self.request, self.gw, self.model, p, self.bounds[i], self.t0, self.mm, usage)
        async with closing_engine_call(es, lambda: self.why):
            return await work(es, p, job)

    async def each(self, work: Callable[[EngineStream, _Prepared, _Job], Awaitable[_T]]) -> list[_T]:
        """``work`` on every sample at once, in the call's order; the first failure cancels the others
        (their engine calls closed with its reason) and is raised."""
        tasks = [asyncio.ensure_future(self.run(i, work)) for i in range(len(self.samples))]
        try:
            return await asyncio.gather(*tasks)
        except BaseException as e:
            if not isinstance(e, GONE):
                self.why = abort_reason(e)
            raise
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


_T = TypeVar("_T")


async def _whole_batch(batch: _Batch, tok: Any) -> web.Response:
    """A batch's (or ``n`` samples') answers, in the call's order; the first failure fails the call."""

    async def answer(es: EngineStream, p: _Prepared, job: _Job) -> dict[str, Any]:
        return await _answer(es, p.rid, p.sampling, tok, job)

    bodies = await batch.each(answer)
    return web.Response(body=orjson.dumps(bodies), content_type="application/json")


async def _stream(
    request: web.Request, es: EngineStream, rid: str, s: Sampling, tok: Any, job: _Job
) -> web.StreamResponse:
    resp = stream_response(request, headers=dict(SSE_HEADERS))
    ids, t0 = job.ids, job.t0
    stamp_headers(request, resp, t0)
    await resp.prepare(request)
    keepalive = request.app[KEEPALIVE_TICKER]
    ka = keepalive.register(resp, KEEPALIVE)
    st = ChoiceState(0, tok, s, ids)
    job.states.append(st)
    out: list[int] = []
    text: list[str] = []
    try:
        try:
            async for piece, prompt, cached in _events(es, st, out, job):
                text.append(piece)
                ka.touch()
                await resp.write(_event(rid, st, job, text, out, prompt, cached, None))
            await resp.write_eof(b"data: [DONE]\n\n")
        except _STREAM_FAILURES as e:
            await es.close(abort_reason(e))  # reported in-band below: the engine call ends with its reason
            await resp.write_eof(_failed(e))
    finally:
        keepalive.unregister(resp)
    return resp


_STREAM_FAILURES = (EngineError, ApiError, TimeoutError)


def _event(
    rid: str,
    st: ChoiceState,
    job: _Job,
    text: list[str],
    out: list[int],
    prompt: int,
    cached: int,
    index: int | None,
) -> bytes:
    """A streamed event: the sample's text and ids so far (``index``: its place in a batch's answers)."""
    meta = _meta(rid, st, prompt or len(job.ids), st.tokens, cached, job.t0)
    if job.logprobs is not None:
        meta.update(job.logprobs.fields(st))
    event: dict[str, Any] = {"text": "".join(text), "output_ids": list(out), "meta_info": meta}
    if index is not None:
        event["index"] = index
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _failed(e: BaseException) -> bytes:
    """The error event (then ``[DONE]``) that ends a stream whose engine call failed."""
    msg = e.message if isinstance(e, ApiError) else str(e) if isinstance(e, EngineError) else "timeout"
    err = {"error": {"message": msg, "code": getattr(e, "code", "timeout")}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"


_BATCH_QUEUE = 32  # a streamed batch's events waiting for the client, at most (then the samples wait)


async def _stream_batch(request: web.Request, batch: _Batch, tok: Any, t0: float) -> web.StreamResponse:
    """A batch's (or ``n`` samples') events as each sample's come, each with its ``index`` (SGLang's
    ``_stream_batch_responses``), then ``[DONE]``; the headers go out at once. A sample whose engine call
    fails ends the stream with the error event (the others' calls closed), as SGLang's. The samples'
    events pass through a short queue: a client that reads slowly holds the engines back, as one
    sample's stream does, rather than piling up events."""
    resp = stream_response(request, headers=dict(SSE_HEADERS))
    stamp_headers(request, resp, t0)
    await resp.prepare(request)
    keepalive = request.app[KEEPALIVE_TICKER]
    ka = keepalive.register(resp, KEEPALIVE)
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(_BATCH_QUEUE)

    async def pump(index: int) -> None:
        async def events(es: EngineStream, p: _Prepared, job: _Job) -> None:
            st = ChoiceState(0, tok, p.sampling, job.ids)
            job.states.append(st)
            out: list[int] = []
            text: list[str] = []
            async for piece, prompt, cached in _events(es, st, out, job):
                text.append(piece)
                await queue.put(_event(p.rid, st, job, text, out, prompt, cached, index))

        try:
            await batch.run(index, events)
        except Exception as e:  # (a failure of any kind ends the stream: no sample waited on forever)
            await queue.put(e)
            return
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(batch.samples))]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, BaseException):
                if not isinstance(got, _STREAM_FAILURES):
                    raise got
                batch.why = abort_reason(got)  # (the others' engine calls end with its reason)
                await resp.write_eof(_failed(got))
                return resp
            else:
                ka.touch()
                await resp.write(got)
        await resp.write_eof(b"data: [DONE]\n\n")
    except BaseException as e:
        if not isinstance(e, GONE):
            batch.why = abort_reason(e)
        raise
    finally:
        keepalive.unregister(resp)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return resp


async def _probe_models(gw: Gateway) -> tuple[int, dict[str, Any]]:
    """One token generated by a worker of each served model: (200, healthy) or (503, the first model
    that failed). HTTP-only models: a healthy worker is enough. The error names workers by id only."""
    for model in gw.model_names():
        if gw.relay_mode(model):
            if not any(w.health.healthy for w in gw.registry.for_model(model)):
                return 503, {"status": "unhealthy", "model": model}
            continue
        if gw.model_kind(model) == "embed":
            continue
        tok = gw.tokenizer(model)
        ids = [tok.bos_token_id if tok.bos_token_id is not None else 0]
        s = parse_completion({"prompt": ids, "max_tokens": 1, "temperature": 0}).sampling
        gen = GenerateRequest(engine_id("health"), ids, engine_sampling(s, 1, None), True, False, 0)
        try:
            async with asyncio.timeout(gw.cfg.health_check_timeout_secs + 8):
                es = await gw.open_stream(model, gen)
        except (EngineError, ApiError, TimeoutError) as e:
            msg = e.message if isinstance(e, ApiError) else str(e)
            if isinstance(e, TimeoutError):
                msg = f"no token within {gw.cfg.health_check_timeout_secs + 8:g} s"
            urls = [w.url for w in gw.registry.workers.values()]
            return 503, {
                "status": "unhealthy",
                "model": model,
                "error": public_engine_message(msg, urls)[:200],
            }
        es.completed = True  # its one token came: the engine ends it (max_tokens 1), no Abort for it
        await es.close("done")
    return 200, {"status": "healthy"}


class HealthGenerate:
    """SGLang's ``GET /health_generate``: one token generated by a worker of each served model (200), else
    503. The probe bypasses admission (it is a probe), so it runs once at a time per node: callers that
    arrive while one runs share its answer (any number of them cost the engines one generation per
    model, not one each; a caller that goes away does not cancel it for the others)."""

    def __init__(self) -> None:
        self._running: asyncio.Task[tuple[int, dict[str, Any]]] | None = None

    async def handle(self, request: web.Request) -> web.Response:
        task = self._running
        if task is None or task.done():
            probe = _probe_models(request.app[GATEWAY])
            task = self._running = asyncio.get_running_loop().create_task(probe)
            task.add_done_callback(_retrieved)
        status, body = await asyncio.shield(task)
        if status == 200:
            body = {**body, "request_id": request_id_of(request)}
        return json_response(body, status)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """(a probe every caller left: its outcome read, never logged as an exception nobody retrieved)"""
    if not task.cancelled():
        task.exception()


def routes() -> list[web.RouteDef]:
    return [
        web.get("/version", version),
        web.get("/ping", ping),
        web.post("/ping", ping),
        web.get("/get_model_info", get_model_info),
        web.get("/get_server_info", get_server_info),
        web.get("/server_info", get_server_info),
        web.get("/model_info", get_model_info),
        web.post("/generate", generate),
        web.put("/generate", generate),  # (SGLang serves both)
        web.get("/health_generate", HealthGenerate().handle),  # (one probe per app)
        web.post("/flush_cache", flush_cache),
        web.post("/reset_prefix_cache", flush_cache),  # vLLM's name for it
        web.get("/get_loads", get_loads),
    ]
