"""One call on the lean gRPC server (``lean_grpc``): ``Stream`` (an HTTP/2 stream's request, send
window, pending data and handler task), ``ServicerContext`` (the part of ``grpc.aio.ServicerContext``
the mock's servicers use) and ``Abort`` (what ``ServicerContext.abort`` raises to end the call).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

__all__ = ["Abort", "ServicerContext", "Stream"]


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ServicerContext:
    """The part of ``grpc.aio.ServicerContext`` the mock's servicers use."""

    __slots__ = ("_callbacks", "_code", "_details", "_done", "_stream", "cancelled_by_peer")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._callbacks: list[Callable[[Any], None]] | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._done = False
        self.cancelled_by_peer = False

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise Abort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def cancelled(self) -> bool:
        return self.cancelled_by_peer

    def done(self) -> bool:
        return self._done

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self._stream.headers)

    def finish(self) -> None:
        if not self._done:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            for cb in callbacks or ():
                cb(self)


class Stream:
    __slots__ = (
        "body",
        "ctx",
        "deadline",
        "drain",
        "expired",
        "headers",
        "headers_sent",
        "id",
        "id_bytes",
        "local_closed",
        "pending",
        "remote_closed",
        "send_window",
        "task",
        "trailers",
    )

    def __init__(self, stream_id: int, headers: list[tuple[bytes, bytes]], send_window: int) -> None:
        self.id = stream_id
        self.id_bytes = stream_id.to_bytes(4, "big")
        self.headers = headers
        self.body = bytearray()
        self.send_window = send_window
        self.pending: deque[bytes] = deque()  # DATA payload waiting for flow-control window
        self.trailers: bytes | None = None  # trailers waiting behind pending data
        self.headers_sent = False
        self.remote_closed = False
        self.local_closed = False
        self.task: asyncio.Task[None] | None = None
        self.drain: asyncio.Future[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.expired = False
        self.ctx: ServicerContext | None = None
