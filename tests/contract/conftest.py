"""Fixtures the contract modules share.

Replayed engines (a module sets ``DIALECT``, the ``replay`` dialect, and may set ``NODE_ARGS``, more node
flags): ``tok`` (the byte tokenizer's directory), ``http``, ``engine`` (the replay server) and ``node``
(a real node over it). TensorRT-LLM and MLX fakes (a module sets ``FAKE``: its start function and URL
scheme): ``served`` (the fake and a node over it by scheme and by ``grpc://``) and ``fake`` (its script
and recorded requests fresh for each test). Every server and node is stopped, even on failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.contract import node_over_fake
from tests.contract.nodes import node_over, replay, tokenizer_dir
from tests.contract.replay import ReplayServer
from tests.e2e.node_procs import NodeProc


@pytest.fixture(scope="module")
def tok() -> Iterator[Path]:
    with tokenizer_dir() as d:
        yield d


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[ReplayServer]:
    with replay(request.module.DIALECT) as s:
        yield s


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest, engine: ReplayServer, tok: Path) -> Iterator[NodeProc]:
    with node_over([engine], tok, *getattr(request.module, "NODE_ARGS", ())) as n:
        yield n


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Any, NodeProc]]:
    start, scheme = request.module.FAKE
    fake, server = start()
    try:
        urls = (f"{scheme}://127.0.0.1:{server.port}", f"grpc://localhost:{server.port}")
        with node_over_fake.node_over(*urls) as n:
            yield fake, n
    finally:
        server.stop()


@pytest.fixture
def fake(served: tuple[Any, NodeProc]) -> Iterator[Any]:
    f = served[0]
    f.script = type(f.script)()
    f.requests.clear()
    yield f
    f.script = type(f.script)()
