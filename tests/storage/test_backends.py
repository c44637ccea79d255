"""What only some backends have: URLs and ``open_store``, SQLite's file, PostgreSQL's migrations (applied
under the advisory lock, or refused with the SQL to run), Redis's keys and TTLs, and
``StorageUnavailable`` when the server is gone (a closed port; a relay cut under a started store)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from shepherd.storage import sql
from shepherd.storage.factory import open_store
from shepherd.storage.memory import MemoryStore
from shepherd.storage.postgres import PostgresStore
from shepherd.storage.redis import RedisStore
from shepherd.storage.sqlite import MEMORY, SQLiteStore, path_of
from shepherd.storage.types import HistoryStore, StorageUnavailable
from tests.services import Service, free_port, redis_service, service_or_skip
from tests.storage.conftest import Backend, Proxy
from tests.storage.test_contract import conversation, item, response

# ---- URLs -----------------------------------------------------------------------------------------------


def test_sqlite_urls() -> None:
    assert path_of("sqlite:///rel/h.db") == "rel/h.db"
    assert path_of("sqlite:////abs/h.db") == "/abs/h.db"
    assert path_of("sqlite://:memory:") == MEMORY
    for bad in ("sqlite://", "sqlite:///", "sqlite://host/h.db", "postgresql://x/y", "sqlite:///d/"):
        with pytest.raises(ValueError):
            path_of(bad)


def test_open_store() -> None:
    kw = {"retention_days": 1.0, "max_items": 10, "migrations": "apply", "pool_size": 2}
    assert isinstance(open_store("memory", None, **kw), MemoryStore)  # type: ignore[arg-type]
    s = open_store("sqlite", "sqlite:////tmp/x/h.db")
    assert isinstance(s, SQLiteStore) and s.path == "/tmp/x/h.db"
    assert isinstance(open_store("postgres", "postgresql://u@h/db"), PostgresStore)
    assert isinstance(open_store("postgres", "postgres://u@h/db"), PostgresStore)
    r = open_store("redis", "redis://h:6379/0", retention_days=2)
    assert isinstance(r, RedisStore) and r.ttl == 2 * 86400
    for backend, url, words in (
        ("sqlite", "postgresql://h/db", "sqlite://"),
        ("postgres", "sqlite:///h.db", "postgresql://"),
        ("redis", "http://h", "redis://"),
        ("postgres", None, "needs a URL"),
        ("redis", "localhost:6379", "redis://"),
        ("memory", "sqlite:///h.db", "takes no URL"),
        ("mysql", "mysql://h", "unknown history backend"),
    ):
        with pytest.raises(ValueError, match=words):
            open_store(backend, url)
    with pytest.raises(ValueError, match="refuse"):
        open_store("postgres", "postgresql://h/db", migrations="sometimes")
    with pytest.raises(ValueError, match="pool_size"):
        open_store("redis", "redis://h", pool_size=0)


# ---- SQLite ---------------------------------------------------------------------------------------------


async def test_sqlite_file_wal_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "h.db"
    s = SQLiteStore(str(path))
    await s.start()
    a = item()
    r = response(inputs=[a])
    await s.put_response(r, [a])
    await s.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        versions = conn.execute(f"SELECT version FROM {sql.MIGRATIONS_TABLE} ORDER BY version").fetchall()
        assert versions == [(v,) for v, _ in sql.MIGRATIONS] and versions[-1] == (sql.LATEST,)
    s2 = SQLiteStore(str(path))
    await s2.start()
    try:
        assert await s2.get_response(r.id) == r
        assert await s2.get_items([a.id]) == [a]
    finally:
        await s2.close()


async def test_a_database_of_an_older_schema_is_migrated_at_start(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as conn:  # a database an older Shepherd made: schema version 1 only
        conn.execute(
            f"CREATE TABLE {sql.MIGRATIONS_TABLE} (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION)"
        )
        for stmt in sql.statements(sql.SQLITE, 1):
            conn.execute(stmt)
        conn.execute(f"INSERT INTO {sql.MIGRATIONS_TABLE} VALUES (1, 0)")
    s = SQLiteStore(str(path))
    await s.start()
    try:
        assert await s.claim("conversation:conv_x", "resp_1", 2e9, 1e9)  # the leases of version 2
        assert not await s.claim("conversation:conv_x", "resp_2", 2e9, 1e9)
    finally:
        await s.close()
    with sqlite3.connect(path) as conn:
        assert [v for (v,) in conn.execute(f"SELECT version FROM {sql.MIGRATIONS_TABLE}")] == [1, 2]


async def test_sqlite_memory_and_not_started() -> None:
    s = SQLiteStore(MEMORY)
    with pytest.raises(StorageUnavailable):
        await s.get_response("resp_x")
    await s.start()
    await s.put_record("k", "a", b"1")
    assert await s.get_record("k", "a") == b"1"
    await s.close()
    await s.close()


async def test_sqlite_unusable_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StorageUnavailable):
        await SQLiteStore(str(tmp_path / "file" / "h.db")).start()
    (tmp_path / "junk.db").write_bytes(b"this is not a database file" * 100)
    with pytest.raises(Exception, match="not a database"):
        await SQLiteStore(str(tmp_path / "junk.db")).start()


# ---- PostgreSQL migrations ------------------------------------------------------------------------------


@pytest.fixture
def pg(pg_service: Service, tmp_path: Path) -> Backend:
    return Backend("postgres", tmp_path, pg_service)


async def test_postgres_refuse_prints_the_sql_that_works(pg: Backend) -> None:
    ns = await pg.namespace()
    refusing = PostgresStore(ns["url"], migrations="refuse")
    with pytest.raises(sql.SchemaError) as err:
        await refusing.start()
    msg = str(err.value)
    assert "refuse" in msg and "CREATE TABLE IF NOT EXISTS responses" in msg
    assert "conversation_item_links" in msg and sql.MIGRATIONS_TABLE in msg
    # nothing was created; the operator runs the SQL; then the refusing node starts
    conn = await asyncpg.connect(ns["url"])
    try:
        assert (
            await conn.fetch("SELECT 1 FROM information_schema.tables WHERE table_name = 'responses'") == []
        )
        await conn.execute(err.value.sql)
    finally:
        await conn.close()
    await refusing.start()
    try:
        a = item()
        await refusing.put_response(response(inputs=[a]), [a])
    finally:
        await refusing.close()


async def test_postgres_migrations_once_under_the_lock(pg: Backend) -> None:
    ns = await pg.namespace()
    stores = [PostgresStore(ns["url"], pool_size=2) for _ in range(4)]
    await asyncio.gather(*(s.start() for s in stores))
    await asyncio.gather(*(s.close() for s in stores))
    conn = await asyncpg.connect(ns["url"])
    try:
        rows = await conn.fetch(f"SELECT version FROM {sql.MIGRATIONS_TABLE}")
        assert [r[0] for r in rows] == [v for v, _ in sql.MIGRATIONS]
        cols = await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
        )
        have = {(r[0], r[1]) for r in cols}
        for table, col in (
            ("conversations", "metadata"),
            ("conversation_items", "item_type"),
            ("conversation_item_links", "added_at"),
            ("responses", "raw_response"),
            ("responses", "safety_identifier"),
        ):
            assert (table, col) in have
        # a schema newer than this Shepherd knows refuses to start
        await conn.execute(f"INSERT INTO {sql.MIGRATIONS_TABLE} VALUES ({sql.LATEST + 1}, 0)")
    finally:
        await conn.close()
    with pytest.raises(sql.SchemaError, match="newer"):
        await PostgresStore(ns["url"]).start()


async def _until_waiting_on_a_lock(conn: asyncpg.Connection, task: asyncio.Task[Any]) -> None:
    """Until a session of the database waits on a lock (``task``'s, behind ``conn``'s open transaction),
    or ``task`` ended: bounded."""
    for _ in range(400):
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        if waiting or task.done():
            return
        await asyncio.sleep(0.01)


async def test_postgres_delete_of_a_conversation_waits_for_items_being_added(pg: Backend) -> None:
    """A conversation deleted while another node's transaction adds items to it (its row locked: an
    ``add_items``, a turn's ``put_response``): the delete waits for that one and removes its links too,
    never leaving links (and their items, kept by them) of a conversation that is gone."""
    ns = await pg.namespace()
    s = pg.open(ns)
    await s.start()
    conn = await asyncpg.connect(ns["url"])
    try:
        c = conversation()
        await s.create_conversation(c, [item()])
        adding = conn.transaction()
        await adding.start()
        new = item()
        await PostgresStore._drive(conn, sql.add_items(c.id, [new]))  # (not committed yet)
        deleting = asyncio.create_task(s.delete_conversation(c.id))
        await _until_waiting_on_a_lock(conn, deleting)  # (on the conversation's row)
        await adding.commit()
        assert await deleting
        assert await conn.fetch("SELECT item_id FROM conversation_item_links") == []
        assert await conn.fetch("SELECT id FROM conversation_items") == []
    finally:
        await conn.close()
        await s.close()


async def test_postgres_delete_of_a_response_waits_for_its_update(pg: Backend) -> None:
    """A response deleted while another node's transaction updates it (a background response's progress,
    its row locked): the delete waits for that one and removes the item refs it wrote too."""
    ns = await pg.namespace()
    s = pg.open(ns)
    await s.start()
    conn = await asyncpg.connect(ns["url"])
    try:
        a = item()
        r = response(inputs=[a], status="in_progress")
        await s.put_response(r, [a])
        updating = conn.transaction()
        await updating.start()
        out = item(role="assistant")
        done = dataclasses.replace(r, output_item_ids=(out.id,), status="completed")
        assert await PostgresStore._drive(conn, sql.update_response(done, [out], True))  # (not committed)
        deleting = asyncio.create_task(s.delete_response(r.id))
        await _until_waiting_on_a_lock(conn, deleting)  # (on the response's row)
        await updating.commit()
        assert await deleting
        assert await conn.fetch("SELECT item_id FROM response_item_refs") == []
        assert await conn.fetch("SELECT id FROM conversation_items") == []
    finally:
        await conn.close()
        await s.close()


# ---- Redis ----------------------------------------------------------------------------------------------


async def test_redis_keys_and_ttl(redis_service_: Service) -> None:
    prefix = "ttltest:"
    s = RedisStore(redis_service_.url, prefix=prefix, retention_days=1.0)
    await s.start()
    r = aioredis.Redis.from_url(redis_service_.url)
    try:
        c = conversation()
        a = item()
        await s.create_conversation(c, [a])
        b = item()
        resp = response(inputs=[b], conv=c.id)
        await s.put_response(resp, [b], c.id)
        await s.put_record("key", "k", b"v")
        for key in (
            f"response:{resp.id}",
            f"item:{a.id}",
            f"item:{b.id}",
            f"conversation:{c.id}",
            f"conversation:{c.id}:items",
        ):
            ttl = await r.ttl(prefix + key)
            assert 0 < ttl <= 86400, key
        assert await r.ttl(prefix + "record:key") == -1  # the node's records never expire
        assert await r.zcard(f"{prefix}conversation:{c.id}:items") == 2
        assert await r.hget(f"{prefix}response:{resp.id}", "model") == b'"m"'
        await s.purge(float("inf"))
        assert await r.keys(prefix + "item:*") == []
        assert await r.keys(prefix + "conversation:*") == []
    finally:
        await r.delete(*(await r.keys(prefix + "*")))
        await r.aclose()
        await s.close()
    assert RedisStore("redis://h").prefix == "shepherd:"


# ---- unavailable ----------------------------------------------------------------------------------------


async def test_closed_port_is_unavailable() -> None:
    port = free_port()
    stores: list[HistoryStore] = [
        PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2),
        RedisStore(f"redis://127.0.0.1:{port}/0", timeout=2),
    ]
    for s in stores:
        with pytest.raises(StorageUnavailable):
            await s.start()
        with pytest.raises(StorageUnavailable):
            await s.get_response("resp_x")  # not started


@pytest.mark.parametrize("name", ["postgres", "redis"])
async def test_server_gone_is_unavailable(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    svc: Service = request.getfixturevalue("pg_service" if name == "postgres" else "redis_service_")
    backend = Backend(name, tmp_path, svc)
    ns = await backend.namespace()
    proxy = Proxy(svc.port)
    await proxy.start()
    ns["url"] = ns["url"].replace(f":{svc.port}/", f":{proxy.port}/")
    s = backend.open(ns)
    await s.start()
    try:
        c = conversation()
        await s.create_conversation(c, [item()])
        await proxy.cut()
        for call in (
            lambda: s.get_response("resp_x"),
            lambda: s.list_items(c.id),
            lambda: s.add_items(c.id, [item()]),
            lambda: s.put_record("k", "a", b"1"),
            lambda: s.purge(0),
        ):
            with pytest.raises(StorageUnavailable):
                await call()
    finally:
        await s.close()


async def test_a_restarted_redis_is_answered_at_once() -> None:
    """The pool's idle connections to a Redis that restarted (or closed them: its ``timeout``) are made
    anew when taken, not failed on their next command: a Redis that is up is never a 503."""
    first = contextlib.ExitStack()
    svc = first.enter_context(service_or_skip("Redis", redis_service))
    s = RedisStore(svc.url, prefix="restart:", pool_size=3)
    try:
        await s.start()
        c = conversation()
        await s.create_conversation(c, [item()])
        # three connections in use at once, then idle in the pool
        got = await asyncio.gather(*(s.list_items(c.id) for _ in range(3)))
        assert [len(p.items) for p in got] == [1, 1, 1]
        await asyncio.to_thread(first.close)  # (off the loop: the store's loop sees its connections closed)
        with redis_service(port=svc.port):  # an empty Redis where the old one was
            for _ in range(4):  # each idle connection taken once, and one more call
                assert await s.get_conversation(c.id) is None
            await s.create_conversation(c, [item()])
            assert len((await s.list_items(c.id)).items) == 1
    finally:
        await s.close()
        first.close()


async def test_sqlite_runs_on_its_one_thread(tmp_path: Path) -> None:
    import threading  # not at the top: only this test looks at threads

    s = SQLiteStore(str(tmp_path / "h.db"))
    await s.start()
    threads: set[str] = set()
    try:

        def trace() -> None:
            assert s._conn is not None
            s._conn.set_trace_callback(lambda _: threads.add(threading.current_thread().name))

        await s._call(trace)
        c = conversation()
        await asyncio.gather(
            *(s.create_conversation(conversation()) for _ in range(5)), s.create_conversation(c)
        )
        await s.list_items(c.id)
    finally:
        await s.close()
    assert len(threads) == 1 and threads.pop().startswith("shepherd-sqlite")
