"""Responses API fixes found in review, at the unit level: usage as openai-python's ``ResponseUsage``
requires it, output-text logprobs in the Responses shape, duplicate item ids refused at parse time,
the retried write when a concurrent request stored a client's item id first, and the bound on
background responses."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

import orjson
import pytest
from openai.types.responses import Response, ResponseTextDeltaEvent

from shepherd.node.api.common import History
from shepherd.node.api.responses import BackgroundRegistry, Turn
from shepherd.node.cluster.history import OwnerGone
from shepherd.node.openai.items import parse_items
from shepherd.node.openai.logprobs import TokenTextCache, chat_logprobs
from shepherd.node.output.responses import (
    ResponseEvents,
    response_object,
    response_usage,
    text_logprobs,
)
from shepherd.proto.engine_types import TokenLogprob
from shepherd.proto.openai_errors import ApiError
from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import StoredConversation, StoredItem, StoredResponse
from tests.helpers_tokenizers import load

_ids = itertools.count(1)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):048x}"


BASE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "model": "m",
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "metadata": {},
    "temperature": 1.0,
    "top_p": 1.0,
    "instructions": None,
}

CHAT_LP = {
    "content": [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
        }
    ]
}


def test_usage_validates_as_the_sdk_requires() -> None:
    usage = response_usage(10, 5, 2, 3)
    body = response_object(BASE, status="completed", output=[], usage=usage)
    r = Response.model_validate(body)  # strict: cache_write_tokens is a required field
    assert r.usage is not None and r.usage.input_tokens_details.cache_write_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 3 and r.usage.total_tokens == 15


def test_text_logprobs_take_the_responses_shape() -> None:
    [lp] = text_logprobs(CHAT_LP)
    assert lp == {
        "token": "Hi",
        "bytes": [72, 105],
        "logprob": -0.5,
        "top_logprobs": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5}],
    }
    assert text_logprobs(None) == [] and text_logprobs({"content": None}) == []
    enc = ResponseEvents(BASE, _new_id, quiet=True)
    enc.content(0, "Hi", CHAT_LP)
    enc.finish(0, "stop")
    [msg] = enc.items
    assert msg["content"][0]["logprobs"] == [lp]
    Response.model_validate(
        response_object(BASE, status="completed", output=[msg], usage=response_usage(1, 1, 0))
    )


def test_text_logprobs_keep_a_partial_utf8_tokens_real_bytes() -> None:
    """A token holding part of a character (its string escaped, ``"\\xf0\\x93"``): the Responses entry
    has its real bytes, as the chat entry it comes from, not those of the escaped string."""
    tok = load("qwen3")
    ids = tok.encode("\U00013000", add_special_tokens=False).ids  # one character, three tokens here
    assert len(ids) > 1
    cache = TokenTextCache.for_tokenizer(tok)
    chat = chat_logprobs([TokenLogprob(i, -0.5, ((i, -0.5),)) for i in ids], cache, 1)
    entries = text_logprobs(chat)
    assert [e["bytes"] for e in entries] == [list(cache.get(i).raw) for i in ids]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "\U00013000"
    assert [t["bytes"] for e in entries for t in e["top_logprobs"]] == [e["bytes"] for e in entries]
    assert entries[0]["token"] == cast(list[dict[str, Any]], chat["content"])[0]["token"] == "\\xf0\\x93"


def test_streamed_deltas_carry_logprobs_and_the_done_events_all_of_them() -> None:
    ev = ResponseEvents(BASE, _new_id)
    ev.role()
    delta = ev.content(0, "Hi", CHAT_LP)
    ev.content(0, " there", None)
    ev.finish(0, "stop")
    [added_ev, part_ev, delta_ev] = [_payload(b) for b in delta.split(b"\n\n") if b]
    assert (
        added_ev["type"] == "response.output_item.added" and part_ev["type"] == "response.content_part.added"
    )
    d = ResponseTextDeltaEvent.model_validate(delta_ev)
    assert [x.token for x in d.logprobs] == ["Hi"]
    [msg] = ev.items
    assert msg["content"][0]["text"] == "Hi there" and len(msg["content"][0]["logprobs"]) == 1


def _payload(block: bytes) -> dict[str, Any]:
    data = block.split(b"\ndata: ", 1)[1]
    out: dict[str, Any] = orjson.loads(data)
    return out


def test_duplicate_item_ids_are_a_400_naming_the_second() -> None:
    raw = [
        {"type": "message", "id": "msg_dup", "role": "user", "content": "a"},
        {"type": "message", "id": "msg_dup", "role": "user", "content": "b"},
    ]
    with pytest.raises(ApiError) as e:
        parse_items(raw, param="input", new_id=_new_id, now=0.0)
    assert e.value.status == 400 and e.value.param == "input[1].id"
    ref = [{"type": "item_reference", "id": "msg_x"}, {"type": "item_reference", "id": "msg_x"}]
    with pytest.raises(ApiError):
        parse_items(ref, param="input", new_id=_new_id, now=0.0)


def _turn(hist: History, rid: str, given: StoredItem) -> Turn:
    return Turn(hist, rid, 1.0, "m", None, None, None, [given], (given.id,), None)


def test_a_client_item_stored_meanwhile_is_referred_to_not_a_500() -> None:
    """Two requests give the same (new) client item id: the second write finds it stored and refers to it."""

    async def run() -> None:
        store = MemoryStore()
        hist = History(store, "0" * 8)
        item = StoredItem("msg_client", "message", {"type": "message", "id": "msg_client"}, 1.0)
        first, second = _turn(hist, "resp_a", item), _turn(hist, "resp_b", item)
        await first.save(response_object(BASE, status="completed", output=[], usage=None), [])
        await second.save(response_object(BASE, status="completed", output=[], usage=None), [])
        b = await store.get_response("resp_b")
        assert b is not None and b.input_item_ids == ("msg_client",) and second.new_input == []
        assert [i.id for i in await store.get_items(["msg_client"])] == ["msg_client"]

    asyncio.run(run())


class _OwnerDeadStore(MemoryStore):
    """An embedded store in a mesh whose records' owner node is dead (``RoutedStore``'s answer)."""

    async def put_response(self, *a: Any, **kw: Any) -> None:
        raise OwnerGone("the node 'b' that owns this record is dead")

    async def update_response(self, *a: Any, **kw: Any) -> bool:
        raise OwnerGone("the node 'b' that owns this record is dead")


def test_a_turn_whose_owner_died_meanwhile_ends_with_an_api_error_and_runs_on() -> None:
    """The owner of a turn's conversation dies while the turn runs elsewhere: storing the streamed turn's
    end is an ``ApiError`` (the stream ends with its in-band error; a raw ``OwnerGone`` cut the stream
    without an end), and a background response's checkpoint counts as a failed write, not as its record
    deleted (its runner cancelled: the stream then ended without any terminal event)."""
    from shepherd.node.api.responses import _still_running

    async def run() -> None:
        hist = History(_OwnerDeadStore(), "0" * 8)
        turn = Turn(hist, "resp_t", 1.0, "m", None, None, "conv_1", [], (), None)
        with pytest.raises(ApiError) as e:
            await turn.save(response_object(BASE, status="completed", output=[], usage=None), [])
        assert e.value.status == 404 and e.value.code == "owner_unavailable"
        runner = asyncio.get_running_loop().create_future()
        body = response_object(BASE, status="in_progress", output=[], usage=None)
        assert await _still_running(turn, body, cast(Any, runner)) is None
        assert not runner.cancelled()
        runner.cancel()

    asyncio.run(run())


class _EndMissedStore(MemoryStore):
    """Its records' owner died as the turn ended: the running record was written, its end is not."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[str] = []

    async def update_response(self, response: StoredResponse, *a: Any, **kw: Any) -> bool:
        if response.status == "in_progress":
            return True
        self.ends.append(response.status)
        raise OwnerGone("the node 'b' that owns this record is dead")


