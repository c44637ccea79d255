"""``smg-node serve --procs N``: N event-loop processes on one port, one node to the outside.

The parent parses and checks the configuration, then runs no event loop of its own: it starts N
children, each a full node (``smg-node serve`` with the same flags) listening on the same host and port
with ``SO_REUSEPORT`` (the kernel spreads new connections over them), and meshes them on loopback: each
child is a mesh member with a derived name (``<name>-p<i>``) and a mesh port of its own, all seeded
with each other, sealed with a key made at start and authenticated with certificates of a CA made at
start (both in a private temporary directory, removed at exit). Through the mesh they share what one
node's state is: the worker registry (a worker added on one is routable on all), health, the prefix
index, rate limits (each admits its share), API keys and conversation ownership.

Why the mesh and not shared memory: it already replicates all of that, with the semantics a multi-host
deployment has (tested, chaos-tested); its cost on loopback is its timers (probes, gossip) and the
deltas, small against a request's CPU (README "More than one core").

The parent supervises: a child that exits while the parent is not stopping is started again (at once,
then with a back-off while it keeps crashing within a second of its start), but one that exits with a
configuration error at its first start (status 2: a port in use, a store unreachable) stops them all,
and the parent exits with it; SIGTERM / SIGINT are
forwarded to every child (graceful drain), and a child still alive after the drain bound is killed.
Children are signalled by pid (their ``Popen``), and get SIGTERM if the parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shepherd.auth.certs import write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.node.config import NodeConfig, default_node_name

__all__ = ["PROC_INDEX_ENV", "ProcsError", "Supervisor", "child_argv", "free_mesh_ports", "supervise"]

PR_SET_PDEATHSIG = 1
PROC_INDEX_ENV = "SMG_NODE_PROC_INDEX"  # a child's index among the --procs processes (its metrics' ``proc``)
POLL_S = 0.1  # the child check's period where no signal wake-up fd can be set (not the main thread)
IDLE_WAIT_S = 5.0  # otherwise the parent sleeps until a signal (SIGCHLD, SIGTERM), a restart, or this
FAST_CRASH_S = 1.0
CONFIG_ERROR_EXIT = 2  # ``smg-node``'s status for a configuration error (also found at start-up)
MAX_BACKOFF_S = 10.0


class ProcsError(ValueError):
    """A configuration --procs cannot run with."""


def check(cfg: NodeConfig) -> None:
    if cfg.procs < 2:
        return
    if cfg.mesh_port is not None or cfg.mesh_seeds:
        raise ProcsError(
            "--procs > 1 meshes its processes on loopback; joining them to another mesh (--mesh-port, "
            "--mesh-seeds, join) is not supported yet: run one node per host there"
        )
    if cfg.port == 0 or cfg.admin_port == 0:
        raise ProcsError("--procs > 1 needs a fixed --port (and --admin-port): port 0 is a port per process")


def free_mesh_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` port numbers free for both TCP and UDP on ``host`` now (the mesh uses both)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(64 * n):  # bounded: a port whose UDP twin is taken is skipped
            if len(ports) == n:
                break
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind((host, port))
            except OSError:
                tcp.close()
                udp.close()
                continue
            held += [tcp, udp]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < n:
        raise ProcsError(f"could not find {n} free mesh ports on {host}")
    return ports


@dataclass(frozen=True, slots=True)
class MeshFiles:
    keyring: Path
    certs: dict[str, tuple[Path, Path, Path]]  # name -> (cert, key, ca)


def make_mesh_files(directory: Path, names: Sequence[str]) -> MeshFiles:
    """A fresh sealing key and a CA with one certificate per child, in ``directory`` (private)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    keyring = directory / "keyring"
    fd = os.open(keyring, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(Keyring.format_file([generate_key()]))
    pki = write_dev_pki(directory / "pki", names)
    return MeshFiles(keyring, {n: (Path(t.cert), Path(t.key), Path(t.ca)) for n, t in pki.items()})


def child_argv(
    argv: Sequence[str],
    cfg: NodeConfig,
    index: int,
    names: Sequence[str],
    ports: Sequence[int],
    files: MeshFiles,
) -> list[str]:
    """The command line of child ``index``: the parent's own flags, then (winning, being last) one
    process, SO_REUSEPORT and its place in the loopback mesh."""
    name = names[index]
    cert, key, ca = files.certs[name]
    seeds = [f"127.0.0.1:{p}" for i, p in enumerate(ports) if i != index]
    out = [sys.executable, "-m", "shepherd.node.cli", *argv, "--procs", "1", "--reuse-port"]
    out += ["--mesh-port", str(ports[index]), "--mesh-name", name, "--mesh-bind", "127.0.0.1"]
    out += ["--mesh-keyring-file", str(files.keyring), "--mesh-cert", str(cert), "--mesh-key", str(key)]
    out += ["--mesh-ca", str(ca), "--mesh-cluster", f"procs-{os.getpid()}"]
    if seeds:
        out += ["--mesh-seeds", *seeds]
    if cfg.history_backend == "memory":
        # one node's memory history, spread over its processes (the mesh routes a conversation to
        # the process that holds it): as durable as a single process's
        out.append("--history-allow-local")
    return out


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class _Child:
    index: int
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    crash_streak: int = 0
    restart_at: float | None = None
    restarts: int = 0
    exits: list[int] = field(default_factory=list)


class Supervisor:
    """Starts, restarts and stops the children. ``run()`` returns the exit status."""

    def __init__(self, argvs: Sequence[list[str]], *, drain_s: float, log: bool = True) -> None:
        self.children = [_Child(i, list(a)) for i, a in enumerate(argvs)]
        self.drain_s = drain_s
        self.stopping = False
        self.failed = 0  # a child's configuration error: the status run() returns
        self.log = log

    def _say(self, text: str) -> None:
        if self.log:
            print(f"smg-node procs: {text}", file=sys.stderr, flush=True)

    def _start(self, c: _Child) -> None:
        env = dict(os.environ, **{PROC_INDEX_ENV: str(c.index)})
        c.proc = subprocess.Popen(c.argv, env=env, preexec_fn=_pdeathsig)
        c.started = time.monotonic()
        c.restart_at = None

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            self._say(f"signal {signum}: draining {len(self.children)} processes")
            for c in self.children:
                if c.proc is not None and c.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(signal.SIGTERM)

    def _check(self, c: _Child, now: float) -> None:
        if self.stopping:  # a child due a restart in the pass that stopped the node is not started
            return
        if c.proc is None:
            if c.restart_at is not None and now >= c.restart_at:
                self._start(c)
                c.restarts += 1
            return
        code = c.proc.poll()
        if code is None:
            return
        c.exits.append(code)
        lived = now - c.started
        c.proc = None
        if code == CONFIG_ERROR_EXIT and c.restarts == 0:
            # the child said why on stderr (a port in use, a store unreachable at start...): starting it
            # again cannot help; the node stops, as one process would with that error. Only at its first
            # start: a restarted child's 2 (its mesh port now some connection's source port, a store
            # briefly unreachable) is restarted with the back-off like any other exit
            self._say(f"process {c.index} exited with {code} (a configuration error): stopping")
            self.failed = code
            self._on_signal(signal.SIGTERM, None)
            return
        c.crash_streak = c.crash_streak + 1 if lived < FAST_CRASH_S else 0
        delay = 0.0 if c.crash_streak <= 1 else min(MAX_BACKOFF_S, 0.1 * 2**c.crash_streak)
        c.restart_at = now + delay
        self._say(f"process {c.index} exited with {code} after {lived:.1f} s; restarting in {delay:.1f} s")

    def run(self) -> int:
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        wake = _SignalWake.open()  # None: not the main thread, poll every POLL_S instead
        try:
            for c in self.children:
                self._start(c)
            self._say(f"{len(self.children)} processes, pids {' '.join(map(str, self.pids()))}")
            while not self.stopping:
                now = time.monotonic()
                for c in self.children:
                    self._check(c, now)
                if wake is None:
                    time.sleep(POLL_S)
                    continue
                due = [c.restart_at for c in self.children if c.proc is None and c.restart_at is not None]
                wake.wait(min([IDLE_WAIT_S, *(max(0.0, t - time.monotonic()) for t in due)]))
            worst = self._stop()  # drain first; a child's configuration error is the status
            return self.failed or worst
        finally:
            if wake is not None:
                wake.close()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._kill_all()

    def _stop(self) -> int:
        deadline = time.monotonic() + self.drain_s
        worst = 0
        for c in self.children:
            if c.proc is None:
                continue
            try:
                code = c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"process {c.index} (pid {c.proc.pid}) still running after the drain: killed")
                c.proc.kill()
                code = c.proc.wait()
            worst = worst or (code if code > 0 else 0)
        return worst

    def _kill_all(self) -> None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


