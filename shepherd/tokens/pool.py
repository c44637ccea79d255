"""Tokenizer worker processes behind plain pipes, and the async façade the node uses.

``TokenizerPool``: N forked workers, each holding the parent's loaded tokenizers and templates
(copy-on-write), each talking over a pair of pipes with many calls in flight (request ids). Ids come
back as raw ``array('I')`` bytes. The parent side is non-blocking (``loop.add_reader``, buffered writes
with ``add_writer``). A worker that dies (or is killed for overrunning ``call_timeout``) fails its
in-flight calls with ``TokenizerWorkerError`` and is forked again; ``close()`` stops and reaps them all.
Not ``ProcessPoolExecutor``: its round trip costs 230-600 µs here against 17-23 µs for a pipe
(DESIGN §11).

``TokenizerService``: what the node calls. Caches live in the parent (that is where a hit is cheap):
L0/L1 ids and rendered prompts are looked up inline; what is left to do runs inline when small
(``inline_max_chars`` characters still to encode; a render of at most ``render_inline_max_messages``
messages and ``render_inline_max_bytes`` bytes of serialized input) and in the pool otherwise, and
pool results go into the parent's caches. A worker that renders a plain conversation (role and text
messages) sends back the skeleton of its shape (chat_skeleton.py): the parent fills the next
conversation of that shape itself, at any size, with no jinja and no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import struct
import time
from array import array
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from shepherd.tokens.cache import CacheLimits, EncodePlan, TokenCache
from shepherd.tokens.chat_template import ChatTemplate, ChatTemplateError, ClockReads
from shepherd.tokens.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_INLINE_MAX_CHARS",
    "DEFAULT_RENDER_INLINE_MAX_BYTES",
    "DEFAULT_RENDER_INLINE_MAX_MESSAGES",
    "TokenizerPool",
    "TokenizerPoolUnavailable",
    "TokenizerService",
    "TokenizerWorkerError",
]

# Measured with bench/tokenizer_bench.py ("inline thresholds"): below these sizes a pool round trip
# adds more CPU (parent + worker) than the event-loop time it saves. Encodes (qwen3, FastBPE inline
# and in the workers, ~0.09 µs per character): the break-even is at 1,000-2,000 characters still to
# encode ("encode threshold", interleaved, 3 runs; it was 200-500 with plain tokenizers encodes,
# which are 5-10x dearer); renders (qwen3 template, ~40-70 µs per message): at about 8 messages.
# Both rounded up, towards less total CPU.
DEFAULT_INLINE_MAX_CHARS: Final = 2048
DEFAULT_RENDER_INLINE_MAX_MESSAGES: Final = 8
DEFAULT_RENDER_INLINE_MAX_BYTES: Final = 16384

_OP_ENCODE: Final = 1  # payload: pieces; flag: add_special_tokens → counts + ids
_OP_RENDER: Final = 2  # payload: name length u16 + template name + ChatTemplate.serialize() → text
_OP_CRASH: Final = 255  # tests only: the worker exits at once

_REQ: Final = struct.Struct("<IBBHI")  # request id, op, flag, model index, payload length
_RESP: Final = struct.Struct("<IBI")  # request id, status, payload length
_U32: Final = struct.Struct("<I")
_U16: Final = struct.Struct("<H")
_OK, _TEMPLATE_ERROR, _ERROR = 0, 1, 2
_ID_BYTES: Final = array("I").itemsize
assert _ID_BYTES == 4


class TokenizerWorkerError(RuntimeError):
    """A pool worker died (or was killed) with this call in flight, or failed it unexpectedly."""


class TokenizerPoolUnavailable(RuntimeError):
    """The pool has no live worker (closed, or all restarting)."""


# ---- the worker side (runs in the forked child, blocking I/O) ----------------------------------------


def _read_exact(fd: int, n: int, buf: bytearray) -> bool:
    """Append exactly n bytes from fd to buf; False at EOF."""
    want = len(buf) + n
    while len(buf) < want:
        chunk = os.read(fd, want - len(buf))
        if not chunk:
            return False
        buf += chunk
    return True


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pack_pieces(pieces: Sequence[str]) -> bytes:
    blobs = [p.encode("utf-8", "surrogatepass") for p in pieces]
    head = array("I", [len(blobs), *map(len, blobs)])
    return head.tobytes() + b"".join(blobs)


def _unpack_pieces(payload: bytes) -> list[str]:
    (n,) = _U32.unpack_from(payload, 0)
    lens = array("I")
    lens.frombytes(payload[4 : 4 + 4 * n])
    pos = 4 + 4 * n
    out: list[str] = []
    for ln in lens:
        out.append(payload[pos : pos + ln].decode("utf-8", "surrogatepass"))
        pos += ln
    return out


def _handle(
    tokenizers: Sequence[Tokenizer], op: int, flag: int, model: int, payload: bytes
) -> tuple[int, bytes]:
    tok = tokenizers[model]
    if op == _OP_ENCODE:
        counts = array("I")
        ids = array("I")
        for got in tok.cache.encode_pieces(_unpack_pieces(payload), bool(flag)):  # the inline path's
            counts.append(len(got))
            ids.extend(got)
        return _OK, _U32.pack(len(counts)) + counts.tobytes() + ids.tobytes()
    if op == _OP_RENDER:
        (ln,) = _U16.unpack_from(payload, 0)
        name = payload[2 : 2 + ln].decode()
        try:
            text, reads, skeleton = tok.chat_template(name=name).render_serialized_for_parent(
                payload[2 + ln :]
            )
        except ChatTemplateError as e:
            return _TEMPLATE_ERROR, str(e).encode("utf-8", "replace")
        return _OK, orjson.dumps((text, reads, skeleton))
    if op == _OP_CRASH:
        os._exit(3)
    return _ERROR, f"unknown op {op}".encode()


def _worker_main(rfd: int, wfd: int, tokenizers: Sequence[Tokenizer]) -> None:
    buf = bytearray()
    while True:
        buf.clear()
        if not _read_exact(rfd, _REQ.size, buf):
            return
        req_id, op, flag, model, n = _REQ.unpack(buf)
        buf.clear()
        if n and not _read_exact(rfd, n, buf):
            return
        try:
            status, out = _handle(tokenizers, op, flag, model, bytes(buf))
        except Exception as e:  # a bug or a tokenizer error: report it, keep serving
            status, out = _ERROR, f"{type(e).__name__}: {e}".encode("utf-8", "replace")
        _write_all(wfd, _RESP.pack(req_id, status, len(out)) + out)


def _child(rfd: int, wfd: int, tokenizers: Sequence[Tokenizer]) -> None:
    """Entry of a forked worker: shed the parent's state, serve until the request pipe closes."""
    code = 0
    try:
        # The parent's signal handling (asyncio wakeup fd, handlers) is not ours: Ctrl-C goes to the
        # parent, which stops us by closing the pipe; SIGTERM kills.
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Hold no other fd of the parent (listening sockets, other workers' pipes: EOF must mean EOF).
        keep = sorted((rfd, wfd))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 20)
        # Keep the collector off the inherited heap: fewer copy-on-write page copies.
        gc.freeze()
        _worker_main(rfd, wfd, tokenizers)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _reaped(pid: int) -> bool:
    """Reap ``pid`` if it has exited (True also when it is not our child any more)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def _kill_and_reap(pid: int) -> int | None:
    """SIGKILL ``pid`` if it is still our unreaped child, reap it; its wait status (None if it was
    not ours any more: a reaped pid may belong to another process by now, so it is never signalled)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done != 0:
        return status
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


