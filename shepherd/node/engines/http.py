"""Relay to OpenAI-compatible HTTP workers (vLLM, SGLang, llama.cpp server ...).

The node does not tokenize for these: the request body goes through as it is (with the model name the
worker expects) and the response, SSE included, comes back as it arrives, without buffering.

What a worker URL can make the node do is bounded: the URL is
scheme://host:port only (``check_worker_url``); redirects are never followed; a host name not listed by
name in ``worker_allow`` is resolved on every connection and only its allowed addresses are dialed
(``AllowResolver``: a name that re-binds elsewhere is never reached); what the node reads for itself
(``/v1/models``, ``/v1/loads``) is capped at ``INFO_MAX_BYTES``; the relay's own caps and content
types are ``RELAY_*`` below (``shepherd.node.api.common.relay``). Error messages name the worker by id,
never by URL: they reach clients.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult

from shepherd.node.config import WorkerAllow
from shepherd.node.observe import tracing
from shepherd.proto.engine_types import (
    EngineLoad,
    EngineTimeout,
    EngineUnavailable,
    ModelInfo,
    ServerInfo,
    worker_id,
)

log = logging.getLogger("shepherd.engines.http")

INFO_MAX_BYTES = 1 << 20  # /v1/models, /v1/loads: what the node reads for itself
RELAY_MAX_BYTES = 64 << 20  # a relayed answer read whole (not streamed)
RELAY_STREAM_MAX_BYTES = 1 << 30  # a relayed SSE stream, in all
RELAY_CONTENT_TYPES = frozenset({"application/json", "text/event-stream"})


class BodyTooLarge(Exception):
    """A worker's answer is over its cap."""


class AllowResolver(AbstractResolver):
    """Resolves as aiohttp does, then keeps only the addresses ``allow`` lets the node dial (none left:
    ``OSError``, a connect error): checked on every resolution, so DNS re-binding gains nothing. Names
    the operator listed by name and IP addresses (which aiohttp does not resolve) pass as they are."""

    def __init__(self, allow: WorkerAllow) -> None:
        self.allow = allow
        self._inner = aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if not self.allow.resolve_check(host):
            return found
        kept = [r for r in found if self.allow.address_allowed(r["host"])]
        if not kept:
            raise OSError(f"{host} resolves to no address worker_allow allows")
        return kept

    async def close(self) -> None:
        await self._inner.close()


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body of ``resp``, or ``BodyTooLarge`` once it is over ``cap`` bytes (declared or received)."""
    declared = resp.content_length
    if declared is not None and declared > cap:
        raise BodyTooLarge(f"{declared} bytes declared")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge(f"over {cap} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _int(v: Any) -> int:
    try:
        return max(0, int(v or 0))
    except (TypeError, ValueError, OverflowError):
        return 0


class HttpRelayClient:
    kind = "http"

    def __init__(self, url: str, timeout: float = 600.0, allow: WorkerAllow | None = None) -> None:
        self.url = url.rstrip("/")
        self.id = worker_id(url)
        self._timeout = timeout
        self._allow = allow
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            allow = self._allow
            resolver = AllowResolver(allow) if allow is not None and not allow.any else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, resolver=resolver),
                timeout=aiohttp.ClientTimeout(total=self._timeout, sock_connect=5.0),
                auto_decompress=False,
            )
        return self._session

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Start a POST to the worker; the caller streams and releases the response. Tracing on: a CLIENT
        span until the worker's answer starts, whose context goes in ``traceparent`` / ``tracestate``.
        The whole exchange, the answer's body included, is bounded by ``timeout`` (the node's
        ``request_timeout_secs``): no answer by then is an ``EngineTimeout``."""
        with tracing.client_stage(f"POST {path}", self.url) as span:
            if tracing.ENABLED:
                headers = tracing.inject(dict(headers))
            try:
                resp = await self.session().post(
                    self.url + path, data=body, headers=headers, allow_redirects=False
                )
            except (aiohttp.ClientError, OSError) as e:
                if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ClientError):
                    # the request's own deadline (``timeout``), not a connect failure: the worker has the
                    # request and may be working on it, so another worker is not asked (a 504)
                    log.info("HTTP worker %s (%s): no answer within %.0f s", self.id, self.url, self._timeout)
                    raise EngineTimeout(f"HTTP worker {self.id} did not answer in time.") from None
                log.info("HTTP worker %s (%s) unreachable: %s", self.id, self.url, e)
                raise EngineUnavailable(f"HTTP worker {self.id} is unreachable.") from None
            span.set("http.response.status_code", resp.status)
            return resp

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            async with self.session().get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def confirm_alive(self, timeout: float) -> None:
        """Nothing: HTTP/1.1 has no ping; a relayed request to a hung worker ends with its own timeout."""

    async def _get_json(self, path: str, timeout: float) -> Any:
        """The JSON body of a 200 answer to GET ``path`` (at most ``INFO_MAX_BYTES``); None otherwise."""
        async with self.session().get(
            self.url + path, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
        ) as r:
            if r.status != 200:
                return None
            raw = await read_capped(r, INFO_MAX_BYTES)
        return orjson.loads(raw)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        try:
            data = await self._get_json("/v1/models", timeout)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, BodyTooLarge) as e:
            log.info("HTTP worker %s (%s): cannot list models: %s", self.id, self.url, e)
            raise EngineUnavailable(f"HTTP worker {self.id}: cannot list its models.") from None
        models = data.get("data") if isinstance(data, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            first = models[0]
            name = first.get("id", "")
            return ModelInfo(
                served_model_name=name[:256] if isinstance(name, str) else "",
                max_context_length=_int(first.get("max_model_len")),
            )
        return ModelInfo()

    async def server_info(self, timeout: float = 5.0) -> ServerInfo:
        return ServerInfo(kind="http")

    async def loads(self) -> EngineLoad:
        try:
            data = await self._get_json("/v1/loads", 2.0)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, BodyTooLarge):
            return EngineLoad()
        loads = data.get("loads", []) if isinstance(data, dict) else []
        if not isinstance(loads, list):
            return EngineLoad()
        running = sum(_int(x.get("num_running_reqs")) for x in loads if isinstance(x, dict))
        waiting = sum(_int(x.get("num_waiting_reqs")) for x in loads if isinstance(x, dict))
        return EngineLoad(running=running, waiting=waiting)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
