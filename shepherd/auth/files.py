"""Secret files on disk: private directories and atomic writes that never go through a planted file.

Used for what a node writes that others on the machine must not read or redirect: the development PKI
(``certs.write_dev_pki``: the CA's and nodes' private keys) and the mesh's development keyring
(``shepherd.node.cluster.mesh_node.ensure_dev_pki``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_private_dir", "write_atomic"]


def make_private_dir(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` and any missing parent, each made here mode 0700 (``umask`` may only narrow it);
    a directory that already exists is left as it is. True when ``path`` itself was created."""
    p = Path(path)
    missing: list[Path] = []
    for d in (p, *p.parents):
        if d.is_dir():
            break
        missing.append(d)
    created = False
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
            created = created or d == p
        except FileExistsError:
            if not d.is_dir():
                raise
    return created


def write_atomic(path: str | os.PathLike[str], data: bytes, *, private: bool) -> None:
    """``data`` into ``path`` atomically (a temporary file renamed over it), mode 0600 when ``private``
    (else 0644); a missing directory is made 0700 (``make_private_dir``).

    The temporary file is always a new one: a stale or planted ``<name>.tmp`` (a world-readable file, a
    symlink to somewhere else) is removed first, and the open refuses to follow a link or to reuse a
    file made in between (``O_EXCL | O_NOFOLLOW``), so a secret never lands in a file with another mode
    or at another path."""
    target = Path(path)
    make_private_dir(target.parent)
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
