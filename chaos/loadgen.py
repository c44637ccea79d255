"""The suite's client: an open-loop, bounded, async load generator that only knows the load balancer.

Requests are launched at a fixed rate (open loop: a stalled server does not slow the arrivals down), at most
``max_in_flight`` at once (a launch that finds the cap reached is counted as skipped, not queued). Each
request is retried once (``retries``) on any failure: a non-200 status, a timeout, a reset, an incomplete
stream. Every request's start, end, attempts and errors are recorded for the report.

It runs in its own thread with its own event loop, inside the client's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

import aiohttp
import orjson

from chaos.netns import enter_netns

MAX_RUN_S = 900.0  # a load generator never runs longer than this, whatever the caller does


@dataclass(frozen=True, slots=True)
class LoadSpec:
    url: str  # base URL of the load balancer
    rate: float = 40.0  # launches per second
    max_in_flight: int = 64
    stream_fraction: float = 0.25
    max_tokens: int = 16
    attempt_timeout_s: float = 10.0
    retries: int = 1
    model: str = "qwen3"
    conversations: int = 40  # distinct conversation prefixes (so caches and affinity see repeats)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    start: float  # time.monotonic()
    end: float
    stream: bool
    ok: bool
    attempts: int
    first_error: str | None  # None when the first attempt succeeded
    error: str | None  # the last error when the request failed

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class LoadGenerator:
    """``start()`` launches requests until ``stop()``; ``stop()`` waits (bounded) for those in flight."""

    def __init__(self, spec: LoadSpec, netns: str | None = None) -> None:
        self.spec = spec
        self.netns = netns
        self.records: list[RequestRecord] = []
        self.skipped = 0
        self.launched = 0
        self.abandoned = 0  # still in flight when stop() gave up waiting: counted as failed
        self.started_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # ---- thread side ------------------------------------------------------------------------------------

    def _body(self, index: int, stream: bool) -> bytes:
        conv = index % self.spec.conversations
        return orjson.dumps(
            {
                "model": self.spec.model,
                "messages": [
                    {"role": "system", "content": f"You are assistant {conv} of the chaos suite."},
                    {"role": "user", "content": f"Conversation {conv}, question {index}: tell me a story."},
                ],
                "max_tokens": self.spec.max_tokens,
                "temperature": 0.0,
                "stream": stream,
            }
        )

    async def _attempt(self, session: aiohttp.ClientSession, body: bytes, stream: bool) -> str | None:
        url = self.spec.url.rstrip("/") + "/v1/chat/completions"
        timeout = aiohttp.ClientTimeout(total=self.spec.attempt_timeout_s)
        try:
            async with session.post(
                url, data=body, headers={"content-type": "application/json"}, timeout=timeout
            ) as r:
                data = await r.read()
                if r.status != 200:
                    return f"http_{r.status}"
                if stream:
                    return None if b"data: [DONE]" in data else "stream_incomplete"
                d = orjson.loads(data)
                choices = d.get("choices") if isinstance(d, dict) else None
                if not choices or not isinstance(choices[0].get("message", {}).get("content"), str):
                    return "bad_body"
                return None
        except TimeoutError:
            return "timeout"
        except aiohttp.ServerDisconnectedError:
            return "disconnected"
        except aiohttp.ClientPayloadError:
            return "payload_error"
        except aiohttp.ClientConnectionError as e:
            return f"connect_error:{type(e).__name__}"
        except (aiohttp.ClientError, orjson.JSONDecodeError, ValueError) as e:
            return f"client_error:{type(e).__name__}"

    async def _one(self, session: aiohttp.ClientSession, index: int, stream: bool) -> None:
        body = self._body(index, stream)
        start = time.monotonic()
        first: str | None = None
        err: str | None = None
        attempts = 0
        for attempt in range(1 + self.spec.retries):
            attempts = attempt + 1
            err = await self._attempt(session, body, stream)
            if attempt == 0:
                first = err
            if err is None:
                break
        rec = RequestRecord(index, start, time.monotonic(), stream, err is None, attempts, first, err)
        with self._lock:
            self.records.append(rec)

    async def _run(self) -> None:
        spec = self.spec
        connector = aiohttp.TCPConnector(limit=spec.max_in_flight * 2, keepalive_timeout=5.0)
        tasks: set[asyncio.Task[None]] = set()
        stream_every = round(1 / spec.stream_fraction) if spec.stream_fraction > 0 else 0
        async with aiohttp.ClientSession(connector=connector) as session:
            self.started_at = t0 = time.monotonic()
            i = 0
            while not self._stop.is_set() and time.monotonic() - t0 < MAX_RUN_S:
                wait = t0 + i / spec.rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if len(tasks) >= spec.max_in_flight:
                    self.skipped += 1
                else:
                    stream = bool(stream_every) and i % stream_every == stream_every - 1
                    task = asyncio.create_task(self._one(session, i, stream))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self.launched += 1
                i += 1
            if tasks:
                bound = spec.attempt_timeout_s * (1 + spec.retries) + 5.0
                _, pending = await asyncio.wait(set(tasks), timeout=bound)
                self.abandoned = len(pending)
                for t in pending:
                    t.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.gather(*pending, return_exceptions=True)

    def _thread_main(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            asyncio.run(self._run())
        except BaseException as e:  # reported by stop()
            self._error = e

    # ---- caller side ------------------------------------------------------------------------------------

    def start(self) -> LoadGenerator:
        self._thread = threading.Thread(target=self._thread_main, name="smgc-loadgen", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[RequestRecord]:
        """Stop launching, wait for the requests in flight (bounded), return every record."""
        self._stop.set()
        if self._thread is not None:
            bound = self.spec.attempt_timeout_s * (1 + self.spec.retries) + 15.0
            self._thread.join(timeout=bound)
        if self._error is not None:
            raise RuntimeError(f"load generator failed: {self._error!r}") from self._error
        return self.snapshot()

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return sorted(self.records, key=lambda r: r.index)
