"""``proto.msgpack_bounds``: a body up to STEP bytes decodes in one ``unpackb`` call, a larger one in
slices; both paths give the same value, and refuse the same things with ``BoundsError`` (too many
containers, trailing bytes, an incomplete or malformed value, extension types)."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.proto.msgpack_bounds import STEP, BoundsError, Limits, unpack, unpack_steps

LIMITS = Limits(
    max_bytes=1 << 24,
    max_str_len=1 << 24,
    max_bin_len=1 << 24,
    max_array_len=1 << 24,
    max_map_len=1 << 24,
    bytes_per_container=2,
)


def _stepped(data: bytes) -> object:
    steps = unpack_steps(data, LIMITS)
    n = 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as done:
            assert n <= len(data) // STEP
            return done.value


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(values)
def test_both_paths_give_the_value(v: object) -> None:
    data = msgpack.packb(v, use_bin_type=True)
    assert unpack(data, LIMITS) == _stepped(data) == msgpack.unpackb(data, raw=False)


@pytest.mark.parametrize("size", [STEP // 2, STEP * 3])
def test_what_is_refused_small_or_sliced(size: int) -> None:
    empties = msgpack.packb([[]] * (size - 8))  # one container a byte: past one per 2 bytes
    trailing = msgpack.packb(["x" * (size - 16)]) + b"\x01"
    truncated = msgpack.packb(["x" * (size - 16)])[:-1]
    ext = msgpack.packb([msgpack.ExtType(1, b"x" * (size - 16))])
    for data, why in (
        (empties, "arrays and maps"),
        (trailing, "trailing"),
        (truncated, "incomplete"),
        (ext, "bad"),
    ):
        with pytest.raises(BoundsError, match=why):
            unpack(data, LIMITS)
        with pytest.raises(BoundsError, match=why):
            _stepped(data)
    with pytest.raises(BoundsError, match="incomplete"):
        unpack(b"", LIMITS)
    with pytest.raises(BoundsError, match="bytes >"):
        unpack(b"\x00" * 10, Limits(9, 9, 9, 9, 9))
