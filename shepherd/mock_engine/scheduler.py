"""The mock engine's scheduler: waiting/running queues, KV budget, prefill/decode timing, load figures.

A pure state machine: every method takes ``now`` (seconds, any monotonic origin) and returns what
changed; the I/O shell sleeps and streams. The unit of admission is a *group* (one request with its
``n`` samples); a group needs ``n`` running slots and the KV blocks of all its samples (prompt +
planned output, known up front because the mock decides the output when the request arrives).
Groups are admitted first come, first served; a group that does not fit blocks the queue behind it.

Timing model:
- prefill: one prefill lane (the engine runs one prefill batch at a time). A group's prefill starts
  when the lane is free and lasts ``prefill_base_s + uncached_tokens * prefill_s_per_token``, scaled
  by ``slow_factor``; its first token is produced when the prefill ends. Uncached tokens are the
  prompt tokens past the cached prefix (at least one token is always computed).
- decode: inter-token latency ``decode_s_per_token * slow_factor * (1 + decode_slowdown * running /
  max_running)``, i.e. up to ``1 + decode_slowdown`` times slower with a full batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shepherd.mock_engine.cache import Allocation, PrefixCache

WAITING = "waiting"
RUNNING = "running"
FINISHED = "finished"


class AdmissionError(ValueError):
    """The request can never run here (prompt over the context, more KV than the pool holds...)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 64
    context_length: int = 32_768
    prefill_base_s: float = 0.0
    prefill_s_per_token: float = 20e-6
    decode_s_per_token: float = 5e-3
    decode_slowdown: float = 0.5
    throughput_window_s: float = 10.0


