"""Worker choice: unhealthy and open-circuit workers are skipped; a half-open worker takes one trial."""

from __future__ import annotations

from shepherd.node.config import build_config
from shepherd.node.dispatch.circuit_breaker import BreakerState, CircuitBreaker, HealthTracker
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.workers import Worker
from shepherd.node.engines.http import HttpRelayClient


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gateway_with(n: int) -> tuple[Gateway, list[Worker], Clock]:
    gw = Gateway(build_config({}, {"policy": "round_robin"}))
    clock = Clock()
    gw.registry.clock = clock
    ws = []
    for i in range(n):
        w = Worker(
            id=f"w{i}",
            url=f"grpc://127.0.0.1:{5000 + i}",
            model="qwen3",
            client=HttpRelayClient(f"http://127.0.0.1:{5000 + i}"),  # never called here
            health=HealthTracker(healthy=True, checked=True),
            breaker=CircuitBreaker(failure_threshold=1, success_threshold=1, open_secs=10),
        )
        gw.registry.workers[w.id] = w
        ws.append(w)
    return gw, ws, clock


def test_skips_unhealthy_and_open() -> None:
    gw, (_a, b, c), clock = gateway_with(3)
    b.health.healthy = False
    c.breaker.record_failure(clock.now)
    picks = {gw.pick("qwen3", set(), [], None, http=True).id for _ in range(6)}  # type: ignore[union-attr]
    assert picks == {"w0"}
    assert gw.pick("qwen3", {"w0"}, [], None, http=True) is None


def test_half_open_trial_then_others() -> None:
    gw, (a, _b), clock = gateway_with(2)
    a.breaker.record_failure(clock.now)
    clock.now += 11  # cool-down over: a may take one trial
    got = [gw.pick("qwen3", set(), [], None, http=True) for _ in range(4)]
    ids = [w.id for w in got if w is not None]
    assert ids.count("w0") == 1 and len(ids) == 4  # one trial for w0, the rest go to w1
    assert a.breaker.state is BreakerState.HALF_OPEN
