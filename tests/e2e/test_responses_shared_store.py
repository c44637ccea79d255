"""End to end: two nodes on one PostgreSQL without a mesh (siblings behind a balancer), a background
response (streamed or not) running on one, cancelled through the other.

The other node does not run it and has no mesh to ask the runner: it stores ``cancelled`` itself. The
runner's next write of its progress (its heartbeat: the engine is stalled) must then not undo that end
(a store update made only while the record has not ended): it stops generating (the engine request
ends), its readers' streams end with ``response.cancelled`` (never ``response.completed``), and the
record stays ``cancelled``.
Loopback only; every process stopped by its pid; bounded waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_procs import NodeProc
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL, qwen3_node, sdk
from tests.services import postgres_service, service_or_skip

pytestmark = pytest.mark.timeout(120)

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http
engine = responses_fixtures.engine


@pytest.fixture(scope="module")
def siblings(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[tuple[NodeProc, NodeProc]]:
    with service_or_skip("PostgreSQL", postgres_service) as svc:
        shared = {"history_backend": "postgres", "history_url": svc.url}
        with (
            qwen3_node(engine, tokenizer_dir, **shared) as a,
            qwen3_node(engine, tokenizer_dir, **shared) as b,
        ):
            yield a, b


def active(engine: MockEngineProc, http: httpx.Client) -> int:
    n: int = http.get(f"http://127.0.0.1:{engine.http_port}/mock/stats").json()["active"]
    return n


@pytest.mark.parametrize("stream", [True, False])
def test_an_end_stored_by_a_sibling_stands_and_stops_the_runner(
    siblings: tuple[NodeProc, NodeProc], engine: MockEngineProc, http: httpx.Client, stream: bool
) -> None:
    a, b = siblings
    faults = f"http://127.0.0.1:{engine.http_port}/mock/faults"
    # stalled for longer than the test waits: the runner sees the end by its heartbeat write (5 s)
    http.post(faults, json={"stall_after_tokens": 2, "stall_seconds": 120.0}).raise_for_status()
    try:
        seen: list[Any] = []
        reader = None
        if stream:
            s = sdk(a).responses.create(model=MODEL, input="a long one", background=True, stream=True)
            events = iter(s)
            opening: Any = next(events)
            rid = opening.response.id
            seen.append(opening)
            reader = threading.Thread(target=lambda: seen.extend(events), daemon=True)
            reader.start()
        else:
            rid = sdk(a).responses.create(model=MODEL, input="a long one", background=True).id
        for _ in range(100):  # bounded: until the engine has it
            if active(engine, http):
                break
            time.sleep(0.05)
        assert sdk(b).responses.cancel(rid).status == "cancelled"  # b stores it: it does not run it
        if reader is not None:
            reader.join(timeout=40)
            assert not reader.is_alive()  # a stopped once its progress write found the end
            assert "response.completed" not in [e.type for e in seen]
            end: Any = seen[-1]  # the end b stored, told to a's own reader
            assert end.type == "response.cancelled" and end.sequence_number == len(seen) - 1
        for _ in range(400):  # bounded (~40 s): a's task stops, and with it the engine request
            if not active(engine, http):
                break
            time.sleep(0.1)
        assert active(engine, http) == 0
        for _ in range(20):  # a's task writes nothing over the end
            assert sdk(a).responses.retrieve(rid).status == "cancelled"
            time.sleep(0.05)
    finally:
        http.post(faults, json={"stall_after_tokens": None, "stall_seconds": 0.0}).raise_for_status()
