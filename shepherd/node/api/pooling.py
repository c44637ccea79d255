"""Pooling routes, relayed to OpenAI HTTP workers that serve them (vLLM's shapes): ``POST /v1/rerank``
(and ``/rerank``), ``POST /v1/score`` (and ``/score``), ``POST /classify`` (and ``/v1/classify``).

The node does not run these models' math: it checks just enough of the request to refuse what no
worker would serve (the OpenAI error envelope: a missing or mistyped field, nothing to score, more than
``MAX_ITEMS`` documents or inputs; the body size is capped by ``read_json``), resolves the model (404),
and relays the body as it is (``relay``: JSON answers only, size caps, no redirects, retried elsewhere
when a connection fails) to one HTTP worker of the model, picked by the model's policy, under admission
(prompt estimate: body bytes / 4, no completion tokens). A model without any HTTP worker gets a 400:
gRPC engines have no such service, and nothing is sent anywhere.

Shapes accepted: rerank ``{model, query, documents: [str | {text}], top_n?, return_documents?}``; score
``{model, text_1, text_2}`` or ``{model, queries, documents}`` (each a string or a list of strings, a
single left text paired with every right one, else as many on each side); classify
``{model, input: str | [str] | [int] | [[int]]}``. Other keys pass through to the worker unread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from shepherd.node.api.common import GATEWAY, MODEL_KEY, admitted, model_for, relay
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import read_json
from shepherd.node.openai.requests import parse_sampling
from shepherd.proto.openai_errors import ApiError, bad

MAX_ITEMS = 1024  # documents of a rerank, texts of a score side, inputs of a classify

# what admission reserves for a pooling request: its prompt, no completion
_POOLING = replace(parse_sampling({}, max_tokens_keys=("max_tokens",)), max_tokens=0)


def _model(d: dict[str, Any]) -> str:
    m = d.get("model")
    if not isinstance(m, str) or not m:
        raise bad("'model' is required and must be a string.", param="model", code="invalid_type")
    return m


def _count(n: int, name: str) -> None:
    if n == 0:
        raise bad(f"'{name}' is empty: nothing to score.", param=name, code="invalid_value")
    if n > MAX_ITEMS:
        raise bad(f"'{name}' holds {n} items; at most {MAX_ITEMS}.", param=name, code="invalid_value")


def _texts(value: Any, name: str) -> int:
    """How many texts ``value`` (a string or a list of strings) holds."""
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        _count(len(value), name)
        if all(isinstance(v, str) for v in value):
            return len(value)
    raise bad(f"'{name}' must be a string or a list of strings.", param=name, code="invalid_type")


def check_rerank(d: dict[str, Any]) -> None:
    if not isinstance(d.get("query"), str):
        raise bad("'query' is required and must be a string.", param="query", code="invalid_type")
    docs = d.get("documents")
    if not isinstance(docs, list):
        raise bad("'documents' is required and must be a list.", param="documents", code="invalid_type")
    _count(len(docs), "documents")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) and not (isinstance(doc, dict) and isinstance(doc.get("text"), str)):
            raise bad(
                f"documents[{i}] must be a string or an object with a string 'text'.",
                param="documents",
                code="invalid_type",
            )
    top_n = d.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise bad("'top_n' must be a non-negative integer.", param="top_n", code="invalid_value")
    if not isinstance(d.get("return_documents", False), bool):
        raise bad("'return_documents' must be a boolean.", param="return_documents", code="invalid_type")


def check_score(d: dict[str, Any]) -> None:
    a, b = ("queries", "documents") if "queries" in d or "documents" in d else ("text_1", "text_2")
    for key in (a, b):
        if key not in d:
            raise bad(f"'{key}' is required.", param=key, code="invalid_type")
    n_a, n_b = _texts(d[a], a), _texts(d[b], b)
    if n_a != 1 and n_a != n_b:
        raise bad(
            f"'{a}' must hold one text or as many as '{b}' ({n_b}); it holds {n_a}.",
            param=a,
            code="invalid_value",
        )


def check_classify(d: dict[str, Any]) -> None:
    inp = d.get("input")
    if isinstance(inp, str):
        if not inp:
            raise bad("'input' is empty: nothing to classify.", param="input", code="invalid_value")
        return
    if isinstance(inp, list):
        _count(len(inp), "input")
        if all(isinstance(x, str) for x in inp) or all(
            isinstance(x, int) and not isinstance(x, bool) for x in inp
        ):
            return
        if all(
            isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            for x in inp
        ):
            return
    raise bad(
        "'input' must be a string, a list of strings, token ids or lists of token ids.",
        param="input",
        code="invalid_type",
    )


NEED_HTTP = "rerank/score/classify need an HTTP worker serving them"


async def _pooled(
    check: Callable[[dict[str, Any]], None], upstream: str, request: web.Request
) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    raw, d = await read_json(request, gw.cfg.max_body_bytes)
    name = _model(d)
    check(d)
    model = model_for(request, gw, name)
    request[MODEL_KEY] = model
    workers = gw.registry.for_model(model)
    if workers and not any(w.is_http for w in workers):
        raise ApiError(
            400,
            f"Model '{model}' is served by gRPC workers only: {NEED_HTTP} (http:// worker URLs).",
            param="model",
            code="unsupported_endpoint",
        )
    send = partial(relay, request, gw, model, raw, d, upstream, False)
    return await admitted(request, model, len(raw) // 4, _POOLING, send)


# each route is relayed to the path vLLM serves it on


async def rerank(request: web.Request) -> web.StreamResponse:
    return await _pooled(check_rerank, "/v1/rerank", request)


async def score(request: web.Request) -> web.StreamResponse:
    return await _pooled(check_score, "/v1/score", request)


async def classify(request: web.Request) -> web.StreamResponse:
    return await _pooled(check_classify, "/classify", request)


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/rerank", rerank),
        web.post("/rerank", rerank),
        web.post("/v1/score", score),
        web.post("/score", score),
        web.post("/classify", classify),
        web.post("/v1/classify", classify),
    ]
