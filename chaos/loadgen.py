"""The suite's client: an open-loop, bounded, async load generator that only knows the load balancer.

Requests are launched at a fixed rate (open loop: a stalled server does not slow the arrivals down), at most
``max_in_flight`` at once (a launch that finds the cap reached is counted as skipped, not queued). Each
request is retried once (``retries``) on any failure: a non-200 status, a timeout, a reset, a stream that
did not end with ``[DONE]`` or that carried an error event (``stream_outcome``).
Every request's start, end, attempts and errors are recorded for the report. With ``targets`` the requests
go round-robin straight to those base URLs (a retry to the next one) instead of the load balancer, and each
record says which one answered and with what status (the rate-limit scenario counts 200s per node).

``ConversationLoad`` is the multi-turn client: conversations whose every turn carries the whole history, sent
turn by turn round-robin over the nodes, each turn recording the prompt and cached token counts the engine
reported (the cache-affinity figures).

It runs in its own thread with its own event loop, inside the client's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from chaos.netns import enter_netns

MAX_RUN_S = 900.0  # a load generator never runs longer than this, whatever the caller does
ATTEMPT_ERRORS = (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, ValueError)


def client_error(e: BaseException) -> str:
    """The recorded name of an attempt's failure on the client side (one of ``ATTEMPT_ERRORS``)."""
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "disconnected"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "payload_error"
    if isinstance(e, aiohttp.ClientConnectionError):
        return f"connect_error:{type(e).__name__}"
    return f"client_error:{type(e).__name__}"


def stream_outcome(body: bytes) -> str | None:
    """None when an SSE body completed cleanly: at least one chunk with ``choices``, no error event (the
    node ends an engine failure mid-stream with ``data: {"error": ...}`` then ``data: [DONE]``: a loss),
    and ``data: [DONE]`` as its last event; else why not (``stream_error``, ``stream_incomplete``,
    ``stream_bad_event``, ``stream_empty``)."""
    events: list[bytes] = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [ln for ln in block.split(b"\n") if ln and not ln.startswith(b":")]
        if not lines:
            continue
        if any(ln.strip() == b"event: error" for ln in lines):
            return "stream_error"
        data = b"\n".join(ln[5:].lstrip() for ln in lines if ln.startswith(b"data:"))
        if data:
            events.append(data)
    if not events or events[-1] != b"[DONE]":
        return "stream_incomplete"
    if b"[DONE]" in events[:-1]:
        return "stream_bad_event"
    chunks = 0
    for data in events[:-1]:
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "stream_bad_event"
        if not isinstance(d, dict):
            return "stream_bad_event"
        if "error" in d:
            return "stream_error"
        if isinstance(d.get("choices"), list):
            chunks += 1
    return None if chunks else "stream_empty"


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
    targets: tuple[
        str, ...
    ] = ()  # base URLs to send to round-robin instead of ``url`` (the nodes themselves)
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (e.g. x-smg-tenant)


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
    target: str = ""  # base URL of the last attempt
    status: int = 0  # HTTP status of the last attempt (0: no answer)

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class _BackgroundLoad:
    """The thread both loads run in: an event loop of its own (inside ``netns`` when given), started by
    ``start()``; ``_join(what)`` stops it, waits a bounded time and re-raises what the thread raised."""

    _thread_name = "smgc-load"

    def __init__(self, netns: str | None, attempt_timeout_s: float, retries: int) -> None:
        self.netns = netns
        self._join_s = attempt_timeout_s * (1 + retries) + 15.0  # what may still be in flight, plus slack
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    async def _run(self) -> None:
        raise NotImplementedError

    def _thread_main(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            asyncio.run(self._run())
        except BaseException as e:  # reported by stop()
            self._error = e

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name=self._thread_name, daemon=True)
        self._thread.start()

    def _join(self, what: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._join_s)
        if self._error is not None:
            raise RuntimeError(f"{what} failed: {self._error!r}") from self._error


