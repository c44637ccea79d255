"""What a tokenizer file determines, kept on disk between process starts.

Every process that loads a tokenizer (node, mock engine, a ``--procs`` child) derived the same tables
from the same ``tokenizer.json``: the fast encoder's checks and ranks, the byte decoder's table, the
parsed pieces of the file they need (~1 s of CPU for a 150k vocabulary, at each start). They depend on
the file's content, the ``tokenizers`` library, Python's Unicode tables and the code that derives
them, and are kept per all of those in ``$SHEPHERD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/shepherd``,
``~/.cache/shepherd``), in a directory only this user may read.

A record is a small JSON header and lists of byte strings and of unsigned ints, in a format of its
own (no pickle or marshal: nothing in a record is code, and a malformed one is only a miss). Written
whole or not at all (a temporary file renamed over it); an unwritable cache, or none (no absolute
place for it), is no error: the tables are derived again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import unicodedata
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import tokenizers

__all__ = ["Record", "cache_path", "code_digest", "load_record", "store_record"]

_MAGIC: Final = b"SHEPHERD-TABLES\x01"
_U32: Final = struct.Struct("<I")


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
        parts = [_MAGIC, _U32.pack(len(head)), head, _U32.pack(len(self.blobs)), _U32.pack(len(self.ints))]
        for items in self.blobs:
            lengths = array("I", map(len, items))
            parts += [_U32.pack(len(items)), lengths.tobytes(), b"".join(items)]
        for ints in self.ints:
            parts += [_U32.pack(len(ints)), array("I", ints).tobytes()]
        return b"".join(parts)

    @classmethod
    def parse(cls, data: bytes) -> Record:
        """The record in ``data`` (raises ValueError when it is not a whole one)."""
        view = memoryview(data)
        pos = len(_MAGIC)
        if bytes(view[:pos]) != _MAGIC:
            raise ValueError("not a table record")

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
def code_digest(*files: str) -> bytes:
    """The digest of the source files that derive a kind of table: a change to them is a new record."""
    h = hashlib.sha256()
    for f in files:
        try:
            h.update(Path(f).read_bytes())
        except OSError:
            h.update(f.encode())
    return h.digest()


def cache_path(kind: str, key: bytes, code: bytes, suffix: str = ".tables") -> Path | None:
    """Where the record of ``kind`` for file content ``key`` and deriving code ``code`` lives (None
    when there is no absolute place for the cache: nothing is kept)."""
    base = os.environ.get("SHEPHERD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shepherd"
    )
    if not os.path.isabs(base):
        return None
    tag = b"|".join((key, code, tokenizers.__version__.encode(), unicodedata.unidata_version.encode()))
    return Path(base) / kind / f"{hashlib.sha256(tag).hexdigest()}{suffix}"


def load_record(path: Path | None) -> Record | None:
    if path is None:
        return None
    try:
        return Record.parse(path.read_bytes())
    except (OSError, ValueError):
        return None


def store_record(path: Path | None, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all; the directories are made private to this user."""
    if path is None:
        return
    try:
        path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
