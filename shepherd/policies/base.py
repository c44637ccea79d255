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


def worker_load(w: WorkerView) -> int:
    """A worker's load in requests: what its engine reports (running + waiting, mesh-wide since the
    engine serves every node) or this node's own in-flight count if that is higher (the report is
    periodic, in-flight is current). Not the sum: the engine's count includes this node's requests."""
    engine = w.running + w.waiting
    return engine if engine >= w.in_flight else w.in_flight


def load_key(w: WorkerView) -> tuple[int, float, str]:
    """Sort key for "least loaded": load, then KV token usage, then id (deterministic ties)."""
    return (worker_load(w), w.token_usage, w.id)


def least_loaded(workers: Sequence[WorkerView]) -> WorkerView:
    return min(workers, key=load_key)


class Policy(Protocol):
    """A routing policy. A class attribute ``uses_loads = False`` says it never reads the engine-reported
    load (``running``, ``waiting``, ``token_usage``): the node then does not poll engines for it.
    ``text_affinity = True`` says it wants a request relayed to HTTP workers (not tokenized) keyed by
    its text: ``input_ids`` are then the text's pseudo token ids (``text_ids``); others get none."""

    name: str

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        """Choose one of ``workers`` (all routable, never empty when called) or None."""
        ...
