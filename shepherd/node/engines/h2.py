"""Engine client over a lean HTTP/2 transport written on asyncio (no threads): SGLang and vLLM services.

Same behaviour and error mapping as ``grpcio.GrpcEngineClient`` (statuses go through the same
``map_rpc_error``), at a fraction of the CPU per message: there is no poller thread, frames are parsed
in ``data_received`` and each stream's messages land in a deque; the consumer drains the deque and
awaits a future only when it is empty, so many messages in one read cost one wake-up. A Generate call's
consumer can instead be pushed each batch as it arrives (``GenerateCall.push``): no wake-up at all.

One HTTP/2 connection per worker (``h2_protocol.H2Protocol``), multiplexing every call; on loss the next
call reconnects, with exponential back-off between failed attempts (calls during the back-off fail fast
with EngineUnavailable, as grpcio's do in TRANSIENT_FAILURE). The calls' streams (``GrpcStream``, their
deadlines, gRPC statuses) are in h2_stream.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl
from smg_grpc_proto.generated import common_pb2

from shepherd.node.config import WorkerAllow
from shepherd.node.engines.backoff import Backoff
from shepherd.node.engines.errors import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    OK,
    UNAVAILABLE,
    UNIMPLEMENTED,
    health_timeout,
    sglang_context,
)
from shepherd.node.engines.h2_frames import LOCAL_WINDOW, RequestHeaders, hpack_literal
from shepherd.node.engines.h2_protocol import H2Protocol, LazyReads
from shepherd.node.engines.h2_stream import Deadlines, GrpcStream, RpcStatus, grpc_message, map_status
from shepherd.node.observe import tracing
from shepherd.proto.engine_requests import (
    SGLANG_SERVICE,
    VLLM_SERVICE,
    sglang_embed,
    sglang_generate_bytes,
    vllm_embed,
    vllm_generate_bytes,
)
from shepherd.proto.engine_responses import (
    decode_batch,
    decode_embed,
    decode_loads,
    decode_model_info,
    decode_server_info,
    lone_chunk,
)
from shepherd.proto.engine_types import (
    EmbedResult,
    EngineError,
    EngineEvent,
    EngineLoad,
    GenerateRequest,
    KvEventBatch,
    ModelInfo,
    ServerInfo,
)
from shepherd.proto.kv_codec import decode_kv_wire

M = TypeVar("M", bound=Message)

log = logging.getLogger("shepherd.engines.h2")

_UNPROCESSED_RETRIES = 5  # transparent re-sends of a call the server never processed
# an answer's bytes received and not consumed past which its stream's credit waits for the consumer (the
# client's transport full: the engine stops sending that answer; at most this and the stream window held)
GENERATE_BACKLOG_BYTES = 1 << 20
# the most queued message bytes decoded and taken as one batch: a client that stopped reading leaves up to
# the stream window queued, and its answer is formatted and written a slice at a time as its transport
# drains, not all at once (logprobs make the JSON several times the messages' size)
BATCH_MAX_BYTES = 64 * 1024

_MAX_DEADLINE_GROUPS = 8


def _next_batch(msgs: collections.deque[bytes]) -> list[bytes]:
    """The queued messages of one batch, taken off ``msgs``: all of them, or the oldest ones up to
    ``BATCH_MAX_BYTES`` (at least one; the rest stay queued, and count against the stream's credit)."""
    if len(msgs) == 1:
        return [msgs.popleft()]
    raws: list[bytes] = []
    size = 0
    while msgs and (not raws or size + len(msgs[0]) <= BATCH_MAX_BYTES):  # bounded by the messages
        raw = msgs.popleft()
        size += len(raw)
        raws.append(raw)
    return raws


def parse_target(target: str) -> tuple[str, int, str | None]:
    """A gRPC target -> (host, port, unix socket path or None). Accepts host:port, [v6]:port, dns:///,
    ipv4:, ipv6:, unix:path."""
    t = target.strip()
    if t.startswith("unix:"):
        path = t[5:]
        if path.startswith("//"):
            path = path[2:]
        return "localhost", 0, path
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(prefix):
            t = t[len(prefix) :]
            break
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif t.count(":") == 1:
        host, _, port = t.partition(":")
    else:
        host, port = t, ""
    return host, int(port) if port else 443, None


def _path(kind: str, method: str) -> str:
    return f"/{VLLM_SERVICE if kind == 'vllm' else SGLANG_SERVICE}/{method}"


_SG_GENERATE = _path("sglang", "Generate")
_VL_GENERATE = _path("vllm", "Generate")
_SG_PARSE = sg.GenerateResponse.FromString
_VL_PARSE = vl.GenerateResponse.FromString

_MAX_WAITS = 10_000  # bound on the wake-ups one call waits for (a slot, a connection, its end)


class H2EngineClient:
    """EngineClient for ``grpc://``, ``sglang://`` and ``vllm://`` workers over the lean HTTP/2 transport."""

    def __init__(
        self,
        url: str,
        target: str,
        kind: str | None = None,
        *,
        connect_timeout: float = 5.0,
        keepalive_s: float = 60.0,
        keepalive_timeout_s: float = 20.0,
        window: int = LOCAL_WINDOW,
        backoff: Backoff | None = None,
        coalesce_writes: bool = True,
        tls: ssl.SSLContext | None = None,  # TLS (ALPN h2) to the engine; None: cleartext h2c
        allow: WorkerAllow | None = None,  # the node's worker_allow: a name's addresses checked per connect
    ) -> None:
        self.url = url
        self.target = target
        self.kind = kind or "unknown"
        self._host, self._port, self._unix = parse_target(target)
        authority = "localhost" if self._unix else f"{self._host}:{self._port}"
        if ":" in self._host and not self._unix:
            authority = f"[{self._host}]:{self._port}"
        self._tls = tls
        self._allow = allow
        self._headers = RequestHeaders(authority, scheme="https" if tls else "http")
        self._connect_timeout = connect_timeout
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._window = window
        self._coalesce = coalesce_writes
        self._backoff = backoff or Backoff()
        self._proto: H2Protocol | None = None
        self._protos: set[H2Protocol] = set()
        self._connecting: asyncio.Task[H2Protocol] | None = None
        self._deadlines: dict[float, Deadlines] = {}  # by timeout
        self._last_error = ""
        self._closed = False
        self.connects = 0  # successful connections made (observability and tests)
        # KV-event streams on a connection of their own, read when this polls (None: on the client's
        # connection, read as it arrives); set before the first subscription
        self.kv_reads: LazyReads | None = None
        self._lazy: LazyReads | None = None  # this client's connections are read lazily (the KV side)
        self._kv_side: H2EngineClient | None = None

    # ------------------------------------------------------------------------------------------ connection

    async def _protocol(self, deadline: float | None) -> H2Protocol:
        p = self._proto
        if p is not None and p.conn.usable:
            return p
        if self._closed:
            raise RpcStatus(UNAVAILABLE, "client closed")
        self._proto = None
        loop = asyncio.get_running_loop()
        task = self._connecting
        if task is None:
            now = loop.time()
            if not self._backoff.ready(now):
                raise RpcStatus(
                    UNAVAILABLE,
                    f"{self._last_error} (next connection attempt in {self._backoff.until - now:.2f}s)",
                )
            task = self._connecting = loop.create_task(self._connect())
            task.add_done_callback(_retrieve)
        if deadline is None:
            return await asyncio.shield(task)
        try:  # (asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel landing as the connect ends)
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                return await asyncio.shield(task)
        except TimeoutError:
            raise RpcStatus(DEADLINE_EXCEEDED, "deadline exceeded while connecting") from None

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        """Where to dial: the host as given, or, for a name ``worker_allow`` does not list, the addresses
        it resolves to now that ``worker_allow`` lets the node dial (metadata ones never, with the list
        empty too), so a name that resolves, or re-binds, to 169.254.169.254 is never dialed (OSError
        when none is left)."""
        if self._unix is not None or self._allow is None or not self._allow.resolve_check(self._host):
            return [self._host]
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        found = list(dict.fromkeys(str(info[4][0]) for info in infos))
        kept = [a for a in found if self._allow.address_allowed(a)]
        if not kept:
            raise OSError(f"{self._host} resolves to no address worker_allow allows")
        return kept

    async def _dial(self, loop: asyncio.AbstractEventLoop, factory: Callable[[], H2Protocol]) -> H2Protocol:
        """A TCP connection (TLS with the URL's name as the server name), to the first of ``_addresses``
        that answers; on a KV-event side client, one its ``LazyReads`` reads."""
        last: OSError | None = None
        for address in await self._addresses(loop):
            try:
                if self._lazy is not None:  # a KV-event stream's own connection, read on the owner's polls
                    return await self._lazy.connect(factory, address, self._port, self._unix)
                name = self._host if self._tls is not None and address != self._host else None
                _, proto = await loop.create_connection(
                    factory, address, self._port, ssl=self._tls, server_hostname=name
                )
                return proto
            except OSError as e:
                last = e
        assert last is not None  # (``_addresses`` gives at least one)
        raise last

    async def _connect(self) -> H2Protocol:
        loop = asyncio.get_running_loop()

        def factory() -> H2Protocol:
            return H2Protocol(
                loop,
                local_window=self._window,
                keepalive_s=self._keepalive_s,
                keepalive_timeout_s=self._keepalive_timeout_s,
                coalesce_writes=self._coalesce,
            )

        proto: H2Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._unix is not None and self._lazy is None:
                    host = "localhost" if self._tls else None
                    _, proto = await loop.create_unix_connection(
                        factory, self._unix, ssl=self._tls, server_hostname=host
                    )
                else:
                    proto = await self._dial(loop, factory)
                await proto.ready
        except (OSError, TimeoutError) as e:
            if proto is not None:
                proto.abort()
            why = "connect timeout" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
            self._last_error = f"cannot connect to {self.target}: {why}"
            self._backoff.failed(loop.time())
            raise RpcStatus(UNAVAILABLE, self._last_error) from None
        finally:
            self._connecting = None
        self._backoff.succeeded()
        self.connects += 1
        if self._closed:
            proto.close()
            raise RpcStatus(UNAVAILABLE, "client closed")
        self._proto = proto
        self._protos.add(proto)
        proto.closed.add_done_callback(lambda _f: self._protos.discard(proto))
        return proto

    def _start_now(
        self, path: str, body: bytes, timeout: float | None, extra: bytes = b""
    ) -> GrpcStream | None:
        """Open a call and send its request at once when a connection and a slot are ready, else None."""
        p = self._proto
        if p is None or not p.can_open:
            return None
        loop = p.loop
        stream = GrpcStream(loop)
        p.conn.open_stream(stream, self._headers.block(path, timeout) + extra, grpc_message(body))
        if timeout is not None:
            dl = self._deadlines.get(timeout)
            if dl is None or dl.loop is not loop:
                if len(self._deadlines) >= _MAX_DEADLINE_GROUPS:  # timeouts that vary: a timer each
                    stream.timer = loop.call_later(timeout, stream.expire)
                    return stream
                # a timeout seen before shares a timer with its calls (generation, health checks, loads)
                dl = self._deadlines[timeout] = Deadlines(loop, timeout)
            dl.add(stream)
        return stream

    async def _start(self, path: str, body: bytes, timeout: float | None, extra: bytes = b"") -> GrpcStream:
        """Open a call and send its request; no suspension when a connection and a slot are ready."""
        ready = self._start_now(path, body, timeout, extra)
        if ready is not None:
            return ready
        loop = asyncio.get_running_loop()
        stream = GrpcStream(loop)
        deadline = None if timeout is None else loop.time() + timeout
        waited = False  # once woken in FIFO order it is our turn, whoever else waits
        for _ in range(_MAX_WAITS):
            p = await self._protocol(deadline)
            c = p.conn
            if c.has_slot and (waited or not p.has_waiters):
                remaining = None if deadline is None else max(0.001, deadline - loop.time())
                c.open_stream(stream, self._headers.block(path, remaining) + extra, grpc_message(body))
                if deadline is not None:
                    stream.timer = loop.call_at(deadline, stream.expire)
                return stream
            waited = True
            if deadline is None:
                await p.wait_slot()
            else:
                try:
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        await p.wait_slot()
                except TimeoutError:
                    raise RpcStatus(DEADLINE_EXCEEDED, "deadline exceeded waiting for a stream") from None
        raise RpcStatus(UNAVAILABLE, "no stream could be opened")

    # ------------------------------------------------------------------------------------------ calls

    async def call_unary(
        self, path: str, request: Message, response_type: type[M], timeout: float | None
    ) -> M:
        """One unary call; raises RpcStatus (internal error type) on a non-OK status. The caller's trace
        context goes as metadata when tracing is on (an Embed of a request; none for background calls)."""
        trace = tracing.grpc_header_block(hpack_literal) if tracing.ENABLED else b""
        stream = await self._start(path, request.SerializeToString(), timeout, trace)
        try:
            for _ in range(_MAX_WAITS):
                if stream.done:
                    break
                await stream.wait()
        finally:
            if not stream.done:
                stream.cancel()
        if stream.code != OK:
            raise RpcStatus(stream.code, stream.details)
        if len(stream.messages) != 1:
            raise RpcStatus(INTERNAL, f"unary call got {len(stream.messages)} messages")
        try:
            return response_type.FromString(stream.messages[0])
        except DecodeError as e:
            raise RpcStatus(INTERNAL, f"cannot parse the response: {e}") from None

    async def call_stream(
        self,
        path: str,
        request: Message,
        response_type: type[M],
        timeout: float | None,
        parse: Callable[[bytes], Any] | None = None,
    ) -> AsyncIterator[M]:
        """A server-streaming call; closing the iterator early cancels the call (RST_STREAM). The caller's
        trace context goes as metadata when tracing is on (the Generate of a TensorRT-LLM or MLX worker).
        ``parse``: what reads each message's bytes instead of ``response_type.FromString``."""
        trace = tracing.grpc_header_block(hpack_literal) if tracing.ENABLED else b""
        stream = await self._start(path, request.SerializeToString(), timeout, trace)
        if parse is None:
            parse = response_type.FromString
        msgs = stream.messages
        try:
            while True:
                while msgs:
                    yield parse(msgs.popleft())
                if stream.done:
                    break
                await stream.wait()
        except DecodeError as e:
            raise RpcStatus(INTERNAL, f"cannot parse a response: {e}") from None
        finally:
            if not stream.done:
                stream.cancel()
        if stream.code != OK:
            raise RpcStatus(stream.code, stream.details)

    async def _unary(self, method: str, request: Message, response_type: type[M], timeout: float) -> M:
        try:
            return await self.call_unary(_path(self.kind, method), request, response_type, timeout)
        except RpcStatus as e:
            raise e.engine_error() from None

    # ------------------------------------------------------------------------------------------ EngineClient

    async def detect(self, timeout: float = 5.0) -> str:
        """Settle ``kind`` by asking GetServerInfo of each service (SGLang first)."""
        if self.kind in ("sglang", "vllm"):
            return self.kind
        try:
            await self.call_unary(
                _path("sglang", "GetServerInfo"), sg.GetServerInfoRequest(), sg.GetServerInfoResponse, timeout
            )
            self.kind = "sglang"
        except RpcStatus as e:
            if e.code != UNIMPLEMENTED:
                raise e.engine_error() from None
            try:
                await self.call_unary(
                    _path("vllm", "GetServerInfo"),
                    vl.GetServerInfoRequest(),
                    vl.GetServerInfoResponse,
                    timeout,
                )
            except RpcStatus as e2:
                raise e2.engine_error() from None
            self.kind = "vllm"
        return self.kind

    async def generate(
        self, req: GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[EngineEvent]:
        call = GenerateCall(self, req, timeout)
        try:
            async for batch in call:
                for ev in batch:
                    yield ev
        finally:
            call.close()

    def generate_batches(self, req: GenerateRequest, timeout: float | None = None) -> GenerateCall:
        """Like ``generate``, but yields every event that is already here at once: a network read that
        carried many messages costs the consumer one wake-up and one downstream write."""
        return GenerateCall(self, req, timeout)

    async def embed(self, request_id: str, ids: Sequence[int], timeout: float | None = None) -> EmbedResult:
        """One Embed call (unary) of ``ids``; raises EngineError."""
        if self.kind == "unknown":
            await self.detect()
        try:
            if self.kind == "vllm":
                r: Any = await self.call_unary(
                    _path("vllm", "Embed"), vllm_embed(request_id, ids), vl.EmbedResponse, timeout
                )
            else:
                r = await self.call_unary(
                    _path("sglang", "Embed"), sglang_embed(request_id, ids), sg.EmbedResponse, timeout
                )
        except RpcStatus as e:
            raise e.engine_error() from None
        return decode_embed(r, len(ids))

    async def abort(self, request_id: str, reason: str = "") -> None:
        with contextlib.suppress(RpcStatus):
            if self.kind == "vllm":
                await self.call_unary(
                    _path("vllm", "Abort"), vl.AbortRequest(request_ids=[request_id]), vl.AbortResponse, 5.0
                )
            else:
                await self.call_unary(
                    _path("sglang", "Abort"),
                    sg.AbortRequest(request_id=request_id, reason=reason),
                    sg.AbortResponse,
                    5.0,
                )
        # best effort: the stream cancellation also frees the request

    async def health_check(self, timeout: float = 2.0) -> bool:
        try:
            if self.kind == "unknown":
                await self.detect(timeout)
            timeout = health_timeout(self.kind, timeout)
            if self.kind == "vllm":
                r: Any = await self.call_unary(
                    _path("vllm", "HealthCheck"), vl.HealthCheckRequest(), vl.HealthCheckResponse, timeout
                )
            else:
                r = await self.call_unary(
                    _path("sglang", "HealthCheck"), sg.HealthCheckRequest(), sg.HealthCheckResponse, timeout
                )
        except (RpcStatus, EngineError):
            return False
        return bool(r.healthy)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        if self.kind == "vllm":
            r: Any = await self._unary(
                "GetModelInfo", vl.GetModelInfoRequest(), vl.GetModelInfoResponse, timeout
            )
        else:
            r = await self._unary("GetModelInfo", sg.GetModelInfoRequest(), sg.GetModelInfoResponse, timeout)
        return decode_model_info(r, await sglang_context(self.kind, lambda: self.server_info(timeout)))

    async def server_info(self, timeout: float = 5.0) -> ServerInfo:
        if self.kind == "vllm":
            r: Any = await self._unary(
                "GetServerInfo", vl.GetServerInfoRequest(), vl.GetServerInfoResponse, timeout
            )
        else:
            r = await self._unary(
                "GetServerInfo", sg.GetServerInfoRequest(), sg.GetServerInfoResponse, timeout
            )
        return decode_server_info(r, self.kind)

    async def loads(self) -> EngineLoad:
        if self.kind == "vllm":
            r: Any = await self._unary(
                "GetLoads", vl.GetLoadsRequest(include=["core"]), vl.GetLoadsResponse, 5.0
            )
        else:
            r = await self._unary("GetLoads", sg.GetLoadsRequest(include=["core"]), sg.GetLoadsResponse, 5.0)
        return decode_loads(r)

    async def flush_cache(self, timeout: float = 30.0) -> tuple[bool, str]:
        """FlushCache: (success, the engine's message)."""
        if self.kind == "unknown":
            await self.detect()
        r: Any = await self._unary(
            "FlushCache", common_pb2.FlushCacheRequest(), common_pb2.FlushCacheResponse, timeout
        )
        return bool(r.success), str(r.message)

    async def get_tokenizer(self, timeout: float = 120.0) -> tuple[bytes, str]:
        """GetTokenizer (server stream): the zip's bytes, concatenated, and the sha256 the last chunk
        carries ("" when the engine sent none)."""
        if self.kind == "unknown":
            await self.detect()
        parts: list[bytes] = []
        sha = ""
        stream = cast(
            AsyncGenerator[Any, None],
            self.call_stream(
                _path(self.kind, "GetTokenizer"),
                common_pb2.GetTokenizerRequest(),
                common_pb2.GetTokenizerChunk,
                timeout,
            ),
        )
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    parts.append(chunk.data)
                    sha = chunk.sha256 or sha
        except RpcStatus as e:
            raise e.engine_error() from None
        return b"".join(parts), sha

    async def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]:
        """SubscribeKvEvents (server stream, no deadline); closing the iterator cancels the call."""
        req = await self._kv_request(start_seq)
        stream = cast(
            AsyncGenerator[Any, None],
            self._kv_client().call_stream(
                _path(self.kind, "SubscribeKvEvents"), req, common_pb2.KvEventBatch, None, decode_kv_wire
            ),
        )
        try:
            async with contextlib.aclosing(stream):
                async for batch in stream:  # the events as bytes where the C scanner is built
                    yield batch
        except RpcStatus as e:
            raise e.engine_error() from None

    async def kv_events_pushed(self, start_seq: int, on_batch: Callable[[KvEventBatch], bool]) -> None:
        """SubscribeKvEvents with each batch handed to ``on_batch`` as it is read, from the connection's
        frame loop (the stream's ``listener``: no future, task step or generator resumption per message,
        as the generation streams' tokens); returns when the stream ends, raising ``EngineError`` as
        ``subscribe_kv_events`` does. ``on_batch`` returning False ends the call (cancelled, as closing
        the iterator does); what it raises ends the call and is raised here; so is a malformed message
        (INTERNAL). Cancelling the caller cancels the call."""
        req = await self._kv_request(start_seq)
        trace = tracing.grpc_header_block(hpack_literal) if tracing.ENABLED else b""
        path = _path(self.kind, "SubscribeKvEvents")
        try:
            stream = await self._kv_client()._start(path, req.SerializeToString(), None, trace)
        except RpcStatus as e:
            raise e.engine_error() from None
        ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # True: stopped by on_batch
        msgs = stream.messages

        def drain() -> None:
            if ended.done():
                return
            try:
                while msgs:
                    if not on_batch(decode_kv_wire(msgs.popleft())):
                        ended.set_result(True)
                        return
            except DecodeError as e:
                ended.set_exception(RpcStatus(INTERNAL, f"cannot parse a response: {e}"))
                return
            except Exception as e:  # the consumer's: raised in the caller, not in the frame loop
                ended.set_exception(e)
                return
            if stream.done:
                ended.set_result(False)

        stream.listener = drain
        try:
            drain()  # what came with the call's start
            stopped = await ended
        except RpcStatus as e:
            raise e.engine_error() from None
        finally:
            stream.listener = None
            if not stream.done:
                stream.cancel()
        if not stopped and stream.code != OK:
            raise RpcStatus(stream.code, stream.details).engine_error()

    async def _kv_request(self, start_seq: int) -> common_pb2.SubscribeKvEventsRequest:
        if self.kind == "unknown":
            await self.detect()
        return common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start_seq, load_records_before_first_batch=True
        )

    def _kv_client(self) -> H2EngineClient:
        """Where KV-event streams go: this client, or with ``kv_reads`` set a client of its own to the same
        engine whose connection ``kv_reads`` reads (batches and load records wait for its poll; the
        generation streams on this client's connection are read as they arrive)."""
        lazy = self.kv_reads
        if lazy is None or self._tls is not None:  # TLS: on this client's connection, read as it arrives
            return self
        side = self._kv_side
        if side is None:
            side = self._kv_side = H2EngineClient(
                self.url,
                self.target,
                self.kind,
                connect_timeout=self._connect_timeout,
                keepalive_s=self._keepalive_s,
                keepalive_timeout_s=self._keepalive_timeout_s,
                window=self._window,
                coalesce_writes=self._coalesce,
                tls=self._tls,
                allow=self._allow,
            )
            side._lazy = lazy
        side.kind = self.kind
        return side

    def confirm_alive(self, timeout: float) -> None:
        """The worker failed its health checks: each of this client's connections with calls in flight is
        sent one PING now (``H2Protocol.probe``), and one whose ACK does not come within ``timeout`` fails
        with its calls (UNAVAILABLE: the gateway retries those that sent the client nothing yet), rather
        than waiting for the keepalive (up to 80 s on a hung engine). An engine alive but busy answers
        PINGs at once. The KV-event side client's connection (``_kv_side``) is left alone: its ACK would
        wait for its owner's poll, and its stream (no deadline, nothing a client waits for) ends with
        the keepalive."""
        for p in list(self._protos):
            p.probe(timeout, functools.partial(self._unanswered, timeout))

    def _unanswered(self, timeout: float, calls: int) -> None:
        log.warning(
            "worker %s did not answer a ping within %gs after failing its health checks: "
            "failing its %d in-flight calls",
            self.url,
            timeout,
            calls,
        )

    async def close(self) -> None:
        self._closed = True
        if self._kv_side is not None:
            await self._kv_side.close()
        if self._connecting is not None:
            self._connecting.cancel()
        protos = list(self._protos)
        self._proto = None
        for p in protos:
            p.close()
        if protos:
            await asyncio.wait([p.closed for p in protos], timeout=2.0)


