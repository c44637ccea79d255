"""A grpc.aio server on loopback, in a thread with its own event loop, for the dialect fakes of
tests/contract (``fake_trtllm``, ``fake_mlx``): the node under test is a real process talking to it over
real gRPC; the test reads and steers the fake's servicer (same process) between requests.

Also the reply tokens the fakes play: the node's embedded Qwen3 tokenizer (the node serves it by default),
so what a fake sends decodes to the text the test expects.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable

import grpc.aio

from shepherd.node.config import EMBEDDED_MODEL_DIR
from shepherd.tokens.tokenizer import Tokenizer


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.load(EMBEDDED_MODEL_DIR)


def reply_ids(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def eos_id() -> int:
    ids = tokenizer().eos_token_ids
    return int(ids[0])


class ServerThread:
    """``add(server)`` registers the servicers; ``start`` binds 127.0.0.1 on ``port`` (0: a free one; the
    port is returned) and serves until ``stop``."""

    def __init__(self, add: Callable[[grpc.aio.Server], None], port: int = 0) -> None:
        self._add = add
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-grpc")
        self._server: grpc.aio.Server | None = None
        self.port = 0

    def start(self) -> int:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self.port

    async def _start(self) -> int:
        server = grpc.aio.server()
        self._add(server)
        port = server.add_insecure_port(f"127.0.0.1:{self._port}")
        await server.start()
        self._server = server
        return port

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(timeout=30)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
