"""History storage behind one async interface (responses, conversations, items, the node's records).

Callers use ``types`` (``HistoryStore``, the records, ``StorageUnavailable`` ...), ``ids`` (record ids
that name their owner node) and ``factory.open_store`` (the store a configuration names). Backends:
``memory.MemoryStore`` (bounded, in-process), ``sqlite.SQLiteStore`` (one file, on its own thread),
``postgres.PostgresStore`` (asyncpg; migrations under an advisory lock) and ``redis.RedisStore``
(hashes, ZSETs, Lua writes, TTL retention); ``sql`` holds the schema and operations SQLite and
PostgreSQL share. Imports proto only (docs/DESIGN.md §12).
"""

__all__ = ["factory", "ids", "memory", "postgres", "redis", "sql", "sqlite", "types"]
