"""Who is calling: the principal the auth layer puts on each request, read by admission and handlers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

Role = Literal["admin", "user"]


@dataclass(frozen=True, slots=True)
class Principal:
    subject: str  # key id, JWT "sub", client certificate name (mTLS), or "anonymous"
    tenant: str  # rate-limit and accounting unit
    role: Role
    key_id: str | None = None  # set when authenticated by an API key
    method: Literal["none", "api_key", "jwt", "mtls"] = "none"
    issuer: str = ""  # a JWT's "iss" (its subject is that issuer's name for the caller)
    models: tuple[str, ...] | None = None  # the models it may use (an API key's list); None: every one

    @property
    def owner(self) -> str:
        """Who owns what this principal stores (responses, conversations): its subject under how it
        authenticated, its tenant and a JWT's issuer, so that names from different sources (an API key
        id, a token's "sub", a certificate's name) or tenants never meet."""
        return json.dumps([self.method, self.tenant, self.issuer, self.subject], separators=(",", ":"))


# request[PRINCIPAL_KEY] holds the caller's Principal once the auth middleware has run
PRINCIPAL_KEY: web.RequestKey[Principal] = web.RequestKey("shepherd.principal", Principal)

ANONYMOUS = Principal(subject="anonymous", tenant="default", role="admin")


def principal_of(request: web.Request) -> Principal:
    """The request's principal; ANONYMOUS when no auth is configured (every caller is trusted)."""
    p = request.get(PRINCIPAL_KEY)
    return p if isinstance(p, Principal) else ANONYMOUS
