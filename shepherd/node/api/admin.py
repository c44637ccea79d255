"""Everything that is not generation: models, tokenize/detokenize, health probes, metrics, worker admin."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from shepherd.node.api.common import GATEWAY, audit, may_use, model_for, request_id_of, usable_models
from shepherd.node.api.openai import render_chat
from shepherd.node.cluster.worker_journal import WorkerJournal
from shepherd.node.config import ConfigError, check_worker_url, insecure_admin_in_effect, worker_endpoint
from shepherd.node.dispatch.circuit_breaker import BreakerState
from shepherd.node.dispatch.gateway import Gateway, model_not_found
from shepherd.node.dispatch.workers import Worker
from shepherd.node.http.body import json_response, read_json
from shepherd.node.metrics import merge_processes
from shepherd.node.openai.requests import check_chat_schemas, parse_chat_deferred
from shepherd.proto.anthropic_errors import anthropic_error_response
from shepherd.proto.openai_errors import ApiError, bad


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: OpenAI's list (vLLM's cards), or Anthropic's page when the request carries
    ``anthropic-version`` (what the ``anthropic`` SDK sends): ``anthropic_models``. Either lists only the
    models the caller may use (an API key's own list)."""
    gw: Gateway = request.app[GATEWAY]
    names = [name for name in gw.models if may_use(request, name)]  # (a key's own list)
    if ANTHROPIC_VERSION in request.headers:
        return anthropic_models(request, gw, names)
    return json_response({"object": "list", "data": [_model_card(gw, name) for name in names]})


