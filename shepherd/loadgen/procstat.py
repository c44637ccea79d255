"""CPU time and memory of a process tree, read from /proc (Linux).

"Gateway CPU ms per request" is the CPU that the gateway's whole process tree (the node and e.g.
its tokenizer pool workers) used during the measurement window, divided by the requests served.
``TreeCpuTracker`` walks the tree (``/proc/<pid>/task/*/children`` recursively) at every
``sample()`` and remembers the last CPU time seen of every process (keyed by pid and start time,
so a reused pid is a new process). The tree's CPU at a sample is the sum over every process ever
seen, live or gone, so a worker that exits during the run keeps what it used up to the last sample
that saw it: sample at the window's start and end and every fraction of a second in between, and
at most the CPU since the last sample of an exiting process is lost. A process born during the
window counts from zero.

``host_line`` names the host a figure came from (CPUs, their model, the load average): the same code's
CPU per request, and its ratio to smg's, moved by more than any one change between machines of the same
kind (2026-12-02: smg's burst chat 0.31 ms a request on one machine, 0.21 on another, the node's 0.20
on both), so a figure is only compared with figures of the same host line.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MAX_TREE = 4096  # bound on the processes walked in one tree


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` used here (times in clock ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime: int
    stime: int
    cutime: int
    cstime: int
    num_threads: int
    starttime: int
    rss_pages: int

    @property
    def cpu_seconds(self) -> float:
        """This process's own user + system CPU (all its threads, not its children)."""
        return (self.utime + self.stime) / CLOCK_TICKS


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first CPU's model from ``/proc/cpuinfo`` (or the text given): on x86 its name, family and model
    numbers, and whether it has AVX-512; on ARM (no name there) its implementer and part numbers; "" when
    nothing is known (another OS, an unreadable file)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read(1 << 16)  # (the first CPU's block is at the top)
        except OSError:
            return ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first CPU's block ends at the first blank line
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    parts = [" ".join(name.split())] if name else []
    implementer, part = fields.get("CPU implementer"), fields.get("CPU part")
    if not name and implementer and part:
        parts.append(f"implementer {implementer} part {part}")
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model:
        parts.append(f"family {family} model {model}")
    flags = fields.get("flags", "").split()
    if "avx512f" in flags:
        parts.append("AVX-512")
    return ", ".join(parts)


def host_line() -> str:
    """``"2 CPUs (Intel(R) Xeon(R) Processor, family 6 model 143, AVX-512), load average 0.10 0.20 0.30"``:
    the host a benchmark's figures came from, for its header."""
    model = cpu_model()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    cpus = f"{os.cpu_count()} CPUs" + (f" ({model})" if model else "")
    return f"{cpus}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def parse_stat(line: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line; ``comm`` may hold spaces and parentheses."""
    open_paren = line.index("(")
    close_paren = line.rindex(")")
    pid = int(line[:open_paren].strip())
    comm = line[open_paren + 1 : close_paren]
    rest = line[close_paren + 2 :].split()
    # rest[0] is field 3 (state); field n is rest[n - 3]
    if len(rest) < 22:
        raise ValueError(f"short stat line for pid {pid}")
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        utime=int(rest[11]),
        stime=int(rest[12]),
        cutime=int(rest[13]),
        cstime=int(rest[14]),
        num_threads=int(rest[17]),
        starttime=int(rest[19]),
        rss_pages=int(rest[21]),
    )


def parse_status_kb(text: str, key: str) -> int:
    """A ``kB`` field (e.g. ``VmRSS``) from ``/proc/<pid>/status`` text; 0 when absent."""
    prefix = key + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            parts = line[len(prefix) :].split()
            return int(parts[0]) if parts else 0
    return 0


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read())
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    except OSError:
        return None


def parse_schedstat_ns(text: str) -> int:
    """The time on CPU (ns) from ``/proc/<pid>/task/<tid>/schedstat`` text (its first field)."""
    parts = text.split()
    return int(parts[0]) if parts else 0


def read_run_ns(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's CPU time in ns, summed over its threads' ``schedstat`` (the scheduler's own
    clock: exact where ``stat``'s utime + stime come in 10 ms ticks, which an idle process's few ms a
    second need minutes of window to resolve); None once it is gone or where the kernel keeps no
    schedstat. Threads that ended between two reads are not counted (an idle process's do not end)."""
    total, found = 0, False
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += parse_schedstat_ns((task / "schedstat").read_text())
            found = True
        except (OSError, ValueError):
            continue
    return total if found else None


def read_rss_kb(pid: int) -> int:
    """VmRSS of the process in kB (0 once it is gone or for a zombie)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            return parse_status_kb(f.read(), "VmRSS")
    except OSError:
        return 0


def read_pss_kb(pid: int) -> int:
    """Proportional set size in kB (``/proc/<pid>/smaps_rollup``): pages shared with other processes
    count in proportion, so a tree's sum does not count a forked worker's shared pages twice. Falls back
    to VmRSS where the kernel has no smaps_rollup; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8", errors="replace") as f:
            return parse_status_kb(f.read(), "Pss")
    except FileNotFoundError:
        return read_rss_kb(pid)
    except OSError:
        return 0


def _children_files_supported() -> bool:
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


_HAS_CHILDREN_FILES = _children_files_supported()


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from every thread's ``children`` file, or a /proc scan)."""
    if not _HAS_CHILDREN_FILES:
        return _children_by_scan(pid)
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def _children_by_scan(pid: int) -> list[int]:
    out: list[int] = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None and st.ppid == pid:
                out.append(st.pid)
    return out


def tree_pids(root: int) -> list[int]:
    """``root`` and all its live descendants, parents before children (bounded by MAX_TREE)."""
    seen: list[int] = []
    queue = deque([root])
    visited: set[int] = set()
    while queue and len(seen) < MAX_TREE:
        pid = queue.popleft()
        if pid in visited:
            continue
        visited.add(pid)
        if not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        queue.extend(children(pid))
    return seen


@dataclass(frozen=True, slots=True)
class TreeSample:
    """One look at a process tree: cumulative CPU seconds (live and gone), RSS and PSS of the live ones."""

    cpu_seconds: float
    rss_kb: int
    live_pids: tuple[int, ...]
    seen_processes: int
    pss_kb: int = 0


class TreeCpuTracker:
    """Cumulative CPU of a process tree, including processes that exited since an earlier sample."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._last_ticks: dict[tuple[int, int], int] = {}

    def sample(self, *, with_rss: bool = True) -> TreeSample:
        live: list[int] = []
        rss_kb = pss_kb = 0
        for pid in tree_pids(self.root_pid):
            st = read_stat(pid)
            if st is None:
                continue
            if st.state == "Z":
                # a zombie still reports its times until reaped; keep what it had
                key = (st.pid, st.starttime)
                self._last_ticks[key] = max(self._last_ticks.get(key, 0), st.utime + st.stime)
                continue
            live.append(pid)
            self._last_ticks[(st.pid, st.starttime)] = st.utime + st.stime
            if with_rss:
                rss_kb += read_rss_kb(pid)
                pss_kb += read_pss_kb(pid)
        total = sum(self._last_ticks.values())
        return TreeSample(
            cpu_seconds=total / CLOCK_TICKS,
            rss_kb=rss_kb,
            live_pids=tuple(live),
            seen_processes=len(self._last_ticks),
            pss_kb=pss_kb,
        )


def iter_tree_stats(root: int) -> Iterator[ProcStat]:
    """The stat of every live process in the tree (a convenience for reports and tests)."""
    for pid in tree_pids(root):
        st = read_stat(pid)
        if st is not None:
            yield st
