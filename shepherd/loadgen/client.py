"""A closed-loop HTTP/1.1 load generator for OpenAI chat completions, on raw asyncio protocols.

``concurrency`` keep-alive connections each keep exactly one request in flight: when a response
completes, the next request is written from the same ``data_received`` callback, with no task
switch, no coroutine per request and request bytes built by a ``RequestSource``. A run is a
warm-up (not counted), a measurement window that ends after ``duration_s`` or ``max_requests``
measured requests (whichever comes first), then a drain (in-flight requests finish, not counted).

A request counts as OK only if it got a 200 and a well-formed body: for a stream, SSE events that
parse as chat-completion chunks, at least one content event, and a final ``data: [DONE]``; for a
non-stream, a chat completion with ``choices[0].message``. Everything else is counted by kind:
``http_<status>``, ``connect``, ``reset`` (closed mid-response), ``timeout``, ``malformed``,
``stream_error``, ``no_done``, ``empty``.

Streams give TTFT (request written → first content event received), inter-token latency (between
consecutive content events; events that arrive in one read share a timestamp, as a client sees
them) and end-to-end latency. The generator's own CPU time over the window is measured too.
"""

from __future__ import annotations

import asyncio
import signal
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from shepherd.loadgen.http1 import ProtocolError, ResponseParser
from shepherd.loadgen.sse import SseParser, StreamCheck, check_completion
from shepherd.loadgen.stats import Distribution

try:
    import uvloop

    HAVE_UVLOOP = True
except ImportError:  # pragma: no cover - uvloop is a dependency; without it, asyncio's loop
    HAVE_UVLOOP = False

MAX_ERROR_BODY = 4096


