from collections.abc import Callable, Sequence
from typing import Any

class PlainStep:
    paused: bool
    taken: int
    def __init__(
        self,
        chunk_type: type,
        state: Any,
        state_text: list[str],
        detok: Any,
        ids: list[int],
        parts: list[str],
        drop: frozenset[int] | None,
        drop_extra: set[int] | frozenset[int] | None,
        stop_ids: frozenset[int],
        reasoning: Any,
        prefix: bytes,
        tail: bytes,
        observe: Callable[[float], object],
        clock: Callable[[], float],
        last: list[float],
        cached: list[int],
        got: list[int],
        last_ids: list[Sequence[int]],
        seen: list[bool],
        ka: Any,
        monotonic: Callable[[], float],
        send: Callable[[bytes], bool],
        pending: list[bytes],
        fallback: Callable[[list[Any]], bool],
        vocab: int,
        itl: object = None,
        limit: int = ...,
    ) -> None: ...
    def __call__(self, batch: list[Any], /) -> bool: ...
    def bind_listener(
        self,
        msgs: Any,
        stream: Any,
        fut: Any,
        lone_chunk: Callable[[bytes, bool], Any],
        vllm: bool,
        slow: Callable[[], None],
        stopped: Callable[[], None],
        failed: Callable[[Exception], None],
        /,
    ) -> Callable[[], None]: ...
    def ready(self) -> None: ...
