"""Applying an engine's KV events to the prefix index: CPU per event, batch and stored block, from the
wire bytes of ``SubscribeKvEvents`` messages to the index's state.

    .venv/bin/python bench/kv_events_bench.py [--requests 2000] [--rounds 5] [--paths python,native]
    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=/tmp/kv.%p.out .venv/bin/python bench/kv_events_bench.py --callgrind --paths X
        # the "totals:" line of the dump over the events printed: instructions per event

The stream: one engine's ``smg.grpc.common.KvEventBatch`` messages (with the load record the mock
engine attaches to each) for a multi-turn trace shaped like ``smg-bench routing --shape fleet`` (three
system prompts of ~1,500 tokens, 4-8 turns per user, 40-200 tokens per user turn, 40-160 out), as the
mock engine's paged cache (``mock_engine.cache.PrefixCache``, 16-token blocks) emits them: per request
a batch at admission (the prompt's new blocks, and the blocks evicted to make room) and one at the end
(the answer's blocks). The cache holds ~a quarter of the live conversations, so evictions run.

Paths: ``python`` is protobuf's parse, ``kv_codec.decode_kv_batch`` and ``WorkerKvState.apply`` (the
applier's engine-hash map in Python, the index's insert in C); ``native`` is what the node runs where
the extension is built. The index is the mesh's replica (``make_replica``: a meshed node's), or the plain
native index with ``--plain``. CPU time (process_time), best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from smg_grpc_proto.generated import common_pb2  # noqa: E402

from shepherd.mock_engine.cache import AllBlocksCleared, BlockRemoved, BlockStored, PrefixCache  # noqa: E402
from shepherd.mock_engine.grpc_messages import kv_event_pb  # noqa: E402
from shepherd.node.dispatch.kv_feed import WorkerKvState  # noqa: E402
from shepherd.policies.native_index import NativePrefixIndex  # noqa: E402
from shepherd.policies.prefix_index import PrefixIndex  # noqa: E402
from shepherd.policies.prefix_replica_native import make_replica  # noqa: E402

VOCAB = 150_000


def stream(requests: int, seed: int = 0) -> tuple[list[bytes], int, int]:
    """The wire messages of one engine for ``requests`` requests; also (events, stored blocks)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(1400, 1600))] for _ in range(3)]
    cache = PrefixCache(capacity_blocks=4096)
    live: list[list[int]] = []  # conversations so far (prompt + answers)
    turns_left: list[int] = []
    out: list[bytes] = []
    seq = events = stored = 0

    def publish(evs: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        nonlocal seq, events, stored
        if not evs:
            return
        seq += 1
        events += len(evs)
        stored += sum(len(e.block_hashes) for e in evs if isinstance(e, BlockStored))
        load = common_pb2.EngineLoad(
            running_requests=rng.randint(0, 8),
            waiting_requests=0,
            token_usage=0.5,
            max_running_requests=16,
            sample=seq,
            load_only=False,
        )
        msg = common_pb2.KvEventBatch(
            sequence_number=seq, timestamp=1e9 + seq, events=[kv_event_pb(e) for e in evs], load=load
        )
        out.append(msg.SerializeToString())

    for _ in range(requests):  # bounded
        if len(live) < 12 or rng.random() < 0.2:
            live.append(list(rng.choice(systems)))
            turns_left.append(rng.randint(4, 8))
        i = rng.randrange(len(live))
        conv = live[i]
        conv += [rng.randrange(VOCAB) for _ in range(rng.randint(40, 200))]
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(40, 160))]
        alloc = cache.allocate(conv, len(conv) + len(answer))
        publish(cache.drain_events())
        if alloc is not None:
            cache.release(alloc, conv + answer)
            publish(cache.drain_events())
        conv += answer
        turns_left[i] -= 1
        if not turns_left[i]:
            del live[i], turns_left[i]
    return out, events, stored


def python_path(index: PrefixIndex) -> Callable[[list[bytes]], None]:
    """Protobuf's parse, ``decode_kv_batch`` and ``WorkerKvState.apply``: the node before the C path."""
    from shepherd.proto.kv_codec import decode_kv_batch

    state = WorkerKvState(index, "w0", clock=lambda: 1e9)
    parse = common_pb2.KvEventBatch.FromString

    def run(msgs: list[bytes]) -> None:
        for raw in msgs:
            state.apply(decode_kv_batch(parse(raw)))

    return run


def native_path(index: PrefixIndex) -> Callable[[list[bytes]], None]:
    """``kv_codec.decode_kv_wire`` (the header in C, the events kept as bytes) and ``WorkerKvState.apply``
    (``NativeKvApplier``: the events applied in C): what the node's H2 client and KV feed run now."""
    from shepherd.proto.kv_codec import decode_kv_wire

    state = WorkerKvState(index, "w0", clock=lambda: 1e9)

    def run(msgs: list[bytes]) -> None:
        for raw in msgs:
            state.apply(decode_kv_wire(raw))

    return run


def none_path(index: PrefixIndex) -> Callable[[list[bytes]], None]:
    """Nothing: the harness's own count under callgrind (subtract it)."""
    return lambda msgs: None


PATHS: dict[str, Callable[[PrefixIndex], Callable[[list[bytes]], None]]] = {
    "python": python_path,
    "native": native_path,
    "none": none_path,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--paths", default="python,native")
    ap.add_argument("--plain", action="store_true", help="the plain native index, not the mesh's replica")
    ap.add_argument("--callgrind", action="store_true", help="under valgrind: count one pass of each path")
    args = ap.parse_args()
    msgs, events, stored = stream(args.requests)
    nbytes = sum(map(len, msgs))
    print(
        f"{len(msgs)} batches, {events} events ({stored} stored blocks), {nbytes / len(msgs):.0f} bytes per "
        f"batch; load average {os.getloadavg()[0]:.2f}"
    )

    def callgrind(*a: str) -> None:
        subprocess.run(["callgrind_control", *a, str(os.getpid())], check=True, capture_output=True)

    for name in args.paths.split(","):
        best = float("inf")
        for _ in range(1 if args.callgrind else args.rounds):  # bounded
            index = NativePrefixIndex() if args.plain else make_replica()
            run = PATHS[name](index)
            if args.callgrind:
                callgrind("-i", "on")
            t0 = time.process_time()
            run(msgs)
            best = min(best, time.process_time() - t0)
            if args.callgrind:
                callgrind("-i", "off")
                callgrind("-d", name)
        print(
            f"{name:8s} {best / events * 1e6:6.2f} µs/event  {best / len(msgs) * 1e6:7.2f} µs/batch  "
            f"{best / stored * 1e9:6.0f} ns/stored block"
        )


if __name__ == "__main__":
    main()