class LoadGenerator(_BackgroundLoad):
    """``start()`` launches requests until ``stop()``; ``stop()`` waits (bounded) for those in flight."""

    _thread_name = "smgc-loadgen"

    def __init__(self, spec: LoadSpec, netns: str | None = None) -> None:
        super().__init__(netns, spec.attempt_timeout_s, spec.retries)
        self.spec = spec
        self.records: list[RequestRecord] = []
        self.skipped = 0
        self.launched = 0
        self.abandoned = 0  # still in flight when stop() gave up waiting: counted as failed
        self.started_at = 0.0

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

    def _target(self, index: int) -> str:
        targets = self.spec.targets
        return targets[index % len(targets)] if targets else self.spec.url

    async def _attempt(
        self, session: aiohttp.ClientSession, base: str, body: bytes, stream: bool
    ) -> tuple[str | None, int]:
        """(error or None, HTTP status or 0)."""
        url = base.rstrip("/") + "/v1/chat/completions"
        timeout = aiohttp.ClientTimeout(total=self.spec.attempt_timeout_s)
        try:
            async with session.post(
                url,
                data=body,
                headers={"content-type": "application/json", **dict(self.spec.headers)},
                timeout=timeout,
            ) as r:
                data = await r.read()
                if r.status != 200:
                    return f"http_{r.status}", r.status
                if stream:
                    return stream_outcome(data), r.status
                d = orjson.loads(data)
                choices = d.get("choices") if isinstance(d, dict) else None
                if not choices or not isinstance(choices[0].get("message", {}).get("content"), str):
                    return "bad_body", r.status
                return None, r.status
        except ATTEMPT_ERRORS as e:
            return client_error(e), 0

    async def _one(self, session: aiohttp.ClientSession, index: int, stream: bool) -> None:
        body = self._body(index, stream)
        start = time.monotonic()
        first: str | None = None
        err: str | None = None
        attempts = status = 0
        base = self.spec.url
        for attempt in range(1 + self.spec.retries):
            attempts = attempt + 1
            base = self._target(index + attempt)
            err, status = await self._attempt(session, base, body, stream)
            if attempt == 0:
                first = err
            if err is None:
                break
        rec = RequestRecord(
            index, start, time.monotonic(), stream, err is None, attempts, first, err, base, status
        )
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

    # ---- caller side ------------------------------------------------------------------------------------

    def start(self) -> LoadGenerator:
        self._start()
        return self

    def stop(self) -> list[RequestRecord]:
        """Stop launching, wait for the requests in flight (bounded), return every record."""
        self._join("load generator")
        return self.snapshot()

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return sorted(self.records, key=lambda r: r.index)


# ---- multi-turn conversations ---------------------------------------------------------------------------

