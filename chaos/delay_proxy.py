"""A userspace TCP delay proxy: latency for one path, since this kernel has no ``tc netem``.

Every chunk read on either side is written to the other side ``delay_ms`` (+ uniform jitter) after it
arrived, in order: a link with that one-way latency and unbounded bandwidth. The delay can be changed
while running through a control port (one line ``<delay_ms> [<jitter_ms>]``, answered
``ok <delay_ms> <jitter_ms>``).

    python -m chaos.delay_proxy --listen 10.213.0.11:31000 --target 127.0.0.1:30000 --delay-ms 100 \
        --control 127.0.0.1:31001

prints ``delay proxy ready listen=H:P control=H:P`` once serving; exits on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK = 65536
MAX_QUEUED = 256  # chunks in flight per direction before the reader waits (bounded memory)


@dataclass
class DelaySettings:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def next_deadline(self, now: float, previous: float, rng: random.Random) -> float:
        """When a chunk read at ``now`` may be written: never before the previous one (order is kept)."""
        extra = rng.uniform(0.0, self.jitter_ms) if self.jitter_ms > 0 else 0.0
        return max(previous, now + (self.delay_ms + extra) / 1000.0)


def parse_control(line: str) -> tuple[float, float]:
    """``"<delay_ms> [<jitter_ms>]"`` -> (delay_ms, jitter_ms); ValueError on anything else."""
    parts = line.split()
    if not 1 <= len(parts) <= 2:
        raise ValueError("expected '<delay_ms> [<jitter_ms>]'")
    delay = float(parts[0])
    jitter = float(parts[1]) if len(parts) == 2 else 0.0
    if delay < 0 or jitter < 0 or delay > 60_000 or jitter > 60_000:
        raise ValueError("delay and jitter must be in [0, 60000] ms")
    return delay, jitter


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {addr!r}")
    return host, int(port)


class DelayProxy:
    def __init__(
        self, listen: tuple[str, int], target: tuple[str, int], settings: DelaySettings, seed: int = 0
    ):
        self.listen = listen
        self.target = target
        self.settings = settings
        self.rng = random.Random(seed)
        self.connections = 0
        self.bytes = 0
        self.listen_port = 0  # bound ports, once serving
        self.control_port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED)

        async def read_side() -> None:
            last = 0.0
            try:
                while True:
                    data = await reader.read(CHUNK)
                    last = self.settings.next_deadline(time.monotonic(), last, self.rng)
                    await queue.put((last, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                await queue.put((last, b""))

        async def write_side() -> None:
            while True:
                deadline, data = await queue.get()
                wait = deadline - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()

        reading = asyncio.create_task(read_side())
        try:
            await write_side()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), timeout=5.0)
        except (OSError, TimeoutError):
            c_writer.close()
            return
        try:
            await asyncio.gather(self._pump(c_reader, s_writer), self._pump(s_reader, c_writer))
        finally:
            for w in (c_writer, s_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    def _spawn(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._handle(c_reader, c_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), timeout=5.0)).decode(errors="replace")
            try:
                self.settings.delay_ms, self.settings.jitter_ms = parse_control(line)
                writer.write(f"ok {self.settings.delay_ms:g} {self.settings.jitter_ms:g}\n".encode())
            except ValueError as e:
                writer.write(f"error {e}\n".encode())
            await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def serve(self, control: tuple[str, int] | None, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self._spawn, *self.listen, reuse_address=True)
        ctl = await asyncio.start_server(self._control, *control, reuse_address=True) if control else None
        self.listen_port = int(server.sockets[0].getsockname()[1])
        self.control_port = int(ctl.sockets[0].getsockname()[1]) if ctl is not None else 0
        ctl_text = f"{control[0]}:{self.control_port}" if control else "-"
        print(f"delay proxy ready listen={self.listen[0]}:{self.listen_port} control={ctl_text}", flush=True)
        try:
            await stop.wait()
        finally:
            server.close()
            if ctl is not None:
                ctl.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


def set_delay(control: tuple[str, int], delay_ms: float, jitter_ms: float = 0.0, timeout: float = 5.0) -> str:
    """Change a running proxy's delay through its control port (blocking; call from the right namespace)."""
    import socket

    with socket.create_connection(control, timeout=timeout) as s:
        s.sendall(f"{delay_ms} {jitter_ms}\n".encode())
        reply = s.makefile().readline().strip()
    if not reply.startswith("ok"):
        raise RuntimeError(f"delay proxy refused: {reply}")
    return reply


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chaos.delay_proxy", description=__doc__.split("\n")[0])
    p.add_argument("--listen", type=_split, required=True, help="HOST:PORT to accept on")
    p.add_argument("--target", type=_split, required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--control", type=_split, default=None, help="HOST:PORT of the control port")
    args = p.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        proxy = DelayProxy(args.listen, args.target, DelaySettings(args.delay_ms, args.jitter_ms))
        await proxy.serve(args.control, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
