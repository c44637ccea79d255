"""``smg-node serve --procs N`` (shepherd.node.procs): the children's command lines, what it refuses,
its loopback mesh's ports and files; and the heap trim the tokenizer service does before forking."""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from shepherd.mesh.keyring import Keyring
from shepherd.node import procs
from shepherd.node.config import NodeConfig, build_config
from shepherd.tokens import heap


def cfg(**kw: Any) -> NodeConfig:
    return dataclasses.replace(build_config({}, {"port": 30123}), **kw)


def test_check_refuses_what_it_cannot_run() -> None:
    procs.check(cfg(procs=2))
    procs.check(cfg(procs=1, mesh_port=7946))  # one process: nothing to say
    with pytest.raises(procs.ProcsError, match="mesh"):
        procs.check(cfg(procs=2, mesh_port=7946))
    with pytest.raises(procs.ProcsError, match="mesh"):
        procs.check(cfg(procs=2, mesh_seeds=("127.0.0.1:7946",)))
    with pytest.raises(procs.ProcsError, match="port"):
        procs.check(cfg(procs=2, admin_port=0))


def test_config_bounds_procs() -> None:
    assert build_config({}, {"procs": 4}).procs == 4
    assert build_config({"procs": 3}, {}).procs == 3
    with pytest.raises(Exception, match="procs"):
        build_config({}, {"procs": 0})


def test_free_mesh_ports_are_free_for_tcp_and_udp() -> None:
    ports = procs.free_mesh_ports(3)
    assert len(set(ports)) == 3
    for p in ports:
        with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            t.bind(("127.0.0.1", p))
            u.bind(("127.0.0.1", p))


def test_mesh_files_and_child_command_lines(tmp_path: Path) -> None:
    names = ["host-p0", "host-p1", "host-p2"]
    files = procs.make_mesh_files(tmp_path / "mesh", names)
    assert stat.S_IMODE(os.stat(tmp_path / "mesh").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files.keyring).st_mode) == 0o600
    assert len(Keyring.from_file(files.keyring).keys) == 1
    for cert, key, ca in files.certs.values():
        assert cert.is_file() and key.is_file() and ca.is_file()
    ports = [41001, 41002, 41003]
    argv = ["serve", "--port", "30123", "--procs", "3"]
    c = cfg(procs=3)
    line = procs.child_argv(argv, c, 1, names, ports, files)
    assert line[:3] == [sys.executable, "-m", "shepherd.node.cli"]
    assert line[3:8] == argv
    rest = line[8:]
    # one process each, on the shared port, and its own place in the mesh (flags after the parent's win)
    assert rest[:3] == ["--procs", "1", "--reuse-port"]
    assert rest[rest.index("--mesh-port") + 1] == "41002"
    assert rest[rest.index("--mesh-name") + 1] == "host-p1"
    assert rest[rest.index("--mesh-bind") + 1] == "127.0.0.1"
    assert rest[rest.index("--mesh-keyring-file") + 1] == str(files.keyring)
    assert rest[rest.index("--mesh-cert") + 1] == str(files.certs["host-p1"][0])
    seeds = rest[rest.index("--mesh-seeds") + 1 : rest.index("--mesh-seeds") + 3]
    assert seeds == ["127.0.0.1:41001", "127.0.0.1:41003"]
    assert "--history-allow-local" in rest  # the memory backend: one node's history over its processes
    shared = procs.child_argv(argv, dataclasses.replace(c, history_backend="sqlite"), 0, names, ports, files)
    assert "--history-allow-local" not in shared


def test_child_command_line_parses_to_a_meshed_single_process_config(tmp_path: Path) -> None:
    from shepherd.node.cli import config_from_args  # not at the top: as the cli does (grpcio env)

    names = ["h-p0", "h-p1"]
    files = procs.make_mesh_files(tmp_path / "mesh", names)
    argv = ["serve", "--port", "30123", "--procs", "2"]
    parent = config_from_args(argv)
    assert parent.procs == 2 and parent.mesh_port is None
    line = procs.child_argv(argv, parent, 0, names, [41001, 41002], files)
    child = config_from_args(line[3:])
    assert child.procs == 1 and child.reuse_port
    assert child.port == 30123
    assert child.mesh_port == 41001 and child.mesh_name == "h-p0"
    assert child.mesh_seeds == ("127.0.0.1:41002",)
    assert child.history_allow_local


def test_heap_trim_and_freeze() -> None:
    assert heap.trim_heap() is sys.platform.startswith("linux")
    before = gc.get_freeze_count()
    try:
        heap.freeze_before_fork()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_configuration_error_at_first_start_stops_the_node_with_its_status(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    # the other child exits 3 when told to stop: the configuration error's 2 is still the status
    other = _py(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(30)\n"
    )
    failing = _py(
        "import pathlib, sys, time\n"
        f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.01)\n"
        "sys.exit(2)\n"
    )
    sup = procs.Supervisor([failing, other], drain_s=10.0, log=False)
    assert sup.run() == procs.CONFIG_ERROR_EXIT
    assert sup.children[0].exits == [2] and sup.children[0].restarts == 0


def test_a_restarted_childs_configuration_error_is_restarted(tmp_path: Path) -> None:
    count = tmp_path / "count"
    # run 1 crashes, run 2 exits 2 (as when its mesh port was taken meanwhile), run 3 stops the parent
    child = _py(
        "import os, pathlib, signal, sys, time\n"
        f"p = pathlib.Path({str(count)!r})\n"
        "n = int(p.read_text()) + 1 if p.exists() else 1\n"
        "p.write_text(str(n))\n"
        "if n == 1: sys.exit(1)\n"
        "if n == 2: sys.exit(2)\n"
        "os.kill(os.getppid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    sup = procs.Supervisor([child], drain_s=10.0, log=False)
    assert sup.run() == 0
    assert sup.children[0].exits == [1, 2]
    assert sup.children[0].restarts == 2


def test_no_child_is_started_once_stopping() -> None:
    sup = procs.Supervisor([_py("import time; time.sleep(30)")], drain_s=1.0, log=False)
    c = sup.children[0]
    c.restart_at = 0.0  # due a restart in the pass that stopped the node
    sup.stopping = True
    try:
        sup._check(c, 1.0)
        assert c.proc is None
    finally:
        sup._kill_all()
