"""A worker is admitted (takes requests) once it has given its model info (GetModelInfo, and an SGLang
engine's GetServerInfo): an engine loading its weights or under heavy load answers those late. The node
asks it again, with a longer deadline each time it ran out, shows it in ``GET /workers`` as ``pending``
with the reason, says so at WARNING, and admits it as soon as it answers; one that has not answered
within ``--worker-startup-timeout-secs`` is said at ERROR and shown ``failed``, and is still asked (as
SMG keeps a failed worker registered). A real node over a replay servicer whose two calls answer late.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.contract.nodes import MODEL, replay
from tests.contract.replay import EngineFacts, ReplayServer
from tests.e2e.node_procs import NodeProc, start_node

pytestmark = pytest.mark.timeout(180)


@contextmanager
def node_over_slow(s: ReplayServer, tok: Path, *extra: str) -> Iterator[NodeProc]:
    """A node over ``s``, live (its worker not admitted yet), stopped by pid."""
    node = start_node(
        *("--worker-urls", s.url, "--model-id", MODEL, "--model-path", str(tok), "--tokenizer-workers", "0"),
        *("--health-check-interval-secs", "0.5", "--health-success-threshold", "1"),
        *extra,
        wait_ready=False,
    )
    try:
        yield node
    finally:
        node.stop()


def worker(node: NodeProc) -> dict[str, Any]:
    (w,) = httpx.get(node.url + "/workers", timeout=10).json()["workers"]
    got: dict[str, Any] = w
    return got


def wait_for(node: NodeProc, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded by the deadline
        if cond():
            return
        assert node.proc.poll() is None, node.log()
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout} s; worker {worker(node)}\n{node.log()[-3000:]}")


def test_a_worker_slow_to_give_its_model_info_is_admitted_once_it_answers(tok: Path) -> None:
    # each call 3 s: 6 s in all, over the first attempt's 5 s (the health-check timeout + 3)
    with replay("sglang-smg", EngineFacts(info_delay_s=3.0)) as s, node_over_slow(s, tok) as node:
        w = worker(node)
        assert w["status"] == "pending" and not w["healthy"], w
        assert "no answer to GetModelInfo / GetServerInfo within 5 s" in w["status_reason"], w
        warned = [ln for ln in node.log().splitlines() if "WARNING" in ln and s.url in ln]
        assert any("not admitted yet" in ln for ln in warned), node.log()

        wait_for(node, "admitted", lambda: worker(node)["status"] == "ready")
        w = worker(node)
        assert w["healthy"] and w["status_reason"] is None and w["max_context_length"] == 2048, w
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert r.choices[0].text
        assert "ERROR" not in node.log()


def test_a_worker_that_does_not_answer_fails_at_the_startup_timeout_and_is_still_asked(tok: Path) -> None:
    with (
        replay("sglang-smg", EngineFacts(info_delay_s=600.0)) as s,
        node_over_slow(s, tok, "--worker-startup-timeout-secs", "1") as node,
    ):
        wait_for(node, "failed", lambda: worker(node)["status"] == "failed")
        w = worker(node)
        assert not w["healthy"] and "no answer to GetModelInfo / GetServerInfo" in w["status_reason"], w
        errors = [ln for ln in node.log().splitlines() if " ERROR " in ln]
        assert any(s.url in ln and "--worker-startup-timeout-secs" in ln for ln in errors), node.log()
        assert httpx.get(node.url + "/readiness", timeout=10).status_code == 503

        s.facts.info_delay_s = 0.0  # the engine answers now: the calls waiting, and the next ones
        wait_for(node, "admitted", lambda: worker(node)["status"] == "ready")
        assert httpx.get(node.url + "/readiness", timeout=10).status_code == 200
