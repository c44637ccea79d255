"""Start and stop the processes a benchmark runs (mock engine, node, peer gateways).

Each process is started in its own session, pinned to CPUs with ``taskset -c`` when asked, with its
output in a log file, and with a parent-death signal so it does not outlive a killed benchmark.
``ProcessGroup`` is a context manager that always stops what it started, by pid (SIGTERM, then
SIGKILL after a grace period), descendants included, also on errors and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from shepherd.loadgen.procstat import read_stat, tree_pids

PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    """A process exited early or did not become ready in time."""


@dataclass(frozen=True, slots=True)
class ProcSpec:
    """How to run one process and how to know it is ready (an HTTP GET answering 200)."""

    name: str
    argv: tuple[str, ...]
    cpus: str | None = None  # a taskset CPU list, e.g. "1" or "0,1"
    env: Mapping[str, str] = field(default_factory=dict)  # added to the inherited environment
    ready_port: int | None = None
    ready_path: str = "/health"
    ready_host: str = "127.0.0.1"
    ready_timeout_s: float = 60.0
    cwd: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def pin_self(cpus: Sequence[int]) -> bool:
    """Pin the calling process to ``cpus``; False when that is not possible here."""
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    wanted = {c for c in cpus if c in available}
    if not wanted or not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, wanted)
    return True


def parse_cpu_list(text: str) -> list[int]:
    """``"0,2-3"`` → ``[0, 2, 3]`` (taskset's list syntax)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def _set_parent_death_signal() -> None:
    """In the child before exec: get SIGTERM when the benchmark process dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def http_get_status(host: str, port: int, path: str, timeout_s: float = 1.0) -> int | None:
    """The status of ``GET path``, or None when the server cannot be reached."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


class ManagedProcess:
    """One started process; ``stop()`` is idempotent."""

    def __init__(self, spec: ProcSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._family: dict[int, int] = {}  # pid -> starttime, descendants seen while running

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RuntimeError(f"{self.spec.name} not started")
        return self._popen.pid

    def start(self) -> None:
        argv = list(self.spec.argv)
        if self.spec.cpus is not None:
            taskset = shutil.which("taskset")
            if taskset is not None:
                argv = [taskset, "-c", self.spec.cpus, *argv]
        env = dict(os.environ)
        env.update(self.spec.env)
        with open(self.log_path, "wb") as log:
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.spec.cwd,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal,
            )

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def wait_ready(self) -> None:
        """Poll ``GET ready_path`` until it answers 200; raise if the process exits or time runs out."""
        spec = self.spec
        if spec.ready_port is None:
            return
        deadline = time.monotonic() + spec.ready_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessFailed(f"{spec.name} exited during start-up:\n{self.log_tail()}")
            status = http_get_status(spec.ready_host, spec.ready_port, spec.ready_path)
            if status == 200:
                self.remember_family()
                return
            time.sleep(0.1)
        raise ProcessFailed(
            f"{spec.name} not ready at http://{spec.ready_host}:{spec.ready_port}{spec.ready_path} "
            f"after {spec.ready_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def remember_family(self) -> None:
        """Note the current descendants, so that ``stop()`` can end them even if the root dies first."""
        if not self.alive():
            return
        for pid in tree_pids(self.pid):
            if pid == self.pid:
                continue
            st = read_stat(pid)
            if st is not None:
                self._family[pid] = st.starttime

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; then the same for descendants left behind."""
        popen = self._popen
        if popen is None:
            return None
        if popen.poll() is None:
            self.remember_family()
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=grace_s)
        self._stop_family(grace_s)
        return popen.returncode

    def _stop_family(self, grace_s: float) -> None:
        left = {pid: start for pid, start in self._family.items() if _same_process(pid, start)}
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            left = {pid: start for pid, start in left.items() if _same_process(pid, start)}
            if left:
                time.sleep(0.05)
        for pid, start in left.items():
            if _same_process(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._family.clear()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _same_process(pid: int, starttime: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.starttime == starttime and st.state != "Z"


class ProcessGroup:
    """Processes started for one benchmark; all stopped, newest first, on exit of the ``with``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[ManagedProcess] = []

    def start(self, spec: ProcSpec) -> ManagedProcess:
        """Start ``spec`` and wait until it is ready (it is stopped again if it never is)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = ManagedProcess(spec, self.log_dir)
        self._procs.append(proc)
        proc.start()
        proc.wait_ready()
        return proc

    def stop_all(self) -> None:
        while self._procs:
            proc = self._procs.pop()
            with contextlib.suppress(Exception):
                proc.stop()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()
