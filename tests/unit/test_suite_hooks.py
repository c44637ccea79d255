"""The suite's own hooks (``tests/conftest.py``), run in an inner pytest: a SIGTERM ends a run through
its teardowns (the processes its tests started are stopped), and a timeout shows the event loop's tasks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

INNER_SIGTERM = """
import subprocess, sys, time
import pytest

@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p
    p.kill()
    p.wait()

def test_waits(child):
    with open("{pidfile}", "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
"""

INNER_TIMEOUT = """
import asyncio

async def stuck_here():
    await asyncio.Event().wait()

async def test_hangs():
    await asyncio.create_task(stuck_here(), name="the-stuck-task")
"""


def _pytest(test_file: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
        "-o", "asyncio_mode=auto", "--rootdir", str(test_file.parent), *extra, str(test_file),
    ]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_ends_the_run_through_its_teardowns(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    test_file = tmp_path / "test_inner_sigterm.py"
    test_file.write_text(INNER_SIGTERM.replace("{pidfile}", str(pidfile)))
    inner = subprocess.Popen(_pytest(test_file), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child = 0
    try:
        for _ in range(600):  # bounded: 60 s for the inner run to start its child
            if pidfile.exists() and pidfile.read_text():
                child = int(pidfile.read_text())
                break
            time.sleep(0.1)
        assert child, "the inner test did not start its child"
        inner.send_signal(signal.SIGTERM)
        out, _ = inner.communicate(timeout=60)
        assert b"KeyboardInterrupt" in out, out.decode(errors="replace")[-2000:]
        for _ in range(100):  # bounded: the fixture's kill is done before the inner pytest exits
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child), "the fixture's teardown did not run: its child outlived the run"
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_timeout_shows_where_the_loops_tasks_wait(tmp_path: Path) -> None:
    test_file = tmp_path / "test_inner_timeout.py"
    test_file.write_text(INNER_TIMEOUT)
    done = subprocess.run(
        _pytest(test_file, "--timeout=2"), cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Timeout: the event loop's tasks" in out, out[-3000:]
    assert "task the-stuck-task (pending):" in out
    assert "in stuck_here" in out  # the await chain down to the frame that waits
