"""Suite-wide hooks. A test that runs over pytest-timeout's limit inside an event loop shows, besides the
threads' stacks, where each of the loop's tasks is suspended (the chain of awaits down to the innermost
frame): a hung ``await`` is otherwise only the loop waiting in ``select``. And a SIGTERM to pytest (a CI
job's time limit, ``kill``) ends the run as Ctrl-C does, through every ``finally`` and fixture teardown, so
the engines, nodes and services the tests started are stopped by pid instead of left running."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import pytest_timeout  # type: ignore[import-untyped]

_MAX_DEPTH = 64  # awaits followed per task (bounded)
_FRAME_ATTRS = ("cr_frame", "gi_frame", "ag_frame")  # a coroutine's, a generator's, an async generator's
_AWAIT_ATTRS = ("cr_await", "gi_yieldfrom", "ag_await")


def _await_frames(obj: Any) -> Iterator[FrameType]:
    """The frames of a coroutine (or generator) and of what it awaits, outermost first."""
    for _ in range(_MAX_DEPTH):
        if obj is None:
            return
        frame = next((f for a in _FRAME_ATTRS if (f := getattr(obj, a, None)) is not None), None)
        if frame is not None:
            yield frame
        obj = next((o for a in _AWAIT_ATTRS if (o := getattr(obj, a, None)) is not None), None)


def task_stacks() -> list[str]:
    """One block per task of the loop running in this thread: its name, state and await chain."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop running in this thread
        return []
    out = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        lines = [f"task {task.get_name()} ({'done' if task.done() else 'pending'}):"]
        frames = _await_frames(task.get_coro())
        lines.extend(f"  {f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in frames)
        waiter = getattr(task, "_fut_waiter", None)
        if waiter is not None:
            lines.append(f"  waiting on {waiter!r}"[:400])
        out.append("\n".join(lines))
    return out


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionstart(session: pytest.Session) -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):
        signal.signal(signal.SIGTERM, _terminated)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's signal method, with the running loop's task stacks dumped before its own report."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # the plugin's own way (a thread: no loop to look at from there)

    def handler(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        stacks = task_stacks()
        if stacks:
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title="Timeout: the event loop's tasks")
            terminal.line("\n".join(stacks))
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
