"""Engines' KV events into the node's prefix index: one background subscription per gRPC worker.

The routing decisions of ``cache_aware`` feed the index with what the node *expects* an engine to
cache; SubscribeKvEvents tells what it *did* cache and evict. For every gRPC worker of a model whose
policy keeps a prefix index, a task subscribes to the worker's stream and applies "stored", "removed"
and "all cleared" events (``policies.kv_events.KvEventApplier``; from the connection's frame loop as
each record is read with the lean H2 client, through the stream's iterator with the others), takes the
engine's capacity (GetServerInfo or the load telemetry on the stream) as the worker's capacity in the
index, and hands every load record on the stream to ``on_load`` (fresher than a GetLoads poll).

Sequence numbers (``KvCursor``, pure): a batch past the next expected one is a gap; the task
subscribes again from the first missing batch (``start_sequence_number``), and an engine that keeps
a history replays it. When the answer does not reach back (SGLang's servicers stream live events only
and ignore the start), the events in the gap are lost but what the index holds is still the engine's
own account: the batch is applied as it is, nothing is cleared, and later gaps on that worker are
taken in stride (no more subscribing again for a replay it does not do). Only numbers going backwards
(the engine restarted: its cache is empty) clear the worker's entries.

Engine pages of any size: 16·m tokens map onto m index blocks (``KvEventApplier``; ``NativeKvApplier``
for a native index fed by a client that keeps the events as bytes, ``kv_codec.WireEvents``: a batch is
then applied in C in one call, the events it hands back in Python); smaller pages
(SGLang's default page size is 1) are gathered into 16-token blocks (``SmallPageApplier``).
A stream that fails or ends is subscribed again after an exponential, jittered, bounded back-off.
The task stops when the worker is removed (``stop``), which also clears the worker's entries.

Lazy reads (``KvFeed.read_lazily``, called by the mesh: ``MeshNode``): each lean-HTTP/2 worker's stream
goes over a cleartext connection of its own (``h2_protocol.LazyReads``) that is read when ``poll()`` is
called (on the mesh runtime's wake-ups, every 0.5 s at the latest), so an engine's batches and load
records wait up to that long and the node does not wake for each one; the generation streams keep the
client's connection, read as bytes arrive.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Literal, Protocol

from shepherd.node.engines.backoff import Backoff
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_protocol import LazyReads
from shepherd.policies.cache_aware import CacheAware
from shepherd.policies.kv_events import KvEventApplier, NativeKvApplier, native_kv_ok
from shepherd.policies.prefix_index import BLOCK_TOKENS, PrefixIndex
from shepherd.proto.engine_types import (
    EngineError,
    EngineLoad,
    KvBlocksRemoved,
    KvBlocksStored,
    KvCacheEvent,
    KvEventBatch,
    ServerInfo,
)
from shepherd.proto.kv_codec import WireEvents, decode_kv_event_bytes, kv_event_ranges

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

Verdict = Literal["apply", "skip", "resubscribe", "gap", "reset"]


@dataclass(slots=True)
class KvCursor:
    """Where one worker's event stream is. ``opened(start)`` for each subscription, then ``on_batch``
    for each event batch (not for load-only records):

    - "apply": the next batch (or the first ever, or an unnumbered one);
    - "skip": a batch already applied (a replay overlapping what was seen);
    - "resubscribe": a gap in a live stream: subscribe again from ``resume_from()`` (once: an engine
      that did not replay is not asked again);
    - "gap": batches were lost (the engine did not replay them): apply the batch, clear nothing;
    - "reset": the numbers went backwards on a new subscription (the engine restarted): clear what the
      index holds for the worker, then apply the batch.
    """

    last: int = 0  # sequence of the last batch applied (0: none yet)
    asked: int = 0  # the start of the current subscription
    fresh: bool = True  # no event batch seen on the current subscription
    replays: bool = True  # False once the engine answered a start it was asked for with later batches
    gaps: int = 0
    lost: int = 0  # gaps the engine did not replay
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
        if fresh and self.asked == last + 1:  # asked for the gap, the engine did not replay it
            self.replays = False
            self.lost += 1
            self.last = seq
            return "gap"
        self.gaps += 1
        if not self.replays:  # it never replays (SGLang): asking again would lose more
            self.lost += 1
            self.last = seq
            return "gap"
        self.fresh = True  # the batch is not taken: the next subscription starts here
        return "resubscribe"


# ---- applying a batch ------------------------------------------------------------------------------


class SmallPageApplier:
    """Stored and removed events of an engine whose pages are smaller than the index's 16-token blocks
    (a divisor of 16: SGLang's default page size is 1, and its servicers send one event per page).

    The pages of a chain are gathered into 16-token blocks: each engine page is remembered with the
    index's name of the last whole block at or before its end and the tokens since then (fewer than
    16); a page that completes a block stores it in the index, chained to the block before. A page
    removed that completed a block removes that block (the engine evicts from the leaves: the block is
    no longer whole). The map is bounded as ``KvEventApplier``'s (oldest entries go first)."""

    def __init__(self, index: PrefixIndex, worker: str, block_size: int, max_pages: int = 1 << 20) -> None:
        if block_size <= 0 or BLOCK_TOKENS % block_size:
            raise ValueError(f"engine page size {block_size} does not divide {BLOCK_TOKENS}")
        self.index = index
        self.worker = worker
        self.block_size = block_size
        self.max_pages = max(1, max_pages)
        # engine page hash -> (index name of the last whole block up to it or None, tokens after it,
        # whether this page completed that block)
        self._pages: dict[int, tuple[int | None, tuple[int, ...], bool]] = {}

    def stored(
        self, engine_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], now: float
    ) -> bool:
        if parent is None:
            seed: int | None = None
            pending: tuple[int, ...] = ()
        else:
            at = self._pages.get(parent)
            if at is None:
                return False
            seed, pending, _ = at
        run = pending + tuple(token_ids)
        whole = len(run) // BLOCK_TOKENS * BLOCK_TOKENS
        names = self.index.store_token_blocks(self.worker, run[:whole], now, parent=seed) if whole else []
        p = self.block_size
        base = len(pending)
        pages = self._pages
        for j, eh in enumerate(engine_hashes):
            end = base + (j + 1) * p
            if end > len(run):
                break  # an event with fewer tokens than its pages: only its whole pages
            full = end // BLOCK_TOKENS
            if full > len(names):  # the index stored fewer blocks than asked: nothing more to name
                break
            name = names[full - 1] if full else seed
            pages[eh] = (name, run[full * BLOCK_TOKENS : end], full > 0 and end % BLOCK_TOKENS == 0)
        over = len(pages) - self.max_pages
        if over > 0:
            for eh in list(islice(pages, over + self.max_pages // 16)):  # bounded by the map
                del pages[eh]
        return True

    def removed(self, engine_hashes: Sequence[int]) -> None:
        pop = self._pages.pop
        gone: list[int] = []
        for eh in engine_hashes:
            at = pop(eh, None)
            if at is not None and at[2] and at[0] is not None:
                gone.append(at[0])
        if gone:
            self.index.remove_blocks(gone, self.worker)

    def cleared(self) -> None:
        self._pages.clear()
        self.index.clear_worker(self.worker)

    def __len__(self) -> int:
        return len(self._pages)


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

    def __init__(
        self,
        index: PrefixIndex,
        worker: str,
        clock: Callable[[], float] = time.time,
        max_blocks: int = 1 << 18,
    ) -> None:
        self.index = index
        self.worker = worker
        self.clock = clock
        self.max_blocks = max_blocks  # engine blocks the applier maps at most (16·m-token pages)
        self.cursor = KvCursor()
        self.stats = FeedStats()
        self.streaming = False  # the current subscription delivered a record (the engine talks to us)
        self._applier: KvEventApplier | NativeKvApplier | SmallPageApplier | None = None
        self.unsupported_block_size = 0

    def set_capacity_tokens(self, max_total_tokens: int) -> None:
        blocks = max_total_tokens // BLOCK_TOKENS
        if blocks > 0 and blocks != self.stats.capacity_blocks:
            self.stats.capacity_blocks = blocks
            self.index.set_capacity(self.worker, blocks)

    def _applier_for(
        self, block_size: int, wire: bool = False
    ) -> KvEventApplier | NativeKvApplier | SmallPageApplier | None:
        a = self._applier
        if a is not None:
            size = a.block_size if isinstance(a, SmallPageApplier) else a.per_block * BLOCK_TOKENS
            if size == block_size:
                return a
        if block_size > 0 and block_size % BLOCK_TOKENS == 0:
            index = self.index
            if wire and native_kv_ok(index):  # events as bytes, a native index: the map in C
                self._applier = NativeKvApplier(index, self.worker, block_size, self.max_blocks)
            else:
                self._applier = KvEventApplier(index, self.worker, block_size, self.max_blocks)
        elif block_size > 0 and BLOCK_TOKENS % block_size == 0:
            self._applier = SmallPageApplier(self.index, self.worker, block_size)
        else:
            if self.unsupported_block_size != block_size:
                log.warning(
                    "worker %s: KV pages of %d tokens (neither a multiple nor a divisor of %d): stored "
                    "events not applied",
                    self.worker,
                    block_size,
                    BLOCK_TOKENS,
                )
            self.unsupported_block_size = block_size
            return None
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
        self.stats.batches += 1
        now = self.clock()
        events = batch.events
        if isinstance(events, WireEvents):
            self._apply_wire(events, now)
        else:
            for ev in events:
                self._apply_event(ev, now, False)
        return verdict

    def _apply_event(self, ev: KvCacheEvent, now: float, wire: bool) -> None:
        st = self.stats
        st.events += 1
        if isinstance(ev, KvBlocksStored):
            a = self._applier_for(ev.block_size, wire)
            if a is None:
                return
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

    def _apply_wire(self, events: WireEvents, now: float) -> None:
        """A batch's events from its message's bytes: in C while the applier is native (one call up to
        an event it hands back, which goes through ``_apply_event``); decoded by protobuf otherwise."""
        if not isinstance(self._applier, NativeKvApplier):  # none yet (the first stored event makes it)
            for ev in events:
                self._apply_event(ev, now, True)
            return
        st = self.stats
        raw = events.raw
        start = 0
        while True:  # bounded: every turn moves ``start`` past at least one event of raw
            a: KvEventApplier | NativeKvApplier | SmallPageApplier | None = self._applier
            if not isinstance(a, NativeKvApplier):  # another page size since: the rest one by one
                for lo, hi in kv_event_ranges(raw, start):  # bounded by the events
                    one = decode_kv_event_bytes(raw[lo:hi])
                    if one is not None:
                        self._apply_event(one, now, True)
                return
            lo, hi, n, stored, removed, unknown = a.apply_wire(raw, start, now)
            st.events += n
            st.stored_blocks += stored
            st.removed_blocks += removed
            st.unknown_parent += unknown
            if lo < 0:
                return
            back = decode_kv_event_bytes(raw[lo:hi])  # handed back: Python's
            if back is not None:
                self._apply_event(back, now, True)
            start = hi


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


# a routing decision reads the lazily read KV-event streams first when their last poll is older than this
FRESH_POLL_S = 0.05
CLOSE_ROUNDS = 10  # close(): one-second waits for the stopped feeds' tasks, each followed by a re-cancel


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
        # set before workers start (the mesh does): their streams are read on poll(), not as they arrive
        self.lazy_reads: LazyReads | None = None
        self._polled = 0.0  # monotonic time of the last poll

    def read_lazily(self) -> None:
        """Workers started from now on stream over connections read on ``poll()`` (idempotent)."""
        if self.lazy_reads is None:
            self.lazy_reads = LazyReads()

    def poll(self) -> None:
        """Read what the lazily read streams received since the last poll and apply it (the records are
        pushed to the feed as they are read: in the index when this returns); a no-op without lazy reads."""
        if self.lazy_reads is not None:
            self._polled = time.monotonic()
            self.lazy_reads.poll()

    def poll_fresh(self) -> None:
        """Before a routing decision: read the lazily read streams if the last poll is over
        ``FRESH_POLL_S`` old, so a request that arrives on a quiet node is routed on the engines' KV
        events and loads of ~50 ms ago, not of up to the poll period (a read of a socket with nothing
        costs a failed ``recv``, no wake-up)."""
        if self.lazy_reads is not None and time.monotonic() - self._polled >= FRESH_POLL_S:
            self.poll()

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
        if self.lazy_reads is not None and isinstance(source, H2EngineClient) and source.kv_reads is None:
            source.kv_reads = self.lazy_reads
        task = asyncio.get_running_loop().create_task(self._run(state, source, on_load))
        self._tasks[worker] = task
        return state

    def live(self, worker: str) -> bool:
        """The worker's KV-event stream is open here and has delivered (what ``--mesh-index-replication
        auto`` takes as: every node learns what this engine caches from its own events)."""
        state = self.states.get(worker)
        return state is not None and state.streaming and self.running(worker)

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
        """Stop every feed and wait for their tasks, bounded: a task still running after a second is
        cancelled again (a cancellation can be lost on the way, as Python 3.11's ``asyncio.wait_for``
        loses one that lands as the call it waits for ends; ``_run`` also ends by itself at its next step
        once it is no longer the worker's feed), and after ``CLOSE_ROUNDS`` it is left, logged."""
        for wid in list(self._tasks):
            self.stop(wid, clear=False)
        for _ in range(CLOSE_ROUNDS):
            if not self._stopping:
                return
            _, pending = await asyncio.wait(set(self._stopping), timeout=1.0)
            for t in pending:
                t.cancel()
        if self._stopping:
            log.warning("KV feed: %d task(s) did not stop at close", len(self._stopping))

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
        me = asyncio.current_task()
        # until cancelled by stop(); and should the cancellation be lost (see close()), until a step
        # finds that this task is no longer the worker's feed
        while self._tasks.get(state.worker) is me:
            start = state.cursor.resume_from()
            state.cursor.opened(start)
            state.stats.subscriptions += 1
            why = "ended"

            def take(batch: KvEventBatch) -> bool:
                """One record; False: a gap in the numbers, subscribe again."""
                nonlocal why
                state.stats.records += 1
                state.streaming = True
                if not batch.load_only:  # events flow: a later failure starts the back-off afresh
                    backoff.succeeded()
                if batch.load is not None and on_load is not None:
                    on_load(batch.load)
                if state.apply(batch) == "resubscribe":
                    why = "gap"
                    return False
                return True

            try:
                if not asked_capacity:
                    asked_capacity = await self._capacity(state, source)
                if isinstance(source, H2EngineClient):
                    # each record taken as it is read, from the connection's frame loop (no task step)
                    await source.kv_events_pushed(start, take)
                else:
                    stream = source.subscribe_kv_events(start)
                    try:
                        async for batch in stream:
                            if not take(batch):
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
            finally:
                state.streaming = False
            if why == "gap":
                log.debug(
                    "worker %s: KV event gap after %d, subscribing again", state.worker, state.cursor.last
                )
                continue
            if self._tasks.get(state.worker) is not me:
                return  # stopped meanwhile (its cancellation lost): no back-off, no next attempt
            state.stats.failures += 1
            delay = backoff.failed(0.0)  # the delay: pure, no clock here
            log.debug("worker %s: KV event stream %s; again in %.2fs", state.worker, why, delay)
            await self.sleep(delay)


def feed_index_of(policy: object, model: str) -> PrefixIndex | None:
    """The prefix index the model's policy routes with, if it keeps one."""
    if isinstance(policy, CacheAware):
        return policy.index(model)
    return None
