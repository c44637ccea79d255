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


# A JSON array or object decodes to a Python object of 56 bytes and more (an empty list 56, a dict 64):
# 16 MB of "[]," decode to 470 MB and hold the event loop 1.6 s, where 16 MB of text is ~20 ms and its
# size again. A body over DENSE_FROM bytes may hold one "[" or "{" per DENSE_BYTES bytes at most (counted
# in C, strings included: an over-count, never an under-count): real requests carry text, numbers and a
# few containers a message or a schema node (a tool's schema ~1 per 15-20 bytes, token-id prompts one an
# array), so what a body can make stays a few times its size.
DENSE_FROM = 256 * 1024
DENSE_BYTES = 8


def _check_density(raw: bytes) -> None:
    if len(raw) <= DENSE_FROM:
        return
    most = len(raw) // DENSE_BYTES
    if raw.count(b"[") + raw.count(b"{") > most:
        raise bad(
            f"The request body holds more JSON arrays and objects than a body of its size may "
            f"({most}: one per {DENSE_BYTES} bytes).",
            code="invalid_json",
        )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad("The request body is empty; expected a JSON object.", code="invalid_json")
    _check_density(raw)
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
