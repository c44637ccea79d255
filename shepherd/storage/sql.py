"""What the SQLite and PostgreSQL backends share: the schema (SMG's table names, docs/DESIGN.md §12),
its versioned migrations, and every operation written once as a *plan*.

A plan is a generator that yields ``Q`` (one SQL statement with ``?`` placeholders) and is sent back
the rows it returned (tuples); its return value is the operation's result. A driver runs one plan in
one transaction: ``sqlite.SQLiteStore`` synchronously on its thread, ``postgres.PostgresStore`` with
``await`` on a pooled connection (placeholders rewritten to ``$n``). The plans raise the storage
errors (``NotFound``, ``IntegrityError``, ``ChainError``); the drivers map their database's errors.

Tables (extra columns beyond SMG's: ``owner``, ``status``, ``output_item_ids``; ``responses.input``
holds the JSON list of the turn's input item ids, ``raw_response`` the response body;
``conversation_items.content`` the whole item as the API shows it):

* ``conversations(id, created_at, metadata, owner)``
* ``conversation_items(id, response_id, item_type, role, content, status, created_at)``
* ``conversation_item_links(seq, conversation_id, item_id, added_at)``, index on
  ``(conversation_id, added_at, seq)``: ``seq`` orders items added at the same time
* ``responses(id, conversation_id, previous_response_id, input, created_at, safety_identifier, model,
  raw_response, output_item_ids, owner, status)``
* ``response_item_refs(response_id, item_id)``: the items a response refers to (an item is removed
  once no response refers to it and no conversation links it)
* ``node_records(kind, key, value)``; ``shepherd_schema_migrations(version, applied_at)``.

Times are unix seconds (``DOUBLE PRECISION``).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from shepherd.storage.types import (
    TERMINAL_STATUSES,
    ChainError,
    IntegrityError,
    ItemPage,
    NotFound,
    Order,
    StorageError,
    StoredConversation,
    StoredItem,
    StoredResponse,
    StoreStats,
)

T = TypeVar("T")
Row = tuple[Any, ...]
MIGRATIONS_TABLE = "shepherd_schema_migrations"
CHUNK = 500  # ids per IN (...) list


@dataclass(frozen=True, slots=True)
class Q:
    """One statement: ``args`` are its parameters, or with ``many`` a list of parameter tuples."""

    sql: str
    args: Sequence[Any] = ()
    many: bool = False


Plan = Generator[Q, list[Row], T]


class SchemaError(StorageError):
    """The database's schema is not the one this Shepherd needs (migrations refused, or newer)."""

    def __init__(self, message: str, sql: str = "") -> None:
        super().__init__(message)
        self.sql = sql


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    json: str  # the type of a JSON column
    blob: str
    seq_pk: str  # an auto-increment primary key
    table_exists: str  # one ? : the table name


SQLITE = Dialect(
    "sqlite",
    json="TEXT",
    blob="BLOB",
    seq_pk="INTEGER PRIMARY KEY AUTOINCREMENT",
    table_exists="SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
)
POSTGRES = Dialect(
    "postgres",
    json="JSON",
    blob="BYTEA",
    seq_pk="BIGSERIAL PRIMARY KEY",
    table_exists="SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema() "
    "AND table_name = ?",
)

