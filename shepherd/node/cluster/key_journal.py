"""API keys across restarts: the node's ``MemoryKeyStore`` journaled to its durable records.

The replicated control-plane document (``key_sync``) is the fast path between live nodes; it lives in
memory, so a restart of every node at once would lose every key minted through ``/admin/keys``. The
journal keeps them: each record whose stored form changes (``MemoryKeyStore.watch``: minted, revoked,
or applied from the document) is written, as its ``to_dict`` JSON under kind ``"api_key"``, to the
node's record store (``<data_dir>/node.db`` when ``data_dir`` is set, else the history store's
``put_record``), and ``load`` applies what was written before the node serves.

- Writes run in order on one task (the store's callbacks are synchronous); ``close`` flushes what is
  queued (bounded), so a graceful stop keeps a key minted just before it.
- Bootstrap keys (configuration) are not journaled while usable: the configuration stays the truth for
  them (a key removed from it must stop working); their revocation is journaled, as revocation is final.
- ``load`` skips (and counts) a stored record that does not parse; it runs before ``attach``, so
  nothing it applies is written back.
- At start (``shepherd.node.app``): ``KeyJournal.open(data_dir, history_backend)`` loads ``journal.store``,
  which the auth layer then uses (``api.keys.install(app, store)``: bootstrap keys and the mesh's link
  added there), and ``attach(store, bootstrap_ids)`` starts journaling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

import orjson

from shepherd.auth.keys import ApiKeyRecord, MemoryKeyStore
from shepherd.node.config import ConfigError
from shepherd.storage.sqlite import SQLiteStore
from shepherd.storage.types import StorageError

log = logging.getLogger("shepherd.node.cluster.key_journal")

KIND = "api_key"
MAX_QUEUE = 100_000


def check_data_dir(data_dir: str) -> None:
    """Warn when ``data_dir`` exists and group or others may read or enter it: it holds the API key
    records (and may hold conversations). Left as it is: the operator made it (one made by the node is
    0700: ``shepherd.storage.sqlite.private_dir``)."""
    try:
        mode = os.stat(data_dir).st_mode
    except OSError:
        return  # missing: made 0700 when the store opens; anything else: the open says what is wrong
    if stat.S_ISDIR(mode) and mode & 0o077:
        log.warning(
            "data_dir %s is accessible to group or others (mode %04o): it holds the API key records; "
            "consider chmod 700",
            data_dir,
            stat.S_IMODE(mode),
        )


class RecordStore(Protocol):
    """What the journal uses of a ``HistoryStore`` (its node-records part)."""

    async def put_record(self, kind: str, key: str, value: bytes) -> None: ...

    async def delete_record(self, kind: str, key: str) -> bool: ...

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]: ...


class ClosableRecords(RecordStore, Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


class KeyJournal:
    """Journals one ``MemoryKeyStore`` to a ``RecordStore`` (see the module doc)."""

    def __init__(self, records: RecordStore, *, owned: ClosableRecords | None = None) -> None:
        self.records = records
        self.owned = owned  # a record store this journal opened (and closes)
        self.store = MemoryKeyStore()
        self.local_ids: frozenset[str] = frozenset()
        self.loaded = 0
        self.skipped = 0
        self.written = 0
        self.failed = 0
        self._queue: asyncio.Queue[ApiKeyRecord] = asyncio.Queue(MAX_QUEUE)
        self._task: asyncio.Task[None] | None = None
        self._last: dict[str, ApiKeyRecord] = {}  # what was last queued per id (no duplicate writes)

    @classmethod
    async def open(cls, data_dir: str | None, fallback: RecordStore) -> KeyJournal:
        """The node's journal: on SQLite at ``<data_dir>/node.db`` when ``data_dir`` is set (opened
        here, closed by ``close``), else on ``fallback`` (the history backend's records), with its
        records loaded into ``self.store``."""
        owned: SQLiteStore | None = None
        if data_dir is not None:
            check_data_dir(data_dir)
            owned = SQLiteStore(str(Path(data_dir) / "node.db"))  # the dir made 0700, node.db 0600
            try:
                await owned.start()
            except StorageError as e:
                raise ConfigError(f"data_dir {data_dir}: the node's records cannot be opened: {e}") from None
        journal = cls(owned if owned is not None else fallback, owned=owned)
        try:
            await journal.load(journal.store)
        except BaseException:
            if owned is not None:
                await owned.close()
            raise
        return journal

    async def load(self, store: MemoryKeyStore) -> int:
        """Apply the journaled records to ``store`` (before ``attach``); how many were applied."""
        for key_id, raw in await self.records.list_records(KIND):
            try:
                rec = ApiKeyRecord.from_dict(orjson.loads(raw))
            except (ValueError, TypeError, KeyError):
                self.skipped += 1
                log.warning("key journal: stored record %r does not parse: skipped", key_id[:64])
                continue
            store.apply([rec.to_dict()])
            self._last[rec.id] = rec
            self.loaded += 1
        return self.loaded

    def attach(self, store: MemoryKeyStore, local_ids: Collection[str] = ()) -> None:
        """Journal every change of ``store`` from now on (``local_ids``: the bootstrap keys), and what
        it holds now that the journal lacks (records taken from the mesh's document meanwhile)."""
        self.local_ids = frozenset(local_ids)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="key-journal")
        store.watch(self.changed)
        for r in store.records():
            self.changed(r)

    def changed(self, r: ApiKeyRecord) -> None:
        """``MemoryKeyStore.watch`` callback."""
        if r.id in self.local_ids and not r.revoked:
            return
        if self._last.get(r.id) == r:
            return
        self._last[r.id] = r
        try:
            self._queue.put_nowait(r)
        except asyncio.QueueFull:
            self.failed += 1
            log.error("key journal: queue full, key %r not written", r.id[:64])

    async def _run(self) -> None:
        while True:  # until cancelled by close()
            r = await self._queue.get()
            try:
                await self.records.put_record(KIND, r.id, orjson.dumps(r.to_dict()))
                self.written += 1
            except Exception:
                self.failed += 1
                log.exception("key journal: writing key %r failed", r.id[:64])
            finally:
                self._queue.task_done()

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait (bounded) until everything queued is written; False on timeout."""
        if self._task is None:
            return self._queue.empty()
        try:
            async with asyncio.timeout(timeout):
                await self._queue.join()
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Flush (bounded) and stop the writer."""
        if not await self.flush(timeout):
            log.error("key journal: %d key changes not written at shutdown", self._queue.qsize())
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.owned is not None:
            with contextlib.suppress(Exception):
                await self.owned.close()
            self.owned = None
