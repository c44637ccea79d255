"""The shape of a chaos fleet (``FleetSpec``), its addresses, and the flags that put its nodes in a mesh."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent

LB_INDEX = 2
CLIENT_INDEX = 3
NODE_BASE = 11
ENGINE_BASE = 31
PROXY_PORT = 31000
PROXY_CONTROL_PORT = 31001
# A small tokenizer keeps (re)starts cheap on 2 cores (gpt2: ~1.7 s of CPU until ready, the embedded
# qwen3 ~3.7 s); FleetSpec(model_dir=None) runs the embedded qwen3 instead.
SMALL_MODEL_DIR = REPO / "tests" / "assets" / "tokenizers" / "gpt2"
SMALL_MODEL_TEMPLATE = REPO / "tests" / "assets" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    nodes: int = 3
    spare_nodes: int = 0  # declared to the LB with a namespace, not started (a node that joins later)
    engines: int = 2
    policy: str = "least_load"
    model_dir: str | None = str(SMALL_MODEL_DIR)  # tokenizer dir for nodes and engines; None: embedded qwen3
    chat_template: str | None = str(SMALL_MODEL_TEMPLATE)
    node_port: int = 30000
    engine_grpc_port: int = 50051
    engine_http_port: int = 18001
    lb_port: int = 8080
    engine_args: tuple[str, ...] = ("--decode-ms-per-token", "2", "--prefill-us-per-token", "10")
    node_args: tuple[str, ...] = (
        "--tokenizer-workers",
        "0",
        "--health-check-interval-secs",
        "1",
        # the mock engines are SGLang-kind workers: the node raises this to 2.5 s for them (SMG's SGLang
        # HealthCheck sleeps 1 s). No scenario relies on it: a crashed engine refuses connections at once
        # (engine_crash), a slowed one answers (engine_slow); no scenario hangs an engine.
        "--health-check-timeout-secs",
        "1",
        "--health-failure-threshold",
        "2",
        "--cb-failure-threshold",
        "3",
        "--cb-timeout-duration-secs",
        "3",
        "--shutdown-grace-period-secs",
        "10",
        "--log-level",
        "warning",
    )
    delay_proxy_nodes: tuple[int, ...] = ()  # node indexes the LB reaches through a delay proxy
    lb_check_timeout_ms: int = 2000
    lb_check_inter_ms: int = 500
    lb_server_timeout_ms: int = 5000
    start_timeout_s: float = 90.0
    mesh: bool = False  # start the nodes as one SWIM mesh (``mesh_args``)
    # extra environment of every node process: the test-only fault switches (shepherd.mesh.faults) that
    # ``python -m chaos.run --inject FAULT`` sets, to prove a scenario sees the break
    node_env: tuple[tuple[str, str], ...] = ()
    mesh_port: int = 39527

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spare_nodes

    @property
    def model_name(self) -> str:
        return Path(self.model_dir).name if self.model_dir else "qwen3"

    def model_args(self, engine: bool) -> list[str]:
        if not self.model_dir:
            return []
        if engine:
            return ["--tokenizer", self.model_dir, "--model", self.model_name]
        args = ["--model-path", self.model_dir, "--model-id", self.model_name]
        return args + (["--chat-template", self.chat_template] if self.chat_template else [])


@dataclass(frozen=True, slots=True)
class MeshPlace:
    """Where one node sits in the mesh: its name, its address, the seeds it joins through, the dev PKI dir."""

    name: str
    ip: str
    seeds: tuple[str, ...]
    pki_dir: str


def mesh_args(spec: FleetSpec, place: MeshPlace) -> list[str]:
    """Extra ``smg-node serve`` flags for one node: ``--mesh-port``, ``--mesh-name``, ``--mesh-bind``,
    ``--mesh-dev-pki DIR`` (nodes sharing DIR trust each other: a dev CA and keyring made once under a file
    lock) and ``--mesh-seeds``; the first node starts the mesh, the others join through it. SWIM timings
    stay the node's defaults unless ``FleetSpec.node_args`` sets them."""
    if not spec.mesh:
        return []
    args = ["--mesh-port", str(spec.mesh_port), "--mesh-name", place.name, "--mesh-bind", place.ip]
    args += ["--mesh-dev-pki", place.pki_dir]
    if place.seeds:
        args += ["--mesh-seeds", *place.seeds]
    return args


def mesh_available() -> bool:
    """Does this ``smg-node`` know ``--mesh-port``? (A check for a tree built without the mesh.)"""
    try:
        res = subprocess.run(
            [str(BIN / "smg-node"), "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--mesh-port" in res.stdout
