"""Engines' KV events into the node's prefix index: one background subscription per gRPC worker.

The routing decisions of ``cache_aware`` feed the index with what the node *expects* an engine to
cache; SubscribeKvEvents tells what it *did* cache and evict. For every gRPC worker of a model whose
policy keeps a prefix index, a task consumes the worker's stream and applies "stored", "removed" and
"all cleared" events (``policies.kv_events.KvEventApplier``), takes the engine's capacity (GetServerInfo
or the load telemetry on the stream) as the worker's capacity in the index, and hands every load record
on the stream to ``on_load`` (fresher than a GetLoads poll).

Sequence numbers (``KvCursor``, pure): a batch past the next expected one is a gap; the task
subscribes again from the first missing batch, and the engine replays what it still holds. If the
replay does not reach back (or the numbers went backwards: the engine restarted), what the index
holds for the worker is unknown: its entries are cleared and the stream is taken from there.
A stream that fails or ends is subscribed again after an exponential, jittered, bounded back-off.
The task stops when the worker is removed (``stop``), which also clears the worker's entries.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from shepherd.node.engines.backoff import Backoff
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.kv_events import KvEventApplier
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex
from shepherd.proto.engine_types import (
    EngineError,
    EngineLoad,
    KvBlocksRemoved,
    KvBlocksStored,
    KvEventBatch,
    ServerInfo,
)

log = logging.getLogger("shepherd.kv_feed")


def merge_load(old: EngineLoad, new: EngineLoad) -> EngineLoad:
    """A pushed load record over the last known load: telemetry absent from the record is kept."""
    if new.max_total_tokens:
        return new
    return replace(
        new,
        used_tokens=old.used_tokens,
        max_total_tokens=old.max_total_tokens,
        cache_hit_rate=old.cache_hit_rate,
    )


# ---- sequence numbers (pure) -----------------------------------------------------------------------

Verdict = Literal["apply", "skip", "resubscribe", "reset"]


@dataclass(slots=True)
class KvCursor:
    """Where one worker's event stream is. ``opened(start)`` for each subscription, then ``on_batch``
    for each event batch (not for load-only records):

    - "apply": the next batch (or the first ever, or an unnumbered one);
    - "skip": a batch already applied (a replay overlapping what was seen);
    - "resubscribe": a gap in a live stream: subscribe again from ``resume_from()``;
    - "reset": the worker's state is unknown (the engine could not replay the gap, or its numbers went
      backwards: it restarted): clear what the index holds for it, then apply the batch.
    """

    last: int = 0  # sequence of the last batch applied (0: none yet)
    asked: int = 0  # the start of the current subscription
    fresh: bool = True  # no event batch seen on the current subscription
    gaps: int = 0
    resets: int = 0

    def resume_from(self) -> int:
        """The start for the next subscription: the first batch not applied (1: all the engine holds)."""
        return self.last + 1

    def opened(self, start: int) -> None:
        self.asked = start
        self.fresh = True

    def on_batch(self, seq: int) -> Verdict:
        fresh, self.fresh = self.fresh, False
        last = self.last
        if seq == 0:  # unnumbered: nothing to order it by
            return "apply"
        if last == 0 or seq == last + 1:
            self.last = seq
            return "apply"
        if seq <= last:
            if not fresh:
                return "skip"
            self.resets += 1  # numbers went backwards on a new subscription: another engine life
            self.last = seq
            return "reset"
        # seq > last + 1
        if fresh and self.asked == last + 1:  # asked for the gap, the engine no longer has it
            self.resets += 1
            self.last = seq
            return "reset"
        self.gaps += 1
        self.fresh = True  # the batch is not taken: the next subscription starts here
        return "resubscribe"


# ---- applying a batch ------------------------------------------------------------------------------


@dataclass(slots=True)
class FeedStats:
    subscriptions: int = 0
    records: int = 0  # messages received (event batches and load records)
    batches: int = 0  # event batches applied
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unknown_parent: int = 0  # stored events whose parent block the feed never saw (not applied)
    failures: int = 0
    capacity_blocks: int = 0  # as set from the engine's report (0: the index's configured capacity)


class WorkerKvState:
    """What the feed keeps for one worker: the applier (engine hashes -> index names) and the cursor.
    ``apply`` is synchronous and does no I/O."""

    def __init__(self, index: PrefixIndex, worker: str, clock: Callable[[], float] = time.time) -> None:
        self.index = index
        self.worker = worker
        self.clock = clock
        self.cursor = KvCursor()
        self.stats = FeedStats()
        self._applier: KvEventApplier | None = None
        self.unsupported_block_size = 0

    def set_capacity_tokens(self, max_total_tokens: int) -> None:
        blocks = max_total_tokens // BLOCK_TOKENS
        if blocks > 0 and blocks != self.stats.capacity_blocks:
            self.stats.capacity_blocks = blocks
            self.index.set_capacity(self.worker, blocks)

    def _applier_for(self, block_size: int) -> KvEventApplier | None:
        a = self._applier
        if a is not None and a.per_block * BLOCK_TOKENS == block_size:
            return a
        if block_size <= 0 or block_size % BLOCK_TOKENS:
            if self.unsupported_block_size != block_size:
                log.warning(
                    "worker %s: KV blocks of %d tokens (not a multiple of %d): stored events not applied",
                    self.worker,
                    block_size,
                    BLOCK_TOKENS,
                )
            self.unsupported_block_size = block_size
            return None
        self._applier = KvEventApplier(self.index, self.worker, block_size)
        return self._applier

    def clear(self) -> None:
        self.stats.cleared += 1
        if self._applier is not None:
            self._applier.cleared()
        else:
            self.index.clear_worker(self.worker)

    def apply(self, batch: KvEventBatch) -> Verdict | None:
        """Apply one batch; returns the cursor's verdict (None for a load-only record)."""
        if batch.load is not None and batch.load.max_total_tokens:
            self.set_capacity_tokens(batch.load.max_total_tokens)
        if batch.load_only:
            return None
        verdict = self.cursor.on_batch(batch.sequence_number)
        if verdict in ("skip", "resubscribe"):
            return verdict
        if verdict == "reset":
            self.clear()
        st = self.stats
        st.batches += 1
        now = self.clock()
        for ev in batch.events:
            st.events += 1
            if isinstance(ev, KvBlocksStored):
                a = self._applier_for(ev.block_size)
                if a is None:
                    continue
                if a.stored(ev.block_hashes, ev.parent_hash, ev.token_ids, now):
                    st.stored_blocks += len(ev.block_hashes)
                else:
                    st.unknown_parent += 1
            elif isinstance(ev, KvBlocksRemoved):
                st.removed_blocks += len(ev.block_hashes)
                if self._applier is not None:
                    self._applier.removed(ev.block_hashes)
            else:
                self.clear()
        return verdict


