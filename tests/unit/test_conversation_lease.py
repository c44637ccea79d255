"""A conversation's turn holds its lease until its end is stored, and frees it before the client can
read that end: an agent's next turn, sent as soon as the last one's end is read, is never refused as
``conversation_locked`` (a streamed turn's ``end``, a background turn's terminal update)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shepherd.node.api import responses as api
from shepherd.node.api.common import History
from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import StorageUnavailable, StoredConversation


async def _turn(store: MemoryStore, conv: str, rid: str) -> api.Turn:
    lease = api._Lease(store, conv, rid)
    now = time.time()
    assert await store.claim(lease.name, rid, now + 60, now)
    hist = History(store, "t1")
    return api.Turn(hist, rid, now, "m", None, None, conv, [], (), None, lease=lease)


def _body(rid: str, status: str) -> dict[str, object]:
    return {"id": rid, "object": "response", "status": status, "output": [], "usage": None}


async def _free(store: MemoryStore, conv: str) -> bool:
    now = time.time()
    return await store.claim(api.conversation_lease(conv), "resp_next", now + 60, now)


@pytest.mark.parametrize("status", ["completed", "failed", "incomplete"])
async def test_a_stored_end_frees_the_conversation(status: str) -> None:
    store = MemoryStore()
    await store.create_conversation(StoredConversation("conv_1", time.time(), {}))
    turn = await _turn(store, "conv_1", "resp_1")
    assert not await _free(store, "conv_1")  # held while the turn runs
    await turn.save(_body("resp_1", status), [])
    assert await _free(store, "conv_1")


async def test_a_background_turn_frees_it_with_its_terminal_update_only() -> None:
    store = MemoryStore()
    await store.create_conversation(StoredConversation("conv_2", time.time(), {}))
    turn = await _turn(store, "conv_2", "resp_2")
    await turn.put(turn.record(_body("resp_2", "queued"), [], "queued"), [])
    await turn.update(_body("resp_2", "in_progress"), [])
    assert not await _free(store, "conv_2")  # still running
    await turn.update(_body("resp_2", "completed"), [])
    assert await _free(store, "conv_2")
    assert (await store.get_response("resp_2")) is not None


async def test_a_release_cancelled_midway_is_made_by_the_next_call() -> None:
    """A cancel landing inside the release's store call (a background task cancelled as it stores its
    end) leaves the lease to the next ``release`` (its task's ``finally``), not held until it expires."""
    store = MemoryStore()
    await store.create_conversation(StoredConversation("conv_3", time.time(), {}))
    lease = (await _turn(store, "conv_3", "resp_3")).lease
    assert lease is not None
    real = store.release
    entered = asyncio.Event()

    async def slow(name: str, holder: str) -> bool:
        entered.set()
        await asyncio.sleep(10)
        return await real(name, holder)

    store.release = slow  # type: ignore[method-assign]
    task = asyncio.create_task(lease.release())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store.release = real  # type: ignore[method-assign]
    assert not await _free(store, "conv_3")
    await lease.release()
    assert await _free(store, "conv_3")


async def test_a_release_the_store_refused_is_made_once_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store down as a turn ends (its end not stored: the client told so) refuses the release too: it
    is made again once the store answers, not left to expire at the turn's deadline (10 minutes of
    ``conversation_locked`` for a store that was back in seconds)."""
    monkeypatch.setattr(api, "RELEASE_RETRY_S", 0.01)
    monkeypatch.setattr(api, "RELEASE_RETRY_MAX_S", 0.02)
    store = MemoryStore()
    await store.create_conversation(StoredConversation("conv_4", time.time(), {}))
    lease = (await _turn(store, "conv_4", "resp_4")).lease
    assert lease is not None
    lease.until = time.time() + 60
    real = store.release
    refused = 0

    async def down(name: str, holder: str) -> bool:
        nonlocal refused
        if refused < 3:  # the store down for the release and two more tries
            refused += 1
            raise StorageUnavailable("down")
        return await real(name, holder)

    store.release = down  # type: ignore[method-assign]
    await lease.release()  # (logged, not raised)
    for _ in range(500):  # bounded: until the store has answered a try
        if refused == 3 and await _free(store, "conv_4"):
            break
        await asyncio.sleep(0.01)
    assert await _free(store, "conv_4")