async def get_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: one model in ``/v1/models``' shape (OpenAI's and vLLM's; Anthropic's
    ``ModelInfo`` with ``anthropic-version``); an unknown id is a 404 in the OpenAI envelope (Anthropic's
    ``not_found_error`` with ``anthropic-version``)."""
    gw: Gateway = request.app[GATEWAY]
    name = request.match_info["model_id"]
    anthropic = ANTHROPIC_VERSION in request.headers
    if name not in gw.models or not may_use(request, name):
        err = model_not_found(name, usable_models(request, gw))
        if anthropic:
            return _anthropic_error(request, err)
        raise err
    if anthropic:
        return _anthropic_json(request, _model_info(gw, name))
    return json_response(_model_card(gw, name))


# ---- Anthropic's Models API (``anthropic-version``) ----

ANTHROPIC_VERSION = "anthropic-version"
ANTHROPIC_LIMIT_MAX = 1000  # Anthropic's ``limit``: 1 to 1000, 20 by default
_LIFECYCLES = ("active", "deprecated", "retired")


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(int(ts), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _model_info(gw: Gateway, name: str) -> dict[str, Any]:
    """A model as Anthropic's ``ModelInfo``: ``created_at`` is when the node started serving it (a
    release date it does not know), the limits its context length."""
    context = gw.context_length(name)
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": _rfc3339(gw.started_at),
        "lifecycle": "active",
        "deprecated_at": None,
        "retires_at": None,
        "max_input_tokens": context,
        "max_tokens": context,
    }


def _anthropic_json(request: web.Request, body: dict[str, Any]) -> web.Response:
    """An Anthropic answer: with its ``request-id`` header (the SDK's ``_request_id``)."""
    resp = json_response(body)
    resp.headers["request-id"] = request_id_of(request)
    return resp


def _anthropic_error(request: web.Request, err: ApiError) -> web.Response:
    resp = anthropic_error_response(err)
    resp.headers["request-id"] = request_id_of(request)
    return resp


def _bad_param(request: web.Request, param: str, message: str) -> web.Response:
    return _anthropic_error(request, bad(f"{param}: {message}", param=param))


def anthropic_models(request: web.Request, gw: Gateway, names: list[str]) -> web.Response:
    """Anthropic's ``GET /v1/models`` page of ``names`` (in the node's order): ``limit`` (1-1000, 20),
    ``after_id`` (the models after that one) or ``before_id`` (the ``limit`` models right before it),
    ``lifecycle`` (the node's models are all ``active``: a filter without it lists none);
    ``{data, has_more, first_id, last_id}``, ``has_more`` in the direction of the cursor. Errors in
    Anthropic's envelope: a bad parameter (a cursor that names no listed model included) is a 400."""
    q = request.query
    raw_limit = q.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= ANTHROPIC_LIMIT_MAX:
        return _bad_param(request, "limit", f"expected an integer from 1 to {ANTHROPIC_LIMIT_MAX}.")
    lifecycle = q.getall("lifecycle[]", []) + q.getall("lifecycle", [])
    if any(v not in _LIFECYCLES for v in lifecycle):
        return _bad_param(request, "lifecycle", f"expected values of {list(_LIFECYCLES)}.")
    after, before = q.get("after_id"), q.get("before_id")
    if after is not None and before is not None:
        return _bad_param(request, "before_id", "cannot be combined with after_id.")
    if lifecycle and "active" not in lifecycle:
        names = []
    cursor = after if after is not None else before
    if cursor is not None and cursor not in names:
        param = "after_id" if after is not None else "before_id"
        return _bad_param(request, param, f"no model {cursor[:100]!r} in this list.")
    if after is not None:
        start = names.index(after) + 1
        page, has_more = names[start : start + limit], start + limit < len(names)
    elif before is not None:
        end = names.index(before)
        page, has_more = names[max(0, end - limit) : end], end - limit > 0
    else:
        page, has_more = names[:limit], limit < len(names)
    body = {
        "data": [_model_info(gw, name) for name in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }
    return _anthropic_json(request, body)


def _model_card(gw: Gateway, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(gw.started_at),
        "owned_by": "shepherd",
        "root": gw.served_name(name),  # vLLM shows the served model here; never a filesystem path
        "parent": None,
        "max_model_len": gw.context_length(name),
        # vLLM's card carries one permission object (OpenAI's old shape); clients that read it find it
        "permission": [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": int(gw.started_at),
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


# the chat request's fields that shape its prompt (the rest, sampling and answer fields, make no token);
# ``chat_template`` and a true ``add_special_tokens`` are refused as chat refuses them
TOKENIZE_CHAT_KEYS = (
    "messages",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "add_special_tokens",
)


# a batch of prompts or of id lists (SGLang's and SMG's ``/tokenize`` / ``/detokenize``): at most this many
MAX_TOKENIZE_BATCH = 2048


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's tokenize (``prompt`` or ``messages``: ``tokens``, ``count``, ``max_model_len``, ``token_strs``)
    and SGLang's and SMG's (``char_count``; ``prompt`` a list of strings: ``tokens`` a list of id lists,
    ``count`` and ``char_count`` lists)."""
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    model = model_for(request, gw, str(d.get("model", "default")))
    add_special = d.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad("'add_special_tokens' must be a boolean.", param="add_special_tokens")
    chars: int | None = None  # (SMG's ``char_count``, of a prompt given as text)
    if "messages" in d:
        # the prompt chat completions builds (vLLM's tokenize runs its chat's _preprocess_chat too): the
        # chat request's parsing of these fields (roles, content parts, legacy turns, their 400s) and its
        # rendering, so that ``count`` is that chat request's ``usage.prompt_tokens``
        req = parse_chat_deferred({k: d[k] for k in TOKENIZE_CHAT_KEYS if k in d})
        await check_chat_schemas(req)  # (the tools' schemas, as chat checks them)
        _, ids = await render_chat(gw, model, req)
    else:
        prompt = d.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) > MAX_TOKENIZE_BATCH:
                raise bad(f"'prompt' holds more than {MAX_TOKENIZE_BATCH} strings.", param="prompt")
            if d.get("return_token_strs", False) is not False:
                raise bad("'return_token_strs' takes one prompt, not a list.", param="return_token_strs")
            for p in prompt:  # (each before any tokenizing: bounded work)
                gw.check_prompt_chars(model, len(p), "prompt")
            batch = [await gw.tokenizers.encode(model, p, add_special) for p in prompt]
            return json_response(
                {
                    "tokens": batch,
                    "count": [len(ids) for ids in batch],
                    "char_count": [len(p) for p in prompt],
                    "max_model_len": gw.context_length(model),
                }
            )
        if not isinstance(prompt, str):
            raise bad("'prompt' (a string or a list of strings) or 'messages' is required.", param="prompt")
        gw.check_prompt_chars(model, len(prompt), "prompt")
        ids = await gw.tokenizers.encode(model, prompt, add_special)
        chars = len(prompt)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": gw.context_length(model)}
    if chars is not None:
        out["char_count"] = chars
    strs = d.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise bad("'return_token_strs' must be a boolean.", param="return_token_strs")
    if strs:  # vLLM's: the vocabulary's token strings (byte-level, as convert_ids_to_tokens gives them)
        hf = gw.tokenizer(model).hf
        out["token_strs"] = [hf.id_to_token(i) for i in ids]
    return json_response(out)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's detokenize (``prompt``) and SGLang's and SMG's (``text``): both fields, the same text;
    ``tokens`` a list of id lists (theirs): a list of texts in each."""
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    model = model_for(request, gw, str(d.get("model", "default")))
    toks = d.get("tokens")
    tok = gw.tokenizer(model)
    seqs: list[Any] = [toks]
    batch = isinstance(toks, list) and bool(toks) and all(isinstance(t, list) for t in toks)
    if batch and isinstance(toks, list):
        seqs = toks
    if not all(_ids(s) for s in seqs):
        raise bad("'tokens' must be a list of integers (or a list of such lists).", param="tokens")
    if len(seqs) > MAX_TOKENIZE_BATCH:
        raise bad(f"'tokens' holds more than {MAX_TOKENIZE_BATCH} lists.", param="tokens")
    if any(t < 0 or t >= tok.vocab_size for s in seqs for t in s):
        raise bad(f"'tokens' holds an id outside the vocabulary (size {tok.vocab_size}).", param="tokens")
    skip = d.get("skip_special_tokens", False)
    if not isinstance(skip, bool):
        raise bad("'skip_special_tokens' must be a boolean.", param="skip_special_tokens")
    texts = [tok.decode(s, skip_special_tokens=skip) for s in seqs]
    text: str | list[str] = texts if batch else texts[0]
    return json_response({"prompt": text, "text": text})


def _serving(gw: Gateway, w: Worker) -> bool:
    """Healthy and its circuit not open (an open circuit takes no request until its cool-down ends: a
    worker whose checks pass but whose every call fails serves nothing)."""
    return w.health.healthy and (
        w.breaker.state is not BreakerState.OPEN or w.breaker.allows(gw.registry.clock())
    )


def can_serve(gw: Gateway) -> bool:
    """A request can be served: a worker serving (``_serving``); with PD disaggregation (where every
    generation goes to a prefill and a decode worker of its model, and a gRPC worker of neither pool
    serves none), a prefill and a decode worker of one model both serving, or an HTTP worker serving."""
    serving = [w for w in gw.registry.workers.values() if _serving(gw, w)]
    pd = gw.pd
    if pd is None or not serving:
        return bool(serving)
    if any(w.is_http for w in serving):
        return True
    prefill = {w.model for w in serving if w.id in pd.prefill_ids}
    return any(w.model in prefill for w in serving if w.id in pd.decode_ids)


async def liveness(request: web.Request) -> web.Response:
    return json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    if gw.draining:
        return json_response({"status": "draining"}, 503)
    if not can_serve(gw):
        return json_response({"status": "no healthy worker"}, 503)
    return json_response({"status": "ready"})


async def health(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    healthy = can_serve(gw) and not gw.draining
    body = {
        "status": "healthy" if healthy else "unhealthy",
        "draining": gw.draining,
        "in_flight": gw.in_flight,
        "workers": {
            "total": len(gw.registry.workers),
            "healthy": sum(_serving(gw, w) for w in gw.registry.workers.values()),
        },
    }
    if insecure_admin_in_effect(gw.cfg):  # unauthenticated control plane others can reach: say so
        body["insecure_admin"] = True
    return json_response(body, 200 if healthy else 503)


# the specs of the workers added here through the API, kept across restarts (set by ``app.serve``)
WORKER_JOURNAL: web.AppKey[WorkerJournal] = web.AppKey("worker_journal")
# ``--procs N``: (this process's index, a call giving the sibling processes' expositions by index)
PROCS_METRICS: web.AppKey[tuple[str, Callable[[], Awaitable[dict[str, bytes]]]]] = web.AppKey("procs_metrics")


async def metrics(request: web.Request) -> web.Response:
    """The node's metrics; under ``--procs N`` every process's series, each with its ``proc`` label (the
    port's connections land on any process: a scrape of one process's figures alone would read as
    counter resets from one scrape to the next)."""
    gw: Gateway = request.app[GATEWAY]
    await gw.registry.loads_for_reading()  # (the engine-load gauges)
    body = gw.metrics.render()
    procs = request.app.get(PROCS_METRICS)
    if procs is not None:
        own, siblings = procs
        body = merge_processes({**(await siblings()), own: body})
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def describe(gw: Gateway, w: Worker) -> dict[str, Any]:
    """A worker as the admin API shows it: Shepherd's fields and SMG's ``WorkerInfo`` (its pool on a PD
    node: ``worker_type`` prefill / decode, a prefill worker's ``bootstrap_port``)."""
    d = w.describe()
    pd = gw.pd
    if pd is not None:
        if w.id in pd.prefill_ids:
            d["worker_type"] = "prefill"
            d["bootstrap_port"] = pd.bootstrap_ports.get(w.id)
        elif w.id in pd.decode_ids:
            d["worker_type"] = "decode"
    return d


async def list_workers(request: web.Request) -> web.Response:
    """SMG's ``WorkerListResponse``: ``workers``, ``total``, ``stats``."""
    gw: Gateway = request.app[GATEWAY]
    await gw.registry.loads_for_reading()  # (each worker's ``engine_load``)
    ws = [describe(gw, w) for w in gw.registry.workers.values()]
    by_type = {"regular": 0, "prefill": 0, "decode": 0}
    for d in ws:
        by_type[d["worker_type"]] += 1
    stats = {
        "total_workers": len(ws),
        "healthy_workers": sum(1 for d in ws if d["is_healthy"]),
        "total_models": len({d["model_id"] for d in ws}),
        "total_load": sum(d["load"] for d in ws),
        "by_type": by_type,
        # smg 1.13's server's
        "prefill_count": by_type["prefill"],
        "decode_count": by_type["decode"],
        "regular_count": by_type["regular"],
    }
    return json_response({"workers": ws, "total": len(ws), "stats": stats})


WORKER_TYPES = ("regular", "prefill", "decode")
RUNTIMES = ("sglang", "vllm")
_SPEC_KEYS = frozenset(
    {
        "url",
        "model_id",
        "model",
        "worker_type",
        "runtime_type",
        "runtime",
        "priority",
        "cost",
        "labels",
        "bootstrap_port",
        # SMG's spec fields set per model or node here: refused when set (_PER_MODEL), or the node's own
        # health settings apply (accepted)
        "api_key",
        "tokenizer_path",
        "reasoning_parser",
        "tool_parser",
        "chat_template",
        "health_check_timeout_secs",
        "health_check_interval_secs",
        "health_success_threshold",
        "health_failure_threshold",
        "max_connection_attempts",
        "dp_aware",
    }
)


# SMG's per-worker settings that are per model (or not supported) here: a 400 naming them when set
_PER_MODEL = {
    "api_key": "workers are reached without a per-worker API key",
    "tokenizer_path": "the tokenizer is the model's (--model-path, YAML models:, or the engine's)",
    "chat_template": "the chat template is the model's (--chat-template, YAML models:)",
    "reasoning_parser": "the reasoning parser is the model's (--reasoning-parser, YAML models:)",
    "tool_parser": "the tool-call parser is the model's (--tool-call-parser, YAML models:)",
    "dp_aware": "data-parallel-aware scheduling is not supported",
}


def _weights(d: dict[str, Any]) -> tuple[int | None, float | None, dict[str, str] | None]:
    """``priority``, ``cost`` and ``labels`` of a worker spec or update, checked (None: not given)."""
    priority = d.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority <= 2**32 - 1):
        raise bad("'priority' must be a non-negative integer.", param="priority")
    cost = d.get("cost")
    if cost is not None:
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost < float("inf"):
            raise bad("'cost' must be a non-negative number.", param="cost")
        cost = float(cost)
    labels = d.get("labels")
    if labels is not None:
        ok = isinstance(labels, dict) and len(labels) <= 64
        if not ok or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise bad("'labels' must be an object of at most 64 string values.", param="labels")
        if any(len(k) > 128 or len(v) > 1024 for k, v in labels.items()):
            raise bad("'labels': keys up to 128 characters, values up to 1024.", param="labels")
    return priority, cost, labels


async def add_worker(request: web.Request) -> web.Response:
    """``POST /workers``: Shepherd's ``{"url", "model_id"}`` or SMG's worker spec (``worker_type``
    regular / prefill / decode, ``runtime_type``, ``priority``, ``cost``, ``labels``,
    ``bootstrap_port``). Answers as smg 1.13's server does: 202 with ``Location: /workers/{id}`` and
    ``status: accepted``, ``worker_id``, ``url``, ``location``, ``message`` (the worker's first checks run
    on, as there), with SMG's ``WorkerApiResponse`` (``success``, ``worker``) and the worker's fields
    beside; a URL already registered is a 409 ``worker_exists`` naming its worker (smg's
    ``WORKER_ALREADY_EXISTS``: replace it with ``PUT /workers/{id}``, update it with ``PATCH``)."""
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, 64 * 1024)
    return await _added(request, await _add(gw, d), d)


async def _kept(request: web.Request) -> None:
    """An admin change of the workers answered once the journal has it (a restart right after keeps it)."""
    journal = request.app.get(WORKER_JOURNAL)
    if journal is not None:
        await journal.settled()


async def add_spec(gw: Gateway, d: dict[str, Any]) -> str:
    """A worker spec added as ``POST /workers`` adds it (a journaled one, at start): its worker's id."""
    return (await _add(gw, d)).id


async def _added(request: web.Request, w: Worker, spec: dict[str, Any]) -> web.Response:
    audit(request, "worker added", f"{w.id} {w.url} (model {w.model})")
    journal = request.app.get(WORKER_JOURNAL)
    if journal is not None:  # kept across this node's restarts (until removed)
        journal.added(w.id, spec)
        await journal.settled()
    info = describe(request.app[GATEWAY], w)
    location = f"/workers/{w.id}"
    body = {
        **info,
        "status": "accepted",  # (smg's; the worker's own state is ``worker.status``)
        "worker_id": w.id,
        "url": w.url,
        "location": location,
        "message": f"Worker {w.id} added.",
        "success": True,
        "worker": info,
    }
    resp = json_response(body, 202)
    resp.headers["Location"] = location
    return resp


async def add_worker_legacy(request: web.Request) -> web.Response:
    """SMG's older ``POST /add_worker?url=...`` (``model_id``, ``worker_type``, ``runtime_type``,
    ``bootstrap_port`` as query parameters too); answers as ``POST /workers``."""
    gw: Gateway = request.app[GATEWAY]
    q = request.query
    d: dict[str, Any] = {k: q[k] for k in ("url", "model_id", "worker_type", "runtime_type") if k in q}
    if "bootstrap_port" in q:
        if not q["bootstrap_port"].isdigit():
            raise bad("'bootstrap_port' must be a port number.", param="bootstrap_port")
        d["bootstrap_port"] = int(q["bootstrap_port"])
    return await _added(request, await _add(gw, d), d)


async def list_workers_legacy(request: web.Request) -> web.Response:
    """SMG's older ``GET /list_workers``: ``{"urls": [...]}``."""
    gw: Gateway = request.app[GATEWAY]
    return json_response({"urls": [w.url for w in gw.registry.workers.values()]})


async def remove_worker_legacy(request: web.Request) -> web.Response:
    """SMG's older ``POST /remove_worker?url=...``; answers as ``DELETE /workers/{id}``."""
    gw: Gateway = request.app[GATEWAY]
    return await _remove(request, _worker(gw, request.query.get("url", "")))


async def _add(gw: Gateway, d: dict[str, Any]) -> Worker:
    """Register the worker of a spec (checked; 400 naming a bad field) and return it. A URL registered
    already is a 409 ``worker_exists`` whatever the spec (nothing of the worker changes: ``PUT`` or
    ``PATCH /workers/{id}`` do that), as smg's ``WORKER_ALREADY_EXISTS``."""
    unknown = sorted(set(d) - _SPEC_KEYS)
    if unknown:
        raise bad(f"Unknown worker spec field {unknown[0]!r}.", param=unknown[0])
    for key, why in _PER_MODEL.items():
        if d.get(key) not in (None, False, ""):
            raise bad(f"'{key}' cannot be set per worker: {why}.", param=key)
    url = d.get("url")
    if not isinstance(url, str):
        raise bad("'url' (a string) is required.", param="url")
    try:
        check_worker_url(url)
    except ConfigError as e:
        raise bad(str(e), param="url", code="invalid_worker_url") from None
    wtype = d.get("worker_type") or "regular"
    if wtype not in WORKER_TYPES:
        raise bad(f"'worker_type' must be one of {', '.join(WORKER_TYPES)}.", param="worker_type")
    runtime = d.get("runtime_type") or d.get("runtime")
    key = "runtime_type" if d.get("runtime_type") else "runtime"
    if runtime is not None and runtime not in RUNTIMES:
        raise bad(f"'{key}' must be one of {', '.join(RUNTIMES)}.", param=key)
    port = d.get("bootstrap_port")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        raise bad("'bootstrap_port' must be a port number.", param="bootstrap_port")
    if port is not None and wtype != "prefill":
        raise bad("'bootstrap_port' is for prefill workers.", param="bootstrap_port")
    priority, cost, labels = _weights(d)
    scheme, _, rest = url.partition("://")
    if runtime is not None and scheme == "grpc":
        url = f"{runtime}://{rest}"  # the engine's kind, as the URL says it (no detection)
    elif runtime is not None and scheme in RUNTIMES and scheme != runtime:
        raise bad(f"'{key}' {runtime!r} contradicts the URL's scheme {scheme!r}.", param=key)
    if wtype != "regular":
        if gw.pd is None:
            raise bad(
                f"'worker_type' {wtype!r}: this node does not run PD disaggregation (--pd-disaggregation).",
                param="worker_type",
            )
        if scheme in ("http", "https"):
            raise bad("PD workers are gRPC engines.", param="worker_type")
    model = d.get("model_id") or d.get("model")
    if model is None:
        if len(gw.models) != 1:
            raise bad("'model_id' is required when the node serves several models.", param="model_id")
        model = next(iter(gw.models))
    if not isinstance(model, str) or model not in gw.models:
        raise ApiError(404, f"Unknown model {model!r}.", param="model_id", code="model_not_found")
    known = gw.registry.find(url)
    if known is not None and known.model != model:
        raise ApiError(
            409,
            f"Worker {url!r} is already registered for model {known.model!r}; remove it first.",
            param="model_id",
            code="worker_exists",
        )
    if known is not None and gw.pd is not None:  # the same URL in another role: not what was asked
        role = gw.pd.role_of(known.id)
        if role != wtype:
            raise ApiError(
                409,
                f"Worker {known.id} is registered as a {role} worker; remove it first to make it {wtype}.",
                param="worker_type",
                code="worker_exists",
            )
    if known is not None:
        raise ApiError(
            409,
            f"Worker already exists at URL {known.url!r} with ID {known.id}. Use PUT /workers/{known.id} to "
            f"replace or PATCH /workers/{known.id} to update.",
            param="url",
            code="worker_exists",
        )
    # the same engine under another spelling: one engine, one worker
    here = worker_endpoint(url)
    same = next((w for w in gw.registry.workers.values() if worker_endpoint(w.url) == here), None)
    if same is not None:
        raise ApiError(
            409,
            f"Worker {same.id} ({same.url}) is this engine already; remove it first to register it "
            f"as {url!r}.",
            param="url",
            code="worker_exists",
        )
    pool = gw.pd if wtype != "regular" else None  # (a PD worker: its pool)
    if pool is not None:
        pool.join_pool(url, wtype, port)  # before the registry: the pool's policy learns of it then
    try:
        w = await gw.registry.add(url, model)
    except BaseException:
        if pool is not None:
            pool.leave_pool(url)
        raise
    if pool is not None:
        mismatch = _pd_kind_mismatch(gw, w, wtype)
        if mismatch is not None:  # (taken out again: nothing routes to it meanwhile, the pool knew it first)
            await gw.registry.remove(w.id)
            pool.leave_pool(w.url)
            raise bad(mismatch, param="runtime_type", code="engine_kind_mismatch")
    _apply(w, priority, cost, labels)
    return w


def _pd_kind_mismatch(gw: Gateway, w: Worker, wtype: str) -> str | None:
    """Why a new PD worker cannot join (None: it can): the pools speak one protocol (SGLang's bootstrap
    or vLLM's KV transfer), and an engine of the other kind would fail the requests routed to it."""
    pd = gw.pd
    assert pd is not None
    kind = str(w.client.kind)
    if kind not in ("sglang", "vllm"):
        return None  # (not known yet: an engine still loading; its first requests tell)
    pool = pd.prefill_ids | pd.decode_ids
    others = {str(x.client.kind) for x in gw.registry.workers.values() if x.id in pool and x.id != w.id}
    others &= {"sglang", "vllm"}
    if not others or kind in others:
        return None
    return f"{wtype} worker {w.url} is a {kind} engine; this node's PD pools are {others.pop()} engines."


def _apply(w: Worker, priority: int | None, cost: float | None, labels: dict[str, str] | None) -> None:
    if priority is not None:
        w.priority = priority
    if cost is not None:
        w.cost = cost
    if labels is not None:
        w.labels = dict(labels)


def _worker(gw: Gateway, key: str) -> Worker:
    if not key:
        raise bad(
            "Name the worker: its id, or its URL in the 'url' query parameter.",
            param="url",
            code="missing_parameter",
        )
    w = gw.registry.find(key)
    if w is None:
        raise ApiError(404, "No such worker.", code="worker_not_found")
    return w


async def get_worker(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    w = _worker(gw, request.match_info["worker_id"])
    await gw.registry.loads_for_reading()  # (its ``engine_load``)
    return json_response(describe(gw, w))


async def update_worker(request: web.Request) -> web.Response:
    """``PUT`` / ``PATCH /workers/{id}``: SMG's ``WorkerUpdateRequest`` (``priority``, ``cost``,
    ``labels``); answers SMG's ``WorkerApiResponse``."""
    gw: Gateway = request.app[GATEWAY]
    w = _worker(gw, request.match_info["worker_id"])
    _, d = await read_json(request, 64 * 1024)
    unknown = sorted(set(d) - {"priority", "cost", "labels"})
    if unknown:
        raise bad(
            f"'{unknown[0]}' cannot be updated (priority, cost and labels can); remove and add the worker.",
            param=unknown[0],
        )
    _apply(w, *_weights(d))
    journal = request.app.get(WORKER_JOURNAL)
    if journal is not None:
        journal.updated(w.id, d)
    await _kept(request)
    audit(request, "worker updated", f"{w.id} {sorted(d)}")
    info = describe(gw, w)
    return json_response({"success": True, "message": f"Worker {w.id} updated.", "worker": info, **info})


async def delete_worker(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    return await _remove(
        request, _worker(gw, request.match_info.get("worker_id") or request.query.get("url", ""))
    )


async def _remove(request: web.Request, w: Worker) -> web.Response:
    """Out of routing at once; the requests it serves finish (``WorkerRegistry.remove``). Answers as smg
    1.13's server does, 202 with ``status: accepted``, ``worker_id``, ``message``, and SMG's
    ``WorkerApiResponse`` (``success``, ``worker``: the worker as it was) with ``deleted`` and ``url``
    beside."""
    gw = request.app[GATEWAY]
    info = describe(gw, w)
    await gw.registry.remove(w.id)
    if gw.pd is not None:
        gw.pd.leave_pool(w.url)
    audit(request, "worker removed", f"{w.id} {w.url} ({w.in_flight} requests in flight finish)")
    await _kept(request)
    return json_response(
        {
            "status": "accepted",
            "worker_id": w.id,
            "message": f"Worker {w.id} removed.",
            "success": True,
            "worker": info,
            "deleted": w.id,
            "url": w.url,
        },
        202,
    )


def routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model_id:.+}", get_model),
        web.post("/v1/tokenize", tokenize),
        web.post("/v1/detokenize", detokenize),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/health", health),
        web.get("/liveness", liveness),
        web.get("/readiness", readiness),
        web.get("/metrics", metrics),
        web.get("/workers", list_workers),
        web.post("/workers", add_worker),
        web.get("/workers/{worker_id}", get_worker),
        web.put("/workers/{worker_id}", update_worker),
        web.patch("/workers/{worker_id}", update_worker),
        web.delete("/workers/{worker_id}", delete_worker),
        web.delete("/workers", delete_worker),
        # SMG's older query-string admin
        web.post("/add_worker", add_worker_legacy),
        web.get("/list_workers", list_workers_legacy),
        web.post("/remove_worker", remove_worker_legacy),
    ]