# ---- the I/O shell ---------------------------------------------------------------------------------


class KvSource(Protocol):
    """What the feed needs of an engine client."""

    def subscribe_kv_events(self, start_seq: int = 0) -> AsyncIterator[KvEventBatch]: ...

    async def server_info(self) -> ServerInfo: ...


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    initial_s: float = 0.2
    max_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each delay is scaled by a factor in [1 - jitter, 1 + jitter]


class KvFeed:
    """The subscriptions of one node, one task per worker."""

    def __init__(
        self,
        *,
        backoff: BackoffConfig | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.backoff = backoff or BackoffConfig()
        self.clock = clock
        self.sleep = sleep
        self.rand = rand
        self.states: dict[str, WorkerKvState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def running(self, worker: str) -> bool:
        t = self._tasks.get(worker)
        return t is not None and not t.done()

    def start(
        self,
        worker: str,
        source: KvSource,
        index: PrefixIndex,
        on_load: Callable[[EngineLoad], None] | None = None,
    ) -> WorkerKvState:
        """Start feeding ``index`` from ``source`` for ``worker`` (a no-op if it is fed already)."""
        state = self.states.get(worker)
        if state is not None and self.running(worker):
            return state
        state = self.states[worker] = WorkerKvState(index, worker, self.clock)
        task = asyncio.get_running_loop().create_task(self._run(state, source, on_load))
        self._tasks[worker] = task
        return state

    def stop(self, worker: str, *, clear: bool = True) -> None:
        """Stop feeding ``worker``; with ``clear`` its entries leave the index (it was removed)."""
        task = self._tasks.pop(worker, None)
        state = self.states.pop(worker, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        if clear and state is not None:
            state.clear()

    async def close(self) -> None:
        for wid in list(self._tasks):
            self.stop(wid, clear=False)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    async def _capacity(self, state: WorkerKvState, source: KvSource) -> bool:
        """The engine's KV capacity (GetServerInfo) as the worker's in the index; False if not reached."""
        try:
            info = await source.server_info()
        except (EngineError, OSError, TimeoutError):
            return False
        if info.max_total_num_tokens:
            state.set_capacity_tokens(info.max_total_num_tokens)
        return True  # an engine that does not say (vLLM) may still tell through the load telemetry

    async def _run(
        self, state: WorkerKvState, source: KvSource, on_load: Callable[[EngineLoad], None] | None
    ) -> None:
        c = self.backoff
        backoff = Backoff(c.initial_s, c.max_s, c.multiplier, c.jitter, self.rand)
        asked_capacity = False
        while True:  # until cancelled by stop()
            start = state.cursor.resume_from()
            state.cursor.opened(start)
            state.stats.subscriptions += 1
            why = "ended"
            try:
                if not asked_capacity:
                    asked_capacity = await self._capacity(state, source)
                stream = source.subscribe_kv_events(start)
                try:
                    async for batch in stream:
                        state.stats.records += 1
                        if not batch.load_only:  # events flow: a later failure starts the back-off afresh
                            backoff.succeeded()
                        if batch.load is not None and on_load is not None:
                            on_load(batch.load)
                        if state.apply(batch) == "resubscribe":
                            why = "gap"
                            break
                finally:
                    aclose = getattr(stream, "aclose", None)
                    if aclose is not None:
                        await aclose()  # cancels the call now, not when the generator is collected
            except EngineError as e:
                if "UNIMPLEMENTED" in str(e):
                    log.info("worker %s does not serve SubscribeKvEvents: no KV feed", state.worker)
                    return
                why = str(e)
            except (OSError, TimeoutError) as e:
                why = str(e) or type(e).__name__
            except Exception as e:  # a bug or a malformed message: keep the feed alive, loudly
                log.warning("worker %s: KV event stream failed: %r", state.worker, e)
                why = repr(e)
            if why == "gap":
                log.debug(
                    "worker %s: KV event gap after %d, subscribing again", state.worker, state.cursor.last
                )
                continue
            state.stats.failures += 1
            delay = backoff.failed(0.0)  # the delay: pure, no clock here
            log.debug("worker %s: KV event stream %s; again in %.2fs", state.worker, why, delay)
            await self.sleep(delay)


def feed_index_of(policy: object, model: str) -> PrefixIndex | None:
    """The prefix index the model's policy routes with, if it keeps one."""
    if isinstance(policy, CacheAware):
        return policy.index(model)
    return None
