"""``POST /v1/embeddings``: OpenAI embeddings over the engines' gRPC ``Embed`` RPC (SGLang and vLLM), or
relayed as is to OpenAI HTTP workers.

Input: a string, a list of strings, a list of token ids, or a list of token-id lists (``parse_embeddings``:
at most ``MAX_INPUTS``, none empty). ``encoding_format``: ``float`` (default) or ``base64`` (each vector
as little-endian float32 bytes, as OpenAI sends them). ``dimensions``: the vectors cut to that many
floats and renormalized, for models configured ``matryoshka: true``; any other model refuses it (400).
``user`` is accepted and not used. vLLM's ``truncate_prompt_tokens`` (each input cut to that many tokens,
-1: the context length) and ``add_special_tokens`` are honoured; ``normalize: false`` is a 400.

Order, so that nothing reaches an engine before the request is known to be served: parse (bounded),
resolve the model (404) and its kind (a generation-only model: 400), then either relay (HTTP workers)
or tokenize the strings (the tokenizer service: big ones in the pool), check every input against the
vocabulary and the context length and the sum against ``MAX_TOTAL_TOKENS`` (400), then under admission
(rate limits, no completion tokens) one Embed call per input, at most ``CONCURRENCY`` at once, each
through ``Gateway.embed`` (the model's policy, retries on another worker).
"""

from __future__ import annotations

import asyncio
import base64
import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from shepherd.node.api.common import ADMISSION, GATEWAY, MODEL_KEY, model_for, relay
from shepherd.node.api.generation import fresh_id
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import read_json
from shepherd.node.openai.requests import parse_sampling
from shepherd.proto.engine_types import EmbedResult
from shepherd.proto.openai_errors import bad

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_TOTAL_TOKENS = 300_000  # OpenAI's limit on the tokens of one request, all inputs together
CONCURRENCY = 64  # Embed calls of one request in flight at once

ENCODINGS = ("float", "base64")

# what admission reserves for an embeddings request: its prompt, no completion
_EMBEDDING = replace(parse_sampling({}, max_tokens_keys=("max_tokens",)), max_tokens=0)

