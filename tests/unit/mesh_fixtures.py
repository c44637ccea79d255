"""What the tests of real mesh runtimes on loopback share: a keyring key (and a foreign one), SWIM
timings fast enough for tests, a bounded wait for a condition, and two meshed nodes (gateway and
``MeshNode`` each) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from shepherd.mesh.swim_types import SwimConfig
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.config import build_config
from shepherd.node.dispatch.gateway import Gateway

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))

FAST = SwimConfig(
    probe_interval=0.2,
    probe_timeout=0.1,
    nack_timeout=0.08,
    suspicion_mult=3,
    suspicion_max_timeout_mult=3,
    gossip_interval=0.05,
    push_pull_interval=1.0,
    reconnect_interval=0.5,
    join_retry_interval=0.1,
    join_retry_max_interval=0.5,
    gossip_to_the_dead_time=60.0,
)


async def eventually(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``cond`` every 20 ms until it holds (bounded: an AssertionError after ``timeout`` s)."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


def mesh_node(
    tmp_path: Path, model: str, name: str, seeds: tuple[str, ...] = (), extra: dict[str, object] | None = None
) -> tuple[Gateway, MeshNode]:
    """A gateway for ``model`` (cache-aware, no tokenizer workers) and its mesh node ``name`` on an
    ephemeral loopback port, with dev certificates in ``tmp_path``; ``extra`` adds config keys."""
    cfg = build_config(
        {},
        {
            "tokenizer_workers": 0,
            "model_id": model,
            "policy": "cache_aware",
            "mesh_port": 0,
            "mesh_name": name,
            "mesh_dev_pki": str(tmp_path),
            "mesh_seeds": list(seeds),
            **(extra or {}),
        },
    )
    gw = Gateway(cfg)
    return gw, MeshNode(cfg, gw)


@contextlib.asynccontextmanager
async def two_mesh_nodes(
    tmp_path: Path,
    model: str,
    *,
    prepare_a: Callable[[MeshNode], None] = lambda _: None,
    extra: dict[str, object] | None = None,
) -> AsyncIterator[tuple[Gateway, MeshNode, Gateway, MeshNode]]:
    """Nodes ``a`` and ``b`` (``mesh_node``), b joined through a and both seeing 2 members; ``prepare_a``
    runs on a before it starts. Both are closed on exit, also on failure."""
    gw_a, a = mesh_node(tmp_path, model, "a", extra=extra)
    prepare_a(a)
    gw_b: Gateway | None = None
    b: MeshNode | None = None
    try:
        await a.start()
        assert a.runtime is not None
        gw_b, b = mesh_node(tmp_path, model, "b", (f"127.0.0.1:{a.runtime.address[1]}",), extra)
        await b.start()
        nodes = (a, b)
        await eventually(lambda: all(len(n.members()) == 2 for n in nodes), what="both members")
        yield gw_a, a, gw_b, b
    finally:
        await a.close()
        await gw_a.close()
        if b is not None and gw_b is not None:
            await b.close()
            await gw_b.close()
