"""The native prefix index's 64 workers per model, enforced where workers come in: a configuration with
more is refused at start-up (``Gateway``: ``ConfigError``), a run-time add beyond it gets HTTP 409
``too_many_workers`` (``WorkerRegistry.add``, what the admin API and the mesh bridge call), instead of
the index silently dropping the extra worker's inserts. Policies without that index have no limit."""

from __future__ import annotations

import pytest

from shepherd.node.config import ConfigError, build_config
from shepherd.node.dispatch.gateway import Gateway
from shepherd.policies.native_index import NATIVE_INDEX, WORKER_LIMIT
from shepherd.proto.openai_errors import ApiError

pytestmark = pytest.mark.timeout(120)

# the core is built by the project's install (make / pip install -e .): CI always has it
needs_core = pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built")


def _urls(n: int) -> list[str]:
    # loopback ports nobody listens on: the first check fails at once (connection refused)
    return [f"http://127.0.0.1:{1 + i}" for i in range(n)]


@needs_core
def test_a_configuration_with_more_workers_than_the_index_holds_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match="more than the 64"):
        Gateway(build_config({}, {"policy": "cache_aware", "worker_urls": _urls(WORKER_LIMIT + 1)}))
    gw = Gateway(build_config({}, {"policy": "cache_aware", "worker_urls": _urls(WORKER_LIMIT)}))
    assert gw.registry.workers == {}  # built, nothing dialed yet


@needs_core
async def test_a_run_time_add_beyond_the_limit_gets_409_and_a_removal_makes_room() -> None:
    gw = Gateway(build_config({}, {"policy": "cache_aware"}))
    model = next(iter(gw.models))
    reg = gw.registry
    try:
        for url in _urls(WORKER_LIMIT):
            await reg.add(url, model)
        assert len(reg.for_model(model)) == WORKER_LIMIT
        extra = "http://127.0.0.1:999"
        with pytest.raises(ApiError) as ei:
            await reg.add(extra, model)
        assert ei.value.status == 409 and ei.value.code == "too_many_workers"
        assert reg.find(extra) is None
        await reg.add(_urls(1)[0], model)  # one already registered: idempotent, not refused
        first = reg.find(_urls(1)[0])
        assert first is not None
        await reg.remove(first.id)
        w = await reg.add(extra, model)
        assert reg.find(extra) is w
    finally:
        await reg.close()


async def test_a_policy_without_the_native_index_has_no_worker_limit() -> None:
    gw = Gateway(build_config({}, {"policy": "round_robin", "worker_urls": _urls(WORKER_LIMIT + 1)}))
    model = next(iter(gw.models))
    try:
        for url in _urls(WORKER_LIMIT + 1):
            await gw.registry.add(url, model)
        assert len(gw.registry.for_model(model)) == WORKER_LIMIT + 1
    finally:
        await gw.registry.close()