# ---- the parent side ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    future: asyncio.Future[tuple[int, bytes]]
    started: float


@dataclass(slots=True)
class _Worker:
    slot: int
    pid: int
    to_fd: int  # parent writes requests
    from_fd: int  # parent reads responses
    started: float
    inflight: dict[int, _Call] = field(default_factory=dict)
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    alive: bool = True
    death_reason: str = ""


class TokenizerPool:
    """Forked tokenizer workers on pipes. Start and use it from one event loop."""

    def __init__(
        self,
        tokenizers: Sequence[Tokenizer],
        workers: int = 2,
        *,
        call_timeout: float | None = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self.tokenizers = list(tokenizers)
        self.index = {t.name: i for i, t in enumerate(self.tokenizers)}
        self.size = workers
        self.call_timeout = call_timeout
        self._workers: list[_Worker | None] = [None] * workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 1
        self._closed = False
        self._crash_streak = [0] * workers
        self._respawns: dict[int, asyncio.TimerHandle] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self.calls = 0
        self.failures = 0
        self.restarts = 0

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("pool already started")
        self._loop = asyncio.get_running_loop()
        for slot in range(self.size):
            self._spawn(slot)
        if self.call_timeout is not None:
            self._arm_watchdog()

    def pids(self) -> list[int]:
        """Pids of the live workers."""
        return [w.pid for w in self._workers if w is not None and w.alive]

    def alive(self) -> int:
        return sum(1 for w in self._workers if w is not None and w.alive)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (EOF, then SIGKILL after ``timeout``) and reap them."""
        if self._closed:
            return
        self._closed = True
        for h in self._respawns.values():
            h.cancel()
        self._respawns.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
        workers = [w for w in self._workers if w is not None]
        for w in workers:
            if w.alive:
                self._retire(w, "the pool is closing", kill=False)
        deadline = time.monotonic() + timeout
        pending = [w.pid for w in workers]
        while pending:
            pending = [pid for pid in pending if not _reaped(pid)]
            if not pending:
                break
            if time.monotonic() > deadline:
                for pid in pending:
                    _kill_and_reap(pid)
                break
            await asyncio.sleep(0.005)
        self._workers = [None] * self.size

    def _spawn(self, slot: int) -> None:
        assert self._loop is not None
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(req_w)
            os.close(resp_r)
            _child(req_r, resp_w, self.tokenizers)
        os.close(req_r)
        os.close(resp_w)
        os.set_blocking(req_w, False)
        os.set_blocking(resp_r, False)
        w = _Worker(slot=slot, pid=pid, to_fd=req_w, from_fd=resp_r, started=time.monotonic())
        self._workers[slot] = w
        self._loop.add_reader(resp_r, self._on_readable, w)

    def _retire(self, w: _Worker, reason: str, *, kill: bool) -> None:
        """Take ``w`` out of service: close its pipes, (kill and reap it,) fail its calls."""
        if not w.alive:
            return
        w.alive = False
        assert self._loop is not None
        self._loop.remove_reader(w.from_fd)
        if w.wbuf:
            self._loop.remove_writer(w.to_fd)
        for fd in (w.to_fd, w.from_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if kill:
            st = _kill_and_reap(w.pid)
            if st is not None and os.WIFSIGNALED(st):
                reason += f" (signal {os.WTERMSIG(st)})"
            elif st is not None and os.WIFEXITED(st):
                reason += f" (exit status {os.WEXITSTATUS(st)})"
        w.death_reason = reason
        calls, w.inflight = w.inflight, {}
        if calls:
            self.failures += len(calls)
            err = TokenizerWorkerError(
                f"tokenizer worker pid {w.pid} {reason}; {len(calls)} call(s) in flight failed"
            )
            for call in calls.values():
                if not call.future.done():
                    call.future.set_exception(err)

    def _on_death(self, w: _Worker, reason: str) -> None:
        self._retire(w, reason, kill=True)
        if self._closed:
            return
        self.restarts += 1
        lived = time.monotonic() - w.started
        self._crash_streak[w.slot] = self._crash_streak[w.slot] + 1 if lived < 1.0 else 0
        delay = min(5.0, 0.05 * 2 ** self._crash_streak[w.slot]) if self._crash_streak[w.slot] > 1 else 0.0
        assert self._loop is not None
        self._respawns[w.slot] = self._loop.call_later(delay, self._respawn, w.slot)

    def _respawn(self, slot: int) -> None:
        self._respawns.pop(slot, None)
        if not self._closed:
            self._spawn(slot)

    def _arm_watchdog(self) -> None:
        assert self._loop is not None and self.call_timeout is not None
        self._watchdog = self._loop.call_later(max(0.05, self.call_timeout / 4), self._check_timeouts)

    def _check_timeouts(self) -> None:
        if self._closed or self.call_timeout is None:
            return
        now = time.monotonic()
        for w in self._workers:
            if w is not None and w.alive and w.inflight:
                oldest = min(c.started for c in w.inflight.values())
                if now - oldest > self.call_timeout:
                    self._on_death(w, f"was killed: a call ran over {self.call_timeout:g} s")
        self._arm_watchdog()

    # ---- I/O ----------------------------------------------------------------------------------------

    def _on_readable(self, w: _Worker) -> None:
        try:
            chunk = os.read(w.from_fd, 1 << 18)
        except BlockingIOError:
            return
        except OSError as e:
            self._on_death(w, f"pipe failed ({e})")
            return
        if not chunk:
            self._on_death(w, "exited")
            return
        buf = w.rbuf
        buf += chunk
        hsize = _RESP.size
        while len(buf) >= hsize:
            req_id, status, n = _RESP.unpack_from(buf, 0)
            if len(buf) < hsize + n:
                break
            payload = bytes(buf[hsize : hsize + n])
            del buf[: hsize + n]
            call = w.inflight.pop(req_id, None)
            if call is not None and not call.future.done():
                call.future.set_result((status, payload))

    def _on_writable(self, w: _Worker) -> None:
        self._flush(w)

    def _flush(self, w: _Worker) -> None:
        assert self._loop is not None
        try:
            n = os.write(w.to_fd, w.wbuf)
        except BlockingIOError:
            return
        except OSError as e:
            self._on_death(w, f"pipe failed ({e})")
            return
        del w.wbuf[:n]
        if not w.wbuf:
            self._loop.remove_writer(w.to_fd)

    def _pick(self) -> _Worker:
        best: _Worker | None = None
        for w in self._workers:
            if w is not None and w.alive and (best is None or len(w.inflight) < len(best.inflight)):
                best = w
        if best is None:
            raise TokenizerPoolUnavailable(
                "no tokenizer worker is running" + (" (closed)" if self._closed else "")
            )
        return best

    async def _call(self, op: int, flag: int, model: int, payload: bytes) -> bytes:
        if self._loop is None:
            raise TokenizerPoolUnavailable("the tokenizer pool is not started")
        w = self._pick()
        req_id = self._next_id
        self._next_id = (req_id + 1) & 0xFFFFFFFF or 1
        fut: asyncio.Future[tuple[int, bytes]] = self._loop.create_future()
        w.inflight[req_id] = _Call(fut, time.monotonic())
        self.calls += 1
        frame = _REQ.pack(req_id, op, flag, model, len(payload)) + payload
        if w.wbuf:
            w.wbuf += frame
        else:
            try:
                n = os.write(w.to_fd, frame)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._on_death(w, f"pipe failed ({e})")
                n = len(frame)
            if n < len(frame) and w.alive:
                w.wbuf += frame[n:]
                self._loop.add_writer(w.to_fd, self._on_writable, w)
        try:
            status, out = await fut
        finally:
            w.inflight.pop(req_id, None)
        if status == _OK:
            return out
        message = out.decode("utf-8", "replace")
        if status == _TEMPLATE_ERROR:
            raise ChatTemplateError(message)
        raise TokenizerWorkerError(f"tokenizer worker pid {w.pid} failed the call: {message}")

    # ---- operations -----------------------------------------------------------------------------------

    def model_index(self, model: str) -> int:
        try:
            return self.index[model]
        except KeyError:
            raise KeyError(f"model {model!r} is not in the tokenizer pool") from None

    async def encode(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """``Tokenizer.encode_uncached`` in a worker."""
        return (await self.encode_pieces(model, [text], add_special_tokens))[0]

    async def encode_pieces(
        self, model: str, pieces: Sequence[str], add_special_tokens: bool
    ) -> list[list[int]]:
        """Each piece encoded on its own (with ``add_special_tokens``), in one worker call."""
        out = await self._call(
            _OP_ENCODE, int(add_special_tokens), self.model_index(model), _pack_pieces(pieces)
        )
        (n,) = _U32.unpack_from(out, 0)
        counts = array("I")
        counts.frombytes(out[4 : 4 + 4 * n])
        ids = array("I")
        ids.frombytes(out[4 + 4 * n :])
        flat = ids.tolist()
        if n == 1:
            return [flat]
        result: list[list[int]] = []
        pos = 0
        for c in counts:
            result.append(flat[pos : pos + c])
            pos += c
        return result

    async def render(self, model: str, template_name: str, serialized: bytes) -> tuple[str, ClockReads]:
        """``ChatTemplate.render_serialized_for_parent`` in a worker, less the skeleton (raises
        ChatTemplateError as inline does): the text and the clock reads it made."""
        text, reads, _ = await self.render_with_skeleton(model, template_name, serialized)
        return text, reads

    async def render_with_skeleton(
        self, model: str, template_name: str, serialized: bytes
    ) -> tuple[str, ClockReads, Any]:
        """``render`` plus the skeleton the worker holds for the conversation's shape when it is a
        plain one (``ChatTemplate.render_serialized_for_parent``), else None."""
        name = template_name.encode()
        out = await self._call(
            _OP_RENDER, 0, self.model_index(model), _U16.pack(len(name)) + name + serialized
        )
        text, reads, skeleton = orjson.loads(out)
        return text, tuple((fmt, value) for fmt, value in reads), skeleton

    async def crash_worker_for_test(self) -> None:
        """Make one worker exit mid-call (tests: the call fails with TokenizerWorkerError)."""
        await self._call(_OP_CRASH, 0, 0, b"")


class TokenizerService:
    """The node's tokenizer façade: caches in this process, big work in the pool.

    ``models`` maps a served model name to its tokenizer directory (or to a loaded ``Tokenizer`` of
    that name, shared as it is); ``chat_templates`` optionally overrides a model's template (a
    ``.jinja`` path, a template name, or template text) for the ones loaded here.
    ``workers=0`` runs everything inline (no processes).
    """

    def __init__(
        self,
        models: Mapping[str, str | Path | Tokenizer],
        workers: int = 2,
        inline_max_chars: int | None = None,
        *,
        render_inline_max_bytes: int | None = None,
        render_inline_max_messages: int | None = None,
        chat_templates: Mapping[str, str | Path] | None = None,
        cache_limits: CacheLimits | None = None,
        call_timeout: float | None = 120.0,
    ) -> None:
        self._paths = {name: p if isinstance(p, Tokenizer) else Path(p) for name, p in models.items()}
        self._overrides = dict(chat_templates or {})
        self.workers = workers
        self.inline_max_chars = DEFAULT_INLINE_MAX_CHARS if inline_max_chars is None else inline_max_chars
        self.render_inline_max_bytes = (
            DEFAULT_RENDER_INLINE_MAX_BYTES if render_inline_max_bytes is None else render_inline_max_bytes
        )
        self.render_inline_max_messages = (
            DEFAULT_RENDER_INLINE_MAX_MESSAGES
            if render_inline_max_messages is None
            else render_inline_max_messages
        )
        self._cache_limits = cache_limits
        self._call_timeout = call_timeout
        self._tokenizers: dict[str, Tokenizer] = {}
        self._pool: TokenizerPool | None = None
        self.inline_encodes = 0
        self.pool_encodes = 0
        self.inline_renders = 0
        self.pool_renders = 0
        self.pool_fallbacks = 0

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every tokenizer (here, once), then fork the pool (which inherits them)."""
        for name, path in self._paths.items():
            if name in self._tokenizers:
                continue
            if isinstance(path, Tokenizer):
                if path.name != name:
                    raise ValueError(f"tokenizer named {path.name!r} given for model {name!r}")
                self._tokenizers[name] = path
            else:
                self._tokenizers[name] = Tokenizer.load(
                    path, name, chat_template=self._overrides.get(name), cache_limits=self._cache_limits
                )
        if self.workers > 0 and self._pool is None:
            self._pool = TokenizerPool(
                list(self._tokenizers.values()), self.workers, call_timeout=self._call_timeout
            )
            await self._pool.start()
        for tok in self._tokenizers.values():  # after the fork: the workers never decode
            tok.build_fast_decoder()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> TokenizerPool | None:
        return self._pool

    # ---- lookups -----------------------------------------------------------------------------------

    def get(self, model: str) -> Tokenizer:
        try:
            return self._tokenizers[model]
        except KeyError:
            if model in self._paths:
                raise KeyError(f"tokenizer of {model!r} is not loaded yet (call start())") from None
            raise KeyError(f"unknown model {model!r}") from None

    def models(self) -> list[str]:
        return list(self._paths)

    # ---- work --------------------------------------------------------------------------------------------

    async def encode(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` (equal to ``Tokenizer.encode_uncached``): cache hits and small remainders
        inline, big remainders in the pool; results land in this process's caches."""
        got = self._encode_here(model, self.get(model).cache, text, add_special_tokens)
        return got if isinstance(got, list) else await got

    def _encode_here(
        self, model: str, cache: TokenCache, text: str, add_special_tokens: bool
    ) -> list[int] | Awaitable[list[int]]:
        """The ids when the caches and a small inline encode give them (no await in the common case),
        else the pool's, to await."""
        chars = cache.encoded_chars
        got = cache.encode_or_plan(
            text, add_special_tokens, self.inline_max_chars if self._pool is not None else None
        )
        if isinstance(got, EncodePlan):
            return self._encode_planned(model, cache, got)
        self.inline_encodes += cache.encoded_chars != chars  # (cache hits alone encode nothing)
        return got

    async def _encode_planned(self, model: str, cache: TokenCache, plan: EncodePlan) -> list[int]:
        """What the caches left over, encoded in the pool (inline when it is unavailable)."""
        pieces = plan.missing_pieces()
        if self._pool is not None:
            try:
                encoded = await self._pool.encode_pieces(model, pieces, plan.piece_add_special)
            except TokenizerPoolUnavailable:
                self.pool_fallbacks += 1
            else:
                self.pool_encodes += 1
                return cache.complete(plan, encoded)
        self.inline_encodes += 1
        return cache.complete(plan, cache.encode_pieces(pieces, plan.piece_add_special))

    async def render(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered prompt (``Tokenizer.render_chat``), big renders in the pool."""
        tpl = self.get(model).chat_template(tools=tools is not None)
        text = self._rendered(
            model, tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        return text if isinstance(text, str) else await text

    def _rendered(
        self,
        model: str,
        tpl: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str | Awaitable[str]:
        """The render when it is cheap here (no await in the common case), else the pool's, to await."""
        text, key = self._render_here(
            tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        if text is not None:
            return text
        assert key is not None
        return self._render_in_pool(
            model, tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )

    def _render_here(
        self,
        tpl: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[str | None, bytes | None]:
        """``(the render, its cache key)`` when it is cheap here: a skeleton fill (a conversation shape
        seen before, at any size: no cache key then), a render-cache hit, a small render; else
        ``(None, the serialized inputs)``: the pool should render it.

        A skeleton fill costs about what the render cache's key and lookup cost, so conversations it
        fills skip that cache (an identical request is filled again); the cache serves the others."""
        if not continue_final_message:
            text = tpl.render_from_skeleton(messages, tools, add_generation_prompt, template_kwargs)
            if text is not None:
                self.inline_renders += 1
                return text, None
        key = tpl.serialize(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        text = tpl.cached(key)
        if text is not None:
            return text, key
        if self._pool is not None and key is not None and self._render_is_big(messages, key):
            return None, key
        text = self._render_inline(
            tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        return text, key

    def _render_inline(
        self,
        tpl: ChatTemplate,
        key: bytes | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """Render on the event loop and cache the result under ``key`` (None: not cacheable)."""
        self.inline_renders += 1
        text, reads = tpl.render_recorded(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        tpl.store(key, text, reads)
        return text

    async def _render_in_pool(
        self,
        model: str,
        tpl: ChatTemplate,
        key: bytes,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        assert self._pool is not None
        try:
            text, reads, skeleton = await self._pool.render_with_skeleton(model, tpl.name, key)
        except TokenizerPoolUnavailable:
            self.pool_fallbacks += 1
            return self._render_inline(
                tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
        self.pool_renders += 1
        if skeleton is not None:  # the next conversation of this shape is filled here
            tpl.adopt_skeleton(messages, add_generation_prompt, template_kwargs, skeleton)
        tpl.store(key, text, reads)
        return text

    def _render_is_big(self, messages: object, key: bytes) -> bool:
        count = len(messages) if isinstance(messages, Sequence) else 0
        return count > self.render_inline_max_messages or len(key) > self.render_inline_max_bytes

    async def render_and_encode(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered chat prompt and its ids. The ids are encoded with ``add_special_tokens=False``,
        as transformers' ``apply_chat_template(tokenize=True)`` does: templates write BOS themselves.

        One synchronous pass when everything is cheap here (the common case), the pool otherwise."""
        tok = self._tokenizers.get(model) or self.get(model)
        tpl = tok.chat_template(tools=tools is not None)
        rendered = self._rendered(
            model, tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        text = rendered if isinstance(rendered, str) else await rendered
        got = self._encode_here(model, tok.cache, text, False)
        return text, got if isinstance(got, list) else await got

    def stats(self) -> dict[str, int]:
        """Counters summed over models: ``l0_hits``/``l0_misses``/``l1_hits``/``l1_misses``/
        ``render_hits``/``render_misses`` plus sizes and pool figures."""
        out: dict[str, int] = {}
        for tok in self._tokenizers.values():
            for k, v in tok.cache.stats().items():
                out[k] = out.get(k, 0) + v
            for tpl in tok.templates.values():
                out["render_hits"] = out.get("render_hits", 0) + tpl.hits
                out["render_misses"] = out.get("render_misses", 0) + tpl.misses
        out.setdefault("render_hits", 0)
        out.setdefault("render_misses", 0)
        out["inline_encodes"] = self.inline_encodes
        out["pool_encodes"] = self.pool_encodes
        out["inline_renders"] = self.inline_renders
        out["pool_renders"] = self.pool_renders
        out["pool_fallbacks"] = self.pool_fallbacks
        pool = self._pool
        out["pool_calls"] = pool.calls if pool else 0
        out["pool_failures"] = pool.failures if pool else 0
        out["pool_restarts"] = pool.restarts if pool else 0
        out["pool_workers_alive"] = pool.alive() if pool else 0
        return out