Input = str | list[int]


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: list[Input]  # each a non-empty string or a non-empty list of token ids
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: each input cut to this many tokens (-1: the context length; a text as the tokenizer's own
    # truncation cuts it, its special tokens kept, token ids keep their last, as vLLM's slice)
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True  # vLLM's: a text's special tokens (BOS...) added by the tokenizer


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool: orjson gives exact ints


def _ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise bad(f"{where} is an empty list of token ids.", param="input", code="invalid_value")
    if not all(map(_is_int, value)):
        raise bad(f"{where} must hold integers only.", param="input", code="invalid_type")
    if min(value) < 0:
        raise bad(f"{where} holds a negative token id.", param="input", code="invalid_value")
    return value


def parse_inputs(inp: Any) -> list[Input]:
    """``input`` as a list of inputs, each a non-empty string or a non-empty list of token ids."""
    if isinstance(inp, str):
        if not inp:
            raise bad("'input' is an empty string.", param="input", code="invalid_value")
        return [inp]
    if not isinstance(inp, list):
        raise bad(
            "'input' must be a string, a list of strings, token ids or lists of token ids.",
            param="input",
            code="invalid_type",
        )
    if not inp:
        raise bad("'input' is an empty list.", param="input", code="invalid_value")
    first = inp[0]
    if _is_int(first):  # one input of token ids (its length is the context's to bound, not MAX_INPUTS)
        return [_ids(inp, "'input'")]
    if len(inp) > MAX_INPUTS:
        raise bad(
            f"'input' holds {len(inp)} items; at most {MAX_INPUTS}.", param="input", code="invalid_value"
        )
    if isinstance(first, str):
        if not all(isinstance(x, str) for x in inp):
            raise bad("'input' mixes strings with other values.", param="input", code="invalid_type")
        for i, x in enumerate(inp):
            if not x:
                raise bad(f"input[{i}] is an empty string.", param="input", code="invalid_value")
        return list(inp)
    if isinstance(first, list):
        out: list[Input] = []
        for i, x in enumerate(inp):
            if not isinstance(x, list):
                raise bad("'input' mixes lists with other values.", param="input", code="invalid_type")
            out.append(_ids(x, f"input[{i}]"))
        return out
    raise bad(
        "'input' must be a string, a list of strings, token ids or lists of token ids.",
        param="input",
        code="invalid_type",
    )


def parse_embeddings(d: dict[str, Any]) -> EmbeddingsRequest:
    """The request's fields, validated (bounded work: no tokenization)."""
    model = d.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string.", param="model", code="invalid_type")
    if "input" not in d:
        raise bad("'input' is required.", param="input", code="invalid_type")
    inputs = parse_inputs(d["input"])
    fmt = d.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise bad(
            f"'encoding_format' must be one of {', '.join(ENCODINGS)}.",
            param="encoding_format",
            code="invalid_value",
        )
    dims = d.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise bad("'dimensions' must be a positive integer.", param="dimensions", code="invalid_value")
    user = d.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string.", param="user", code="invalid_type")
    cut = d.get("truncate_prompt_tokens")
    if cut is not None and (not _is_int(cut) or not (cut == -1 or cut >= 1)):
        msg = "'truncate_prompt_tokens' must be -1 (the context length) or a positive integer."
        raise bad(msg, param="truncate_prompt_tokens", code="invalid_value")
    specials = d.get("add_special_tokens", True)
    if not isinstance(specials, bool):
        raise bad("'add_special_tokens' must be a boolean.", param="add_special_tokens", code="invalid_type")
    if d.get("normalize") not in (None, True):  # (the engines' Embed returns the model's vectors as they are)
        raise bad(
            "'normalize' must be true (or absent): the vectors are the engine's.",
            param="normalize",
            code="unsupported_parameter",
        )
    return EmbeddingsRequest(model, inputs, fmt, dims, user, cut, specials)


# ---- vectors ---------------------------------------------------------------------------------------------


def truncate(vec: Sequence[float], dims: int) -> list[float]:
    """The first ``dims`` floats, renormalized to unit length (Matryoshka representation)."""
    head = list(vec[:dims])
    norm = math.sqrt(math.fsum(x * x for x in head))
    if norm == 0.0:
        return head
    return [x / norm for x in head]


def encode_base64(vec: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI sends for ``encoding_format: base64``."""
    a = array("f", vec)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def embeddings_body(
    model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    b64 = encoding_format == "base64"
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_base64(v) if b64 else list(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


# ---- the route -----------------------------------------------------------------------------------------


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return fresh_id("embd-")


async def _tokenize(
    gw: Gateway, model: str, inputs: list[Input], cut: int | None = None, specials: bool = True
) -> list[list[int]]:
    """Every input as ids: strings through the tokenizer service (inline when small, else in the pool),
    ids checked against the vocabulary; each cut to ``cut`` tokens when asked (``truncate_prompt_tokens``),
    within the context length, all within MAX_TOTAL_TOKENS."""
    vocab = gw.tokenizer(model).vocab_size
    ctx = gw.context_length(model)
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    out: list[list[int]] = [x if isinstance(x, list) else [] for x in inputs]
    if texts:
        encoded = await asyncio.gather(*(gw.tokenizers.encode(model, t, specials) for _, t in texts))
        for (i, _), ids in zip(texts, encoded, strict=True):
            out[i] = ids
    if cut is not None:
        keep = ctx if cut == -1 else cut
        left = gw.tokenizer(model).config.get("truncation_side") == "left"
        for i, ids in enumerate(out):
            if len(ids) <= keep:
                continue
            x = inputs[i]
            if isinstance(x, list):
                out[i] = ids[-keep:]  # (vLLM's slice of a token-id prompt)
            else:
                content = await gw.tokenizers.encode(model, x, False) if specials else ids
                out[i] = _truncated(ids, content, keep, left)

    total = 0
    for i, ids in enumerate(out):
        if not ids:
            raise bad(f"input[{i}] encodes to no tokens.", param="input", code="invalid_value")
        if isinstance(inputs[i], list) and max(ids) >= vocab:
            raise bad(
                f"input[{i}] holds a token id outside the vocabulary (size {vocab}).",
                param="input",
                code="invalid_value",
            )
        if len(ids) > ctx:
            raise bad(
                f"This model's maximum context length is {ctx} tokens. However, input[{i}] has "
                f"{len(ids)} tokens. Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
        total += len(ids)
    if total > MAX_TOTAL_TOKENS:
        raise bad(
            f"The inputs hold {total} tokens together; at most {MAX_TOTAL_TOKENS} per request.",
            param="input",
            code="max_tokens_per_request",
        )
    return out


def _truncated(ids: list[int], content: list[int], keep: int, left: bool) -> list[int]:
    """A text's ids cut to ``keep`` as the tokenizer's own truncation cuts them (vLLM's tokenizer call
    with ``truncation=True, max_length``): its content tokens (``content``: the text without the special
    tokens ``ids`` has around it) cut on the tokenizer's ``truncation_side``, the specials kept (a BERT's
    ``[SEP]``, the end token a last-token-pooling model reads its vector from)."""
    n = len(content)
    at = next((k for k in range(len(ids) - n + 1) if ids[k : k + n] == content), -1) if n else -1
    if at < 0:
        return ids[-keep:] if left else ids[:keep]
    head, tail = ids[:at], ids[at + n :]
    room = max(keep - len(head) - len(tail), 0)
    kept = (content[n - room :] if room else []) if left else content[:room]
    return (head + kept + tail)[:keep] if room == 0 else head + kept + tail


async def _embed_all(
    gw: Gateway, model: str, rid: str, all_ids: list[list[int]], target: str | None, routing_key: str | None
) -> list[EmbedResult]:
    """One Embed call per input, at most CONCURRENCY at once; the first failure cancels the rest and is
    raised as it is."""
    sem = asyncio.Semaphore(CONCURRENCY)
    one = len(all_ids) == 1

    async def call(i: int, ids: list[int]) -> EmbedResult:
        async with sem:
            return await gw.embed(
                model, rid if one else f"{rid}-{i}", ids, target=target, routing_key=routing_key
            )

    if one:
        return [await call(0, all_ids[0])]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(call(i, ids)) for i, ids in enumerate(all_ids)]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def _run(
    request: web.Request, gw: Gateway, model: str, req: EmbeddingsRequest, all_ids: list[list[int]]
) -> web.StreamResponse:
    rid = _request_id(request)
    h = request.headers
    results = await _embed_all(
        gw, model, rid, all_ids, h.get("x-smg-target-worker"), h.get("x-smg-routing-key")
    )
    vectors: list[list[float]] = [r.embedding for r in results]
    if req.dimensions is not None:
        native = len(vectors[0])
        if req.dimensions > native:
            raise bad(
                f"'dimensions' is {req.dimensions}; model '{model}' gives {native}.",
                param="dimensions",
                code="invalid_value",
            )
        vectors = [truncate(v, req.dimensions) for v in vectors]
    prompt = sum(r.prompt_tokens for r in results)
    gw.metrics.tokens.labels(model, "prompt", "embeddings").inc(prompt)
    body = embeddings_body(model, vectors, prompt, req.encoding_format)
    return web.Response(
        body=orjson.dumps(body), content_type="application/json", headers={"x-request-id": rid}
    )


async def embeddings(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    raw, d = await read_json(request, gw.cfg.max_body_bytes)
    req = parse_embeddings(d)
    model = model_for(request, gw, req.model)
    request[MODEL_KEY] = model
    gw.require_kind(model, "embed")
    adm = request.app[ADMISSION]
    if gw.relay_mode(model):
        send = partial(relay, request, gw, model, raw, d, "/v1/embeddings", False)
        if adm is None:
            return await send()
        return await adm.guard(request, model, len(raw) // 4, _EMBEDDING, send)
    if req.dimensions is not None:
        mc = gw.models.get(model)
        if mc is None or not mc.matryoshka:
            raise bad(
                f"Model '{model}' does not support 'dimensions' (not configured matryoshka).",
                param="dimensions",
                code="invalid_value",
            )
    all_ids = await _tokenize(gw, model, req.inputs, req.truncate_prompt_tokens, req.add_special_tokens)
    run = partial(_run, request, gw, model, req, all_ids)
    if adm is None:
        return await run()
    return await adm.guard(request, model, sum(map(len, all_ids)), _EMBEDDING, run)


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/embeddings", embeddings)]
