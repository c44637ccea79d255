"""End to end: secure defaults of a real ``smg-node`` (a security review's findings), on loopback.

What each test reproduces, and what the node must now do:

- **data files**: ``--data-dir`` was made 0755 and ``node.db`` (API key records), ``history.db``
  (conversations) and their ``-wal`` / ``-shm`` 0644: now a data dir the node makes is 0700 and the
  database files 0600; a data dir the operator made is left as it is, with a warning in the log when
  group or others may enter it;
- **metadata workers**: with the default (empty) ``--worker-allow``, a worker on 169.254.169.254 (cloud
  instance credentials), another link-local address or ``metadata.google.internal`` was accepted: now a
  configuration error at start (exit 2) and a 400 ``worker_not_allowed`` on ``POST /workers``;
- **guessing keys**: failed credentials were answered 401 as fast as they came: after
  ``--auth-failure-limit`` failures in ``--auth-failure-window-secs`` the address gets 429 with
  ``Retry-After`` (OpenAI's envelope, Anthropic's on ``/v1/messages``) whatever it sends; a short
  bootstrap key from the environment is warned about at start;
- **DNS rebinding off loopback**: with ``--insecure-admin`` on a listener that is not loopback no
  ``Host`` was checked, so a page on a rebound name could read ``/workers``, ``/admin/keys`` and
  ``/metrics``: now a ``Host`` name other than the listener's, this machine's or
  ``--admin-allowed-hosts`` is a 403 ``host_not_allowed``;
- **an unreachable PostgreSQL**: ``--history-backend postgres`` with the database down died with a
  ``StorageUnavailable`` traceback: now one line, ``configuration error``, naming the backend and the URL
  with its password redacted, exit 2 (and a data dir that cannot hold ``node.db`` likewise).

Ports 48000-48999 only; files under /tmp/sweep_sec2/ (removed after); every process stopped by its pid,
also when a test fails; every wait a bounded poll; nothing timed.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.node_procs import BIN, NodeProc, env, reserved_port, start_node

pytestmark = pytest.mark.timeout(180)

SCRATCH = Path("/tmp/sweep_sec2")
ADMIN_KEY = "sk-smg-e2e-security-defaults-" + os.urandom(12).hex()
JSON = {"Content-Type": "application/json"}
_rng = random.Random()


def port48() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


@pytest.fixture
def scratch() -> Iterator[Path]:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=SCRATCH))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, inherited by the node: the old code's files came out 0644 under it."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def node_args(*extra: str) -> list[str]:
    return ["--model-id", "qwen3", "--tokenizer-workers", "0", *extra]


def start(*args: str) -> NodeProc:
    return start_node(*node_args(*args), port=port48(), wait_ready=False)


def run_to_exit(*args: str) -> tuple[int, str]:
    """``smg-node serve`` expected to refuse to start: (exit code, stderr)."""
    argv = [str(BIN / "smg-node"), "serve", "--host", "127.0.0.1", "--port", str(port48()), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode, err.decode(errors="replace")


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def wait_for(pred: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded poll
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout}s: {what}")


def envelope_code(r: httpx.Response) -> str | None:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    code: str | None = body["error"]["code"]
    return code


# ---- C: the data files ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("umask_022")
def test_a_data_dir_the_node_makes_is_private(scratch: Path) -> None:
    data = scratch / "state" / "node"  # missing: the node makes it
    with env({"SEC2_ADMIN_KEY": ADMIN_KEY}):
        node = start(
            "--auth-mode", "api_key", "--auth-admin-key-env", "SEC2_ADMIN_KEY",
            "--data-dir", str(data), "--history-backend", "sqlite",
        )  # fmt: skip
    try:
        r = httpx.post(
            node.url + "/admin/keys",
            json={"name": "ci", "role": "user"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        assert r.status_code == 201, r.text
        files = [data / n for n in ("node.db", "node.db-wal", "node.db-shm", "history.db", "history.db-wal")]
        wait_for(lambda: all(f.exists() for f in files), f"{files} (the node's SQLite files)")
        assert mode(data) == 0o700 and mode(data.parent) == 0o700
        assert {f.name: oct(mode(f)) for f in files} == {f.name: oct(0o600) for f in files}
    finally:
        node.stop()


@pytest.mark.usefixtures("umask_022")
def test_an_operator_made_data_dir_is_left_alone_and_warned_about(scratch: Path) -> None:
    data = scratch / "data"
    data.mkdir()
    data.chmod(0o755)
    node = start("--data-dir", str(data))
    try:
        wait_for(lambda: (data / "node.db").exists(), "node.db")
        wait_for(lambda: "accessible to group or others" in node.log(), "the data_dir warning")
        assert mode(data) == 0o755  # the operator's choice stays
        assert mode(data / "node.db") == 0o600
    finally:
        node.stop()


# ---- E: metadata addresses as workers --------------------------------------------------------------------


METADATA = ["http://169.254.169.254:80", "grpc://[fe80::1]:50051", "http://metadata.google.internal"]


def test_metadata_workers_are_refused_at_start_and_on_post_workers() -> None:
    for url in METADATA[:2]:
        code, err = run_to_exit(*node_args("--worker-urls", url))
        assert code == 2, err
        assert "configuration error" in err and "metadata" in err and "Traceback" not in err, err
    node = start()
    try:
        with httpx.Client(timeout=10) as http:
            for url in [*METADATA, "http://2852039166:80", "http://[::ffff:169.254.169.254]:80"]:
                r = http.post(node.url + "/workers", json={"url": url})
                assert r.status_code == 400 and envelope_code(r) == "worker_not_allowed", (url, r.text)
            listed = http.get(node.url + "/workers").text
            assert "169.254" not in listed and "metadata.google" not in listed and "fe80" not in listed
    finally:
        node.stop()


# ---- F: guessing credentials ---------------------------------------------------------------------------


def test_guessing_keys_is_answered_429_and_a_short_bootstrap_key_is_warned_about() -> None:
    short = "sk-smg-" + "s" * 9  # 16 characters
    with env({"SEC2_SHORT_KEY": short, "SEC2_ADMIN_KEY": ADMIN_KEY}):
        node = start(
            "--auth-mode", "api_key", "--auth-admin-key-env", "SEC2_SHORT_KEY", "SEC2_ADMIN_KEY",
            "--auth-failure-limit", "3", "--auth-failure-window-secs", "600",
        )  # fmt: skip
    try:
        log = node.log()
        assert "SEC2_SHORT_KEY is 16 characters" in log and short not in log, log
        assert "SEC2_ADMIN_KEY is" not in log
        good = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(timeout=10) as http:
            for _ in range(10):  # successes count for nothing
                assert http.get(node.url + "/v1/models", headers=good).status_code == 200
            for i in range(3):
                r = http.get(node.url + "/v1/models", headers={"Authorization": f"Bearer sk-smg-guess-{i}"})
                assert r.status_code == 401, r.text
            r = http.get(node.url + "/v1/models", headers={"Authorization": "Bearer sk-smg-guess-4"})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
            assert envelope_code(r) == "auth_rate_limited" and r.json()["error"]["type"] == "rate_limit_error"
            # the credential is not looked at now: the good key waits as well, on the control plane too
            assert http.get(node.url + "/v1/models", headers=good).status_code == 429
            assert http.get(node.url + "/workers", headers=good).status_code == 429
            r = http.post(
                node.url + "/v1/messages", headers={"x-api-key": "sk-smg-guess-5", **JSON}, content=b"{}"
            )
            body = r.json()
            assert r.status_code == 429 and "Retry-After" in r.headers, r.text
            assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
            assert http.get(node.url + "/health").status_code in (200, 503)  # probes: never limited
    finally:
        node.stop()


# ---- G: DNS rebinding against a control plane off loopback --------------------------------------------


def non_loopback_listen_host() -> str:
    """A listen address the node does not take for loopback: this machine's name when it resolves to
    loopback only (the listener then stays on loopback), else the wildcard (as test_admin_plane.py)."""
    name = socket.gethostname()
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except OSError:
        addrs = set()
    if addrs and all(a.startswith("127.") or a == "::1" for a in addrs):
        return name
    return "0.0.0.0"


def test_an_open_control_plane_off_loopback_checks_host() -> None:
    listen = non_loopback_listen_host()
    admin = port48()
    node = start("--admin-host", listen, "--admin-port", str(admin), "--insecure-admin")
    url = f"http://127.0.0.1:{admin}"
    try:
        with httpx.Client(timeout=10) as http:
            for path in ("/workers", "/admin/keys", "/metrics"):
                r = http.get(url + path, headers={"Host": f"rebound.evil.example:{admin}"})
                assert r.status_code == 403 and envelope_code(r) == "host_not_allowed", (path, r.text)
            for host in (f"127.0.0.1:{admin}", f"{socket.gethostname()}:{admin}", f"localhost:{admin}"):
                r = http.get(url + "/workers", headers={"Host": host})
                assert r.status_code == 200, (host, r.text)
    finally:
        node.stop()
    admin = port48()
    node = start(
        "--admin-host", listen, "--admin-port", str(admin), "--insecure-admin",
        "--admin-allowed-hosts", "gw.example",
    )  # fmt: skip
    url = f"http://127.0.0.1:{admin}"
    try:
        with httpx.Client(timeout=10) as http:
            assert http.get(url + "/workers", headers={"Host": f"gw.example:{admin}"}).status_code == 200
            r = http.get(url + "/workers", headers={"Host": f"rebound.evil.example:{admin}"})
            assert r.status_code == 403 and envelope_code(r) == "host_not_allowed", r.text
    finally:
        node.stop()


# ---- H: an unreachable history database ----------------------------------------------------------------


def test_an_unreachable_postgres_is_a_one_line_configuration_error(scratch: Path) -> None:
    dead = port48()  # nothing listens there
    password = "pw-" + os.urandom(6).hex()
    code, err = run_to_exit(
        *node_args(
            "--history-backend", "postgres", "--history-url", f"postgresql://shep:{password}@127.0.0.1:{dead}/db"
        )
    )  # fmt: skip
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "configuration error" in ln]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "postgres" in errors[0] and f"postgresql://shep:***@127.0.0.1:{dead}/db" in errors[0], err
    assert password not in err
    # a data dir that cannot hold node.db: the same kind of answer, naming it
    blocker = scratch / "not-a-dir"
    blocker.write_text("")
    code, err = run_to_exit(*node_args("--data-dir", str(blocker)))
    assert code == 2 and "configuration error" in err and "data_dir" in err and "Traceback" not in err, err


def test_a_port_in_use_is_a_one_line_configuration_error_with_one_process_or_several() -> None:
    """A client port another process holds: one line naming it and exit 2, no traceback (it was one); with
    ``--procs 2`` the parent stops rather than starting its children again and again, and exits 2 too."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for procs in ("1", "2"):
            code, err = run_to_exit(*node_args("--port", str(port), "--procs", procs))
            assert code == 2 and "Traceback" not in err, err
            errors = [ln for ln in err.splitlines() if ln.startswith("smg-node: configuration error")]
            assert errors and all(
                f"cannot listen on 127.0.0.1:{port} (--host/--port)" in ln for ln in errors
            ), err
            assert len(errors) <= int(procs), err  # each process at most once: none started again


def test_a_host_that_does_not_resolve_is_a_one_line_configuration_error() -> None:
    # --insecure-admin: past the refusal to serve the control plane open off loopback, to the bind
    code, err = run_to_exit(*node_args("--host", "no-such-host.invalid", "--insecure-admin"))
    assert code == 2 and "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("smg-node: configuration error")]
    assert len(errors) == 1 and "cannot listen on no-such-host.invalid:" in errors[0], err
