"""``open_store``: the history store a node's configuration names (docs/DESIGN.md §12).

``backend`` is ``memory``, ``sqlite``, ``postgres`` or ``redis``; the URL's scheme must match it
(``sqlite://``, ``postgresql://`` / ``postgres://``, ``redis://`` / ``rediss://`` / ``unix://``;
memory takes none). Bad input is a ``ValueError`` that says what is expected. The store is returned
not started: the caller awaits ``start()``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import HistoryStore

BACKENDS = ("memory", "sqlite", "postgres", "redis")
_SCHEMES = {
    "sqlite": ("sqlite",),
    "postgres": ("postgresql", "postgres"),
    "redis": ("redis", "rediss", "unix"),
}


def _check_url(backend: str, url: str | None) -> str:
    if not url:
        raise ValueError(f"the {backend} history backend needs a URL ({_SCHEMES[backend][0]}://...)")
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in _SCHEMES[backend]:
        allowed = " or ".join(f"{s}://" for s in _SCHEMES[backend])
        raise ValueError(f"the {backend} history backend takes a {allowed} URL, not {url!r}")
    return url


def open_store(
    backend: str,
    url: str | None,
    *,
    retention_days: float = 30.0,
    max_items: int = 200_000,
    max_bytes: int = 1 << 30,
    migrations: str = "apply",
    pool_size: int = 8,
) -> HistoryStore:
    """The store of ``backend`` at ``url`` (not started)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown history backend {backend!r} (one of {', '.join(BACKENDS)})")
    if retention_days < 0:
        raise ValueError("retention_days must be >= 0 (0: kept for ever)")
    if migrations not in ("apply", "refuse"):
        raise ValueError(f'history migrations are "apply" or "refuse", not {migrations!r}')
    if pool_size < 1:
        raise ValueError("pool_size must be >= 1")
    if backend == "memory":
        if url:
            raise ValueError(f"the memory history backend takes no URL, not {url!r}")
        return MemoryStore(max_items=max_items, max_bytes=max_bytes)
    url = _check_url(backend, url)
    if backend == "sqlite":
        # not at the top: each backend's module (and its optional driver) loads only when chosen
        from shepherd.storage.sqlite import SQLiteStore, path_of

        return SQLiteStore(path_of(url))
    if backend == "postgres":
        # optional dependency (asyncpg), imported only when chosen: not at the top
        from shepherd.storage.postgres import PostgresStore

        return PostgresStore(url, pool_size=pool_size, migrations=migrations)
    # optional dependency (redis), imported only when chosen: not at the top
    from shepherd.storage.redis import RedisStore

    return RedisStore(url, retention_days=retention_days, pool_size=pool_size)