_SCHEMA_V1 = (
    """CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at DOUBLE PRECISION NOT NULL,
    metadata {json} NOT NULL,
    owner TEXT
)""",
    "CREATE INDEX IF NOT EXISTS conversations_created_at ON conversations (created_at)",
    """CREATE TABLE IF NOT EXISTS conversation_items (
    id TEXT PRIMARY KEY,
    response_id TEXT,
    item_type TEXT NOT NULL,
    role TEXT,
    content {json} NOT NULL,
    status TEXT,
    created_at DOUBLE PRECISION NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS conversation_item_links (
    seq {seq_pk},
    conversation_id TEXT NOT NULL,
    item_id TEXT NOT NULL,
    added_at DOUBLE PRECISION NOT NULL,
    UNIQUE (conversation_id, item_id)
)""",
    "CREATE INDEX IF NOT EXISTS conversation_item_links_conversation_added "
    "ON conversation_item_links (conversation_id, added_at, seq)",
    "CREATE INDEX IF NOT EXISTS conversation_item_links_item ON conversation_item_links (item_id)",
    """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    conversation_id TEXT,
    previous_response_id TEXT,
    input {json} NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    safety_identifier TEXT,
    model TEXT NOT NULL,
    raw_response {json} NOT NULL,
    output_item_ids {json} NOT NULL,
    owner TEXT,
    status TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)",
    """CREATE TABLE IF NOT EXISTS response_item_refs (
    response_id TEXT NOT NULL,
    item_id TEXT NOT NULL,
    PRIMARY KEY (response_id, item_id)
)""",
    "CREATE INDEX IF NOT EXISTS response_item_refs_item ON response_item_refs (item_id)",
    """CREATE TABLE IF NOT EXISTS node_records (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value {blob} NOT NULL,
    PRIMARY KEY (kind, key)
)""",
)

# 2: leases (a conversation's turn in progress: ``claim`` / ``release``)
_SCHEMA_V2 = (
    """CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    until_at DOUBLE PRECISION NOT NULL
)""",
)

# (version, statements): applied in order, each version in one transaction
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = ((1, _SCHEMA_V1), (2, _SCHEMA_V2))
LATEST = MIGRATIONS[-1][0]

_MIGRATIONS_DDL = (
    f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} "
    "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
)


def statements(dialect: Dialect, version: int) -> list[str]:
    """The DDL of one migration in ``dialect``."""
    for v, stmts in MIGRATIONS:
        if v == version:
            return [s.format(json=dialect.json, blob=dialect.blob, seq_pk=dialect.seq_pk) for s in stmts]
    raise KeyError(version)


def migration_script(dialect: Dialect, versions: Sequence[int]) -> str:
    """The SQL an operator runs to apply ``versions`` by hand."""
    out = ["BEGIN;", _MIGRATIONS_DDL + ";"]
    for v in versions:
        out += [s + ";" for s in statements(dialect, v)]
        out.append(f"INSERT INTO {MIGRATIONS_TABLE} (version, applied_at) VALUES ({v}, {time.time():.0f});")
    out.append("COMMIT;")
    return "\n".join(out)


def migrate(dialect: Dialect, apply: bool) -> Plan[list[int]]:
    """Bring the schema to ``LATEST`` (the versions applied), or with ``apply=False`` raise
    ``SchemaError`` naming the SQL the operator must run. A schema newer than ``LATEST`` is an error."""
    exists = yield Q(dialect.table_exists, (MIGRATIONS_TABLE,))
    applied: set[int] = set()
    if exists:
        applied = {int(r[0]) for r in (yield Q(f"SELECT version FROM {MIGRATIONS_TABLE}"))}
    if applied and max(applied) > LATEST:
        raise SchemaError(
            f"the history database is at schema version {max(applied)}, newer than this Shepherd's "
            f"{LATEST}: upgrade Shepherd"
        )
    pending = [v for v, _ in MIGRATIONS if v not in applied]
    if pending and not apply:
        sql = migration_script(dialect, pending)
        raise SchemaError(
            f"the history database needs schema migrations {pending} and history_migrations is "
            f'"refuse": run this SQL as the database operator, then start again:\n\n{sql}\n',
            sql,
        )
    if pending:
        yield Q(_MIGRATIONS_DDL)
    for v in pending:
        for s in statements(dialect, v):
            yield Q(s)
        yield Q(f"INSERT INTO {MIGRATIONS_TABLE} (version, applied_at) VALUES (?, ?)", (v, time.time()))
    return pending


# ---- rows <-> records ---------------------------------------------------------------------------------

_RESP_COLS = (
    "id, created_at, model, raw_response, input, output_item_ids, previous_response_id, "
    "conversation_id, owner, status"
)
_CHAIN_COLS = _RESP_COLS.replace("raw_response", "NULL")  # a chain's older responses: no body
_ITEM_COLS = "id, item_type, content, created_at, response_id, role, status"
_CONV_COLS = "id, created_at, metadata, owner"
_ITEM_COLS_I = ", ".join("i." + c for c in _ITEM_COLS.split(", "))


def _dumps(v: Any) -> str:
    return orjson.dumps(v).decode()


def _loads(v: Any) -> Any:
    return orjson.loads(v) if isinstance(v, str | bytes) else v


def _response(r: Row) -> StoredResponse:
    return StoredResponse(
        id=r[0],
        created_at=float(r[1]),
        model=r[2],
        body=_loads(r[3]) if r[3] is not None else {},
        input_item_ids=tuple(_loads(r[4]) or ()),
        output_item_ids=tuple(_loads(r[5]) or ()),
        previous_response_id=r[6],
        conversation_id=r[7],
        owner=r[8],
        status=r[9],
    )


def _item(r: Row) -> StoredItem:
    return StoredItem(
        id=r[0],
        type=r[1],
        data=_loads(r[2]),
        created_at=float(r[3]),
        response_id=r[4],
        role=r[5],
        status=r[6],
    )


def _conversation(r: Row) -> StoredConversation:
    return StoredConversation(id=r[0], created_at=float(r[1]), metadata=_loads(r[2]) or {}, owner=r[3])


def _item_args(it: StoredItem) -> Row:
    return (it.id, it.response_id, it.type, it.role, _dumps(it.data), it.status, it.created_at)


def _response_args(r: StoredResponse) -> Row:
    return (
        r.id,
        r.conversation_id,
        r.previous_response_id,
        _dumps(list(r.input_item_ids)),
        r.created_at,
        r.model,
        _dumps(r.body),
        _dumps(list(r.output_item_ids)),
        r.owner,
        r.status,
    )


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _chunks(ids: Sequence[str]) -> list[Sequence[str]]:
    return [ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK)]


# ---- shared steps ---------------------------------------------------------------------------------------


def _existing_items(ids: Sequence[str]) -> Plan[set[str]]:
    found: set[str] = set()
    for part in _chunks(list(dict.fromkeys(ids))):
        rows = yield Q(f"SELECT id FROM conversation_items WHERE id IN ({_marks(len(part))})", tuple(part))
        found.update(r[0] for r in rows)
    return found


def _insert_items(items: Sequence[StoredItem]) -> Plan[None]:
    """Insert new items: a duplicate (stored, or twice in ``items``) is an ``IntegrityError``."""
    if not items:
        return
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise IntegrityError("an item id appears twice in one write")
    dup = yield from _existing_items(ids)
    if dup:
        raise IntegrityError(f"items {sorted(dup)[:3]} are already stored")
    yield Q(
        "INSERT INTO conversation_items (id, response_id, item_type, role, content, status, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [_item_args(it) for it in items],
        many=True,
    )


def _conversation_exists(conversation_id: str) -> Plan[bool]:
    rows = yield Q("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,))
    return bool(rows)


def _lock_conversation(conversation_id: str) -> Plan[bool]:
    """Whether it exists, its row locked until the transaction ends (PostgreSQL: a concurrent delete
    waits, or this sees it gone; SQLite's write transactions are serial anyway). A no-op UPDATE, as
    both dialects lock with it."""
    rows = yield Q("UPDATE conversations SET id = id WHERE id = ? RETURNING 1", (conversation_id,))
    return bool(rows)


def _link(conversation_id: str, items: Sequence[StoredItem]) -> Plan[None]:
    if items:
        yield Q(
            "INSERT INTO conversation_item_links (conversation_id, item_id, added_at) VALUES (?, ?, ?)",
            [(conversation_id, it.id, it.created_at) for it in items],
            many=True,
        )


def _ref(response_id: str, ids: Sequence[str]) -> Plan[None]:
    """Record that ``response_id`` refers to the stored ones of ``ids``."""
    if ids:
        yield Q(
            "INSERT INTO response_item_refs (response_id, item_id) "
            "SELECT ?, id FROM conversation_items WHERE id = ? ON CONFLICT DO NOTHING",
            [(response_id, i) for i in dict.fromkeys(ids)],
            many=True,
        )


def _collect(candidates: Sequence[str]) -> Plan[None]:
    """Remove those of ``candidates`` no response refers to and no conversation links."""
    for part in _chunks(list(dict.fromkeys(candidates))):
        yield Q(
            f"DELETE FROM conversation_items WHERE id IN ({_marks(len(part))}) "
            "AND NOT EXISTS (SELECT 1 FROM conversation_item_links l WHERE l.item_id = conversation_items.id)"
            " AND NOT EXISTS (SELECT 1 FROM response_item_refs r WHERE r.item_id = conversation_items.id)",
            tuple(part),
        )


def _unref_response(response_id: str) -> Plan[list[str]]:
    rows = yield Q("DELETE FROM response_item_refs WHERE response_id = ? RETURNING item_id", (response_id,))
    return [r[0] for r in rows]


# ---- responses ------------------------------------------------------------------------------------------


def put_response(
    response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None
) -> Plan[None]:
    exists = yield Q("SELECT 1 FROM responses WHERE id = ?", (response.id,))
    if exists:
        raise IntegrityError(f"response {response.id!r} is already stored")
    if conversation_id is not None and not (yield from _lock_conversation(conversation_id)):
        raise NotFound(f"conversation {conversation_id!r} not found")
    yield from _insert_items(items)
    new = {it.id for it in items}
    refs = [*response.input_item_ids, *response.output_item_ids]
    outside = [i for i in refs if i not in new]
    if outside:
        found = yield from _existing_items(outside)
        missing = [i for i in outside if i not in found]
        if missing:
            raise IntegrityError(f"response {response.id!r} refers to unknown items {missing[:3]}")
    yield Q(
        "INSERT INTO responses (id, conversation_id, previous_response_id, input, created_at, model, "
        "raw_response, output_item_ids, owner, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _response_args(response),
    )
    yield from _ref(response.id, refs)
    if conversation_id is not None:
        yield from _link(conversation_id, items)


def update_response(
    response: StoredResponse, items: Sequence[StoredItem], running_only: bool = False
) -> Plan[bool]:
    # its row locked until the transaction ends (a no-op UPDATE, as _lock_conversation), its status read
    rows = yield Q("UPDATE responses SET id = id WHERE id = ? RETURNING status", (response.id,))
    if not rows:
        raise NotFound(f"response {response.id!r} not found")
    if running_only and rows[0][0] in TERMINAL_STATUSES:
        return False
    conv = response.conversation_id if items else None
    if conv is not None and not (yield from _lock_conversation(conv)):
        raise NotFound(f"conversation {conv!r} not found")
    yield from _insert_items(items)
    old = yield from _unref_response(response.id)
    yield Q(
        "UPDATE responses SET conversation_id = ?, previous_response_id = ?, input = ?, created_at = ?, "
        "model = ?, raw_response = ?, output_item_ids = ?, owner = ?, status = ? WHERE id = ?",
        (*_response_args(response)[1:], response.id),
    )
    yield from _ref(response.id, [*response.input_item_ids, *response.output_item_ids])
    if conv is not None:
        yield from _link(conv, items)
    yield from _collect(old)
    return True


def get_response(response_id: str) -> Plan[StoredResponse | None]:
    rows = yield Q(f"SELECT {_RESP_COLS} FROM responses WHERE id = ?", (response_id,))
    return _response(rows[0]) if rows else None


def delete_response(response_id: str) -> Plan[bool]:
    # its row locked first, as update_response does: an update meanwhile is waited for, and the refs it
    # wrote are deleted too (else they outlive the response, and keep their items)
    if not (yield Q("UPDATE responses SET id = id WHERE id = ? RETURNING id", (response_id,))):
        return False
    old = yield from _unref_response(response_id)
    rows = yield Q("DELETE FROM responses WHERE id = ? RETURNING id", (response_id,))
    yield from _collect(old)
    return bool(rows)


def get_chain(response_id: str, max_depth: int) -> Plan[list[StoredResponse]]:
    """Walk ``previous_response_id`` with a recursive CTE bounded at ``max_depth + 1`` hops (so a
    cycle ends too): more rows than ``max_depth``, or an id seen twice, is a ``ChainError``."""
    rows = yield Q(
        "WITH RECURSIVE chain (id, prev, depth) AS ("
        " SELECT id, previous_response_id, 1 FROM responses WHERE id = ?"
        " UNION ALL"
        " SELECT r.id, r.previous_response_id, c.depth + 1 FROM chain c JOIN responses r ON r.id = c.prev"
        " WHERE c.depth <= ?"
        ") SELECT id, depth FROM chain ORDER BY depth",
        (response_id, max_depth),
    )
    ids = [r[0] for r in rows]
    if len(set(ids)) != len(ids):
        raise ChainError(f"the chain of {response_id!r} loops")
    if len(ids) > max_depth:
        raise ChainError(f"the chain of {response_id!r} is longer than {max_depth} responses")
    got: dict[str, StoredResponse] = {}
    # the newest whole, the others without their bodies (types.py, ``get_chain``)
    if ids:
        for r in (yield Q(f"SELECT {_RESP_COLS} FROM responses WHERE id = ?", (ids[0],))):
            got[r[0]] = _response(r)
    for part in _chunks(ids[1:]):
        for r in (
            yield Q(f"SELECT {_CHAIN_COLS} FROM responses WHERE id IN ({_marks(len(part))})", tuple(part))
        ):
            got[r[0]] = _response(r)
    return [got[i] for i in reversed(ids) if i in got]


def get_items(item_ids: Sequence[str]) -> Plan[list[StoredItem]]:
    got: dict[str, StoredItem] = {}
    for part in _chunks(list(dict.fromkeys(item_ids))):
        rows = yield Q(
            f"SELECT {_ITEM_COLS} FROM conversation_items WHERE id IN ({_marks(len(part))})", tuple(part)
        )
        for r in rows:
            got[r[0]] = _item(r)
    return [got[i] for i in item_ids if i in got]


# ---- conversations --------------------------------------------------------------------------------------


def create_conversation(conversation: StoredConversation, items: Sequence[StoredItem]) -> Plan[None]:
    if (yield from _conversation_exists(conversation.id)):
        raise IntegrityError(f"conversation {conversation.id!r} is already stored")
    yield from _insert_items(items)
    yield Q(
        "INSERT INTO conversations (id, created_at, metadata, owner) VALUES (?, ?, ?, ?)",
        (conversation.id, conversation.created_at, _dumps(conversation.metadata), conversation.owner),
    )
    yield from _link(conversation.id, items)


def get_conversation(conversation_id: str) -> Plan[StoredConversation | None]:
    rows = yield Q(f"SELECT {_CONV_COLS} FROM conversations WHERE id = ?", (conversation_id,))
    return _conversation(rows[0]) if rows else None


def update_conversation(conversation_id: str, metadata: dict[str, str]) -> Plan[StoredConversation | None]:
    rows = yield Q(
        f"UPDATE conversations SET metadata = ? WHERE id = ? RETURNING {_CONV_COLS}",
        (_dumps(metadata), conversation_id),
    )
    return _conversation(rows[0]) if rows else None


def delete_conversation(conversation_id: str) -> Plan[bool]:
    # its row locked first, as a write adding to it does: one adding items meanwhile is waited for, and
    # its links are deleted too (else they outlive the conversation, and keep their items)
    if not (yield from _lock_conversation(conversation_id)):
        return False
    links = yield Q(
        "DELETE FROM conversation_item_links WHERE conversation_id = ? RETURNING item_id", (conversation_id,)
    )
    rows = yield Q("DELETE FROM conversations WHERE id = ? RETURNING id", (conversation_id,))
    yield from _collect([r[0] for r in links])
    return bool(rows)


def add_items(conversation_id: str, items: Sequence[StoredItem]) -> Plan[None]:
    if not (yield from _lock_conversation(conversation_id)):
        raise NotFound(f"conversation {conversation_id!r} not found")
    yield from _insert_items(items)
    yield from _link(conversation_id, items)


def list_items(conversation_id: str, after: str | None, limit: int, order: Order) -> Plan[ItemPage]:
    if not (yield from _conversation_exists(conversation_id)):
        raise NotFound(f"conversation {conversation_id!r} not found")
    where, args = "", [conversation_id]
    cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
    if after is not None:
        pos = yield Q(
            "SELECT added_at, seq FROM conversation_item_links WHERE conversation_id = ? AND item_id = ?",
            (conversation_id, after),
        )
        if not pos:
            raise NotFound(f"item {after!r} is not in conversation {conversation_id!r}")
        where = f" AND (l.added_at, l.seq) {cmp} (?, ?)"
        args += [pos[0][0], pos[0][1]]
    rows = yield Q(
        f"SELECT {_ITEM_COLS_I} FROM conversation_item_links l "
        f"JOIN conversation_items i ON i.id = l.item_id WHERE l.conversation_id = ?{where} "
        f"ORDER BY l.added_at {direction}, l.seq {direction} LIMIT ?",
        (*args, max(limit, 0) + 1),
    )
    return ItemPage([_item(r) for r in rows[:limit]], len(rows) > limit)


def get_item(conversation_id: str, item_id: str) -> Plan[StoredItem | None]:
    rows = yield Q(
        f"SELECT {_ITEM_COLS_I} FROM conversation_item_links l "
        "JOIN conversation_items i ON i.id = l.item_id WHERE l.conversation_id = ? AND l.item_id = ?",
        (conversation_id, item_id),
    )
    return _item(rows[0]) if rows else None


def delete_item(conversation_id: str, item_id: str) -> Plan[bool]:
    rows = yield Q(
        "DELETE FROM conversation_item_links WHERE conversation_id = ? AND item_id = ? RETURNING item_id",
        (conversation_id, item_id),
    )
    yield from _collect([r[0] for r in rows])
    return bool(rows)


# ---- node records ---------------------------------------------------------------------------------------


def put_record(kind: str, key: str, value: bytes) -> Plan[None]:
    yield Q(
        "INSERT INTO node_records (kind, key, value) VALUES (?, ?, ?) "
        "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
        (kind, key, bytes(value)),
    )


def get_record(kind: str, key: str) -> Plan[bytes | None]:
    rows = yield Q("SELECT value FROM node_records WHERE kind = ? AND key = ?", (kind, key))
    return bytes(rows[0][0]) if rows else None


def delete_record(kind: str, key: str) -> Plan[bool]:
    rows = yield Q("DELETE FROM node_records WHERE kind = ? AND key = ? RETURNING key", (kind, key))
    return bool(rows)


def list_records(kind: str) -> Plan[list[tuple[str, bytes]]]:
    rows = yield Q("SELECT key, value FROM node_records WHERE kind = ? ORDER BY key", (kind,))
    return [(r[0], bytes(r[1])) for r in rows]


# ---- leases ---------------------------------------------------------------------------------------------


def claim(name: str, holder: str, until: float, now: float) -> Plan[bool]:
    # one statement: a row inserted, or updated when expired or its holder's own (else none returned)
    rows = yield Q(
        "INSERT INTO leases (name, holder, until_at) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until_at = excluded.until_at "
        "WHERE leases.until_at < ? OR leases.holder = excluded.holder RETURNING holder",
        (name, holder, until, now),
    )
    return bool(rows)


def release(name: str, holder: str) -> Plan[bool]:
    rows = yield Q("DELETE FROM leases WHERE name = ? AND holder = ? RETURNING name", (name, holder))
    return bool(rows)


# ---- retention ------------------------------------------------------------------------------------------


def purge(older_than: float) -> Plan[int]:
    refs = yield Q(
        "DELETE FROM response_item_refs WHERE response_id IN (SELECT id FROM responses WHERE created_at < ?) "
        "RETURNING item_id",
        (older_than,),
    )
    links = yield Q(
        "DELETE FROM conversation_item_links WHERE conversation_id IN "
        "(SELECT id FROM conversations WHERE created_at < ?) RETURNING item_id",
        (older_than,),
    )
    responses = yield Q("DELETE FROM responses WHERE created_at < ? RETURNING id", (older_than,))
    convs = yield Q("DELETE FROM conversations WHERE created_at < ? RETURNING id", (older_than,))
    yield Q("DELETE FROM leases WHERE until_at < ?", (older_than,))  # (a holder that never released)
    yield from _collect([r[0] for r in (*refs, *links)])
    return len(responses) + len(convs)


# ---- the methods both drivers share -----------------------------------------------------------------------


class PlanStore:
    """``HistoryStore``'s methods over plans: a driver implements ``_run`` (one plan, one transaction;
    ``write``: the transaction writes), ``start`` and ``close``."""

    name = "sql"
    shared = False

    def __init__(self) -> None:
        self.stats = StoreStats()

    async def _run(self, plan: Plan[T], write: bool) -> T:
        raise NotImplementedError

    async def _write(self, plan: Plan[T]) -> T:
        out = await self._run(plan, True)
        self.stats.writes += 1
        return out

    async def _read(self, plan: Plan[T]) -> T:
        self.stats.reads += 1
        return await self._run(plan, False)

    async def put_response(
        self, response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None = None
    ) -> None:
        await self._write(put_response(response, items, conversation_id))

    async def update_response(
        self, response: StoredResponse, items: Sequence[StoredItem] = (), *, running_only: bool = False
    ) -> bool:
        return await self._write(update_response(response, items, running_only))

    async def get_response(self, response_id: str) -> StoredResponse | None:
        return await self._read(get_response(response_id))

    async def delete_response(self, response_id: str) -> bool:
        return await self._write(delete_response(response_id))

    async def get_chain(self, response_id: str, max_depth: int) -> list[StoredResponse]:
        return await self._read(get_chain(response_id, max_depth))

    async def get_items(self, item_ids: Sequence[str]) -> list[StoredItem]:
        return await self._read(get_items(item_ids))

    async def create_conversation(
        self, conversation: StoredConversation, items: Sequence[StoredItem] = ()
    ) -> None:
        await self._write(create_conversation(conversation, items))

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        return await self._read(get_conversation(conversation_id))

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None:
        return await self._write(update_conversation(conversation_id, metadata))

    async def delete_conversation(self, conversation_id: str) -> bool:
        return await self._write(delete_conversation(conversation_id))

    async def add_items(self, conversation_id: str, items: Sequence[StoredItem]) -> None:
        await self._write(add_items(conversation_id, items))

    async def list_items(
        self, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> ItemPage:
        return await self._read(list_items(conversation_id, after, limit, order))

    async def get_item(self, conversation_id: str, item_id: str) -> StoredItem | None:
        return await self._read(get_item(conversation_id, item_id))

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        return await self._write(delete_item(conversation_id, item_id))

    async def put_record(self, kind: str, key: str, value: bytes) -> None:
        await self._write(put_record(kind, key, value))

    async def get_record(self, kind: str, key: str) -> bytes | None:
        return await self._run(get_record(kind, key), False)

    async def delete_record(self, kind: str, key: str) -> bool:
        return await self._run(delete_record(kind, key), True)

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]:
        return await self._run(list_records(kind), False)

    async def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        return await self._run(claim(name, holder, until, now), True)

    async def release(self, name: str, holder: str) -> bool:
        return await self._run(release(name, holder), True)

    async def purge(self, older_than: float) -> int:
        n = await self._run(purge(older_than), True)
        self.stats.purged += n
        return n
