"""What the node writes to disk is private: the SQLite files (API key records, conversations) and the
development PKI / keyring (private keys), and neither is written through a file someone planted.

- ``SQLiteStore``: a directory it makes is 0700 (an operator's existing one is left alone, and
  ``KeyJournal.open`` warns when ``data_dir`` is open to group or others); ``node.db`` and its ``-wal`` /
  ``-shm`` are 0600; files an earlier version left 0644 are narrowed.
- ``ensure_dev_pki``: its directory is made 0700; the keyring goes through a new 0600 temp file (a stale
  world-readable ``.tmp`` or a planted symlink is never written through); the lock file is never
  truncated through a planted link.

Run under umask 022 (the usual one), where the old code made 0755 directories and 0644 files.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shepherd.auth.files import make_private_dir, write_atomic
from shepherd.node.cluster.key_journal import KeyJournal
from shepherd.node.cluster.mesh_node import DEV_KEYRING, ensure_dev_pki
from shepherd.storage.memory import MemoryStore
from shepherd.storage.sqlite import SQLiteStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# ---- the SQLite files --------------------------------------------------------------------------------


async def test_a_data_dir_made_by_the_node_is_0700_and_its_database_files_0600(tmp_path: Path) -> None:
    data = tmp_path / "a" / "data"  # neither exists
    journal = await KeyJournal.open(str(data), MemoryStore())
    try:
        await journal.records.put_record("api_key", "k1", b"{}")  # a write: the WAL and its index exist
        assert mode(data) == 0o700 and mode(data.parent) == 0o700
        db = data / "node.db"
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
        assert all(f.exists() for f in files), list(data.iterdir())
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    finally:
        await journal.close()


async def test_an_operator_made_data_dir_is_left_alone_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="shepherd.node.cluster.key_journal"):
        journal = await KeyJournal.open(str(data), MemoryStore())
    await journal.close()
    assert mode(data) == 0o755  # not ours to change
    assert mode(data / "node.db") == 0o600
    warned = [r.getMessage() for r in caplog.records if "data_dir" in r.getMessage()]
    assert warned and "0755" in warned[0] and str(data) in warned[0], caplog.text
    # a private one: nothing to say
    caplog.clear()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="shepherd.node.cluster.key_journal"):
        journal = await KeyJournal.open(str(private), MemoryStore())
    await journal.close()
    assert not [r for r in caplog.records if "data_dir" in r.getMessage()], caplog.text


def leave_world_readable(db: Path) -> Path:
    db.chmod(0o644)
    wal = Path(f"{db}-wal")
    wal.write_bytes(b"")
    wal.chmod(0o644)
    return wal


async def test_database_files_left_world_readable_are_narrowed(tmp_path: Path) -> None:
    db = tmp_path / "history.db"
    first = SQLiteStore(str(db))
    await first.start()
    await first.close()
    wal = leave_world_readable(db)  # as an earlier version made them
    store = SQLiteStore(str(db))
    await store.start()
    try:
        assert mode(db) == 0o600 and mode(wal) == 0o600
    finally:
        await store.close()


# ---- the development PKI and keyring ---------------------------------------------------------------


def test_the_dev_pki_dir_is_made_0700_and_its_secrets_0600(tmp_path: Path) -> None:
    d = tmp_path / "pki" / "dev"
    files, keyring = ensure_dev_pki(d, "n1")
    assert mode(d) == 0o700 and mode(d.parent) == 0o700
    assert mode(keyring) == 0o600 and mode(files.key) == 0o600 and mode(d / "ca-key.pem") == 0o600
    assert not list(d.glob("*.tmp"))


def test_the_keyring_is_never_written_through_a_planted_temp_file(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir(mode=0o755)  # a shared directory someone else can write to
    stale = d / (DEV_KEYRING + ".tmp")
    stale.write_text("planted\n")
    stale.chmod(0o666)  # world-readable: O_TRUNC kept this mode for the keyring
    _, keyring = ensure_dev_pki(d, "n1")
    assert mode(keyring) == 0o600
    assert "planted" not in keyring.read_text()
    assert not stale.exists()

    d2 = tmp_path / "pki2"
    d2.mkdir(mode=0o755)
    leak = tmp_path / "leak.txt"
    leak.write_text("")
    (d2 / (DEV_KEYRING + ".tmp")).symlink_to(leak)  # the keyring would have landed in leak.txt
    _, keyring2 = ensure_dev_pki(d2, "n1")
    assert leak.read_text() == ""
    assert not keyring2.is_symlink() and mode(keyring2) == 0o600 and keyring2.read_text().strip()


def test_the_lock_file_is_not_truncated_through_a_planted_link(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    d.mkdir(mode=0o755)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (d / ".lock").symlink_to(victim)
    with pytest.raises(OSError):
        ensure_dev_pki(d, "n1")
    assert victim.read_text() == "keep me\n"


def test_the_shared_helpers(tmp_path: Path) -> None:
    assert make_private_dir(tmp_path / "x" / "y") is True
    assert make_private_dir(tmp_path / "x" / "y") is False  # exists: left as it is
    existing = tmp_path / "open"
    existing.mkdir(mode=0o755)
    assert make_private_dir(existing) is False and mode(existing) == 0o755
    write_atomic(tmp_path / "x" / "pub.pem", b"cert", private=False)
    write_atomic(tmp_path / "x" / "key.pem", b"key", private=True)
    assert mode(tmp_path / "x" / "pub.pem") == 0o644 and mode(tmp_path / "x" / "key.pem") == 0o600
