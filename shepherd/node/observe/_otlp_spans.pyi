from collections.abc import Callable, Sequence
from typing import Any

def request(
    spans: Sequence[Any],
    fallback: Callable[[Any], bytes],
    resource: bytes,
    scope: bytes | None,
    scope_schema: str,
    resource_schema: str,
    /,
) -> bytes: ...
