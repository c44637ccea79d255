"""The HTTP relay's SSE framing (``event_end``): where in a chunk the last complete event ends, blank
lines in any of SSE's line endings, split across chunks anywhere."""

from __future__ import annotations

import pytest

from shepherd.node.api.common import event_end

STREAMS = [
    b'data: {"a": "h\xc3\xa9"}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n',
    b'data: {"a": 1}\r\n\r\ndata: {"b": 2}\r\n\r\ndata: [DONE]\r\n\r\n',
    b'data: {"a": 1}\r\rdata: [DONE]\r\r',
    b": keep-alive\n\nevent: x\ndata: 1\ndata: 2\n\n",
]


def _events(stream: bytes, size: int) -> list[bytes]:
    """What the relay writes for ``stream`` arriving in chunks of ``size`` bytes (held tail last)."""
    out: list[bytes] = []
    held = recent = b""
    for i in range(0, len(stream), size):
        chunk = stream[i : i + size]
        end = event_end(recent, chunk)
        recent = (recent + chunk)[-2:]
        if end:
            out.append(held + chunk[:end])
            held = chunk[end:]
        else:
            held += chunk
    return [*out, held] if held else out


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_writes_end_on_event_boundaries_however_the_stream_is_cut(stream: bytes, size: int) -> None:
    writes = _events(stream, size)
    assert b"".join(writes) == stream
    for w in writes:
        assert w.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")), w


def test_no_boundary_in_the_chunk() -> None:
    assert event_end(b"", b"data: {") == 0
    assert event_end(b"\n", b"\n") == 1  # the blank line began in the chunk before
    assert event_end(b"\r\n\r", b"\ndata") == 1
    assert event_end(b"", b"data: 1\n\ndata: 2") == 9
