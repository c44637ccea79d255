"""README command 1 (`make run` -> shepherd.node.devrun): a mock engine and a node on embedded defaults."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.node_procs import http_status, reserved_port


@pytest.mark.parametrize(
    ("stop", "background"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["ctrl-c", "sigterm", "sigint-to-a-background-job"],
)
def test_devrun_serves_a_chat_and_stops_both_processes(stop: signal.Signals, background: bool) -> None:
    """``background``: started as a shell script's ``... &`` starts it, SIGINT ignored (inherited): a
    ``kill -INT`` stops it all the same."""
    ports: set[int] = set()
    while len(ports) < 3:  # bounded: three distinct ports below the ephemeral range (free_port closes its
        ports.add(reserved_port())  # socket: two calls may hand out one port, or a client take it meanwhile)
    port, grpc_port, http_port = sorted(ports)
    env = {
        **os.environ,
        "SMG_PORT": str(port),
        "SMG_ENGINE_GRPC_PORT": str(grpc_port),
        "SMG_ENGINE_HTTP_PORT": str(http_port),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "shepherd.node.devrun"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its group: whatever of it is left is stopped below, also on failure
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None,
    )
    try:
        _serve_then_stop(proc, stop, port, http_port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _serve_then_stop(proc: subprocess.Popen[bytes], stop: signal.Signals, port: int, http_port: int) -> None:
    try:
        deadline = time.monotonic() + 90
        while http_status(f"http://127.0.0.1:{port}/readiness") != 200:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "node never became ready"
            time.sleep(0.2)
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # both children went with it
    assert http_status(f"http://127.0.0.1:{port}/liveness") == 0
    assert http_status(f"http://127.0.0.1:{http_port}/health") == 0
