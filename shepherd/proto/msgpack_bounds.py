"""Bounded msgpack decoding of what other nodes send (history RPCs, replicated-state payloads).

``msgpack.unpackb`` bounds each string, bin and container by the input's length and nesting by its own
stack (1024 levels: ``StackError``), but not how many objects a body makes: one byte is an empty array
(~70 bytes of Python objects), so a 16 MiB frame decodes into 16 million lists (1.2 GB, ~4 s). The
decoder holds the GIL all along: in a thread the event loop stops just the same. Here:

* ``Limits``: the input's size, msgpack's per-object bounds (``max_str_len``, ``max_bin_len``,
  ``max_array_len``, ``max_map_len``, ``max_ext_len``) and ``max_containers``, the arrays and maps of a
  body in all (counted as each is made, refused at the first past the bound): what a legitimate message
  of the kind holds.
* ``unpack_steps``: a body larger than ``STEP`` is fed to one ``msgpack.Unpacker`` ``STEP`` bytes at a
  time (it resumes where the last slice ended) with a yield between slices, so the caller's loop runs
  between them (``unpack_async``); a smaller one decodes in one ``unpackb`` call (as ``unpack`` does,
  without the generator: the datagrams and most state payloads).

Scalars are not counted (a 3-byte string is a ~50-byte object): a body still makes up to ~25 times its
size in objects, bounded by ``max_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

__all__ = ["STEP", "BoundsError", "Limits", "unpack", "unpack_async", "unpack_steps"]

STEP = 64 * 1024  # bytes decoded between two yields (~1 ms of legitimate records, ~15 ms at worst)


class BoundsError(ValueError):
    """A body that is not one msgpack value within its ``Limits`` (the message says which)."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_bytes: int
    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_ext_len: int = 0
    # arrays and maps in all: at most ``max_containers`` and one per ``bytes_per_container`` of the body
    max_containers: int = 1 << 62
    bytes_per_container: int = 1

    def containers(self, size: int) -> int:
        return min(self.max_containers, max(1024, size // self.bytes_per_container))


class _TooMany(Exception):
    pass


def _options(limits: Limits, size: int) -> dict[str, Any]:
    """msgpack's options for a body of ``size`` bytes under ``limits`` (its containers counted)."""
    budget = limits.containers(size)
    opts: dict[str, Any] = {
        "raw": False,
        "strict_map_key": True,
        "max_str_len": limits.max_str_len,
        "max_bin_len": limits.max_bin_len,
        "max_array_len": limits.max_array_len,
        "max_map_len": limits.max_map_len,
        "max_ext_len": limits.max_ext_len,
    }
    if budget < size:  # (a body of n bytes has at most n containers: no count needed)
        made = 0

        def count(v: Any) -> Any:
            nonlocal made
            made += 1
            if made > budget:
                raise _TooMany
            return v

        opts["list_hook"] = opts["object_hook"] = count
    return opts


def _check_size(data: bytes, limits: Limits) -> int:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BoundsError("not bytes")
    size = len(data)
    if size > limits.max_bytes:
        raise BoundsError(f"{size} bytes > {limits.max_bytes}")
    return size


def _whole(data: bytes, limits: Limits, size: int) -> Any:
    """A body of at most ``STEP`` bytes in one ``unpackb`` call (a datagram's, most state payloads)."""
    try:
        return msgpack.unpackb(data, **_options(limits, size))
    except _TooMany:
        raise BoundsError(f"more than {limits.containers(size)} arrays and maps") from None
    except msgpack.ExtraData:
        raise BoundsError("trailing bytes after the value") from None
    except Exception as e:  # msgpack raises many types (FormatError, StackError, ValueError, ...)
        if type(e) is ValueError and "incomplete" in str(e):
            raise BoundsError("incomplete msgpack value") from None
        raise BoundsError(f"bad msgpack: {type(e).__name__}: {e}") from None


def unpack_steps(data: bytes, limits: Limits) -> Generator[None, None, Any]:
    """The one msgpack value of ``data`` (the generator's return value), decoded ``STEP`` bytes at a
    time with a yield between; ``BoundsError`` on anything malformed or past ``limits``."""
    size = _check_size(data, limits)
    if size <= STEP:
        return _whole(data, limits, size)
    unpacker = msgpack.Unpacker(max_buffer_size=size, **_options(limits, size))
    view = memoryview(data)
    try:
        for start in range(0, max(size, 1), STEP):
            if start:
                yield
            unpacker.feed(view[start : start + STEP])
            try:
                value = unpacker.unpack()
            except msgpack.OutOfData:
                continue
            if unpacker.tell() != size:
                raise BoundsError("trailing bytes after the value")
            return value
    except _TooMany:
        raise BoundsError(f"more than {limits.containers(size)} arrays and maps") from None
    except BoundsError:
        raise
    except Exception as e:  # msgpack raises many types (FormatError, StackError, ValueError, ...)
        raise BoundsError(f"bad msgpack: {type(e).__name__}: {e}") from None
    raise BoundsError("incomplete msgpack value")


def unpack(data: bytes, limits: Limits) -> Any:
    """``unpack_steps`` without yielding (for bodies a caller decodes at once: a datagram's)."""
    size = _check_size(data, limits)
    if size <= STEP:
        return _whole(data, limits, size)
    steps = unpack_steps(data, limits)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def unpack_async(data: bytes, limits: Limits) -> Any:
    """``unpack_steps`` with the event loop running between the slices."""
    steps = unpack_steps(data, limits)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)