class RequestSource(Protocol):
    """Complete request bytes (head and body), one call per request."""

    def next_request(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class LoadSpec:
    host: str
    port: int
    concurrency: int
    duration_s: float = 10.0
    warmup_s: float = 2.0
    max_requests: int | None = None  # measured requests; the window ends at the first bound hit
    stream: bool = False
    timeout_s: float = 60.0  # per request
    drain_s: float = 5.0  # at most this long for in-flight requests after the window
    connect_retry_s: float = 0.1
    tick_s: float = 0.25  # timeout sweep and ``on_tick`` period

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("duration must be positive and warm-up not negative")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")


@dataclass(frozen=True, slots=True)
class WindowHooks:
    """Called from the event loop at the window's start and end and every tick while running.

    ``on_start`` runs before and ``on_end`` after the generator's own CPU is read, so that their
    cost (e.g. sampling /proc) is not counted as the generator's.
    """

    on_start: Callable[[], None] | None = None
    on_tick: Callable[[], None] | None = None
    on_end: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What the window measured. Latencies are in seconds."""

    spec: LoadSpec
    ok: int
    errors: Mapping[str, int]
    errors_outside_window: Mapping[str, int]
    window_s: float
    latency: Distribution
    ttft: Distribution
    itl: Distribution
    content_events: int  # stream: content events of the OK requests
    completion_tokens: int  # from ``usage`` where the target reports it
    loadgen_cpu_s: float
    requests_sent: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def rps(self) -> float:
        return self.ok / self.window_s if self.window_s > 0 else 0.0

    @property
    def loadgen_cpu_ms_per_request(self) -> float:
        served = self.ok + self.error_count
        return 1000.0 * self.loadgen_cpu_s / served if served else float("nan")


_WARMUP = 0
_MEASURE = 1
_DRAIN = 2
_DONE = 3


class _Conn(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.stream = run.spec.stream
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser(self._on_body)
        self.sse = SseParser()
        self.check = StreamCheck()
        self.body: list[bytes] = []
        self.body_len = 0
        self.itl: list[float] = []
        self.busy = False
        self.closing = False
        self.t_start = 0.0
        self.t_first = 0.0
        self.t_last = 0.0
        self.now = 0.0

    # -- asyncio callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.run.conns.add(self)
        self.run.issue(self)

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        if not self.busy:
            if not self.closing:
                self.fail("malformed")  # bytes with no request outstanding
            return
        try:
            extra = self.parser.feed(data)
        except (ProtocolError, ValueError):
            self.fail("malformed")
            return
        if self.parser.complete:
            if extra:
                self.fail("malformed")
            else:
                self._complete()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.now = time.perf_counter()
            try:
                self.parser.feed_eof()
            except ProtocolError:
                self.busy = False
                self.run.record(self, "reset")
            else:
                self.closing = True
                self._complete()
        self.transport = None
        self.run.conn_lost(self)

    # -- request life ------------------------------------------------------------------
    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self.t_start = time.perf_counter()
        self.t_first = 0.0
        self.transport.write(request)

    def _on_body(self, chunk: bytes) -> None:
        if self.stream and self.parser.status == 200:
            check = self.check
            for payload in self.sse.feed(chunk):
                if check.on_event(payload):
                    now = self.now
                    if self.t_first == 0.0:
                        self.t_first = now
                    else:
                        self.itl.append(now - self.t_last)
                    self.t_last = now
        elif self.body_len < MAX_ERROR_BODY or (self.parser.status == 200 and not self.stream):
            self.body.append(chunk)
            self.body_len += len(chunk)

    def _complete(self) -> None:
        status = self.parser.status
        tokens: int | None = None
        kind: str | None
        if status != 200:
            kind = f"http_{status}"
        elif self.stream:
            kind = self.check.verdict()
            if kind is None and self.sse.pending:
                kind = "malformed"  # an unterminated event after [DONE]
            tokens = self.check.usage_completion_tokens
        else:
            kind, tokens = check_completion(b"".join(self.body))
        self.busy = False
        self.run.record(self, kind, tokens)
        keep = self.parser.keep_alive and not self.closing
        self._reset()
        if keep:
            self.run.issue(self)
        else:
            self.close()

    def _reset(self) -> None:
        self.parser.reset()
        if self.stream:
            self.sse = SseParser()
            self.check = StreamCheck()
            self.itl.clear()
        self.body.clear()
        self.body_len = 0

    def fail(self, kind: str) -> None:
        if self.busy:
            self.busy = False
            self.run.record(self, kind)
        self._reset()
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class _Run:
    def __init__(self, spec: LoadSpec, source: RequestSource, hooks: WindowHooks) -> None:
        self.spec = spec
        self.source = source
        self.hooks = hooks
        self.loop = asyncio.get_running_loop()
        self.conns: set[_Conn] = set()
        self.phase = _WARMUP
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.ok = 0
        self.measured = 0
        self.sent = 0
        self.errors: Counter[str] = Counter()
        self.errors_outside: Counter[str] = Counter()
        self.latency = array("d")
        self.ttft = array("d")
        self.itl = array("d")
        self.content_events = 0
        self.completion_tokens = 0
        self.t_window_start = 0.0
        self.t_window_end = 0.0
        self.cpu_start = 0.0
        self.cpu_end = 0.0
        self.connect_tasks: set[asyncio.Task[None]] = set()
        self._tick_handle: asyncio.TimerHandle | None = None

    # -- phases ------------------------------------------------------------------------
    def start(self) -> None:
        for _ in range(self.spec.concurrency):
            self.connect()
        self.loop.call_later(self.spec.warmup_s, self.start_window)
        self._tick_handle = self.loop.call_later(self.spec.tick_s, self.tick)

    def start_window(self) -> None:
        if self.phase != _WARMUP:
            return
        if self.hooks.on_start is not None:
            self.hooks.on_start()
        self.cpu_start = time.process_time()
        self.t_window_start = time.perf_counter()
        self.phase = _MEASURE
        self.loop.call_later(self.spec.duration_s, self.end_window)

    def end_window(self) -> None:
        if self.phase != _MEASURE:
            return
        self.t_window_end = time.perf_counter()
        self.cpu_end = time.process_time()
        self.phase = _DRAIN
        if self.hooks.on_end is not None:
            self.hooks.on_end()
        if not any(c.busy for c in self.conns):
            self.finish()
        else:
            self.loop.call_later(self.spec.drain_s, self.finish)

    def finish(self) -> None:
        if self.phase == _DONE:
            return
        self.phase = _DONE
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        for task in list(self.connect_tasks):
            task.cancel()
        for conn in list(self.conns):
            conn.busy = False  # whatever is in flight now is not counted
            conn.closing = True
            if conn.transport is not None:
                conn.transport.abort()
        if not self.done.done():
            self.done.set_result(None)

    def tick(self) -> None:
        if self.phase == _DONE:
            return
        now = time.perf_counter()
        limit = self.spec.timeout_s
        for conn in list(self.conns):
            if conn.busy and now - conn.t_start > limit:
                conn.fail("timeout")
        if self.hooks.on_tick is not None and self.phase == _MEASURE:
            self.hooks.on_tick()
        self._tick_handle = self.loop.call_later(self.spec.tick_s, self.tick)

    # -- connections -------------------------------------------------------------------
    def connect(self) -> None:
        task = self.loop.create_task(self._connect())
        self.connect_tasks.add(task)
        task.add_done_callback(self.connect_tasks.discard)

    async def _connect(self) -> None:
        try:
            await self.loop.create_connection(lambda: _Conn(self), self.spec.host, self.spec.port)
        except OSError:
            self.count_error("connect")
            if self.phase in (_WARMUP, _MEASURE):
                self.loop.call_later(self.spec.connect_retry_s, self.connect_if_running)
        self.maybe_drained()

    def connect_if_running(self) -> None:
        if self.phase in (_WARMUP, _MEASURE):
            self.connect()

    def conn_lost(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if self.phase in (_WARMUP, _MEASURE):
            self.connect()
        else:
            self.maybe_drained()

    def issue(self, conn: _Conn) -> None:
        if self.phase in (_WARMUP, _MEASURE):
            self.sent += 1
            conn.send(self.source.next_request())
        elif self.phase == _DRAIN:
            conn.close()
            self.maybe_drained()
        else:
            conn.close()

    def maybe_drained(self) -> None:
        if self.phase == _DRAIN and not any(c.busy for c in self.conns):
            self.finish()

    # -- accounting --------------------------------------------------------------------
    def count_error(self, kind: str) -> None:
        if self.phase == _MEASURE:
            self.errors[kind] += 1
            self.measured += 1
            self._check_count()
        else:
            self.errors_outside[kind] += 1

    def record(self, conn: _Conn, kind: str | None, tokens: int | None = None) -> None:
        if kind is not None:
            self.count_error(kind)
            return
        if self.phase != _MEASURE:
            return
        self.ok += 1
        self.measured += 1
        self.latency.append(conn.now - conn.t_start)
        if tokens is not None:
            self.completion_tokens += tokens
        if conn.stream:
            self.ttft.append(conn.t_first - conn.t_start)
            self.itl.extend(conn.itl)
            self.content_events += conn.check.content_events
        self._check_count()

    def _check_count(self) -> None:
        limit = self.spec.max_requests
        if limit is not None and self.measured >= limit:
            self.end_window()

    def result(self) -> LoadResult:
        window = self.t_window_end - self.t_window_start if self.t_window_end else 0.0
        return LoadResult(
            spec=self.spec,
            ok=self.ok,
            errors=dict(self.errors),
            errors_outside_window=dict(self.errors_outside),
            window_s=window,
            latency=Distribution.of(self.latency),
            ttft=Distribution.of(self.ttft),
            itl=Distribution.of(self.itl),
            content_events=self.content_events,
            completion_tokens=self.completion_tokens,
            loadgen_cpu_s=self.cpu_end - self.cpu_start,
            requests_sent=self.sent,
        )


async def run_load(spec: LoadSpec, source: RequestSource, hooks: WindowHooks | None = None) -> LoadResult:
    """Run one closed-loop load against ``spec.host:spec.port`` and return what the window measured."""
    run = _Run(spec, source, hooks or WindowHooks())
    run.start()
    # bounded: warm-up + window + drain, plus slack for a stuck connect
    limit = spec.warmup_s + spec.duration_s + spec.drain_s + spec.timeout_s + 10.0
    try:
        async with asyncio.timeout(limit):
            await asyncio.shield(run.done)
    except TimeoutError:
        run.end_window()
        run.finish()
    finally:
        run.finish()
    # let aborted transports report connection_lost and cancelled connects settle
    for _ in range(3):
        await asyncio.sleep(0)
    return run.result()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (cheaper per callback), else asyncio's."""
    if not HAVE_UVLOOP:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run_load_sync(spec: LoadSpec, source: RequestSource, hooks: WindowHooks | None = None) -> LoadResult:
    """``run_load`` on a fresh (uv)loop, for callers without one.

    SIGINT and SIGTERM during the run cancel it cleanly (connections closed) and raise
    ``KeyboardInterrupt`` here, so that the caller's ``with`` blocks stop their processes. Raising from
    a plain signal handler instead would land inside a protocol callback, where the loop swallows it.
    """
    interrupted: list[int] = []

    async def main() -> LoadResult:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        installed: list[tuple[signal.Signals, Any]] = []

        def stop(signum: int) -> None:
            interrupted.append(signum)
            if task is not None:
                task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            try:
                loop.add_signal_handler(sig, stop, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread, or no signals here
            installed.append((sig, previous))
        try:
            return await run_load(spec, source, hooks)
        finally:
            for sig, previous in installed:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        try:
            return runner.run(main())
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
