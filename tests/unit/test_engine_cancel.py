"""A caller cancelled while its engine call is still connecting sees the cancellation, whatever the moment
it lands: on Python 3.11 ``asyncio.wait_for`` returned the connect's own outcome instead when the cancel
came as the connect ended (here: refused), and a loop being stopped went on (a KV feed kept a node's
close waiting, retrying every 10 s). ``asyncio.timeout`` keeps it; ruff bans ``wait_for`` in ``shepherd``."""

from __future__ import annotations

import asyncio
import socket

from shepherd.node.engines.h2 import H2EngineClient
from shepherd.proto.engine_types import EngineError


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_a_cancel_at_any_step_of_a_refused_connect_is_not_lost() -> None:
    port = refused_port()
    cancelled, finished = 0, 0
    for steps in range(40):  # bounded: the cancel lands one loop step later each time
        client = H2EngineClient(f"grpc://127.0.0.1:{port}", f"127.0.0.1:{port}", "sglang")
        try:
            call = asyncio.create_task(client.server_info(timeout=5.0))
            for _ in range(steps):
                await asyncio.sleep(0)
            requested = call.cancel()  # False: the call had ended (refused) before
            outcome: BaseException | None = None
            try:
                await call
            except BaseException as e:  # (what the call ended with is the subject)
                outcome = e
            if requested:
                assert isinstance(outcome, asyncio.CancelledError), (steps, repr(outcome))
                cancelled += 1
            else:
                assert isinstance(outcome, EngineError | OSError), (steps, repr(outcome))
                finished += 1
        finally:
            await client.close()
    assert cancelled and finished  # both sides of the moment the connect ends were crossed
