"""The node over vLLM's own gRPC entrypoint, replayed (tests/contract/replay.py, ``vllm-entrypoint``).

Read from vllm-project/vllm vllm/entrypoints/grpc_server.py at
94d4b167853fb62ab5e9da17992921d18387b63a (before the entrypoint took SMG's servicer): Generate sends
``outputs[0]`` only, a chunk per DELTA output and, once finished, a Complete repeating the last
delta (``completion_tokens`` the delta's length); GetModelInfo's ``max_context_length`` is
``max_model_len``; the servicer has no GetLoads and no SubscribeKvEvents, so grpc answers them
UNIMPLEMENTED. Through a real node process.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.contract.nodes import complete, ids, node_over, replay, sse_events, streamed_text
from tests.contract.replay import Choice, Plan, ReplayServer
from tests.e2e.node_procs import NodeProc

NO_LOADS = "does not serve GetLoads"


DIALECT = "vllm-entrypoint"
# least_load: a policy that routes by engine loads, so the node polls GetLoads (round_robin would not)
NODE_ARGS = ("--load-poll-interval-secs", "0.1", "--policy", "least_load")


@pytest.mark.parametrize("stream", [False, True])
def test_stream_and_not(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    engine.plan = Plan([Choice([ids(tok, "one "), ids(tok, "two")])], cached=1)
    r = complete(http, node, prompt="hi", stream=stream)
    assert r.status_code == 200, r.text
    text = streamed_text(sse_events(r.text)) if stream else r.json()["choices"][0]["text"]
    assert text == "one two"
    if not stream:
        assert r.json()["usage"]["completion_tokens"] == len("one two")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1


def test_missing_get_loads_is_detected_once_and_not_asked_again(engine: ReplayServer, node: NodeProc) -> None:
    for _ in range(200):  # bounded: the node polls every 0.1 s
        if NO_LOADS in node.log():
            break
        time.sleep(0.05)
    assert NO_LOADS in node.log()
    time.sleep(1.0)  # ten more poll intervals
    assert engine.calls["GetLoads"] == 1
    assert node.log().count(NO_LOADS) == 1


def test_without_get_loads_least_load_spreads_by_this_nodes_in_flight(tok: Path) -> None:
    """Both workers lack GetLoads, so the engine's load is unknown (zero); least_load then ranks them by
    the node's own in-flight requests. Ties go to the lower id, so a request held on the first worker
    must send the following ones to the other: without the in-flight count they would all follow it."""
    release = threading.Event()
    lock = threading.Lock()
    held: list[str] = []

    def plan(s: ReplayServer, req: Any) -> Plan:
        with lock:
            hold = not held
            if hold:
                held.append(s.url)
        if hold:
            release.wait(30)  # bounded: released below, or gives up after 30 s
        return Plan([Choice([ids(tok, "ok")])])

    with (
        replay("vllm-entrypoint") as a,
        replay("vllm-entrypoint") as b,
        node_over([a, b], tok, "--policy", "least_load", "--load-poll-interval-secs", "0.1") as n,
        httpx.Client(timeout=60) as c1,
        httpx.Client(timeout=60) as c2,
        ThreadPoolExecutor(1) as pool,
    ):
        a.plan = b.plan = plan
        for _ in range(200):  # both workers asked once and found without GetLoads
            if n.log().count(NO_LOADS) == 2:
                break
            time.sleep(0.05)
        assert n.log().count(NO_LOADS) == 2
        try:
            pending = pool.submit(complete, c1, n, prompt="held")
            for _ in range(400):
                with lock:
                    if held:
                        break
                time.sleep(0.05)
            assert held, "the held request reached no worker"
            other = b if held[0] == a.url else a
            before = len(other.generates())
            for _ in range(4):
                r = complete(c2, n, prompt="next")
                assert r.status_code == 200, r.text
            assert len(other.generates()) - before == 4
        finally:
            release.set()
        assert pending.result(60).status_code == 200
