"""``LazyReads``: an HTTP/2 connection the event loop does not watch, read on ``poll()`` only."""

from __future__ import annotations

import asyncio
import socket

from shepherd.node.engines.h2_protocol import H2Protocol, LazyReads

SETTINGS_EMPTY = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # a SETTINGS frame with no parameters


async def _server(received: list[bytes], reply: bytes, close_after: bool) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        received.append(await r.read(24))  # the client preface
        w.write(reply)
        await w.drain()
        if close_after:
            w.close()
        else:
            await r.read()  # until the client goes

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_bytes_wait_for_a_poll_and_eof_is_seen_on_the_next() -> None:
    received: list[bytes] = []
    server = await _server(received, SETTINGS_EMPTY, close_after=True)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    lazy = LazyReads()
    try:
        proto = await lazy.connect(lambda: H2Protocol(loop), "127.0.0.1", port, None)
        assert len(lazy) == 1
        for _ in range(100):  # bounded: the server has the preface (written at once, not on a poll)
            if received:
                break
            await asyncio.sleep(0.01)
        assert received and received[0].startswith(b"PRI * HTTP/2.0")
        await asyncio.sleep(0.2)  # the server's SETTINGS and its EOF are in: not read without a poll
        assert not proto.ready.done() and not proto.closed.done() and lazy.reads == 0
        lazy.poll()
        assert proto.ready.done() and proto.ready.exception() is None  # SETTINGS read on the poll
        # a short read ends the poll (the socket had no more then: no recv that finds nothing)
        assert not proto.closed.done() and lazy.reads == 1
        lazy.poll()
        assert proto.closed.done()  # the EOF, on the next poll: the connection is lost, forgotten
        assert len(lazy) == 0 and lazy.reads == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_a_poll_reads_on_while_reads_come_back_full() -> None:
    """More than one read's worth waiting (a SETTINGS frame, then 300 KB of PINGs with ACK set, which the
    client ignores): one poll reads it all, since only a short read ends it."""
    ping_ack = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + bytes(8)
    received: list[bytes] = []
    server = await _server(received, SETTINGS_EMPTY + ping_ack * (300_000 // len(ping_ack)), False)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    lazy = LazyReads()
    try:
        proto = await lazy.connect(lambda: H2Protocol(loop), "127.0.0.1", port, None)
        assert proto.transport is not None
        sock = proto.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # room for more than one read
        queued = 0
        for _ in range(100):  # bounded: until more than a read's worth is in the socket's buffer
            await asyncio.sleep(0.02)
            queued = len(sock.recv(400_000, socket.MSG_PEEK))
            if queued > 262_144:
                break
        assert queued > 262_144, f"only {queued} bytes queued: the test needs more than one read's worth"
        lazy.poll()
        assert proto.ready.done() and lazy.reads >= 2  # a full read, then on to the short one
        assert not proto.closed.done()
        proto.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_close_forgets_the_connection_and_tells_the_protocol() -> None:
    received: list[bytes] = []
    server = await _server(received, SETTINGS_EMPTY, close_after=False)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    lazy = LazyReads()
    try:
        proto = await lazy.connect(lambda: H2Protocol(loop), "127.0.0.1", port, None)
        lazy.poll()
        for _ in range(100):  # bounded: poll until the SETTINGS came
            if proto.ready.done():
                break
            await asyncio.sleep(0.01)
            lazy.poll()
        assert proto.ready.done()
        proto.close()
        assert len(lazy) == 0
        await asyncio.wait_for(proto.closed, 2.0)
        lazy.poll()  # nothing left to read: a no-op
        assert lazy.polls >= 1
    finally:
        server.close()
        await server.wait_closed()


def test_a_routing_decision_reads_the_lazy_streams_when_their_last_read_is_stale() -> None:
    """``KvFeed.poll_fresh`` (called before each routing decision): a poll when the last is over
    ``FRESH_POLL_S`` old, none when it is fresh, nothing at all without lazy reads."""
    import time  # (not at the top: this test alone)

    from shepherd.node.dispatch.kv_feed import FRESH_POLL_S, KvFeed

    class Counting(LazyReads):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def poll(self) -> None:
            self.calls += 1

    feed = KvFeed()
    feed.poll_fresh()  # no lazy reads: nothing to do (and no error)
    lazy = Counting()
    feed.lazy_reads = lazy
    feed.poll_fresh()
    assert lazy.calls == 1  # never polled: stale
    feed.poll_fresh()
    assert lazy.calls == 1  # just polled: fresh
    deadline = time.monotonic() + FRESH_POLL_S * 1.5
    while time.monotonic() < deadline:  # bounded: a short wait past the freshness bound
        time.sleep(0.01)
    feed.poll_fresh()
    assert lazy.calls == 2
    feed.poll()  # the mesh's periodic poll counts as a read too
    feed.poll_fresh()
    assert lazy.calls == 3
