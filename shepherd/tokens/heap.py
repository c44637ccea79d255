"""Give the C heap's free pages back to the kernel after loading tokenizers (glibc ``malloc_trim``).

Loading a tokenizer parses its tokenizer.json twice in native code and once in Python: HF
``tokenizers`` (serde), ``orjson`` (the fast encoder's checks) and tiktoken's rank tables. What the
parses allocated is freed, but glibc keeps the freed pages in its arenas: for Qwen3 (151k vocabulary)
``tokenizers.Tokenizer.from_buffer`` leaves the process 160 MB larger, of which 110 MB are free heap
that ``malloc_trim(0)`` returns. Trimming before the tokenizer pool forks also keeps those pages out
of every worker's RSS. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from typing import Any

__all__ = ["freeze_before_fork", "trim_heap"]

_libc: Any = None


def _malloc_trim() -> Any:
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            _libc = False
        else:
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _libc = lib.malloc_trim
                _libc.argtypes = [ctypes.c_size_t]
                _libc.restype = ctypes.c_int
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                _libc = False
    return _libc


def trim_heap() -> bool:
    """Return the C heap's free pages to the kernel; True when it ran (glibc)."""
    trim = _malloc_trim()
    if not trim:
        return False
    trim(0)
    return True


def freeze_before_fork() -> None:
    """Collect, move every object alive now to the collector's permanent generation, and trim: the
    pages of start-up's objects (tokenizer tables, templates) are then shared with forked workers
    and stay shared, since no later collection in the parent writes to their headers again."""
    gc.collect()
    gc.freeze()
    trim_heap()
