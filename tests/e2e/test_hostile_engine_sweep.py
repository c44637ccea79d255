"""A hostile or broken gRPC engine against a real node: the node survives, every client gets a clear error
in its protocol's envelope, no engine call is leaked, memory stays bounded.

``HostileEngine`` is a raw asyncio HTTP/2 server (its own frames, no grpc library) speaking SGLang's
service, run on a thread of the test process; each test sets how its Generate calls are answered
(``engine.generate``: an async function writing frames) and runs a real ``smg-node`` process against
it on loopback (ports 47000-47999), stopped by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import hpack
import httpx
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg

from shepherd.node.engines import h2_frames as h2
from tests.e2e.node_procs import NodeProc, reserved_port, start_node
from tests.e2e.test_node_tools import byte_tokenizer

_PREFIX = struct.Struct(">BI")

Handler = Callable[["EngineConn", int, sg.GenerateRequest], Awaitable[None]]


def free_port_in_range() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


def gmsg(body: bytes, compressed: int = 0) -> bytes:
    return _PREFIX.pack(compressed, len(body)) + body


def chunk(rid: str, ids: list[int], n: int) -> bytes:
    r = sg.GenerateResponse(
        request_id=rid,
        chunk=sg.GenerateStreamChunk(token_ids=ids, prompt_tokens=4, completion_tokens=n),
    )
    return bytes(r.SerializeToString())


def complete(rid: str, ids: list[int], n: int, reason: str = "stop") -> bytes:
    r = sg.GenerateResponse(
        request_id=rid,
        complete=sg.GenerateComplete(
            output_ids=ids, finish_reason=reason, prompt_tokens=4, completion_tokens=n
        ),
    )
    return bytes(r.SerializeToString())


class EngineConn(asyncio.Protocol):
    """One client connection of the hostile engine: frames parsed, calls dispatched to the engine."""

    def __init__(self, engine: HostileEngine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.preface = False
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self.calls: dict[int, tuple[str, bytearray]] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.ended: set[int] = set()

    # output

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def head(self, sid: int, fields: list[tuple[str, str]] | None = None, end: bool = False) -> None:
        fields = fields or [(":status", "200"), ("content-type", "application/grpc")]
        block = self.enc.encode(fields)
        self.write(b"".join(h2.headers_frames(sid, block, end, 16384)))
        if end:
            self.ended.add(sid)

    def data(self, sid: int, payload: bytes, end: bool = False) -> None:
        for off in range(0, max(1, len(payload)), 16384):  # bounded by the payload
            part = payload[off : off + 16384]
            last = end and off + 16384 >= len(payload)
            self.write(h2.frame(h2.DATA, h2.FLAG_END_STREAM if last else 0, sid, part))
        if end:
            self.ended.add(sid)

    def msg(self, sid: int, body: bytes) -> None:
        self.data(sid, gmsg(body))

    def trail(self, sid: int, status: int = 0, message: str = "") -> None:
        fields = [("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
        self.head(sid, fields, end=True)

    def unary(self, sid: int, body: bytes) -> None:
        self.head(sid)
        self.msg(sid, body)
        self.trail(sid)

    # input

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.engine.conns.append(self)
        self.write(h2.settings_frame(self.engine.settings))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for t in self.tasks.values():
            t.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.preface:
            if len(self.buf) < len(h2.PREFACE):
                return
            self.buf = self.buf[len(h2.PREFACE) :]
            self.preface = True
        while len(self.buf) >= 9:  # bounded by the buffer
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                return
            ftype, flags = self.buf[3], self.buf[4]
            sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload = self.buf[9 : 9 + length]
            self.buf = self.buf[9 + length :]
            self.frame(ftype, flags, sid, payload)

    def frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        eng = self.engine
        if ftype == h2.SETTINGS and not flags & h2.FLAG_ACK:
            self.write(h2.frame(h2.SETTINGS, h2.FLAG_ACK, 0))
        elif ftype == h2.PING and not flags & h2.FLAG_ACK:
            self.write(h2.ping_frame(payload, ack=True))
        elif ftype == h2.HEADERS:
            headers: dict[Any, Any] = dict(self.dec.decode(payload))
            self.calls[sid] = (str(headers.get(":path", "")), bytearray())
            if flags & h2.FLAG_END_STREAM:
                self.dispatch(sid)
        elif ftype == h2.DATA:
            call = self.calls.get(sid)
            if call is not None:
                call[1].extend(payload)
                if payload and eng.credit:
                    self.write(h2.window_update_frame(0, len(payload)))
                    self.write(h2.window_update_frame(sid, len(payload)))
                if flags & h2.FLAG_END_STREAM:
                    self.dispatch(sid)
        elif ftype == h2.GOAWAY:
            eng.goaways.append(int.from_bytes(payload[4:8], "big"))
        elif ftype == h2.RST_STREAM:
            eng.resets.append((sid, int.from_bytes(payload, "big")))
            task = self.tasks.pop(sid, None)
            if task is not None:
                task.cancel()

    def dispatch(self, sid: int) -> None:
        path, body = self.calls.pop(sid)
        method = path.rsplit("/", 1)[-1]
        msg = bytes(body[5:])
        eng = self.engine
        if method == "HealthCheck":
            self.unary(sid, sg.HealthCheckResponse(healthy=True).SerializeToString())
        elif method == "GetModelInfo":
            self.unary(sid, eng.model_info)
        elif method == "GetServerInfo":
            self.unary(sid, eng.server_info)
        elif method == "Abort":
            eng.aborts.append(sg.AbortRequest.FromString(msg).request_id)
            self.unary(sid, sg.AbortResponse().SerializeToString())
        elif method == "Generate":
            req = sg.GenerateRequest.FromString(msg)
            eng.generates.append(req.request_id)
            task = asyncio.ensure_future(self._generate(sid, req))
            self.tasks[sid] = task
        else:  # GetLoads, SubscribeKvEvents...: not here
            self.head(
                sid, [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12")], True
            )

    async def _generate(self, sid: int, req: sg.GenerateRequest) -> None:
        try:
            await self.engine.generate(self, sid, req)
        finally:
            self.tasks.pop(sid, None)


async def normal(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
    """A well-behaved engine: three tokens, then the Complete."""
    rid = req.request_id
    conn.head(sid)
    for i in range(3):
        conn.msg(sid, chunk(rid, [72 + i], i + 1))
    conn.msg(sid, complete(rid, [], 3))
    conn.trail(sid)


class HostileEngine:
    """The hostile engine, serving on a thread of its own; ``generate`` answers Generate calls."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.generate: Handler = normal
        self.settings: dict[int, int] = {h2.SETTINGS_MAX_CONCURRENT_STREAMS: 100}
        self.credit = True  # give back the window of the request bodies received
        self.model_info = sg.GetModelInfoResponse(
            served_model_name="m", max_context_length=4096, vocab_size=512, is_generation=True
        ).SerializeToString()
        self.server_info = sg.GetServerInfoResponse(sglang_version="hostile").SerializeToString()
        self.conns: list[EngineConn] = []
        self.resets: list[tuple[int, int]] = []
        self.goaways: list[int] = []  # the error codes of the node's GOAWAY frames
        self.aborts: list[str] = []
        self.generates: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        fut.result(10)

    async def _serve(self) -> None:
        self._server = await self.loop.create_server(lambda: EngineConn(self), "127.0.0.1", self.port)

    def stop(self) -> None:
        async def down() -> None:
            if self._server is not None:
                self._server.close()
            for c in self.conns:
                if c.transport is not None:
                    c.transport.abort()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine's loop (its state is the loop's)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def open_generates(self) -> int:
        """Generate calls the engine still runs (neither ended by it nor reset by the node)."""
        return int(self.call(lambda: sum(len(c.tasks) for c in self.conns)))


