"""Start a real ``smg-mock-engine`` process on loopback for end-to-end tests; always stopped by pid.

    with start_mock_engine("--zero-latency") as engine:
        ... engine.grpc_port, engine.http_port, engine.pid ...

Ports are picked by the engine itself (``--grpc-port 0 --http-port 0`` unless given) and read from
its ready line, so there is no race between choosing a port and binding it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.e2e.logs import log_file

BIN = Path(sys.executable).parent
READY = re.compile(r"mock engine ready grpc=(\S+):(\d+) http=(\S+):(\d+)")


class MockEngineProc:
    """A running mock engine. A context manager; ``stop()`` may also be called directly (idempotent)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, grpc_port: int, http_port: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.grpc_port = grpc_port
        self.http_port = http_port

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal the process by pid and wait; SIGKILL if it does not exit in ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode

    def __enter__(self) -> MockEngineProc:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if exc_type is None:
            self.log_path.unlink(missing_ok=True)


def start_mock_engine(*args: str, timeout: float = 60.0) -> MockEngineProc:
    """Start ``smg-mock-engine *args`` and wait for its ready line (raises with the log if it fails)."""
    argv = [str(BIN / "smg-mock-engine"), *args]
    if "--grpc-port" not in args:
        argv += ["--grpc-port", "0"]
    if "--http-port" not in args:
        argv += ["--http-port", "0"]
    log_path = log_file("smg-mock-engine-")
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            m = READY.search(text)
            if m:
                return MockEngineProc(proc, log_path, int(m.group(2)), int(m.group(4)))
            if proc.poll() is not None:
                raise RuntimeError(f"smg-mock-engine exited with {proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(
            f"smg-mock-engine not ready in {timeout}s:\n{log_path.read_text(errors='replace')}"
        )
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        raise
