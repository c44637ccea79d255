"""PD disaggregation in the mock: what a prefill-role engine saw, and a decode-role engine's check.

A prefill engine records each request it receives: by its SGLang bootstrap room and by its request
id (vLLM's ``remote_request_id``), with the prompt's length and digest; its HTTP surface serves
them (``GET /mock/pd/rooms/{room}``, ``GET /mock/pd/requests/{id}``): the stand-in for SGLang's
bootstrap server and NIXL's handshake. A decode engine asks the prefill side named by the request
(bootstrap host and port; or ``remote_host`` / ``remote_bootstrap_port`` of the KV transfer
parameters) and fails the request clearly, before any token, when the prefill never saw it or saw
another prompt. SGLang sends both halves at once, so the decode side waits a little for the room.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from shepherd.mock_engine.requests import MockRequest, MockRpcError

Fetch = Callable[[str], Awaitable[dict[str, Any] | None]]


def prompt_digest(prompt: tuple[int, ...]) -> int:
    """The same in every process (the hash of a tuple of ints is not salted)."""
    return hash(prompt)


@dataclass(frozen=True, slots=True)
class PrefillRecord:
    request_id: str
    prompt_tokens: int
    digest: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class PrefillLog:
    """The requests a prefill engine received, by room and by request id (the most recent ``keep``)."""

    def __init__(self, keep: int = 65_536) -> None:
        self._keep = keep
        self._rooms: OrderedDict[int, PrefillRecord] = OrderedDict()
        self._requests: OrderedDict[str, PrefillRecord] = OrderedDict()

    def record(self, req: MockRequest) -> None:
        rec = PrefillRecord(req.request_id, len(req.prompt), prompt_digest(req.prompt))
        self._requests[req.request_id] = rec
        if len(self._requests) > self._keep:
            self._requests.popitem(last=False)
        if req.bootstrap_room is not None:
            self._rooms[req.bootstrap_room] = rec
            if len(self._rooms) > self._keep:
                self._rooms.popitem(last=False)

    def room(self, room: int) -> PrefillRecord | None:
        return self._rooms.get(room)

    def request(self, request_id: str) -> PrefillRecord | None:
        return self._requests.get(request_id)


def _where(req: MockRequest) -> tuple[str, str, str]:
    """(prefill address, lookup URL, what is looked up) for a decode request; raises if it names none."""
    if req.bootstrap_room is not None and req.bootstrap_host:
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        return (
            addr,
            f"http://{addr}/mock/pd/rooms/{req.bootstrap_room}",
            f"bootstrap room {req.bootstrap_room}",
        )
    if req.kv_transfer_params_json is not None:
        try:
            kv = json.loads(req.kv_transfer_params_json)
            addr = f"{kv['remote_host']}:{int(kv['remote_bootstrap_port'])}"
            rid = str(kv["remote_request_id"])
        except (ValueError, KeyError, TypeError) as e:
            raise MockRpcError(
                "INVALID_ARGUMENT", f"kv_transfer_params do not name a prefill request ({e!r})"
            ) from None
        return addr, f"http://{addr}/mock/pd/requests/{rid}", f"remote request {rid!r}"
    raise MockRpcError(
        "FAILED_PRECONDITION",
        "decode-role engine: the request carries neither bootstrap parameters (SGLang) nor "
        "kv_transfer_params (vLLM)",
    )


async def verify_decode(req: MockRequest, fetch: Fetch, wait_s: float = 5.0, poll_s: float = 0.02) -> None:
    """Raise MockRpcError unless the prefill engine the request names computed this very prompt."""
    addr, url, what = _where(req)
    rec: dict[str, Any] | None = None
    for _ in range(max(1, int(wait_s / poll_s))):  # bounded: the prefill half may arrive a bit later
        rec = await fetch(url)
        if rec is not None:
            break
        await asyncio.sleep(poll_s)
    if rec is None:
        raise MockRpcError("FAILED_PRECONDITION", f"{what} is unknown to the prefill engine at {addr}")
    if rec.get("digest") != prompt_digest(req.prompt) or rec.get("prompt_tokens") != len(req.prompt):
        raise MockRpcError(
            "FAILED_PRECONDITION",
            f"{what}: the prefill engine at {addr} computed another prompt ({rec.get('prompt_tokens')} "
            f"tokens) than this decode request's ({len(req.prompt)} tokens)",
        )


class BootstrapClient:
    """``Fetch`` over HTTP: the record as JSON on 200, None on 404 or when the server cannot be reached."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str) -> dict[str, Any] | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    return None
                data: dict[str, Any] = await resp.json()
                return data
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
