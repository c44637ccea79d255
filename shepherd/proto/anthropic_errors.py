"""The Anthropic error envelope: what the Messages API routes (``/v1/messages*``) answer instead of the
OpenAI one.

``{"type": "error", "error": {"type": <kind>, "message": <text>}}`` with Anthropic's statuses and kinds:
400 ``invalid_request_error``, 401 ``authentication_error``, 403 ``permission_error``, 404
``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 529 ``overloaded_error`` (the
node's 503s: no worker, a tokenizer pool failure, draining), 500 ``api_error`` (the node's 502s: an engine
failed; Anthropic documents no 502), other 5xx ``api_error`` (status kept).
Every refusal is still raised or built as an ``ApiError``; ``anthropic_error_response`` answers it in
this envelope and ``convert_body`` rewrites an OpenAI envelope already made (an answer a middleware or
the admission built), so the conversion is one rule keyed on the route's path prefix.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from shepherd.proto.openai_errors import ApiError

__all__ = [
    "DETAIL_CODES",
    "MESSAGES_PREFIX",
    "anthropic_body",
    "anthropic_error_response",
    "anthropic_kind",
    "anthropic_status",
    "convert_body",
    "failure_kind",
    "is_messages_path",
]

MESSAGES_PREFIX = "/v1/messages"

_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_TIMEOUT_CODES = frozenset({"timeout", "engine_timeout"})  # (an in-band failure's code: timeout_error)
# codes Anthropic answers with ``error.details`` (``{"error_code": code}``), what the SDK reads to recover:
# a ``thread`` (server-side conversation state) refused, its tool runner goes on sending the whole history
DETAIL_CODES = frozenset({"thread_unsupported_request"})


def is_messages_path(path: str) -> bool:
    """Whether a request path is one of the Messages API's (``/v1/messages``, ``/v1/messages/...``)."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


# the node's statuses Anthropic has no use of, as its documented ones: 503 (no worker, draining) 529
# overloaded; 502 (an engine failed, a worker unreachable) 500 api_error
_STATUSES = {503: 529, 502: 500}


def anthropic_status(status: int) -> int:
    """The status Anthropic answers for the node's ``status`` (503, unavailable: 529, overloaded; 502,
    an engine's failure: 500, Anthropic's internal error)."""
    return _STATUSES.get(status, status)


def anthropic_kind(status: int) -> str:
    """The error ``type`` of an (Anthropic) status."""
    kind = _KINDS.get(status)
    if kind is not None:
        return kind
    return "api_error" if status >= 500 else "invalid_request_error"


def failure_kind(code: str) -> str:
    """The error ``type`` of a stream that failed after its start (``event: error``), from the node's
    error ``code``: overloaded, timed out, or an API error."""
    if code in ("no_available_worker", "overloaded"):
        return "overloaded_error"
    return "timeout_error" if code in _TIMEOUT_CODES else "api_error"


def anthropic_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": anthropic_kind(anthropic_status(status)), "message": message}
    if code in DETAIL_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def anthropic_error_response(err: ApiError) -> web.Response:
    """``err`` in the Anthropic envelope, with its headers (Retry-After, WWW-Authenticate)."""
    return web.Response(
        status=anthropic_status(err.status),
        body=orjson.dumps(anthropic_body(err.status, err.message, err.code)),
        content_type="application/json",
        headers=err.headers or None,
    )


def convert_body(status: int, body: bytes) -> tuple[int, bytes] | None:
    """An OpenAI error envelope (``{"error": {"message", ...}}``) as the Anthropic one: (status, body);
    None when ``body`` is not an OpenAI envelope (already converted, or not an error)."""
    try:
        d = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(d, dict) or d.get("type") == "error":
        return None
    err = d.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    return anthropic_status(status), orjson.dumps(anthropic_body(status, err["message"]))
