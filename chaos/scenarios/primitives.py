"""Checks of the network fault primitives the mesh scenarios will use: partition and heal, one-way partition,
flapping partition. They run on the fleet's node namespaces with probe sockets on spare ports (TCP connect,
UDP datagrams), not with the nodes' traffic."""

from __future__ import annotations

import contextlib

from chaos import faults
from chaos.fleet import Fleet
from chaos.netns import Host
from chaos.report import ScenarioResult
from chaos.scenarios.base import scenario

PROBE_TCP = 7946
PROBE_UDP = 7947


def _matrix(hosts: list[Host]) -> dict[tuple[str, str], bool]:
    """Which ordered pairs can open a TCP connection (probe listeners must be up)."""
    return {
        (a.name, b.name): faults.tcp_connects(a, b.ip, PROBE_TCP) for a in hosts for b in hosts if a is not b
    }


def _fmt(m: dict[tuple[str, str], bool]) -> str:
    return ", ".join(f"{a}->{b}:{'ok' if ok else 'cut'}" for (a, b), ok in sorted(m.items()))


@scenario(
    "partition_primitives",
    "partition, one-way partition and flapping partition: traffic is cut as asked and heals completely",
    short=True,
    must_hold="a partition cuts exactly the pairs across it; healing restores all; no rule is left behind",
)
def partition_primitives(fleet: Fleet, result: ScenarioResult) -> None:
    hosts = [n.host for n in fleet.active_nodes()][:3]
    a, b, c = hosts
    fw = fleet.firewall
    with contextlib.ExitStack() as stack:
        for h in hosts:
            stack.enter_context(faults.tcp_listener(h, PROBE_TCP))
        before = _matrix(hosts)
        result.check("all pairs connect before any fault", all(before.values()), _fmt(before))

        # 1 | 2: a is cut from b and c, b and c still talk
        with faults.partition(fw, [a], [b, c]) as cut:
            during = _matrix(hosts)
            result.figures["partition_rules"] = len(cut.rules)
        want = {(x, y): (x == a.name) == (y == a.name) for (x, y) in during}
        result.check(
            f"partition {a.name} | {b.name},{c.name} cuts exactly the pairs across it",
            during == want,
            _fmt(during),
        )
        healed = _matrix(hosts)
        result.check("the partition heals completely", all(healed.values()), _fmt(healed))

        # one way: a's packets to b are dropped, b's packets to a arrive (UDP shows it; TCP needs both ways)
        with faults.one_way(fw, [a], [b]):
            a_to_b = faults.udp_delivers(a, b, PROBE_UDP)
            b_to_a = faults.udp_delivers(b, a, PROBE_UDP)
            tcp_b_to_a = faults.tcp_connects(b, a.ip, PROBE_TCP)
        result.check(
            f"one-way {a.name} -> {b.name}: UDP {a.name}->{b.name} dropped, {b.name}->{a.name} delivered",
            not a_to_b and b_to_a,
            f"a->b {a_to_b}, b->a {b_to_a}",
        )
        result.check(
            "one-way: a TCP handshake from the other side fails too (its SYN-ACK is dropped)", not tcp_b_to_a
        )
        after_one_way = faults.udp_delivers(a, b, PROBE_UDP)
        result.check("the one-way partition heals", after_one_way)

        # flapping: partitioned / healed every 0.3 s for 1.5 s, then healed for good
        with faults.Flapper(fw, [a], [b, c], period_s=0.3, duration_s=1.5) as flapper:
            flapper.wait()  # the flapping is bounded: it ends by itself after 1.5 s
        result.figures["flapper_flips"] = flapper.flips
        result.check(
            "the flapper flipped the partition several times", flapper.flips >= 3, f"{flapper.flips} flips"
        )
        after_flap = _matrix(hosts)
        result.check("after flapping everything connects", all(after_flap.values()), _fmt(after_flap))

    left = {h.name: faults.list_rules(h.ns) for h in hosts}
    result.check("no iptables rule is left behind", not any(left.values()) and not fw.rules, f"{left}")