@dataclass(eq=False, slots=True)
class SeqGroup:
    """One request in the scheduler. Identity-hashed; the shell may key its own state by it."""

    request_id: str
    prompt: tuple[int, ...]
    output_lens: tuple[int, ...]
    submitted_at: float
    skip_prefill: bool = False
    state: str = WAITING
    allocs: list[Allocation] = field(default_factory=list)
    cached_tokens: int = 0
    uncached_tokens: int = 0  # estimate while waiting, exact once admitted
    admitted_at: float | None = None
    first_token_at: float | None = None

    @property
    def n(self) -> int:
        return len(self.output_lens)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What GetLoads reports (sequences, not groups, as SGLang counts them)."""

    running: int
    waiting: int
    used_tokens: int
    max_total_tokens: int
    token_usage: float
    waiting_uncached_tokens: int
    prefill_pending_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    max_running: int
    utilization: float
    cached_blocks: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: PrefixCache) -> None:
        self.config = config
        self.cache = cache
        self.slow_factor = 1.0
        self._waiting: deque[SeqGroup] = deque()
        self._running: set[SeqGroup] = set()
        self._running_seqs = 0
        self._waiting_seqs = 0
        self._waiting_uncached = 0
        self._lane_free_at = 0.0
        self._generated: deque[tuple[float, int]] = deque()  # (finish time, tokens) in the window
        self._generated_sum = 0

    # ---- queries -------------------------------------------------------------------------------

    @property
    def running_seqs(self) -> int:
        return self._running_seqs

    @property
    def waiting_seqs(self) -> int:
        return self._waiting_seqs

    @property
    def running_groups(self) -> int:
        return len(self._running)

    @property
    def waiting_groups(self) -> int:
        return len(self._waiting)

    def itl(self) -> float:
        """The decode inter-token latency right now."""
        cfg = self.config
        load = self._running_seqs / cfg.max_running if cfg.max_running else 0.0
        return cfg.decode_s_per_token * self.slow_factor * (1.0 + cfg.decode_slowdown * min(load, 1.0))

    def loads(self, now: float) -> LoadSnapshot:
        cfg = self.config
        self._expire_throughput(now)
        cache = self.cache
        bs = cache.block_size
        max_total = cache.capacity_blocks * bs
        used = cache.used_blocks * bs
        pending = sum(
            g.uncached_tokens
            for g in self._running
            if g.first_token_at is not None and g.first_token_at > now
        )
        return LoadSnapshot(
            running=self._running_seqs,
            waiting=self._waiting_seqs,
            used_tokens=used,
            max_total_tokens=max_total,
            token_usage=used / max_total if max_total else 0.0,
            waiting_uncached_tokens=self._waiting_uncached,
            prefill_pending_tokens=pending,
            cache_hit_rate=cache.stats().hit_rate,
            gen_throughput=self._generated_sum / cfg.throughput_window_s,
            max_running=cfg.max_running,
            utilization=self._running_seqs / cfg.max_running if cfg.max_running else 0.0,
            cached_blocks=len(cache),
        )

    # ---- transitions ---------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        output_lens: Sequence[int],
        now: float,
        *,
        skip_prefill: bool = False,
    ) -> SeqGroup:
        """Queue a request; it is admitted at once when it fits (check ``group.state``).

        Raises AdmissionError when it can never run: an empty prompt, a prompt plus output over the
        context length, or more KV blocks than the whole pool.
        """
        cfg = self.config
        prompt_t = prompt if isinstance(prompt, tuple) else tuple(prompt)
        if not prompt_t:
            raise AdmissionError("empty prompt")
        if not output_lens:
            raise AdmissionError("no samples")
        longest = max(output_lens)
        if len(prompt_t) + longest > cfg.context_length:
            raise AdmissionError(
                f"prompt ({len(prompt_t)} tokens) plus output ({longest}) exceeds the context length "
                f"({cfg.context_length})"
            )
        bs = self.cache.block_size
        need = -(-(len(prompt_t) + longest) // bs)
        if len(output_lens) > 1:
            need += sum(-(-(len(prompt_t) + o) // bs) - len(prompt_t) // bs for o in output_lens[1:])
        if need > self.cache.capacity_blocks:
            raise AdmissionError(f"request needs {need} KV blocks, the pool has {self.cache.capacity_blocks}")
        group = SeqGroup(
            request_id, prompt_t, tuple(output_lens), submitted_at=now, skip_prefill=skip_prefill
        )
        if not self._waiting and self._try_admit(group, now):
            return group
        group.uncached_tokens = (
            0 if skip_prefill else len(prompt_t) - self.cache.cached_prefix_tokens(prompt_t)
        )
        self._waiting.append(group)
        self._waiting_seqs += group.n
        self._waiting_uncached += group.uncached_tokens
        return group

    def finish(
        self, group: SeqGroup, now: float, outputs: Sequence[Sequence[int]] | None = None
    ) -> list[SeqGroup]:
        """A running group is done; ``outputs`` (per sample) are cached with the prompt.

        Returns the groups admitted from the waiting queue as a result.
        """
        if group.state != RUNNING:
            return self.abort(group, now)
        self._retire(group)
        generated = 0
        for i, alloc in enumerate(group.allocs):
            out = outputs[i] if outputs is not None and i < len(outputs) else None
            if out:
                generated += len(out)
                self.cache.release(alloc, group.prompt + tuple(out))
            else:
                self.cache.release(alloc)
        self._record_generated(now, generated)
        return self._admit_waiting(now)

    def abort(self, group: SeqGroup, now: float, generated: int = 0) -> list[SeqGroup]:
        """Remove a group wherever it is, freeing its blocks. Returns newly admitted groups."""
        if group.state == WAITING:
            try:
                self._waiting.remove(group)
            except ValueError:
                return []
            self._waiting_seqs -= group.n
            self._waiting_uncached -= group.uncached_tokens
            group.state = FINISHED
            return self._admit_waiting(now)
        if group.state == RUNNING:
            self._retire(group)
            for alloc in group.allocs:
                self.cache.release(alloc)
            self._record_generated(now, generated)
            return self._admit_waiting(now)
        return []

    def flush_cache(self) -> bool:
        """Drop every cached block; refused while anything runs or waits."""
        if self._running or self._waiting:
            return False
        return self.cache.clear()

    # ---- internals -----------------------------------------------------------------------------

    def _retire(self, group: SeqGroup) -> None:
        self._running.discard(group)
        self._running_seqs -= group.n
        group.state = FINISHED

    def _try_admit(self, group: SeqGroup, now: float) -> bool:
        cfg = self.config
        if self._running_seqs and self._running_seqs + group.n > cfg.max_running:
            return False
        plen = len(group.prompt)
        totals = [plen + o for o in group.output_lens]
        allocs = self.cache.allocate_group(group.prompt, totals)
        if allocs is None:
            return False
        group.allocs = allocs
        group.state = RUNNING
        group.admitted_at = now
        cached = min(allocs[0].cached_tokens, plen - 1)
        group.cached_tokens = cached
        if group.skip_prefill:
            group.uncached_tokens = 0
            group.first_token_at = now
        else:
            group.uncached_tokens = plen - cached
            start = max(now, self._lane_free_at)
            end = (
                start
                + (cfg.prefill_base_s + group.uncached_tokens * cfg.prefill_s_per_token) * self.slow_factor
            )
            self._lane_free_at = end
            group.first_token_at = end
        self._running.add(group)
        self._running_seqs += group.n
        return True

    def _admit_waiting(self, now: float) -> list[SeqGroup]:
        admitted: list[SeqGroup] = []
        while self._waiting:
            head = self._waiting[0]
            estimate = head.uncached_tokens
            if not self._try_admit(head, now):
                break
            self._waiting.popleft()
            self._waiting_seqs -= head.n
            self._waiting_uncached -= estimate
            admitted.append(head)
        return admitted

    def _record_generated(self, now: float, tokens: int) -> None:
        if tokens:
            self._generated.append((now, tokens))
            self._generated_sum += tokens
        self._expire_throughput(now)

    def _expire_throughput(self, now: float) -> None:
        horizon = now - self.config.throughput_window_s
        gen = self._generated
        while gen and gen[0][0] < horizon:
            self._generated_sum -= gen.popleft()[1]
