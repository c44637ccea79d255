"""The chaos suite's short subset, end to end: a real fleet (3 nodes, 2 mock engines, HAProxy), one network
namespace each; a node crash, a rolling restart, the partition primitives and, on a 3-node SWIM mesh, a 2 | 1
partition and heal (``python -m chaos.run short``).

Needs root, network namespaces and chaos/install.sh's packages. Without them it is skipped with the reason,
unless CI=true: then it installs the packages (chaos/install.sh) and must run.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.cleanup import cleanup
from chaos.netns import PREFIX
from chaos.run import INSTALL_SCRIPT, preflight

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"
RUN_TIMEOUT_S = 240.0  # the subset takes ~65 s here; generous for a loaded 2-core machine


def _ready_or_skip() -> None:
    if IN_CI and os.geteuid() == 0:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True, timeout=600)
    reason = preflight()
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI=true but the chaos suite cannot run: {reason}")
    pytest.skip(f"chaos suite unavailable: {reason}")


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_short_subset(tmp_path: Path) -> None:
    _ready_or_skip()
    run_id = secrets.token_hex(2)[:3]
    report = tmp_path / "chaos-short.md"
    argv = [sys.executable, "-m", "chaos.run", "short", "--report", str(report), "--run-id", run_id]
    argv += ["--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # chaos.run tears its fleet down on SIGTERM
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
        pytest.fail(f"chaos.run short did not finish in {RUN_TIMEOUT_S} s:\n{out}")
    finally:
        left = cleanup(f"{PREFIX}{run_id}", verbose=False)  # what a killed run would leave behind
    text = report.read_text() if report.exists() else ""
    print(out)
    print(text)
    assert proc.returncode == 0, f"chaos.run short failed ({proc.returncode}):\n{out}\n{text}"
    assert not left, f"namespaces left behind: {left}"
    for name in ("node_crash", "rolling_restart", "partition_primitives", "mesh_partition_2_1"):
        assert f"| {name} | passed |" in text
