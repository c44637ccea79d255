"""The parsers' contract (shepherd/node/openai/requests.py): a typed request or an ``ApiError`` 4xx whose
envelope serialises; anything else raised is a bug (a 500)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import orjson

from shepherd.proto.openai_errors import ApiError

ENVELOPE_KEYS = {"message", "type", "param", "code"}
T = TypeVar("T")


def check_error(e: ApiError) -> None:
    assert 400 <= e.status < 500, f"{e.status} for client input: {e.message}"
    env = orjson.loads(e.body())  # the answer's body must serialise (a lone surrogate would not)
    err = env["error"]
    assert set(err) == ENVELOPE_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


def accepts(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when it refuses the input the way the contract allows (an ``ApiError`` 4xx)."""
    try:
        return fn()
    except ApiError as e:
        check_error(e)
        return None
