"""Workers added through the admin API, across restarts: their specs journaled to the node's records.

A node's configuration adds its own workers again when it starts, and the mesh's registry holds a worker
while the node that added it is alive (a dead node's entries are cleaned up: DESIGN). A worker added
through ``POST /workers`` (or SMG's ``/add_worker``) lived in memory only, so a rolling restart (the
README's upgrade procedure) dropped every one of them for good. The journal keeps each such worker's
spec, as the API took it, under kind ``"worker"`` keyed by the worker's id in the node's record store
(the key journal's: ``<data_dir>/node.db``, else the history backend's records), until the worker is
removed here, whoever asked (a removal the mesh applies here included); ``replay`` adds them again at
start, through the API's own checks.

- Writes run in order on one task (the registry's removal hook is synchronous); the admin calls answer
  once their change is written (``settled``), ``close`` waits (bounded) for what is queued.
- A spec that no longer parses or is refused at replay (a model the node stopped serving, a URL the
  allowlist now refuses) is logged, counted and dropped from the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from shepherd.node.cluster.key_journal import RecordStore

log = logging.getLogger("shepherd.node.cluster.worker_journal")

KIND = "worker"


class WorkerJournal:
    """The specs of the workers added here through the admin API (see the module doc)."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self.specs: dict[str, dict[str, Any]] = {}  # worker id -> the spec as the API took it
        self.replayed = 0
        self.dropped = 0
        self.failed = 0
        self._tail: asyncio.Future[None] | None = None  # the last queued write (writes run in order)

    async def replay(self, add: Callable[[dict[str, Any]], Awaitable[str]]) -> int:
        """Add every journaled worker again (``add``: the API's add, the worker's id back); a spec it
        refuses is dropped from the journal. How many were added."""
        for wid, raw in await self.records.list_records(KIND):
            try:
                spec = orjson.loads(raw)
                if not isinstance(spec, dict):
                    raise ValueError("not an object")
                got = await add(spec)
            except Exception as e:  # an ApiError (refused), a spec that does not parse
                status = getattr(e, "status", None)
                if status == 409:  # registered already (the configuration, or the mesh): kept
                    self.specs[wid] = spec
                    continue
                self.dropped += 1
                log.warning("worker journal: worker %s not added again (%s): dropped", wid[:64], e)
                self._write(self.records.delete_record(KIND, wid))
                continue
            self.specs[got] = spec
            self.replayed += 1
        return self.replayed

    def added(self, wid: str, spec: dict[str, Any]) -> None:
        """A worker the admin API added here."""
        self.specs[wid] = spec
        self._write(self.records.put_record(KIND, wid, orjson.dumps(spec)))

    def updated(self, wid: str, fields: dict[str, Any]) -> None:
        """``PUT``/``PATCH /workers/{id}`` changed a journaled worker's weights or labels."""
        spec = self.specs.get(wid)
        if spec is not None:
            self.added(wid, {**spec, **{k: v for k, v in fields.items() if v is not None}})

    def removed(self, wid: str) -> None:
        """The registry's removal hook: a journaled worker removed here (by whoever) leaves the journal."""
        if self.specs.pop(wid, None) is not None:
            self._write(self.records.delete_record(KIND, wid))

    def _write(self, op: Awaitable[Any]) -> None:
        prev = self._tail

        async def run() -> None:
            if prev is not None:
                with contextlib.suppress(Exception):
                    await prev
            try:
                await op
            except Exception:
                self.failed += 1
                log.exception("worker journal: a write failed")

        self._tail = asyncio.ensure_future(run())

    async def settled(self, timeout: float = 5.0) -> bool:
        """Wait (bounded) for the writes queued so far (an admin call answers once its change is kept);
        False on timeout."""
        tail = self._tail
        if tail is None:
            return True
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(tail)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the queued writes."""
        if not await self.settled(timeout):
            log.error("worker journal: writes not finished at shutdown")
