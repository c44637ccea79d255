"""The mock engine's pooling routes, in vLLM's request and answer shapes: ``POST /v1/rerank`` (and
``/rerank``), ``POST /v1/score`` (and ``/score``), ``POST /classify`` (and ``/v1/classify``).

The answers are deterministic: a score is read from a hash of what is scored (the same query and document
always score the same), token counts are the tokenizer's. Shapes (vLLM's ``RerankResponse``,
``ScoreResponse``, ``ClassificationResponse``):

- rerank: ``{id, model, usage: {total_tokens}, results: [{index, document: {text}, relevance_score}]}``,
  by score, best first, cut to ``top_n`` (when > 0); ``document`` left out when ``return_documents`` is
  false;
- score: ``{id, object: "list", created, model, data: [{index, object: "score", score}], usage}``, one
  score per (text_1, text_2) pair (a single text_1 pairs with every text_2; ``queries``/``documents`` is
  the newer spelling);
- classify: ``{id, object: "list", created, model, data: [{index, label, probs, num_classes}], usage}``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from shepherd.mock_engine.engine import TokenizerLike
from shepherd.mock_engine.http_params import HttpError, error_response, json_object, json_response
from shepherd.mock_engine.stats import MockStats

LABELS = ("negative", "positive")


def unit(*parts: str) -> float:
    """A number in [0, 1) fixed by ``parts``."""
    h = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise HttpError(400, f"'{name}' must be a string or a non-empty list of strings", "invalid_type", name)


class PoolingRoutes:
    """The pooling handlers of one mock engine (``model``: the name it serves)."""

    def __init__(self, model: str, tokenizer: TokenizerLike, stats: MockStats) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stats = stats
        self._ids = itertools.count(1)

    def add_to(self, router: web.UrlDispatcher) -> None:
        for path, handler in (
            ("/v1/rerank", self.rerank),
            ("/rerank", self.rerank),
            ("/v1/score", self.score),
            ("/score", self.score),
            ("/classify", self.classify),
            ("/v1/classify", self.classify),
        ):
            router.add_post(path, self._handled(path, handler))

    def _handled(
        self, path: str, fn: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            self.stats.count_rpc("http" + path.replace("/v1/", "/").replace("/", "."))
            try:
                out = fn(json_object(await request.read(), self.model))
            except HttpError as e:
                return error_response(e.status, e.message, e.code, e.param)
            return json_response(out)

        return handle

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _id(self, prefix: str) -> str:
        return f"{prefix}-mock-{next(self._ids)}"

    def _listed(self, kind: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
        """The envelope vLLM's score and classify answers share: ``data`` and the prompt tokens read."""
        return {
            "id": self._id(kind),
            "object": "list",
            "created": int(time.time()),
            "model": self.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    def rerank(self, body: Mapping[str, Any]) -> dict[str, Any]:
        query = body.get("query")
        if not isinstance(query, str):
            raise HttpError(400, "'query' must be a string", "invalid_type", "query")
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise HttpError(400, "'documents' must be a non-empty list", "invalid_type", "documents")
        texts = [d if isinstance(d, str) else d.get("text") if isinstance(d, dict) else None for d in docs]
        if not all(isinstance(t, str) for t in texts):
            raise HttpError(400, "each document must be a string or {text}", "invalid_type", "documents")
        top_n = body.get("top_n") or 0
        keep = body.get("return_documents", True) is not False
        q_tokens = self._tokens(query)
        results: list[dict[str, Any]] = []
        total = 0
        for i, t in enumerate(texts):
            assert isinstance(t, str)
            total += q_tokens + self._tokens(t)
            r: dict[str, Any] = {"index": i}
            if keep:
                r["document"] = {"text": t}
            r["relevance_score"] = unit("rerank", query, t)
            results.append(r)
        results.sort(key=lambda r: (-float(r["relevance_score"]), int(r["index"])))
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return {
            "id": self._id("rerank"),
            "model": self.model,
            "usage": {"total_tokens": total},
            "results": results,
        }

    def score(self, body: Mapping[str, Any]) -> dict[str, Any]:
        a, b = ("queries", "documents") if "queries" in body else ("text_1", "text_2")
        left, right = _texts(body.get(a), a), _texts(body.get(b), b)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise HttpError(400, f"'{a}' must hold one text or as many as '{b}'", "invalid_value", a)
        data = []
        tokens = 0
        for i, (x, y) in enumerate(zip(left, right, strict=True)):
            tokens += self._tokens(x) + self._tokens(y)
            data.append({"index": i, "object": "score", "score": unit("score", x, y)})
        return self._listed("score", data, tokens)

    def classify(self, body: Mapping[str, Any]) -> dict[str, Any]:
        inputs = _texts(body.get("input"), "input")
        data = []
        tokens = 0
        for i, text in enumerate(inputs):
            tokens += self._tokens(text)
            logit = 4 * unit("classify", text) - 2
            p1 = 1 / (1 + math.exp(-logit))
            probs = [1 - p1, p1]
            label = LABELS[1] if p1 >= 0.5 else LABELS[0]
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(LABELS)})
        return self._listed("classify", data, tokens)
