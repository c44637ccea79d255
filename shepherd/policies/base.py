"""What a routing policy sees and returns. Policies are pure: a snapshot in, a choice out, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A routable worker as policies see it."""

    id: str
    url: str
    in_flight: int = 0  # this node's own requests on the worker
    running: int = 0  # as the engine reports (GetLoads)
    waiting: int = 0
    token_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    input_ids: Sequence[int] = ()
    routing_key: str | None = None


class Policy(Protocol):
    name: str

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        """Choose one of ``workers`` (all routable, never empty when called) or None."""
        ...
