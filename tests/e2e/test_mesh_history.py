"""End to end: history in a mesh of 3 real ``smg-node`` processes, with an embedded backend (SQLite in
each node's ``--data-dir``: each call on another owner's record routed to it over the mesh's mTLS RPC)
and with a shared one (one PostgreSQL): a conversation made on A is read and appended on B and C; a
``previous_response_id`` chain is continued on another node each turn; responses in a conversation
owned by another node; and once an owner has left, the others answer a clear 404 (embedded) or still
serve its records (shared).

Security as in production (a CA, node certificates, a key file); short SWIM intervals. Every wait is a
bounded poll; the tests run in file order on one cluster (the last one stops a node), and every process
is stopped by its pid, also on failure.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shepherd.auth.certs import write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.storage.ids import node_tag, tag_of
from tests.e2e.node_procs import NodeProc, http_status, reserved_port, spawn_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.responses_fixtures import script
from tests.e2e.test_mesh_cluster import mesh_flags, wait_for
from tests.services import postgres_service, service_or_skip

pytestmark = pytest.mark.timeout(180)

MODEL = "qwen3"
NAMES = ("a", "b", "c")


@dataclass
class Cluster:
    nodes: dict[str, NodeProc]
    engine: MockEngineProc
    backend: str  # "sqlite" (embedded: each record on its owner node) or "postgres" (shared)

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def sdk(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(name) + "/v1", api_key="unused", max_retries=0, timeout=30)

    def members(self, name: str) -> dict[str, str]:
        rows = httpx.get(self.url(name) + "/mesh/members", timeout=10).json()["members"]
        return {m["name"]: m["state"] for m in rows}


def spawn(command: str, *args: str, port: int) -> NodeProc:
    return spawn_node(command, *args, port=port, log_prefix="smg-mesh-history-")


@contextlib.contextmanager
def history_flags(backend: str) -> Iterator[list[str]]:
    """The nodes' history flags: SQLite in each one's --data-dir (embedded: routed over the mesh), or one
    private PostgreSQL all of them share (skipped without it, a failure under CI=true)."""
    if backend == "sqlite":
        yield ["--history-backend", "sqlite"]
        return
    with service_or_skip("PostgreSQL", postgres_service) as svc:
        yield ["--history-backend", "postgres", "--history-url", svc.url]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    backend: str = request.param
    pki = tmp_path_factory.mktemp("mesh-history-pki")
    data = tmp_path_factory.mktemp("mesh-history-data")
    files = write_dev_pki(pki, NAMES)
    keyring = pki / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    nodes: dict[str, NodeProc] = {}
    with history_flags(backend) as history, start_mock_engine("--zero-latency") as engine:
        try:
            mesh_ports = {n: reserved_port() for n in NAMES}

            def flags(name: str) -> list[str]:
                return [
                    "--model-id", MODEL, "--tokenizer-workers", "0", "--no-kv-events",
                    "--health-check-interval-secs", "1",
                    "--worker-urls", f"grpc://{engine.grpc_target}",
                    *history, "--data-dir", str(Path(data) / name),
                    *mesh_flags(name, mesh_ports[name], files[name], keyring),
                ]  # fmt: skip

            seed = f"127.0.0.1:{mesh_ports['a']}"
            nodes["b"] = spawn("join", seed, *flags("b"), port=reserved_port())
            nodes["c"] = spawn(
                "join", f"127.0.0.1:{mesh_ports['b']}", seed, *flags("c"), port=reserved_port()
            )
            nodes["a"] = spawn("serve", *flags("a"), port=reserved_port())
            for name, node in nodes.items():
                wait_for(
                    lambda node=node: (
                        node.proc.poll() is not None or http_status(node.url + "/liveness") == 200
                    ),  # type: ignore[misc]
                    f"node {name} up",
                    timeout=90,
                )
                if node.proc.poll() is not None:
                    raise RuntimeError(f"node {name} exited:\n{node.log()}")
            c = Cluster(nodes, engine, backend)
            for name in NAMES:
                wait_for(
                    lambda name=name: c.members(name) == dict.fromkeys(NAMES, "alive"),  # type: ignore[misc]
                    f"{name}: 3 alive",
                )
            yield c
        finally:
            for node in nodes.values():
                node.stop(signal.SIGKILL if node.proc.poll() is None else signal.SIGTERM, timeout=10)


def texts(page: Sequence[Any]) -> list[str]:
    return [str(i.content[0].text) for i in page]


def iid(item: Any) -> str:
    assert isinstance(item.id, str)
    return item.id


def test_conversation_made_on_a_is_read_and_appended_on_b_and_c(cluster: Cluster) -> None:
    conv = cluster.sdk("a").conversations.create(
        items=[{"role": "user", "content": "started on a"}], metadata={"from": "a"}
    )
    assert tag_of(conv.id) == node_tag("a")
    for name in ("b", "c"):
        got = cluster.sdk(name).conversations.retrieve(conv.id)
        assert got.id == conv.id and got.metadata == {"from": "a"}
        added = cluster.sdk(name).conversations.items.create(
            conv.id, items=[{"role": "user", "content": f"appended on {name}"}]
        )
        assert tag_of(iid(added.data[0])) == node_tag("a")  # the owner's records carry the owner's tag
    for name in NAMES:
        every = list(cluster.sdk(name).conversations.items.list(conv.id, order="asc", limit=2))
        assert texts(every) == ["started on a", "appended on b", "appended on c"]
    first = cluster.sdk("a").conversations.items.list(conv.id, order="asc").data[0]
    assert cluster.sdk("c").conversations.items.retrieve(iid(first), conversation_id=conv.id).id == first.id
    upd = cluster.sdk("b").conversations.update(conv.id, metadata={"from": "b"})
    assert upd.metadata == {"from": "b"}
    assert cluster.sdk("c").conversations.retrieve(conv.id).metadata == {"from": "b"}
    assert cluster.sdk("c").conversations.items.delete(iid(first), conversation_id=conv.id).id == conv.id
    assert texts(list(cluster.sdk("a").conversations.items.list(conv.id, order="asc"))) == [
        "appended on b",
        "appended on c",
    ]
    with pytest.raises(openai.NotFoundError):
        cluster.sdk("b").conversations.retrieve("conv_" + node_tag("a") + "0" * 40)
    metrics = httpx.get(cluster.url("b") + "/metrics", timeout=10).text
    assert ('smg_history_rpc_total{kind="sent"}' in metrics) == (cluster.backend == "sqlite")
    assert cluster.sdk("c").conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        cluster.sdk("a").conversations.retrieve(conv.id)


def test_response_chain_continues_on_another_node_each_turn(cluster: Cluster) -> None:
    prev: str | None = None
    ids: list[str] = []
    used: list[int] = []
    for turn, name in enumerate(("a", "b", "c", "a", "c", "b")):
        kw: dict[str, Any] = {} if prev is None else {"previous_response_id": prev}
        r = cluster.sdk(name).responses.create(
            model=MODEL, input=f"turn {turn} on {name}", max_output_tokens=4, **kw
        )
        assert r.status in ("completed", "incomplete") and r.previous_response_id == prev, r
        assert tag_of(r.id) == node_tag(name)  # stored by the node that answered
        assert r.usage is not None
        used.append(r.usage.input_tokens)
        ids.append(r.id)
        prev = r.id
    # every turn was given the whole chain, fetched segment by segment from its owners
    assert all(x < y for x, y in itertools.pairwise(used)), used
    for name in NAMES:
        got = cluster.sdk(name).responses.retrieve(ids[0])
        assert got.id == ids[0]
        # its input items: the whole chain it continued (each turn's question and answer), then its own
        items: list[Any] = list(cluster.sdk(name).responses.input_items.list(ids[-1], order="asc"))
        asked = [t for i, t in zip(items, texts(items), strict=True) if i.role == "user"]
        assert asked == [f"turn {k} on {n}" for k, n in enumerate(("a", "b", "c", "a", "c", "b"))]
        assert [i.role for i in items] == ["user", "assistant"] * 5 + ["user"]


def test_a_reasoning_blob_sealed_on_one_node_opens_on_the_others(cluster: Cluster) -> None:
    """``include: ["reasoning.encrypted_content"]`` with ``store: false`` (Codex CLI, the Agents SDK): the
    blob a node seals under the mesh's keyring opens on every other node, whose prompt then holds the
    reasoning it seals, the item sent back without its text (the Vercel AI SDK, pydantic-ai)."""
    http = httpx.Client(timeout=10)
    thought = f"plan-{uuid.uuid4().hex[:10]}"
    marker = script(cluster.engine, http, f"<think>{thought}</think>It is done.")
    first = cluster.sdk("a").responses.create(
        model=MODEL, input=f"plan {marker}", store=False, include=["reasoning.encrypted_content"]
    )
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and isinstance(reasoning.encrypted_content, str)
    # (qwen3 renders past reasoning after the last question only: the blob's turn, then a continuation)
    blob: Any = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    turn: Any = [
        {"role": "user", "content": "plan"},
        blob,
        {"role": "assistant", "content": "It is done."},
    ]
    for name in ("b", "c"):
        answer = f"seen-on-{name}"
        script(cluster.engine, http, answer, match=f"<think>\n{thought}\n</think>")
        r = cluster.sdk(name).responses.create(model=MODEL, input=turn, store=False, max_output_tokens=8)
        assert r.output_text == answer
    http.close()


def test_responses_in_a_conversation_owned_by_another_node(cluster: Cluster) -> None:
    conv = cluster.sdk("a").conversations.create(items=[{"role": "user", "content": "hello from a"}])
    for name in ("b", "c"):
        r = cluster.sdk(name).responses.create(
            model=MODEL, input=f"asked on {name}", conversation=conv.id, max_output_tokens=4
        )
        assert tag_of(r.id) == node_tag("a")  # stored with its conversation, by the conversation's owner
    every = list(cluster.sdk("b").conversations.items.list(conv.id, order="asc"))
    texts_in = texts([i for i in every if i.type == "message"])
    assert texts_in[0] == "hello from a" and "asked on b" in texts_in and "asked on c" in texts_in
    assert len(every) == 5  # the first message, then per turn its input and the answer


def test_background_response_is_cancelled_from_any_node(cluster: Cluster) -> None:
    """A background response in a's conversation runs on b (its id names a, which stores it); a cancel
    sent to c reaches b's task, and every node then reads "cancelled"."""
    conv = cluster.sdk("a").conversations.create()
    with stalled_engine(cluster):
        r = cluster.sdk("b").responses.create(
            model=MODEL, input="a slow one", conversation=conv.id, background=True
        )
        assert tag_of(r.id) == node_tag("a")
        assert cluster.sdk("c").responses.cancel(r.id).status == "cancelled"
        for name in NAMES:
            assert cluster.sdk(name).responses.retrieve(r.id).status == "cancelled"


