"""MeshRuntime on loopback: several nodes in one event loop, real sockets, short protocol intervals.

Assertions are on eventual states, reached through bounded polling loops (never on durations).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import replace

import pytest

from shepherd.auth.certs import TlsFiles, client_context, server_context, write_dev_pki
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime import MeshRuntime
from shepherd.mesh.runtime_config import MeshRuntimeConfig
from shepherd.mesh.swim_types import MemberDead, MemberEvent, MemberLeft, MemberUp
from shepherd.proto.mesh_messages import Addr, MemberState
from tests.unit.mesh_fixtures import FAST, KEY, OTHER_KEY, eventually

pytestmark = pytest.mark.timeout(90)


ALIVE, DEAD, LEFT = MemberState.ALIVE, MemberState.DEAD, MemberState.LEFT


async def never(cond: Callable[[], bool], window: float = 1.5) -> None:
    for _ in range(int(window / 0.02)):
        assert not cond()
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    out = tmp_path_factory.mktemp("pki")
    files = write_dev_pki(out, ["n1", "n2", "n3", "n4", "mallory"])
    files.update({f"foreign-{k}": v for k, v in write_dev_pki(out / "foreign", ["n4"]).items()})
    return files


class RecordingDelegate:
    """A delegate with a bit of state; records what it got and from whom (certificate identity)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.outbox: list[bytes] = []
        self.user: list[tuple[bytes, str]] = []
        self.merged_from: list[tuple[bytes, str]] = []
        self.dead: list[str] = []

    def broadcasts(self, budget: int) -> list[bytes]:
        out, self.outbox = self.outbox, []
        return out

    def on_user(self, payload: bytes, src_name: str) -> None:
        self.user.append((payload, src_name))

    def local_state(self) -> bytes:
        return f"state-of-{self.name}".encode()

    def merge_remote_state(self, data: bytes) -> None:  # pragma: no cover - the runtime prefers _from
        self.merged_from.append((data, "?"))

    def merge_remote_state_from(self, data: bytes, peer: str) -> None:
        self.merged_from.append((data, peer))

    def on_member_dead(self, name: str) -> None:
        self.dead.append(name)


class Cluster:
    def __init__(self, stack: AsyncExitStack, pki: dict[str, TlsFiles]) -> None:
        self.stack = stack
        self.pki = pki
        self.events: dict[str, list[MemberEvent]] = {}

    async def node(
        self,
        name: str,
        seeds: tuple[Addr, ...] = (),
        *,
        key: bytes = KEY,
        tls: str | None = None,
        delegate: RecordingDelegate | None = None,
    ) -> MeshRuntime:
        files = self.pki[tls or name]
        events = self.events.setdefault(name, [])
        rt = MeshRuntime(
            MeshRuntimeConfig(name=name, bind_host="127.0.0.1", bind_port=0, seeds=seeds, swim=FAST),
            Keyring([key]),
            server_context(files),
            client_context(files),
            delegate,
            on_member_event=events.append,
            rng=random.Random(name),
        )
        await rt.start()
        self.stack.push_async_callback(rt.abort)
        return rt


@pytest.fixture
async def cluster(pki: dict[str, TlsFiles]) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        yield Cluster(stack, pki)


def state_of(rt: MeshRuntime, name: str) -> MemberState | None:
    return rt.member_state(name)


def all_alive(nodes: list[MeshRuntime], names: list[str]) -> bool:
    return all(state_of(rt, n) == ALIVE for rt in nodes for n in names)