# ---------------------------------------------------------------------------------------------- fixtures

CLIENT_TIMEOUT = 60.0  # only keeps a regression from hanging the suite


@pytest.fixture(scope="module")
def tokenizer_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield byte_tokenizer(Path(tmp) / "bytes")


@contextlib.contextmanager
def hostile_node(
    tokenizer_dir: Path, engine: HostileEngine | None = None, *flags: str
) -> Iterator[tuple[HostileEngine, NodeProc]]:
    """A hostile engine (started here unless given) and a node serving model ``m`` from it, both stopped
    on exit (the node by its pid)."""
    from tests.e2e.node_fixtures import QWEN3_TEMPLATE

    eng = engine or HostileEngine(free_port_in_range())
    eng.start()
    node: NodeProc | None = None
    try:
        node = start_node(
            *("--worker-urls", f"sglang://127.0.0.1:{eng.port}", "--model-id", "m"),
            *("--model-path", str(tokenizer_dir), "--chat-template", str(QWEN3_TEMPLATE)),
            *("--cb-failure-threshold", "1000", "--request-timeout-secs", "30"),
            *flags,
            port=free_port_in_range(),
        )
        yield eng, node
    finally:
        if node is not None:
            node.stop()
        eng.stop()


def chat(node: NodeProc, stream: bool = False, max_tokens: int = 5) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(
        node.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=CLIENT_TIMEOUT
    )


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def settles(cond: Callable[[], bool]) -> bool:
    """Whether ``cond`` holds within a bounded number of polls (what the node does next on another
    socket: no ordering with the client's answer)."""
    for _ in range(400):  # bounded
        if cond():
            return True
        time.sleep(0.05)
    return False


