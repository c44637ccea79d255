"""Cross-origin requests from browsers to the data plane (``--cors-allowed-origins``): off by default.

Off, a browser page of another origin cannot call the node: JSON routes require ``Content-Type:
application/json``, which needs a preflight the node does not grant (SECURITY.md: a page cannot drive a
node on ``localhost``). On, as vLLM's ``--allowed-origins`` and SMG's ``--cors-allowed-origins``:

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from an allowed origin
  is answered 204 with the methods, the headers it asked for (``Authorization`` among them: a wildcard
  does not cover it) and ``Access-Control-Max-Age``, before authentication (a preflight carries no
  credential);
- every answer to an allowed origin carries ``Access-Control-Allow-Origin`` (the origin, or ``*`` when
  any is allowed), ``Vary: Origin`` and the headers a client reads (``x-request-id``, ``request-id``,
  ``retry-after``, the rate-limit headers) in ``Access-Control-Expose-Headers``: whole answers, streams
  and errors alike (the server adds them to the response head: ``HEAD_EXTRA``);
- the control plane is never opened to another origin this way (its own ``--admin-allowed-origins``
  guard stands), nor is an origin not in the list (no CORS headers: the browser refuses the answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from shepherd.auth.control import normalize_origin
from shepherd.auth.middleware import plane_of
from shepherd.node.http.types import HEAD_EXTRA, add_head_extra

__all__ = ["make_cors_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED = (
    "x-request-id, request-id, retry-after, x-ratelimit-limit-requests, x-ratelimit-remaining-requests, "
    "x-ratelimit-reset-requests, x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, "
    "x-ratelimit-reset-tokens, x-smg-schema-violation"
)
MAX_AGE = "3600"
_MAX_REQUESTED = 1024  # the requested headers echoed back, at most this many characters


def make_cors_middleware(origins: Sequence[str], metrics_protected: bool = True) -> Middleware:
    """The middleware for ``origins`` (``scheme://host[:port]`` each, or ``*`` for any). Put it first:
    a preflight is answered before anything else runs."""
    any_origin = "*" in origins
    allowed = frozenset(normalize_origin(o) for o in origins if o != "*")

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None or plane_of(_route(request), metrics_protected) == "control":
            return await handler(request)
        if not any_origin and normalize_origin(origin) not in allowed:
            return await handler(request)
        allow = "*" if any_origin else origin
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            asked = request.headers.get("Access-Control-Request-Headers", "")[:_MAX_REQUESTED]
            headers = {
                "Access-Control-Allow-Origin": allow,
                "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": asked or "authorization, content-type",
                "Access-Control-Max-Age": MAX_AGE,
                "Vary": "Origin",
            }
            return web.Response(status=204, headers=headers)
        request[HEAD_EXTRA] = (
            ("Access-Control-Allow-Origin", allow),
            ("Vary", "Origin"),
            ("Access-Control-Expose-Headers", EXPOSED),
        )
        return await handler(request)

    return cors_middleware


def _route(request: web.Request) -> str:
    """The route a request names: its matched template, or its path (a preflight matches no route)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


async def apply_head_extra(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's server (``--http-server aiohttp``): ``HEAD_EXTRA`` added as the response is prepared
    (the lean server adds it itself)."""
    add_head_extra(request, response.headers)
