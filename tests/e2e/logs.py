"""Log files of the processes the e2e tests start: one directory per test session, removed when the
session's interpreter exits (``SMG_KEEP_LOGS=1`` keeps it and prints where it is)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

_DIR = Path(tempfile.mkdtemp(prefix="smg-e2e-logs-"))


def _remove() -> None:
    if os.environ.get("SMG_KEEP_LOGS"):
        print(f"e2e process logs kept in {_DIR}", file=sys.stderr)
        return
    shutil.rmtree(_DIR, ignore_errors=True)


atexit.register(_remove)


def log_file(prefix: str) -> Path:
    """A new empty log file for one process."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=_DIR)
    os.close(fd)
    return Path(name)
