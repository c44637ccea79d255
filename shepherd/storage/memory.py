"""The memory backend: dicts in this process, bounded by a count of entries (items, responses and
conversations) and by their size (the JSON size of the items' data, the responses' bodies and the
conversations' metadata, plus RECORD_BYTES a record: a client's 450 KB schema in a response body counts),
the oldest responses and conversations evicted first (counted in ``stats.evicted``). Lost when the
process ends.

Every method runs to completion without awaiting, so each one is atomic on the event loop.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence

import orjson

from shepherd.storage.types import (
    TERMINAL_STATUSES,
    ChainError,
    IntegrityError,
    ItemPage,
    NotFound,
    Order,
    StoredConversation,
    StoredItem,
    StoredResponse,
    StoreStats,
)

MAX_BYTES = 1 << 30  # the items' data held, by default
RECORD_BYTES = 256  # what a response or conversation record costs besides its JSON (counted in bytes)
MAX_LEASES = 10_000  # past twice this many leases held, the expired ones are dropped


class _Conv:
    __slots__ = ("links", "record")

    def __init__(self, record: StoredConversation) -> None:
        self.record = record
        # (added_at, seq, item id), sorted: listing order and pagination
        self.links: list[tuple[float, int, str]] = []


class MemoryStore:
    name = "memory"
    shared = False

    def __init__(self, max_items: int = 200_000, max_bytes: int = MAX_BYTES) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0  # the JSON size of the items, response bodies and conversation metadata held
        self.stats = StoreStats()
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._convs: OrderedDict[str, _Conv] = OrderedDict()
        self._items: dict[str, StoredItem] = {}
        self._sizes: dict[str, int] = {}  # item, response or conversation id -> its counted bytes
        self._refs: dict[str, int] = {}  # item id -> responses + conversations referring to it
        self._records: dict[str, dict[str, bytes]] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # name -> (holder, until)
        self._seq = itertools.count()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # ---- items and their reference counts -----------------------------------------------------------

    def _check_new(self, items: Sequence[StoredItem]) -> None:
        seen: set[str] = set()
        for it in items:
            if it.id in self._items or it.id in seen:
                raise IntegrityError(f"item {it.id!r} is already stored")
            seen.add(it.id)

    def _add_items(self, items: Sequence[StoredItem]) -> None:
        for it in items:
            self._items[it.id] = it
            self._refs.setdefault(it.id, 0)
            n = len(orjson.dumps(it.data))
            self.bytes += n - self._sizes.get(it.id, 0)
            self._sizes[it.id] = n

    def _forget(self, item_id: str) -> None:
        self._items.pop(item_id, None)
        self.bytes -= self._sizes.pop(item_id, 0)

    def _size_record(self, record_id: str, data: object) -> None:
        n = RECORD_BYTES + len(orjson.dumps(data))
        self.bytes += n - self._sizes.get(record_id, 0)
        self._sizes[record_id] = n

    def _ref(self, ids: Sequence[str], delta: int) -> None:
        for i in ids:
            n = self._refs.get(i)
            if n is None:
                continue
            n += delta
            if n <= 0 and delta < 0:
                del self._refs[i]
                self._forget(i)
            else:
                self._refs[i] = n

    def _link(self, conv: _Conv, items: Sequence[StoredItem]) -> None:
        for it in items:
            bisect.insort(conv.links, (it.created_at, next(self._seq), it.id))
        self._ref([it.id for it in items], +1)

    def _entries(self) -> int:
        return len(self._items) + len(self._responses) + len(self._convs)

    def _evict(self) -> None:
        while (self._entries() > self.max_items or self.bytes > self.max_bytes) and (
            self._responses or self._convs
        ):
            r_first = next(iter(self._responses.values()), None)
            c_first = next(iter(self._convs.values()), None)
            if c_first is None or (r_first is not None and r_first.created_at <= c_first.record.created_at):
                assert r_first is not None
                self._drop_response(r_first.id)
            else:
                self._drop_conversation(c_first.record.id)
            self.stats.evicted += 1

    # ---- responses ----------------------------------------------------------------------------------

    async def put_response(
        self, response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None = None
    ) -> None:
        if response.id in self._responses:
            raise IntegrityError(f"response {response.id!r} is already stored")
        conv = None
        if conversation_id is not None:
            conv = self._convs.get(conversation_id)
            if conv is None:
                raise NotFound(f"conversation {conversation_id!r} not found")
        self._check_new(items)
        missing = [
            i
            for i in (*response.input_item_ids, *response.output_item_ids)
            if i not in self._items and all(it.id != i for it in items)
        ]
        if missing:
            raise IntegrityError(f"response {response.id!r} refers to unknown items {missing[:3]}")
        self._add_items(items)
        self._responses[response.id] = response
        self._size_record(response.id, response.body)
        self._ref([*response.input_item_ids, *response.output_item_ids], +1)
        if conv is not None:
            self._link(conv, items)
        self.stats.writes += 1
        self._evict()

    async def update_response(
        self, response: StoredResponse, items: Sequence[StoredItem] = (), *, running_only: bool = False
    ) -> bool:
        old = self._responses.get(response.id)
        if old is None:
            raise NotFound(f"response {response.id!r} not found")
        if running_only and old.status in TERMINAL_STATUSES:
            return False
        conv = None
        if response.conversation_id is not None and items:
            conv = self._convs.get(response.conversation_id)
            if conv is None:
                raise NotFound(f"conversation {response.conversation_id!r} not found")
        self._check_new(items)
        self._add_items(items)
        self._ref([*response.input_item_ids, *response.output_item_ids], +1)
        self._ref([*old.input_item_ids, *old.output_item_ids], -1)
        self._responses[response.id] = response
        self._size_record(response.id, response.body)
        if conv is not None:
            self._link(conv, items)
        self.stats.writes += 1
        self._evict()
        return True

    async def get_response(self, response_id: str) -> StoredResponse | None:
        self.stats.reads += 1
        return self._responses.get(response_id)

    def _drop_response(self, response_id: str) -> bool:
        r = self._responses.pop(response_id, None)
        if r is None:
            return False
        self.bytes -= self._sizes.pop(response_id, 0)
        self._ref([*r.input_item_ids, *r.output_item_ids], -1)
        return True

    async def delete_response(self, response_id: str) -> bool:
        self.stats.writes += 1
        return self._drop_response(response_id)

    async def get_chain(self, response_id: str, max_depth: int) -> list[StoredResponse]:
        self.stats.reads += 1
        chain: list[StoredResponse] = []
        seen: set[str] = set()
        rid: str | None = response_id
        while rid is not None:
            r = self._responses.get(rid)
            if r is None:
                break
            if rid in seen:
                raise ChainError(f"the chain of {response_id!r} loops at {rid!r}")
            if len(chain) >= max_depth:
                raise ChainError(f"the chain of {response_id!r} is longer than {max_depth} responses")
            seen.add(rid)
            chain.append(dataclasses.replace(r, body={}) if chain else r)  # (the newest whole)
            rid = r.previous_response_id
        chain.reverse()
        return chain

    async def get_items(self, item_ids: Sequence[str]) -> list[StoredItem]:
        self.stats.reads += 1
        got = self._items
        return [got[i] for i in item_ids if i in got]

    # ---- conversations ------------------------------------------------------------------------------

    async def create_conversation(
        self, conversation: StoredConversation, items: Sequence[StoredItem] = ()
    ) -> None:
        if conversation.id in self._convs:
            raise IntegrityError(f"conversation {conversation.id!r} is already stored")
        self._check_new(items)
        conv = _Conv(conversation)
        self._add_items(items)
        self._convs[conversation.id] = conv
        self._size_record(conversation.id, conversation.metadata)
        self._link(conv, items)
        self.stats.writes += 1
        self._evict()

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        self.stats.reads += 1
        c = self._convs.get(conversation_id)
        return None if c is None else c.record

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None:
        c = self._convs.get(conversation_id)
        if c is None:
            return None
        old = c.record
        c.record = StoredConversation(old.id, old.created_at, dict(metadata), old.owner)
        self._size_record(conversation_id, c.record.metadata)
        self.stats.writes += 1
        return c.record

    def _drop_conversation(self, conversation_id: str) -> bool:
        c = self._convs.pop(conversation_id, None)
        if c is None:
            return False
        self.bytes -= self._sizes.pop(conversation_id, 0)
        self._ref([i for _, _, i in c.links], -1)
        return True

    async def delete_conversation(self, conversation_id: str) -> bool:
        self.stats.writes += 1
        return self._drop_conversation(conversation_id)

    async def add_items(self, conversation_id: str, items: Sequence[StoredItem]) -> None:
        c = self._convs.get(conversation_id)
        if c is None:
            raise NotFound(f"conversation {conversation_id!r} not found")
        self._check_new(items)
        self._add_items(items)
        self._link(c, items)
        self.stats.writes += 1
        self._evict()

    async def list_items(
        self, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> ItemPage:
        self.stats.reads += 1
        c = self._convs.get(conversation_id)
        if c is None:
            raise NotFound(f"conversation {conversation_id!r} not found")
        ids = [i for _, _, i in c.links]
        if order == "desc":
            ids.reverse()
        start = 0
        if after is not None:
            try:
                start = ids.index(after) + 1
            except ValueError:
                raise NotFound(f"item {after!r} is not in conversation {conversation_id!r}") from None
        page = ids[start : start + limit]
        return ItemPage([self._items[i] for i in page], start + limit < len(ids))

    async def get_item(self, conversation_id: str, item_id: str) -> StoredItem | None:
        self.stats.reads += 1
        c = self._convs.get(conversation_id)
        if c is None or not any(i == item_id for _, _, i in c.links):
            return None
        return self._items.get(item_id)

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        c = self._convs.get(conversation_id)
        if c is None:
            return False
        for k, (_, _, i) in enumerate(c.links):
            if i == item_id:
                del c.links[k]
                self._ref([item_id], -1)
                self.stats.writes += 1
                return True
        return False

    # ---- node records -------------------------------------------------------------------------------

    async def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        held = self._leases.get(name)
        if held is not None and held[0] != holder and held[1] >= now:
            return False
        self._leases[name] = (holder, until)
        if len(self._leases) > 2 * MAX_LEASES:  # expired ones are dropped now and then (bounded)
            self._leases = {n: h for n, h in self._leases.items() if h[1] >= now}
        return True

    async def release(self, name: str, holder: str) -> bool:
        held = self._leases.get(name)
        if held is None or held[0] != holder:
            return False
        del self._leases[name]
        return True

    async def put_record(self, kind: str, key: str, value: bytes) -> None:
        self._records.setdefault(kind, {})[key] = bytes(value)
        self.stats.writes += 1

    async def get_record(self, kind: str, key: str) -> bytes | None:
        return self._records.get(kind, {}).get(key)

    async def delete_record(self, kind: str, key: str) -> bool:
        return self._records.get(kind, {}).pop(key, None) is not None

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]:
        return sorted(self._records.get(kind, {}).items())

    # ---- retention ----------------------------------------------------------------------------------

    async def purge(self, older_than: float) -> int:
        n = 0
        for r in [r for r in self._responses.values() if r.created_at < older_than]:
            self._drop_response(r.id)
            n += 1
        for c in [c for c in self._convs.values() if c.record.created_at < older_than]:
            self._drop_conversation(c.record.id)
            n += 1
        self.stats.purged += n
        return n