async def test_join_leave_and_crash(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,))
    n3 = await cluster.node("n3", seeds=(n1.address,))
    names = ["n1", "n2", "n3"]
    await eventually(lambda: all_alive([n1, n2, n3], names), what="all three alive everywhere")
    assert [m.name for m in n2.members()] == names
    view = {m.name: m for m in n1.members()}["n3"]
    assert view.state == "alive" and view.address == f"127.0.0.1:{n3.address[1]}"
    assert view.to_json()["incarnation"] == view.incarnation and view.last_change > 0
    m = n1.transport_metrics
    await eventually(lambda: m.udp_packets_in > 0 and m.udp_bytes_out > 0, what="gossip flowing")
    assert n1.transport_metrics.tcp_sessions_in >= 2  # the joins

    # graceful leave: the others see LEFT (not DEAD)
    await n3.close()
    await eventually(lambda: state_of(n1, "n3") == LEFT and state_of(n2, "n3") == LEFT, what="n3 LEFT")
    assert any(isinstance(e, MemberLeft) and e.member.name == "n3" for e in cluster.events["n1"])

    # crash: sockets closed without a leave; the survivor marks it DEAD through suspicion
    await n2.abort()
    await eventually(lambda: state_of(n1, "n2") == DEAD, timeout=30, what="n2 DEAD")
    assert any(isinstance(e, MemberDead) and e.member.name == "n2" for e in cluster.events["n1"])
    assert state_of(n1, "n3") == LEFT
    assert any(isinstance(e, MemberUp) and e.member.name == "n2" for e in cluster.events["n1"])
    kinds = n1.metrics.member_events
    assert kinds.get("MemberUp", 0) >= 2 and kinds.get("MemberDead", 0) >= 1


async def test_seeds_retried_until_joined(cluster: Cluster, pki: dict[str, TlsFiles]) -> None:
    # n2 starts first, pointing at a seed that is not up yet; it joins once the seed exists
    n1 = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_port=0, swim=FAST),
        Keyring([KEY]),
        server_context(pki["n1"]),
        client_context(pki["n1"]),
    )
    await n1.start()
    port = n1.address[1]
    await n1.abort()  # frees the port: n2's join attempts fail for a while
    n2 = await cluster.node("n2", seeds=(("127.0.0.1", port),))
    await asyncio.sleep(0.3)
    assert state_of(n2, "n1") is None
    late = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_port=port, swim=FAST),
        Keyring([KEY]),
        server_context(pki["n1"]),
        client_context(pki["n1"]),
    )
    try:
        await late.start()
    except OSError:
        pytest.skip("the freed port was taken by another process")
    cluster.stack.push_async_callback(late.abort)
    await eventually(lambda: all_alive([late, n2], ["n1", "n2"]), what="late seed joined")


