"""The PostgreSQL backend: asyncpg and a pool; SMG's tables (``sql``'s schema and operations, shared
with SQLite; docs/DESIGN.md §12).

At start the schema is brought to this version's: migrations from ``shepherd_schema_migrations`` are
applied under ``pg_advisory_lock`` (several nodes may start at once), or with ``migrations="refuse"``
``start`` raises ``SchemaError`` whose message is the SQL the operator must run. Each method is one
transaction on a pooled connection. A connection that cannot be made, is lost or times out is
``StorageUnavailable``; a unique violation is ``IntegrityError``.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from shepherd.storage import sql
from shepherd.storage.sql import Plan, T
from shepherd.storage.types import IntegrityError, StorageError, StorageUnavailable

# pg_advisory_lock key of the migrations: "shepherd" as a 64-bit integer
MIGRATION_LOCK = int.from_bytes(b"shepherd", "big") & 0x7FFF_FFFF_FFFF_FFFF
_UNAVAILABLE = (
    OSError,  # refused, reset, unreachable; TimeoutError is one
    asyncio.TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,  # 08xxx, the connection gone
    asyncpg.exceptions.OperatorInterventionError,  # 57xxx: shutting down, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # 53xxx: too many connections, disk full
    asyncpg.exceptions.InterfaceError,  # the pool closing, a connection closed under us
    asyncpg.exceptions.InternalClientError,
)


@functools.lru_cache(maxsize=512)
def dollar_params(text: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2 ...`` (the plans never put ``?`` in a literal)."""
    n = iter(range(1, 1 << 16))
    return re.sub(r"\?", lambda _: f"${next(n)}", text)


class PostgresStore(sql.PlanStore):
    name = "postgres"
    shared = True

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 8,
        migrations: str = "apply",
        connect_timeout: float = 5.0,
        command_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        if migrations not in ("apply", "refuse"):
            raise ValueError(f'migrations is "apply" or "refuse", not {migrations!r}')
        if pool_size < 1:
            raise ValueError("pool_size must be >= 1")
        self.dsn = dsn
        self.pool_size = pool_size
        self.migrations = migrations
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._pool: Any = None

    def _unavailable(self, e: BaseException) -> StorageUnavailable:
        return StorageUnavailable(f"PostgreSQL unavailable: {type(e).__name__}: {e}")

    async def start(self) -> None:
        if self._pool is not None:
            return
        try:
            pool = await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self.pool_size,
                timeout=self.connect_timeout,
                command_timeout=self.command_timeout,
            )
        except _UNAVAILABLE as e:
            raise self._unavailable(e) from e
        self._pool = pool
        try:
            await self._migrate()
        except BaseException:
            await self.close()
            raise

    async def _migrate(self) -> None:
        apply = self.migrations == "apply"
        try:
            async with self._pool.acquire(timeout=self.connect_timeout) as conn:
                if apply:
                    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
                try:
                    async with conn.transaction():
                        await self._drive(conn, sql.migrate(sql.POSTGRES, apply))
                finally:
                    if apply:
                        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
        except asyncpg.exceptions.PostgresError as e:
            if isinstance(e, _UNAVAILABLE):
                raise self._unavailable(e) from e
            raise StorageError(f"PostgreSQL schema migration failed: {e}") from e
        except _UNAVAILABLE as e:
            raise self._unavailable(e) from e

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await pool.close()
            except (*_UNAVAILABLE, asyncpg.exceptions.PostgresError):
                pool.terminate()

    @staticmethod
    async def _drive(conn: Any, plan: Plan[T]) -> T:
        rows: list[tuple[Any, ...]] = []
        try:
            q = next(plan)
            while True:
                text = dollar_params(q.sql)
                if q.many:
                    await conn.executemany(text, q.args)
                    rows = []
                else:
                    rows = [tuple(r) for r in await conn.fetch(text, *q.args)]
                q = plan.send(rows)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def _run(self, plan: Plan[T], write: bool) -> T:
        if self._pool is None:
            raise StorageUnavailable("the PostgreSQL store is not started")
        try:
            async with self._pool.acquire(timeout=self.connect_timeout) as conn, conn.transaction():
                return await self._drive(conn, plan)
        except asyncpg.exceptions.UniqueViolationError as e:
            raise IntegrityError(str(e)) from e
        except _UNAVAILABLE as e:
            raise self._unavailable(e) from e
        except asyncpg.exceptions.PostgresError as e:
            raise StorageError(f"PostgreSQL: {type(e).__name__}: {e}") from e
