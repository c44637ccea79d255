"""What the tests of real mesh runtimes on loopback share: a keyring key (and a foreign one), SWIM
timings fast enough for tests, and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shepherd.mesh.swim_types import SwimConfig

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
