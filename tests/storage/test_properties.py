"""Invariants over random inputs, on every backend (hypothesis; each example opens its store on the
test's namespace and uses fresh ids):

* paging a conversation (any page size, either order) visits each item once, in (added time,
  insertion) order, and ``has_more`` is false exactly on the last page;
* ``get_chain`` over a random graph of ``previous_response_id`` links (chains, cycles, dangling links)
  answers what the memory reference answers.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import ChainError, HistoryStore, StoredResponse
from tests.storage.conftest import Backend
from tests.storage.test_contract import T0, conversation, item, response

SETTINGS = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
_run = itertools.count()


async def _with_store(backend: Backend, ns: dict[str, Any], body: Any) -> None:
    s = backend.open(ns)
    await s.start()
    try:
        await body(s)
    finally:
        await s.close()


@pytest.mark.parametrize("page", [1, 3])
def test_pagination_visits_each_item_once_in_order(backend: Backend, page: int) -> None:
    ns = asyncio.run(backend.namespace())

    @SETTINGS
    @given(
        batches=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=5), min_size=1, max_size=5),
        order=st.sampled_from(["asc", "desc"]),
    )
    def check(batches: list[list[int]], order: str) -> None:
        async def body(s: HistoryStore) -> None:
            c = conversation()
            added: list[tuple[float, int, str]] = []
            for k, batch in enumerate(batches):
                its = [item(T0 + t) for t in batch]
                if k == 0:
                    await s.create_conversation(c, its)
                else:
                    await s.add_items(c.id, its)
                added += [(it.created_at, len(added) + j, it.id) for j, it in enumerate(its)]
            want = [i for _, _, i in sorted(added)]
            if order == "desc":
                want.reverse()
            seen: list[str] = []
            after: str | None = None
            for _ in range(len(want) + 2):  # bounded: one page more than needed at most
                p = await s.list_items(c.id, after=after, limit=page, order=order)  # type: ignore[arg-type]
                seen += [i.id for i in p.items]
                assert p.has_more == (len(seen) < len(want))
                if not p.has_more:
                    break
                after = p.items[-1].id
            assert seen == want

        asyncio.run(_with_store(backend, ns, body))

    check()


def test_chain_matches_the_reference(backend: Backend) -> None:
    ns = asyncio.run(backend.namespace())

    @SETTINGS
    @given(
        links=st.lists(st.one_of(st.none(), st.integers(0, 9)), min_size=1, max_size=10),
        max_depth=st.integers(1, 6),
    )
    def check(links: list[int | None], max_depth: int) -> None:
        run = next(_run)
        # response k's previous is response links[k] (which may be missing from the store: >= len)
        rid = [f"resp_p{run}_{k}" for k in range(10)]
        rs = [
            response(rid=rid[k], prev=None if p is None else rid[p], t=T0 + k, inputs=[])
            for k, p in enumerate(links)
        ]

        async def answers(s: HistoryStore) -> list[list[StoredResponse] | str]:
            for r in rs:
                await s.put_response(r, [])
            out: list[list[StoredResponse] | str] = []
            for r in rs:
                try:
                    out.append(await s.get_chain(r.id, max_depth))
                except ChainError:
                    out.append("ChainError")
            return out

        async def both(s: HistoryStore) -> None:
            ref = MemoryStore()
            assert await answers(s) == await answers(ref)

        asyncio.run(_with_store(backend, ns, both))

    check()


def test_items_round_trip(backend: Backend) -> None:
    ns = asyncio.run(backend.namespace())
    json_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)

    @SETTINGS
    @given(texts=st.lists(json_text, min_size=1, max_size=4), t=st.floats(0, 4e9, allow_nan=False))
    def check(texts: list[str], t: float) -> None:
        async def body(s: HistoryStore) -> None:
            its = [item(t, text=x) for x in texts]
            r = response(outputs=its, t=t)
            await s.put_response(r, its)
            assert await s.get_response(r.id) == r
            assert await s.get_items([i.id for i in its]) == its

        asyncio.run(_with_store(backend, ns, body))

    check()
