"""Processes inside the test namespaces: started with ``ip netns exec``, output to a log file, stopped by pid.

``ip netns exec`` (and ``env``) exec the command in place, so the pid the harness holds is the pid of the
program itself: SIGSTOP / SIGCONT / SIGKILL reach it directly.

Each process gets PR_SET_PDEATHSIG = SIGKILL (``setpriv --pdeathsig KILL``, which also execs in place):
if the harness dies without cleaning up (SIGKILL, a crash), the kernel kills its processes too. The signal
fires when the *thread* that started the process ends, so processes are started from a long-lived thread
(the harness's main thread), never from a helper thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

FAKETIME_DIRS = (
    "/usr/lib/x86_64-linux-gnu/faketime",
    "/usr/lib/aarch64-linux-gnu/faketime",
    "/usr/lib/faketime",
)


_PDEATHSIG = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


def faketime_lib() -> str | None:
    """The libfaketime shared object, or None when libfaketime is not installed."""
    for d in FAKETIME_DIRS:
        p = Path(d) / "libfaketime.so.1"
        if p.exists():
            return str(p)
    return None


def faketime_env(offset_s: float) -> dict[str, str]:
    """Environment that shifts the wall clock of a process by ``offset_s`` seconds (monotonic untouched)."""
    lib = faketime_lib()
    if lib is None:
        raise RuntimeError("libfaketime is not installed: run chaos/install.sh")
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": f"{offset_s:+.3f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class HostProcess:
    """One program run in a namespace; may be started again after it stopped (same argv, new log segment)."""

    def __init__(
        self, name: str, ns: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ):
        self.name = name
        self.ns = ns
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.starts = 0
        self.ready_start = 0  # the start its owner saw ready (``starts`` then: the running one is)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, extra_env: Mapping[str, str] | None = None, extra_args: Sequence[str] = ()) -> int:
        """Start the program (it must not be running); returns its pid."""
        with self._lock:
            if self.alive():
                raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
            env_pairs = [f"{k}={v}" for k, v in {**self.env, **(extra_env or {})}.items()]
            argv = ["ip", "netns", "exec", self.ns, *_PDEATHSIG, "env", *env_pairs, *self.argv, *extra_args]
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as logf:
                logf.write(f"\n=== start {self.starts + 1}: {' '.join(argv)}\n".encode())
                logf.flush()
                self.proc = subprocess.Popen(
                    argv,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self.paused = False
            self.starts += 1
            return self.proc.pid

    def send(self, sig: int) -> None:
        if self.alive() and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.send(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        self.send(signal.SIGKILL)
        self.wait(5.0)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Stop by pid: ``sig`` (a paused process is resumed first), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.alive():
            if self.paused:
                self.resume()
            self.send(sig)
            if self.wait(timeout) is None:
                self.send(signal.SIGKILL)
                self.wait(5.0)
        return self.proc.returncode

    def rss(self) -> int | None:
        pid = self.pid
        return rss_bytes(pid) if pid is not None and self.alive() else None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode(errors="replace")


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``pred()`` until it is true or ``timeout`` seconds pass (bounded); False when time ran out."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
