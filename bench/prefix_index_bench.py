"""Prefix index: CPU µs per match+insert of a 1,300-token prompt, and bytes per live block.

    .venv/bin/python bench/prefix_index_bench.py [--blocks 100000] [--workers 8] [--prompt 1300]

The index is filled with conversations (a few shared system prompts, then per-conversation turns)
spread over the workers until it holds ``--blocks`` live blocks; then each measured call is what a
cache-aware pick does: ``match(ids)`` then ``insert(ids, worker, now)`` on a fresh ids list (as the
tokenizer hands it over). Three kinds of prompts: a follow-up turn (the held prefix plus ~200 new
tokens), an exact repeat, and a brand-new conversation. CPU time (process_time), best of 5 rounds.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from functools import partial

from shepherd.policies.prefix_index import PrefixIndex, PrefixIndexConfig, block_hashes


def _prompt(rng: random.Random, system: list[int], n: int) -> list[int]:
    return system + [rng.randrange(150_000) for _ in range(n - len(system))]


def _fill(index: PrefixIndex, rng: random.Random, workers: list[str], blocks: int, plen: int) -> None:
    systems = [[rng.randrange(150_000) for _ in range(320)] for _ in range(4)]
    t = 0.0
    while index.live_blocks < blocks:
        ids = _prompt(rng, rng.choice(systems), plen)
        t += 0.001
        index.insert(ids, rng.choice(workers), t)


def _cpu_us(fn: Callable[[], object], n: int, rounds: int = 5) -> float:
    """CPU µs per call, best of ``rounds`` rounds of ``n`` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1300)
    ap.add_argument("--n", type=int, default=400)
    a = ap.parse_args()
    rng = random.Random(7)
    workers = [f"w{i}" for i in range(a.workers)]
    # per-worker capacity a little above an even share: the measured calls run with eviction
    cfg = PrefixIndexConfig(capacity_blocks=a.blocks * 5 // (4 * a.workers))

    tracemalloc.start()
    index = PrefixIndex(cfg)
    base = tracemalloc.get_traced_memory()[0]
    _fill(index, rng, workers, a.blocks, a.prompt)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    entries = sum(index.worker_blocks(w) for w in workers)
    print(
        f"live blocks {index.live_blocks:,}, (block, worker) entries {entries:,}: "
        f"{used / index.live_blocks:.1f} bytes per live block ({used / 2**20:.1f} MiB traced)"
    )

    system = [rng.randrange(150_000) for _ in range(320)]
    convs = [_prompt(rng, system, a.prompt - 200) for _ in range(256)]
    for i, c in enumerate(convs):
        index.insert(c, workers[i % len(workers)], 1e6)
    now = [2e6]
    total = 5 * a.n  # calls per measurement (5 rounds): every call gets a prompt of its own

    def followups() -> list[list[int]]:
        return [convs[i % 256] + [rng.randrange(150_000) for _ in range(200)] for i in range(total)]

    def repeats() -> list[list[int]]:
        return [list(convs[i % 256]) for i in range(total)]  # fresh list objects, as from the tokenizer

    def news() -> list[list[int]]:
        return [_prompt(rng, system, a.prompt) for _ in range(total)]

    ids0 = followups()[0]
    hash_us = _cpu_us(lambda: block_hashes(ids0), a.n)
    print(f"block_hashes alone, one prompt again and again ({a.prompt} tokens): {hash_us:.1f} µs")
    for name, make in (("follow-up turn", followups), ("exact repeat", repeats), ("new conversation", news)):
        full = _cpu_us(partial(_pick, index, workers, iter(make()), now), a.n)
        chains = iter([block_hashes(p) for p in make()])
        only = _cpu_us(partial(_pick_hashed, index, workers, chains, now), a.n)
        print(
            f"{name:16s}: match+insert {full:6.1f} µs CPU; with the block hashes given {only:5.1f} µs "
            f"({a.workers} workers, {index.live_blocks:,} live blocks)"
        )


def _choose(m: dict[str, int], workers: list[str], i: int) -> str:
    return max(m, key=m.__getitem__) if m else workers[i % len(workers)]


def _pick(index: PrefixIndex, workers: list[str], prompts: Iterator[list[int]], now: list[float]) -> None:
    """What a cache-aware pick does with the index: match the prompt, record the choice."""
    ids = next(prompts)
    now[0] += 1e-3
    index.insert(ids, _choose(index.match(ids), workers, len(ids)), now[0])


def _pick_hashed(
    index: PrefixIndex, workers: list[str], chains: Iterator[list[int]], now: list[float]
) -> None:
    hs = next(chains)
    now[0] += 1e-3
    index.insert_blocks(hs, _choose(index.match_blocks(hs), workers, len(hs)), now[0])


if __name__ == "__main__":
    main()
