"""What a tokenizer file determines, kept on disk between process starts.

Every process that loads a tokenizer (node, mock engine, a ``--procs`` child) derived the same tables
from the same ``tokenizer.json``: the fast encoder's checks and ranks, the byte decoder's table, the
parsed pieces of the file they need (~1 s of CPU for a 150k vocabulary, at each start). They depend on
the file's content, the ``tokenizers`` library, Python's Unicode tables and the code that derives
them, and are kept per all of those in ``$SHEPHERD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/shepherd``,
``~/.cache/shepherd``), in a directory only this user may read.

A record is a small JSON header and lists of byte strings and of unsigned ints, in a format of its
own (no pickle or marshal: nothing in a record is code), with a digest of its bytes: a malformed or
damaged one is only a miss. Only files and directories of this user's that no one else may write are
read (no symbolic link followed). Written whole or not at all (a temporary file renamed over it); an
unwritable cache, or none (no absolute place for it), is no error: the tables are derived again, as
they are when a kept table fails the checks it is used under (the record is then replaced).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import stat
import struct
import tempfile
import unicodedata
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import tokenizers

__all__ = ["Record", "cache_path", "code_digest", "forget", "load_record", "read_kept", "store_record"]

_MAGIC: Final = b"SHEPHERD-TABLES\x02"
_U32: Final = struct.Struct("<I")
_DIGEST_SIZE: Final = 32


def _digest(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=_DIGEST_SIZE).digest()


class Record:
    """One kept set of tables: ``header`` (JSON), ``blobs`` (lists of bytes), ``ints`` (uint32 arrays)."""

    __slots__ = ("blobs", "header", "ints")

    def __init__(
        self, header: dict[str, Any], blobs: Sequence[Sequence[bytes]], ints: Sequence[Sequence[int]]
    ) -> None:
        self.header = header
        self.blobs: list[list[bytes]] = [list(b) for b in blobs]
        self.ints: list[array[int]] = [a if isinstance(a, array) else array("I", a) for a in ints]

    def dump(self) -> bytes:
        head = json.dumps(self.header, separators=(",", ":")).encode()
        parts = [_U32.pack(len(head)), head, _U32.pack(len(self.blobs)), _U32.pack(len(self.ints))]
        for items in self.blobs:
            lengths = array("I", map(len, items))
            parts += [_U32.pack(len(items)), lengths.tobytes(), b"".join(items)]
        for ints in self.ints:
            parts += [_U32.pack(len(ints)), array("I", ints).tobytes()]
        body = b"".join(parts)
        return _MAGIC + _digest(body) + body

    @classmethod
    def parse(cls, data: bytes) -> Record:
        """The record in ``data`` (raises ValueError when it is not a whole one, or its digest does not
        match its bytes: a record damaged in a way that keeps its lengths is a miss too)."""
        view = memoryview(data)
        pos = len(_MAGIC) + _DIGEST_SIZE
        if bytes(view[: len(_MAGIC)]) != _MAGIC:
            raise ValueError("not a table record")
        if bytes(view[len(_MAGIC) : pos]) != _digest(view[pos:]):
            raise ValueError("the record's digest does not match")

        def u32() -> int:
            nonlocal pos
            if pos + 4 > len(view):
                raise ValueError("cut short")
            (n,) = _U32.unpack_from(view, pos)
            pos += 4
            return int(n)

        def take(n: int) -> memoryview:
            nonlocal pos
            if n < 0 or pos + n > len(view):
                raise ValueError("cut short")
            out = view[pos : pos + n]
            pos += n
            return out

        n_head = u32()
        header = json.loads(bytes(take(n_head)))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        n_blobs, n_ints = u32(), u32()
        blobs: list[list[bytes]] = []
        for _ in range(n_blobs):
            count = u32()
            lengths = array("I")
            lengths.frombytes(take(4 * count))
            raw = bytes(take(sum(lengths)))
            items: list[bytes] = []
            at = 0
            for n in lengths:
                items.append(raw[at : at + n])
                at += n
            blobs.append(items)
        ints: list[array[int]] = []
        for _ in range(n_ints):
            count = u32()
            a = array("I")
            a.frombytes(take(4 * count))
            ints.append(a)
        if pos != len(view):
            raise ValueError("trailing bytes")
        return cls(header, blobs, ints)


@functools.cache
def code_digest(*files: str) -> bytes | None:
    """The digest of the source files that derive a kind of table: a change to them is a new record
    (None when a source cannot be read, an install without sources: then nothing is kept, as a record
    could outlive the code that made it)."""
    h = hashlib.sha256()
    for f in files:
        try:
            h.update(Path(f).read_bytes())
        except OSError:
            return None
    return h.digest()


def cache_path(kind: str, key: bytes, code: bytes | None, suffix: str = ".tables") -> Path | None:
    """Where the record of ``kind`` for file content ``key`` and deriving code ``code`` lives (None
    when there is no absolute place for the cache, or no code digest: nothing is kept)."""
    base = os.environ.get("SHEPHERD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shepherd"
    )
    if not os.path.isabs(base) or code is None:
        return None
    tag = b"|".join((key, code, tokenizers.__version__.encode(), unicodedata.unidata_version.encode()))
    return Path(base) / kind / f"{hashlib.sha256(tag).hexdigest()}{suffix}"


def _ours(st: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else: what the records and their directories must be
    (a directory someone else may write, or a file of another user's, is not taken: its tables would
    decide how this node tokenizes)."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _dirs_ours(path: Path) -> bool:
    """The record's directory and the cache's base above it: this user's directories (no links)."""
    try:
        sts = [os.lstat(d) for d in (path.parent.parent, path.parent)]
    except OSError:
        return False
    return all(stat.S_ISDIR(st.st_mode) and _ours(st) for st in sts)


def read_kept(path: Path | None) -> bytes | None:
    """A kept file's bytes: a regular file (no symbolic link followed) in the cache's directories, all
    this user's and writable by no one else; else None (a miss)."""
    if path is None or not _dirs_ours(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _ours(st):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def load_record(path: Path | None) -> Record | None:
    data = read_kept(path)
    if data is None:
        return None
    try:
        return Record.parse(data)
    except ValueError:
        return None


def store_record(path: Path | None, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a temporary file of its own, renamed over it); the
    directories are made private to this user, and nothing is written into ones that are not."""
    if path is None:
        return
    try:
        path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        if not _dirs_ours(path):
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # O_EXCL, 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass


def forget(path: Path | None) -> None:
    """Remove a kept record (one whose tables the checks refused: it is derived and kept again)."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
