"""Validation helpers for decoding replicated-state payloads (msgpack values into typed ones).

Every helper checks one decoded value's type and bounds and returns it, or raises
``StateDecodeError``, the one exception type every state decoder raises (the mesh state's CRDTs, the
prefix-index wire): a caller catches it to count and drop a malformed payload. Types are checked
exactly (``type(v) is int``: a bool is not an int here).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "StateDecodeError",
    "expect_bool",
    "expect_bytes",
    "expect_float",
    "expect_int",
    "expect_list",
    "expect_str",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1  # the range of a msgpack int64


class StateDecodeError(ValueError):
    """A state payload is malformed (the one exception type every state decoder raises)."""


def expect_int(v: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise StateDecodeError(f"expected an int in [{lo}, {hi}], got {type(v).__name__}")
    return v


def expect_float(v: Any) -> float:
    if type(v) is int:
        v = float(v)
    if type(v) is not float or not math.isfinite(v):
        raise StateDecodeError(f"expected a finite float, got {type(v).__name__}")
    return v


def expect_str(v: Any, max_len: int = 256, allow_empty: bool = False) -> str:
    if type(v) is not str or len(v) > max_len or (not v and not allow_empty):
        raise StateDecodeError(f"expected a str of at most {max_len} chars, got {type(v).__name__}")
    return v


def expect_bytes(v: Any, max_len: int = 1 << 24) -> bytes:
    if type(v) is not bytes or len(v) > max_len:
        raise StateDecodeError(f"expected bytes of at most {max_len}, got {type(v).__name__}")
    return v


def expect_bool(v: Any) -> bool:
    if type(v) is not bool:
        raise StateDecodeError(f"expected a bool, got {type(v).__name__}")
    return v


def expect_list(v: Any, length: int | None = None, max_len: int = 1 << 20) -> list[Any]:
    if type(v) is not list or len(v) > max_len or (length is not None and len(v) != length):
        want = f"of length {length}" if length is not None else f"of at most {max_len} items"
        raise StateDecodeError(f"expected a list {want}, got {type(v).__name__}")
    return v
