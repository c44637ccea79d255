"""The node's Abort to an engine that still holds a request it gave up on before handing anything on (SMG's
SGLang servicer replayed, tests/contract/replay.py ``sglang-smg``): the request timeout reached while the
engine is silent (queued behind others), streamed or not, and a call without streaming whose n > 1 choices
include one the engine aborted while the others still run. Each gets an Abort RPC naming its engine id, as
a stream that times out after its first token does (``--request-timeout-secs``: "the engine request is
aborted"), not only the stream's cancellation."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.contract.nodes import complete
from tests.contract.replay import Choice, Plan, ReplayServer
from tests.e2e.node_procs import NodeProc

DIALECT = "sglang-smg"
NODE_ARGS = ("--request-timeout-secs", "1")


def _aborted(engine: ReplayServer, rid: str, timeout: float = 10.0) -> bool:
    """Whether an Abort naming the Generate call ``rid`` reached the engine (polled, bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.lock:
            if any(m == "Abort" and r.request_id == rid for m, r in engine.requests):
                return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_any_output_sends_abort(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, stream: bool
) -> None:
    engine.plan = Plan([Choice([], finish=None)], hold_s=30.0)  # silent past the node's 1 s deadline
    before = len(engine.generates())
    r = complete(http, node, prompt="hi", stream=stream)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "engine_timeout"
    gens = engine.generates()[before:]
    assert len(gens) == 1
    assert _aborted(engine, gens[0].request_id)


def test_one_choice_aborted_without_streaming_aborts_the_others(
    engine: ReplayServer, node: NodeProc, http: httpx.Client
) -> None:
    # choice 0 still running (no Complete), choice 1 ended by the scheduler: the answer is a 502 and
    # the request, still running on the engine, is aborted
    engine.plan = Plan([Choice([[65]], finish=None), Choice([[66]], finish="abort")], hold_s=30.0)
    before = len(engine.generates())
    r = complete(http, node, prompt="hi", n=2)
    assert r.status_code == 502, r.text
    gens = engine.generates()[before:]
    assert len(gens) == 1
    assert _aborted(engine, gens[0].request_id)
