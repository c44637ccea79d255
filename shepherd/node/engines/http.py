"""Relay to OpenAI-compatible HTTP workers (vLLM, SGLang, llama.cpp server ...).

The node does not tokenize for these: the request body goes through as it is (with the model name the
worker expects) and the response, SSE included, comes back as it arrives, without buffering.
"""

from __future__ import annotations

import aiohttp

from shepherd.proto.engine_types import EngineLoad, EngineUnavailable, ModelInfo, ServerInfo


class HttpRelayClient:
    kind = "http"

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=self._timeout, sock_connect=5.0),
                auto_decompress=False,
            )
        return self._session

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Start a POST to the worker; the caller streams and releases the response."""
        try:
            return await self.session().post(self.url + path, data=body, headers=headers)
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnavailable(f"HTTP worker {self.url} unreachable: {e}") from None

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            async with self.session().get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def model_info(self) -> ModelInfo:
        try:
            async with self.session().get(
                self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise EngineUnavailable(f"HTTP worker {self.url}: cannot list models: {e}") from None
        models = data.get("data") if isinstance(data, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            first = models[0]
            return ModelInfo(
                served_model_name=str(first.get("id", "")),
                max_context_length=int(first.get("max_model_len") or 0),
            )
        return ModelInfo()

    async def server_info(self) -> ServerInfo:
        return ServerInfo(kind="http")

    async def loads(self) -> EngineLoad:
        try:
            async with self.session().get(
                self.url + "/v1/loads", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                if r.status != 200:
                    return EngineLoad()
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return EngineLoad()
        loads = data.get("loads", []) if isinstance(data, dict) else []
        running = sum(int(x.get("num_running_reqs", 0)) for x in loads if isinstance(x, dict))
        waiting = sum(int(x.get("num_waiting_reqs", 0)) for x in loads if isinstance(x, dict))
        return EngineLoad(running=running, waiting=waiting)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
