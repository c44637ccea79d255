"""Fixtures of the storage suite: the PostgreSQL and Redis services (one each per session, from
tests.services), a ``Backend`` per parametrized backend that opens stores in a fresh namespace (a new
database, a new key prefix, a new file), and a started ``store``.

Without a service: skipped with the reason locally, a failure under CI=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from shepherd.storage.memory import MemoryStore
from shepherd.storage.postgres import PostgresStore
from shepherd.storage.redis import RedisStore
from shepherd.storage.sqlite import SQLiteStore
from shepherd.storage.types import HistoryStore
from tests.services import Service, postgres_service, redis_service, service_or_skip

BACKENDS = ("memory", "sqlite", "postgres", "redis")
_dbs = itertools.count()


@pytest.fixture(scope="session")
def pg_service() -> Iterator[Service]:
    with service_or_skip("PostgreSQL", postgres_service) as svc:
        yield svc


@pytest.fixture(scope="session")
def redis_service_() -> Iterator[Service]:
    with service_or_skip("Redis", redis_service) as svc:
        yield svc


class Backend:
    """Opens stores of one backend; ``namespace()`` makes a fresh, empty place to open them on (stores
    opened on one namespace share their records, as two nodes on one database)."""

    def __init__(self, name: str, tmp: Path, service: Service | None) -> None:
        self.name = name
        self.tmp = tmp
        self.service = service

    async def namespace(self) -> dict[str, Any]:
        n = next(_dbs)
        if self.name == "sqlite":
            return {"path": str(self.tmp / f"db{n}" / "history.db")}
        if self.name == "redis":
            assert self.service is not None
            return {"url": self.service.url, "prefix": f"t{uuid.uuid4().hex[:12]}:"}
        if self.name == "postgres":
            assert self.service is not None
            db = f"t_{uuid.uuid4().hex[:16]}"
            conn = await asyncpg.connect(self.service.url)
            try:
                await conn.execute(f"CREATE DATABASE {db}")
            finally:
                await conn.close()
            return {"url": self.service.url.rsplit("/", 1)[0] + "/" + db}
        return {}

    def open(self, ns: dict[str, Any], **kw: Any) -> HistoryStore:
        if self.name == "sqlite":
            return SQLiteStore(ns["path"])
        if self.name == "postgres":
            return PostgresStore(
                ns["url"], pool_size=kw.get("pool_size", 4), migrations=kw.get("migrations", "apply")
            )
        if self.name == "redis":
            return RedisStore(
                ns["url"], prefix=ns["prefix"], retention_days=kw.get("retention_days", 0.0), pool_size=4
            )
        return MemoryStore(max_items=kw.get("max_items", 100_000))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    name: str = request.param
    svc: Service | None = None
    if name == "postgres":
        svc = request.getfixturevalue("pg_service")
    elif name == "redis":
        svc = request.getfixturevalue("redis_service_")
    return Backend(name, tmp_path, svc)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[HistoryStore]:
    s = backend.open(await backend.namespace())
    await s.start()
    try:
        yield s
    finally:
        await s.close()


class Proxy:
    """A loopback TCP relay to a service: ``cut()`` closes it and every connection through it, as a
    server that went away."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.close()
            return
        self._writers |= {cw, sw}
        await asyncio.gather(self._pipe(cr, sw), self._pipe(sr, cw))

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