class _SignalWake:
    """The parent's idle wait: asleep until a child exits (SIGCHLD) or a signal to stop arrives (the
    signal module's wake-up fd), rather than waking ten times a second to poll its children."""

    def __init__(self, r: int, w: int, old_fd: int, old_chld: signal.Handlers | object) -> None:
        self._r, self._w, self._old_fd, self._old_chld = r, w, old_fd, old_chld

    @classmethod
    def open(cls) -> _SignalWake | None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(r)
            os.close(w)
            return None
        old_chld = signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a handler: the fd is written
        return cls(r, w, old_fd, old_chld)

    def wait(self, timeout: float) -> None:
        ready, _, _ = select.select([self._r], [], [], timeout)
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._r, 512):  # bounded by the pipe's contents
                    pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGCHLD, self._old_chld)  # type: ignore[arg-type]
        os.close(self._r)
        os.close(self._w)


def supervise(argv: Sequence[str], cfg: NodeConfig) -> int:
    """Run ``cfg.procs`` children of the node command line ``argv`` (without the program name)."""
    check(cfg)
    n = cfg.procs
    base = (cfg.mesh_name or default_node_name())[:58]
    names = [f"{base}-p{i}" for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix="smg-node-procs-"))
    try:
        files = make_mesh_files(tmp / "mesh", names)
        ports = free_mesh_ports(n)
        argvs = [child_argv(argv, cfg, i, names, ports, files) for i in range(n)]
        sup = Supervisor(argvs, drain_s=cfg.shutdown_grace_secs + 10.0)
        return sup.run()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
