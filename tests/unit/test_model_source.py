"""The tokenizer cache of shepherd.node.dispatch.model_source: sha256-verified, extracted once, hostile zips
refused; ``--model-alias`` parsing."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from shepherd.node.config import ConfigError
from shepherd.node.dispatch.model_source import TokenizerCache, parse_aliases


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_store_verifies_extracts_once_and_indexes(tmp_path: Path) -> None:
    cache = TokenizerCache(tmp_path)
    data = _zip({"tokenizer.json": b"{}", "chat_template.jinja": b"{{ messages }}"})
    sha = hashlib.sha256(data).hexdigest()
    d = cache.store(data, sha)
    assert d == tmp_path / sha and (d / "chat_template.jinja").read_bytes() == b"{{ messages }}"
    assert cache.store(data, "") == d  # no sha from the engine: named by the bytes' own
    cache.index("k", sha)
    assert cache.indexed("k") == d
    (tmp_path / f"{sha}.zip").write_bytes(b"tampered")  # no longer verifies: not used
    assert cache.lookup(sha) is None and cache.indexed("k") is None
    assert cache.indexed("other") is None


def test_a_sha_mismatch_is_refused(tmp_path: Path) -> None:
    data = _zip({"tokenizer.json": b"{}"})
    with pytest.raises(ValueError, match="sha256 mismatch"):
        TokenizerCache(tmp_path).store(data, "0" * 64)
    assert not any(p for p in tmp_path.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("name", ["../evil.json", "/abs.json", "sub/dir.json"])
def test_entries_outside_a_flat_directory_are_refused(tmp_path: Path, name: str) -> None:
    data = _zip({"tokenizer.json": b"{}", name: b"x"})
    with pytest.raises(ValueError, match="not a plain file name"):
        TokenizerCache(tmp_path / "c").store(data, hashlib.sha256(data).hexdigest())
    assert not (tmp_path / "evil.json").exists()
    assert not any((tmp_path / "c").glob("[0-9a-f]*"))


def test_aliases() -> None:
    assert parse_aliases(("mine=org/model", " b = c ")) == {"org/model": "mine", "c": "b"}
    for bad in ("nothing", "=x", "x="):
        with pytest.raises(ConfigError):
            parse_aliases((bad,))
