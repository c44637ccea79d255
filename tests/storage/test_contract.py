"""The contract of shepherd/storage/types.py's docstring, on all four backends (the ``store`` fixture is
parametrized over memory, SQLite, PostgreSQL and Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence

import pytest

from shepherd.storage.types import (
    ChainError,
    HistoryStore,
    IntegrityError,
    NotFound,
    StoredConversation,
    StoredItem,
    StoredResponse,
)
from tests.storage.conftest import Backend

T0 = 1_764_378_000.123456  # a created_at with sub-millisecond digits: round trips exactly
_n = itertools.count()


def item(
    t: float = T0, *, role: str | None = "user", text: str = "hi", response_id: str | None = None
) -> StoredItem:
    i = f"msg_{next(_n):06d}"
    data = {"id": i, "type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
    return StoredItem(i, "message", data, t, response_id=response_id, role=role, status="completed")


def response(
    *,
    inputs: Sequence[StoredItem] = (),
    outputs: Sequence[StoredItem] = (),
    prev: str | None = None,
    conv: str | None = None,
    t: float = T0,
    status: str = "completed",
    rid: str | None = None,
) -> StoredResponse:
    rid = rid or f"resp_{next(_n):06d}"
    return StoredResponse(
        id=rid,
        created_at=t,
        model="m",
        body={"id": rid, "object": "response", "status": status, "usage": {"total_tokens": 3}},
        input_item_ids=tuple(i.id for i in inputs),
        output_item_ids=tuple(i.id for i in outputs),
        previous_response_id=prev,
        conversation_id=conv,
        owner="alice",
        status=status,
    )


def conversation(t: float = T0, **metadata: str) -> StoredConversation:
    return StoredConversation(f"conv_{next(_n):06d}", t, dict(metadata), owner="alice")


async def ids_of(store: HistoryStore, conv: str, **kw: object) -> list[str]:
    page = await store.list_items(conv, limit=1000, **kw)  # type: ignore[arg-type]
    return [i.id for i in page.items]


# ---- responses ------------------------------------------------------------------------------------------


async def test_put_and_get_response(store: HistoryStore) -> None:
    a, b = item(), item(role="assistant", text="x\u0000y ✓ \U0001f600")
    r = response(inputs=[a], outputs=[b])
    await store.put_response(r, [a, b])
    assert await store.get_response(r.id) == r
    assert await store.get_response("resp_missing") is None
    # the ones that exist, in the order asked
    assert await store.get_items([b.id, "msg_missing", a.id]) == [b, a]
    assert await store.get_items([]) == []
    assert store.stats.writes >= 1


async def test_duplicate_item_fails_the_whole_put(store: HistoryStore) -> None:
    c = conversation()
    await store.create_conversation(c)
    a = item()
    r1 = response(inputs=[a], conv=c.id)
    await store.put_response(r1, [a], c.id)
    z = item()
    r2 = response(inputs=[z, a], conv=c.id)
    with pytest.raises(IntegrityError):
        await store.put_response(r2, [z, a], c.id)
    assert await store.get_response(r2.id) is None
    assert await store.get_items([z.id]) == []
    assert await ids_of(store, c.id) == [a.id]
    # the same id twice in one put
    y = item()
    with pytest.raises(IntegrityError):
        await store.put_response(response(inputs=[y]), [y, y])
    assert await store.get_items([y.id]) == []


async def test_duplicate_response_id_and_unknown_refs(store: HistoryStore) -> None:
    a = item()
    r = response(inputs=[a])
    await store.put_response(r, [a])
    b = item()
    with pytest.raises(IntegrityError):
        await store.put_response(response(rid=r.id, inputs=[b]), [b])
    assert await store.get_items([b.id]) == []
    ghost = item()  # referred to, never stored
    c = item()
    r3 = response(inputs=[c, ghost])
    with pytest.raises(IntegrityError):
        await store.put_response(r3, [c])
    assert await store.get_response(r3.id) is None
    assert await store.get_items([c.id]) == []
    # a response may refer to items stored before
    r4 = response(inputs=[a], prev=r.id)
    await store.put_response(r4, [])
    assert await store.get_response(r4.id) == r4


async def test_put_into_unknown_conversation_stores_nothing(store: HistoryStore) -> None:
    a = item()
    r = response(inputs=[a], conv="conv_missing")
    with pytest.raises(NotFound):
        await store.put_response(r, [a], "conv_missing")
    assert await store.get_response(r.id) is None
    assert await store.get_items([a.id]) == []


async def test_update_response(store: HistoryStore) -> None:
    c = conversation()
    await store.create_conversation(c)
    a = item()
    r = response(inputs=[a], conv=c.id, status="in_progress")
    await store.put_response(r, [a], c.id)
    b = item(role="assistant")
    done = response(rid=r.id, inputs=[a], outputs=[b], conv=c.id, status="completed")
    await store.update_response(done, [b])
    assert await store.get_response(r.id) == done
    assert await store.get_items([a.id, b.id]) == [a, b]
    assert await ids_of(store, c.id) == [a.id, b.id]
    # a duplicate item: nothing of the update happens
    d = item()
    bad = response(rid=r.id, inputs=[a], outputs=[b, d], conv=c.id, status="failed")
    with pytest.raises(IntegrityError):
        await store.update_response(bad, [d, a])
    assert await store.get_response(r.id) == done
    assert await store.get_items([d.id]) == []
    with pytest.raises(NotFound):
        await store.update_response(response(rid="resp_missing"), [])


async def test_update_response_running_only_leaves_an_ended_one(store: HistoryStore) -> None:
    """``running_only``: a background response's runner writing its progress never undoes an end another
    writer stored (a cancel, a peer that held the runner gone)."""
    a = item()
    r = response(inputs=[a], status="queued")
    await store.put_response(r, [a])
    going = response(rid=r.id, inputs=[a], status="in_progress")
    assert await store.update_response(going, [], running_only=True) is True
    assert await store.get_response(r.id) == going
    cancelled = response(rid=r.id, inputs=[a], status="cancelled")
    assert await store.update_response(cancelled, [], running_only=True) is True
    b = item(role="assistant")
    late = response(rid=r.id, inputs=[a], outputs=[b], status="completed")
    assert await store.update_response(late, [b], running_only=True) is False
    assert await store.get_response(r.id) == cancelled
    assert await store.get_items([b.id]) == []  # nothing of the refused update happened
    assert await store.update_response(late, [b]) is True  # (without it: replaced, as before)
    assert await store.get_response(r.id) == late


async def test_update_response_drops_items_no_longer_referred_to(store: HistoryStore) -> None:
    a, b = item(), item()
    r = response(inputs=[a], outputs=[b])
    await store.put_response(r, [a, b])
    await store.update_response(response(rid=r.id, inputs=[a]))
    assert await store.get_items([a.id, b.id]) == [a]


async def test_delete_response(store: HistoryStore) -> None:
    c = conversation()
    await store.create_conversation(c)
    a, b = item(), item()
    r = response(inputs=[a, b], conv=c.id)
    await store.put_response(r, [a, b], c.id)
    await store.delete_item(c.id, b.id)
    assert await store.delete_response(r.id)
    assert not await store.delete_response(r.id)
    assert await store.get_response(r.id) is None
    # a still linked to the conversation; b referred to by nothing
    assert await store.get_items([a.id, b.id]) == [a]


# ---- chains ---------------------------------------------------------------------------------------------


async def _chain(store: HistoryStore, n: int, first_prev: str | None = None) -> list[StoredResponse]:
    out: list[StoredResponse] = []
    prev = first_prev
    for k in range(n):
        x = item(T0 + k)
        r = response(inputs=[x], prev=prev, t=T0 + k)
        await store.put_response(r, [x])
        out.append(r)
        prev = r.id
    return out


def _walked(rs: list[StoredResponse]) -> list[StoredResponse]:
    """A chain as ``get_chain`` gives it: the newest whole, the others without their bodies."""
    return [*(dataclasses.replace(r, body={}) for r in rs[:-1]), *rs[-1:]]


async def test_chain_order_and_depth(store: HistoryStore) -> None:
    rs = await _chain(store, 5)
    assert await store.get_chain(rs[-1].id, 5) == _walked(rs)
    assert await store.get_chain(rs[2].id, 3) == _walked(rs[:3])
    assert await store.get_chain(rs[0].id, 1) == rs[:1]
    with pytest.raises(ChainError):
        await store.get_chain(rs[-1].id, 4)
    assert await store.get_chain("resp_missing", 10) == []


async def test_chain_ends_at_a_response_not_held(store: HistoryStore) -> None:
    rs = await _chain(store, 3, first_prev="resp_elsewhere")
    got = await store.get_chain(rs[-1].id, 10)
    assert got == _walked(rs)
    assert got[0].previous_response_id == "resp_elsewhere"


async def test_chain_cycle_is_an_error(store: HistoryStore) -> None:
    # a cycle through the public interface: a response may name a previous one not (yet) stored
    x, y, z = item(), item(), item()
    a = response(inputs=[x], prev="resp_b_cycle", rid=f"resp_a{next(_n)}")
    b = response(inputs=[y], prev=a.id, rid="resp_b_cycle")
    await store.put_response(a, [x])
    await store.put_response(b, [y])
    for rid in (a.id, b.id):
        with pytest.raises(ChainError):
            await store.get_chain(rid, 100)
    self_loop = response(inputs=[z], rid=f"resp_self{next(_n)}")
    self_loop = response(inputs=[z], rid=self_loop.id, prev=self_loop.id)
    await store.put_response(self_loop, [z])
    with pytest.raises(ChainError):
        await store.get_chain(self_loop.id, 100)


# ---- conversations --------------------------------------------------------------------------------------


async def test_conversation_crud(store: HistoryStore) -> None:
    a, b = item(), item()
    c = conversation(topic="x")
    await store.create_conversation(c, [a, b])
    assert await store.get_conversation(c.id) == c
    with pytest.raises(IntegrityError):
        await store.create_conversation(c)
    with pytest.raises(IntegrityError):  # an item already stored
        await store.create_conversation(conversation(), [a])
    updated = await store.update_conversation(c.id, {"topic": "y", "k": "v"})
    assert updated == StoredConversation(c.id, c.created_at, {"topic": "y", "k": "v"}, "alice")
    assert await store.get_conversation(c.id) == updated
    assert await store.update_conversation("conv_missing", {"a": "b"}) is None
    assert await store.get_conversation("conv_missing") is None
    with pytest.raises(NotFound):
        await store.add_items("conv_missing", [item()])
    assert await store.delete_conversation(c.id)
    assert not await store.delete_conversation(c.id)
    assert await store.get_conversation(c.id) is None
    with pytest.raises(NotFound):
        await store.list_items(c.id)
    # its items went with it (nothing else referred to them)
    assert await store.get_items([a.id, b.id]) == []


async def test_items_list_in_added_order_with_ties_by_insertion(store: HistoryStore) -> None:
    c = conversation()
    first = [item(T0 + 5), item(T0 + 5), item(T0 + 5)]
    await store.create_conversation(c, first)
    later = [item(T0 + 3), item(T0 + 7), item(T0 + 5)]
    await store.add_items(c.id, later)
    want = [first[0], first[1], first[2], later[2]]
    want = [later[0], *want, later[1]]
    assert await ids_of(store, c.id) == [i.id for i in want]
    assert await ids_of(store, c.id, order="desc") == [i.id for i in reversed(want)]
    assert await store.get_item(c.id, later[1].id) == later[1]


async def test_list_items_pages(store: HistoryStore) -> None:
    c = conversation()
    its = [item(T0 + k // 3) for k in range(7)]
    await store.create_conversation(c, its[:4])
    await store.add_items(c.id, its[4:])
    ids = [i.id for i in its]
    for order, want in (("asc", ids), ("desc", ids[::-1])):
        seen: list[str] = []
        after: str | None = None
        for _ in range(10):
            page = await store.list_items(c.id, after=after, limit=3, order=order)  # type: ignore[arg-type]
            seen += [i.id for i in page.items]
            if not page.has_more:
                break
            after = page.items[-1].id
        assert seen == want
    p = await store.list_items(c.id, limit=7)
    assert len(p.items) == 7 and not p.has_more
    p = await store.list_items(c.id, limit=6)
    assert len(p.items) == 6 and p.has_more
    p = await store.list_items(c.id, after=ids[-1])
    assert p.items == [] and not p.has_more
    with pytest.raises(NotFound):
        await store.list_items(c.id, after="msg_not_here")


async def test_get_and_delete_item(store: HistoryStore) -> None:
    c1, c2 = conversation(), conversation()
    a, b = item(), item()
    await store.create_conversation(c1, [a])
    await store.create_conversation(c2, [b])
    assert await store.get_item(c1.id, a.id) == a
    assert await store.get_item(c1.id, b.id) is None
    assert await store.get_item("conv_missing", a.id) is None
    assert not await store.delete_item(c1.id, b.id)
    assert not await store.delete_item("conv_missing", a.id)
    # an item a response refers to stays after its unlinking; one nothing refers to goes
    r = response(inputs=[], outputs=[a])
    await store.put_response(r, [])
    assert await store.delete_item(c1.id, a.id)
    assert not await store.delete_item(c1.id, a.id)
    assert await store.get_item(c1.id, a.id) is None
    assert await store.get_items([a.id]) == [a]
    assert await ids_of(store, c1.id) == []
    assert await store.delete_item(c2.id, b.id)
    assert await store.get_items([b.id]) == []


async def test_response_items_linked_to_conversation(store: HistoryStore) -> None:
    c = conversation()
    await store.create_conversation(c)
    prev: str | None = None
    want: list[str] = []
    rs: list[StoredResponse] = []
    for k in range(3):
        i, o = item(T0 + k), item(T0 + k, role="assistant")
        r = response(inputs=[i], outputs=[o], prev=prev, conv=c.id, t=T0 + k)
        await store.put_response(r, [i, o], c.id)
        want += [i.id, o.id]
        rs.append(r)
        prev = r.id
    assert await ids_of(store, c.id) == want
    assert await store.get_chain(rs[-1].id, 10) == _walked(rs)


# ---- records --------------------------------------------------------------------------------------------


async def test_records(store: HistoryStore) -> None:
    assert await store.get_record("key", "a") is None
    await store.put_record("key", "b", b"\x00\xff2")
    await store.put_record("key", "a", b"1")
    await store.put_record("other", "a", b"x")
    await store.put_record("key", "a", b"1'")
    assert await store.get_record("key", "a") == b"1'"
    assert await store.list_records("key") == [("a", b"1'"), ("b", b"\x00\xff2")]
    assert await store.delete_record("key", "a")
    assert not await store.delete_record("key", "a")
    assert await store.list_records("key") == [("b", b"\x00\xff2")]
    assert await store.list_records("other") == [("a", b"x")]
    assert await store.list_records("none") == []
    # retention never touches them
    await store.purge(T0 * 10)
    assert await store.get_record("other", "a") == b"x"


# ---- leases ---------------------------------------------------------------------------------------------


async def test_leases_have_one_holder_at_a_time(store: HistoryStore) -> None:
    now = T0
    assert await store.claim("conversation:conv_a", "resp_1", now + 60, now)
    assert not await store.claim("conversation:conv_a", "resp_2", now + 60, now + 1)  # held
    assert await store.claim("conversation:conv_b", "resp_2", now + 60, now + 1)  # another lease
    assert await store.claim("conversation:conv_a", "resp_1", now + 120, now + 2)  # its holder renews
    assert not await store.claim("conversation:conv_a", "resp_2", now + 200, now + 100)  # renewed: held
    assert not await store.release("conversation:conv_a", "resp_2")  # not its holder's
    assert await store.release("conversation:conv_a", "resp_1")
    assert not await store.release("conversation:conv_a", "resp_1")
    assert await store.claim("conversation:conv_a", "resp_2", now + 300, now + 101)  # free again
    # an expired lease (a holder that never released it) goes to the next claimant
    assert await store.claim("conversation:conv_a", "resp_3", now + 400, now + 301)
    assert not await store.release("conversation:conv_a", "resp_2")


async def test_a_lease_is_claimed_once_when_claimants_race(store: HistoryStore) -> None:
    got = await asyncio.gather(
        *(store.claim("conversation:race", f"resp_{i}", T0 + 60, T0) for i in range(8))
    )
    assert sum(got) == 1


# ---- retention ------------------------------------------------------------------------------------------


async def test_purge(store: HistoryStore) -> None:
    old_t, new_t, cut = 100.0, T0, 1000.0
    shared = item(old_t)
    old_in = item(old_t)
    old_r = response(inputs=[shared, old_in], t=old_t)
    await store.put_response(old_r, [shared, old_in])
    old_c = conversation(old_t)
    old_ci = item(old_t)
    await store.create_conversation(old_c, [old_ci])
    new_c = conversation(new_t)
    await store.create_conversation(new_c)
    new_in = item(new_t)
    new_r = response(inputs=[new_in, shared], t=new_t, conv=new_c.id)
    await store.put_response(new_r, [new_in], new_c.id)
    assert await store.purge(cut) == 2
    assert await store.get_response(old_r.id) is None
    assert await store.get_conversation(old_c.id) is None
    assert await store.get_response(new_r.id) == new_r
    assert await store.get_conversation(new_c.id) == new_c
    # items of purged records go, unless a kept record refers to them
    assert await store.get_items([shared.id, old_in.id, old_ci.id, new_in.id]) == [shared, new_in]
    assert await store.purge(cut) == 0
    assert store.stats.purged == 2


# ---- concurrency ----------------------------------------------------------------------------------------


async def test_concurrent_writers_on_one_store(store: HistoryStore) -> None:
    c = conversation()
    await store.create_conversation(c)

    async def one(k: int) -> str:
        x = item(T0 + k)
        await store.put_response(response(inputs=[x], conv=c.id, t=T0 + k), [x], c.id)
        return x.id

    ids = await asyncio.gather(*(one(k) for k in range(20)))
    assert await ids_of(store, c.id) == list(ids)


async def test_two_stores_on_one_database(backend: Backend) -> None:
    if backend.name == "memory":
        pytest.skip("the memory backend is one process's dicts: nothing to share")
    ns = await backend.namespace()
    s1, s2 = backend.open(ns), backend.open(ns)
    # both start at once: PostgreSQL's migrations serialize on the advisory lock
    await asyncio.gather(s1.start(), s2.start())
    try:
        c = conversation()
        await s1.create_conversation(c)

        async def one(s: HistoryStore, k: int) -> StoredResponse:
            x = item(T0 + k)
            r = response(inputs=[x], conv=c.id, t=T0 + k)
            await s.put_response(r, [x], c.id)
            return r

        rs = await asyncio.gather(*(one((s1, s2)[k % 2], k) for k in range(30)))
        for s in (s1, s2):
            assert len(await ids_of(s, c.id)) == 30
            assert [await s.get_response(r.id) for r in rs] == list(rs)
        # the same response id from both: exactly one wins
        x1, x2 = item(), item()
        got = await asyncio.gather(
            s1.put_response(response(rid="resp_race", inputs=[x1]), [x1]),
            s2.put_response(response(rid="resp_race", inputs=[x2]), [x2]),
            return_exceptions=True,
        )
        assert sorted(type(g).__name__ for g in got) == ["IntegrityError", "NoneType"]
    finally:
        await asyncio.gather(s1.close(), s2.close())
