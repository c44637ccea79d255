"""CPU and memory of process trees from /proc, and starting/stopping benchmark processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shepherd.loadgen.procs import ManagedProcess, ProcessGroup, ProcSpec, free_port, parse_cpu_list
from shepherd.loadgen.procstat import (
    TreeCpuTracker,
    cpu_model,
    host_line,
    parse_schedstat_ns,
    parse_stat,
    parse_status_kb,
    read_run_ns,
    read_stat,
    tree_pids,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

STAT = (
    "4242 (my (weird) proc) S 1 4242 4242 0 -1 4194560 1234 0 0 0 "
    "150 25 7 3 20 0 5 0 987654 123456789 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0"
)


XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R)   Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512dq

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Some Other CPU
flags\t\t: fpu
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd0c
CPU revision\t: 1

processor\t: 1
CPU implementer\t: 0x42
CPU part\t: 0xfff
"""


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (XEON, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, family 6 model 143, AVX-512"),
        (XEON.replace(" avx512f", ""), "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, family 6 model 143"),
        (ARM, "implementer 0x41 part 0xd0c"),  # (the first CPU's block only)
        ("", ""),
        ("garbage without colons\n\n\n", ""),
    ],
)
def test_cpu_model_of_the_first_cpu(text: str, want: str) -> None:
    assert cpu_model(text) == want


def test_host_line_names_the_cpus_and_the_load() -> None:
    line = host_line()
    assert line.startswith(f"{os.cpu_count()} CPUs")
    assert ", load average " in line
    model = cpu_model()
    assert (f"({model})" in line) == bool(model)


def test_parse_stat_with_parentheses_in_the_name() -> None:
    st = parse_stat(STAT)
    assert st.pid == 4242
    assert st.comm == "my (weird) proc"
    assert st.state == "S"
    assert st.ppid == 1
    assert (st.utime, st.stime, st.cutime, st.cstime) == (150, 25, 7, 3)
    assert st.num_threads == 5
    assert st.starttime == 987654
    assert st.rss_pages == 2048


def test_parse_stat_rejects_short_lines() -> None:
    with pytest.raises(ValueError):
        parse_stat("1 (x) S 0 1")


def test_parse_status_kb() -> None:
    text = "Name:\tpython\nVmPeak:\t  2000 kB\nVmRSS:\t  1234 kB\n"
    assert parse_status_kb(text, "VmRSS") == 1234
    assert parse_status_kb(text, "VmSwap") == 0


def test_own_stat_is_readable() -> None:
    import os

    st = read_stat(os.getpid())
    assert st is not None
    assert st.pid == os.getpid()
    assert read_stat(2**22 + 12345) is None


BURN = """
import os, sys, time
x = 0
while time.process_time() < 0.05:  # burn a little CPU, then report ready
    x += 1
print(os.getpid(), flush=True)
sys.stdin.read()
"""

PARENT = f"""
import subprocess, sys
gc = subprocess.Popen([sys.executable, "-c", {BURN!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
print(gc.stdout.readline().decode().strip(), flush=True)
sys.stdin.readline()           # "stop the grandchild"
gc.stdin.close()
gc.wait()
print("gone", flush=True)
sys.stdin.read()
"""


def _kill(pid: int) -> None:
    import os
    import signal

    st = read_stat(pid)
    if st is not None and st.state != "Z":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_tree_cpu_counts_children_and_keeps_exited_ones() -> None:
    child = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    grandchild = 0
    try:
        grandchild = int(child.stdout.readline())
        tracker = TreeCpuTracker(child.pid)
        first = tracker.sample()
        assert child.pid in first.live_pids
        assert grandchild in first.live_pids
        assert first.seen_processes >= 2
        assert first.cpu_seconds > 0
        assert first.rss_kb > 0
        assert 0 < first.pss_kb <= first.rss_kb
        assert grandchild in tree_pids(child.pid)

        child.stdin.write(b"stop\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == b"gone"
        second = tracker.sample()
        assert grandchild not in second.live_pids
        # the grandchild's CPU stays counted after it exited
        assert second.cpu_seconds >= first.cpu_seconds
    finally:
        child.kill()
        child.wait(timeout=10)
        if grandchild:
            _kill(grandchild)


def test_parse_cpu_list_and_free_port() -> None:
    assert parse_cpu_list("0,2-3, 5") == [0, 2, 3, 5]
    port = free_port()
    assert 0 < port < 65536


SERVER_WITH_CHILD = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_process_group_waits_for_readiness_and_stops_descendants(tmp_path: Path) -> None:
    port = free_port()
    spec = ProcSpec(
        name="srv",
        argv=(sys.executable, "-c", SERVER_WITH_CHILD, str(port)),
        ready_port=port,
        ready_path="/",
        ready_timeout_s=30.0,
        cwd=str(tmp_path),
    )
    with ProcessGroup(tmp_path / "logs") as group:
        proc = group.start(spec)
        root = proc.pid
        descendants: list[int] = []
        for _ in range(200):  # bounded wait for the child to show up
            descendants = [p for p in tree_pids(root) if p != root]
            if descendants:
                break
            time.sleep(0.05)
        assert descendants
    for pid in [root, *descendants]:
        st = read_stat(pid)
        assert st is None or st.state == "Z"


def test_stop_kills_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)"
    )
    proc = ManagedProcess(ProcSpec(name="stubborn", argv=(sys.executable, "-c", code)), tmp_path)
    proc.start()
    try:
        for _ in range(200):  # bounded: wait until the handler is installed
            if "up" in proc.log_tail():
                break
            time.sleep(0.05)
        assert proc.stop(grace_s=0.5) == -9
        assert not proc.alive()
    finally:
        proc.stop(grace_s=0.1)


def test_start_failure_is_reported_with_the_log(tmp_path: Path) -> None:
    from shepherd.loadgen.procs import ProcessFailed

    spec = ProcSpec(
        name="dies",
        argv=(sys.executable, "-c", "print('boom'); raise SystemExit(3)"),
        ready_port=free_port(),
        ready_timeout_s=30.0,
    )
    with ProcessGroup(tmp_path) as group, pytest.raises(ProcessFailed, match="boom"):
        group.start(spec)


def test_run_ns_sums_the_threads_schedstat(tmp_path: Path) -> None:
    assert parse_schedstat_ns("123456789 2000 17\n") == 123456789
    assert parse_schedstat_ns("") == 0
    for tid, text in (("10", "1500000 9 3\n"), ("11", "250 1 1\n")):
        (tmp_path / "10" / "task" / tid).mkdir(parents=True)
        (tmp_path / "10" / "task" / tid / "schedstat").write_text(text)
    (tmp_path / "10" / "task" / "12").mkdir()  # a thread gone between the listing and the read
    assert read_run_ns(10, tmp_path) == 1500250
    assert read_run_ns(99, tmp_path) is None  # no such process


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc/PID/task")
def test_run_ns_of_this_process_grows_with_its_cpu() -> None:
    before = read_run_ns(os.getpid())
    if before is None:
        pytest.skip("this kernel keeps no schedstat")
    t = time.process_time()
    while time.process_time() - t < 0.05:  # bounded: 50 ms of CPU
        pass
    after = read_run_ns(os.getpid())
    assert after is not None and after - before >= 40_000_000