async def test_wrong_key_node_cannot_join(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2", seeds=(n1.address,))
    await eventually(lambda: all_alive([n1, n2], ["n1", "n2"]), what="n1+n2 alive")
    # valid certificate, wrong mesh key: neither UDP nor the TCP join gets through
    intruder = await cluster.node("n4", seeds=(n1.address, n2.address), key=OTHER_KEY)
    await eventually(
        lambda: n1.transport_metrics.tcp_bad_seal > 0 and n2.transport_metrics.tcp_bad_seal > 0,
        what="sealed join refused",
    )
    await never(lambda: state_of(n1, "n4") is not None or state_of(n2, "n4") is not None)
    assert [m.name for m in intruder.members()] == ["n4"]
    assert intruder.transport_metrics.tcp_errors_out > 0


async def test_foreign_ca_node_cannot_join(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    outsider = await cluster.node("n4", seeds=(n1.address,), tls="foreign-n4")
    await eventually(lambda: n1.transport_metrics.tcp_rejected_tls > 0, what="TLS refusal")
    await never(lambda: state_of(n1, "n4") is not None)
    assert [m.name for m in outsider.members()] == ["n4"]


async def test_identity_is_the_certificate_not_the_claim(cluster: Cluster) -> None:
    d1 = RecordingDelegate("n1")
    n1 = await cluster.node("n1", delegate=d1)
    # mallory's certificate, configured to call itself n2: its state does not list "mallory"
    impostor = await cluster.node("n2", seeds=(n1.address,), tls="mallory")
    await eventually(lambda: n1.metrics.push_pulls_refused > 0, what="impostor refused")
    await never(lambda: state_of(n1, "n2") is not None, window=1.0)
    assert d1.merged_from == []
    assert state_of(impostor, "n1") is None


async def test_delegate_state_and_broadcasts(cluster: Cluster) -> None:
    d1, d2 = RecordingDelegate("n1"), RecordingDelegate("n2")
    n1 = await cluster.node("n1", delegate=d1)
    n2 = await cluster.node("n2", seeds=(n1.address,), delegate=d2)
    await eventually(lambda: all_alive([n1, n2], ["n1", "n2"]), what="joined")
    # push-pull state reaches the delegate with the peer's certificate identity
    await eventually(lambda: (b"state-of-n1", "n1") in d2.merged_from, what="n2 merged n1's state")
    await eventually(lambda: (b"state-of-n2", "n2") in d1.merged_from, what="n1 merged n2's state")
    # piggybacked user broadcasts
    d1.outbox.append(b"delta-1")
    await eventually(lambda: (b"delta-1", "n1") in d2.user, what="broadcast delivered")
    await n2.abort()
    await eventually(lambda: "n2" in d1.dead, timeout=30, what="delegate told n2 is dead")


class SteppedDelegate(RecordingDelegate):
    """Merges a push-pull state in three steps (``merge_remote_state_steps``), noting at each step how
    far a task that counts loop turns got: the loop must run between the steps."""

    def __init__(self, name: str, turns: list[int]) -> None:
        super().__init__(name)
        self.turns = turns
        self.steps: list[tuple[str, list[int]]] = []  # (peer, loop turns seen at each step)

    def merge_remote_state_steps(self, data: bytes, peer: str) -> Iterator[None]:
        seen = []
        for _ in range(3):
            seen.append(self.turns[0])
            yield
        seen.append(self.turns[0])
        self.merged_from.append((data, peer))
        self.steps.append((peer, seen))


async def test_push_pull_state_merged_in_steps_lets_the_loop_run(cluster: Cluster) -> None:
    turns = [0]

    async def count_turns() -> None:
        for _ in range(10**7):  # (bounded; cancelled at the end)
            turns[0] += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(count_turns())
    try:
        d1, d2 = SteppedDelegate("n1", turns), SteppedDelegate("n2", turns)
        n1 = await cluster.node("n1", delegate=d1)
        n2 = await cluster.node("n2", seeds=(n1.address,), delegate=d2)
        await eventually(lambda: all_alive([n1, n2], ["n1", "n2"]), what="joined")
        # both sides (the requester's reply, the responder's request) merge in steps, with the identity
        await eventually(lambda: (b"state-of-n1", "n1") in d2.merged_from, what="n2 merged n1's state")
        await eventually(lambda: (b"state-of-n2", "n2") in d1.merged_from, what="n1 merged n2's state")
    finally:
        ticker.cancel()
    for d, peer in ((d1, "n2"), (d2, "n1")):
        assert d.steps and all(p == peer for p, _ in d.steps)
        for _, seen in d.steps:
            assert all(b > a for a, b in itertools.pairwise(seen)), seen  # the loop ran between


async def test_a_deadline_already_past_fires_at_once_and_is_not_lag(pki: dict[str, TlsFiles]) -> None:
    """A deadline already past when the timer is armed (a probe made due at once by a heard suspicion,
    armed when the probe in flight is acked) fires at once, and its age is not taken for loop lag."""
    rt = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_port=0, swim=replace(FAST)),
        Keyring([KEY]),
        server_context(pki["n1"]),
        client_context(pki["n1"]),
    )
    await rt.start()
    swim = rt.swim
    try:
        await eventually(lambda: rt.metrics.ticks > 0, what="ticks")
        real = swim.next_deadline
        past = rt._now() - 0.5
        asked: list[float] = []

        def once() -> float:  # the past deadline once, then the machine's own
            if asked:
                return real()
            asked.append(past)
            return past

        swim.next_deadline = once  # type: ignore[method-assign]
        ticks = rt.metrics.ticks
        rt._arm_timer()
        assert asked and rt._timer_at >= past + 0.5 - 0.01
        await eventually(lambda: rt.metrics.ticks > ticks, what="the timer fired")
        assert rt.metrics.lag_last < 0.1  # (it was the deadline's age, 0.5 s)
    finally:
        swim.__dict__.pop("next_deadline", None)
        await rt.close()


