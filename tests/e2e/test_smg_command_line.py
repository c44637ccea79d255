"""End to end: an ``smg launch`` command line moved to ``smg-node serve`` as it is. SMG's flags the node
renames take effect, those it ignores are named in WARNING lines of its log, and one it cannot honour
stops it with a one-line configuration error (exit 2) naming the flag: never argparse's usage dump."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.e2e.node_procs import BIN, reserved_port, running_node

pytestmark = pytest.mark.timeout(120)

SMG_LINE = [
    "--model-id", "qwen3", "--tokenizer-workers", "0",
    "--policy", "cache_aware", "--cache-threshold", "0.5",
    "--disable-retries", "--log-json", "--log-level", "warn",
    "--prometheus-port", "29000", "--prometheus-host", "0.0.0.0",
    "--queue-size", "100", "--max-concurrent-requests", "-1", "--tokenizer-cache-enable-l0",
]  # fmt: skip


def test_an_smg_command_line_starts_a_node_that_says_what_it_ignored() -> None:
    with running_node(*SMG_LINE, wait_ready=False) as node:
        r = httpx.get(node.url + "/v1/models", timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "qwen3"
        log = node.log()
    notes = [
        json.loads(line) for line in log.splitlines() if "is ignored" in line
    ]  # (--log-json: JSON lines)
    said = {n["msg"].split(" is ignored")[0] for n in notes if n["level"] == "warning"}
    flags = ("--prometheus-port", "--prometheus-host", "--queue-size", "--tokenizer-cache-enable-l0")
    assert said == {f"SMG's {f}" for f in flags}, log


def test_a_flag_it_cannot_honour_is_a_one_line_configuration_error() -> None:
    argv = [str(BIN / "smg-node"), "serve", "--host", "127.0.0.1", "--port", str(reserved_port())]
    proc = subprocess.run(
        [*argv, "--model-id", "qwen3", "--api-key", "sk-worker-key"],
        capture_output=True,
        timeout=90,
        check=False,
    )
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2, err
    assert "configuration error" in err and "--api-key" in err and "usage:" not in err, err
    assert "sk-worker-key" not in err  # (a key given on the line is not echoed)
