"""Request bodies: read with a size limit (413), decoded as a JSON object (400), and JSON answers.

A JSON body must say so: ``Content-Type: application/json`` (any parameters, e.g. ``; charset=utf-8``)
or another ``application/*+json`` type; anything else (``text/plain``, form types, none at all) is a 415
``unsupported_media_type``, as vLLM answers. This is what keeps a web page from POSTing to a node: a
browser sends ``application/json`` cross-origin only after a CORS preflight, which the node never
grants. The openai and anthropic SDKs send ``application/json``; ``curl -d`` sends
``application/x-www-form-urlencoded`` unless told ``-H 'content-type: application/json'`` (or ``--json``).

The errors are ``ApiError``s in the OpenAI envelope (``shepherd.proto.openai_errors``).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from aiohttp import web

from shepherd.node.http.types import lean_request
from shepherd.proto.openai_errors import ApiError, bad

__all__ = ["check_json_content_type", "json_now", "json_response", "parse_json_body", "read_json"]


def _is_json_type(value: str | None) -> bool:
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json":
        return True
    top, _, sub = media.partition("/")
    return top == "application" and sub.endswith("+json")


def check_json_content_type(request: web.Request) -> None:
    """Raise the 415 unless the request says its body is JSON."""
    ctype = request.headers.get("Content-Type")
    if ctype != "application/json" and not _is_json_type(ctype):  # (the SDKs' exact value first)
        raise ApiError(
            415,
            "Unsupported Media Type: send the JSON body with 'Content-Type: application/json'"
            + (f" (got {ctype.split(';', 1)[0].strip()[:80]!r})." if ctype else " (none was sent)."),
            code="unsupported_media_type",
        )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    return data


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    check_json_content_type(request)
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413, f"The request body is larger than the limit of {limit} bytes.", code="body_too_large"
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raw = None
    except web.HTTPUnsupportedMediaType as e:  # a Content-Encoding the server cannot decode (lean server)
        raise ApiError(415, e.text or e.reason, code="unsupported_content_encoding") from None
    except (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError) as e:
        # a body that does not decode as its Content-Encoding says, or framing cut short
        raise ApiError(
            400, f"The request body could not be read: {type(e).__name__}.", code="bad_body"
        ) from None
    if raw is not None and len(raw) <= limit:  # (a chunked body has no Content-Length to check first)
        return raw, parse_json_body(raw)
    raise ApiError(413, f"The request body is larger than the limit of {limit} bytes.", code="body_too_large")


def json_now(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]] | None:
    """``read_json`` without awaiting, for a body the lean server has already received whole and within
    ``limit`` (the common case); None otherwise: then ``await read_json(...)``."""
    lean = lean_request(request)
    if lean is None or (lean.content_length is not None and lean.content_length > limit):
        return None
    check_json_content_type(request)
    raw = lean.body_now()
    if raw is None or len(raw) > limit:
        return None
    return raw, parse_json_body(raw)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")
