"""The control plane's own guard: which listener serves it, and no browser may drive it.

A node serves ``/workers*``, ``/admin/*``, ``/mesh/*`` and ``/metrics`` (the control routes,
``middleware.plane_of``) on its client port, or, with an admin listener (``admin_port``), on that
listener only: there the control routes answer and every data route is a 404, and on the client port
the control routes are a 404. The probes (``/health``, ``/liveness``, ``/readiness``) answer on both.

Browsers: a web page can make a visitor's browser send "simple" requests (a ``text/plain`` or form
POST, any GET) to a node on localhost or the LAN, and with DNS rebinding read the answers. So a control
route refuses with a 403 (in the OpenAI envelope):

- a request whose ``Origin`` is not one of ``admin_allowed_origins`` (exact ``scheme://host[:port]``;
  ``null`` is never allowed), ``cross_origin_refused``;
- a request without ``Origin`` that says ``Sec-Fetch-Site: cross-site`` or ``same-site`` (another port
  of localhost is the same site), ``cross_site_refused``;
- when the control listener is on loopback: a ``Host`` that is not a loopback literal, ``localhost``
  (or a name under ``.localhost``), the listener's own address or the host of an allowed origin,
  ``host_not_allowed`` (DNS rebinding: ``evil.example`` resolving to 127.0.0.1);
- when it is not, and the control plane is unauthenticated there (``--insecure-admin``) or
  ``admin_allowed_hosts`` is set: a ``Host`` name that is not one of ``admin_allowed_hosts`` (default:
  the listener's own address and this machine's host name), a loopback name or the host of an allowed
  origin, ``host_not_allowed``. A ``Host`` that is an IP address passes: DNS rebinding needs the
  attacker's name in ``Host``, and a browser sends an address only to that address's own origin.
  ``admin_allowed_hosts: ["*"]`` turns the check off.

Non-browser clients (curl, SDKs, Prometheus) send no ``Origin`` or ``Sec-Fetch-*`` header and pass.
JSON bodies must also say ``Content-Type: application/json`` (``shepherd.node.http.body``), which no
simple cross-origin request can.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from shepherd.auth.middleware import AuthFailure, request_planes

LOCAL_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost", "ip6-loopback"})
ANY_HOST = "*"  # an ``admin_allowed_hosts`` entry: every Host passes
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def is_loopback(host: str | None) -> bool:
    """``host`` (a listen address or a name) is only reachable from this machine. A wildcard or empty
    address is not; names other than localhost are not assumed to be."""
    if not host:
        return False
    h = host.strip().lower().strip("[]")
    if h in LOCAL_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lowercased, without a trailing slash."""
    return origin.strip().rstrip("/").lower()


def host_of(value: str) -> str:
    """The host of a ``Host`` header or an origin, without the port; IPv6 without brackets."""
    v = value.strip().lower()
    if "://" in v:
        v = v.split("://", 1)[1]
    v = v.split("/", 1)[0]
    if v.startswith("["):
        return v[1:].split("]", 1)[0]
    if v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def machine_names() -> set[str]:
    """This machine's host name (and its first label), lower case."""
    name = socket.gethostname().strip().lower().rstrip(".")
    return {name, name.split(".", 1)[0]} - {""}


@dataclass(frozen=True, slots=True)
class ControlGuard:
    allowed_origins: frozenset[str]
    allowed_hosts: frozenset[str] | None  # None: Host is not checked (``admin_allowed_hosts: ["*"]``)
    # a listener not on loopback: any IP address passes, names only those above or under a suffix here
    addresses_pass: bool = False
    suffixes: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        listener_host: str,
        allowed_origins: Iterable[str],
        allowed_hosts: Iterable[str] = (),
        *,
        unauthenticated: bool = False,
    ) -> ControlGuard:
        """The guard of a control listener on ``listener_host``. ``allowed_hosts`` (``admin_allowed_hosts``:
        names, ``.suffix`` names, addresses, or ``*``: no check) adds to a loopback listener's hosts. On a
        listener not on loopback the ``Host`` is checked against them when given, else, when the control
        plane is ``unauthenticated`` (``--insecure-admin``), against the listener's address and this
        machine's names; an authenticated one without ``allowed_hosts`` is not checked (a browser sends
        no bearer credential by itself, rebound or not)."""
        origins = frozenset(normalize_origin(o) for o in allowed_origins if o.strip())
        entries = [e.strip().lower().rstrip(".") for e in allowed_hosts if e.strip()]
        if ANY_HOST in entries:
            return cls(origins, None)
        names = {host_of(e) for e in entries if not e.startswith(".")}
        suffixes = tuple(e for e in entries if e.startswith("."))
        origin_hosts = {host_of(o) for o in origins}
        if is_loopback(listener_host):
            return cls(origins, frozenset({host_of(listener_host), *origin_hosts, *names}), False, suffixes)
        if not entries:
            if not unauthenticated:
                return cls(origins, None)
            own = host_of(listener_host)
            names = machine_names() | ({own} if own not in WILDCARDS else set())
        return cls(origins, frozenset(names | origin_hosts), True, suffixes)

    def _host_ok(self, host: str | None) -> bool:
        if self.allowed_hosts is None or host is None:  # no Host: HTTP/1.0, never a browser
            return True
        h = host_of(host).rstrip(".")
        return (
            h in self.allowed_hosts
            or is_loopback(h)
            or (self.addresses_pass and is_address(h))
            or any(h.endswith(s) for s in self.suffixes)
        )

    def refusal(self, headers: Mapping[str, str]) -> AuthFailure | None:
        """Why a request to a control route looks like a browser's that may not drive the node; None: ok."""
        origin = headers.get("Origin")
        if origin is not None:
            if normalize_origin(origin) not in self.allowed_origins:
                return AuthFailure(
                    403,
                    "Browser requests from this Origin may not use the control plane "
                    "(see admin_allowed_origins).",
                    "cross_origin_refused",
                )
        elif (headers.get("Sec-Fetch-Site") or "").strip().lower() in ("cross-site", "same-site"):
            return AuthFailure(
                403, "Cross-site browser requests may not use the control plane.", "cross_site_refused"
            )
        if not self._host_ok(headers.get("Host")):
            return AuthFailure(
                403,
                "The Host header does not name this node's control listener (DNS rebinding?); the "
                "operator may allow it with admin_allowed_hosts.",
                "host_not_allowed",
            )
        return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def local_port(request: web.Request) -> int | None:
    """The port of the listener the request came in on (None: the connection is gone)."""
    t = request.transport
    name = t.get_extra_info("sockname") if t is not None else None
    if isinstance(name, tuple) and len(name) >= 2 and isinstance(name[1], int):
        return name[1]
    return None


def make_control_middleware(
    guard: ControlGuard, *, admin_port: int | None, metrics_protected: bool = True
) -> Middleware:
    """The listener split (``admin_port``: None when the client port serves everything) and the browser
    guard of the control routes. Put it after the error middleware and before the auth middleware: a
    control route on the wrong listener is a 404 whatever the credential."""
    plane_for = request_planes(metrics_protected)

    @web.middleware
    async def control_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        _, plane = plane_for(request)
        if plane == "public":
            return await handler(request)
        if admin_port is not None and (plane == "control") != (local_port(request) == admin_port):
            raise web.HTTPNotFound()
        if plane == "control" and (refused := guard.refusal(request.headers)) is not None:
            return refused.response()
        return await handler(request)

    return control_middleware