def test_a_background_end_the_owner_missed_is_not_replaced_by_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A background response that completed while its record's owner was down: that end is what
    ``RoutedStore`` sends again once the owner is back (the latest write per record), so no failure is
    written after it (it replaced the completed answer there)."""
    from types import SimpleNamespace

    from shepherd.node.api import responses as api

    async def run() -> None:
        store = _EndMissedStore()
        turn = Turn(History(store, "0" * 8), "resp_t", 1.0, "m", None, None, None, [], (), None)

        async def collect(*a: Any, **kw: Any) -> tuple[list[Any], list[Any]]:
            return [None], []

        g = SimpleNamespace(
            gw=SimpleNamespace(metrics=SimpleNamespace(overhead=SimpleNamespace(observe=lambda v: None))),
            t0=0.0,
            collect=collect,
            rejected=lambda v: None,
        )
        monkeypatch.setattr(api, "_answer", lambda *a: ("stop", "completed", [], None))
        await api._background(api._Run(cast(Any, g), cast(Any, None), turn, BASE, None, None))
        assert store.ends == ["completed"]

    asyncio.run(run())


def test_background_registry_is_bounded() -> None:
    async def run() -> None:
        reg = BackgroundRegistry(limit=2)
        gate = asyncio.Event()

        async def wait() -> None:
            await gate.wait()

        tasks = [asyncio.create_task(wait()) for _ in range(2)]
        assert not reg.full()
        for i, t in enumerate(tasks):
            reg.add(f"resp_{i}", t)
        assert reg.full() and len(reg) == 2
        gate.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(0)  # the done callbacks
        assert not reg.full() and len(reg) == 0
        await reg.close()

    asyncio.run(run())


def test_memory_store_is_bounded_by_bytes_too() -> None:
    """Few but large items (up to megabytes each) are evicted by size, oldest first."""

    async def run() -> None:
        store = MemoryStore(max_items=1000, max_bytes=10_000)
        for n in range(5):
            it = StoredItem(f"msg_{n}", "message", {"type": "message", "text": "x" * 4000}, float(n))
            rec = Turn(
                History(store, "0" * 8), f"resp_{n}", float(n), "m", None, None, None, [it], (it.id,), None
            )
            await rec.save(response_object(BASE, status="completed", output=[], usage=None), [])
        assert 0 < store.bytes <= 10_000 and store.stats.evicted == 3
        assert await store.get_response("resp_0") is None and await store.get_response("resp_4") is not None
        assert [i.id for i in await store.get_items(["msg_0", "msg_4"])] == ["msg_4"]
        await store.delete_response("resp_4")
        await store.delete_response("resp_3")
        assert store.bytes == 0

    asyncio.run(run())


def test_memory_store_counts_response_bodies_and_conversations() -> None:
    """What a client stores besides items counts too: a response body (a client's large schema rides in
    it) and a conversation (its metadata, and itself against the entry bound), evicted oldest first."""

    async def run() -> None:
        store = MemoryStore(max_items=1000, max_bytes=20_000)
        for n in range(10):
            body = {"id": f"resp_{n}", "text": {"format": {"schema": {"x": "y" * 4000}}}}
            await store.put_response(StoredResponse(f"resp_{n}", float(n), "m", body), [])
        assert 0 < store.bytes <= 20_000 and store.stats.evicted >= 6
        assert await store.get_response("resp_0") is None and await store.get_response("resp_9") is not None
        few = MemoryStore(max_items=50)
        for n in range(200):
            await few.create_conversation(StoredConversation(f"conv_{n}", float(n), {"k": "v" * 10}))
        assert len(few._convs) == 50 and few.stats.evicted == 150
        assert await few.get_conversation("conv_199") is not None
        for n in range(150, 200):
            await few.delete_conversation(f"conv_{n}")
        for n in range(10):
            await store.delete_response(f"resp_{n}")
        assert few.bytes == 0 and store.bytes == 0

    asyncio.run(run())


def test_streams_following_running_responses_from_the_store_are_bounded_per_node() -> None:
    """Each such stream re-reads the record every 0.25-2 s: past the node's bound a 429 (a replay of an
    ended one is one read: never refused)."""
    from types import SimpleNamespace  # (this test alone serves the routes)

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from shepherd.node.api import responses as api
    from shepherd.node.api.common import GATEWAY, HISTORY, KEEPALIVE_TICKER, KeepAlive

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:  # (the node's, less metrics)
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except ApiError as e:
            return web.Response(status=e.status, body=e.body(), content_type="application/json")

    async def run() -> None:
        store = MemoryStore()
        hist = History(store, "t1")
        body = {**BASE, "background": True, "status": "in_progress", "_events": [], "_runner": "t2/x"}
        ended = {**BASE, "id": "resp_done", "background": True, "status": "completed", "_events": []}
        for b in (body, ended):
            rec = StoredResponse(b["id"], 1.0, "m", b, (), (), None, None, None, b["status"])
            await store.put_response(rec, [])
        app = web.Application(middlewares=[errors])
        api.install(app)
        app[api.BACKGROUND].followers_limit = 1
        app[HISTORY] = hist
        app[GATEWAY] = cast(Any, SimpleNamespace(cfg=SimpleNamespace(request_timeout_secs=5.0)))
        app[KEEPALIVE_TICKER] = KeepAlive(0)
        async with TestClient(TestServer(app)) as c:
            first = await c.get("/v1/responses/resp_1", params={"stream": "true"})
            assert first.status == 200  # following (its record: no event yet, not ended)
            second = await c.get("/v1/responses/resp_1", params={"stream": "true"})
            assert second.status == 429 and (await second.json())["error"]["code"] == "too_many_followers"
            replay = await c.get("/v1/responses/resp_done", params={"stream": "true"})
            assert replay.status == 200 and await replay.read() == b""
            first.close()

    asyncio.run(run())


def test_one_caller_cannot_take_every_follower_slot_of_a_node() -> None:
    """With auth on, a principal's streams following running responses from the store are bounded on
    their own too: another caller still gets a slot; with auth off (no owner) only the node's bound."""
    from shepherd.node.api.responses import BackgroundRegistry  # (the registry's bookkeeping alone)

    reg = BackgroundRegistry(followers=5, followers_per_owner=2)
    assert reg.follower_refused("a") is None and reg.follower_refused("a") is None
    assert "of this caller" in (reg.follower_refused("a") or "")
    assert reg.follower_refused("b") is None
    assert reg.follower_refused(None) is None and reg.follower_refused(None) is None
    assert "on this node" in (reg.follower_refused("c") or "")  # 5 in all
    reg.follower_ended("a")
    assert reg.follower_refused("a") is None  # its slot back
    for owner in ("a", "a", "b", None, None):
        reg.follower_ended(owner)
    assert reg.followers == 0 and reg.owner_followers == {}
