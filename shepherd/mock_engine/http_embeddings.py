"""The mock engine's ``POST /v1/embeddings`` (OpenAI's shape), for relay tests and benchmarks.

Input: a string, a list of strings, token ids, or lists of token ids; each becomes ``embed_ids`` of its
ids (the vector the gRPC ``Embed`` gives for the same ids). ``encoding_format``: ``float`` or ``base64``
(little-endian float32); ``dimensions``: cut and renormalized. Answer:
``{object: "list", data: [{object: "embedding", index, embedding}], model, usage}``.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Any

from aiohttp import web

from shepherd.mock_engine.embeddings import embed_ids
from shepherd.mock_engine.engine import TokenizerLike
from shepherd.mock_engine.engine_config import EngineConfig
from shepherd.mock_engine.http_params import HttpError, error_response, json_object, json_response
from shepherd.mock_engine.stats import MockStats


def _inputs(inp: Any, tok: TokenizerLike) -> list[list[int]]:
    if isinstance(inp, str) and inp:
        return [list(tok.encode(inp))]
    if isinstance(inp, list) and inp:
        kinds = set(map(type, inp))
        if kinds == {str} and all(inp):
            return [list(tok.encode(s)) for s in inp]
        if kinds == {int}:
            return [inp]
        if kinds == {list} and all(x and set(map(type, x)) == {int} for x in inp):
            return [list(x) for x in inp]
    raise HttpError(
        400, "input must be a non-empty string, list of strings, token ids or lists of ids", "invalid_type"
    )


def _cut(vec: list[float], dims: int) -> list[float]:
    head = vec[:dims]
    norm = math.sqrt(math.fsum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _b64(vec: list[float]) -> str:
    a = array("f", vec)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


class EmbeddingsRoute:
    def __init__(self, config: EngineConfig, tokenizer: TokenizerLike, stats: MockStats) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.stats = stats

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/embeddings", self.embeddings)

    async def embeddings(self, request: web.Request) -> web.Response:
        self.stats.count_rpc("http.embeddings")
        cfg = self.config
        try:
            body = json_object(await request.read(), cfg.model)
            all_ids = _inputs(body.get("input"), self.tokenizer)
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise HttpError(400, "encoding_format must be float or base64", "invalid_value")
            dims = body.get("dimensions")
            if dims is not None and (type(dims) is not int or not 0 < dims <= cfg.embedding_dim):
                raise HttpError(400, f"dimensions must be in [1, {cfg.embedding_dim}]", "invalid_value")
            for ids in all_ids:
                if len(ids) > cfg.context_length:
                    raise HttpError(400, "an input is longer than the context", "context_length_exceeded")
        except HttpError as e:
            return error_response(e.status, e.message, e.code, e.param)
        data = []
        for i, ids in enumerate(all_ids):
            vec = embed_ids(ids, cfg.embedding_dim, cfg.seed)
            if dims is not None:
                vec = _cut(vec, dims)
            data.append(
                {"object": "embedding", "index": i, "embedding": _b64(vec) if fmt == "base64" else vec}
            )
        n = sum(map(len, all_ids))
        out = {
            "object": "list",
            "data": data,
            "model": cfg.model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
        return json_response(out)