def test_a_streamed_background_response_resumes_on_another_node(cluster: Cluster) -> None:
    """Created streaming in the background on b, its first stream left after one delta; c resumes it
    after that event's sequence number while b still generates it (from b's record, as b writes its
    events there), then replays the whole of it once it ended: the same events either way."""
    base = f"http://127.0.0.1:{cluster.engine.http_port}/mock"
    answer = "Resumed on another node, word by word."
    httpx.post(f"{base}/responses", json={"text": answer, "match": "resume-me"}).raise_for_status()
    httpx.post(f"{base}/faults", json={"stall_after_tokens": 2, "stall_seconds": 2.0}).raise_for_status()
    try:
        first: list[Any] = []
        with cluster.sdk("b").responses.create(
            model=MODEL, input="resume-me", background=True, stream=True
        ) as s:
            for ev in s:
                first.append(ev)
                if ev.type == "response.output_text.delta":
                    break
        rid, k = first[0].response.id, first[-1].sequence_number
        rest = list(cluster.sdk("c").responses.retrieve(rid, stream=True, starting_after=k))
    finally:
        httpx.post(
            f"{base}/faults", json={"stall_after_tokens": None, "stall_seconds": 0.0}
        ).raise_for_status()
    assert [e.sequence_number for e in rest] == list(range(k + 1, k + 1 + len(rest)))
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == answer
    text = "".join(e.delta for e in [*first, *rest] if e.type == "response.output_text.delta")
    assert text == answer
    again = list(cluster.sdk("a").responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again[k + 1 :]] == [e.model_dump() for e in rest]