async def test_lag_monitor_and_clean_shutdown(pki: dict[str, TlsFiles]) -> None:
    rt = MeshRuntime(
        MeshRuntimeConfig(name="n1", bind_port=0, swim=replace(FAST), lag_interval=0.02),
        Keyring([KEY]),
        server_context(pki["n1"]),
        client_context(pki["n1"]),
    )
    before = set(asyncio.all_tasks())
    await rt.start()
    assert (rt.running, rt.swim.joined) == (True, True)
    await eventually(lambda: rt.metrics.ticks > 0, what="ticks")
    loop_block_start = asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - loop_block_start < 0.15:  # block the loop: lag appears
        pass
    await eventually(lambda: rt.metrics.lag_max > 0.05, what="lag measured")
    await rt.close()
    await rt.close()  # idempotent
    assert not rt.running
    leftover = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    assert leftover == []
    with pytest.raises(RuntimeError):
        await rt.start()


def test_wildcard_bind_needs_advertise_address(pki: dict[str, TlsFiles]) -> None:
    with pytest.raises(ValueError):
        MeshRuntime(
            MeshRuntimeConfig(name="n1", bind_host="0.0.0.0"),
            Keyring([KEY]),
            server_context(pki["n1"]),
            client_context(pki["n1"]),
        )


async def test_join_on_demand(cluster: Cluster) -> None:
    n1 = await cluster.node("n1")
    n2 = await cluster.node("n2")  # no seeds: alone until told to join
    assert [m.name for m in n2.members()] == ["n2"]
    assert await n2.join([n1.address, n2.address]) == 1
    await eventually(lambda: all_alive([n1, n2], ["n1", "n2"]), what="joined on demand")


def test_from_files_checks_the_certificate_names_this_node(pki: dict[str, TlsFiles]) -> None:
    rt = MeshRuntime.from_files(MeshRuntimeConfig(name="n1", bind_port=0), Keyring([KEY]), pki["n1"])
    assert rt.me.name == "n1"
    with pytest.raises(ValueError, match="is for node 'mallory'"):
        MeshRuntime.from_files(MeshRuntimeConfig(name="n1", bind_port=0), Keyring([KEY]), pki["mallory"])


async def test_addresses_parsed_and_resolved() -> None:
    from shepherd.mesh.runtime_config import parse_addr, resolve_addrs

    assert parse_addr("10.0.0.1:7000", 7946) == ("10.0.0.1", 7000)
    assert parse_addr("node-a", 7946) == ("node-a", 7946)
    assert parse_addr("[::1]:7001", 7946) == ("::1", 7001)
    assert parse_addr("::1", 7946) == ("::1", 7946)
    for bad in ("", "h:0", "h:x", "[::1]:70000"):
        with pytest.raises(ValueError):
            parse_addr(bad, 7946)
    got = await resolve_addrs([("localhost", 7000), ("127.0.0.1", 7001), ("127.0.0.1", 7001)])
    assert ("127.0.0.1", 7001) in got and len(got) == 2 and got.count(("127.0.0.1", 7001)) == 1
    assert all(h in ("127.0.0.1", "::1") for h, _ in got)
    # not resolvable yet: kept by name, the join's TCP connect resolves it again at every retry
    assert await resolve_addrs([("no-such-host.invalid", 1)], timeout=5) == [("no-such-host.invalid", 1)]
