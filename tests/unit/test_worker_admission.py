"""A worker not admitted at its first check (no model info yet) is asked again by one task of its own,
whatever the number of attempts, which its removal or the registry's close ends; the health rounds
leave it to that task; once its engine answers it is health-checked at once. The end-to-end shape over
real gRPC: tests/contract/test_worker_admission.py."""

from __future__ import annotations

import asyncio

import pytest

from shepherd.node.config import build_config
from shepherd.node.dispatch import workers as workers_mod
from shepherd.node.dispatch.workers import WorkerRegistry
from shepherd.proto.engine_types import EngineUnavailable, ModelInfo


class _Engine:
    """An HTTP-like engine client (no kind to detect) whose model info fails while ``down``."""

    kind = "http"

    def __init__(self) -> None:
        self.down = True
        self.asked = 0
        self.checks = 0
        self.closed = False

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        self.asked += 1
        if self.down:
            raise EngineUnavailable("loading")
        return ModelInfo(max_context_length=4096)

    async def health_check(self, timeout: float = 2.0) -> bool:
        self.checks += 1
        return True

    def confirm_alive(self, timeout: float) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


async def _until(cond: object, what: str) -> None:
    for _ in range(500):  # bounded: 5 s
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> _Engine:
    eng = _Engine()
    monkeypatch.setattr(workers_mod, "make_client", lambda *a, **k: eng)
    return eng


def _registry() -> WorkerRegistry:
    cfg = build_config({}, {"health_check_interval_secs": 0.01, "health_success_threshold": 1})
    return WorkerRegistry(cfg)


async def test_one_task_asks_until_it_answers_then_it_is_checked_at_once(engine: _Engine) -> None:
    reg = _registry()
    w = await reg.add("http://127.0.0.1:9", "m")
    d = w.describe()
    assert d["status"] == "pending" and not d["healthy"] and "loading" in d["status_reason"], d
    await _until(lambda: engine.asked >= 10, "asked again")
    assert reg.admitting == 1  # one task, however many attempts
    await reg.check(w)  # a health round leaves a worker not admitted to its task
    assert engine.checks == 0
    engine.down = False
    await _until(lambda: w.status == "ready", "admitted and healthy")
    d = w.describe()
    assert d["healthy"] and d["status_reason"] is None and d["max_context_length"] == 4096, d
    assert reg.admitting == 0
    await reg.close()


async def test_removal_and_close_end_the_retries(engine: _Engine) -> None:
    reg = _registry()
    w = await reg.add("http://127.0.0.1:9", "m")
    await _until(lambda: engine.asked >= 3, "asked again")
    await reg.remove(w.id)
    assert reg.admitting == 0 and engine.closed
    asked = engine.asked
    await asyncio.sleep(0.1)  # (pauses of 0.01 s: ten attempts, were it still asking)
    assert engine.asked == asked

    engine.closed = False
    w = await reg.add("http://127.0.0.1:9", "m")
    assert reg.admitting == 1
    await reg.close()
    assert reg.admitting == 0 and engine.closed


async def test_an_add_cancelled_during_its_first_ask_still_leaves_the_worker_asked(engine: _Engine) -> None:
    gate = asyncio.Event()
    real = engine.model_info

    async def slow(timeout: float = 5.0) -> ModelInfo:
        await gate.wait()
        return await real(timeout)

    engine.model_info = slow  # type: ignore[method-assign]
    reg = _registry()
    adding = asyncio.create_task(reg.add("http://127.0.0.1:9", "m"))
    await _until(lambda: len(reg.workers) == 1, "registered")
    adding.cancel()  # the caller of POST /workers went away during the first ask
    with pytest.raises(asyncio.CancelledError):
        await adding
    assert reg.admitting == 1  # not a worker left registered and never asked again
    gate.set()
    engine.down = False
    [w] = reg.workers.values()
    await _until(lambda: w.status == "ready", "admitted by its own task")
    await reg.close()
