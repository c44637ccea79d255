"""gRPC statuses as the gateway treats them: what is retried on another worker, what is the request's
own fault, what tells the client to come back later."""

from __future__ import annotations

import pytest

from shepherd.node.engines.errors import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    UNKNOWN,
    engine_error,
)


@pytest.mark.parametrize("code", [UNAVAILABLE, RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN, 10, 15])
def test_server_errors_are_worth_another_worker(code: int) -> None:
    assert engine_error(code, "boom").retryable


@pytest.mark.parametrize("code", [INVALID_ARGUMENT, DEADLINE_EXCEEDED, 5, 7, 9, 11, 16])
def test_the_requests_own_faults_and_its_deadline_are_not(code: int) -> None:
    assert not engine_error(code, "boom").retryable


def test_an_overloaded_engine_and_an_oversized_request_differ() -> None:
    busy = engine_error(RESOURCE_EXHAUSTED, "the scheduler's queue is full")
    assert (busy.code, busy.retryable) == ("engine_overloaded", True)
    big = engine_error(RESOURCE_EXHAUSTED, "Received message larger than max (9000000 vs. 4194304)")
    assert (big.code, big.retryable) == ("invalid_request", False)