def test_one_turn_at_a_time_on_a_conversation_across_nodes(cluster: Cluster) -> None:
    """A turn in progress on b holds a's conversation (the lease lives with the conversation: on its
    owner, or in the shared store): c's turn meanwhile is OpenAI's conversation_locked; once b's turn
    ends (cancelled here), c's is taken."""
    conv = cluster.sdk("a").conversations.create()
    with stalled_engine(cluster):
        r = cluster.sdk("b").responses.create(
            model=MODEL, input="a slow one", conversation=conv.id, background=True
        )
        with pytest.raises(openai.BadRequestError) as ei:
            cluster.sdk("c").responses.create(model=MODEL, input="meanwhile", conversation=conv.id)
        err: Any = ei.value.body
        assert err["code"] == "conversation_locked", err
        assert cluster.sdk("a").responses.cancel(r.id).status == "cancelled"
    got = cluster.sdk("c").responses.create(
        model=MODEL, input="now", conversation=conv.id, max_output_tokens=4
    )
    assert got.status in ("completed", "incomplete")
    # an agent's loop: the next turn as soon as the last one's end is read, on another node each time
    # (the conversation is free before the client reads that end: no false conversation_locked)
    for i in range(4):
        with cluster.sdk(NAMES[i % 3]).responses.stream(
            model=MODEL, input=f"turn {i}", conversation=conv.id
        ) as st:
            assert st.get_final_response().status == "completed"
        r = cluster.sdk(NAMES[(i + 1) % 3]).responses.create(
            model=MODEL, input=f"then {i}", conversation=conv.id, max_output_tokens=4, background=True
        )
        for _ in range(200):  # bounded: the mock answers at once
            if cluster.sdk("a").responses.retrieve(r.id).status not in ("queued", "in_progress"):
                break
            time.sleep(0.02)


