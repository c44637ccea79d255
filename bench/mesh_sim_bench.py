"""SWIM + Lifeguard in the deterministic simulator: detection, propagation, false deaths, gossip bytes.

    .venv/bin/python bench/mesh_sim_bench.py [--sizes 3,5,10,20] [--trials 20] [--soak 120] \\
        [--loss 0.1] [--pause 1.0] [--pause-every 3.0] [--sweep-pauses 0.5,1.0,1.5] [--sweep-soak 120] \\
        [--delay-ms 0.2,1.0] [--seed 1] [--probe-interval 0.4] [--suspicion-mult 5] [--log-n-min]

docs/DESIGN.md §6's original timers, for comparison: ``--probe-interval 0.5 --suspicion-mult 4 --log-n-min``.

All figures are in simulated time (a fake clock; LAN delay uniform in ``--delay-ms``, default
0.2-1 ms), so they are exact and reproducible for a given seed, and independent of machine load.

* crash detection: a random node crashes at a random phase after a warm-up; the time until each
  survivor marks it DEAD (pooled over observers and trials), and until all of them did.
* state propagation: user broadcasts (the state layer's deltas, re-broadcast by every receiver like
  ``MeshState`` does) originated at random nodes; time until each other node has it, with no loss
  and with ``--loss``.
* soak: ``--soak`` seconds with ``--loss`` packet loss and a ``--pause`` s SIGSTOP of a random node
  every ``--pause-every`` s on average: DEAD declarations about nodes that were running (must be 0).
* pause sweep: the same soak (``--sweep-soak`` s) for each pause length in ``--sweep-pauses``. Pauses
  of one node may overlap into a longer stall (likely with long pauses in a small cluster: a 3-node
  cluster with a 1.5 s pause every 3 s has stalls of 3 s and more), and a stall longer than one probe
  period plus the suspicion floor (2.4 s by default) is indistinguishable from a crash, so each false
  DEAD is put down to the stall it fell in: a single pause, merged pauses (the longest such stall is
  shown), or none (loss alone).
* partitions (``--partitions 3:1,5:2 --partition-trials 1000``): an N-node mesh cut in two at a random
  phase; the time until every majority node holds every minority node DEAD, p50 / p99 / worst over the
  trials (the chaos suite's partition checks are these figures plus a margin: when each victim is first
  probed is random, so one measured run is no bound).
* gossip bytes: UDP bytes sent per node per second (sealed size: + ``seal_overhead`` per packet),
  steady state without faults, and during the soak; TCP push-pull bytes separately.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shepherd.mesh.sim import GossipDelegate, Sim
from shepherd.mesh.swim_types import Delegate, SwimConfig
from shepherd.proto.mesh_messages import MemberState

WARMUP = 5.0


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def _delay(lo_ms: float, hi_ms: float) -> tuple[float, float]:
    return (lo_ms / 1000, hi_ms / 1000)


@dataclass
class Row:
    n: int
    det_p50: float
    det_p99: float
    det_all_p50: float
    det_all_p99: float
    undetected: int
    prop_p50: float
    prop_p99: float
    prop_loss_p50: float
    prop_loss_p99: float
    false_dead: int
    soak_suspicions: int
    bytes_steady: float
    bytes_soak: float
    pp_bytes: float


def crash_detection(
    n: int, trials: int, seed: int, delay: tuple[float, float], cfg: SwimConfig | None = None
) -> tuple[list[float], list[float], int]:
    per_observer: list[float] = []
    all_detected: list[float] = []
    missed = 0
    for trial in range(trials):
        rng = random.Random(f"crash-{seed}-{n}-{trial}")
        sim = Sim(n, seed=seed * 1000 + trial, delay=delay, config=cfg)
        sim.run(3.0 + rng.uniform(0, 2.0))  # converged after ~1 s; then a random crash phase
        victim = rng.choice(sim.names)
        crashed = sim.now
        sim.crash(victim)
        survivors = sim.up()
        t = sim.run_until(_all_see_dead(sim, survivors, [victim]), timeout=40.0, step=0.1)
        if t is None:
            missed += 1
            continue
        det = sim.detection(victim, crashed)  # exact event times
        per_observer += [x - crashed for x in det.values()]
        all_detected.append(max(det.values()) - crashed)
    return per_observer, all_detected, missed


def partition_detection(
    n: int, minority: int, trials: int, seed: int, delay: tuple[float, float], cfg: SwimConfig | None = None
) -> tuple[list[float], int]:
    """Per trial: cut ``minority`` nodes off at a random phase; when the last majority node held the last
    minority node DEAD (exact event times), and how many trials saw no such split within 40 s."""
    took: list[float] = []
    missed = 0
    for trial in range(trials):
        rng = random.Random(f"partition-{seed}-{n}-{minority}-{trial}")
        sim = Sim(n, seed=seed * 1000 + trial, delay=delay, config=cfg)
        sim.run(3.0 + rng.uniform(0, 2.0))
        names = list(sim.names)
        rng.shuffle(names)
        side_b, side_a = names[:minority], names[minority:]
        cut = sim.now
        sim.partition(side_a, side_b)
        if sim.run_until(_all_see_dead(sim, side_a, side_b), timeout=40.0, step=0.1) is None:
            missed += 1
            continue
        took.append(max(max(sim.detection(v, cut)[o] for o in side_a) for v in side_b) - cut)
    return took, missed


def _all_see_dead(sim: Sim, observers: list[str], victims: list[str]) -> Callable[[], bool]:
    return lambda: sim.sees(observers, victims, MemberState.DEAD)


def propagation(
    n: int, count: int, seed: int, loss: float, delay: tuple[float, float], cfg: SwimConfig | None = None
) -> list[float]:
    sim: Sim
    rng = random.Random(f"prop-{seed}-{n}-{loss}")

    def make(name: str) -> Delegate:
        return GossipDelegate(name, lambda: sim.now)

    sim = Sim(n, seed=seed, loss=loss, delay=delay, delegates=make, config=cfg)
    sim.run(WARMUP)
    sent: dict[bytes, tuple[str, float]] = {}
    for i in range(count):
        sim.run_for(rng.uniform(0.5, 1.5))
        origin = rng.choice(sim.names)
        payload = f"delta-{i}".encode()
        sent[payload] = (origin, sim.now)
        sim.originate(origin, payload)
    sim.run_for(20.0)
    lat: list[float] = []
    for payload, (origin, t0) in sent.items():
        for name in sim.names:
            if name == origin:
                continue
            d = sim.nodes[name].delegate
            assert isinstance(d, GossipDelegate)
            lat.append(d.received.get(payload, float("inf")) - t0)
    return lat


@dataclass
class Soak:
    false_dead: int  # DEAD events about running nodes (one per observer)
    in_single: int  # ... declared during (or just after) a single pause
    in_merged: int  # ... during overlapping pauses of that node (a longer stall)
    no_stall: int  # ... about a node that had not been paused in the last second (loss alone)
    longest_merged: float  # the longest merged stall behind a false DEAD, s (0: none)
    suspicions: int
    bytes_per_node_s: float
    pp_bytes_per_node_s: float


def stalls(pauses: Sequence[tuple[float, str]], length: float) -> dict[str, list[tuple[float, float]]]:
    """Per node, its pauses with the overlapping ones merged: (start, end) stalls."""
    out: dict[str, list[tuple[float, float]]] = {}
    for t, name in sorted(pauses):
        iv = out.setdefault(name, [])
        if iv and t <= iv[-1][1]:
            iv[-1] = (iv[-1][0], max(iv[-1][1], t + length))
        else:
            iv.append((t, t + length))
    return out


def soak(
    n: int,
    seconds: float,
    seed: int,
    loss: float,
    pause: float,
    every: float,
    delay: tuple[float, float],
    cfg: SwimConfig | None = None,
) -> Soak:
    sim = Sim(n, seed=seed, loss=loss, delay=delay, config=cfg)
    sim.run(WARMUP)
    pauses = sim.random_pauses(random.Random(f"soak-{seed}-{n}"), WARMUP, WARMUP + seconds, every, pause)
    b0 = sim.gossip_bytes()
    sim.run(WARMUP + seconds)
    by_node = stalls(pauses, pause)
    single = merged = none = 0
    longest = 0.0
    false_dead = sim.false_dead()
    for e in false_dead:
        before = [iv for iv in by_node.get(e.member, []) if iv[0] <= e.time <= iv[1] + 1.0]
        if not before:
            none += 1
        elif before[-1][1] - before[-1][0] <= pause + 1e-9:
            single += 1
        else:
            merged += 1
            longest = max(longest, before[-1][1] - before[-1][0])
    pp = sum(nd.stats.push_pull_bytes for nd in sim.nodes.values())
    return Soak(
        len(false_dead),
        single,
        merged,
        none,
        longest,
        sum(1 for e in sim.events if e.kind == "suspect"),
        (sim.gossip_bytes() - b0) / n / seconds,
        pp / n / (WARMUP + seconds),
    )


def steady_bytes(n: int, seed: int, delay: tuple[float, float], cfg: SwimConfig | None = None) -> float:
    sim = Sim(n, seed=seed, delay=delay, config=cfg)
    sim.run(WARMUP + 5.0)
    b0 = sim.gossip_bytes()
    sim.run(WARMUP + 45.0)
    return (sim.gossip_bytes() - b0) / n / 40.0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3,5,10,20", help="cluster sizes (comma separated)")
    ap.add_argument("--trials", type=int, default=20, help="crash trials per size")
    ap.add_argument("--broadcasts", type=int, default=30, help="user broadcasts per size and loss setting")
    ap.add_argument("--soak", type=float, default=120.0, help="simulated seconds of the loss+pause soak")
    ap.add_argument("--loss", type=float, default=0.1)
    ap.add_argument("--pause", type=float, default=1.0, help="pause (SIGSTOP) length, s")
    ap.add_argument("--pause-every", type=float, default=3.0, help="mean time between pauses, s")
    ap.add_argument("--delay-ms", default="0.2,1.0", help="one-way delay range, ms")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--sweep-pauses", default="0.5,1.0,1.5", help="pause lengths of the sweep, s ('' for none)"
    )
    ap.add_argument("--sweep-soak", type=float, default=120.0, help="simulated seconds per sweep cell")
    ap.add_argument("--partitions", default="", help="N:minority cuts to time, e.g. 3:1,5:2 ('' for none)")
    ap.add_argument("--partition-trials", type=int, default=200, help="trials per partition")
    ap.add_argument("--suspicion-mult", type=int, default=SwimConfig().suspicion_mult)
    ap.add_argument(
        "--probe-interval", type=float, default=SwimConfig().probe_interval, help="(probe timeout: half)"
    )
    ap.add_argument(
        "--log-n-min",
        action="store_true",
        help="memberlist's formula: the suspicion floor grows with log10 n too (log_n_min_suspicion)",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    lo, hi = (float(x) for x in args.delay_ms.split(","))
    delay = _delay(lo, hi)
    cfg = SwimConfig(
        suspicion_mult=args.suspicion_mult,
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_interval / 2,
        nack_timeout=args.probe_interval * 0.4,
        log_n_min_suspicion=args.log_n_min,
    )
    sweep = [float(x) for x in args.sweep_pauses.split(",") if x]

    wall0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[Row] = []
    sweeps: dict[tuple[int, float], Soak] = {}
    for n in sizes:
        per_obs, all_det, missed = crash_detection(n, args.trials, args.seed, delay, cfg)
        prop = propagation(n, args.broadcasts, args.seed, 0.0, delay, cfg)
        prop_loss = propagation(n, args.broadcasts, args.seed, args.loss, delay, cfg)
        sk = soak(n, args.soak, args.seed, args.loss, args.pause, args.pause_every, delay, cfg)
        for length in sweep:
            cell = sk if length == args.pause and args.sweep_soak == args.soak else None
            sweeps[(n, length)] = cell or soak(
                n, args.sweep_soak, args.seed, args.loss, length, args.pause_every, delay, cfg
            )
        rows.append(
            Row(
                n,
                pct(per_obs, 50),
                pct(per_obs, 99),
                pct(all_det, 50),
                pct(all_det, 99),
                missed,
                pct(prop, 50) * 1000,
                pct(prop, 99) * 1000,
                pct(prop_loss, 50) * 1000,
                pct(prop_loss, 99) * 1000,
                sk.false_dead,
                sk.suspicions,
                steady_bytes(n, args.seed, delay, cfg),
                sk.bytes_per_node_s,
                sk.pp_bytes_per_node_s,
            )
        )

    lo_s = {n: cfg.suspicion_bounds(n)[0] for n in sizes}
    floor = ", ".join(f"{v:.2f}" for v in dict.fromkeys(lo_s.values()))
    print(
        f"SWIM+Lifeguard simulation (probe {cfg.probe_interval} s / timeout {cfg.probe_timeout} s, "
        f"suspicion mult {cfg.suspicion_mult}: floor {floor} s"
        f"{' (log10 n)' if args.log_n_min else ''}, max 6 x mult x max(1, log10 n) x probe; "
        f"gossip {cfg.gossip_interval} s x {cfg.gossip_nodes}); delay {lo}-{hi} ms, seed {args.seed}"
    )
    print(
        f"crash: {args.trials} trials/size | propagation: {args.broadcasts} broadcasts, 0% and "
        f"{args.loss:.0%} loss | soak: {args.soak:.0f} s, {args.loss:.0%} loss, {args.pause:.1f} s pause "
        f"every ~{args.pause_every:.1f} s"
    )
    head = (
        f"{'N':>3} | {'detect p50':>10} {'p99':>6} {'all p50':>8} {'all p99':>8} | "
        f"{'prop p50':>8} {'p99':>6} {'loss p50':>8} {'p99':>6} | {'false':>5} {'susp':>5} | "
        f"{'B/node/s':>8} {'soak':>6} {'pp':>5}"
    )
    print(head)
    print(
        f"{'':>3} | {'s':>10} {'s':>6} {'s':>8} {'s':>8} | {'ms':>8} {'ms':>6} {'ms':>8} {'ms':>6} | "
        f"{'DEAD':>5} {'':>5} | {'steady':>8} {'':>6} {'tcp':>5}"
    )
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.n:>3} | {r.det_p50:>10.2f} {r.det_p99:>6.2f} {r.det_all_p50:>8.2f} {r.det_all_p99:>8.2f} | "
            f"{r.prop_p50:>8.0f} {r.prop_p99:>6.0f} {r.prop_loss_p50:>8.0f} {r.prop_loss_p99:>6.0f} | "
            f"{r.false_dead:>5} {r.soak_suspicions:>5} | "
            f"{r.bytes_steady:>8.0f} {r.bytes_soak:>6.0f} {r.pp_bytes:>5.0f}"
            + (f"  ({r.undetected} crash(es) undetected in 40 s)" if r.undetected else "")
        )
    if sweep:
        print(
            f"\npause sweep: false DEAD (events, one per observer) in {args.sweep_soak:.0f} s with "
            f"{args.loss:.0%} loss and a pause of a random node every ~{args.pause_every:.1f} s; put down to "
            "single pauses / merged pauses (the longest merged stall) / no pause (loss alone)"
        )
        print(f"{'N':>3} | " + " | ".join(f"{f'{p:g} s pauses':>26}" for p in sweep))
        print("-" * (6 + 29 * len(sweep)))
        for n in sizes:
            cells = []
            for p in sweep:
                c = sweeps[(n, p)]
                longest = f" ({c.longest_merged:.1f} s)" if c.in_merged else ""
                cells.append(f"{f'{c.false_dead}: {c.in_single}/{c.in_merged}{longest}/{c.no_stall}':>26}")
            print(f"{n:>3} | " + " | ".join(cells))
    for spec in (x for x in args.partitions.split(",") if x):
        n, minority = (int(v) for v in spec.split(":"))
        took, missed = partition_detection(n, minority, args.partition_trials, args.seed, delay, cfg)
        print(
            f"partition {n - minority} | {minority} of {n}: every majority node holds every minority node "
            f"DEAD after p50 {pct(took, 50):.2f} s, p99 {pct(took, 99):.2f} s, "
            f"worst {max(took, default=0):.2f} s "
            f"({len(took)} trials" + (f", {missed} not split within 40 s)" if missed else ")")
        )
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(f"(bench: {wall:.1f} s wall, {cpu:.1f} s CPU)")


if __name__ == "__main__":
    main()
