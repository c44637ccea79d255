"""Tokenizer worker processes behind plain pipes: the parent side.

``TokenizerPool``: N forked workers, each holding the parent's loaded tokenizers and templates
(copy-on-write), each talking over a pair of pipes with many calls in flight (request ids). Ids come
back as raw ``array('I')`` bytes. The parent side is non-blocking (``loop.add_reader``, buffered writes
with ``add_writer``; a worker with ``WBUF_MAX`` bytes of requests unread takes no more). A worker that
dies (or is killed for overrunning ``call_timeout``) fails its in-flight calls with ``TokenizerWorkerError``
and is forked again; a call it failed that way is asked once more of the pool (the work is a pure function),
unless it is the one that ran over. A call whose caller gave up stays in its worker's in-flight table
until the worker answers it (the watchdog's clock, the picking's load: a wedged worker is seen and
avoided, not fed). Calls of more than ``HEAVY_BYTES`` (a prompt of hundreds of kilobytes: seconds of
BPE for a long run of letters) take at most N - 1 workers at once, the others waiting in the parent (a
caller that gives up there costs nothing), and the other calls go to a worker without one: a few big
prompts cannot hold every worker while the small requests of everyone else wait behind them.
``close()`` stops and reaps them all.
Not ``ProcessPoolExecutor``: its round trip costs 230-600 µs here against 17-23 µs for a pipe
(DESIGN §11). The worker side and the pipe format are in pool_worker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from shepherd.tokens.chat_messages import ChatTemplateError
from shepherd.tokens.chat_template import ClockReads
from shepherd.tokens.pool_worker import (
    _OK,
    _OP_CRASH,
    _OP_ENCODE,
    _OP_RENDER,
    _REQ,
    _RESP,
    _TEMPLATE_ERROR,
    _U16,
    _U32,
    _child,
    _pack_pieces,
)
from shepherd.tokens.tokenizer import Tokenizer

__all__ = [
    "HEAVY_BYTES",
    "TokenizerPool",
    "TokenizerPoolUnavailable",
    "TokenizerWorkerError",
]


class TokenizerWorkerError(RuntimeError):
    """A pool worker died (or was killed) with this call in flight, or failed it unexpectedly.
    ``retryable``: the worker died with the call in flight, not because of it (asked again once)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


# a worker with this many bytes of requests it has not read yet takes no more (stopped, stuck in a call, or
# far behind): new calls go to another, or inline; the watchdog settles whether it is wedged
WBUF_MAX = 32 << 20
# a call's payload past which it is heavy: at most N - 1 of those run at once (see the module docstring)
HEAVY_BYTES = 256 << 10


class TokenizerPoolUnavailable(RuntimeError):
    """The pool has no live worker (closed, or all restarting)."""


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


@dataclass(slots=True)
class _Call:
    future: asyncio.Future[tuple[int, bytes]]
    started: float
    # a heavy call's slot of the heavy lane: given back when the worker is done with the call (answered,
    # or the worker gone), not when its caller gives up: the worker grinds on until then
    lane: asyncio.Semaphore | None = None


@dataclass(slots=True)
class _Worker:
    slot: int
    pid: int
    to_fd: int  # parent writes requests
    from_fd: int  # parent reads responses
    started: float
    inflight: dict[int, _Call] = field(default_factory=dict)
    heavy: int = 0  # heavy calls among them
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    alive: bool = True
    death_reason: str = ""


def _done(w: _Worker, call: _Call) -> None:
    """``call`` has left ``w``'s in-flight table: its heavy-lane slot back."""
    if call.lane is not None:
        w.heavy -= 1
        call.lane.release()


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
        self._heavy_lane: asyncio.Semaphore | None = None  # (made on the pool's loop, at start)
        self._next_id = 1
        self._closed = False
        self._crash_streak = [0] * workers
        self._respawns: dict[int, asyncio.TimerHandle] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self.calls = 0
        self.failures = 0
        self.retries = 0
        self.restarts = 0

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("pool already started")
        self._loop = asyncio.get_running_loop()
        self._heavy_lane = asyncio.Semaphore(max(1, self.size - 1))
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

    def _retire(self, w: _Worker, reason: str, *, kill: bool, culprit: int | None = None) -> None:
        """Take ``w`` out of service: close its pipes, (kill and reap it,) fail its calls (all but
        ``culprit``, the call that ran over, may be asked again)."""
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
        for call in calls.values():
            _done(w, call)
        if calls:
            self.failures += len(calls)
            message = f"tokenizer worker pid {w.pid} {reason}; {len(calls)} call(s) in flight failed"
            for req_id, call in calls.items():
                if not call.future.done():
                    call.future.set_exception(TokenizerWorkerError(message, retryable=req_id != culprit))

    def _on_death(self, w: _Worker, reason: str, culprit: int | None = None) -> None:
        self._retire(w, reason, kill=True, culprit=culprit)
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
                req_id, oldest = min(((r, c.started) for r, c in w.inflight.items()), key=lambda rc: rc[1])
                if now - oldest > self.call_timeout:
                    self._on_death(w, f"was killed: a call ran over {self.call_timeout:g} s", req_id)
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
            if call is not None:
                _done(w, call)
                if not call.future.done():
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
        """The live worker with room for a call: one without a heavy call first, then the least loaded."""
        best: _Worker | None = None
        best_key = (0, 0)
        for w in self._workers:
            if w is not None and w.alive and len(w.wbuf) <= WBUF_MAX:
                key = (w.heavy, len(w.inflight))
                if best is None or key < best_key:
                    best, best_key = w, key
        if best is None:
            raise TokenizerPoolUnavailable(
                "no tokenizer worker is running" + (" (closed)" if self._closed else "")
            )
        return best

    async def _call(self, op: int, flag: int, model: int, payload: bytes) -> bytes:
        heavy = len(payload) > HEAVY_BYTES
        try:
            return await self._call_once(op, flag, model, payload, heavy)
        except TokenizerWorkerError as e:
            if not e.retryable:
                raise
            self.retries += 1  # its worker died with it in flight: once more, on the pool as it is now
            return await self._call_once(op, flag, model, payload, heavy)

    async def _call_once(self, op: int, flag: int, model: int, payload: bytes, heavy: bool) -> bytes:
        if self._loop is None:
            raise TokenizerPoolUnavailable("the tokenizer pool is not started")
        lane = self._heavy_lane if heavy else None
        if lane is not None:
            await lane.acquire()  # (a caller gone while it waits here was never sent)
        try:
            w = self._pick()
        except BaseException:
            if lane is not None:
                lane.release()
            raise
        req_id = self._next_id
        self._next_id = (req_id + 1) & 0xFFFFFFFF or 1
        fut: asyncio.Future[tuple[int, bytes]] = self._loop.create_future()
        w.inflight[req_id] = _Call(fut, time.monotonic(), lane)
        if lane is not None:
            w.heavy += 1
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
        # (the answer pops the call; a caller that gives up leaves it: see the module's docstring)
        status, out = await fut
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