@contextlib.contextmanager
def stalled_engine(cluster: Cluster) -> Iterator[None]:
    """The mock engine stalls 60 s after its first token while inside."""
    faults = f"http://127.0.0.1:{cluster.engine.http_port}/mock/faults"
    httpx.post(faults, json={"stall_after_tokens": 1, "stall_seconds": 60.0}).raise_for_status()
    try:
        yield
    finally:
        httpx.post(faults, json={"stall_after_tokens": None, "stall_seconds": 0.0}).raise_for_status()


def test_owner_gone_is_a_clear_404_unless_the_store_is_shared(cluster: Cluster) -> None:
    """c leaves gracefully (SIGTERM) while a turn of a's conversation streams on it: c stays in the mesh
    while it drains, so the turn ends and is stored on a, and the conversation is free for the next turn
    (c left at once before: its write to a failed and a's lease on the conversation stayed 10 minutes);
    then c's own records are a clear 404 on the others (embedded) or still served (shared)."""
    conv = cluster.sdk("c").conversations.create(metadata={"from": "c"})
    assert cluster.sdk("a").conversations.retrieve(conv.id).metadata == {"from": "c"}
    on_a = cluster.sdk("a").conversations.create()
    events: list[str] = []
    started = threading.Event()

    def turn() -> None:
        stream = cluster.sdk("c").responses.create(
            model=MODEL, input="a turn while c drains", conversation=on_a.id, stream=True
        )
        for ev in stream:  # bounded: the stall, then the answer's end
            events.append(ev.type)
            started.set()

    faults = f"http://127.0.0.1:{cluster.engine.http_port}/mock/faults"
    httpx.post(faults, json={"stall_after_tokens": 1, "stall_seconds": 3.0}).raise_for_status()
    t = threading.Thread(target=turn)
    try:
        t.start()
        assert started.wait(30)
        assert cluster.nodes["c"].stop(timeout=60) == 0  # a graceful leave, the turn drained first
        t.join(60)
    finally:
        httpx.post(faults, json={"stall_after_tokens": None, "stall_seconds": 0.0}).raise_for_status()
    assert events[-1] == "response.completed", events
    stored = list(cluster.sdk("a").conversations.items.list(on_a.id, order="asc"))
    assert [getattr(it, "role", None) for it in stored] == ["user", "assistant"], stored
    assert (
        cluster.sdk("a").responses.create(model=MODEL, input="next", conversation=on_a.id).status
        == "completed"
    )
    wait_for(lambda: cluster.members("a").get("c") in ("left", None), "a sees c gone")
    r = httpx.get(f"{cluster.url('a')}/v1/conversations/{conv.id}", timeout=10)
    if cluster.backend == "postgres":  # the records are in the shared database, not on c
        assert r.status_code == 200 and r.json()["metadata"] == {"from": "c"}, r.text
        return
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "owner_unavailable" and "'c'" in err["message"]


