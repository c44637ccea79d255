"""bucket: requests grouped by prompt length, each length bucket served by its own workers.

Workers (sorted by id) are split into as many contiguous groups as there are buckets; a request goes
to the least loaded worker of its bucket's group. With fewer workers than buckets, buckets share
workers (bucket b -> worker b * n // buckets). Short and long prompts thus stop sharing batches.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from shepherd.policies.base import RouteRequest, WorkerView, least_loaded


@dataclass(frozen=True, slots=True)
class BucketConfig:
    boundaries: tuple[int, ...] = (1024, 4096)  # prompt tokens: [0,1024) [1024,4096) [4096,...)

    def __post_init__(self) -> None:
        if list(self.boundaries) != sorted(set(self.boundaries)):
            raise ValueError("bucket boundaries must be strictly increasing")


class Bucket:
    name = "bucket"

    def __init__(self, config: BucketConfig | None = None) -> None:
        self.config = config or BucketConfig()

    def bucket_of(self, n_tokens: int) -> int:
        return bisect_right(self.config.boundaries, n_tokens)

    def pick(self, workers: Sequence[WorkerView], req: RouteRequest) -> WorkerView | None:
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.id)
        n, nb = len(ordered), len(self.config.boundaries) + 1
        b = self.bucket_of(len(req.input_ids))
        if n < nb:
            return ordered[b * n // nb]
        return least_loaded(ordered[b * n // nb : (b + 1) * n // nb])