def assert_serves(eng: HostileEngine, node: NodeProc) -> None:
    """The node is alive and answers a well-behaved Generate again."""
    eng.generate = normal
    r = chat(node)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ijk", r.text
    assert node.proc.poll() is None


# ---------------------------------------------------------------------------------------------- tests


def test_a_huge_grpc_message_is_bounded_in_the_error_and_the_log(tokenizer_dir: Path) -> None:
    """Trailers with grpc-status 13 and a 60 KB grpc-message (in CONTINUATION frames): the client's error
    carries a bounded text saying it was cut, and the node's log lines stay short (the 60 KB text went
    into every log line and the address scrubbing of the client's message, quadratic in its length:
    ~12 s of a blocked event loop per attempt)."""

    async def huge_status(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
        conn.head(sid)
        conn.trail(sid, 13, "x" * 60_000)

    with hostile_node(tokenizer_dir) as (eng, node):
        eng.generate = huge_status
        r = chat(node)
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert "more characters" in msg and len(msg) < 1000, msg
        r = chat(node, stream=True)
        assert "more characters" in r.text and len(r.text) < 2000, r.text[:300]
        assert_serves(eng, node)
        longest = max(len(line) for line in node.log().splitlines())
        assert longest < 2000, longest


def test_a_continuation_flood_fails_the_connection_not_the_memory(tokenizer_dir: Path) -> None:
    """HEADERS then CONTINUATION frames without END_HEADERS, 128 MB of them: the node gives up on the
    connection (GOAWAY ENHANCE_YOUR_CALM) once the block passes its bound instead of gathering it all
    (the node's RSS grew by the flood's size)."""

    async def flood(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
        conn.write(h2.frame(h2.HEADERS, 0, sid, conn.enc.encode([(":status", "200")])))
        blob = h2.frame(h2.CONTINUATION, 0, sid, b"\0" * 16384)
        for i in range(8192):  # 128 MB
            conn.write(blob)
            if i % 64 == 0:
                await asyncio.sleep(0)
                if conn.transport is None:
                    return
        await asyncio.sleep(3600)

    with hostile_node(tokenizer_dir) as (eng, node):
        before = rss_kb(node.pid)
        eng.generate = flood
        r = chat(node)
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] in ("engine_unavailable", "engine_error"), r.text
        assert rss_kb(node.pid) - before < 64 * 1024, (before, rss_kb(node.pid))
        assert_serves(eng, node)


def test_a_2gb_length_prefix_fails_the_call_at_once(tokenizer_dir: Path) -> None:
    """A message prefix announcing 2 GB, then data trickling in: the call fails at the prefix (a 502
    naming the size) rather than buffering until the request's deadline (a 504, 320 MB later)."""

    async def huge_prefix(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
        conn.head(sid)
        conn.data(sid, _PREFIX.pack(0, 2**31))
        blob = b"\0" * 16384
        for i in range(16384):  # 256 MB, unless the node resets the stream first
            if sid not in conn.tasks or conn.transport is None:
                return
            conn.data(sid, blob)
            if i % 64 == 0:
                await asyncio.sleep(0.001)
        await asyncio.sleep(3600)

    with hostile_node(tokenizer_dir) as (eng, node):
        before = rss_kb(node.pid)
        eng.generate = huge_prefix
        r = chat(node)
        assert r.status_code == 502, r.text
        assert "2147483648 bytes" in r.json()["error"]["message"], r.text
        assert rss_kb(node.pid) - before < 64 * 1024
        assert settles(lambda: eng.open_generates() == 0)  # the node reset the call
        assert_serves(eng, node)


@pytest.mark.parametrize("context", [float("inf"), 1e300, -5.0, float("nan")])
def test_absurd_context_lengths_from_get_server_info(tokenizer_dir: Path, context: float) -> None:
    """GetServerInfo's server_args.context_length infinite (the node died at start: OverflowError),
    1e300 (GET /workers answered 500: not a 64-bit integer), negative, NaN: taken as unknown."""
    from google.protobuf import struct_pb2

    eng = HostileEngine(free_port_in_range())
    args = struct_pb2.Struct()
    args.update({"context_length": 0})
    args.fields["context_length"].number_value = context
    eng.server_info = sg.GetServerInfoResponse(server_args=args).SerializeToString()
    with hostile_node(tokenizer_dir, eng) as (eng, node):
        assert_serves(eng, node)
        r = httpx.get(node.url + "/workers", timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["workers"][0]["healthy"] is True


def test_absurd_get_model_info_values_are_taken_as_unknown() -> None:
    """GetModelInfo with a negative context (every request then refused: 'maximum context length is -7
    tokens'), a negative vocabulary, control characters in the served name."""
    from shepherd.proto.engine_responses import decode_model_info

    info = decode_model_info(
        sg.GetModelInfoResponse(
            served_model_name="m\x1b[31m\n\x00" + "n" * 1000,
            model_path="/p\r\n",
            max_context_length=-7,
            vocab_size=-1,
        )
    )
    assert info.max_context_length == 0 and info.vocab_size == 0
    assert info.served_model_name == "m[31m" + "n" * 251
    assert info.model_path == "/p"


async def runaway(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
    """An engine that ignores max_new_tokens: a token every 10 ms until the node resets the call (bounded
    here by 3,000 tokens: a regression fails on the count, it does not hang)."""
    rid = req.request_id
    conn.head(sid)
    for i in range(3000):
        if sid not in conn.tasks or conn.transport is None or conn.transport.is_closing():
            return
        conn.msg(sid, chunk(rid, [72 + i % 20], i + 1))
        await asyncio.sleep(0.01)


async def overshoot(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
    """An engine answering 50 tokens at once (whole, in its Complete) for any max_new_tokens."""
    rid = req.request_id
    conn.head(sid)
    conn.msg(sid, complete(rid, [72 + i % 20 for i in range(50)], 50, "stop"))
    conn.trail(sid)


def test_an_engine_past_max_tokens_is_cut_there(tokenizer_dir: Path) -> None:
    """An engine sending more tokens than it was asked for: the client gets max_tokens of them and
    finish_reason "length", streamed or not, through the C token step or not, and a streaming engine's
    call is reset (it would otherwise run until the request timeout, flooding the client)."""
    with hostile_node(tokenizer_dir) as (eng, node):
        eng.generate = runaway
        for stream in (False, True):
            before = len(eng.call(lambda: list(eng.resets)))
            r = chat(node, stream=stream, max_tokens=5)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
                reasons = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
                assert reasons[-1] == "length" and len(text) == 5, r.text
            else:
                body = r.json()
                assert body["choices"][0]["finish_reason"] == "length", body
                assert (
                    body["usage"]["completion_tokens"] == 5
                    and len(body["choices"][0]["message"]["content"]) == 5
                )
            assert settles(lambda: eng.open_generates() == 0)
            assert len(eng.call(lambda: list(eng.resets))) > before  # the call was reset, not left running
        eng.generate = overshoot
        body = chat(node, max_tokens=7).json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 7, (
            body
        )
        assert_serves(eng, node)


def test_generate_past_max_new_tokens_is_cut_there(tokenizer_dir: Path) -> None:
    """SGLang's /generate over an engine sending more tokens than asked for: ``max_new_tokens`` of them
    (text, ``output_ids`` and ``completion_tokens`` agree), finish ``length``, streamed or not, and a
    streaming engine's call is reset, as chat's (it would otherwise run on, flooding the client)."""
    with hostile_node(tokenizer_dir) as (eng, node):
        body = {"model": "m", "text": "hi", "sampling_params": {"max_new_tokens": 5}}
        eng.generate = runaway
        for stream in (False, True):
            before = len(eng.call(lambda: list(eng.resets)))
            r = httpx.post(node.url + "/generate", json={**body, "stream": stream}, timeout=CLIENT_TIMEOUT)
            assert r.status_code == 200, r.text
            events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            answer = events[-1] if stream else r.json()
            meta = answer["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 5, answer
            assert len(answer["text"]) == 5 and len(answer["output_ids"]) == 5, answer
            assert settles(lambda: eng.open_generates() == 0)
            assert len(eng.call(lambda: list(eng.resets))) > before  # the call was reset, not left running
        eng.generate = overshoot
        answer = httpx.post(node.url + "/generate", json=body, timeout=CLIENT_TIMEOUT).json()
        assert answer["meta_info"]["finish_reason"]["type"] == "length", answer
        assert len(answer["text"]) == 5 and len(answer["output_ids"]) == 5, answer
        assert_serves(eng, node)


async def fails_midway_naming_a_host(conn: EngineConn, sid: int, req: sg.GenerateRequest) -> None:
    """Two tokens, then an error whose text names an internal address."""
    rid = req.request_id
    conn.head(sid)
    conn.msg(sid, chunk(rid, [72], 1))
    conn.msg(sid, chunk(rid, [73], 2))
    conn.trail(sid, 13, "upstream shard at 10.1.2.3:50051 reset")


def test_an_in_band_engine_error_names_no_address(tokenizer_dir: Path) -> None:
    """An engine failing after the first tokens: the stream's error event says so, without the internal
    address its text named (as the error middleware's answers before a stream starts)."""
    with hostile_node(tokenizer_dir) as (eng, node):
        eng.generate = fails_midway_naming_a_host
        r = chat(node, stream=True)
        assert r.status_code == 200 and "error" in r.text, r.text
        assert "10.1.2.3" not in r.text and "<worker>" in r.text, r.text