def test_a_background_response_whose_node_died_ends_failed(cluster: Cluster) -> None:
    """A background response in a's conversation runs on b (a stores it); b is killed mid-generation. Once
    the mesh holds b dead, a read on a finds the record's runner gone and stores and answers it as failed,
    rather than in progress forever (a client polls until it ends). (After the test above: c is gone.)"""
    conv = cluster.sdk("a").conversations.create()
    followed: list[str] = []
    with stalled_engine(cluster):
        r = cluster.sdk("b").responses.create(
            model=MODEL, input="a slow one", conversation=conv.id, background=True
        )
        # b's own (its record on b with an embedded store), streamed, followed from a
        own = cluster.sdk("b").responses.create(model=MODEL, input="b's own", background=True, stream=True)
        first: Any = next(iter(own))
        own_id = first.response.id
        own.close()

        def follow() -> None:
            url = f"{cluster.url('a')}/v1/responses/{own_id}?stream=true&starting_after=0"
            with httpx.stream("GET", url, timeout=120) as s:
                followed.append(f"status {s.status_code}")
                for ln in s.iter_lines():
                    if ln.startswith("event: ") or s.status_code != 200:
                        followed.append(ln)
                        following.set()

        following = threading.Event()
        follower = threading.Thread(target=follow)
        follower.start()
        assert following.wait(30), followed
        wait_for(lambda: cluster.sdk("a").responses.retrieve(r.id).status == "in_progress", "running on b")
        cluster.nodes["b"].proc.kill()
        wait_for(
            lambda: cluster.members("a").get("b") in ("dead", "left", None), "a holds b dead", timeout=30
        )
        got = cluster.sdk("a").responses.retrieve(r.id)
        assert got.status == "failed" and got.error is not None and got.error.code == "server_error"
        assert "_runner" not in httpx.get(f"{cluster.url('a')}/v1/responses/{r.id}", timeout=10).json()
        # the follower of b's own response is told it failed, and its stream ends (it waited forever)
        follower.join(90)
        assert not follower.is_alive() and followed[-1:] == ["event: response.failed"], followed


def respawn(node: NodeProc) -> NodeProc:
    """The same node started again (its command line, port and data directory), not waited for."""
    args = [str(a) for a in node.proc.args]  # type: ignore[union-attr]
    cmd, rest = args[1], args[2:]
    cut = rest.index("--host")  # (spawn_node adds --host and --port)
    return spawn(cmd, *rest[:cut], port=node.port)


def test_a_background_response_whose_node_restarted_ends_failed_everywhere(cluster: Cluster) -> None:
    """b runs a background response of its own and is killed, then restarted under its name before or
    after the mesh held it dead: the mesh holds b alive, but the new process does not run it. A read on
    another node asks b whether it runs it, once the record has not been written for two heartbeats, and
    stores and answers it failed (it read in_progress forever through every node but b). (After the test
    above: b is dead, c gone.)"""
    cluster.nodes["b"] = respawn(cluster.nodes["b"])
    wait_for(lambda: cluster.members("a").get("b") == "alive", "b back", timeout=60)
    with stalled_engine(cluster):
        r = cluster.sdk("b").responses.create(model=MODEL, input="a slow one of b's own", background=True)
        wait_for(lambda: cluster.sdk("a").responses.retrieve(r.id).status == "in_progress", "running on b")
        cluster.nodes["b"].proc.kill()
        cluster.nodes["b"].proc.wait(10)
        cluster.nodes["b"] = respawn(cluster.nodes["b"])
        wait_for(lambda: http_status(cluster.url("b") + "/liveness") == 200, "b restarted", timeout=60)
        wait_for(lambda: cluster.members("a").get("b") == "alive", "a holds b alive", timeout=60)
        wait_for(
            lambda: cluster.sdk("a").responses.retrieve(r.id).status == "failed", "failed on a", timeout=60
        )
    got = cluster.sdk("b").responses.retrieve(r.id)
    assert got.status == "failed" and got.error is not None and got.error.code == "server_error"
    with pytest.raises(openai.BadRequestError):  # OpenAI's: an ended response cannot be cancelled
        cluster.sdk("a").responses.cancel(r.id)
