"""Everything that is not generation: models, tokenize/detokenize, health probes, metrics, worker admin."""

from __future__ import annotations

from aiohttp import web

from shepherd.node.api.common import GATEWAY
from shepherd.node.config import ConfigError, check_worker_url, insecure_admin_in_effect
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import json_response, read_json
from shepherd.proto.openai_errors import ApiError, bad
from shepherd.tokens.chat_messages import ChatTemplateError


async def list_models(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    created = int(gw.started_at)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "shepherd",
            "root": name,  # vLLM shows the served model here; never a filesystem path
            "parent": None,
            "max_model_len": gw.context_length(name),
        }
        for name in gw.models
    ]
    return json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    model = gw.resolve_model(str(d.get("model", "default")))
    add_special = d.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad("'add_special_tokens' must be a boolean.", param="add_special_tokens")
    if "messages" in d:
        msgs = d["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise bad("'messages' must be a non-empty list.", param="messages")
        agp = d.get("add_generation_prompt", True)
        kwargs = d.get("chat_template_kwargs") or {}
        if not isinstance(agp, bool) or not isinstance(kwargs, dict):
            raise bad("'add_generation_prompt' must be a boolean and 'chat_template_kwargs' an object.")
        try:
            _, ids = await gw.tokenizers.render_and_encode(model, msgs, d.get("tools"), agp, False, kwargs)
        except ChatTemplateError as e:
            raise bad(f"Cannot render the chat template: {e}", param="messages") from None
    else:
        prompt = d.get("prompt")
        if not isinstance(prompt, str):
            raise bad("'prompt' (a string) or 'messages' is required.", param="prompt")
        ids = await gw.tokenizers.encode(model, prompt, add_special)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": gw.context_length(model)})


async def detokenize(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    model = gw.resolve_model(str(d.get("model", "default")))
    toks = d.get("tokens")
    tok = gw.tokenizer(model)
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise bad("'tokens' must be a list of integers.", param="tokens")
    if any(t < 0 or t >= tok.vocab_size for t in toks):
        raise bad(f"'tokens' holds an id outside the vocabulary (size {tok.vocab_size}).", param="tokens")
    skip = d.get("skip_special_tokens", False)
    if not isinstance(skip, bool):
        raise bad("'skip_special_tokens' must be a boolean.", param="skip_special_tokens")
    return json_response({"prompt": tok.decode(toks, skip_special_tokens=skip)})


def _any_healthy(gw: Gateway) -> bool:
    return any(w.health.healthy for w in gw.registry.workers.values())


async def liveness(request: web.Request) -> web.Response:
    return json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    if gw.draining:
        return json_response({"status": "draining"}, 503)
    if not _any_healthy(gw):
        return json_response({"status": "no healthy worker"}, 503)
    return json_response({"status": "ready"})


async def health(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    healthy = _any_healthy(gw) and not gw.draining
    body = {
        "status": "healthy" if healthy else "unhealthy",
        "draining": gw.draining,
        "in_flight": gw.in_flight,
        "workers": {
            "total": len(gw.registry.workers),
            "healthy": sum(w.health.healthy for w in gw.registry.workers.values()),
        },
    }
    if insecure_admin_in_effect(gw.cfg):  # unauthenticated control plane others can reach: say so
        body["insecure_admin"] = True
    return json_response(body, 200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    return web.Response(
        body=gw.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def list_workers(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    return json_response({"workers": [w.describe() for w in gw.registry.workers.values()]})


async def add_worker(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, 64 * 1024)
    url = d.get("url")
    if not isinstance(url, str):
        raise bad("'url' (a string) is required.", param="url")
    try:
        check_worker_url(url)
    except ConfigError as e:
        raise bad(str(e), param="url", code="invalid_worker_url") from None
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
    existed = known is not None
    w = await gw.registry.add(url, model)
    return json_response(w.describe(), 200 if existed else 201)


async def get_worker(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    w = gw.registry.find(request.match_info["worker_id"])
    if w is None:
        raise ApiError(404, "No such worker.", code="worker_not_found")
    return json_response(w.describe())


async def delete_worker(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    key = request.match_info.get("worker_id") or request.query.get("url", "")
    w = gw.registry.find(key)
    if w is None:
        raise ApiError(404, "No such worker.", code="worker_not_found")
    await gw.registry.remove(w.id)
    return json_response({"deleted": w.id, "url": w.url})


def routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/models", list_models),
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
        web.delete("/workers/{worker_id}", delete_worker),
        web.delete("/workers", delete_worker),
    ]
