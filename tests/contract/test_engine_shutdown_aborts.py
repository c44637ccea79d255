"""A node stopped (SIGTERM) with a stream still under way when its grace is over: the stream ends with its
in-band error and the engine gets an Abort naming its call, over the lean HTTP/2 client and grpcio alike
(``--shutdown-grace-period-secs``: "every engine call aborted"). SMG's SGLang servicer replayed
(tests/contract/replay.py ``sglang-smg``), which records every Abort it receives; the Abort must go out
before the node closes its engine connections."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.contract.nodes import MODEL, node_over, replay, tokenizer_dir
from tests.contract.replay import Choice, Plan, ReplayServer


def _aborted(engine: ReplayServer, rid: str) -> bool:
    with engine.lock:
        return any(m == "Abort" and r.request_id == rid for m, r in engine.requests)


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
def test_shutdown_aborts_the_calls_it_ends(transport: str) -> None:
    with tokenizer_dir() as tok, replay("sglang-smg") as engine:
        # one token, then the engine keeps the request running past the node's 1 s grace
        engine.plan = Plan([Choice([[72]], finish=None)], hold_s=60.0)
        args = ("--shutdown-grace-period-secs", "1", "--engine-transport", transport)
        with node_over([engine], tok, *args) as node:
            lines: list[str] = []
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}

            def stream() -> None:
                with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=60) as r:
                    lines.extend(ln for ln in r.iter_lines() if ln)  # bounded: the grace, then the end

            t = threading.Thread(target=stream)
            t.start()
            deadline = time.monotonic() + 30
            while not engine.generates() and time.monotonic() < deadline:  # bounded
                time.sleep(0.05)
            assert engine.generates()
            rid = engine.generates()[0].request_id
            node.proc.send_signal(signal.SIGTERM)
            assert node.proc.wait(timeout=30) == 0
            t.join(30)
        assert lines[-1] == "data: [DONE]" and "server_shutting_down" in lines[-2], lines[-3:]
        assert _aborted(engine, rid)  # (the node has exited: whatever Abort it sent has arrived)
