"""SWIM + Lifeguard in the deterministic simulator: detection, propagation, false deaths, gossip bytes.

    .venv/bin/python bench/mesh_sim_bench.py [--sizes 3,5,10,20] [--trials 20] [--soak 120] \\
        [--loss 0.1] [--pause 1.0] [--pause-every 3.0] [--delay-ms 0.2,1.0] [--seed 1]

All figures are in simulated time (a fake clock; LAN delay uniform in ``--delay-ms``, default
0.2-1 ms), so they are exact and reproducible for a given seed, and independent of machine load.

* crash detection: a random node crashes at a random phase after a warm-up; the time until each
  survivor marks it DEAD (pooled over observers and trials), and until all of them did.
* state propagation: user broadcasts (the state layer's deltas, re-broadcast by every receiver like
  ``MeshState`` does) originated at random nodes; time until each other node has it, with no loss
  and with ``--loss``.
* soak: ``--soak`` seconds with ``--loss`` packet loss and a ``--pause`` s SIGSTOP of a random node
  every ``--pause-every`` s on average: DEAD declarations about nodes that were running (must be 0).
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
from shepherd.mesh.swim_types import Delegate, MemberState, SwimConfig

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
        t = sim.run_until(_all_see_dead(sim, survivors, victim), timeout=40.0, step=0.1)
        if t is None:
            missed += 1
            continue
        det = sim.detection(victim, crashed)  # exact event times
        per_observer += [x - crashed for x in det.values()]
        all_detected.append(max(det.values()) - crashed)
    return per_observer, all_detected, missed


def _all_see_dead(sim: Sim, observers: list[str], victim: str) -> Callable[[], bool]:
    return lambda: sim.sees(observers, [victim], MemberState.DEAD)


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


def soak(
    n: int,
    seconds: float,
    seed: int,
    loss: float,
    pause: float,
    every: float,
    delay: tuple[float, float],
    cfg: SwimConfig | None = None,
) -> tuple[int, int, float, float]:
    sim = Sim(n, seed=seed, loss=loss, delay=delay, config=cfg)
    sim.run(WARMUP)
    rng = random.Random(f"soak-{seed}-{n}")
    t = WARMUP
    while True:
        t += rng.expovariate(1 / every)
        if t >= WARMUP + seconds:
            break
        name = rng.choice(sim.names)
        sim.at(t, _pauser(sim, name, pause))
    b0 = sim.gossip_bytes()
    sim.run(WARMUP + seconds)
    suspicions = sum(1 for e in sim.events if e.kind == "suspect")
    pp = sum(nd.stats.push_pull_bytes for nd in sim.nodes.values())
    return (
        len(sim.false_dead()),
        suspicions,
        (sim.gossip_bytes() - b0) / n / seconds,
        pp / n / (WARMUP + seconds),
    )


def _pauser(sim: Sim, name: str, pause: float) -> Callable[[], None]:
    return lambda: sim.pause(name, pause)


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
    ap.add_argument("--suspicion-mult", type=int, default=SwimConfig().suspicion_mult)
    ap.add_argument("--probe-interval", type=float, default=SwimConfig().probe_interval)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    lo, hi = (float(x) for x in args.delay_ms.split(","))
    delay = _delay(lo, hi)
    cfg = SwimConfig(
        suspicion_mult=args.suspicion_mult,
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_interval / 2,
        nack_timeout=args.probe_interval * 0.4,
    )

    wall0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[Row] = []
    for n in sizes:
        per_obs, all_det, missed = crash_detection(n, args.trials, args.seed, delay, cfg)
        prop = propagation(n, args.broadcasts, args.seed, 0.0, delay, cfg)
        prop_loss = propagation(n, args.broadcasts, args.seed, args.loss, delay, cfg)
        fd, sus, b_soak, pp = soak(
            n, args.soak, args.seed, args.loss, args.pause, args.pause_every, delay, cfg
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
                fd,
                sus,
                steady_bytes(n, args.seed, delay, cfg),
                b_soak,
                pp,
            )
        )
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    print(
        f"SWIM+Lifeguard simulation (probe {cfg.probe_interval} s / timeout {cfg.probe_timeout} s, "
        f"suspicion mult {cfg.suspicion_mult}, gossip {cfg.gossip_interval} s x {cfg.gossip_nodes}); "
        f"delay {lo}-{hi} ms, seed {args.seed}"
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
    print(f"(bench: {wall:.1f} s wall, {cpu:.1f} s CPU)")


if __name__ == "__main__":
    main()