_WORD_TEXT = (
    "river stone lantern orchard harbor meadow copper violet thunder garden window silver marble canyon "
    "feather island winter candle forest puzzle ribbon saddle timber velvet anchor basket cactus dragon "
    "engine falcon glacier hammer jacket kettle ladder magnet needle oyster pepper quartz rocket shadow "
    "tunnel umbrella valley wagon yellow zebra bridge castle desert echo fabric gravel hollow ivory jungle"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def conversation_words(seed: int, conversation: int, turn: int, n: int) -> str:
    """``n`` words that only this (seed, conversation, turn) gets: the text of one user turn."""
    rng = random.Random(seed * 1_000_003 + conversation * 1009 + turn)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    targets: tuple[str, ...]  # node base URLs: turn k of conversation slot s goes to targets[(s + k) % n]
    conversations: int = 12  # conversations running at once (one per slot)
    turns: int = 8  # turns of a conversation; then a new one takes its slot
    think_s: float = 0.3  # pause between an answer and the next turn
    opening_words: int = 160  # the first turn's text (its own words: its own prefix)
    turn_words: int = (
        48  # each later user turn: > 2 blocks of 16 tokens, so the engines' caches tell turns apart
    )
    max_tokens: int = 16
    attempt_timeout_s: float = 10.0
    retries: int = 1  # a failed turn is retried once, on the next target
    model: str = "qwen3"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TurnRecord:
    conversation: int
    turn: int  # 0: the opening turn
    target: str  # base URL of the last attempt
    start: float  # time.monotonic()
    end: float
    ok: bool
    attempts: int
    error: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


class ConversationLoad(_BackgroundLoad):
    """``start()`` runs ``spec.conversations`` conversations until ``stop()``, each turn carrying the whole
    history; ``set_targets`` changes the nodes the next turns go to (e.g. without a killed one)."""

    _thread_name = "smgc-conversations"

    def __init__(self, spec: ConversationSpec, netns: str | None = None) -> None:
        if not spec.targets:
            raise ValueError("a conversation load needs at least one target")
        super().__init__(netns, spec.attempt_timeout_s, spec.retries)
        self.spec = spec
        self.records: list[TurnRecord] = []
        self._targets: tuple[str, ...] = spec.targets
        self._next_id = spec.conversations

    def set_targets(self, targets: Sequence[str]) -> None:
        if not targets:
            raise ValueError("a conversation load needs at least one target")
        with self._lock:
            self._targets = tuple(targets)

    def _target(self, k: int) -> str:
        with self._lock:
            return self._targets[k % len(self._targets)]

    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    async def _send(
        self, session: aiohttp.ClientSession, base: str, messages: list[dict[str, str]]
    ) -> tuple[str | None, int, int, str]:
        """(error or None, prompt tokens, cached tokens, the answer's text)."""
        spec = self.spec
        body = orjson.dumps(
            {"model": spec.model, "messages": messages, "max_tokens": spec.max_tokens, "temperature": 0.0}
        )
        timeout = aiohttp.ClientTimeout(total=spec.attempt_timeout_s)
        try:
            async with session.post(
                base.rstrip("/") + "/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
                timeout=timeout,
            ) as r:
                data = await r.read()
                if r.status != 200:
                    return f"http_{r.status}", 0, 0, ""
                d = orjson.loads(data)
        except ATTEMPT_ERRORS as e:
            return client_error(e), 0, 0, ""
        try:
            usage = d["usage"]
            answer = d["choices"][0]["message"]["content"]
            prompt = int(usage["prompt_tokens"])
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (KeyError, IndexError, TypeError, ValueError):
            return "bad_body", 0, 0, ""
        return (None, prompt, cached, answer) if isinstance(answer, str) else ("bad_body", 0, 0, "")

    async def _conversation(self, session: aiohttp.ClientSession, slot: int, t0: float) -> None:
        spec = self.spec
        conv = slot
        while not self._stop.is_set() and time.monotonic() - t0 < MAX_RUN_S:
            opening = f"Conversation {conv}: " + conversation_words(spec.seed, conv, 0, spec.opening_words)
            messages = [{"role": "user", "content": opening}]
            for turn in range(spec.turns):
                if self._stop.is_set():
                    return
                if turn > 0:
                    text = conversation_words(spec.seed, conv, turn, spec.turn_words)
                    messages.append({"role": "user", "content": text})
                start = time.monotonic()
                err: str | None = None
                prompt = cached = attempts = 0
                answer = base = ""
                for attempt in range(1 + spec.retries):
                    attempts = attempt + 1
                    base = self._target(slot + turn + attempt)
                    err, prompt, cached, answer = await self._send(session, base, messages)
                    if err is None:
                        break
                rec = TurnRecord(
                    conv, turn, base, start, time.monotonic(), err is None, attempts, err, prompt, cached
                )
                with self._lock:
                    self.records.append(rec)
                if err is not None:
                    break  # the history is broken: a new conversation takes the slot
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(spec.think_s)
            conv = self._new_id()

    async def _run(self) -> None:
        spec = self.spec
        connector = aiohttp.TCPConnector(limit=spec.conversations * 2, keepalive_timeout=5.0)
        async with aiohttp.ClientSession(connector=connector) as session:
            t0 = time.monotonic()
            tasks = [
                asyncio.create_task(self._conversation(session, s, t0)) for s in range(spec.conversations)
            ]
            await asyncio.get_running_loop().run_in_executor(None, self._stop.wait, MAX_RUN_S)
            bound = spec.attempt_timeout_s * (1 + spec.retries) + 5.0
            _, pending = await asyncio.wait(tasks, timeout=bound)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> ConversationLoad:
        self._start()
        return self

    def stop(self) -> list[TurnRecord]:
        """Stop starting turns, wait (bounded) for the turns in flight, return every record."""
        self._join("conversation load")
        return self.snapshot()

    def snapshot(self) -> list[TurnRecord]:
        with self._lock:
            return list(self.records)
