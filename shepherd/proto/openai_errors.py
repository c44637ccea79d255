"""The OpenAI error envelope: ``ApiError`` and its HTTP answer.

Every part of the node that refuses a request (body reading, request parsing, auth, admission,
dispatch) raises an ``ApiError``; the error middleware and the auth middleware answer it with
``error_response``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

__all__ = ["ApiError", "bad", "error_response"]


class ApiError(Exception):
    """A request that ends in an error answer: the HTTP status and the OpenAI envelope's fields.

    Invariants: ``status`` is the HTTP status the client gets (4xx for the request's fault, 5xx for the
    gateway's or an engine's); ``envelope()`` is always ``{"error": {"message", "type", "param",
    "code"}}`` with those four keys; ``headers`` (e.g. ``Retry-After``, ``WWW-Authenticate``) go out
    with the answer. Raised anywhere on the request path, it is turned into the answer by the error
    middleware (or an SSE error event once a stream has started), so bad input never becomes a 500.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})  # e.g. Retry-After, WWW-Authenticate

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return orjson.dumps(self.envelope())


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_response(err: ApiError) -> web.Response:
    """The error in the OpenAI envelope, with the headers it carries."""
    return web.Response(
        status=err.status, body=err.body(), content_type="application/json", headers=err.headers or None
    )
