"""Start a real ``smg-node`` process on loopback for end-to-end tests; always stopped by pid."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.logs import log_file

BIN = Path(sys.executable).parent


@contextlib.contextmanager
def env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment the node processes started inside inherit (restored on exit)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_RESERVED = range(20_000, 32_000)  # below Linux's ephemeral range (32768-60999): no client socket lands here
_rng = random.Random()
_handed: set[int] = set()  # every port given out in this process: none twice (a test's ports bind later)


def reserved_port() -> int:
    """A port free for TCP and UDP now, for a process that binds it *later* (a mesh node started after
    others already connect to it): ``free_port`` hands out ephemeral ports, which the connections made
    meanwhile may take as their source port; this one is picked below the ephemeral range, and never
    one given out before in this process (a test's ports bind only once its nodes start: one port drawn
    twice by a test, its mesh and its HTTP port, made a node's two listeners collide)."""
    for _ in range(200):  # bounded: almost every port here is free on a test machine
        port = _rng.choice(_RESERVED)
        if port in _handed:
            continue
        try:
            with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                t.bind(("127.0.0.1", port))
                u.bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {_RESERVED}")


def http_status(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@dataclass
class NodeProc:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def start_node(
    *args: str,
    port: int | None = None,
    wait_ready: bool = True,
    timeout: float = 60.0,
    tls: ssl.SSLContext | None = None,
) -> NodeProc:
    """``smg-node serve`` on loopback, polled until ready (or live); ``tls``: its port serves HTTPS, polled
    with that client context."""
    port = port or free_port()
    log_path = log_file("smg-node-")
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(
            [str(BIN / "smg-node"), "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    node = NodeProc(proc, port, log_path)
    deadline = time.monotonic() + timeout
    path = "/readiness" if wait_ready else "/liveness"
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"smg-node exited with {proc.returncode}:\n{node.log()}")
            base = f"https://127.0.0.1:{port}" if tls is not None else node.url
            if http_status(base + path, context=tls) == 200:
                return node
            time.sleep(0.1)
        raise RuntimeError(f"smg-node not ready in {timeout}s:\n{node.log()}")
    except BaseException:
        node.stop(signal.SIGKILL)
        raise


def spawn_node(command: str, *args: str, port: int, log_prefix: str = "smg-node-") -> NodeProc:
    """``smg-node <command>`` (``serve``, ``join``) on ``port``, not waited for (a mesh node whose seeds
    start after it): the caller polls it up and stops it."""
    log_path = log_file(log_prefix)
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(
            [str(BIN / "smg-node"), command, *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return NodeProc(proc, port, log_path)


@contextlib.contextmanager
def running_node(*args: str, **kw: object) -> Iterator[NodeProc]:
    node = start_node(*args, **kw)  # type: ignore[arg-type]
    try:
        yield node
    finally:
        node.stop()


@contextlib.contextmanager
def node_of_models(models: list[dict[str, Any]], *flags: str, **settings: Any) -> Iterator[NodeProc]:
    """A running node over the YAML ``models:`` list ``models`` and ``settings`` (``tokenizer_workers``
    0 unless given), its configuration file in a temporary directory; ``flags`` after ``--config``."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "node.yaml"
        cfg.write_text(yaml.safe_dump({"models": models, "tokenizer_workers": 0, **settings}))
        with running_node("--config", str(cfg), *flags) as n:
            yield n