class GenerateCall:
    """One Generate call as an async iterator of event batches (``H2EngineClient.generate_batches``).

    An object rather than an async generator: every request creates, steps and closes one, and this
    costs less to do all three (no generator frame, no loop hooks). Closing it early (``aclose``, or an
    exception or a cancellation while it waits) cancels the call (RST_STREAM). The request is encoded
    and sent at the first ``__anext__``, which returns once the first messages arrived."""

    __slots__ = (
        "_client",
        "_closed",
        "_lone",
        "_parse",
        "_push_fut",
        "_push_take",
        "_req",
        "_single",
        "_stream",
        "_timeout",
    )

    def __init__(self, client: H2EngineClient, req: GenerateRequest, timeout: float | None) -> None:
        self._client = client
        self._req = req
        self._timeout = timeout
        self._stream: GrpcStream | None = None
        self._parse: Callable[[bytes], Any] = _SG_PARSE
        self._single: str | None = None  # the engine kind when the request has one choice (decode_batch)
        self._lone: bool | None = None  # with one choice and lone_chunk built: whether the engine is vLLM
        self._closed = False
        self._push_fut: asyncio.Future[None] | None = None  # push(): resolved when it hands back
        self._push_take: Callable[[list[EngineEvent]], bool] | None = None

    def __aiter__(self) -> GenerateCall:
        return self

    async def __anext__(self) -> list[EngineEvent]:
        if self._closed:
            raise StopAsyncIteration
        try:
            stream = self._stream
            if stream is None:
                stream = await self._open()
            msgs = stream.messages
            while True:  # bounded by the messages and the end of the stream
                if msgs:
                    raws = _next_batch(msgs)
                    if stream.credit_held and not msgs:
                        stream.consumed()
                    batch = decode_batch(raws, self._parse, single=self._single)
                    if batch:
                        return batch
                    continue
                if stream.done:
                    break
                if stream.credit_held:  # (waiting with nothing queued: not behind)
                    stream.consumed()
                await stream.wait()
        except DecodeError as e:
            self.close()
            raise map_status(INTERNAL, f"cannot parse a response: {e}") from None
        except BaseException:
            self.close()
            raise
        self._closed = True
        if stream.code != OK:
            raise map_status(stream.code, stream.details)
        raise StopAsyncIteration

    async def _open(self) -> GrpcStream:
        client = self._client
        if client.kind == "unknown":
            await client.detect()
        req = self._req
        if client.kind == "vllm":
            body = vllm_generate_bytes(req)
            self._parse = _VL_PARSE
            path = _VL_GENERATE
        else:
            body = sglang_generate_bytes(req)
            path = _SG_GENERATE
        if req.sampling.n == 1:
            self._single = client.kind
            if lone_chunk is not None:
                self._lone = client.kind == "vllm"
        timeout = self._timeout
        # the caller's trace context (traceparent, tracestate) as gRPC metadata, when tracing is on
        trace = tracing.grpc_header_block(hpack_literal) if tracing.ENABLED else b""
        stream: GrpcStream | None = None
        for _attempt in range(_UNPROCESSED_RETRIES + 1):
            stream = client._start_now(path, body, timeout, trace)
            if stream is None:
                try:
                    stream = await client._start(path, body, timeout, trace)
                except RpcStatus as e:
                    raise e.engine_error() from None
            self._stream = stream
            stream.credit_hold = GENERATE_BACKLOG_BYTES  # (a client that stops reading stops the engine)
            while not stream.done and not stream.messages:
                await stream.wait()
            # a call the server refused before processing it (REFUSED_STREAM, or above a GOAWAY's
            # last stream id: e.g. opened before its SETTINGS limit arrived) is sent again, as gRPC does
            if not (stream.done and stream.unprocessed):
                break
        assert stream is not None
        return stream

    def push(self, take: Callable[[list[EngineEvent]], bool]) -> asyncio.Future[None]:
        """Hand the call's next batches to ``take`` as they arrive, from the engine connection's frame
        loop: no future, task wake-up or coroutine step per engine message (a paced engine sends one
        message per token). ``take`` returns True to stop (the answer is complete, or the client's
        transport wants a pause). The future resolves when ``take`` stopped or the stream ended (the
        next ``__anext__`` then gives its status), and fails with what ``take`` or the parse raised; the
        consumer goes on with ``__anext__``. Only after the first ``__anext__`` returned."""
        stream = self._stream
        assert stream is not None, "push() before the call was opened"
        fut = stream._loop.create_future()
        self._push_fut = fut
        self._push_take = take
        # a take with a listener of its own (plain_step.PlainStep: a lone plain chunk read and taken in C,
        # anything else through _on_ready)
        bind = getattr(take, "bind_listener", None) if self._lone is not None else None
        if bind is not None:
            stream.listener = bind(
                stream.messages,
                stream,
                fut,
                lone_chunk,
                self._lone,
                self._on_ready,
                self._push_stopped,
                self._push_failed,
            )
        else:
            stream.listener = self._on_ready
        if stream.messages or stream.done:
            self._on_ready()
        elif stream.credit_held:  # (nothing queued: the consumer is not behind)
            stream.consumed()
        return fut

    def _push_stopped(self) -> None:
        """``take`` returned True (a take's own listener): as ``_on_ready`` ends the push."""
        fut = self._push_fut
        self._end_push()
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _push_failed(self, e: Exception) -> None:
        """``take`` raised (a take's own listener): as ``_on_ready`` fails the push."""
        fut = self._push_fut
        self._end_push()
        if fut is not None and not fut.done():
            if isinstance(e, DecodeError):
                fut.set_exception(map_status(INTERNAL, f"cannot parse a response: {e}"))
            else:
                fut.set_exception(e)

    def _end_push(self) -> None:
        self._push_fut = self._push_take = None
        if self._stream is not None:
            self._stream.listener = None

    def _on_ready(self) -> None:
        """Messages arrived, or the stream ended (GrpcStream's listener, while pushing)."""
        fut = self._push_fut
        take = self._push_take
        stream = self._stream
        if fut is None or take is None or stream is None or fut.done():  # the consumer went away
            self._end_push()
            return
        msgs = stream.messages
        lone = self._lone
        try:
            while msgs:  # bounded by the messages (``take`` runs no engine I/O)
                if lone is not None and len(msgs) == 1:  # a paced engine's token: read in C, if plain
                    raw = msgs.popleft()
                    ev = lone_chunk(raw, lone)  # type: ignore[misc]  # (not None when _lone is set)
                    batch = [ev] if ev is not None else decode_batch([raw], self._parse, single=self._single)
                else:
                    batch = decode_batch(_next_batch(msgs), self._parse, single=self._single)
                if stream.credit_held and not msgs:  # every message taken: the engine may send again,
                    stream.consumed()  # whether ``take`` pauses on this batch or not
                if batch and take(batch):
                    self._end_push()
                    fut.set_result(None)
                    return
        except DecodeError as e:
            self._end_push()
            fut.set_exception(map_status(INTERNAL, f"cannot parse a response: {e}"))
            return
        except Exception as e:
            self._end_push()
            fut.set_exception(e)
            return
        if stream.done:
            self._end_push()
            fut.set_result(None)

    def close(self) -> None:
        """End the call: cancelled (RST_STREAM) unless the server already ended it."""
        self._closed = True
        self._end_push()
        s = self._stream
        if s is not None and not s.done:
            s.cancel()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        s = self._stream
        if s is not None and not s.done:  # dropped unclosed: free the engine's request all the same
            with contextlib.suppress(Exception):
                s.cancel()


def _retrieve(task: asyncio.Task[H2Protocol]) -> None:
    if not task.cancelled():
        task.exception()  # the callers that waited got it; don't warn when none did
