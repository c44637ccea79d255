"""PostgreSQL and Redis for the storage tests: installed from Debian when missing, run on a private
loopback port and a private temp directory, stopped by process group (docs/DESIGN.md §12).

``python -m tests.services install`` installs the Debian packages ``postgresql`` and ``redis-server``
when their binaries are missing (root and apt-get; ``make test`` runs it first). ``postgres_service()``
and ``redis_service()`` are context managers the session fixtures of tests/storage use: each starts one
server, waits (a bounded loop) until it answers, and stops it on exit, tests failed or not.

PostgreSQL refuses to run as root: as root, ``initdb`` and ``postgres`` run as the ``postgres`` OS user
(``setpriv``, else ``runuser``), with the socket directory inside the temp directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

IN_CI = os.environ.get("CI", "").lower() == "true"
READY_POLLS = 400  # x 0.05 s: the bound on waiting for a server to answer
POSTGRES_USER = "postgres"


class ServiceError(RuntimeError):
    """A service cannot be installed or started (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    port: int
    url: str  # postgresql://postgres@127.0.0.1:P/postgres or redis://127.0.0.1:P/0
    pid: int
    directory: Path


def postgres_bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin holding ``postgres`` and ``initdb`` (None: none)."""
    found: list[tuple[int, Path]] = []
    for p in glob.glob("/usr/lib/postgresql/*/bin/postgres"):
        d = Path(p).parent
        ver = d.parent.name
        if ver.isdigit() and (d / "initdb").exists():
            found.append((int(ver), d))
    return max(found)[1] if found else None


def redis_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )


def missing_packages() -> list[str]:
    missing = []
    if postgres_bin_dir() is None:
        missing.append("postgresql")
    if redis_binary() is None:
        missing.append("redis-server")
    if shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy"):
        missing.append("haproxy")  # (the PROXY protocol test's load balancer)
    return missing


def install() -> list[str]:
    """Install the Debian packages whose binaries are missing; the packages installed. Raises
    ``ServiceError`` when some are missing and this is not root with apt-get."""
    missing = missing_packages()
    if not missing:
        return []
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ServiceError(f"{', '.join(missing)} missing and this is not root with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    still = missing_packages()
    if still:
        raise ServiceError(f"installed {missing} but {still} still missing")
    # Debian's packages start their own system servers: the tests never use those
    return missing


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres_user(argv: list[str]) -> list[str]:
    """``argv`` run as the postgres OS user when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={POSTGRES_USER}", f"--regid={POSTGRES_USER}", "--init-groups", *argv]
    if shutil.which("runuser"):
        return ["runuser", "-u", POSTGRES_USER, "--", *argv]
    raise ServiceError("root, and neither setpriv nor runuser to drop to the postgres user")


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Stop the process group the service leads: ``sig``, then SIGKILL after a bounded wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def _wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, log: Path) -> None:
    for _ in range(READY_POLLS):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(f"{what} exited with {proc.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.05)
    raise ServiceError(f"{what} did not answer after {READY_POLLS} polls")


@contextlib.contextmanager
def postgres_service() -> Iterator[Service]:
    """A private PostgreSQL (trust auth, loopback, fsync off) for the lifetime of the context."""
    bindir = postgres_bin_dir()
    if bindir is None:
        raise ServiceError("PostgreSQL is not installed (python -m tests.services install)")
    root = Path(tempfile.mkdtemp(prefix="shepherd-pg-"))
    try:
        if os.geteuid() == 0:
            pw = pwd.getpwnam(POSTGRES_USER)
            os.chown(root, pw.pw_uid, pw.pw_gid)
        data, log = root / "data", root / "postgres.log"
        init = subprocess.run(
            _as_postgres_user(
                [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", POSTGRES_USER, "--no-sync"]
            ),
            capture_output=True,
            cwd=root,
        )
        if init.returncode != 0:
            raise ServiceError(f"initdb failed: {init.stderr.decode(errors='replace')[-2000:]}")
        port = free_port()
        argv = [
            str(bindir / "postgres"),
            "-D", str(data),
            "-p", str(port),
            "-h", "127.0.0.1",
            "-k", str(root),
            "-c", "fsync=off",
            "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off",
            "-c", "max_connections=200",
        ]  # fmt: skip
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                _as_postgres_user(argv),
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=root,
                start_new_session=True,
            )
        try:
            isready = [str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]
            _wait_ready(proc, lambda: subprocess.run(isready).returncode == 0, "postgres", log)
            yield Service(
                "postgres", port, f"postgresql://{POSTGRES_USER}@127.0.0.1:{port}/postgres", proc.pid, root
            )
        finally:
            _stop(proc, signal.SIGINT)  # SIGINT: PostgreSQL's fast shutdown
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_service(port: int | None = None) -> Iterator[Service]:
    """A private Redis (loopback, no persistence) for the lifetime of the context; ``port``: that one
    (a Redis coming back where a stopped one was), else a free one."""
    binary = redis_binary()
    if binary is None:
        raise ServiceError("redis-server is not installed (python -m tests.services install)")
    root = Path(tempfile.mkdtemp(prefix="shepherd-redis-"))
    try:
        port, log = port or free_port(), root / "redis.log"
        argv = [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(root),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
        ]  # fmt: skip
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, cwd=root, start_new_session=True
            )
        try:
            _wait_ready(proc, lambda: _redis_pings(port), "redis-server", log)
            yield Service("redis", port, f"redis://127.0.0.1:{port}/0", proc.pid, root)
        finally:
            _stop(proc, signal.SIGTERM)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def service_or_skip(
    name: str, start: Callable[[], contextlib.AbstractContextManager[Service]]
) -> Iterator[Service]:
    """``start()``'s service for tests (``name``: what a skip says): without one they are skipped, and
    they fail under CI=true."""
    import pytest  # here: ``python -m tests.services install`` runs without pytest

    with contextlib.ExitStack() as stack:
        try:
            svc = stack.enter_context(start())
        except ServiceError as e:
            if IN_CI:
                pytest.fail(f"CI=true but {name} cannot run: {e}")
            pytest.skip(f"{name} unavailable: {e} (python -m tests.services install, as root)")
        yield svc


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        try:
            done = install()
        except (ServiceError, subprocess.CalledProcessError) as e:
            print(f"tests.services: {e}", file=sys.stderr)
            # locally without root the storage tests skip; under CI a missing service is a failure
            return 1 if IN_CI else 0
        print(
            f"tests.services: installed {', '.join(done)}" if done else "tests.services: nothing to install"
        )
        return 0
    if argv[:1] == ["check"]:
        for cm in (postgres_service, redis_service):
            with cm() as svc:
                print(f"{svc.name}: up on port {svc.port} (pid {svc.pid})")
        return 0
    print("usage: python -m tests.services install | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
