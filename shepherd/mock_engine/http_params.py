"""The request side of the mock engine's HTTP surface: a chat or completions body's parameters, parsed
and checked into ``Params`` (``parse_params``; a bad one raises ``HttpError``, the status and OpenAI error
fields to answer with), and the request's stop strings applied to the output text as it grows
(``StopText``). Also what every route of the surface (``http_api``, ``http_embeddings``,
``http_pooling``) reads and answers with: a body as JSON (``json_body``, ``json_object``), a JSON answer
(``json_response``) and an error's (``error_response``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from shepherd.mock_engine.outputs import OutputSpec

__all__ = [
    "HttpError",
    "Params",
    "StopText",
    "error_response",
    "json_body",
    "json_object",
    "json_response",
    "parse_params",
]

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
_JSON_HEADERS = {"Content-Type": "application/json"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return web.Response(status=status, body=orjson.dumps(body), headers=_JSON_HEADERS)


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), headers=_JSON_HEADERS)


def json_body(raw: bytes) -> Any:
    """A request body parsed as JSON; HttpError 400 when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise HttpError(400, f"invalid JSON: {e}", "invalid_json") from e


def json_object(raw: bytes, model: str) -> dict[str, Any]:
    """A request body that must be a JSON object, for the model served as ``model`` (or naming none);
    HttpError 400 or 404 otherwise."""
    body = json_body(raw)
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object", "invalid_type")
    asked = body.get("model")
    if asked is not None and asked != model:
        raise HttpError(404, f"The model `{asked}` does not exist.", "model_not_found", "model")
    return body


def _opt_int(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise HttpError(400, f"{name} must be an integer", "invalid_type", name)
        return v
    return None


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise HttpError(400, "stop must be a string or a list of strings", "invalid_type", "stop")


@dataclass(frozen=True, slots=True)
class Params:
    spec: OutputSpec
    n: int
    stream: bool
    include_usage: bool
    stops: tuple[str, ...]
    include_stop_str: bool
    logprobs: bool
    top_logprobs: int


def parse_params(body: Mapping[str, Any], chat: bool) -> Params:
    max_tokens = (
        _opt_int(body, "max_completion_tokens", "max_tokens") if chat else _opt_int(body, "max_tokens")
    )
    if max_tokens is not None and max_tokens < 0:
        raise HttpError(400, "max_tokens must be >= 0", "invalid_value", "max_tokens")
    n = _opt_int(body, "n")
    n = 1 if n is None else n
    if n < 1 or n > 128:
        raise HttpError(400, "n must be in [1, 128]", "invalid_value", "n")
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float) or isinstance(temperature, bool)
    ):
        raise HttpError(400, "temperature must be a number", "invalid_type", "temperature")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) for i in stop_ids):
        raise HttpError(400, "stop_token_ids must be a list of integers", "invalid_type", "stop_token_ids")
    seed = _opt_int(body, "seed")
    if chat:
        want_lp = bool(body.get("logprobs"))
        top = _opt_int(body, "top_logprobs") or 0
    else:
        lp = _opt_int(body, "logprobs")
        want_lp = lp is not None
        top = lp or 0
    opts = body.get("stream_options")
    return Params(
        spec=OutputSpec(
            max_new_tokens=max_tokens,
            min_new_tokens=_opt_int(body, "min_tokens") or 0,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=bool(body.get("ignore_eos", False)),
            greedy=temperature == 0,
            seed=seed,
        ),
        n=n,
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
        stops=_stops(body),
        include_stop_str=bool(body.get("include_stop_str_in_output", False)),
        logprobs=want_lp,
        top_logprobs=max(0, min(top, 20)),
    )


class StopText:
    """Stop strings over an incremental text: holds back what could be the start of a stop string."""

    __slots__ = ("_buf", "_emitted", "_hold", "_include", "_stops", "stopped")

    def __init__(self, stops: tuple[str, ...], include: bool) -> None:
        self._stops = stops
        self._include = include
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buf = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        start = max(0, len(self._buf) - self._hold)
        self._buf += delta
        best = -1
        best_stop = ""
        for s in self._stops:
            i = self._buf.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best, best_stop = i, s
        if best >= 0:
            self.stopped = True
            end = best + len(best_stop) if self._include else best
            out = self._buf[self._emitted : end]
            self._emitted = end
            return out
        safe = max(self._emitted, len(self._buf) - self._hold)
        out = self._buf[self._emitted : safe]
        self._emitted = safe
        return out

    def hit(self) -> bool:
        """Whether a stop string was found (a method: type narrowing must not outlive ``feed``)."""
        return self.stopped

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._buf[self._emitted :]
        self._emitted = len(self._buf)
        return out
