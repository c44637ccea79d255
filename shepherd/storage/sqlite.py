"""The SQLite backend: the embedded durable default (one file, docs/DESIGN.md §12).

stdlib ``sqlite3`` on ONE dedicated thread (a single-worker executor this store owns): the event loop
never blocks on SQLite, and the one connection is only ever used by that thread. WAL journal,
``synchronous=NORMAL``, a busy timeout (another process may hold the file); each method is one
transaction (``BEGIN IMMEDIATE`` when it writes), so a failed write leaves nothing. The schema and the
operations are ``sql``'s, shared with PostgreSQL.

URLs: ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite://:memory:`` (tests).

The files hold API key records and conversations: a directory made here is 0700 (``private_dir``; one
that exists is left as the operator made it) and the database is created 0600 before SQLite opens it
(SQLite gives its ``-wal`` and ``-shm`` files the database's mode); files of an earlier start readable by
group or others are narrowed to 0600 (``private_file``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shepherd.storage import sql
from shepherd.storage.sql import Plan, T
from shepherd.storage.types import IntegrityError, StorageError, StorageUnavailable

MEMORY = ":memory:"
BUSY_TIMEOUT_S = 5.0
DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger("shepherd.storage.sqlite")


def private_dir(path: str | os.PathLike[str]) -> bool:
    """Create the directory ``path`` and its missing parents, each 0700; a directory that exists is left
    as it is. True when ``path`` itself was created here."""
    p = Path(path)
    missing: list[Path] = []
    for d in (p, *p.parents):
        if d.is_dir():
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
    return bool(missing) and missing[0] == p


def private_file(path: str) -> None:
    """Create ``path`` empty with mode 0600 if it is missing (SQLite then keeps it, and gives its
    ``-wal`` / ``-shm`` the same mode); narrow it and its ``-wal`` / ``-shm`` to 0600 when they exist with
    group or other permissions (left by an earlier version)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    os.close(fd)
    for f in (path, path + "-wal", path + "-shm"):
        try:
            st = os.stat(f)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            try:
                os.chmod(f, FILE_MODE)
                log.warning("SQLite file %s was readable by group or others: narrowed to 0600", f)
            except PermissionError:
                log.warning("SQLite file %s is readable by group or others (not ours to narrow)", f)


def path_of(url: str) -> str:
    """The database path of a ``sqlite://`` URL (``:memory:`` for an in-memory database)."""
    if not url.startswith("sqlite://"):
        raise ValueError(f"a SQLite URL starts with sqlite://, not {url!r}")
    rest = url[len("sqlite://") :]
    if rest in (MEMORY, "/" + MEMORY):
        return MEMORY
    if not rest.startswith("/") or len(rest) < 2:
        raise ValueError(
            f"bad SQLite URL {url!r}: use sqlite:///relative/path.db, sqlite:////absolute/path.db "
            "or sqlite://:memory:"
        )
    path = rest[1:]
    if "?" in path or path.endswith("/"):
        raise ValueError(f"bad SQLite URL {url!r}: a file path without query or trailing slash")
    return path


class SQLiteStore(sql.PlanStore):
    name = "sqlite"
    shared = False

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    # ---- on the store's thread ------------------------------------------------------------------------

    def _open(self) -> None:
        if self.path != MEMORY:
            private_dir(Path(self.path).parent)
            private_file(self.path)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        # switching to WAL takes the file's exclusive lock and SQLite does not wait for it (no busy
        # handler): two stores opening one new file at once would fail here, so retry, bounded
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    conn.close()
                    raise
                time.sleep(0.01)
        conn.execute("PRAGMA synchronous = NORMAL")
        self._conn = conn
        self._execute(sql.migrate(sql.SQLITE, apply=True), True)

    def _execute(self, plan: Plan[T], write: bool) -> T:
        conn = self._conn
        if conn is None:
            raise StorageUnavailable("the SQLite store is not started")
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            rows: list[tuple[Any, ...]] = []
            q = next(plan)
            while True:
                if q.many:
                    conn.executemany(q.sql, q.args)
                    rows = []
                else:
                    rows = [tuple(r) for r in conn.execute(q.sql, tuple(q.args)).fetchall()]
                q = plan.send(rows)
        except StopIteration as done:
            conn.execute("COMMIT")
            return done.value  # type: ignore[no-any-return]
        finally:
            if conn.in_transaction:  # the plan failed, or COMMIT did: nothing of it stays
                conn.execute("ROLLBACK")

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- on the event loop ------------------------------------------------------------------------------

    async def _call(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            raise StorageUnavailable("the SQLite store is not started")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.IntegrityError as e:
            raise IntegrityError(str(e)) from e
        except (sqlite3.OperationalError, OSError) as e:  # locked past the busy timeout, disk I/O, no dir
            raise StorageUnavailable(f"SQLite {self.path}: {e}") from e
        except sqlite3.Error as e:
            raise StorageError(f"SQLite {self.path}: {e}") from e

    async def _run(self, plan: Plan[T], write: bool) -> T:
        out: T = await self._call(self._execute, plan, write)
        return out

    async def start(self) -> None:
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shepherd-sqlite")
        try:
            await self._call(self._open)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        ex = self._executor
        if ex is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(ex, self._close)
        finally:
            self._executor = None
            ex.shutdown(wait=False)
